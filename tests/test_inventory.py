"""
Tests for the node facts: L{llmport_agent.inventory.collector}, L{.host} and
L{.capabilities}.
"""

from __future__ import annotations

import json
import os
import platform
from collections import namedtuple
from collections.abc import Callable, Mapping
from typing import Any, cast

from twisted.internet import defer
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, Logger
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmport_agent import VERSION
from llmport_agent.core.threads import PoolService
from llmport_agent.inventory import capabilities as caps_module
from llmport_agent.inventory import host as host_module
from llmport_agent.inventory.capabilities import (
    build_capabilities,
    quick_host_facts,
    static_host_facts,
)
from llmport_agent.inventory.collector import (
    InventoryCollector,
    InventoryReport,
    assert_no_nulls,
    find_nulls,
    scrub_nulls,
)
from llmport_agent.inventory.fakes import h100_node
from llmport_agent.inventory.gpu import GPUSnapshot, NoGPUSource
from llmport_agent.inventory.host import collect_host_facts, measure_disks, nearest_existing
from llmport_agent.inventory.nvml import NVMLGPUSource

REQUIRED_CAPS = {
    "hostname": str,
    "os": str,
    "machine": str,
    "processor": str,
    "docker_available": bool,
    "gpu_count": int,
    "gpu_vendor": str,
    "container_runtime": str,
}
REQUIRED_INVENTORY = {
    "cpu_count_logical": int,
    "cpu_count_physical": int,
    "memory_total_bytes": int,
    "disk_total_bytes": int,
    "network_interfaces": list,
    "gpu_count": int,
    "gpu": dict,
    "static_capabilities": dict,
}
REQUIRED_UTILIZATION = {
    "cpu_percent": float,
    "memory_used_bytes": int,
    "memory_available_bytes": int,
    "memory_percent": float,
    "disk_used_bytes": int,
    "disk_free_bytes": int,
    "disk_percent": float,
    "network": dict,
    "gpu_free_vram_bytes": int,
    "gpu": dict,
}
REQUIRED_NETWORK = {"bytes_sent": int, "bytes_recv": int, "packets_sent": int, "packets_recv": int}
REQUIRED_GPU = {
    "count": int,
    "total_vram_bytes": int,
    "used_vram_bytes": int,
    "free_vram_bytes": int,
    "devices": list,
}


def check_types(
    testcase: SynchronousTestCase, obj: dict[str, Any], spec: Mapping[str, type]
) -> None:
    """Assert every key of C{spec} is in C{obj} with exactly that type (bool is no int)."""
    for key, kind in spec.items():
        testcase.assertIn(key, obj)
        testcase.assertIs(type(obj[key]), kind, f"{key}={obj[key]!r} is not {kind.__name__}")


