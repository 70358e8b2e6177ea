"""
The agent's parts on their own, with fakes of their inputs (no AgentService): the drain
(L{llmport_agent.agent.drain.Drain}), the start (L{llmport_agent.agent.startup.Startup}), the
node's status (L{llmport_agent.ops.status.NodeStatus}) and the inventory refresh
(L{llmport_agent.agent.refresh.InventoryRefresh}).
"""

from __future__ import annotations

import signal
from types import SimpleNamespace
from typing import Any

from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.agent.drain import Drain
from llmport_agent.agent.refresh import InventoryRefresh
from llmport_agent.agent.startup import Startup
from llmport_agent.demo.testing import SynchronousRunner
from llmport_agent.host.instance import AlreadyRunning
from llmport_agent.ops.status import NodeStatus


class FakePipeline:
    """Commands that run until the test lets them finish."""

    def __init__(self, busy: int) -> None:
        self.running = True
        self.busy = busy
        self.draining = False
        self.idle: Deferred[None] = Deferred()

    def begin_drain(self) -> None:
        self.draining = True

    def wait_idle(self) -> Deferred[None]:
        return self.idle


class Recorder:
    """Any input whose calls are recorded by name."""

    def __init__(self, **values: Any) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args))
            return None

        return call


class DrainTests(SynchronousTestCase):
    def drain(self, busy: int, grace: float = 30.0) -> tuple[Drain, Clock, FakePipeline, Recorder]:
        clock = Clock()
        pipeline = FakePipeline(busy)
        notify = Recorder()
        drain = Drain(clock, grace, pipeline, notify, Recorder(), SimpleNamespace(connected=False),
                      SimpleNamespace(depth=0), Logger())
        return drain, clock, pipeline, notify

    def test_commands_that_finish_end_the_drain(self) -> None:
        """The drain waits for running commands and reports none left; systemd hears STOPPING."""
        drain, clock, pipeline, notify = self.drain(busy=1)
        d = Deferred.fromCoroutine(drain.drain())
        self.assertNoResult(d)
        self.assertTrue(pipeline.draining)
        self.assertEqual(notify.calls, [("stopping", ("stopping: draining, 1 command(s) running",))])
        clock.advance(2)
        pipeline.busy = 0
        pipeline.idle.callback(None)
        self.successResultOf(d)
        self.assertEqual(drain.report, {"waited_sec": 2.0, "left": 0})

    def test_the_grace_bounds_the_drain(self) -> None:
        """A command longer than the grace: the drain ends at the grace, the command left running."""
        drain, clock, pipeline, _ = self.drain(busy=2, grace=5)
        d = Deferred.fromCoroutine(drain.drain())
        clock.advance(4.9)
        self.assertNoResult(d)
        clock.advance(0.1)
        self.successResultOf(d)
        self.assertEqual(drain.report["left"], 2)

    def test_a_second_stop_request_ends_the_drain(self) -> None:
        """Once the stop began, a stop signal ends the drain at once; the first one stops the reactor."""
        drain, clock, pipeline, _ = self.drain(busy=1)
        reactor = Recorder()
        drain.reactor = reactor
        drain.stop_requested(signal.SIGTERM)
        self.assertEqual(reactor.calls, [("stop", ())])
        self.assertFalse(drain.stopping)
        drain.begin()
        self.assertTrue(drain.stopping)
        drain.reactor = clock
        d = Deferred.fromCoroutine(drain.drain())
        self.assertNoResult(d)
        drain.stop_requested(signal.SIGTERM)
        self.successResultOf(d)
        self.assertEqual(drain.report["left"], 1)


def status(**overrides: Any) -> NodeStatus:
    values: dict[str, Any] = dict(
        config=SimpleNamespace(advertise_host="10.0.0.5"),
        session=SimpleNamespace(phase="backing_off", node_id="n-1",
                                stats=SimpleNamespace(last_error="refused: token tok-s3cret")),
        modes=SimpleNamespace(status=lambda degraded: "degraded" if degraded else "healthy"),
        collector=SimpleNamespace(last_capabilities=lambda: {"gpu_count": 0}),
        gpu_monitor=SimpleNamespace(status_reasons=lambda: []),
        pipeline=SimpleNamespace(running_count=2),
        engine=SimpleNamespace(checked=True, available=False),
        health=None,
        stopping=lambda: False,
        secrets=lambda: ["tok-s3cret"],
    )
    values.update(overrides)
    return NodeStatus(**values)


