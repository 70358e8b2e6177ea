"""
Quiet at idle (issue 27): every timer earns its wake-up and no thread is started per attempt.

Each test drives one behaviour with a task.Clock over hours of reactor time and counts what
ran: a timer put back at its old period (the outbox's 0.5 s flush, the 1 s lateness probe,
the 2 s GPU event retry, the 10 s health check without NVML, the web site's 1 s date) or a
thread started per call turns it red.
"""

from __future__ import annotations

import os
import threading
from typing import Any
from unittest import SkipTest

from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmport_agent.demo.testing import FakeSession, SynchronousRunner
from llmport_agent.events.outbox import EventOutbox
from llmport_agent.host.sdnotify import Notifier, NotifyService
from llmport_agent.inventory import nvml
from llmport_agent.inventory.fakes import h100_node
from llmport_agent.inventory.monitor import GPUHealthMonitor
from llmport_agent.inventory.nvml import NVMLGPUSource
from llmport_agent.inventory.watchdog import WatchdogPool
from llmport_agent.ops.endpoint import OpsService
from llmport_agent.ops.metrics import ReactorLatenessProbe
from llmport_agent.session.reporting import HeartbeatReporter
from llmport_agent.workloads.engine import DockerEngine

HOUR = 3600.0


def record_delays(clock: Clock) -> list[float]:
    """The delays of every timer scheduled on C{clock} from now on (in order)."""
    scheduled: list[float] = []
    real = clock.callLater

    def counting(delay: float, *a: Any, **kw: Any) -> Any:
        scheduled.append(delay)
        return real(delay, *a, **kw)

    clock.callLater = counting  # type: ignore[method-assign]
    return scheduled


def advance(clock: Clock, seconds: float, step: float = 0.25) -> None:
    """Move the clock on in small steps (every timer due on the way runs at its time)."""
    for _ in range(int(seconds / step)):
        clock.advance(step)


async def watch_moved(test: TestCase, reactor: Any, watch: Any, check: Any) -> None:
    """Until C{check()} holds on the real reactor (a real inotify watch moving), 10 s at most."""
    from twisted.internet.task import deferLater

    for _ in range(1000):
        if check():
            return
        await deferLater(reactor, 0.01, lambda: None)
    test.fail(f"the watch did not move (watching {watch.watched!r}, active {watch.active})")


class _NoLibrary(Exception):
    """What pynvml raises without libnvidia-ml (NVML_ERROR_LIBRARY_NOT_FOUND)."""

    value = 12


class _CountingSource(NVMLGPUSource):
    """An NVML source that counts the waits and checks the monitor asks for."""

    waits = 0
    checks = 0

    def wait_events(self, *args: Any, **kwargs: Any) -> Any:
        self.waits += 1
        return super().wait_events(*args, **kwargs)

    def check_health(self) -> None:
        self.checks += 1
        super().check_health()