class SyncRunner:
    """A BlockingRunner that runs at once and records what it ran."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Deferred[Any]:
        self.calls.append(getattr(fn, "__name__", repr(fn)))
        return defer.maybeDeferred(fn, *args, **kwargs)


class ManualRunner:
    """A BlockingRunner that queues calls until the test runs them."""

    def __init__(self) -> None:
        self.queue: list[
            tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], Deferred[Any]]
        ] = []

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        self.queue.append((fn, args, kwargs, d))
        return d

    def names(self) -> list[str]:
        return [getattr(fn, "__name__", repr(fn)) for fn, _, _, _ in self.queue]

    def run_all(self) -> int:
        """Run queued calls (and those they queue) until none is left; return how many."""
        n = 0
        while self.queue:
            fn, args, kwargs, d = self.queue.pop(0)
            defer.maybeDeferred(fn, *args, **kwargs).chainDeferred(d)
            n += 1
        return n


class FailingRunner:
    """A BlockingRunner whose pool is not running."""

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Deferred[Any]:
        return defer.fail(RuntimeError("thread pool 'inventory' is not running"))


# A psutil stand-in recording every call.
_Mem = namedtuple("_Mem", "total available percent used free")
_Swap = namedtuple("_Swap", "total used free percent sin sout")
_Net = namedtuple(
    "_Net", "bytes_sent bytes_recv packets_sent packets_recv errin errout dropin dropout"
)
_Usage = namedtuple("_Usage", "total used free percent")
_Part = namedtuple("_Part", "device mountpoint fstype opts")
_Stat = namedtuple("_Stat", "st_dev")


class FakePsutil:
    """Enough of psutil for L{collect_host_facts}, with recorded calls and knobs."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.usage: dict[str, _Usage] = {}
        self.partitions = [
            _Part("/dev/vda1", "/", "ext4", "rw"),
            _Part("/dev/nvme0n1", "/srv/models", "xfs", "rw"),
        ]
        self.physical: int | None = 32
        self.net: _Net | None = _Net(1000, 2000, 10, 20, 1, 2, 3, 4)
        self.broken: set[str] = set()

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.broken:
            raise OSError(f"{name} is broken")

    def cpu_count(self, logical: bool = True) -> int | None:
        self._call("cpu_count")
        return 64 if logical else self.physical

    def cpu_percent(self, interval: float | None = None) -> float:
        self._call("cpu_percent")
        assert interval is None, "cpu_percent must not block"
        return 12.5

    def virtual_memory(self) -> _Mem:
        self._call("virtual_memory")
        return _Mem(512 * 2**30, 400 * 2**30, 21.9, 100 * 2**30, 300 * 2**30)

    def swap_memory(self) -> _Swap:
        self._call("swap_memory")
        return _Swap(8 * 2**30, 2**30, 7 * 2**30, 12.5, 0, 0)

    def net_if_addrs(self) -> dict[str, list[Any]]:
        self._call("net_if_addrs")
        return {"lo": [], "eth0": [], "ib0": []}

    def net_io_counters(self, pernic: bool = False) -> _Net | None:
        self._call("net_io_counters")
        return self.net

    def boot_time(self) -> float:
        self._call("boot_time")
        return 1.7e9

    def disk_partitions(self, all: bool = False) -> list[_Part]:
        self._call("disk_partitions")
        return self.partitions

    def disk_usage(self, path: str) -> _Usage:
        self.calls.append("disk_usage")
        if "disk_usage" in self.broken:
            raise PermissionError(13, "Permission denied", path)
        return self.usage.get(path, _Usage(100, 40, 60, 40.0))


class FakeFS:
    """A stat() over a made-up tree: path -> device id; missing paths raise."""

    def __init__(self, tree: dict[str, int]) -> None:
        self.tree = tree

    def stat(self, path: str) -> _Stat:
        if path not in self.tree:
            raise FileNotFoundError(2, "No such file or directory", path)
        return _Stat(self.tree[path])

    @staticmethod
    def realpath(path: str) -> str:
        return os.path.normpath(path)


TREE = {
    "/": 1,
    "/var": 1,
    "/var/lib": 1,
    "/var/lib/llmport": 1,
    "/srv": 1,
    "/srv/models": 2,
    "/srv/models/hub": 2,
}


# --------------------------------------------------------------------------- host