class NodeStatusTests(SynchronousTestCase):
    def test_heartbeat_fields(self) -> None:
        """An unreachable engine degrades the node and says why; a stop says draining."""
        fields = status().heartbeat_fields()
        self.assertEqual(fields["status"], "degraded")
        self.assertEqual(fields["status_reason"], "the container engine is unreachable")
        self.assertEqual(fields["advertise_host"], "10.0.0.5")
        fields = status(stopping=lambda: True).heartbeat_fields()
        self.assertEqual(fields["status"], "draining")
        self.assertNotIn("status_reason", fields)

    def test_status_line_names_running_commands_and_masks_secrets(self) -> None:
        """systemd's line: state, node, running commands, the last error without the secret."""
        line = status().status_line()
        self.assertTrue(line.startswith("backing off, node n-1, 2 commands running, last error: refused"), line)
        self.assertNotIn("s3cret", line)
        self.assertTrue(status(stopping=lambda: True).status_line().startswith("draining, "))


class InventoryRefreshTests(SynchronousTestCase):
    def test_a_burst_of_gpu_transitions_is_one_inventory(self) -> None:
        """Each transition is an event and a heartbeat; the burst is one inventory a second later."""
        clock = Clock()
        outbox, heartbeat, inventory = Recorder(), Recorder(), Recorder()
        refresh = InventoryRefresh(clock, outbox, heartbeat, inventory, SimpleNamespace(connected=True),
                                   running=lambda: True)
        t = SimpleNamespace(event_type="gpu.health.degraded", payload=lambda: {"index": 0}, severity="warning")
        for _ in range(3):
            refresh.gpu_transition(t)
        self.assertEqual(len(outbox.calls), 3)
        self.assertEqual(len(heartbeat.calls), 3)
        clock.advance(1)
        self.assertEqual(inventory.calls, [("report_now", ())])

    def test_cancel_leaves_nothing_pending(self) -> None:
        clock = Clock()
        inventory = Recorder()
        refresh = InventoryRefresh(clock, Recorder(), Recorder(), inventory, SimpleNamespace(connected=True),
                                   running=lambda: True)
        refresh.gpu_transition(SimpleNamespace(event_type="e", payload=dict, severity="info"))
        refresh.cancel()
        self.assertEqual(clock.getDelayedCalls(), [])
        self.assertEqual(inventory.calls, [])


class FakeLock:
    path = "/state/agent.lock"
    held = False

    def __init__(self, other: int | None = None) -> None:
        self.other = other

    def acquire(self) -> None:
        if self.other is not None:
            raise AlreadyRunning(self.path, self.other)
        self.held = True


class StartupTests(SynchronousTestCase):
    def startup(self, lock: FakeLock) -> tuple[Startup, MultiService, list[Service], list[tuple[int, str]]]:
        parent = MultiService()
        pools, services = [Service(), Service()], [Service(), Service()]
        for i, svc in enumerate(pools + services):
            svc.setName(f"s{i}")
        fatal: list[tuple[int, str]] = []
        loaded = Recorder(path="/state/state.json", load=lambda: succeed(None))
        startup = Startup(
            parent, pools, services, SimpleNamespace(agent_id="a", backend_url="http://127.0.0.1:1", notes=()),
            "", SynchronousRunner(), lock, loaded, loaded, loaded, Recorder(),
            log_observer=lambda: None, adoption=None, notify=Recorder(),
            fatal=lambda code, why: fatal.append((code, why)), log=Logger(),
        )
        return startup, parent, services, fatal

    def test_services_start_in_order_once_state_is_loaded(self) -> None:
        """The pools, then every other service in order; systemd hears READY=1 last."""
        startup, parent, services, fatal = self.startup(FakeLock())
        self.patch(__import__("llmport_agent.core.state", fromlist=["x"]), "adopt_old_state", lambda path: None)
        startup.begin()
        self.successResultOf(startup.started)
        self.assertEqual([s.name for s in parent], ["s0", "s1", "s2", "s3"])
        self.assertEqual([c[0] for c in startup.notify.calls], ["startService", "ready"])
        self.assertEqual(fatal, [])

    def test_another_agent_holding_the_lock_starts_nothing(self) -> None:
        """The state file is another agent's: exit 1 naming it, only the pools started."""
        startup, parent, services, fatal = self.startup(FakeLock(other=4242))
        startup.begin()
        self.successResultOf(startup.started)
        self.assertEqual([s.name for s in parent], ["s0", "s1"])
        self.assertEqual(len(fatal), 1)
        self.assertEqual(fatal[0][0], 1)
        self.assertIn("4242", fatal[0][1])
        self.assertNotIn("ready", [c[0] for c in startup.notify.calls])


