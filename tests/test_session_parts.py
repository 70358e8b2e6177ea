"""
The session's collaborators on their own, each with fakes of what it needs from the session
(refusals, polling, rotation), the connection lifecycle machine, the stop gate, and
the one-way dependencies between session modules (the phase the session reports from its
lifecycle is tested in test_session's SessionServiceTests).
"""

from __future__ import annotations

import ast
import os
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.task import Clock
from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.core.config import load_config
from llmport_agent.core.state import StateStore
from llmport_agent.demo.testing import SynchronousRunner
from llmport_agent.session import lifecycle
from llmport_agent.session.lifecycle import PHASES, Link
from llmport_agent.session.polling import Polling
from llmport_agent.session.refusal import Refusals
from llmport_agent.session.rotation import ROTATION_INTERVAL, Rotation
from llmport_agent.session.shared import SessionStats
from llmport_agent.session.stop import CRITICAL_STOP_GRACE, StopGate
from tests.test_session import CRED, FakeBackend


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


def _state(case: SynchronousTestCase, **values: Any) -> StateStore:
    d = case.mktemp()
    os.makedirs(d)
    state = StateStore(SynchronousRunner(), os.path.join(d, "state.json"))
    case.successResultOf(state.load())
    if values:
        case.successResultOf(state.update(**values))
    return state


class RefusalsTests(SynchronousTestCase):
    """L{Refusals} alone, its session replaced by the callbacks it is given."""

    def make(self, token: str | None = None) -> Refusals:
        env = {"LLM_PORT_NODE_AGENT_BACKEND_URL": "http://127.0.0.1:8000"}
        if token:
            env["LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN"] = token
        self.wall = [1000.0]
        self.notes: list[tuple[Any, str, dict[str, Any]]] = []
        self.reenrolled: list[str] = []
        self.failed: list[str] = []
        self.state = _state(self, credential=CRED)
        return Refusals(
            config=load_config(env, {}), state=self.state, backend=FakeBackend(),  # type: ignore[arg-type]
            wallclock=lambda: self.wall[0], gate=StopGate(Clock()), log=Logger(),
            note_retry=lambda level, fmt, **fields: self.notes.append((level, fmt, fields)),
            failed=self.failed.append, enrolling=lambda: False, reenroll=self.reenrolled.append,
            connected=lambda: False,
        )

    def test_unused_token_reenrolls_at_the_first_refusal(self) -> None:
        """A token this node never used: re-enroll at once, nothing counted as revoked."""
        refusals = self.make(token="fresh")
        refusals.refused(403, "forbidden")
        self.assertEqual(self.reenrolled, ["fresh"])
        self.assertFalse(refusals.revoked)

    def test_revoked_after_count_and_time_then_slow_retries(self) -> None:
        """Revoked only after enough refusals over enough time; then the slow retry delay."""
        refusals = self.make()
        refusals.revoked_after_refusals, refusals.revoked_after_seconds = 3, 100.0
        for _ in range(3):
            refusals.refused(403, "forbidden")
            self.wall[0] += 10
        self.assertFalse(refusals.revoked)  # 3 refusals within 20 s
        self.assertEqual(self.notes[-1][2]["n"], 3)
        self.wall[0] += 100
        refusals.refused(403, "forbidden")
        self.assertTrue(refusals.revoked)
        self.assertEqual(refusals.retry_delay(lambda: 2.0), refusals.revoked_retry_seconds)
        self.assertEqual(self.state.get("refusals")["count"], 4)
        refusals.opened()
        self.assertEqual((refusals.revoked, refusals.count, self.state.get("refusals")), (False, 0, None))
        self.assertEqual(refusals.retry_delay(lambda: 2.0), 2.0)

    def test_other_failures_are_not_counted(self) -> None:
        """A connection that failed for another reason is said, not counted as a refusal."""
        refusals = self.make()
        refusals.refused(None, "connection refused")
        self.assertEqual(refusals.count, 0)
        self.assertEqual(self.notes[0][2]["reason"], "connection refused")

    def test_restore_from_the_state_file(self) -> None:
        """The persisted streak is picked up at start, unless this run already counted."""
        refusals = self.make()
        self.state.note(refusals={"count": 4, "first_at": 900.0})
        refusals.restore(opens=1)
        self.assertEqual(refusals.count, 0)
        refusals.restore(opens=0)
        self.assertEqual(refusals.count, 4)


class PollingPartTests(SynchronousTestCase):
    """L{Polling} alone: a clock, a config, and a poll sender that records."""

    def make(self) -> Polling:
        self.clock = Clock()
        self.polls: list[float] = []
        self.up = [True]
        config = load_config({"LLM_PORT_NODE_AGENT_BACKEND_URL": "http://127.0.0.1:8000",
                              "LLM_PORT_NODE_AGENT_COMMAND_POLL_ACTIVE_WINDOW_SEC": "30"}, {})
        self.config = config

        def send_poll() -> bool:
            self.polls.append(self.clock.seconds())
            polling.frame_sent("poll")
            return True

        polling = Polling(
            clock=self.clock, config=config, state=_state(self), wallclock=lambda: 0.0, log=Logger(),
            busy=None, send_poll=send_poll, connected=lambda: self.up[0], stopping=lambda: False,
        )
        return polling

    def test_fast_after_open_then_idle(self) -> None:
        """Polls every COMMAND_POLL_INTERVAL_SEC for the active window after a connect, then idle."""
        polling = self.make()
        polling.opened()
        fast, idle = self.config.command_poll_interval_sec, self.config.poll_idle_interval
        self.clock.advance(fast)
        self.assertEqual(self.polls, [fast])
        self.clock.advance(30 + idle)
        self.assertTrue(polling.poll_interval() == idle and len(self.polls) >= 2)
        polling.closed()
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_frames_sent_push_the_poll_back(self) -> None:
        """Any frame sent counts as the poll: the next one leaves an interval after it."""
        polling = self.make()
        polling.opened()
        fast = self.config.command_poll_interval_sec
        self.clock.advance(fast - 1)
        polling.frame_sent("heartbeat")
        self.clock.advance(fast - 1)
        self.assertEqual(self.polls, [])
        self.clock.advance(1)
        self.assertEqual(self.polls, [2 * fast - 1])


class RotationPartTests(SynchronousTestCase):
    """L{Rotation} alone: it rotates only once the stream has been open for a minute."""

    def test_waits_for_a_settled_stream(self) -> None:
        clock = Clock()
        wall = [ROTATION_INTERVAL * 3]
        backend = FakeBackend()
        opened: list[float | None] = [None]
        rotation = Rotation(
            clock=clock, state=_state(self, credential=CRED, last_rotation_at=1.0), backend=backend,  # type: ignore[arg-type]
            wallclock=lambda: wall[0], gate=StopGate(clock), stats=SessionStats(), log=Logger(),
            opened_at=lambda: opened[0],
        )
        rotation.tick()
        self.assertEqual(backend.rotations, [])  # not connected
        opened[0] = clock.seconds()
        clock.advance(30)
        rotation.tick()
        self.assertEqual(backend.rotations, [])  # open for 30 s only
        clock.advance(30)
        rotation.tick()
        self.assertEqual(len(backend.rotations), 1)
        rotation.tick()
        self.assertEqual(len(backend.rotations), 1)  # one at a time