class DiskTests(SynchronousTestCase):
    """Disk figures: dedup by device, nearest existing parent, primary disk choice."""

    def setUp(self) -> None:
        self.ps = FakePsutil()
        self.fs = FakeFS(TREE)

    def facts(self, state_dir: str, model_store: str | None) -> host_module.HostFacts:
        return collect_host_facts(
            state_dir,
            model_store,
            ps=self.ps,
            stat=self.fs.stat,
            realpath=self.fs.realpath,
            loadavg=lambda: (1.0, 0.5, 0.25),
        )

    def test_dedup_by_device(self) -> None:
        """/ and the state dir share one entry; the model store's device gets its own."""
        self.ps.usage = {
            "/var/lib/llmport": _Usage(1000, 300, 700, 30.0),
            "/srv/models/hub": _Usage(8000, 2000, 6000, 25.0),
        }
        facts = self.facts("/var/lib/llmport", "/srv/models/hub")
        self.assertEqual(len(facts.disks), 2)
        root, models = facts.disks
        self.assertEqual(root.mountpoint, "/")
        self.assertEqual(root.roles, ("root", "state_dir"))
        self.assertEqual(root.paths, ("/", "/var/lib/llmport"))
        self.assertEqual((root.device, root.fstype), ("/dev/vda1", "ext4"))
        self.assertEqual(models.mountpoint, "/srv/models")
        self.assertEqual(models.roles, ("model_store",))
        self.assertEqual((models.device, models.fstype), ("/dev/nvme0n1", "xfs"))
        self.assertEqual(models.total_bytes, 8000)
        self.assertIs(facts.primary_disk, models)
        self.assertEqual(facts.errors, ())

    def test_primary_is_root_without_model_store(self) -> None:
        """Without a model store the top-level disk is that of /."""
        facts = self.facts("/var/lib/llmport", None)
        self.assertEqual(len(facts.disks), 1)
        self.assertEqual(facts.primary_disk.mountpoint, "/")
        self.assertIn("root", facts.primary_disk.roles)

    def test_missing_path_measured_at_nearest_parent(self) -> None:
        """A model store not created yet is measured at its nearest existing parent."""
        self.assertEqual(nearest_existing("/srv/models/not/yet", self.fs.stat), "/srv/models")
        self.ps.usage = {"/srv/models": _Usage(5, 1, 4, 20.0)}
        facts = self.facts("/var/lib/llmport/new", "/srv/models/not/yet")
        self.assertEqual(facts.primary_disk.mountpoint, "/srv/models")
        self.assertEqual(facts.primary_disk.paths, ("/srv/models/not/yet",))
        self.assertEqual(facts.primary_disk.total_bytes, 5)

    def test_same_device_everywhere(self) -> None:
        """Everything on one file system gives one entry with every role."""
        disks = measure_disks(
            [("root", "/"), ("state_dir", "/var/lib/llmport"), ("model_store", "/srv")],
            ps=self.ps,
            stat=self.fs.stat,
            realpath=self.fs.realpath,
        )
        self.assertEqual(len(disks), 1)
        self.assertEqual(disks[0].roles, ("root", "state_dir", "model_store"))

    def test_unreadable_disk(self) -> None:
        """A disk that refuses statvfs reads zeros with an error; nothing raises."""
        self.ps.broken.add("disk_usage")
        facts = self.facts("/var/lib/llmport", "/srv/models")
        self.assertEqual(facts.primary_disk.total_bytes, 0)
        self.assertIn("Permission denied", facts.primary_disk.error)
        self.assertTrue(any(e.startswith("disk /srv/models") for e in facts.errors))

    def test_real_filesystem(self) -> None:
        """On the real file system, two directories in one temp dir share one entry."""
        base = self.mktemp()
        os.makedirs(os.path.join(base, "state"))
        state = os.path.join(base, "state")
        models = os.path.join(base, "models", "not-yet")
        facts = collect_host_facts(state, models)
        (entry,) = [d for d in facts.disks if "state_dir" in d.roles]
        self.assertIn("model_store", entry.roles)
        self.assertIs(facts.primary_disk, entry)
        self.assertGreater(entry.total_bytes, 0)
        self.assertEqual(len({d.mountpoint for d in facts.disks}), len(facts.disks))