class NoNVMLTests(SynchronousTestCase):
    """A host without libnvidia-ml: NVML is unusable until the library appears, looked at rarely."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.library = False
        self.node = h100_node()
        self.node.wait_mode = "immediate"

        def importer() -> Any:
            if not self.library:
                raise _NoLibrary("NVML Shared Library Not Found")
            return self.node

        self.source = _CountingSource(
            None, self.clock.seconds, importer=importer, pool=WatchdogPool("t", synchronous=True)
        )
        self.monitor = GPUHealthMonitor(self.clock, self.source, SynchronousRunner(), interval=10)
        self.monitor.startService()
        self.addCleanup(self.monitor.stopService)

    def test_no_event_wait_retries_without_the_library(self) -> None:
        """Before: a wait every 2 s for ever (1800 an hour). Now: the first one only."""
        advance(self.clock, HOUR, step=1)
        self.assertEqual(self.source.events_state, "unavailable")
        self.assertLessEqual(self.source.waits, 2)
        self.assertEqual(self.monitor.metrics()["events"], "unavailable")

    def test_health_checks_back_off_with_the_library_retries(self) -> None:
        """Before: a check every 10 s (360 an hour). Now: when NVML would try again (30 s doubling)."""
        advance(self.clock, HOUR, step=1)
        # 30, 60, 120, 240, 480, 960, 1800 s: 8 checks in the first hour with the first one.
        self.assertLessEqual(self.source.checks, 10)
        self.assertTrue(self.source.failing)
        checks = self.source.checks
        advance(self.clock, 2 * HOUR, step=5)
        self.assertLessEqual(self.source.checks - checks, 5)  # capped at one per 30 minutes

    def test_library_appears(self) -> None:
        """A driver installed later: the next check initialises NVML and the event waits resume."""
        advance(self.clock, 100, step=1)
        self.assertEqual(self.source.events_state, "unavailable")
        self.library = True
        advance(self.clock, 1900, step=1)  # within the back-off (at most 30 minutes)
        self.assertFalse(self.source.failing)
        self.assertEqual(self.source.events_state, "ok")
        waits = self.source.waits
        advance(self.clock, 10, step=0.5)
        self.assertGreater(self.source.waits, waits)  # listening again


class QuietGPUEventWaitTests(SynchronousTestCase):
    """
    On a GPU host, one event wait goes around on its thread (C{wait_rounds} short waits, about
    30 s) instead of coming back to the reactor empty twice a second.
    """

    def source(self) -> tuple[Any, NVMLGPUSource]:
        node = h100_node()
        node.wait_mode = "immediate"  # no event: each short wait times out at once
        source = NVMLGPUSource(node, pool=WatchdogPool("t", synchronous=True))
        source.snapshot()
        return node, source

    def test_rounds_on_the_thread(self) -> None:
        node, source = self.source()
        batch = source.wait_events(500, 100, 60)
        self.assertEqual((batch.state, batch.count), ("ok", 0))
        self.assertEqual(node.called("nvmlEventSetWait"), 60)

    def test_an_event_ends_the_rounds(self) -> None:
        node, source = self.source()
        source.wait_events(500, 100, 1)  # registers the event set
        before = node.called("nvmlEventSetWait")
        node.inject_xid(1, 79)
        batch = source.wait_events(500, 100, 60)
        self.assertEqual(batch.count, 1)
        self.assertLessEqual(node.called("nvmlEventSetWait") - before, 2)  # the event, then "no more"

    def test_stop_ends_the_rounds(self) -> None:
        node, source = self.source()
        source.wait_events(500, 100, 1)
        before = node.called("nvmlEventSetWait")
        stop = threading.Event()
        stop.set()
        source.wait_events(500, 100, 60, stop)
        self.assertEqual(node.called("nvmlEventSetWait") - before, 1)

    def test_monitor_asks_for_the_rounds_and_stops_them(self) -> None:
        seen: list[tuple[Any, ...]] = []

        class Spy(NVMLGPUSource):
            def wait_events(self, *args: Any, **kwargs: Any) -> Any:
                seen.append(args)
                return super().wait_events(*args, **kwargs)

        node = h100_node()
        node.wait_mode = "immediate"
        clock = Clock()
        monitor = GPUHealthMonitor(clock, Spy(node, pool=WatchdogPool("t", synchronous=True)),
                                   SynchronousRunner())
        monitor.startService()
        clock.advance(0)
        stop = seen[0][3]
        self.assertEqual(seen[0][:3], (500, 100, 60))
        self.assertFalse(stop.is_set())
        monitor.stopService()
        self.assertTrue(stop.is_set())


class NoBindingsImportTests(SynchronousTestCase):
    """Without libnvidia-ml the NVML bindings (pynvml, about 2 MiB) are not imported at all."""

    def test_library_checked_before_the_import(self) -> None:
        imported: list[str] = []

        def no_library(name: str) -> Any:
            raise OSError(f"{name}: cannot open shared object file")

        self.patch(nvml.ctypes, "CDLL", no_library)
        self.patch(nvml.importlib, "import_module", lambda name: imported.append(name))
        source = NVMLGPUSource(pool=WatchdogPool("t", synchronous=True))
        snapshot = source.snapshot()
        self.assertEqual(imported, [])
        self.assertIn("libnvidia-ml.so.1", snapshot.gpu_error)
        self.assertIn("no NVIDIA driver is installed", snapshot.gpu_error)

    def test_imported_once_the_library_loads(self) -> None:
        imported: list[str] = []
        self.patch(nvml.ctypes, "CDLL", lambda name: object())
        self.patch(nvml.importlib, "import_module", lambda name: imported.append(name) or h100_node())
        source = NVMLGPUSource(pool=WatchdogPool("t", synchronous=True))
        source.snapshot()
        self.assertEqual(imported, ["pynvml"])
        self.assertFalse(source.failing)


class WatchdogThreadTests(SynchronousTestCase):
    """Calls on the watchdog pool reuse its threads: no thread per call."""

    def test_sequential_calls_share_one_thread(self) -> None:
        pool = WatchdogPool("reuse", max_threads=4)
        self.addCleanup(pool.close)
        names = []
        for _ in range(50):
            job = pool.submit(lambda: threading.current_thread().name, deadline=10)
            names.append(job.future.result(timeout=10))
        self.assertEqual(pool.threads_started, 1)
        self.assertEqual(set(names), {"reuse-1"})

    def test_concurrent_calls_are_bounded_and_reused(self) -> None:
        pool = WatchdogPool("wide", max_threads=3)
        self.addCleanup(pool.close)
        for _ in range(5):
            gate = threading.Event()
            jobs = [pool.submit(gate.wait, 10, deadline=10) for _ in range(3)]
            gate.set()
            for job in jobs:
                job.future.result(timeout=10)
        self.assertEqual(pool.threads_started, 3)

    def test_close_ends_idle_workers(self) -> None:
        pool = WatchdogPool("closing", max_threads=2)
        pool.submit(lambda: None, deadline=10).future.result(timeout=10)
        worker = next(t for t in threading.enumerate() if t.name == "closing-1")
        pool.close()
        worker.join(10)
        self.assertFalse(worker.is_alive())


class OutboxTimerTests(SynchronousTestCase):
    """The event outbox schedules nothing while there is nothing to send."""

    def make(self) -> tuple[Clock, FakeSession, EventOutbox]:
        d = self.mktemp()
        os.makedirs(d)
        clock, session = Clock(), FakeSession()
        box = EventOutbox(clock, SynchronousRunner(), os.path.join(d, "events.jsonl"), session)
        self.successResultOf(box.load())
        box.startService()
        self.addCleanup(box.stopService)
        return clock, session, box

    def test_empty_outbox_has_no_timer(self) -> None:
        clock, session, box = self.make()
        box.session_opened()
        self.assertEqual(clock.getDelayedCalls(), [])
        clock.advance(HOUR)
        self.assertEqual(session.frames, [])

    def test_emit_schedules_one_flush_then_nothing(self) -> None:
        clock, session, box = self.make()
        box.emit("a", {})
        box.emit("b", {})
        [call] = clock.getDelayedCalls()
        self.assertAlmostEqual(call.getTime(), 0.5)
        clock.advance(0.5)
        [frame] = session.of_type("event_batch")
        self.assertEqual([e["event_type"] for e in frame["events"]], ["a", "b"])
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_lost_batch_goes_again_at_the_next_connect(self) -> None:
        clock, session, box = self.make()
        session.auto_confirm = False
        box.emit("a", {})
        clock.advance(0.5)
        session.disconnect()
        self.assertEqual(clock.getDelayedCalls(), [])  # nothing to do until a connect
        clock.advance(HOUR)
        session.connected = True
        session.auto_confirm = True
        box.session_opened()
        self.assertEqual(len(session.of_type("event_batch")), 2)
        self.assertEqual(box.depth, 0)

    def test_refused_send_while_connected_is_retried(self) -> None:
        clock, session, box = self.make()
        refused = [True]
        send = session.send
        session.send = lambda frame: False if refused[0] else send(frame)  # type: ignore[method-assign]
        box.emit("a", {})
        clock.advance(0.5)
        self.assertEqual(len(clock.getDelayedCalls()), 1)
        refused[0] = False
        clock.advance(0.5)
        self.assertEqual(len(session.of_type("event_batch")), 1)
        self.assertEqual(clock.getDelayedCalls(), [])


class LatenessProbeTests(SynchronousTestCase):
    """The reactor lateness probe measures the heartbeat's ticks, not a timer of its own."""

    def test_no_own_wake_ups_while_heartbeats_run(self) -> None:
        clock = Clock()
        probe = ReactorLatenessProbe(clock)
        probe.startService()
        self.addCleanup(probe.stopService)
        session = FakeSession()
        heartbeat = HeartbeatReporter(clock, session, 15, lambda: {"status": "healthy"},
                                      on_lateness=probe.observe)
        heartbeat.startService()
        self.addCleanup(heartbeat.stopService)
        probe.session_opened()
        heartbeat.session_opened()
        self.assertEqual(len(clock.getDelayedCalls()), 1)  # the heartbeat's loop only
        advance(clock, HOUR, step=0.5)
        ticks = len(session.of_type("heartbeat"))
        self.assertEqual(ticks, 241)
        # Every observation is a heartbeat tick (the first has no expected time): none of its own.
        self.assertEqual(probe.observed, ticks - 1)

    def test_own_timer_only_while_disconnected(self) -> None:
        clock = Clock()
        probe = ReactorLatenessProbe(clock)
        probe.startService()
        self.addCleanup(probe.stopService)
        advance(clock, HOUR, step=0.5)
        self.assertEqual(probe.observed, 60)  # once a minute, not once a second
        clock.advance(65)  # due at 3660, runs at 3665
        self.assertAlmostEqual(probe.take_max(), 5.0)
        probe.session_opened()
        self.assertEqual(clock.getDelayedCalls(), [])
        observed = probe.observed
        clock.advance(HOUR)
        self.assertEqual(probe.observed, observed)
        probe.session_closed()
        advance(clock, 600, step=1)
        self.assertEqual(probe.observed, observed + 10)