class StartupLoadsTests(SynchronousTestCase):
    """The state file, the command journal and the event outbox load side by side."""

    def startup(self) -> tuple[Startup, MultiService, dict[str, Deferred[None]], list[tuple[int, str]]]:
        parent = MultiService()
        pools, services = [Service()], [Service(), Service()]
        for i, svc in enumerate(pools + services):
            svc.setName(f"s{i}")
        pending: dict[str, Deferred[None]] = {}

        def store(name: str) -> Recorder:
            def load() -> Deferred[None]:
                pending[name] = Deferred()
                return pending[name]

            return Recorder(path=f"/state/{name}", load=load)

        fatal: list[tuple[int, str]] = []
        self.patch(__import__("llmport_agent.core.state", fromlist=["x"]), "adopt_old_state", lambda path: None)
        startup = Startup(
            parent, pools, services, SimpleNamespace(agent_id="a", backend_url="http://127.0.0.1:1", notes=()),
            "", SynchronousRunner(), FakeLock(), store("state"), store("journal"), store("outbox"), Recorder(),
            log_observer=lambda: None, adoption=None, notify=Recorder(),
            fatal=lambda code, why: fatal.append((code, why)), log=Logger(),
        )
        return startup, parent, pending, fatal

    def test_journal_and_outbox_side_by_side_after_the_state(self) -> None:
        """
        The state file first; then the journal and the outbox are both under way at once; the
        services start only when the last one ends.
        """
        startup, parent, pending, fatal = self.startup()
        startup.begin()
        self.assertEqual(sorted(pending), ["state"])
        pending["state"].callback(None)
        self.assertEqual(sorted(pending), ["journal", "outbox", "state"])
        pending["outbox"].callback(None)
        self.assertEqual([s.name for s in parent], ["s0"])  # the pool only
        pending["journal"].callback(None)
        self.successResultOf(startup.started)
        self.assertEqual([s.name for s in parent], ["s0", "s1", "s2"])
        self.assertEqual(fatal, [])

    def test_an_unreadable_state_touches_nothing_else(self) -> None:
        """
        An unreadable state file stops the start before the journal and the outbox are loaded
        (their loads rewrite them): the operator is needed, nothing else starts.
        """
        from llmport_agent.core.state import StateUnreadable
        from llmport_agent.session.shared import EXIT_NEEDS_OPERATOR

        startup, parent, pending, fatal = self.startup()
        startup.begin()
        pending["state"].errback(StateUnreadable("state.json: permission denied"))
        self.successResultOf(startup.started)
        self.assertEqual(sorted(pending), ["state"])
        self.assertEqual(fatal, [(EXIT_NEEDS_OPERATOR, "state.json: permission denied")])
        self.assertEqual([s.name for s in parent], ["s0"])

    def test_both_failures_are_said(self) -> None:
        """The journal's and the outbox's loads both fail: the first fails the start, the other is logged."""
        startup, parent, pending, fatal = self.startup()
        startup.begin()
        pending["state"].callback(None)
        pending["outbox"].errback(OSError("outbox: disk gone"))
        pending["journal"].errback(OSError("journal: disk gone"))
        self.successResultOf(startup.started)
        self.assertEqual([code for code, _ in fatal], [1])
        self.assertIn("journal: disk gone", fatal[0][1])
        logged = self.flushLoggedErrors(OSError)
        self.assertIn("outbox: disk gone", " ".join(str(f.value) for f in logged))
        self.assertEqual([s.name for s in parent], ["s0"])