class HostFactsTests(SynchronousTestCase):
    """CPU, memory and network readings."""

    def setUp(self) -> None:
        self.ps = FakePsutil()
        self.fs = FakeFS(TREE)

    def facts(self) -> host_module.HostFacts:
        return collect_host_facts(
            "/var/lib/llmport",
            None,
            ps=self.ps,
            stat=self.fs.stat,
            realpath=self.fs.realpath,
            loadavg=lambda: (1.0, 0.5, 0.25),
        )

    def test_figures(self) -> None:
        """psutil figures land in the right fields; cpu_percent is non-blocking."""
        f = self.facts()
        self.assertEqual((f.cpu_count_logical, f.cpu_count_physical), (64, 32))
        self.assertEqual(f.cpu_percent, 12.5)
        self.assertEqual(f.memory_total_bytes, 512 * 2**30)
        self.assertEqual(f.memory_available_bytes, 400 * 2**30)
        self.assertEqual(f.memory_used_bytes, 100 * 2**30)
        self.assertEqual(f.memory_percent, 21.9)
        self.assertEqual(f.network_interfaces, ("eth0", "ib0", "lo"))
        self.assertEqual(
            (f.bytes_sent, f.bytes_recv, f.packets_sent, f.packets_recv), (1000, 2000, 10, 20)
        )
        self.assertEqual((f.network_errors, f.network_drops), (3, 7))
        self.assertEqual(f.load_average, (1.0, 0.5, 0.25))

    def test_unknown_values_are_zero(self) -> None:
        """psutil's None (unknown physical cores, no NICs) becomes 0."""
        self.ps.physical = None
        self.ps.net = None
        f = self.facts()
        self.assertEqual(f.cpu_count_physical, 0)
        self.assertEqual(f.bytes_sent, 0)
        self.assertEqual(f.errors, ())

    def test_failing_section(self) -> None:
        """A failing psutil call zeroes its section and is named in errors."""
        self.ps.broken.add("virtual_memory")
        f = self.facts()
        self.assertEqual(f.memory_total_bytes, 0)
        self.assertEqual(f.cpu_count_logical, 64)
        self.assertEqual(f.errors, ("memory: OSError: virtual_memory is broken",))

    def test_real_psutil(self) -> None:
        """The real psutil readings have sane values."""
        f = collect_host_facts(self.mktemp(), None)
        self.assertGreater(f.cpu_count_logical, 0)
        self.assertGreater(f.memory_total_bytes, 0)
        self.assertIn("lo", f.network_interfaces)
        self.assertGreater(f.primary_disk.total_bytes, 0)


# ------------------------------------------------------------------- capabilities


class CapabilitiesTests(SynchronousTestCase):
    """Static capabilities (protocol 5.1)."""

    def test_processor_falls_back_to_machine(self) -> None:
        """An empty or "unknown" platform.processor() is replaced by the machine type."""
        for answer in ("", "unknown", "Unknown"):
            self.patch(caps_module.platform, "processor", lambda answer=answer: answer)
            facts = static_host_facts(system="darwin")
            self.assertEqual(facts["processor"], platform.machine())
            self.assertNotEqual(facts["processor"], "")

    def test_processor_kept_when_known(self) -> None:
        """Off Linux, a known platform.processor() is reported as is."""
        self.patch(caps_module.platform, "processor", lambda: "Intel(R) Xeon(R)")
        self.assertEqual(static_host_facts(system="darwin")["processor"], "Intel(R) Xeon(R)")

    def test_no_uname_process_on_linux(self) -> None:
        """
        On Linux the processor is the machine type: platform.processor() (which starts
        C{uname -p}) is not called.
        """
        def processor() -> str:
            raise AssertionError("platform.processor() called on Linux")

        self.patch(caps_module.platform, "processor", processor)
        for system in ("linux", "linux2"):
            facts = static_host_facts(system=system)
            self.assertEqual(facts["processor"], platform.machine() or "unknown")
        # The default is this process's platform (the tests run on Linux).
        self.assertEqual(static_host_facts()["processor"], platform.machine())

    def test_shape(self) -> None:
        """Every 5.1 key with its type, plus extras, from host, GPU and engine facts."""
        snap = NVMLGPUSource(h100_node()).snapshot()
        caps = build_capabilities(
            static_host_facts(),
            snap,
            {"docker_available": True, "container_runtime": "docker", "docker_version": "20.10"},
        )
        check_types(self, caps, REQUIRED_CAPS)
        self.assertEqual(caps["gpu_count"], 8)
        self.assertEqual(caps["gpu_vendor"], "nvidia")
        self.assertEqual(caps["gpu_models"], ["NVIDIA H100 80GB HBM3"])
        self.assertEqual(caps["docker_version"], "20.10")
        self.assertEqual(caps["agent_version"], VERSION)
        self.assertEqual(caps["gpu_driver_version"], "550.54.15")
        assert_no_nulls(caps)

    def test_engine_facts_are_sanitised(self) -> None:
        """Engine facts: None values dropped, types coerced, GPU keys not overridden."""
        caps = build_capabilities(
            quick_host_facts(),
            GPUSnapshot(),
            {
                "docker_available": 1,
                "container_runtime": None,
                "docker_version": None,
                "gpu_count": 99,
            },
        )
        self.assertIs(caps["docker_available"], True)
        self.assertEqual(caps["container_runtime"], "none")
        self.assertNotIn("docker_version", caps)
        self.assertEqual(caps["gpu_count"], 0)
        self.assertEqual(caps["gpu_vendor"], "none")

    def test_unknown_vendor_is_none(self) -> None:
        """A vendor outside nvidia|amd|apple|none is reported as none."""
        caps = build_capabilities(quick_host_facts(), GPUSnapshot(vendor="matrox"), None)
        self.assertEqual(caps["gpu_vendor"], "none")
        self.assertIs(caps["docker_available"], False)


