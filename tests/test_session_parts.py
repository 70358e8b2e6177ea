"""
The session's collaborators on their own: the connection lifecycle machine, the phase the
session reports from it, the stop gate, and the one-way dependencies between session modules.
"""

from __future__ import annotations

import ast
import os
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.session import lifecycle
from llmport_agent.session.backend_http import Enrollment as Enrolled
from llmport_agent.session.backend_http import Transient
from llmport_agent.session.lifecycle import PHASES, Link
from llmport_agent.session.stop import CRITICAL_STOP_GRACE, StopGate
from tests import test_session
from tests.test_session import CRED, FakeProto


class LinkTests(SynchronousTestCase):
    """The lifecycle machine follows its transition table."""

    TABLE = {
        # state: {input: next state}
        "stopped": {"start": "connecting", "opened": "stopped", "failed": "stopped", "stop": "stopped"},
        "connecting": {"start": "connecting", "opened": "connected", "failed": "backing_off", "stop": "stopped"},
        "connected": {"start": "connected", "opened": "connected", "failed": "backing_off", "stop": "stopped"},
        "backing_off": {"start": "backing_off", "opened": "connected", "failed": "backing_off", "stop": "stopped"},
    }
    #: Inputs that bring a new machine into each state.
    REACH = {"stopped": [], "connecting": ["start"], "connected": ["start", "opened"],
             "backing_off": ["start", "failed"]}

    def test_every_transition(self) -> None:
        """Each (state, input) pair lands where the table in the module docstring says."""
        for state, moves in self.TABLE.items():
            for name, target in moves.items():
                link = Link()
                for step in self.REACH[state]:
                    getattr(link, step)()
                self.assertEqual(link.phase(), state)
                getattr(link, name)()
                self.assertEqual(link.phase(), target, f"{state} --{name}-->")

    def test_phases_are_the_metrics_labels(self) -> None:
        """The words the session reports are the ones the metrics export."""
        from llmport_agent.ops.metrics import SESSION_STATES

        self.assertEqual(set(PHASES), set(SESSION_STATES))


class PhaseTests(SynchronousTestCase):
    """SessionService.phase through a session's life, from its lifecycle and collaborators."""

    make = test_session.SessionServiceTests.make
    refuse = test_session.SessionServiceTests.refuse

    def test_connect_fail_open_close_stop(self) -> None:
        """connecting, backing_off after a failed connect, connected, backing_off, stopped."""
        svc = self.make(credential=CRED)
        self.assertEqual(svc.phase, "stopped")
        svc.startService()
        self.assertEqual(svc.phase, "connecting")
        self.reactor.tcpClients[-1][2].clientConnectionFailed(None, Failure(ConnectionRefusedError()))
        self.assertEqual(svc.phase, "backing_off")
        proto = FakeProto(self.reactor.seconds())
        svc.connection_opened(proto)  # type: ignore[arg-type]
        self.assertEqual(svc.phase, "connected")
        svc.connection_closed(proto, False, 1006, "gone", None)  # type: ignore[arg-type]
        self.assertEqual(svc.phase, "backing_off")
        svc.stopService()
        self.assertEqual(svc.phase, "stopped")

    def test_superseded_connection_closing_keeps_connected(self) -> None:
        """An older connection closing while a newer one is open does not leave 'connected'."""
        svc = self.make(credential=CRED)
        svc.startService()
        old, new = FakeProto(0.0), FakeProto(0.0)
        svc.connection_opened(old)  # type: ignore[arg-type]
        svc.connection_opened(new)  # type: ignore[arg-type]
        svc.connection_closed(old, True, 1000, "superseded", None)  # type: ignore[arg-type]
        self.assertEqual(svc.phase, "connected")

    def test_enrolling_then_backing_off_after_transient(self) -> None:
        """An enrollment says 'enrolling' through its retries; then connecting to the stream."""
        svc = self.make(token="tok-123")
        svc.startService()
        self.assertEqual(svc.phase, "enrolling")
        self.backend.enrolls[0].errback(Transient("HTTP 503"))
        self.assertEqual(svc.phase, "enrolling")
        self.assertEqual(svc.stats.last_error, "enrollment failed: HTTP 503")
        self.reactor.advance(60)
        self.backend.enrolls[1].callback(Enrolled("n1", CRED, "10.1.2.3"))
        # A failed attempt happened since the start: the stream connect is a retry.
        self.assertEqual(svc.phase, "backing_off")

    def test_revoked_says_refused(self) -> None:
        """Repeated refusals over time: 'refused' (not backing off), until the stream opens."""
        svc = self.make(credential=CRED)
        svc.startService()
        self.refuse(svc, 5, 60)
        self.assertTrue(svc.refusals.revoked)
        self.assertEqual(svc.phase, "refused")
        svc.connection_opened(FakeProto(self.reactor.seconds()))  # type: ignore[arg-type]
        self.assertFalse(svc.refusals.revoked)
        self.assertEqual(svc.phase, "connected")


class StopGateTests(SynchronousTestCase):
    def test_pause_ends_at_stop(self) -> None:
        """A retry pause is cancelled by the stop, and a stopping gate never pauses."""
        clock = Clock()
        gate = StopGate(clock)
        paused = gate.sleep(30)
        self.successResultOf(gate.stop(None, lambda: succeed(None)))
        self.failureResultOf(paused, CancelledError)
        self.failureResultOf(gate.sleep(1), CancelledError)
        gate.start()
        self.assertNoResult(gate.sleep(1))

    def test_critical_work_gets_the_grace_then_requests_are_cancelled(self) -> None:
        """Critical work holds the stop for CRITICAL_STOP_GRACE, then its request is cancelled."""
        clock = Clock()
        gate = StopGate(clock)
        request: Deferred[Any] = Deferred()
        outcome: list[str] = []

        async def work() -> None:
            try:
                await gate.request(request)
            except CancelledError:
                outcome.append("cancelled")

        gate.track_critical(Deferred.fromCoroutine(work()))
        closed: list[bool] = []

        def then() -> Deferred[None]:
            closed.append(True)
            return succeed(None)

        stopped = gate.stop(None, then)
        self.assertNoResult(stopped)
        clock.advance(CRITICAL_STOP_GRACE - 0.01)
        self.assertEqual((outcome, closed), ([], []))
        clock.advance(0.01)
        self.assertEqual(outcome, ["cancelled"])
        self.successResultOf(stopped)
        self.assertEqual(closed, [True])
        self.assertEqual(clock.getDelayedCalls(), [])


class DependencyTests(SynchronousTestCase):
    """The collaborators never import the service that composes them (no import loop)."""

    def test_collaborators_do_not_import_the_service(self) -> None:
        folder = os.path.dirname(lifecycle.__file__)
        for name in ("enrollment", "refusal", "rotation", "polling", "stop", "protocol", "shared",
                     "lifecycle", "dispatch"):
            with open(os.path.join(folder, name + ".py")) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    self.assertNotEqual(node.module, "llmport_agent.session.service", name)
                    if node.module == "llmport_agent.session":
                        self.assertNotIn("service", [a.name for a in node.names], name)