class OpsSiteTimerTests(SynchronousTestCase):
    """The ops endpoint's web site keeps no access-log date timer (its log never reads it)."""

    def test_no_date_timer(self) -> None:
        clock = MemoryReactorClock()
        ops = OpsService(clock, agent=object(), port=9464)
        ops.startService()
        self.addCleanup(ops.stopService)
        site = ops.site
        assert site is not None
        site.doStart()  # what the listening port does when it starts
        self.addCleanup(site.doStop)
        self.assertEqual(clock.getDelayedCalls(), [])
        clock.advance(60)
        self.assertEqual(clock.getDelayedCalls(), [])


class SystemdStatusTests(SynchronousTestCase):
    """Under systemd the status line rides on the watchdog's pings: no 5 s status timer."""

    def test_status_on_pings_and_connects_only(self) -> None:
        clock = Clock()
        sent: list[str] = []
        notifier = Notifier({"NOTIFY_SOCKET": "/run/test/notify", "WATCHDOG_USEC": "60000000"}, pid=1)
        self.patch(notifier, "notify", lambda *parts: sent.append("\n".join(parts)) or True)
        status = {"text": "connecting, node -"}
        svc = NotifyService(clock, notifier, lambda: status["text"])
        svc.startService()
        self.addCleanup(svc.stopService)
        svc.ready()
        self.assertEqual(len(clock.getDelayedCalls()), 1)  # the watchdog's loop, nothing else
        status["text"] = "connected, node n-1"
        svc.session_opened()  # said at once
        self.assertEqual(sent[-1], "STATUS=connected, node n-1")
        status["text"] = "connected, node n-1, 1 commands running"
        clock.advance(30)  # the next ping looks at the line
        self.assertEqual(sent[-2:], ["WATCHDOG=1", "STATUS=connected, node n-1, 1 commands running"])
        before = len(sent)
        advance(clock, HOUR, step=1)
        self.assertEqual(len(sent) - before, 120)  # pings only: the line did not change

    def test_without_watchdog_every_30_s(self) -> None:
        clock = Clock()
        notifier = Notifier({"NOTIFY_SOCKET": "/run/test/notify"}, pid=1)
        looked: list[int] = []
        svc = NotifyService(clock, notifier, lambda: str(looked.append(1)))
        svc.startService()
        self.addCleanup(svc.stopService)
        svc.ready()
        advance(clock, HOUR, step=1)
        self.assertEqual(len(looked), 1 + 120)


class NoEngineSocketTests(SynchronousTestCase):
    """No engine socket: the probe says so without a thread (the timer is its only wake-up)."""

    def test_probe_without_a_socket_uses_no_thread(self) -> None:
        from tests.test_workloads_engine import ADDR, FakeDocker, SyncPool

        clock, fake = Clock(), FakeDocker()
        exists = [False]
        engine = DockerEngine(clock, environ={"DOCKER_HOST": ADDR}, client_factory=fake,
                              socket_exists=lambda path: exists[0] and path == ADDR[len("unix://"):])
        pool = SyncPool()
        engine._short = pool  # type: ignore[assignment]
        engine._streams = SyncPool()  # type: ignore[assignment]
        engine.startService()
        self.addCleanup(engine.stopService)
        advance(clock, HOUR, step=1)
        self.assertFalse(engine.available)
        self.assertEqual(
            engine.last_error,
            f"Docker engine at {ADDR} is unreachable: the socket does not exist (is dockerd running?)",
        )
        self.assertEqual((pool.calls, fake.created), (0, 0))
        exists[0] = True  # dockerd started
        advance(clock, 31, step=1)
        self.assertTrue(engine.available)
        self.assertEqual(pool.calls, 1)

    def test_calls_without_a_socket_use_no_thread(self) -> None:
        from llmport_agent.workloads.engine import EngineError, StreamControl
        from tests.test_workloads_engine import ADDR, FakeDocker, SyncPool

        clock, fake = Clock(), FakeDocker()
        engine = DockerEngine(clock, environ={"DOCKER_HOST": ADDR}, client_factory=fake,
                              socket_exists=lambda path: False)
        short, streams = SyncPool(), SyncPool()
        engine._short = short  # type: ignore[assignment]
        engine._streams = streams  # type: ignore[assignment]
        engine.startService()
        self.addCleanup(engine.stopService)
        for _ in range(3):
            err = self.failureResultOf(
                ensureDeferred(engine.call(lambda client: None, what="list containers")), EngineError
            ).value
            self.assertTrue(err.unreachable)
            self.assertEqual(
                err.error_message,
                f"list containers failed: Docker engine at {ADDR} is unreachable: the socket does "
                "not exist (is dockerd running?)",
            )
            self.failureResultOf(
                ensureDeferred(engine.stream(lambda client, control: None, StreamControl(), what="events")),
                EngineError,
            )
        self.assertEqual((short.calls, streams.calls, fake.created), (0, 0, 0))
        # The node's engine error reads as the probe's, whichever call found the socket missing.
        self.assertEqual(
            engine.last_error,
            f"Docker engine at {ADDR} is unreachable: the socket does not exist (is dockerd running?)",
        )