# ---------------------------------------------------------------------- collector


class CollectorTests(SynchronousTestCase):
    """The inventory and utilisation objects (protocol 5.2)."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1_700_000_000)
        self.runner = SyncRunner()
        self.fake = h100_node()
        self.engine = {"docker_available": True, "container_runtime": "docker"}
        self.state_dir = self.mktemp()
        os.makedirs(self.state_dir)
        self.collector = InventoryCollector(
            self.clock,
            self.runner,
            NVMLGPUSource(self.fake),
            state_dir=self.state_dir,
            model_store=os.path.join(self.state_dir, "models"),
            engine_facts=lambda: self.engine,
        )

    def test_unhealthy_gpu_left_out_of_the_utilisation_sums(self) -> None:
        """
        A GPU unhealthy by its ECC counters still reports memory: the utilisation's
        gpu_free_vram_bytes and gpu_used_vram_bytes leave it out, as the snapshot does (a
        planted bug summing every device survived: the only test used a lost GPU reading 0).
        """
        import pynvml

        source = NVMLGPUSource(self.fake)
        collector = InventoryCollector(self.clock, self.runner, source, state_dir=self.state_dir,
                                       model_store=os.path.join(self.state_dir, "models"),
                                       engine_facts=lambda: self.engine)
        self.successResultOf(Deferred.fromCoroutine(collector.collect()))
        g5 = self.fake.gpus[5]
        g5.ecc_counts[(pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)] = 2
        g5.ecc_counts[(pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC)] = 2
        g5.memory_used = 9 * 1024**3
        source.check_health()
        util = self.successResultOf(Deferred.fromCoroutine(collector.collect())).utilization
        devices = util["gpu"]["devices"]
        self.assertEqual(devices[5]["health"], "unhealthy")
        self.assertGreater(devices[5]["memory_free_bytes"], 0)
        others = [d for d in devices if d["index"] != 5]
        self.assertEqual(util["gpu_free_vram_bytes"], sum(d["memory_free_bytes"] for d in others))
        self.assertEqual(util["gpu_used_vram_bytes"], sum(d["memory_used_bytes"] for d in others))

    def test_inventory_shape(self) -> None:
        """Every 5.2 field is present with its type; GPU snapshot and caps included."""
        report = self.successResultOf(Deferred.fromCoroutine(self.collector.collect()))
        self.assertIsInstance(report, InventoryReport)
        inv, util = report.inventory, report.utilization
        check_types(self, inv, REQUIRED_INVENTORY)
        check_types(self, util, REQUIRED_UTILIZATION)
        check_types(self, util["network"], REQUIRED_NETWORK)
        check_types(self, inv["gpu"], REQUIRED_GPU)
        check_types(self, util["gpu"], REQUIRED_GPU)
        check_types(self, inv["static_capabilities"], REQUIRED_CAPS)
        self.assertEqual(inv["gpu_count"], 8)
        self.assertEqual(inv["gpu"]["count"], 8)
        self.assertEqual(util["gpu_free_vram_bytes"], util["gpu"]["free_vram_bytes"])
        self.assertEqual(inv["static_capabilities"]["gpu_vendor"], "nvidia")
        self.assertIs(inv["static_capabilities"]["docker_available"], True)
        self.assertEqual(inv["collected_at"], "2023-11-14T22:13:20Z")
        self.assertGreater(inv["disk_total_bytes"], 0)
        (primary,) = [d for d in inv["disks"] if "model_store" in d["roles"]]
        self.assertEqual(inv["disk_total_bytes"], primary["total_bytes"])
        self.assertEqual(inv["disk_mountpoint"], primary["mountpoint"])
        self.assertIsNot(inv["gpu"], util["gpu"])

    def test_no_nulls_anywhere(self) -> None:
        """The whole frame payload has no null or NaN and is strict JSON."""
        report = self.successResultOf(Deferred.fromCoroutine(self.collector.collect()))
        frame = {
            "type": "inventory",
            "inventory": report.inventory,
            "utilization": report.utilization,
        }
        assert_no_nulls(frame)
        json.loads(json.dumps(frame, allow_nan=False))

    def test_blocking_calls_go_through_runner(self) -> None:
        """psutil, platform and NVML are only touched inside runner calls."""
        ps = FakePsutil()
        self.patch(host_module, "psutil", ps)
        runner = ManualRunner()
        collector = InventoryCollector(
            self.clock,
            runner,
            NVMLGPUSource(self.fake),
            state_dir=self.state_dir,
            model_store=None,
        )
        d = Deferred.fromCoroutine(collector.collect())
        self.assertNoResult(d)
        self.assertEqual(runner.names(), ["static_host_facts"])
        self.assertEqual(ps.calls, [])
        self.assertEqual(self.fake.calls, [])
        self.assertEqual(runner.run_all(), 3)
        report = self.successResultOf(d)
        self.assertNotEqual(ps.calls, [])
        self.assertNotEqual(self.fake.calls, [])
        self.assertEqual(report.inventory["cpu_count_logical"], 64)
        self.assertEqual(report.inventory["network_interfaces"], ["eth0", "ib0", "lo"])

    def test_runner_sees_each_blocking_function(self) -> None:
        """collect() runs static facts (once), host facts and the GPU snapshot via the runner."""
        self.successResultOf(Deferred.fromCoroutine(self.collector.collect()))
        self.successResultOf(Deferred.fromCoroutine(self.collector.collect()))
        self.assertEqual(
            self.runner.calls,
            [
                "static_host_facts",
                "snapshot",
                "collect_host_facts",
                "snapshot",
                "collect_host_facts",
            ],
        )

    def test_concurrent_collects_share_one_reading(self) -> None:
        """A collect() during a running one shares its result; a cancelled waiter is skipped."""
        runner = ManualRunner()
        collector = InventoryCollector(
            self.clock, runner, NoGPUSource(), state_dir=self.state_dir, model_store=None
        )
        d1 = Deferred.fromCoroutine(collector.collect())
        d2 = Deferred.fromCoroutine(collector.collect())
        d3 = Deferred.fromCoroutine(collector.collect())
        d3.cancel()
        self.failureResultOf(d3, CancelledError)
        self.assertEqual(runner.run_all(), 3)
        r1, r2 = self.successResultOf(d1), self.successResultOf(d2)
        self.assertIs(r1, r2)
        self.assertIs(collector.last_report, r1)
        d4 = Deferred.fromCoroutine(collector.collect())
        self.assertEqual(runner.run_all(), 2)  # static facts are cached now
        self.assertIsNot(self.successResultOf(d4), r1)

    def test_nvml_absent(self) -> None:
        """Without NVML the inventory still has a gpu object (count 0) and no nulls."""

        def importer() -> Any:
            raise ImportError("no pynvml")

        self.patch(NVMLGPUSource, "log", Logger(observer=cast(ILogObserver, lambda e: None)))
        collector = InventoryCollector(
            self.clock,
            self.runner,
            NVMLGPUSource(importer=importer),
            state_dir=self.state_dir,
            model_store=None,
        )
        report = self.successResultOf(Deferred.fromCoroutine(collector.collect()))
        inv, util = report.inventory, report.utilization
        check_types(self, inv["gpu"], REQUIRED_GPU)
        self.assertEqual(inv["gpu_count"], 0)
        self.assertEqual(inv["gpu"]["devices"], [])
        self.assertIn("pynvml", inv["gpu"]["gpu_error"])
        self.assertEqual(util["gpu_free_vram_bytes"], 0)
        self.assertEqual(inv["static_capabilities"]["gpu_vendor"], "none")
        self.assertEqual(inv["static_capabilities"]["gpu_count"], 0)
        assert_no_nulls({"inventory": inv, "utilization": util})

    def test_nvml_init_failing(self) -> None:
        """With nvmlInit failing, reports stay valid and init is not retried every time."""
        events: list[dict[str, Any]] = []
        self.patch(NVMLGPUSource, "log", Logger(observer=cast(ILogObserver, events.append)))
        self.fake.init_error = 9  # NVML_ERROR_DRIVER_NOT_LOADED
        for _ in range(3):
            report = self.successResultOf(Deferred.fromCoroutine(self.collector.collect()))
            assert_no_nulls(report.inventory)
        self.assertEqual(
            report.inventory["gpu"]["gpu_error"], "NVML initialisation failed: Driver Not Loaded"
        )
        self.assertEqual(self.fake.init_count, 1)
        self.assertEqual(len(events), 1)

    def test_gpu_snapshot_failure_degrades(self) -> None:
        """A failing GPU snapshot call gives an empty gpu object and is logged once."""

        class Broken(NoGPUSource):
            def snapshot(self) -> GPUSnapshot:
                raise RuntimeError("worker died")

        collector = InventoryCollector(
            self.clock, self.runner, Broken(), state_dir=self.state_dir, model_store=None
        )
        for _ in range(2):
            report = self.successResultOf(Deferred.fromCoroutine(collector.collect()))
        self.assertEqual(report.inventory["gpu"]["count"], 0)
        self.assertIn("worker died", report.inventory["gpu"]["gpu_error"])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_runner_failure_fails_collect(self) -> None:
        """When the runner cannot run anything, collect() fails (the caller logs)."""
        collector = InventoryCollector(
            self.clock, FailingRunner(), NoGPUSource(), state_dir=self.state_dir, model_store=None
        )
        self.failureResultOf(Deferred.fromCoroutine(collector.collect()), RuntimeError)
        self.flushLoggedErrors(RuntimeError)

    def test_capabilities_cached_host_part(self) -> None:
        """capabilities() computes host facts once and refreshes the GPU part each time."""
        caps = self.successResultOf(Deferred.fromCoroutine(self.collector.capabilities()))
        check_types(self, caps, REQUIRED_CAPS)
        self.assertEqual(caps["gpu_count"], 8)
        del self.fake.gpus[7]
        caps = self.successResultOf(Deferred.fromCoroutine(self.collector.capabilities()))
        self.assertEqual(caps["gpu_count"], 7)
        self.assertEqual(self.runner.calls, ["static_host_facts", "snapshot", "snapshot"])

    def test_last_capabilities(self) -> None:
        """last_capabilities() is valid before any reading, then follows the last one."""
        self.patch(caps_module.platform, "processor", lambda: "")
        caps = self.collector.last_capabilities()
        check_types(self, caps, REQUIRED_CAPS)
        self.assertEqual(caps["gpu_count"], 0)
        self.assertEqual(caps["gpu_vendor"], "none")
        self.assertNotEqual(caps["processor"], "")
        self.assertEqual(self.runner.calls, [])
        self.successResultOf(Deferred.fromCoroutine(self.collector.collect()))
        caps = self.collector.last_capabilities()
        self.assertEqual(caps["gpu_count"], 8)
        self.assertEqual(caps["gpu_vendor"], "nvidia")
        self.engine = {"docker_available": False, "container_runtime": "docker"}
        self.assertIs(self.collector.last_capabilities()["docker_available"], False)
        assert_no_nulls(caps)

    def test_engine_facts_failure(self) -> None:
        """A raising engine_facts gives docker_available False, logged once per outage."""

        def boom() -> dict[str, Any]:
            raise ValueError("engine gone")

        collector = InventoryCollector(
            self.clock,
            self.runner,
            NoGPUSource(),
            state_dir=self.state_dir,
            model_store=None,
            engine_facts=boom,
        )
        for _ in range(3):
            caps = collector.last_capabilities()
        self.assertIs(caps["docker_available"], False)
        self.assertEqual(caps["container_runtime"], "none")
        self.assertEqual(len(self.flushLoggedErrors(ValueError)), 1)

    def test_close_shuts_down_through_runner(self) -> None:
        """close() runs the GPU source's close (nvmlShutdown) through the runner."""
        self.successResultOf(Deferred.fromCoroutine(self.collector.collect()))
        self.runner.calls.clear()
        self.assertIsNone(self.successResultOf(self.collector.close()))
        self.assertEqual(self.runner.calls, ["close"])
        self.assertEqual(self.fake.shutdown_count, 1)

    def test_close_never_fails(self) -> None:
        """close() through a failing runner logs and fires with None."""
        collector = InventoryCollector(
            self.clock, FailingRunner(), NoGPUSource(), state_dir=self.state_dir, model_store=None
        )
        self.assertIsNone(self.successResultOf(collector.close()))
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)


