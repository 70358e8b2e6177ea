"""
GPU health (issue 13): the NVML fake's events and error counters, the health tracker's
verdicts, the NVML source's events, watchdog and identity cache, the monitor service, and
the whole agent against the stand-in backend (Xid 79 on GPU 3 of 8).
"""

from __future__ import annotations

import threading
import time
from typing import Any, cast

import pynvml
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock, deferLater
from twisted.logger import ILogObserver, Logger
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmport_agent.demo.testing import SynchronousRunner
from llmport_agent.inventory.collector import assert_no_nulls
from llmport_agent.inventory.fakes import FakeHandle, FakeNVML, h100_node
from llmport_agent.inventory.health import (
    DEGRADED,
    HEALTHY,
    UNHEALTHY,
    EccErrors,
    HealthReading,
    HealthTracker,
    RemappedRows,
    Transition,
)
from llmport_agent.inventory.monitor import GPUHealthMonitor
from llmport_agent.inventory.nvml import NVMLGPUSource
from llmport_agent.inventory.watchdog import CallTimedOut, PoolSaturated, WatchdogPool, run_deferred
from tests.agentharness import AgentTestCase

UNC = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
COR = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
VOL = pynvml.NVML_VOLATILE_ECC
AGG = pynvml.NVML_AGGREGATE_ECC
XID = pynvml.nvmlEventTypeXidCriticalError


def sync_source(fake: FakeNVML | None = None, **kw: Any) -> tuple[FakeNVML, NVMLGPUSource]:
    """A fake node and an NVML source whose calls run inline (deterministic)."""
    fake = fake if fake is not None else h100_node()
    fake.wait_mode = "immediate"
    source = NVMLGPUSource(fake, pool=WatchdogPool("test", synchronous=True), **kw)
    return fake, source


def states(source: NVMLGPUSource) -> dict[int, str]:
    return {i: h.state for i, h in source.health().items()}


class Quiet:
    """Record a class logger's events instead of printing them."""

    def __init__(self, testcase: SynchronousTestCase, cls: Any) -> None:
        self.events: list[dict[str, Any]] = []
        testcase.patch(cls, "log", Logger(observer=cast(ILogObserver, self.events.append)))

    def formats(self) -> list[str]:
        return [e["log_format"] for e in self.events]


# ------------------------------------------------------------------ the fake's events