LAZY_PROBE = r"""
import sys
from twisted.internet.defer import ensureDeferred
from twisted.internet.task import Clock
import llmport_agent.workloads.handlers, llmport_agent.workloads.health
import llmport_agent.workloads.adoption, llmport_agent.workloads.exits
import llmport_agent.workloads.images, llmport_agent.workloads.imageload
import llmport_agent.workloads.servelogs, llmport_agent.workloads.diagnostics
import llmport_agent.ray.handlers, llmport_agent.ray.container, llmport_agent.ray.imagepin
import llmport_agent.ray.execs
from llmport_agent.workloads.engine import DockerEngine, translate_error
engine = DockerEngine(Clock(), environ={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
translate_error("ping", engine.address, FileNotFoundError(2, "gone"), 1.0)
print("before", "docker" in sys.modules, "requests" in sys.modules)
engine._client("probe")
print("after", "docker" in sys.modules, "requests" in sys.modules)
"""


class LazyDockerImportTests(SynchronousTestCase):
    """docker-py (with requests, ~7 MiB) is imported when the first engine client is made."""

    def test_not_imported_until_a_client_is_made(self) -> None:
        import subprocess
        import sys

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=root)
        out = subprocess.run([sys.executable, "-c", LAZY_PROBE], env=env, capture_output=True,
                             text=True, timeout=120, check=False)
        self.assertEqual(out.returncode, 0, out.stderr[-2000:])
        self.assertEqual(out.stdout.split("\n")[:2], ["before False False", "after True True"])

    def test_tls_settings_read_at_start(self) -> None:
        from docker.errors import TLSParameterError

        # A wrong TLS setting is said when the engine is made (docker-py reads it), as before.
        with self.assertRaises(TLSParameterError):
            DockerEngine(Clock(), environ={"DOCKER_HOST": "tcp://127.0.0.1:2376",
                                           "DOCKER_CERT_PATH": "/nonexistent/certs",
                                           "DOCKER_TLS_VERIFY": "1"})

    def test_lazy_module(self) -> None:
        from llmport_agent.core.lazyimport import LazyModule

        lazy = LazyModule("json")
        self.assertEqual(lazy.dumps([1]), "[1]")
        self.assertTrue(lazy.loaded())
        self.assertIs(lazy.module(), __import__("json"))


class InventorySectionDeadlineTests(SynchronousTestCase):
    """
    One timer bounds all of a round's inventory sections: each timer the round left behind
    (cancelled once its section answered) woke the reactor at its time, once a round.
    """

    def make(self, sections: dict[str, Any]) -> tuple[Clock, Any]:
        from llmport_agent.inventory.collector import InventoryCollector
        from llmport_agent.inventory.gpu import NoGPUSource
        from tests.test_inventory_vllm import SyncRunner

        clock = Clock()
        state = self.mktemp()
        os.makedirs(state)
        collector = InventoryCollector(clock, SyncRunner(), NoGPUSource(), state_dir=state,
                                       model_store=None, sections=sections, section_timeout=30.0)
        return clock, collector

    def test_one_deadline_for_all_sections(self) -> None:
        from twisted.internet.defer import Deferred, succeed

        pending: dict[str, Deferred[Any]] = {n: Deferred() for n in ("a", "b", "c")}
        clock, collector = self.make({n: (lambda n=n: pending[n]) for n in pending})
        d = Deferred.fromCoroutine(collector.collect())
        self.assertEqual([c.getTime() for c in clock.getDelayedCalls()], [30.0])
        pending["a"].callback(1)
        pending["b"].callback(2)
        clock.advance(30)  # "c" never answers: cut off at the round's deadline
        report = self.successResultOf(d)
        self.assertEqual((report.inventory.get("a"), report.inventory.get("b")), (1, 2))
        self.assertNotIn("c", report.inventory)
        self.assertEqual(clock.getDelayedCalls(), [])
        # A round whose sections all answer leaves one cancelled timer, not one per section.
        clock2, collector2 = self.make({n: (lambda: succeed(0)) for n in ("a", "b", "c")})
        scheduled = record_delays(clock2)
        for _ in range(10):
            self.successResultOf(Deferred.fromCoroutine(collector2.collect()))
        self.assertEqual(scheduled.count(30.0), 10)


class HeartbeatChangeTimerTests(SynchronousTestCase):
    """
    The inventory's report calls the heartbeat's notify_changed; on the minute it comes right
    after the heartbeat of the same tick. Nothing changed: no timer for the change gap (it woke
    the reactor once a minute to find nothing to send).
    """

    def test_no_timer_when_nothing_changed(self) -> None:
        clock, session = Clock(), FakeSession()
        fields: dict[str, Any] = {"status": "healthy", "capabilities": {}}
        hb = HeartbeatReporter(clock, session, 15, lambda: dict(fields), min_change_gap=1.0)
        hb.startService()
        self.addCleanup(hb.stopService)
        hb.session_opened()
        loop_only = len(clock.getDelayedCalls())
        for _ in range(60):  # an hour of inventories right after a heartbeat
            clock.advance(60)
            hb.notify_changed()
            self.assertEqual(len(clock.getDelayedCalls()), loop_only)
        fields["status"] = "degraded"  # a real change within the gap still goes at its end
        hb.notify_changed()
        self.assertEqual(len(clock.getDelayedCalls()), loop_only + 1)
        clock.advance(1)
        self.assertEqual(session.of_type("heartbeat")[-1]["status"], "degraded")


class WakeRecorder:
    """
    Records the time of every timer scheduled on a Clock, cancelled or not: the real reactor
    keeps a cancelled call in its heap and wakes at its time all the same.
    """

    def __init__(self, clock: Clock) -> None:
        self.times: set[float] = set()
        real = clock.callLater

        def recording(delay: float, *a: Any, **kw: Any) -> Any:
            call = real(delay, *a, **kw)
            self.times.add(round(call.getTime(), 6))
            return call

        clock.callLater = recording  # type: ignore[method-assign]

    def between(self, start: float, end: float) -> list[float]:
        return sorted(t for t in self.times if start < t <= end)


class _Link:
    """A connection as the keep-alive sees it: a pong adds bytes while the peer answers."""

    def __init__(self) -> None:
        self.bytes_received = 0
        self.answering = True
        self.pings = 0
        self.dropped: list[str] = []

    def send_keepalive_ping(self) -> bool:
        if self.dropped:
            return False
        self.pings += 1
        if self.answering:
            self.bytes_received += 19
        return True

    def drop_unanswered(self, reason: str) -> None:
        self.dropped.append(reason)


