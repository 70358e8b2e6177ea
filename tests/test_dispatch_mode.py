"""
Push-aware dispatch (issue 18 point 1, protocol 10.1): the session tells a pushing backend from one
that only answers frames by what it does; once push is proven no polls go (an idle node sends
only heartbeats and inventory); against an answering (April 2026) backend polling stays exactly
as before, whatever its reply time within reason; a backend that stops pushing (downgraded
behind the same URL) brings polling back; the mode is said once at INFO and kept across
reconnects and restarts for the same backend URL.
"""

from __future__ import annotations

import os
import random
from typing import Any

from twisted.internet.defer import succeed
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.task import LoopingCall
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.core.config import load_config
from llmport_agent.core.state import StateStore
from llmport_agent.demo.testing import SynchronousRunner
from llmport_agent.session.dispatch import POLLING, PUSH, DispatchDetector
from llmport_agent.session.service import SessionService
from tests.test_polling import WireProto
from tests.test_session import CRED, FakeBackend

URL = "http://127.0.0.1:8000"


def command(n: int) -> dict[str, Any]:
    return {"id": f"00000000-0000-0000-0000-{n:012d}", "command_type": "refresh_inventory", "payload": {}}


class DispatchModeTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.dir = self.mktemp()
        os.makedirs(self.dir)
        self.logged: list[str] = []

        def observe(event: dict[str, Any]) -> None:
            text = formatEvent(event)
            if text.startswith("Command dispatch"):
                self.logged.append(f"{event.get('log_level').name}: {text}")

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)

    def make(self, url: str = URL, **env: str) -> SessionService:
        environ = {"LLM_PORT_NODE_AGENT_BACKEND_URL": url}
        environ.update({"LLM_PORT_NODE_AGENT_" + k: v for k, v in env.items()})
        config = load_config(environ, {})
        state = StateStore(SynchronousRunner(), os.path.join(self.dir, "state.json"))
        self.successResultOf(state.load())
        self.successResultOf(state.update(credential=CRED, node_id="n1"))
        svc = SessionService(
            self.reactor, config, state, FakeBackend(),  # type: ignore[arg-type]
            lambda: succeed({}), lambda code, msg: None, version="0.1.0",
            endpoint_factory=lambda host, port, tls: TCP4ClientEndpoint(self.reactor, host, port),
            rng=lambda: 1.0,
        )
        svc.startService()
        self.addCleanup(svc.stopService)
        return svc

    def connect(self, svc: SessionService, hello_after: float = 0.01) -> WireProto:
        proto = WireProto(self.reactor)
        svc.connection_opened(proto)
        self.reactor.advance(hello_after)
        svc.frame_received(proto, {"type": "hello_ack", "session_id": "s", "node_id": "n1", "commands": []})
        return proto

    def heartbeats(self, svc: SessionService, every: float = 15.0, inventory: float = 60.0) -> None:
        for interval, kind in ((every, "heartbeat"), (inventory, "inventory")):
            loop = LoopingCall(svc.send, {"type": kind})
            loop.clock = self.reactor
            loop.start(interval, now=True)
            self.addCleanup(loop.stop)

    def run_for(self, seconds: float, step: float = 0.25) -> None:
        end = self.reactor.seconds() + seconds
        while self.reactor.seconds() < end - 1e-9:
            self.reactor.advance(min(step, end - self.reactor.seconds()))

    @staticmethod
    def polls(proto: WireProto, since: float = 0.0) -> list[float]:
        return [t for t, f in proto.wire if f.get("type") == "poll" and t >= since]

    def quiet(self, proto: WireProto, seconds: float) -> None:
        """Wait for the agent's next frame, then let C{seconds} pass (no frame in between)."""
        n = len(proto.wire)
        while len(proto.wire) == n:
            self.reactor.advance(0.01)
        sent = proto.wire[-1][0]
        self.reactor.advance(seconds - (self.reactor.seconds() - sent))
        self.assertEqual(proto.wire[-1][0], sent)

    # -- proof of push --------------------------------------------------------------------

    def test_pushed_command_stops_polling(self) -> None:
        """A new command arriving 5 s after the agent's last frame proves push: no poll after it, ever."""
        svc = self.make()
        proto = self.connect(svc)
        self.heartbeats(svc)
        self.run_for(700)  # idle: polls every 8 s
        self.assertEqual(svc.dispatch.mode, POLLING)
        self.assertTrue(self.polls(proto, since=600))
        self.quiet(proto, 5.0)
        svc.frame_received(proto, {"type": "commands", "items": [command(1)]})
        self.assertEqual(svc.dispatch.mode, PUSH)
        self.assertTrue(svc.dispatch.proven_here)
        start = self.reactor.seconds()
        self.run_for(1800, step=0.5)
        frames = [f["type"] for t, f in proto.wire if t >= start]
        self.assertNotIn("poll", frames)
        self.assertEqual(frames.count("heartbeat"), 120)
        self.assertEqual(frames.count("inventory"), 30)
        self.assertEqual(set(frames), {"heartbeat", "inventory"})

    def test_no_polls_while_active_either(self) -> None:
        """Once push is proven, a command running (or just answered) does not bring polls back."""
        svc = self.make()
        proto = self.connect(svc)
        self.run_for(700)
        self.quiet(proto, 4.0)
        svc.frame_received(proto, {"type": "commands", "items": [command(1)]})
        svc.send({"type": "command_ack", "command_id": command(1)["id"]})
        svc.send({"type": "command_result", "command_id": command(1)["id"]})
        self.assertTrue(svc.poll_active())
        start = self.reactor.seconds()
        self.run_for(600)
        self.assertEqual(self.polls(proto, since=start), [])

    def test_reply_soon_after_a_frame_proves_nothing(self) -> None:
        """A commands frame within the window (0.5 s at the least) after a frame of ours (a reply, for all we know) is no proof."""
        svc = self.make()
        proto = self.connect(svc)
        self.assertEqual(svc.dispatch.window, 0.5)
        self.run_for(700)
        self.quiet(proto, 0.45)
        svc.frame_received(proto, {"type": "commands", "items": [command(1)]})
        self.assertEqual(svc.dispatch.mode, POLLING)

    def test_push_between_two_fast_polls_proves_it(self) -> None:
        """Inside the active window after a connect (a poll every 2 s), a push 1 s after a poll proves push."""
        svc = self.make()
        proto = self.connect(svc)
        self.heartbeats(svc)
        self.run_for(30)
        self.assertTrue(svc.poll_active())
        self.quiet(proto, 1.0)
        svc.frame_received(proto, {"type": "commands", "items": [command(1)]})
        self.assertEqual(svc.dispatch.mode, PUSH)
        start = self.reactor.seconds()
        self.run_for(60)
        self.assertEqual(self.polls(proto, since=start), [])

    def test_one_push_just_after_a_heartbeat_keeps_push(self) -> None:
        """A push that happens to land 20 ms after a heartbeat, then a plain one: push throughout."""
        svc = self.make()
        proto = self.connect(svc)
        self.heartbeats(svc)
        self.run_for(700)
        self.quiet(proto, 5.0)
        svc.frame_received(proto, {"type": "commands", "items": [command(1)]})
        self.assertEqual(svc.dispatch.mode, PUSH)
        for i in range(2, 40, 2):
            self.quiet(proto, 0.02)  # the coincidence
            svc.frame_received(proto, {"type": "commands", "items": [command(i)]})
            self.assertEqual(svc.dispatch.mode, PUSH)
            self.quiet(proto, 3.0)  # a push on its own
            svc.frame_received(proto, {"type": "commands", "items": [command(i + 1)]})
            self.assertEqual(svc.dispatch.mode, PUSH)
        self.assertGreaterEqual(svc.dispatch.answered, 5)  # coincidences (not beside an inventory) seen as such
        self.assertEqual(svc.dispatch.fallbacks, 0)

    def test_command_listed_again_proves_nothing(self) -> None:
        """A command the connection has seen (hello_ack or an earlier frame), listed again after a silence: no proof."""
        svc = self.make()
        proto = WireProto(self.reactor)
        svc.connection_opened(proto)
        svc.frame_received(proto, {"type": "hello_ack", "commands": [command(1)]})
        svc.frame_received(proto, {"type": "commands", "items": [command(2)]})  # at once: a reply
        self.run_for(700)
        self.quiet(proto, 6.0)
        svc.frame_received(proto, {"type": "commands", "items": [command(1), command(2)]})
        self.assertEqual(svc.dispatch.mode, POLLING)
        svc.frame_received(proto, {"type": "commands", "items": [command(1), {"id": 5}, "x", command(3)]})
        self.assertEqual(svc.dispatch.mode, PUSH)

    def test_slow_backend_widens_the_window(self) -> None:
        """A backend that took 2 s to say hello_ack gets 8 s of reply time: a frame after 6 s of silence is no proof."""
        svc = self.make(COMMAND_POLL_IDLE_INTERVAL_SEC="14", COMMAND_POLL_ACTIVE_WINDOW_SEC="0")
        proto = self.connect(svc, hello_after=2.0)
        self.assertEqual(svc.dispatch.window, 8.0)
        self.run_for(700)
        self.quiet(proto, 6.0)
        svc.frame_received(proto, {"type": "commands", "items": [command(1)]})
        self.assertEqual(svc.dispatch.mode, POLLING)
        self.quiet(proto, 8.5)
        svc.frame_received(proto, {"type": "commands", "items": [command(2)]})
        self.assertEqual(svc.dispatch.mode, PUSH)

    # -- an answering (April) backend --------------------------------------------------------

    def answering_backend(self, svc: SessionService, proto: WireProto, lag: float, rng: random.Random,
                          hours: float) -> int:
        """
        An April backend: commands queued at random moments go out only in reply to the agent's
        next frame (no ack is sent here, so a command stays listed in every reply), each reply
        up to C{lag} seconds late. Returns how many replies it sent.
        """
        pending: list[dict[str, Any]] = []
        next_command = self.reactor.seconds() + rng.uniform(5, 900)
        seen = len(proto.wire)
        replies = 0
        n = 0
        end = self.reactor.seconds() + hours * 3600
        while self.reactor.seconds() < end:
            self.reactor.advance(0.05)
            if self.reactor.seconds() >= next_command:
                n += 1
                pending.append(command(n))
                next_command = self.reactor.seconds() + rng.uniform(5, 900)
            while seen < len(proto.wire):
                seen += 1
                if pending:
                    items = list(pending)
                    self.reactor.callLater(rng.uniform(0, lag), svc.frame_received, proto,
                                           {"type": "commands", "items": items})
                    replies += 1
                if len(pending) > 3:
                    pending.pop(0)  # the agent acked it (its ack is not modelled here)
        return replies

    def test_answering_backend_is_never_taken_for_push(self) -> None:
        """Two hours of an April backend replying up to 0.45 s late: polling throughout, at today's intervals."""
        svc = self.make()
        proto = self.connect(svc)
        self.heartbeats(svc)
        replies = self.answering_backend(svc, proto, 0.45, random.Random(18), 2.0)
        self.assertGreater(replies, 100)
        self.assertEqual(svc.dispatch.mode, POLLING)
        self.assertEqual(svc.dispatch.proofs, 0)
        # Today's adaptive polling: no gap between frames longer than the idle interval.
        times = [t for t, _ in proto.wire]
        self.assertLessEqual(max(b - a for a, b in zip(times, times[1:], strict=False)), 8.0 + 1e-6)
        self.assertGreater(len(self.polls(proto)), 200)

    def test_slow_answering_backend_is_never_taken_for_push(self) -> None:
        """An April backend whose hello_ack took 0.8 s (window 3.2 s) replying up to 3 s late: polling throughout."""
        svc = self.make()
        proto = self.connect(svc, hello_after=0.8)
        self.assertAlmostEqual(svc.dispatch.window, 3.2)
        self.heartbeats(svc)
        replies = self.answering_backend(svc, proto, 3.0, random.Random(19), 1.0)
        self.assertGreater(replies, 50)
        self.assertEqual(svc.dispatch.mode, POLLING)
        self.assertEqual(svc.dispatch.proofs, 0)

    def test_downgraded_backend_brings_polling_back(self) -> None:
        """Push remembered from a previous run; the backend now answers a heartbeat with a new command: polling again."""
        svc = self.make()
        proto = self.connect(svc)
        self.run_for(700)
        self.quiet(proto, 5.0)
        svc.frame_received(proto, {"type": "commands", "items": [command(1)]})
        self.assertEqual(svc.dispatch.mode, PUSH)
        svc.connection_closed(proto, False, 1006, "", None)
        self.successResultOf(svc.stopService())
        # Restart (same state file, same URL): push from the first connect, no polls.
        svc2 = self.make()
        self.assertEqual(svc2.dispatch.mode, PUSH)
        proto2 = self.connect(svc2)
        self.heartbeats(svc2)
        self.run_for(120)
        self.assertEqual(self.polls(proto2), [])
        # Downgraded: new commands come back only 20 ms after a heartbeat, twice in a row.
        self.quiet(proto2, 0.02)
        svc2.frame_received(proto2, {"type": "commands", "items": [command(2)]})
        self.assertEqual(svc2.dispatch.mode, PUSH)  # once can be a coincidence
        self.quiet(proto2, 0.02)
        svc2.frame_received(proto2, {"type": "commands", "items": [command(3)]})
        self.assertEqual(svc2.dispatch.mode, POLLING)
        self.assertEqual(svc2.dispatch.fallbacks, 1)
        start = self.reactor.seconds()
        self.run_for(60)
        self.assertGreater(len(self.polls(proto2, since=start)), 10)
        times = [t for t, _ in proto2.wire if t >= start]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        self.assertTrue(all(g <= 2.0 + 1e-6 for g in gaps), gaps)  # active again, as before

    def test_a_reply_among_busy_frames_is_not_evidence(self) -> None:
        """While the agent sends frames every second (a command's progress), a push near one of them changes nothing."""
        svc = self.make()
        proto = self.connect(svc)
        self.run_for(700)
        self.quiet(proto, 5.0)
        svc.frame_received(proto, {"type": "commands", "items": [command(1)]})
        for _ in range(10):
            self.reactor.advance(1.0)
            svc.send({"type": "command_progress", "command_id": command(1)["id"]})
        self.reactor.advance(0.02)
        svc.frame_received(proto, {"type": "commands", "items": [command(2)]})
        self.assertEqual(svc.dispatch.mode, PUSH)

    # -- memory and log lines ---------------------------------------------------------------

    def test_mode_kept_across_reconnects_and_per_url(self) -> None:
        """A reconnect keeps push; a restart with another backend URL starts polling again."""
        svc = self.make()
        proto = self.connect(svc)
        self.run_for(700)
        self.quiet(proto, 5.0)
        svc.frame_received(proto, {"type": "commands", "items": [command(1)]})
        svc.connection_closed(proto, False, 1006, "", None)
        proto2 = self.connect(svc)
        self.assertEqual(svc.dispatch.mode, PUSH)
        self.assertFalse(svc.dispatch.proven_here)
        self.run_for(100)
        self.assertEqual(self.polls(proto2), [])
        svc.connection_closed(proto2, True, 1000, "", None)
        self.successResultOf(svc.stopService())
        other = self.make(url="http://127.0.0.2:8000")
        self.assertEqual(other.dispatch.mode, POLLING)
        state = other.state.get("dispatch")
        self.assertEqual(state["mode"], PUSH)
        self.assertNotIn("127.0.0.1", repr(state))  # a fingerprint, not the URL

    def test_said_once_at_info_and_at_each_change(self) -> None:
        """One INFO line at the first connect, none at a reconnect, one at each change of mode."""
        svc = self.make()
        proto = self.connect(svc)
        self.assertEqual(len(self.logged), 1)
        self.assertTrue(self.logged[0].startswith("info: Command dispatch: polling, every 2 s"), self.logged)
        svc.connection_closed(proto, False, 1006, "", None)
        proto = self.connect(svc)
        self.assertEqual(len(self.logged), 1)
        self.run_for(700)
        self.quiet(proto, 5.0)
        svc.frame_received(proto, {"type": "commands", "items": [command(1)]})
        self.assertEqual(len(self.logged), 2)
        self.assertIn("push, polling stopped", self.logged[1])
        self.assertIn("pushes commands", self.logged[1])
        self.assertTrue(self.logged[1].startswith("info:"))

    def test_detector_bounds(self) -> None:
        """A frame of 100 000 items is looked at only in part; ids are bounded in length and number."""
        clock = MemoryReactorClock()
        d = DispatchDetector(clock.seconds)
        d.connection_opened()
        d.hello_received([])
        d.frame_sent()
        d.commands_received([command(i) for i in range(100_000)])
        self.assertLessEqual(len(d._seen), 256)
        for i in range(20):
            d.commands_received([{"id": "x" * 10_000 + str(i)} for _ in range(300)] + [command(i)])
        self.assertLessEqual(len(d._seen), 4096)
        self.assertTrue(all(len(k) <= 128 for k in d._seen))
