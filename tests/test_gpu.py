"""
Tests for L{llmport_agent.inventory.gpu} (NVML GPU snapshots) and the fake C{pynvml} in
L{llmport_agent.inventory.fakes}.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Mapping
from typing import Any, cast

import pynvml
from twisted.logger import ILogObserver, Logger
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from llmport_agent.inventory import gpu as gpu_module
from llmport_agent.inventory.collector import assert_no_nulls
from llmport_agent.inventory.fakes import (
    FAKE_FUNCTIONS,
    FakeGPU,
    FakeHandle,
    FakeNVML,
    FakeProcess,
    h100_node,
)
from llmport_agent.inventory.gpu import (
    GPUSnapshot,
    IGPUSource,
    NoGPUSource,
)
from llmport_agent.inventory.nvml import NVMLGPUSource

GIB = 1024**3
MIB = 1024**2

REQUIRED_SNAPSHOT = {
    "count": int,
    "total_vram_bytes": int,
    "used_vram_bytes": int,
    "free_vram_bytes": int,
    "devices": list,
}
REQUIRED_DEVICE = {
    "index": int,
    "vendor": str,
    "name": str,
    "memory_total_mib": int,
    "memory_used_mib": int,
    "utilization_pct": int,
    "temperature_c": int,
    "driver_version": str,
}


class FakeClock:
    """A settable monotonic clock for the backoff."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def check_types(
    testcase: SynchronousTestCase, obj: dict[str, Any], spec: Mapping[str, type]
) -> None:
    """Assert every key of C{spec} is in C{obj} with exactly that type (bool is no int)."""
    for key, kind in spec.items():
        testcase.assertIn(key, obj)
        value = obj[key]
        testcase.assertIs(type(value), kind, f"{key}={value!r} is not {kind.__name__}")


class LogCapture:
    """Replace the class logger of L{NVMLGPUSource} with one that records events."""

    def __init__(self, testcase: SynchronousTestCase) -> None:
        self.events: list[dict[str, Any]] = []
        testcase.patch(
            NVMLGPUSource, "log", Logger(observer=cast(ILogObserver, self.events.append))
        )

    def formats(self) -> list[str]:
        return [e["log_format"] for e in self.events]


# ----------------------------------------------------------------------- the fake