class KeepAliveTickTests(SynchronousTestCase):
    """
    The stream's keep-alive rides the heartbeat's tick: no ping timer and no pong timeout of its
    own (Autobahn's 20 s auto-ping woke the reactor 6 times a minute: its ping, and its pong
    timeout, cancelled but still in the heap), and a dead link is still dropped within 30 s.
    """

    def make(self, interval: float = 15, build: Any = None) -> tuple[Clock, WakeRecorder, Any, _Link, FakeSession]:
        from llmport_agent.session.keepalive import KeepAlive

        clock, session, link = Clock(), FakeSession(), _Link()
        wakes = WakeRecorder(clock)
        keepalive = KeepAlive(clock)
        keepalive.opened(link)
        hb = HeartbeatReporter(clock, session, interval, build or (lambda: {"status": "healthy"}),
                               on_tick=keepalive.tick)
        hb.startService()
        self.addCleanup(hb.stopService)
        hb.session_opened()
        return clock, wakes, keepalive, link, session

    def test_no_wake_up_of_its_own(self) -> None:
        clock, wakes, keepalive, link, session = self.make()
        advance(clock, HOUR, step=1)
        ticks = [15.0 * n for n in range(1, 241)]
        self.assertEqual(wakes.between(0, HOUR), ticks)  # the heartbeat's ticks, nothing else
        self.assertEqual(link.pings, 241)  # one per heartbeat, the one at the connect included
        self.assertEqual(len(session.of_type("heartbeat")), 241)
        self.assertEqual((link.dropped, keepalive.dropped), ([], 0))

    def test_dead_link_dropped_within_two_ticks(self) -> None:
        clock, wakes, keepalive, link, session = self.make()
        advance(clock, 100, step=1)
        link.answering = False  # the peer is gone silently: a half-open connection
        died = clock.seconds()
        while not link.dropped and clock.seconds() < died + 120:
            clock.advance(1)
        self.assertEqual(len(link.dropped), 1)
        self.assertLessEqual(clock.seconds() - died, 30)
        self.assertIn("keep-alive ping not answered in 15 s", link.dropped[0])
        self.assertEqual(keepalive.dropped, 1)

    def test_any_byte_received_is_an_answer(self) -> None:
        clock, wakes, keepalive, link, session = self.make()
        link.answering = False
        for _ in range(40):  # a long frame arriving slowly: bytes, but no pong yet
            clock.advance(15)
            link.bytes_received += 1000
        self.assertEqual(link.dropped, [])

    def test_a_pong_waiting_behind_a_late_tick_is_an_answer(self) -> None:
        """
        The reactor was busy past a tick: the tick runs before the socket is read, with the
        pong waiting there. The verdict waits for one more pass over the sockets.
        """
        from llmport_agent.session.keepalive import KeepAlive

        clock, link = Clock(), _Link()
        keepalive = KeepAlive(clock)
        keepalive.opened(link)
        link.answering = False
        keepalive.tick()  # the ping
        clock.advance(40)
        keepalive.tick()  # late: nothing read yet
        self.assertEqual(link.dropped, [])
        link.bytes_received += 19  # the reads of that pass: the pong was there
        clock.advance(0)
        self.assertEqual((link.dropped, link.pings), ([], 2))  # and the next ping went
        clock.advance(10)
        keepalive.tick()
        clock.advance(0)  # nothing came this time: dropped
        self.assertEqual(len(link.dropped), 1)

    def test_short_heartbeat_gives_a_ping_10_s(self) -> None:
        """
        HEARTBEAT_INTERVAL_SEC=1: a pong that takes 5 s (a slow link, a busy backend) is not a
        dead link; the ticks in between send no other ping; a dead link is still dropped soon.
        """
        clock, wakes, keepalive, link, session = self.make(interval=1)
        link.answering = False
        pings = link.pings  # the one at the connect, unanswered so far
        for _ in range(5):
            clock.advance(1)
        self.assertEqual((link.dropped, link.pings), ([], pings))  # no verdict, no second ping
        link.bytes_received += 19  # the pong, 5 s late
        link.answering = True
        advance(clock, 60, step=1)
        self.assertEqual(link.dropped, [])  # it counted
        self.assertLessEqual(link.pings, pings + 7)  # one per 10 s, not one a second
        link2 = _Link()
        keepalive.opened(link2)
        link2.answering = False
        died = clock.seconds()
        while not link2.dropped and clock.seconds() < died + 60:
            clock.advance(1)
        self.assertEqual(len(link2.dropped), 1)
        self.assertLessEqual(clock.seconds() - died, 21)

    def test_slow_heartbeat_still_ticks_every_15_s(self) -> None:
        """HEARTBEAT_INTERVAL_SEC=60: the loop ticks every 15 s, a heartbeat every 4th tick."""
        clock, wakes, keepalive, link, session = self.make(interval=60)
        advance(clock, HOUR, step=1)
        self.assertEqual(wakes.between(0, HOUR), [15.0 * n for n in range(1, 241)])
        self.assertEqual(len(session.of_type("heartbeat")), 61)
        link.answering = False
        died = clock.seconds()
        while not link.dropped and clock.seconds() < died + 200:
            clock.advance(1)
        self.assertLessEqual(clock.seconds() - died, 30)

    def test_tick_goes_on_when_the_heartbeat_is_not_sent(self) -> None:
        """A heartbeat that fails to build (or a refused send) does not stop the keep-alive."""

        def broken() -> dict[str, Any]:
            raise RuntimeError("no fields")

        clock, wakes, keepalive, link, session = self.make(build=broken)
        session.connected = False  # and the session refuses frames
        advance(clock, 60, step=1)
        self.assertEqual(link.pings, 5)
        link.answering = False
        advance(clock, 30, step=1)
        self.assertEqual(len(link.dropped), 1)
        self.flushLoggedErrors(RuntimeError)

    def test_a_failing_tick_listener_does_not_stop_the_loop(self) -> None:
        clock, session = Clock(), FakeSession()

        def boom() -> None:
            raise RuntimeError("tick listener")

        hb = HeartbeatReporter(clock, session, 15, lambda: {"status": "healthy"}, on_tick=boom,
                               on_lateness=lambda late: boom())
        hb.startService()
        self.addCleanup(hb.stopService)
        hb.session_opened()
        advance(clock, 150, step=1)
        self.assertEqual(len(session.of_type("heartbeat")), 11)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 21)

    def test_session_turns_autobahn_auto_ping_off(self) -> None:
        """The stream's factory is built without Autobahn's auto-ping (and its pong timeout)."""
        from twisted.internet.defer import succeed
        from twisted.internet.endpoints import TCP4ClientEndpoint

        from llmport_agent.core.config import load_config
        from llmport_agent.core.state import StateStore
        from llmport_agent.session import service as session_service
        from llmport_agent.session.protocol import AgentClientFactory
        from tests.test_session import CRED, FakeBackend

        options: list[dict[str, Any]] = []

        class Recording(AgentClientFactory):
            def setProtocolOptions(self, **kw: Any) -> None:  # type: ignore[override]
                options.append(kw)
                super().setProtocolOptions(**kw)

        self.patch(session_service, "AgentClientFactory", Recording)
        reactor = MemoryReactorClock()
        config = load_config({"LLM_PORT_NODE_AGENT_BACKEND_URL": "http://127.0.0.1:8000"}, {})
        d = self.mktemp()
        os.makedirs(d)
        state = StateStore(SynchronousRunner(), os.path.join(d, "state.json"))
        self.successResultOf(state.load())
        self.successResultOf(state.update(credential=CRED, node_id="n1"))
        svc = session_service.SessionService(
            reactor, config, state, FakeBackend(),  # type: ignore[arg-type]
            lambda: succeed({}), lambda code, msg: None, version="0.1.0",
            endpoint_factory=lambda host, port, tls: TCP4ClientEndpoint(reactor, host, port),
        )
        svc.startService()
        self.addCleanup(svc.stopService)
        self.assertEqual(len(reactor.tcpClients), 1)
        self.assertEqual(len(options), 1)
        self.assertEqual(options[0].get("autoPingInterval", 0), 0)
        self.assertEqual(options[0].get("autoPingTimeout", 0), 0)


