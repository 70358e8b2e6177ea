"""
The session's collaborators on their own: the connection lifecycle machine, the stop gate, and
the one-way dependencies between session modules (the phase the session reports from its
lifecycle is tested in test_session's SessionServiceTests).
"""

from __future__ import annotations

import ast
import os
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.session import lifecycle
from llmport_agent.session.lifecycle import PHASES, Link
from llmport_agent.session.stop import CRITICAL_STOP_GRACE, StopGate


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