class FakeNVMLFaithfulnessTests(SynchronousTestCase):
    """The fake offers the real C{pynvml} API: names, parameters, errors, shapes."""

    def test_functions_exist_in_real_bindings_with_same_parameters(self) -> None:
        """Every function the fake implements exists in pynvml with the same parameters."""
        self.assertGreater(len(FAKE_FUNCTIONS), 25)
        for name in FAKE_FUNCTIONS:
            real = getattr(pynvml, name, None)
            assert real is not None, f"pynvml has no {name}"
            real_params = list(inspect.signature(real).parameters)
            fake_params = list(inspect.signature(getattr(FakeNVML(), name)).parameters)
            self.assertEqual(fake_params, real_params, name)

    def test_errors_and_constants_are_the_real_ones(self) -> None:
        """Error classes and NVML_* constants are pynvml's own objects."""
        fake = FakeNVML()
        self.assertIs(fake.NVMLError, pynvml.NVMLError)  # type: ignore[attr-defined]
        self.assertIs(
            fake.NVMLError_NotSupported,  # type: ignore[attr-defined]
            pynvml.NVMLError_NotSupported,
        )
        self.assertEqual(fake.NVML_ERROR_GPU_IS_LOST, 15)  # type: ignore[attr-defined]
        self.assertEqual(fake.NVML_TEMPERATURE_GPU, pynvml.NVML_TEMPERATURE_GPU)  # type: ignore[attr-defined]

    def test_calls_before_init_raise_uninitialized_like_real(self) -> None:
        """Before nvmlInit the fake, like the real bindings here, raises Uninitialized."""
        self.assertRaises(pynvml.NVMLError_Uninitialized, pynvml.nvmlDeviceGetCount)
        self.assertRaises(pynvml.NVMLError_Uninitialized, FakeNVML().nvmlDeviceGetCount)
        self.assertRaises(pynvml.NVMLError_Uninitialized, FakeNVML().nvmlShutdown)

    def test_init_error_raises_matching_subclass(self) -> None:
        """init_error makes nvmlInit raise the NVMLError subclass of that code."""
        fake = FakeNVML(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        exc = self.assertRaises(pynvml.NVMLError_LibraryNotFound, fake.nvmlInit)
        self.assertEqual(exc.value, pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        self.assertEqual(str(exc), "NVML Shared Library Not Found")
        self.assertEqual(fake.refcount, 0)

    def test_return_shapes(self) -> None:
        """Figures come back as the real ctypes structures and list/str shapes."""
        fake = h100_node()
        fake.nvmlInit()
        h = fake.nvmlDeviceGetHandleByIndex(6)
        mem = fake.nvmlDeviceGetMemoryInfo(h)
        self.assertIsInstance(mem, pynvml.c_nvmlMemory_t)
        self.assertEqual(mem.total, mem.free + mem.used)
        mem2 = fake.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        self.assertIsInstance(mem2, pynvml.c_nvmlMemory_v2_t)
        pci = fake.nvmlDeviceGetPciInfo(h)
        self.assertIsInstance(pci, pynvml.nvmlPciInfo_t)
        self.assertEqual(pci.busId, "00000000:BA:00.0")  # the real struct decodes
        self.assertIsInstance(fake.nvmlDeviceGetName(h), str)
        self.assertEqual(fake.nvmlDeviceGetMigMode(h), [1, 1])
        self.assertIsInstance(fake.nvmlDeviceIsMigDeviceHandle(h), pynvml.c_uint)
        self.assertEqual(fake.nvmlDeviceGetMaxMigDeviceCount(h), 7)
        mig = fake.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
        self.assertEqual(fake.nvmlDeviceGetGpuInstanceId(mig), 1)
        self.assertRaises(pynvml.NVMLError_NotFound, fake.nvmlDeviceGetMigDeviceHandleByIndex, h, 5)
        self.assertRaises(
            pynvml.NVMLError_InvalidArgument, fake.nvmlDeviceGetMigDeviceHandleByIndex, h, 7
        )
        self.assertRaises(pynvml.NVMLError_NotSupported, fake.nvmlDeviceGetUtilizationRates, h)
        procs = fake.nvmlDeviceGetComputeRunningProcesses(h)
        self.assertIsInstance(procs[0], pynvml.nvmlFriendlyObject)
        self.assertEqual(
            sorted(vars(procs[0])), ["computeInstanceId", "gpuInstanceId", "pid", "usedGpuMemory"]
        )
        self.assertEqual(fake.nvmlSystemGetCudaDriverVersion(), 12040)

    def test_unavailable_process_memory_reads_none(self) -> None:
        """A process whose memory NVML cannot tell reads usedGpuMemory=None, like pynvml."""
        fake = FakeNVML(
            [
                FakeGPU(
                    name="g",
                    uuid="GPU-1",
                    pci_bus_id="00000000:01:00.0",
                    memory_total=GIB,
                    compute_processes=[FakeProcess(pid=7, used_gpu_memory=None)],
                )
            ]
        )
        fake.nvmlInit()
        (proc,) = fake.nvmlDeviceGetComputeRunningProcesses(fake.nvmlDeviceGetHandleByIndex(0))
        self.assertIsNone(proc.usedGpuMemory)

    def test_fail_knob_targets_one_device(self) -> None:
        """fail(function, code, device) raises only for that device's handles."""
        fake = h100_node()
        fake.nvmlInit()
        fake.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_UNKNOWN, device=2)
        self.assertRaises(
            pynvml.NVMLError_Unknown,
            fake.nvmlDeviceGetPowerUsage,
            fake.nvmlDeviceGetHandleByIndex(2),
        )
        fake.nvmlDeviceGetPowerUsage(fake.nvmlDeviceGetHandleByIndex(1))
        self.assertRaises(AttributeError, fake.fail, "nvmlNoSuchThing", 3)

    def test_lost_gpu_and_refcount(self) -> None:
        """A lost GPU answers GPUIsLost; init/shutdown keep a reference count."""
        fake = h100_node()
        fake.gpus[1].lost = True
        fake.nvmlInit()
        fake.nvmlInit()
        self.assertRaises(pynvml.NVMLError_GpuIsLost, fake.nvmlDeviceGetHandleByIndex, 1)
        self.assertRaises(pynvml.NVMLError_GpuIsLost, fake.nvmlDeviceGetName, FakeHandle(1))
        fake.nvmlShutdown()
        self.assertEqual(fake.nvmlDeviceGetCount(), 8)
        fake.nvmlShutdown()
        self.assertRaises(pynvml.NVMLError_Uninitialized, fake.nvmlDeviceGetCount)


# ------------------------------------------------------------------ NVMLGPUSource


class NVMLSnapshotTests(SynchronousTestCase):
    """Snapshots of the fake 8-GPU MIG node."""

    def setUp(self) -> None:
        self.logs = LogCapture(self)
        self.fake = h100_node()
        self.source = NVMLGPUSource(self.fake, clock=FakeClock())

    def test_provides_interface(self) -> None:
        """Both sources provide IGPUSource."""
        self.assertTrue(verifyObject(IGPUSource, self.source))
        self.assertTrue(verifyObject(IGPUSource, NoGPUSource()))

    def test_protocol_shape_and_types(self) -> None:
        """Every field of protocol 5.2 is present with the right type; no null anywhere."""
        snap = self.source.snapshot()
        d = snap.to_dict()
        check_types(self, d, REQUIRED_SNAPSHOT)
        self.assertEqual(d["count"], 8)
        self.assertEqual(len(d["devices"]), 8)
        for dev in d["devices"]:
            check_types(self, dev, REQUIRED_DEVICE)
            self.assertEqual(dev["vendor"], "nvidia")
            self.assertEqual(dev["name"], "NVIDIA H100 80GB HBM3")
            self.assertEqual(dev["memory_total_mib"], 81559)
            self.assertEqual(dev["driver_version"], "550.54.15")
            self.assertEqual(dev["cuda_driver_version"], "12.4")
            self.assertEqual(dev["error"], "")
            self.assertIsInstance(dev["power_draw_w"], float)
        self.assertEqual([dev["index"] for dev in d["devices"]], list(range(8)))
        self.assertEqual(d["total_vram_bytes"], 8 * 81559 * MIB)
        self.assertEqual(d["used_vram_bytes"] + d["free_vram_bytes"], d["total_vram_bytes"])
        self.assertEqual(d["gpu_error"], "")
        self.assertEqual(d["nvml_version"], "12.550.54.15")
        assert_no_nulls(d)
        json.dumps(d, allow_nan=False)

    def test_figures(self) -> None:
        """Utilisation, temperature, power, PCI and UUID are read per device."""
        dev = self.source.snapshot().to_dict()["devices"][0]
        self.assertEqual(dev["utilization_pct"], 97)
        self.assertEqual(dev["memory_utilization_pct"], 45)
        self.assertEqual(dev["temperature_c"], 58)
        self.assertEqual(dev["power_draw_w"], 612.0)
        self.assertEqual(dev["power_limit_w"], 700.0)
        self.assertEqual(dev["pci_bus_id"], "00000000:18:00.0")
        self.assertTrue(dev["uuid"].startswith("GPU-"))
        self.assertEqual(dev["memory_used_mib"], 72 * 1024 + 512)

    def test_mig_instances(self) -> None:
        """MIG mode and the instances of MIG-enabled GPUs are reported; others have none."""
        devices = self.source.snapshot().to_dict()["devices"]
        self.assertEqual(devices[0]["mig_mode"], {"current": "disabled", "pending": "disabled"})
        self.assertFalse(devices[0]["mig_enabled"])
        self.assertEqual(devices[0]["mig_instances"], [])
        g6 = devices[6]
        self.assertTrue(g6["mig_enabled"])
        self.assertEqual(
            [(m["gpu_instance_id"], m["compute_instance_id"]) for m in g6["mig_instances"]],
            [(1, 0), (2, 0)],
        )
        self.assertEqual(g6["mig_instances"][0]["memory_total_mib"], 40448)
        self.assertTrue(g6["mig_instances"][0]["uuid"].startswith("MIG-"))
        self.assertEqual(g6["mig_instances"][0]["name"], "NVIDIA H100 80GB HBM3 MIG 3g.40gb")
        # Utilisation is NotSupported on a MIG-enabled GPU: 0, and not an error.
        self.assertEqual(g6["utilization_pct"], 0)
        self.assertEqual(g6["error"], "")
        g7 = devices[7]
        self.assertEqual(g7["mig_mode"], {"current": "enabled", "pending": "disabled"})
        self.assertEqual([m["gpu_instance_id"] for m in g7["mig_instances"]], [3, 4, 5, 9])
        self.assertEqual(self.source.snapshot().to_dict()["mig_enabled_count"], 2)

    def test_ecc_counters(self) -> None:
        """ECC counters are read (volatile/aggregate, corrected/uncorrected)."""
        devices = self.source.snapshot().to_dict()["devices"]
        self.assertEqual(
            devices[3]["ecc_errors"],
            {
                "volatile_corrected": 12,
                "volatile_uncorrected": 0,
                "aggregate_corrected": 340,
                "aggregate_uncorrected": 1,
            },
        )
        self.assertEqual(devices[3]["ecc_mode"], "enabled")
        self.assertEqual(devices[0]["ecc_errors"]["aggregate_corrected"], 0)

    def test_processes(self) -> None:
        """Processes come with pid, memory, type and MIG instance (-1 outside MIG)."""
        devices = self.source.snapshot().to_dict()["devices"]
        self.assertEqual(
            devices[0]["processes"],
            [
                {
                    "pid": 41234,
                    "used_memory_bytes": 72 * GIB,
                    "used_memory_mib": 72 * 1024,
                    "type": "compute",
                    "gpu_instance_id": -1,
                    "compute_instance_id": -1,
                }
            ],
        )
        (p4,) = devices[4]["processes"]
        self.assertEqual(p4["type"], "compute,graphics")
        self.assertEqual(p4["used_memory_bytes"], 20 * GIB)
        self.assertEqual(
            [(p["pid"], p["gpu_instance_id"]) for p in devices[6]["processes"]],
            [(60001, 1), (60002, 2)],
        )
        self.assertEqual(devices[5]["processes"], [])

    def test_unavailable_process_memory_is_zero(self) -> None:
        """usedGpuMemory=None from the bindings becomes 0, not null."""
        self.fake.gpus[5].compute_processes.append(FakeProcess(pid=99, used_gpu_memory=None))
        (proc,) = self.source.snapshot().to_dict()["devices"][5]["processes"]
        self.assertEqual(proc["used_memory_bytes"], 0)

    def test_not_supported_fields_become_zero_silently(self) -> None:
        """NotSupported fields read 0/""/[], never fail the snapshot, log nothing."""
        self.source.snapshot()
        for fn in (
            "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetEnforcedPowerLimit",
            "nvmlDeviceGetTemperature",
            "nvmlDeviceGetUtilizationRates",
            "nvmlDeviceGetPciInfo",
            "nvmlDeviceGetUUID",
            "nvmlDeviceGetMigMode",
            "nvmlDeviceGetEccMode",
            "nvmlDeviceGetTotalEccErrors",
            "nvmlDeviceGetComputeRunningProcesses",
        ):
            self.fake.fail(fn, pynvml.NVML_ERROR_NOT_SUPPORTED, device=2)
        self.logs.events.clear()
        d = self.source.snapshot().to_dict()
        dev = d["devices"][2]
        self.assertEqual(dev["power_draw_w"], 0.0)
        self.assertEqual(dev["power_limit_w"], 0.0)
        self.assertEqual(dev["temperature_c"], 0)
        self.assertEqual(dev["utilization_pct"], 0)
        # Identity the device no longer offers comes from its last good read.
        self.assertEqual(dev["pci_bus_id"], "00000000:3A:00.0")
        self.assertEqual(dev["uuid"], self.fake.gpus[2].uuid)
        self.assertEqual(dev["mig_mode"], {"current": "", "pending": ""})
        self.assertEqual(dev["ecc_mode"], "")
        self.assertEqual(dev["ecc_errors"]["volatile_corrected"], 0)
        self.assertEqual(dev["processes"], [])
        self.assertEqual(dev["error"], "")
        self.assertEqual(dev["name"], "NVIDIA H100 80GB HBM3")
        self.assertEqual(d["devices"][1]["power_draw_w"], 615.5)
        self.assertEqual(dev["health"], "healthy")
        self.assertEqual(d["count"], 8)
        assert_no_nulls(d)
        self.assertEqual(self.logs.events, [])

    def test_unknown_error_is_reported_and_logged_once(self) -> None:
        """An Unknown error on a field: 0, named in the device error, logged once per change."""
        self.source.snapshot()
        self.logs.events.clear()
        self.fake.fail("nvmlDeviceGetTemperature", pynvml.NVML_ERROR_UNKNOWN, device=1)
        for _ in range(3):
            dev = self.source.snapshot().to_dict()["devices"][1]
        self.assertEqual(dev["temperature_c"], 0)
        self.assertEqual(dev["error"], "temperature: Unknown Error")
        self.assertEqual(len(self.logs.events), 1)
        self.assertIn("reports NVML errors", self.logs.events[0]["log_format"])
        self.fake.clear_failures()
        self.source.snapshot()
        self.source.snapshot()
        self.assertEqual(len(self.logs.events), 2)
        self.assertIn("no NVML errors", self.logs.events[1]["log_format"])

    def test_lost_gpu_does_not_sink_snapshot(self) -> None:
        """
        A GPU lost before it was ever read stays in the list, unhealthy, with zeros and an
        error; it is left out of the count; the others are fine.
        """
        self.fake.gpus[5].lost = True
        d = self.source.snapshot().to_dict()
        self.assertEqual(d["count"], 7)
        self.assertEqual(d["device_count"], 8)
        dev = d["devices"][5]
        self.assertEqual(dev["index"], 5)
        self.assertEqual(dev["memory_total_mib"], 0)
        self.assertIn("GPU is lost", dev["error"])
        self.assertEqual(dev["health"], "unhealthy")
        self.assertFalse(dev["schedulable"])
        self.assertEqual(d["devices"][4]["memory_total_mib"], 81559)
        self.assertEqual(d["total_vram_bytes"], 7 * 81559 * MIB)
        assert_no_nulls(d)

    def test_gpu_lost_mid_probe_stops_asking(self) -> None:
        """After GPUIsLost on one figure, the device is not asked for more figures."""
        self.fake.fail("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_GPU_IS_LOST, device=2)
        dev = self.source.snapshot().to_dict()["devices"][2]
        self.assertEqual(dev["error"], "memory: GPU is lost")
        self.assertEqual(dev["name"], "NVIDIA H100 80GB HBM3")
        self.assertEqual(self.fake.called("nvmlDeviceGetPowerUsage", device=2), 0)
        self.assertEqual(self.fake.called("nvmlDeviceGetPowerUsage", device=3), 1)

    def test_binding_bug_is_contained(self) -> None:
        """A non-NVML exception from a binding function becomes a device error, not a crash."""

        def broken(handle: object) -> object:
            raise TypeError("boom")

        self.patch(self.fake, "nvmlDeviceGetPowerUsage", broken)
        d = self.source.snapshot().to_dict()
        self.assertEqual(d["count"], 8)  # a binding bug is no verdict on the GPU
        self.assertIn("power_draw: TypeError: boom", d["devices"][0]["error"])
        self.assertEqual(d["devices"][0]["health"], "healthy")

    def test_bytes_from_older_bindings(self) -> None:
        """Strings returned as bytes (older bindings) are decoded."""
        original = self.fake.nvmlDeviceGetName
        self.patch(self.fake, "nvmlDeviceGetName", lambda h: original(h).encode())
        self.patch(self.fake, "nvmlSystemGetDriverVersion", lambda: b"535.1")
        dev = self.source.snapshot().to_dict()["devices"][0]
        self.assertEqual(dev["name"], "NVIDIA H100 80GB HBM3")
        self.assertEqual(dev["driver_version"], "535.1")

    def test_count_change_logged_once(self) -> None:
        """A GPU falling off the bus is logged once."""
        self.source.snapshot()
        self.logs.events.clear()
        del self.fake.gpus[7]
        self.source.snapshot()
        self.source.snapshot()
        self.assertEqual(len(self.logs.events), 1)
        self.assertEqual(self.logs.events[0]["gpu_count"], 7)

    def test_close_shuts_nvml_down_once(self) -> None:
        """close() calls nvmlShutdown once; a later snapshot initialises again."""
        self.source.close()
        self.assertEqual(self.fake.shutdown_count, 0)  # never initialised
        self.source.snapshot()
        self.assertEqual(self.fake.refcount, 1)
        self.source.close()
        self.source.close()
        self.assertEqual(self.fake.shutdown_count, 1)
        self.assertEqual(self.fake.refcount, 0)
        self.assertEqual(self.source.snapshot().count, 8)
        self.assertEqual(self.fake.init_count, 2)

    def test_init_once_across_snapshots(self) -> None:
        """NVML is initialised once, not per snapshot; versions read once."""
        for _ in range(3):
            self.source.snapshot()
        self.assertEqual(self.fake.init_count, 1)
        self.assertEqual(self.fake.called("nvmlSystemGetDriverVersion"), 1)


class NVMLUnavailableTests(SynchronousTestCase):
    """No bindings, no library, failing init: empty snapshots, backoff, quiet logs."""

    def setUp(self) -> None:
        self.logs = LogCapture(self)
        self.clock = FakeClock()

    def assertEmpty(self, snap: GPUSnapshot, vendor: str = "none") -> dict[str, Any]:
        d = snap.to_dict()
        check_types(self, d, REQUIRED_SNAPSHOT)
        self.assertEqual(d["count"], 0)
        self.assertEqual(d["devices"], [])
        self.assertEqual(d["total_vram_bytes"], 0)
        self.assertEqual(d["vendor"], vendor)
        self.assertNotEqual(d["gpu_error"], "")
        assert_no_nulls(d)
        return d

    def test_import_error(self) -> None:
        """Without pynvml, the snapshot is empty and says the bindings are missing."""

        def importer() -> Any:
            raise ImportError("No module named 'pynvml'")

        source = NVMLGPUSource(importer=importer, clock=self.clock)
        d = self.assertEmpty(source.snapshot())
        self.assertIn("pynvml", d["gpu_error"])
        source.close()

    def test_import_error_from_sys_modules(self) -> None:
        """The default importer turns a missing module into an empty snapshot too (on a host whose
        driver library loads: without it the bindings are never imported)."""
        import ctypes

        self.patch(ctypes, "CDLL", lambda name, *a, **kw: object())
        saved = sys.modules.get("pynvml")
        sys.modules["pynvml"] = None  # type: ignore[assignment]  # makes import fail

        def restore() -> None:
            if saved is None:
                sys.modules.pop("pynvml", None)
            else:
                sys.modules["pynvml"] = saved

        self.addCleanup(restore)
        source = NVMLGPUSource(clock=self.clock)
        d = self.assertEmpty(source.snapshot())
        self.assertIn("not installed", d["gpu_error"])

    def test_real_bindings_without_driver(self) -> None:
        """The real pynvml on a machine without libnvidia-ml gives an empty snapshot."""
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            pass
        else:
            pynvml.nvmlShutdown()
            raise self.skipTest("this machine has an NVIDIA driver")
        source = NVMLGPUSource(clock=self.clock)
        d = self.assertEmpty(source.snapshot())
        self.assertIn("libnvidia-ml.so.1", d["gpu_error"])
        self.assertIn("no NVIDIA driver", d["gpu_error"])
        source.close()

    def test_real_bindings_with_driver(self) -> None:
        """On a machine with an NVIDIA driver, the real bindings give a valid snapshot."""
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise self.skipTest(f"no NVIDIA driver here ({e})") from None
        pynvml.nvmlShutdown()
        source = NVMLGPUSource(clock=self.clock)
        self.addCleanup(source.close)
        d = source.snapshot().to_dict()
        check_types(self, d, REQUIRED_SNAPSHOT)
        self.assertGreater(d["count"], 0)
        self.assertEqual(d["gpu_error"], "")
        for dev in d["devices"]:
            check_types(self, dev, REQUIRED_DEVICE)
            self.assertGreater(dev["memory_total_mib"], 0)
            self.assertNotEqual(dev["name"], "")
            self.assertNotEqual(dev["uuid"], "")
        assert_no_nulls(d)
        json.dumps(d, allow_nan=False)
        # Health and the event loop on the real driver, for a few seconds.
        source.check_health()
        states = {h.state for h in source.health().values()}
        self.assertTrue(states <= {"healthy", "degraded", "unhealthy"})
        batches = [source.wait_events(timeout_ms=1000) for _ in range(3)]
        self.assertTrue({b.state for b in batches} <= {"ok", "unsupported"}, batches)
        source.close()

    def test_backoff_doubles_to_thirty_minutes_and_logs_once(self) -> None:
        """Failed init retries after 30 s, doubling to 30 min; one log line for the outage."""
        fake = FakeNVML(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        source = NVMLGPUSource(fake, clock=self.clock)
        start = self.clock.now
        d = self.assertEmpty(source.snapshot())
        self.assertEqual(d["gpu_error"], "NVML initialisation failed: Driver Not Loaded")
        self.assertEqual(fake.init_count, 1)
        delays = []
        last = start
        for _ in range(9):
            nxt = source.next_attempt
            assert nxt is not None
            delays.append(nxt - last)
            self.clock.now = nxt - 1
            source.snapshot()
            attempts = fake.init_count
            self.clock.now = nxt
            self.assertEmpty(source.snapshot())
            self.assertEqual(fake.init_count, attempts + 1)
            last = nxt
        self.assertEqual(delays, [30, 60, 120, 240, 480, 960, 1800, 1800, 1800])
        self.assertEqual(len(self.logs.events), 1)
        self.assertIn("No GPU facts", self.logs.events[0]["log_format"])
        self.assertEqual(self.logs.events[0]["reason"], d["gpu_error"])

        # The driver comes back: facts again, one "available again" line, backoff reset.
        fake.init_error = None
        fake.gpus.append(
            FakeGPU(
                name="NVIDIA L4", uuid="GPU-l4", pci_bus_id="00000000:01:00.0", memory_total=GIB
            )
        )
        self.clock.now = source.next_attempt or 0
        snap = source.snapshot()
        self.assertEqual(snap.count, 1)
        self.assertEqual(snap.vendor, "nvidia")
        self.assertEqual(snap.gpu_error, "")
        self.assertFalse(source.failing)
        self.assertEqual(len(self.logs.events), 2)
        self.assertIn("available again", self.logs.events[1]["log_format"])
        source.snapshot()
        self.assertEqual(len(self.logs.events), 2)

    def test_driver_lost_while_running(self) -> None:
        """
        A failing device count shuts NVML down, keeps the last vendor, backs off; the GPUs
        seen before stay listed (named), unhealthy, and none is offered to the scheduler.
        """
        fake = h100_node()
        source = NVMLGPUSource(fake, clock=self.clock)
        self.assertEqual(source.snapshot().count, 8)
        fake.fail("nvmlDeviceGetCount", pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)
        snap = source.snapshot()
        d = snap.to_dict()
        self.assertEqual(d["count"], 0)
        self.assertEqual(d["vendor"], "nvidia")
        self.assertEqual(len(d["devices"]), 8)
        self.assertEqual({dev["health"] for dev in d["devices"]}, {"unhealthy"})
        self.assertEqual(d["devices"][3]["uuid"], fake.gpus[3].uuid)
        self.assertIn("RM has detected an NVML/RM version mismatch", d["devices"][3]["health_reasons"][0])
        assert_no_nulls(d)
        self.assertIn("RM has detected an NVML/RM version mismatch", d["gpu_error"])
        self.assertEqual(fake.shutdown_count, 1)
        self.assertEqual(fake.refcount, 0)
        self.assertTrue(source.failing)
        self.assertEqual(source.snapshot().count, 0)
        self.assertEqual(fake.init_count, 1)  # not retried before the backoff ends
        fake.clear_failures()
        self.clock.now += 30
        self.assertEqual(source.snapshot().count, 8)
        formats = self.logs.formats()
        self.assertEqual(len([f for f in formats if "No GPU facts" in f]), 1)
        self.assertEqual(len([f for f in formats if "available again" in f]), 1)

    def test_no_gpu_source(self) -> None:
        """NoGPUSource reports an empty snapshot with vendor none and no nulls."""
        d = NoGPUSource().snapshot().to_dict()
        self.assertEqual(d["count"], 0)
        self.assertEqual(d["vendor"], "none")
        self.assertEqual(d["gpu_error"], "")
        assert_no_nulls(d)
        self.assertEqual(NoGPUSource("disabled").snapshot().gpu_error, "disabled")
        NoGPUSource().close()

    def test_device_probe_bug_is_contained_to_that_device(self) -> None:
        """An exception escaping one device's probe makes that device unhealthy, not the rest."""
        fake = h100_node()
        source = NVMLGPUSource(fake, clock=self.clock)
        original = source._probe_device

        def explode(index: int, full: bool, job: Any = None) -> Any:
            if index == 2:
                raise RuntimeError("bug")
            return original(index, full, job)

        self.patch(source, "_probe_device", explode)
        d = source.snapshot().to_dict()
        self.assertEqual(d["count"], 7)
        self.assertEqual(d["devices"][2]["health"], "unhealthy")
        self.assertIn("RuntimeError: bug", d["devices"][2]["health_reasons"][0])
        self.assertEqual(d["devices"][1]["health"], "healthy")

    def test_unexpected_failure_gives_empty_snapshot(self) -> None:
        """An exception escaping the probing code is logged and yields an empty snapshot."""
        source = NVMLGPUSource(h100_node(), clock=self.clock)

        def explode(count: int, full: bool) -> Any:
            raise RuntimeError("bug")

        self.patch(source, "_run_devices", explode)
        d = self.assertEmpty(source.snapshot())
        self.assertIn("bug", d["gpu_error"])
        source.snapshot()
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 0)  # captured, not global
        self.assertEqual(
            [f for f in self.logs.formats() if "failed unexpectedly" in f],
            ["GPU snapshot failed unexpectedly"],
        )


class DescribeErrorTests(SynchronousTestCase):
    """describe_error never raises and names the problem."""

    def test_unprintable(self) -> None:
        """An exception whose str() raises is described by its code or type."""

        class Bad(Exception):
            value = 42

            def __str__(self) -> str:
                raise ValueError("no")

        self.assertEqual(gpu_module.describe_error(Bad()), "NVML error code 42")
        self.assertEqual(gpu_module.describe_error(KeyError()), "KeyError")