class _FakeWatch:
    def __init__(self, path: str, appeared: Any, lost: Any) -> None:
        self.path, self.appeared, self.lost, self.active = path, appeared, lost, True

    def stop(self) -> None:
        self.active = False


class EngineSocketWatchTests(SynchronousTestCase):
    """
    No engine socket: the agent is told when it appears (inotify on its directory) instead of
    probing every 30 s; the probe goes on at a slow back-off (up to 10 minutes) as a safety net.
    """

    def make(self, watches: list[_FakeWatch] | None, exists: list[bool],
             inotify: list[bool] | None = None) -> tuple[Clock, WakeRecorder, Any, Any]:
        from tests.test_workloads_engine import ADDR, FakeDocker, SyncPool

        clock, fake = Clock(), FakeDocker()
        wakes = WakeRecorder(clock)

        def watch(path: str, appeared: Any, lost: Any) -> _FakeWatch | None:
            if watches is None or (inotify is not None and not inotify[0]):
                return None  # no inotify here
            w = _FakeWatch(path, appeared, lost)
            watches.append(w)
            return w

        engine = DockerEngine(clock, environ={"DOCKER_HOST": ADDR}, client_factory=fake,
                              socket_exists=lambda path: exists[0], watch_socket=watch)
        pool = SyncPool()
        engine._short = pool  # type: ignore[assignment]
        engine._streams = SyncPool()  # type: ignore[assignment]
        engine.startService()
        self.addCleanup(engine.stopService)
        return clock, wakes, engine, pool

    def test_watched_not_probed_every_30_s(self) -> None:
        watches: list[_FakeWatch] = []
        exists = [False]
        clock, wakes, engine, pool = self.make(watches, exists)
        advance(clock, HOUR, step=1)
        self.assertEqual([w.path for w in watches], ["/run/test/docker.sock"])  # one watch, kept
        self.assertTrue(watches[0].active)
        # Every 600 s as a safety net (at 30 s: 130 in the first hour).
        probes = wakes.between(1, HOUR)  # after the first, at the start
        self.assertEqual(len(probes), 5)
        self.assertEqual({b - a for a, b in zip([1.0, *probes], probes, strict=False)}, {600.0})
        self.assertFalse(engine.available)
        exists[0] = True  # dockerd made its socket: inotify says so
        watches[0].appeared()
        clock.advance(0)
        self.assertTrue(engine.available)
        self.assertEqual(pool.calls, 1)

    def test_lost_watch_back_to_the_30_s_back_off(self) -> None:
        """
        The watch ends without the socket appearing (its directory deleted and the descriptor
        lost, no inotify watch left): probed within 30 s again, not at the 600 s safety net, and
        watched again at the next probe that finds the socket missing.
        """
        from twisted.logger import globalLogPublisher

        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        watches: list[_FakeWatch] = []
        exists = [False]
        clock, wakes, engine, pool = self.make(watches, exists)
        advance(clock, 1000, step=1)  # watched: on the 600 s back-off
        self.assertEqual(len(watches), 1)
        self.assertEqual(wakes.between(1, 1000), [601.0])
        watches[0].active = False
        watches[0].lost("the inotify descriptor was closed")
        lost = [e for e in events if "Stopped watching" in str(e.get("log_format", ""))]
        self.assertEqual([(e["why"], e["every"]) for e in lost], [("the inotify descriptor was closed", 30.0)])
        advance(clock, 30, step=1)
        self.assertEqual(wakes.between(1001, 1030), [1030.0])  # probed within 30 s
        self.assertEqual(len(watches), 2)  # and watched again: the 600 s safety net again
        advance(clock, 700, step=1)
        # (1201: the cancelled safety-net probe, still in a real reactor's heap once)
        self.assertEqual(wakes.between(1031, 1730), [1201.0, 1630.0])
        exists[0] = True  # the socket appears: the new watch says so
        watches[1].appeared()
        clock.advance(0)
        self.assertTrue(engine.available)

    def test_lost_watch_without_a_new_one_probes_every_30_s(self) -> None:
        """A lost watch that cannot be made again (no inotify watch left): the engine is found within 30 s."""
        watches: list[_FakeWatch] = []
        exists = [False]
        inotify = [True]
        clock, wakes, engine, pool = self.make(watches, exists, inotify)
        advance(clock, 1000, step=1)
        watches[0].active = False
        inotify[0] = False  # no inotify watch left
        watches[0].lost("no watch left")
        advance(clock, HOUR, step=1)
        probes = wakes.between(1001, 1000 + HOUR)
        self.assertEqual(max(b - a for a, b in zip([1000.0, *probes], probes, strict=False)), 30.0)
        exists[0] = True
        advance(clock, 30, step=1)
        self.assertTrue(engine.available)

    def test_call_before_the_probe_watches_before_it_warns(self) -> None:
        """
        A workload call that finds the socket missing before the first probe ran: the watch is
        in place when the "unreachable" warning is said, so the warning tells the truth (checked
        as soon as the socket appears), and no line of its own follows it.
        """
        from twisted.logger import globalLogPublisher

        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        watches: list[_FakeWatch] = []
        clock, _, engine, _ = self.make(watches, [False])  # started; its first probe not run yet
        d = ensureDeferred(engine.call(lambda client: None, what="list containers"))
        self.failureResultOf(d)
        self.assertEqual(len(watches), 1)
        warned = [e for e in events if "answers; start dockerd" in str(e.get("log_format", ""))]
        self.assertEqual(len(warned), 1)
        self.assertEqual(warned[0]["when"], "as soon as its socket appears, and ")
        self.assertEqual(warned[0]["every"], 600.0)
        self.assertFalse([e for e in events if getattr(e.get("log_level"), "name", "") == "debug"])
        clock.advance(0)  # the first probe: nothing said again, the same watch kept
        self.assertEqual(len(watches), 1)
        self.assertEqual(len([e for e in events if "answers; start dockerd" in str(e.get("log_format", ""))]), 1)

    def test_without_inotify_the_old_back_off(self) -> None:
        clock, wakes, engine, pool = self.make(None, [False])
        advance(clock, HOUR, step=1)
        self.assertGreater(len(wakes.between(0, HOUR)), 100)  # every 30 s at most: found within 30 s

    def test_engine_that_went_away_with_its_socket_left_is_probed(self) -> None:
        """The socket file is there but nobody answers (dockerd restarting): the old back-off, no watch."""
        from tests.test_workloads_engine import ADDR, FakeDocker, SyncPool

        clock, fake = Clock(), FakeDocker()
        watches: list[Any] = []
        engine = DockerEngine(clock, environ={"DOCKER_HOST": ADDR}, client_factory=fake,
                              socket_exists=lambda path: True,
                              watch_socket=lambda path, cb, lost: watches.append(path))
        engine._short = SyncPool()  # type: ignore[assignment]
        engine._streams = SyncPool()  # type: ignore[assignment]
        engine.startService()
        self.addCleanup(engine.stopService)
        clock.advance(0)
        self.assertTrue(engine.available)
        fake.down = True
        engine.checkNow()
        clock.advance(0)
        self.assertFalse(engine.available)
        fake.down = False
        advance(clock, 31, step=1)
        self.assertTrue(engine.available)
        self.assertEqual(watches, [])