class FakeEventsTests(SynchronousTestCase):
    """The fake's events and counters behave as NVML documents them."""

    def setUp(self) -> None:
        self.fake = h100_node()
        self.fake.nvmlInit()
        self.es = self.fake.nvmlEventSetCreate()

    def test_wait_times_out_with_the_real_error(self) -> None:
        """No event within timeoutms: NVMLError_Timeout, the real class (code 10)."""
        self.fake.nvmlDeviceRegisterEvents(FakeHandle(0), XID, self.es)
        start = time.monotonic()
        with self.assertRaises(pynvml.NVMLError_Timeout):
            self.fake.nvmlEventSetWait(self.es, 50)
        self.assertGreaterEqual(time.monotonic() - start, 0.04)  # it really waited
        self.fake.wait_mode = "immediate"
        with self.assertRaises(pynvml.NVMLError_Timeout):
            self.fake.nvmlEventSetWait(self.es, 60_000)

    def test_events_only_for_registered_devices_and_types(self) -> None:
        """Events reach a set only for devices and types registered in it, in order."""
        self.fake.wait_mode = "immediate"
        self.fake.nvmlDeviceRegisterEvents(FakeHandle(3), XID, self.es)
        self.assertEqual(self.fake.inject_xid(2, 79), 0)  # GPU 2 not registered
        self.assertEqual(self.fake.inject_event(3, pynvml.nvmlEventTypeDoubleBitEccError), 0)
        self.fake.inject_xid(3, 79)
        self.fake.inject_xid(3, 48)
        first = self.fake.nvmlEventSetWait(self.es, 0)
        self.assertEqual((first.device, first.eventType, first.eventData), (FakeHandle(3), XID, 79))
        self.assertEqual(first.gpuInstanceId, 0xFFFFFFFF)
        self.assertEqual(self.fake.nvmlEventSetWait(self.es, 0).eventData, 48)
        self.assertEqual(self.fake.undelivered, 2)
        # c_nvmlEventData_t has exactly these fields.
        names = [f[0] for f in pynvml.c_nvmlEventData_t._fields_]
        self.assertEqual(names, ["device", "eventType", "eventData", "gpuInstanceId", "computeInstanceId"])
        for name in names:
            self.assertTrue(hasattr(first, name))

    def test_register_refuses_unsupported_types_and_mig_handles(self) -> None:
        """Types the device does not support, and MIG handles, get NVMLError_NotSupported."""
        supported = self.fake.nvmlDeviceGetSupportedEventTypes(FakeHandle(0))
        self.assertTrue(supported & XID)
        with self.assertRaises(pynvml.NVMLError_NotSupported):
            self.fake.nvmlDeviceRegisterEvents(FakeHandle(0), pynvml.nvmlEventTypeGpuRecoveryAction, self.es)
        with self.assertRaises(pynvml.NVMLError_NotSupported):
            self.fake.nvmlDeviceRegisterEvents(FakeHandle(6, 0), XID, self.es)

    def test_free_and_lost(self) -> None:
        """A freed set is refused; a lost GPU cannot be registered."""
        self.fake.gpus[1].lost = True
        with self.assertRaises(pynvml.NVMLError_GpuIsLost):
            self.fake.nvmlDeviceRegisterEvents(FakeHandle(1), XID, self.es)
        self.fake.nvmlEventSetFree(self.es)
        self.assertEqual(self.fake.event_sets, 0)
        with self.assertRaises(pynvml.NVMLError_InvalidArgument):
            self.fake.nvmlEventSetWait(self.es, 0)

    def test_field_values_per_field_return_codes(self) -> None:
        """nvmlDeviceGetFieldValues answers per field: a value, or NOT_SUPPORTED in nvmlReturn."""
        self.fake.gpus[0].recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
        values = self.fake.nvmlDeviceGetFieldValues(
            FakeHandle(0), [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, pynvml.NVML_FI_DEV_RETIRED_SBE]
        )
        self.assertIsInstance(values[0], pynvml.c_nvmlFieldValue_t)
        self.assertEqual(values[0].nvmlReturn, pynvml.NVML_SUCCESS)
        self.assertEqual(values[0].value.uiVal, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
        self.assertEqual(values[1].nvmlReturn, pynvml.NVML_ERROR_NOT_SUPPORTED)  # H100: no retirement

    def test_counters_and_reset(self) -> None:
        """A reset clears volatile ECC counters and pending remaps, keeps aggregate ones."""
        g = self.fake.gpus[5]
        g.ecc_counts[(UNC, VOL)] = 3
        g.ecc_counts[(UNC, AGG)] = 7
        g.remapped_rows = (0, 1, 1, 0)
        g.lost = True
        h = FakeHandle(5)
        with self.assertRaises(pynvml.NVMLError_GpuIsLost):
            self.fake.nvmlDeviceGetRemappedRows(h)
        self.fake.reset_gpu(5)
        self.assertEqual(self.fake.nvmlDeviceGetTotalEccErrors(h, UNC, VOL), 0)
        self.assertEqual(self.fake.nvmlDeviceGetTotalEccErrors(h, UNC, AGG), 7)
        self.assertEqual(self.fake.nvmlDeviceGetRemappedRows(h), (0, 1, 0, 0))
        with self.assertRaises(pynvml.NVMLError_NotSupported):
            self.fake.nvmlDeviceGetRetiredPagesPendingStatus(h)

    def test_hang_blocks_until_released(self) -> None:
        """hang() blocks a function (a hung ioctl) until released."""
        ev = self.fake.hang("nvmlDeviceGetPowerUsage", device=2)
        done = threading.Event()
        t = threading.Thread(target=lambda: (self.fake.nvmlDeviceGetPowerUsage(FakeHandle(2)), done.set()))
        t.start()
        self.assertFalse(done.wait(0.05))
        self.fake.nvmlDeviceGetPowerUsage(FakeHandle(3))  # other GPUs answer
        ev.set()
        self.assertTrue(done.wait(5))
        t.join(5)


# --------------------------------------------------------------------------- tracker


class TrackerTests(SynchronousTestCase):
    """Verdict rules, independent of any vendor."""

    def setUp(self) -> None:
        self.notified = 0
        self.tracker = HealthTracker(notify=self._notify)
        self.tracker.observe_reading(0, HealthReading(values={"ecc": EccErrors()}, identity={"uuid": "GPU-a"}))

    def _notify(self) -> None:
        self.notified += 1

    def test_first_healthy_reading_is_no_transition(self) -> None:
        self.assertEqual(self.tracker.drain(), [])
        self.assertEqual(self.notified, 0)

    def test_not_supported_keeps_the_previous_verdict(self) -> None:
        """A group that answered (pending remap: degraded) and is now unsupported stays."""
        self.tracker.observe_reading(0, HealthReading(values={"remapped_rows": RemappedRows(pending=True)}))
        self.assertEqual(self.tracker.health()[0].state, DEGRADED)
        self.tracker.observe_reading(0, HealthReading(unsupported=frozenset({"remapped_rows"})))
        self.assertEqual(self.tracker.health()[0].state, DEGRADED)
        self.tracker.observe_reading(0, HealthReading(values={"remapped_rows": RemappedRows()}))
        self.assertEqual(self.tracker.health()[0].state, HEALTHY)
        self.assertEqual([t.event_type for t in self.tracker.drain()], ["gpu.health.degraded", "gpu.health.recovered"])

    def test_query_error_fails_closed_until_it_answers(self) -> None:
        self.tracker.observe_reading(0, HealthReading(errors={"pcie": "Unknown Error"}))
        h = self.tracker.health()[0]
        self.assertEqual(h.state, UNHEALTHY)
        self.assertEqual(h.reasons, ("NVML query pcie failed: Unknown Error",))
        self.tracker.observe_reading(0, HealthReading(unsupported=frozenset({"pcie"})))
        self.assertEqual(self.tracker.health()[0].state, UNHEALTHY)  # still not answered
        self.tracker.observe_reading(0, HealthReading(values={"pcie": True}))
        self.assertEqual(self.tracker.health()[0].state, HEALTHY)

    def test_application_xids_are_counted_only(self) -> None:
        for xid in (13, 31, 43, 45, 68, 69, 109):
            self.tracker.observe_xid(0, xid)
        h = self.tracker.health()[0]
        self.assertEqual((h.state, h.xid_total), (HEALTHY, 7))
        self.assertEqual(self.tracker.drain(), [])

    def test_operator_ignored_xids(self) -> None:
        tracker = HealthTracker(ignored_xids=(74,))
        tracker.observe_xid(0, 74)
        self.assertEqual(tracker.health()[0].state, HEALTHY)

    def test_xid_sticks_until_reset_evidence(self) -> None:
        """An Xid verdict lasts across readings; volatile ECC counters going down clear it."""
        self.tracker.observe_reading(0, HealthReading(values={"ecc": EccErrors(volatile_corrected=5)}))
        self.tracker.observe_xid(0, 119)
        for _ in range(3):
            self.tracker.observe_reading(0, HealthReading(values={"ecc": EccErrors(volatile_corrected=5)}))
        self.assertEqual(self.tracker.health()[0].state, UNHEALTHY)
        self.assertIn("Xid 119 (GSP RPC timeout)", self.tracker.health()[0].reasons)
        self.tracker.observe_reading(0, HealthReading(values={"ecc": EccErrors()}))
        self.assertEqual(self.tracker.health()[0].state, HEALTHY)
        self.assertEqual(self.tracker.resets_seen, 1)

    def test_recovery_action_back_to_none_is_reset_evidence(self) -> None:
        self.tracker.observe_xid(0, 154)
        self.tracker.observe_reading(0, HealthReading(values={"recovery_action": 1}))
        self.assertIn("the driver asks for a GPU reset", self.tracker.health()[0].reasons)
        self.tracker.observe_reading(0, HealthReading(values={"recovery_action": 0}))
        self.assertEqual(self.tracker.health()[0].state, HEALTHY)

    def test_unknown_xid_degrades_and_unattributed_hits_every_gpu(self) -> None:
        self.tracker.observe_reading(1, HealthReading(identity={"uuid": "GPU-b"}))
        self.tracker.observe_xid(0, 999)
        self.assertEqual(self.tracker.health()[0].state, DEGRADED)
        self.tracker.observe_xid(None, 79)
        self.assertEqual({h.state for h in self.tracker.health().values()}, {UNHEALTHY})
        self.assertIn("not attributed", self.tracker.health()[1].reasons[0])

    def test_distinct_xid_codes_are_bounded(self) -> None:
        for xid in range(1000, 1100):
            self.tracker.observe_xid(0, xid)
        h = self.tracker.health()[0]
        self.assertLessEqual(len(h.xid_counts), 33)
        self.assertEqual(sum(c for _, c in h.xid_counts), 100)
        self.assertLessEqual(len(h.reasons), 33)  # reasons stay bounded too

    def test_identity_cached_and_new_gpu_at_index_starts_afresh(self) -> None:
        self.tracker.observe_xid(0, 79)
        self.tracker.observe_reading(0, HealthReading(gone="lost"))
        self.assertEqual(self.tracker.identity(0)["uuid"], "GPU-a")
        self.tracker.observe_reading(0, HealthReading(identity={"uuid": "GPU-z"}))
        self.assertEqual(self.tracker.health()[0].state, HEALTHY)
        self.assertEqual(self.tracker.identity(0)["uuid"], "GPU-z")

    def test_notify_after_transitions(self) -> None:
        self.tracker.observe_xid(0, 79)
        self.assertEqual(self.notified, 1)
        self.tracker.observe_xid(0, 79)  # same verdict: nothing new
        self.assertEqual(self.notified, 1)
        (t,) = self.tracker.drain()
        self.assertEqual(t.payload()["previous"], "healthy")
        self.assertEqual((t.event_type, t.severity), ("gpu.health.unhealthy", "error"))


# ----------------------------------------------------------------------- NVML source


class XidScenarioTests(SynchronousTestCase):
    """Xid 79 on GPU 3 of 8, through the NVML source (issue 13's first scenario)."""

    def setUp(self) -> None:
        Quiet(self, NVMLGPUSource)
        self.fake, self.source = sync_source()
        self.assertEqual(self.source.snapshot().count, 8)
        self.assertEqual(self.source.wait_events().state, "ok")  # registers

    def test_xid_79_left_out_named_one_transition_recovered_after_reset(self) -> None:
        self.fake.inject_xid(3, 79)
        self.fake.gpus[3].lost = True
        batch = self.source.wait_events()
        self.assertEqual(batch.count, 1)
        snap = self.source.snapshot()
        d = snap.to_dict()
        self.assertEqual(d["count"], 7)
        self.assertEqual(d["free_vram_bytes"], sum(x["memory_free_bytes"] for x in d["devices"] if x["index"] != 3))
        self.assertEqual(d["total_vram_bytes"], 7 * self.fake.gpus[0].memory_total)
        gpu3 = d["devices"][3]
        self.assertEqual(gpu3["health"], "unhealthy")
        self.assertEqual(gpu3["uuid"], self.fake.gpus[3].uuid)  # named from the last good read
        self.assertEqual(gpu3["name"], "NVIDIA H100 80GB HBM3")
        self.assertEqual(gpu3["pci_bus_id"], "00000000:5D:00.0")
        self.assertIn("Xid 79 (GPU has fallen off the bus)", gpu3["health_reasons"])
        self.assertTrue(any("GPU is lost" in r for r in gpu3["health_reasons"]))
        self.assertEqual(gpu3["xid_counts"], {"79": 1})
        assert_no_nulls(d)
        for _ in range(3):
            self.source.snapshot()
            self.source.check_health()
        (t,) = self.source.tracker.drain()
        self.assertEqual((t.index, t.event_type, t.uuid), (3, "gpu.health.unhealthy", self.fake.gpus[3].uuid))
        self.fake.reset_gpu(3)
        snap = self.source.snapshot()
        self.assertEqual(snap.count, 8)
        (t,) = self.source.tracker.drain()
        self.assertEqual((t.index, t.event_type), (3, "gpu.health.recovered"))

    def test_xid_that_queries_do_not_show_persists(self) -> None:
        """Xid 48 (the GPU still answers) keeps GPU 3 unhealthy across snapshots."""
        self.fake.inject_xid(3, 48)
        self.source.wait_events()
        for _ in range(3):
            self.assertEqual(self.source.snapshot().count, 7)
        self.assertEqual(states(self.source)[3], UNHEALTHY)

    def test_application_xid_counts_only(self) -> None:
        self.fake.inject_xid(2, 13)
        self.source.wait_events()
        snap = self.source.snapshot()
        self.assertEqual(snap.count, 8)
        self.assertEqual(snap.to_dict()["devices"][2]["xid_errors"], 1)
        self.assertEqual(self.source.tracker.drain(), [])

    def test_xid_on_mig_instance_names_it(self) -> None:
        self.fake.inject_xid(6, 95, gpu_instance=1)
        self.source.wait_events()
        self.assertIn("Xid 95 (uncontained ECC error) on MIG GPU instance 1", self.source.health()[6].reasons)

    def test_double_bit_event_and_gpu_unavailable(self) -> None:
        """Non-Xid events: a DBE sticks until reset; an unavailable GPU asks for a check."""
        self.fake.gpus[1].supported_events |= pynvml.nvmlEventTypeGpuUnavailableError
        self.source.reregister_events()
        self.source.wait_events()
        self.fake.inject_event(0, pynvml.nvmlEventTypeDoubleBitEccError)
        self.fake.inject_event(1, pynvml.nvmlEventTypeGpuUnavailableError)
        batch = self.source.wait_events()
        self.assertEqual(batch.count, 2)
        self.assertTrue(batch.check)
        self.assertEqual(states(self.source)[0], UNHEALTHY)
        self.assertEqual(states(self.source)[1], UNHEALTHY)
        self.source.check_health()
        self.assertEqual(states(self.source)[1], HEALTHY)  # it answers: it was unavailable, not broken
        self.assertEqual(states(self.source)[0], UNHEALTHY)  # DBE: until a reset shows

    def test_registration_skips_unsupported_and_fails_closed_on_errors(self) -> None:
        self.fake.gpus[4].supported_events = 0
        self.fake.fail("nvmlDeviceRegisterEvents", pynvml.NVML_ERROR_UNKNOWN, device=5)
        self.source.reregister_events()
        self.source.wait_events()
        self.assertEqual(states(self.source)[4], HEALTHY)
        self.assertEqual(states(self.source)[5], UNHEALTHY)
        self.assertIn("registering for events failed", self.source.health()[5].reasons[0])
        self.assertEqual(self.fake.inject_xid(4, 79), 0)  # never registered
        self.fake.clear_failures()
        self.source.reregister_events()
        self.source.wait_events()
        self.assertEqual(states(self.source)[5], HEALTHY)

    def test_no_device_supports_events(self) -> None:
        fake = h100_node()
        for g in fake.gpus:
            g.supported_events = 0
        _, source = sync_source(fake)
        source.snapshot()
        self.assertEqual(source.wait_events().state, "unsupported")
        self.assertEqual(fake.event_sets, 0)
        self.assertEqual(source.wait_events().state, "unsupported")
        self.assertEqual(fake.called("nvmlEventSetCreate"), 1)

    def test_wait_before_init_is_not_ready(self) -> None:
        _, source = sync_source()
        self.assertEqual(source.wait_events().state, "not_ready")

    def test_burst_of_1000_events_is_taken_in_bounded_batches(self) -> None:
        for n in range(1000):
            self.fake.inject_xid(n % 8, 13 if n % 100 else 79)
        counts = []
        while True:
            batch = self.source.wait_events(max_events=100)
            if not batch.count:
                break
            counts.append(batch.count)
        self.assertEqual(counts, [100] * 10)
        health = self.source.health()
        self.assertEqual(sum(h.xid_total for h in health.values()), 1000)
        transitions = self.source.tracker.drain()
        self.assertLessEqual(len(transitions), 8)  # one per GPU at most, not one per event
        self.assertEqual({t.state for t in transitions}, {UNHEALTHY})

    def test_close_frees_event_set_then_shuts_down(self) -> None:
        self.assertEqual(self.fake.event_sets, 1)
        self.source.close()
        self.assertEqual(self.fake.event_sets, 0)
        self.assertEqual(self.fake.refcount, 0)

    def test_session_restart_registers_again(self) -> None:
        """NVML re-initialised (driver came back): a new event set is made and registered."""
        self.fake.fail("nvmlDeviceGetCount", pynvml.NVML_ERROR_UNKNOWN)
        self.source.snapshot()
        self.fake.clear_failures()
        self.source._next_attempt = None
        self.source.snapshot()
        self.assertEqual(self.source.wait_events().state, "ok")
        self.assertEqual(self.fake.called("nvmlEventSetCreate"), 2)
        self.fake.inject_xid(2, 79)
        self.assertEqual(self.source.wait_events().count, 1)


class CountersTests(SynchronousTestCase):
    """ECC counters rising, remapped rows, retired pages, recovery action, throttling, PCIe."""

    def setUp(self) -> None:
        Quiet(self, NVMLGPUSource)
        self.fake, self.source = sync_source()
        self.source.snapshot()
        self.g5 = self.fake.gpus[5]

    def test_uncorrected_ecc_rising_on_gpu_5(self) -> None:
        self.source.check_health()
        self.assertEqual(states(self.source)[5], HEALTHY)
        for n in (1, 2, 5):
            self.g5.ecc_counts[(UNC, VOL)] = n
            self.g5.ecc_counts[(UNC, AGG)] = n
            self.source.check_health()
        h = self.source.health()[5]
        self.assertEqual(h.state, UNHEALTHY)
        self.assertEqual(h.reasons, ("5 uncorrectable ECC error(s) since the last reset",))
        snap = self.source.snapshot()
        self.assertEqual(snap.count, 7)
        self.assertEqual(snap.devices[5].ecc_errors.aggregate_uncorrected, 5)
        (t,) = self.source.tracker.drain()
        self.assertEqual((t.index, t.state), (5, UNHEALTHY))
        self.fake.reset_gpu(5)
        self.source.check_health()
        self.assertEqual(states(self.source)[5], HEALTHY)

    def test_corrected_ecc_alone_keeps_healthy(self) -> None:
        self.g5.ecc_counts[(COR, VOL)] = 10_000
        self.source.check_health()
        self.assertEqual(states(self.source)[5], HEALTHY)

    def test_field_that_errors_vs_field_not_supported(self) -> None:
        """An error on a query: unhealthy (fail closed). NOT_SUPPORTED: no change."""
        self.fake.fail("nvmlDeviceGetCurrPcieLinkWidth", pynvml.NVML_ERROR_NOT_SUPPORTED, device=1)
        self.fake.fail("nvmlDeviceGetRemappedRows", pynvml.NVML_ERROR_UNKNOWN, device=2)
        self.source.check_health()
        self.assertEqual(states(self.source)[1], HEALTHY)
        h2 = self.source.health()[2]
        self.assertEqual(h2.state, UNHEALTHY)
        self.assertEqual(h2.reasons, ("NVML query remapped_rows failed: Unknown Error",))
        self.assertEqual(self.source.snapshot().count, 7)
        self.fake.clear_failures()
        self.source.check_health()
        self.assertEqual(states(self.source)[2], HEALTHY)

    def test_timeout_from_a_health_field_fails_closed(self) -> None:
        """
        NVML_ERROR_TIMEOUT from remapped rows is an error, not "not supported": the GPU is
        unhealthy until the query answers (fail closed; the planted bug treated it as benign).
        """
        self.fake.fail("nvmlDeviceGetRemappedRows", pynvml.NVML_ERROR_TIMEOUT, device=4)
        self.source.check_health()
        h4 = self.source.health()[4]
        self.assertEqual(h4.state, UNHEALTHY)
        self.assertIn("remapped_rows", " ".join(h4.reasons))
        self.assertEqual(self.source.snapshot().count, 7)
        self.fake.clear_failures()
        self.source.check_health()
        self.assertEqual(states(self.source)[4], HEALTHY)

    def test_unhealthy_gpu_with_memory_is_left_out_of_the_sums(self) -> None:
        """
        A GPU made unhealthy by its ECC counters still reports its memory (unlike a lost one,
        whose memory reads 0): used, free and total VRAM must leave it out all the same, or the
        backend would place models on it.
        """
        self.g5.ecc_counts[(UNC, VOL)] = 3
        self.g5.ecc_counts[(UNC, AGG)] = 3
        self.g5.memory_used = 7 * 1024**3
        self.source.check_health()
        d = self.source.snapshot().to_dict()
        gpu5 = d["devices"][5]
        self.assertEqual(gpu5["health"], "unhealthy")
        self.assertGreater(gpu5["memory_used_bytes"], 0)
        self.assertGreater(gpu5["memory_free_bytes"], 0)
        others = [x for x in d["devices"] if x["index"] != 5]
        self.assertEqual(d["count"], 7)
        self.assertEqual(d["used_vram_bytes"], sum(x["memory_used_bytes"] for x in others))
        self.assertEqual(d["free_vram_bytes"], sum(x["memory_free_bytes"] for x in others))
        self.assertEqual(d["total_vram_bytes"], sum(x["memory_total_bytes"] for x in others))

    def test_not_supported_after_a_verdict_keeps_it(self) -> None:
        self.g5.remapped_rows = (0, 1, 1, 0)
        self.source.check_health()
        self.assertEqual(states(self.source)[5], DEGRADED)
        self.fake.fail("nvmlDeviceGetRemappedRows", pynvml.NVML_ERROR_NOT_SUPPORTED, device=5)
        self.source.check_health()
        self.assertEqual(states(self.source)[5], DEGRADED)

    def test_remapped_rows(self) -> None:
        self.g5.remapped_rows = (2, 1, 1, 0)
        self.source.check_health()
        self.assertEqual(self.source.health()[5].reasons, ("row remapping pending: reset the GPU to apply it",))
        self.assertEqual(self.source.snapshot().count, 8)  # degraded GPUs are still offered
        self.g5.remapped_rows = (2, 1, 0, 1)
        self.source.check_health()
        self.assertEqual(states(self.source)[5], UNHEALTHY)
        self.assertEqual(self.source.snapshot().devices[5].remapped_rows.failure, True)

    def test_retired_pages_on_older_gpus(self) -> None:
        self.g5.retired_pages = {0: [0x1000], 1: [0x2000, 0x3000]}
        self.g5.retired_pending = True
        self.source.check_health()
        self.assertEqual(self.source.health()[5].reasons, ("retired pages pending: reset the GPU to retire them",))
        dev = self.source.snapshot().devices[5]
        self.assertEqual((dev.retired_pages.single_bit, dev.retired_pages.double_bit), (1, 2))

    def test_recovery_action_field(self) -> None:
        self.g5.recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
        self.source.check_health()
        self.assertEqual(self.source.health()[5].reasons, ("the driver asks for a node reboot",))
        self.g5.recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P
        self.source.check_health()
        self.assertEqual(states(self.source)[5], DEGRADED)
        self.fake.reset_gpu(5)
        self.source.check_health()
        self.assertEqual(states(self.source)[5], HEALTHY)

    def test_throttle_and_pcie(self) -> None:
        self.g5.throttle_reasons = pynvml.nvmlClocksEventReasonHwThermalSlowdown | pynvml.nvmlClocksEventReasonGpuIdle
        self.fake.gpus[4].pcie = (4, 5, 8, 16)
        self.fake.gpus[3].throttle_reasons = pynvml.nvmlClocksEventReasonSwPowerCap  # normal
        self.source.check_health()
        self.assertEqual(self.source.health()[5].reasons, ("clocks throttled: hardware thermal slowdown",))
        self.assertEqual(self.source.health()[4].reasons, ("PCIe link x8 of x16",))
        self.assertEqual(states(self.source)[3], HEALTHY)
        dev = self.source.snapshot().to_dict()["devices"][4]
        self.assertEqual(dev["pcie"], {"generation": 4, "max_generation": 5, "width": 8, "max_width": 16})

    def test_reset_required_answer(self) -> None:
        self.g5.reset_required = True
        self.source.check_health()
        h = self.source.health()[5]
        self.assertEqual(h.state, UNHEALTHY)
        self.assertIn("requires a reset", h.reasons[0])
        self.fake.reset_gpu(5)
        self.source.check_health()
        self.assertEqual(states(self.source)[5], HEALTHY)

    def test_gpu_no_longer_enumerated(self) -> None:
        del self.fake.gpus[7]
        snap = self.source.snapshot()
        self.assertEqual((snap.count, snap.device_count), (7, 8))
        self.assertEqual(snap.devices[7].uuid, "GPU-00000007-5a1e-4c3b-9d2f-a0b0c0d00007")
        self.assertIn("no longer enumerated", self.source.health()[7].reasons[0])

    def test_check_health_makes_fewer_calls_than_a_snapshot(self) -> None:
        before = len(self.fake.calls)
        self.source.check_health()
        check = len(self.fake.calls) - before
        before = len(self.fake.calls)
        self.source.snapshot()
        snap = len(self.fake.calls) - before
        self.assertLess(check, snap)
        self.assertEqual(self.fake.called("nvmlDeviceGetComputeRunningProcesses"), 16)  # 2 snapshots


# ----------------------------------------------------------------------------- watchdog


class WatchdogTests(SynchronousTestCase):
    """Hung NVML calls mark a GPU unresponsive; the snapshot never waits on them twice."""

    def setUp(self) -> None:
        self.logs = Quiet(self, NVMLGPUSource)
        self.fake = h100_node()
        self.pool = WatchdogPool("nvml-test", max_threads=12)
        self.source = NVMLGPUSource(self.fake, pool=self.pool, call_timeout=0.3)
        self.addCleanup(self.fake.release_hangs)
        self.assertEqual(self.source.snapshot().count, 8)

    def test_hung_call_marks_that_gpu_unresponsive(self) -> None:
        self.fake.hang("nvmlDeviceGetMemoryInfo", device=3)
        start = time.monotonic()
        snap = self.source.snapshot()
        self.assertLess(time.monotonic() - start, 5.0)  # bounded by the watchdog (0.3 s)
        self.assertEqual(snap.count, 7)
        gpu3 = snap.devices[3]
        self.assertEqual(gpu3.uuid, self.fake.gpus[3].uuid)
        h = self.source.health()[3]
        self.assertTrue(h.unresponsive)
        self.assertIn("nvmlDeviceGetMemoryInfo on GPU 3 did not return within 0.3 s", h.reasons[0])
        calls = self.fake.called("nvmlDeviceGetHandleByIndex")
        start = time.monotonic()
        snap = self.source.snapshot()  # does not wait for GPU 3 again
        self.assertLess(time.monotonic() - start, 0.3 * 0.9 + 1.0)
        self.assertEqual(self.fake.called("nvmlDeviceGetHandleByIndex"), calls + 7)
        self.assertIn("has not returned for", self.source.health()[3].reasons[0])
        self.assertEqual(len(self.pool.stuck_jobs()), 1)
        self.fake.release_hangs()
        deadline = time.monotonic() + 5
        while self.pool.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertEqual(self.source.snapshot().count, 8)
        self.assertEqual([t.event_type for t in self.source.tracker.drain()], ["gpu.health.unhealthy", "gpu.health.recovered"])

    def test_stuck_threads_are_bounded(self) -> None:
        """Every GPU hangs: at most max_threads calls are alive; the rest are not started."""
        self.fake.hang("nvmlDeviceGetMemoryInfo")
        pool = WatchdogPool("small", max_threads=3)
        source = NVMLGPUSource(self.fake, pool=pool, call_timeout=0.2)
        snap = source.snapshot()
        self.assertEqual(snap.count, 0)
        self.assertEqual(pool.alive, 3)
        reasons = [source.health()[i].reasons[0] for i in range(8)]
        self.assertEqual(sum("still running" in r for r in reasons), 5)
        source.snapshot()
        self.assertLessEqual(pool.alive, 3)

    def test_global_call_hangs(self) -> None:
        self.fake.hang("nvmlDeviceGetCount")
        snap = self.source.snapshot()
        self.assertIn("NVML is not answering", snap.gpu_error)
        self.assertEqual((snap.count, snap.device_count), (0, 8))
        self.assertTrue(all(h.unresponsive for h in self.source.health().values()))
        snap = self.source.snapshot()
        self.assertIn("has not returned", snap.gpu_error)
        self.fake.release_hangs()

    def test_close_does_not_shut_down_under_a_hung_call(self) -> None:
        self.fake.hang("nvmlDeviceGetMemoryInfo", device=1)
        self.source.snapshot()
        self.source.close()
        self.assertEqual(self.fake.shutdown_count, 0)
        self.assertIn("Not shutting NVML down", " ".join(self.logs.formats()))


class WatchdogPoolTests(TestCase):
    timeout = 20

    def test_run_deferred_times_out_and_saturates(self) -> Deferred[None]:
        pool = WatchdogPool("p", max_threads=1)
        release = threading.Event()
        self.addCleanup(release.set)

        async def scenario() -> None:
            d = run_deferred(reactor, pool, release.wait, deadline=0.1)
            with self.assertRaises(CallTimedOut):
                await d
            with self.assertRaises(PoolSaturated):
                await run_deferred(reactor, pool, lambda: 1, deadline=1)
            release.set()
            while pool.alive:
                await deferLater(reactor, 0.01, lambda: None)
            self.assertEqual(await run_deferred(reactor, pool, lambda: 42, deadline=1), 42)
            self.assertEqual(pool.timed_out_total, 1)

        return Deferred.fromCoroutine(scenario())

    def test_threads_are_daemons(self) -> None:
        pool = WatchdogPool("d")
        seen: list[bool] = []
        job = pool.submit(lambda: seen.append(threading.current_thread().daemon), deadline=1)
        job.future.result(5)
        self.assertEqual(seen, [True])


# ------------------------------------------------------------------------------ monitor


class MonitorTests(SynchronousTestCase):
    """The monitor on a Clock with inline calls: bounded batches, transitions, stop."""

    def setUp(self) -> None:
        Quiet(self, NVMLGPUSource)
        Quiet(self, GPUHealthMonitor)
        self.clock = Clock()
        self.fake, self.source = sync_source()
        self.seen: list[Transition] = []
        self.monitor = GPUHealthMonitor(
            self.clock, self.source, SynchronousRunner(), interval=10, on_transition=self.seen.append,
            wait_rounds=1,  # one short wait per call (the rounds on the thread: tests.test_idle)
        )
        self.monitor.startService()
        self.addCleanup(self.monitor.stopService)

    def run_loop(self, rounds: int) -> None:
        """Let C{rounds} event waits happen (an empty wait comes around after its timeout)."""
        for _ in range(rounds):
            self.clock.advance(0.5)

    def test_first_check_initialises_and_events_flow(self) -> None:
        self.assertEqual(self.monitor.checks, 1)
        self.run_loop(2)
        self.fake.inject_xid(3, 79)
        self.run_loop(1)
        self.assertEqual([(t.index, t.state) for t in self.seen], [(3, UNHEALTHY)])
        self.assertEqual(self.monitor.status_reasons()[0][:6], "GPU 3 ")
        self.assertIn("Xid 79", self.monitor.status_reasons()[0])

    def test_burst_is_worked_off_in_bounded_steps(self) -> None:
        self.run_loop(1)
        for n in range(1000):
            self.fake.inject_xid(n % 8, 31)
        self.run_loop(2)
        self.assertEqual(self.monitor.events_handled, 1000)
        # Ten reactor callbacks of at most 100 events each: the reactor gets control back
        # between batches (a real reactor runs its other work there).
        self.assertEqual(self.monitor.event_batches, 10)
        self.assertEqual(self.monitor.largest_batch, 100)
        self.assertEqual(self.seen, [])

    def test_periodic_checks_find_counters(self) -> None:
        self.fake.gpus[5].ecc_counts[(UNC, VOL)] = 1
        self.clock.advance(10)
        self.assertEqual(self.monitor.checks, 2)
        self.assertEqual([(t.index, t.state) for t in self.seen], [(5, UNHEALTHY)])

    def test_event_asking_for_check_runs_one(self) -> None:
        self.run_loop(1)
        checks = self.monitor.checks
        self.fake.inject_event(0, pynvml.nvmlEventTypeDoubleBitEccError)
        self.run_loop(1)
        self.assertEqual(self.monitor.checks, checks + 1)

    def test_wait_failures_back_off(self) -> None:
        self.clock.advance(0)
        self.assertEqual(self.fake.called("nvmlEventSetWait"), 1)
        self.fake.fail("nvmlEventSetWait", pynvml.NVML_ERROR_UNKNOWN)
        self.clock.advance(0.5)
        self.assertEqual(self.fake.called("nvmlEventSetWait"), 2)  # failed: next in 1 s, then 2 s
        self.clock.advance(0.9)
        self.assertEqual(self.fake.called("nvmlEventSetWait"), 2)
        self.clock.advance(0.1)
        self.clock.advance(2)
        self.assertEqual(self.fake.called("nvmlEventSetWait"), 4)
        self.assertIn("Unknown Error", self.monitor.metrics()["event_error"])
        self.fake.clear_failures()
        self.clock.advance(4)
        self.assertEqual(self.monitor.metrics()["event_error"], "")

    def test_metrics_view(self) -> None:
        self.run_loop(1)
        self.fake.inject_xid(2, 79)
        self.fake.inject_xid(2, 13)
        self.run_loop(1)
        view = self.monitor.metrics()
        dev = view["devices"][2]
        self.assertEqual((dev["state"], dev["xid_counts"], dev["uuid"]), (UNHEALTHY, {13: 1, 79: 1}, self.fake.gpus[2].uuid))
        self.assertEqual(view["events_handled"], 2)

    def test_stop_with_nothing_in_flight(self) -> None:
        d = self.monitor.stopService()
        self.assertIsNone(self.successResultOf(d))
        self.clock.advance(100)
        self.assertEqual(self.clock.getDelayedCalls(), [])


class ShutdownWhileWaitingTests(TestCase):
    """Real threads, real reactor: the agent stops cleanly while NVML waits for events."""

    timeout = 30

    async def test_stop_while_waiting_for_events(self) -> None:
        fake = h100_node()  # wait_mode "block": nvmlEventSetWait really sleeps
        source = NVMLGPUSource(fake)
        from twisted.internet import threads

        runner = _ThreadRunner()
        monitor = GPUHealthMonitor(reactor, source, runner, interval=60, wait_timeout_ms=400)
        monitor.startService()
        deadline = time.monotonic() + 10
        while fake.called("nvmlEventSetWait") < 2 and time.monotonic() < deadline:
            await deferLater(reactor, 0.02, lambda: None)
        self.assertTrue(monitor._waiting is not None)
        start = time.monotonic()
        await monitor.stopService()
        self.assertLess(time.monotonic() - start, 2.5)  # within the wait's own timeout
        self.assertIsNone(monitor._waiting)
        await threads.deferToThread(source.close)
        self.assertEqual(fake.event_sets, 0)
        self.assertEqual(fake.refcount, 0)
        self.assertEqual(source.pool.alive, 0)

    async def test_stop_while_the_wait_hangs(self) -> None:
        """A wait hung in the driver is left on its daemon thread; the stop goes on."""
        fake = h100_node()
        Quiet(self, GPUHealthMonitor)
        source = NVMLGPUSource(fake, call_timeout=60)
        monitor = GPUHealthMonitor(reactor, source, _ThreadRunner(), interval=60, wait_timeout_ms=100)
        monitor.startService()
        deadline = time.monotonic() + 10
        while fake.called("nvmlEventSetWait") < 1 and time.monotonic() < deadline:
            await deferLater(reactor, 0.02, lambda: None)
        fake.hang("nvmlEventSetWait")
        self.addCleanup(fake.release_hangs)
        while fake.called("nvmlEventSetWait") < 2 and time.monotonic() < deadline:
            await deferLater(reactor, 0.02, lambda: None)
        start = time.monotonic()
        await monitor.stopService()
        self.assertLess(time.monotonic() - start, 5.0)  # bounded: wait timeout + 2 s
        self.assertEqual(source.pool.alive, 1)  # the hung wait, left on its daemon thread
        fake.release_hangs()
        while source.pool.alive and time.monotonic() < deadline + 10:
            await deferLater(reactor, 0.02, lambda: None)
        self.assertEqual(source.pool.alive, 0)  # (trial fails the test on a leftover timer)


class _ThreadRunner:
    """A BlockingRunner on the reactor's thread pool (tests only)."""

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Deferred[Any]:
        from twisted.internet import threads

        return threads.deferToThread(fn, *args, **kwargs)


# --------------------------------------------------------------------- the whole agent


class AgentGPUHealthTests(AgentTestCase):
    """Xid 79 on GPU 3 of 8 through the real agent and the stand-in backend."""

    timeout = 60

    async def test_xid_79_on_gpu_3_of_8(self) -> None:
        fake = h100_node()
        backend = await self.start_backend()
        agent = self.start_agent(backend, gpu_source=NVMLGPUSource(fake), GPU_HEALTH_INTERVAL_SEC="1")
        node_id = await self.wait_connected(backend, agent)
        await backend.wait_for(lambda: (backend.latest_inventory(node_id) or {}).get("inventory", {}).get("gpu_count") == 8)
        await backend.wait_for(lambda: fake.event_sets == 1)
        # No change-heartbeat pending from the first inventory: the one after the Xid is its own.
        await backend.wait_for(lambda: agent.heartbeat._change_call is None)
        beats = len([f for f in backend.frames(node_id) if f.get("type") == "heartbeat"])
        fake.inject_xid(3, 79)
        fake.gpus[3].lost = True
        injected = time.monotonic()

        def degraded() -> list[dict[str, Any]]:
            hb = [f for f in backend.frames(node_id) if f.get("type") == "heartbeat"][beats:]
            return [f for f in hb if f.get("status") == "degraded"]

        await backend.wait_for(lambda: bool(degraded()), 10)
        self.assertLess(time.monotonic() - injected, 5.0)  # generous; the bench measures it
        beat = degraded()[0]
        self.assertIn("GPU 3 (GPU-00000003", beat["status_reason"])
        self.assertIn("Xid 79 (GPU has fallen off the bus)", beat["status_reason"])
        self.assertEqual(backend.node(node_id)["status"], "degraded")

        def inventory() -> dict[str, Any]:
            return (backend.latest_inventory(node_id) or {}).get("inventory", {})

        await backend.wait_for(lambda: inventory().get("gpu_count") == 7, 10)
        # The transition's own heartbeat (notify_changed), not one that only follows the fresh
        # inventory a second later: the degraded heartbeat arrives before that inventory.
        kinds = [(f.get("type"), f.get("status"), (f.get("inventory") or {}).get("gpu_count"))
                 for f in backend.frames(node_id)]
        first_degraded = kinds.index(("heartbeat", "degraded", None))
        first_seven = next(i for i, k in enumerate(kinds) if k[0] == "inventory" and k[2] == 7)
        self.assertLess(first_degraded, first_seven, kinds[-12:])
        inv = inventory()
        self.assertEqual(inv["gpu"]["count"], 7)
        self.assertEqual(len(inv["gpu"]["devices"]), 8)
        self.assertEqual(inv["gpu"]["devices"][3]["health"], "unhealthy")
        self.assertEqual(inv["gpu"]["devices"][3]["uuid"], fake.gpus[3].uuid)
        self.assertEqual(inv["static_capabilities"]["gpu_count"], 7)

        def gpu_events() -> list[dict[str, Any]]:
            return [e for e in backend.events(node_id) if str(e.get("event_type", "")).startswith("gpu.health.")]

        await backend.wait_for(lambda: bool(gpu_events()), 10)
        await deferLater(reactor, 2.5, lambda: None)  # more checks and snapshots: no more events
        self.assertEqual([e["event_type"] for e in gpu_events()], ["gpu.health.unhealthy"])
        payload = gpu_events()[0]["payload"]
        self.assertEqual((payload["gpu_index"], payload["uuid"]), (3, fake.gpus[3].uuid))
        self.assertEqual(gpu_events()[0]["severity"], "error")

        fake.reset_gpu(3)
        await backend.wait_for(lambda: len(gpu_events()) == 2, 10)
        self.assertEqual(gpu_events()[1]["event_type"], "gpu.health.recovered")
        await backend.wait_for(lambda: inventory().get("gpu_count") == 8, 10)
        await backend.wait_for(lambda: backend.node(node_id)["status"] == "healthy", 10)


class MetricsTests(SynchronousTestCase):
    """
    /metrics carries per-GPU health and Xid counters next to the other per-GPU families
    (llmport_agent.ops.metrics.AgentCollector), from the snapshot's current verdicts.
    """

    def test_families(self) -> None:
        from types import SimpleNamespace

        from prometheus_client import CollectorRegistry, generate_latest

        from llmport_agent.ops.metrics import AgentCollector

        Quiet(self, NVMLGPUSource)
        fake, source = sync_source()
        snap = source.snapshot()
        source.wait_events()
        fake.inject_xid(3, 79)
        fake.inject_xid(3, 13)
        fake.inject_xid(3, 13)
        source.wait_events()
        monitor = GPUHealthMonitor(Clock(), source, SynchronousRunner())
        agent = SimpleNamespace(
            collector=SimpleNamespace(last_gpu=snap.with_health(source.health()),
                                      gpu_source_errors=0, gpu_device_errors=0),
            gpu_monitor=monitor,
        )
        collector = AgentCollector(agent)

        class View:
            def collect(self) -> Any:
                yield from collector._gpus(agent)
                yield from collector._gpu_monitor(agent)

        registry = CollectorRegistry(auto_describe=False)
        registry.register(View())  # type: ignore[arg-type]
        text = generate_latest(registry).decode()
        uuid, name = fake.gpus[3].uuid, fake.gpus[3].name
        self.assertIn(f'llmport_agent_gpu_health{{gpu="3",name="{name}",state="unhealthy",uuid="{uuid}"}} 1.0', text)
        self.assertIn(f'llmport_agent_gpu_health{{gpu="3",name="{name}",state="healthy",uuid="{uuid}"}} 0.0', text)
        self.assertIn(f'llmport_agent_gpu_health{{gpu="2",name="{name}",state="healthy",'
                      f'uuid="{fake.gpus[2].uuid}"}} 1.0', text)
        self.assertIn(f'llmport_agent_gpu_xid_errors_total{{gpu="3",name="{name}",uuid="{uuid}",xid="13"}} 2.0', text)
        self.assertIn(f'llmport_agent_gpu_xid_errors_total{{gpu="3",name="{name}",uuid="{uuid}",xid="79"}} 1.0', text)
        self.assertIn("llmport_agent_gpu_unhealthy 1.0", text)
        self.assertIn("llmport_agent_gpu_driver_events_total", text)