class NullHelpersTests(SynchronousTestCase):
    """find_nulls / assert_no_nulls / scrub_nulls."""

    def test_find_nulls_paths(self) -> None:
        """Every None and non-finite number is found with its path."""
        obj = {"a": None, "b": [1, None, {"c": float("nan")}], "d": (float("inf"),), "e": 0}
        self.assertEqual(find_nulls(obj), ["$.a", "$.b[1]", "$.b[2].c", "$.d[0]"])
        self.assertEqual(find_nulls({"ok": [0, "", [], {}]}), [])

    def test_assert_no_nulls(self) -> None:
        """assert_no_nulls raises with the paths, passes on clean data."""
        exc = self.assertRaises(AssertionError, assert_no_nulls, {"gpu": {"name": None}})
        self.assertIn("$.gpu.name", str(exc))
        assert_no_nulls({"gpu": {"name": ""}})

    def test_scrub(self) -> None:
        """scrub_nulls drops None entries, zeroes NaN, lists tuples, stringifies keys."""
        self.assertEqual(
            scrub_nulls({"a": None, 1: (2, None), "n": float("nan"), "x": {"y": None}}),
            {"1": [2], "n": 0.0, "x": {}},
        )


class ThreadedCollectorTests(TestCase):
    """With a real thread pool on the real reactor, NVML is only called in pool threads."""

    timeout = 30

    def test_nvml_runs_in_pool_threads(self) -> Deferred[None]:
        """
        Every NVML call (init, snapshot, shutdown) happens on NVML's own watchdog threads:
        never on the reactor thread, never on the host pool it would share with psutil.
        """
        from twisted.internet import reactor

        pool = PoolService(reactor, "inventory-test", 2)
        pool.startService()
        self.addCleanup(pool.stopService)
        fake = h100_node()
        state_dir = self.mktemp()
        os.makedirs(state_dir)
        collector = InventoryCollector(
            reactor, pool, NVMLGPUSource(fake), state_dir=state_dir, model_store=None
        )

        async def scenario() -> None:
            report = await collector.collect()
            self.assertEqual(report.inventory["gpu_count"], 8)
            assert_no_nulls(report.inventory)
            await collector.close()
            threads = {thread for _, _, thread in fake.calls}
            self.assertEqual(fake.shutdown_count, 1)
            self.assertTrue(threads)
            self.assertTrue(all(t.startswith("nvml-") for t in threads), threads)

        return Deferred.fromCoroutine(scenario())