class RealSocketWatchTests(TestCase):
    """inotify on the nearest existing directory, moving down as the path is made."""

    timeout = 30

    def test_socket_made_under_missing_directories(self) -> None:
        import shutil
        import socket
        import tempfile

        from twisted.internet import reactor

        from llmport_agent.workloads.socketwatch import watch_socket

        root = tempfile.mkdtemp(prefix="sockwatch-")  # short: a socket path has 107 bytes at most
        self.addCleanup(shutil.rmtree, root, True)
        path = os.path.join(root, "a", "b", "docker.sock")
        seen: list[bool] = []
        done: Deferred[None] = Deferred()

        def appeared() -> None:
            seen.append(os.path.exists(path))
            done.callback(None)

        watch = watch_socket(reactor, path, appeared)
        if watch is None:
            raise SkipTest("no inotify here")
        self.addCleanup(watch.stop)
        self.assertEqual(watch.watched, root)

        async def steps() -> None:
            async def until(check: Any) -> None:
                await watch_moved(self, reactor, watch, check)

            os.mkdir(os.path.join(root, "a"))  # the watch moves down, one directory at a time
            await until(lambda: watch.watched == os.path.join(root, "a"))
            os.mkdir(os.path.join(root, "a", "b"))
            await until(lambda: watch.watched == os.path.dirname(path))
            self.assertEqual(seen, [])
            sock = socket.socket(socket.AF_UNIX)
            self.addCleanup(sock.close)
            sock.bind(path)  # dockerd made its socket
            await done

        d = Deferred.fromCoroutine(steps())
        return d.addCallback(lambda _: self.assertEqual((seen, watch.active), ([True], False)))


    def test_watched_directory_deleted_then_made_again(self) -> None:
        """
        The watched directory is deleted (a user's runtime directory at logout, a socket
        directory removed with its daemon): the watch moves back up, without an unhandled
        error or losing its inotify descriptor, and is told when the path and the socket are
        made again.
        """
        import shutil
        import socket
        import tempfile

        from twisted.internet import reactor

        from llmport_agent.workloads.socketwatch import watch_socket

        root = tempfile.mkdtemp(prefix="sockwatch-")
        self.addCleanup(shutil.rmtree, root, True)
        os.makedirs(os.path.join(root, "u", "a"))
        path = os.path.join(root, "u", "a", "docker.sock")
        seen: list[bool] = []
        lost: list[str] = []
        done: Deferred[None] = Deferred()

        def appeared() -> None:
            seen.append(os.path.exists(path))
            done.callback(None)

        watch = watch_socket(reactor, path, appeared, lost.append)
        if watch is None:
            raise SkipTest("no inotify here")
        self.addCleanup(watch.stop)
        self.assertEqual(watch.watched, os.path.dirname(path))

        async def steps() -> None:
            async def until(check: Any) -> None:
                await watch_moved(self, reactor, watch, check)

            shutil.rmtree(os.path.join(root, "u"))  # two levels gone at once
            await until(lambda: watch.watched == root)
            self.assertEqual((watch.active, lost), (True, []))
            os.mkdir(os.path.join(root, "u"))
            await until(lambda: watch.watched == os.path.join(root, "u"))
            os.mkdir(os.path.join(root, "u", "a"))
            await until(lambda: watch.watched == os.path.dirname(path))
            shutil.rmtree(os.path.join(root, "u", "a"))  # and once more, one level
            await until(lambda: watch.watched == os.path.join(root, "u"))
            os.makedirs(os.path.join(root, "u", "a"))
            await until(lambda: watch.watched == os.path.dirname(path))
            self.assertEqual(seen, [])
            sock = socket.socket(socket.AF_UNIX)
            self.addCleanup(sock.close)
            sock.bind(path)
            await done

        d = Deferred.fromCoroutine(steps())
        return d.addCallback(lambda _: self.assertEqual((seen, lost, watch.active), ([True], [], False)))


class _FakeNotifier:
    """The agent's INotify as the watch uses it; C{full}: no inotify watch left (ENOSPC)."""

    def __init__(self) -> None:
        self.full = False
        self.watches: dict[int, str] = {}
        self.closed = 0
        self.callbacks: list[Any] = []

    @property
    def watched(self) -> list[str]:
        return list(self.watches.values())

    def watch(self, path: str, mask: int, callback: Any) -> int:
        if self.full:
            raise OSError(28, "No space left on device")
        wd = len(self.callbacks) + 1
        self.watches[wd] = path
        self.callbacks.append(callback)
        return wd

    def ignore(self, wd: int) -> None:
        del self.watches[wd]

    def close(self) -> None:
        self.closed += 1


class SocketWatchLostTests(SynchronousTestCase):
    """A watch that ends without the socket appearing tells its owner; one its owner stops does not."""

    def make(self) -> tuple[_FakeNotifier, Any, list[str], list[int]]:
        from llmport_agent.workloads.socketwatch import SocketWatch

        notifier, lost, appeared = _FakeNotifier(), [], []
        dirs = {"/run", "/run/user"}
        watch = SocketWatch(notifier, "/run/user/1000/docker.sock", lambda: appeared.append(1), lost.append,
                            exists=lambda p: False, isdir=dirs.__contains__)
        self.assertTrue(watch.start())
        self.assertEqual(notifier.watched, ["/run/user"])
        return notifier, watch, lost, appeared

    def test_no_watch_left_at_an_event(self) -> None:
        notifier, watch, lost, appeared = self.make()
        notifier.full = True
        notifier.watches.clear()  # the kernel dropped the watch, and the notifier forgot it
        notifier.callbacks[0](0x8000, "")  # IN_IGNORED: the directory went away
        self.assertEqual(len(lost), 1)
        self.assertIn("no inotify watch was left", lost[0])
        self.assertEqual((watch.active, notifier.closed, appeared), (False, 1, []))

    def test_descriptor_lost(self) -> None:
        notifier, watch, lost, appeared = self.make()
        watch.notifierLost()
        self.assertEqual(lost, ["the inotify descriptor was closed"])
        self.assertFalse(watch.active)
        watch.notifierLost()  # said once
        self.assertEqual(len(lost), 1)

    def test_stopped_by_its_owner_not_lost(self) -> None:
        notifier, watch, lost, appeared = self.make()
        watch.stop()
        watch.notifierLost()  # the descriptor closing after stop()
        self.assertEqual((lost, notifier.closed, notifier.watched), ([], 1, []))


class HealthReconcileLoopTests(SynchronousTestCase):
    """
    The workload health watcher reconciles every 60 s only while the engine answers: without
    one there is nothing to reconcile (its timer woke the agent once a minute for nothing).
    """

    def test_no_loop_without_an_engine(self) -> None:
        from llmport_agent.workloads.health import HealthWatcher
        from llmport_agent.workloads.settings import WorkloadSettings
        from tests.test_workloads_engine import ADDR, FakeDocker, SyncPool

        clock, fake = Clock(), FakeDocker()
        exists = [False]
        engine = DockerEngine(clock, environ={"DOCKER_HOST": ADDR}, client_factory=fake,
                              socket_exists=lambda path: exists[0], watch_socket=lambda path, cb, lost: None,
                              probe_max=600.0)
        engine._short = SyncPool()  # type: ignore[assignment]
        engine._streams = SyncPool()  # type: ignore[assignment]
        watcher = HealthWatcher(clock, engine, WorkloadSettings(agent_id="n"), lambda *a: None)
        reconciles: list[float] = []

        async def reconcile() -> None:
            reconciles.append(clock.seconds())

        watcher.reconcile = reconcile  # type: ignore[method-assign]
        wakes = WakeRecorder(clock)
        engine.startService()
        watcher.startService()
        self.addCleanup(engine.stopService)
        self.addCleanup(watcher.stopService)
        advance(clock, HOUR, step=1)
        self.assertFalse(engine.available)
        self.assertEqual(reconciles, [])
        # The engine's own probe back-off (up to 10 minutes here) is all that is scheduled.
        self.assertLessEqual(len(wakes.between(0, HOUR)), 16)
        exists[0] = True  # the engine answers: reconciled at once, then every 60 s
        engine.checkNow()
        advance(clock, 130, step=1)
        self.assertTrue(engine.available)
        self.assertEqual(len(reconciles), 3)
        fake.down = True  # and gone again: the loop stops
        engine.checkNow()
        clock.advance(0)
        self.assertFalse(engine.available)
        count = len(reconciles)
        advance(clock, 600, step=1)
        self.assertEqual(len(reconciles), count)


class InventoryRoundTimerTests(SynchronousTestCase):
    """
    One timer per inventory round (the collector's section deadline): the reporter's own 30 s
    timeout is gone (cancelled, it still woke the reactor at its time); a hung round is
    abandoned at the loop's next tick instead.
    """

    def test_one_timer_per_round(self) -> None:
        from twisted.internet.defer import succeed

        from llmport_agent.inventory.collector import InventoryCollector
        from llmport_agent.inventory.gpu import NoGPUSource
        from llmport_agent.session.reporting import InventoryReporter
        from tests.test_inventory_vllm import SyncRunner

        clock, session = Clock(), FakeSession()
        state = self.mktemp()
        os.makedirs(state)
        collector = InventoryCollector(clock, SyncRunner(), NoGPUSource(), state_dir=state, model_store=None,
                                       sections={"a": lambda: succeed(1)}, section_timeout=30.0)
        scheduled = record_delays(clock)
        rep = InventoryReporter(clock, session, 60, collector)
        rep.startService()
        self.addCleanup(rep.stopService)
        rep.session_opened()
        advance(clock, HOUR, step=1)
        rounds = len(session.of_type("inventory"))
        self.assertEqual(rounds, 61)
        # Per round: the loop's next tick and the section deadline, nothing else.
        self.assertEqual(sorted(set(scheduled)), [30.0, 60.0])
        self.assertEqual(scheduled.count(30.0), rounds)
        self.assertEqual(len(scheduled), 2 * rounds)
