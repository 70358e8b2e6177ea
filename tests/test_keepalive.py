"""
Never silent for long (issue 18 point 3, protocol 10.3): from its ack to its result every command
sends command_progress at least every COMMAND_KEEPALIVE_SEC (30 s), whatever its handler reports,
repeating the last phase; never after the result; nothing left scheduled after a stop.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.core.config import ConfigError, load_config
from tests.test_pipeline import Harness, command


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


class KeepaliveTests(SynchronousTestCase):
    def harness(self) -> Harness:
        h = Harness(self)
        h.pipeline.deadlines["gated"] = 6 * 3600.0  # a long command, like a deploy
        return h

    def frames_at(self, h: Harness, cid: str) -> list[tuple[float, dict[str, Any]]]:
        return [(f["_t"], f) for f in h.session.frames if f.get("command_id") == cid]

    def timed(self, h: Harness) -> None:
        """Stamp each frame with the clock time it left."""
        original = h.session.send

        def send(frame: dict[str, Any]) -> bool:
            return original(dict(frame, _t=h.clock.seconds()))

        h.session.send = send  # type: ignore[method-assign]

    def run_for(self, h: Harness, seconds: float, step: float = 1.0) -> None:
        end = h.clock.seconds() + seconds
        while h.clock.seconds() < end - 1e-9:
            h.clock.advance(min(step, end - h.clock.seconds()))

    def test_ten_minute_command_never_silent(self) -> None:
        """A handler silent for 10 minutes after its first phase: progress every 30 s, the same phase, then one result."""
        h = self.harness()
        self.timed(h)
        c = command("gated", {"runtime_id": "r"})
        h.deliver(c)
        self.run_for(h, 600)
        h.gates[c["id"]].callback({"ok": True})
        frames = self.frames_at(h, c["id"])
        times = [t for t, _ in frames]
        self.assertLessEqual(max(gaps(times)), 30.0 + 1e-6)
        progress = [f for _, f in frames if f["type"] == "command_progress"]
        self.assertEqual(len(progress), 1 + 20)
        self.assertTrue(all(f["phase"] == "start" for f in progress))
        self.assertEqual([f.get("keepalive") for f in progress[1:]], [True] * 20)
        self.assertEqual(frames[-1][1]["type"], "command_result")
        # Nothing after the result, however long the clock runs.
        n = len(frames)
        self.run_for(h, 600, step=5)
        self.assertEqual(len(self.frames_at(h, c["id"])), n)

    def test_handler_progress_keeps_it_quiet(self) -> None:
        """A handler that reports every 10 s gets no keepalive frames on top."""
        h = self.harness()
        self.timed(h)
        c = command("gated", {"runtime_id": "r"})
        h.deliver(c)
        ctx_progress = h.pipeline.send_progress
        rec = h.journal.get(c["id"])
        for i in range(30):
            self.run_for(h, 10)
            ctx_progress(rec, "pull_image", f"layer {i}", {"progress_pct": i})
        progress = [f for _, f in self.frames_at(h, c["id"]) if f["type"] == "command_progress"]
        self.assertEqual(len(progress), 31)
        self.assertFalse(any(f.get("keepalive") for f in progress))
        # Silent again: the last phase comes back, with its percentage.
        self.run_for(h, 31)
        last = self.frames_at(h, c["id"])[-1][1]
        self.assertEqual((last["phase"], last["message"], last["progress_pct"], last["keepalive"]),
                         ("pull_image", "layer 29", 29, True))

    def test_waiting_in_its_lane_is_not_silent(self) -> None:
        """A deploy queued behind another one for the same runtime says it is queued every 30 s."""
        h = self.harness()
        self.timed(h)
        first = command("gated", {"runtime_id": "r"})
        second = command("gated", {"runtime_id": "r"})
        h.deliver(first, second)
        self.run_for(h, 400)
        waiting = [f for _, f in self.frames_at(h, second["id"]) if f["type"] == "command_progress"]
        self.assertGreaterEqual(len(waiting), 13)
        self.assertEqual({f["phase"] for f in waiting}, {"queued"})
        times = [t for t, _ in self.frames_at(h, second["id"])]
        self.assertLessEqual(max(gaps(times + [h.clock.seconds()])), 30.0 + 1e-6)
        h.gates[first["id"]].callback({})
        self.assertEqual(h.calls[-1], ("gated", second["id"]))
        self.run_for(h, 31)
        self.assertEqual(self.frames_at(h, second["id"])[-1][1]["phase"], "start")

    def test_after_a_reconnect_at_once_then_every_30_s(self) -> None:
        """Disconnected: nothing. Back: the ack if unseen, then the phase at once, then every 30 s."""
        h = self.harness()
        self.timed(h)
        c = command("gated", {"runtime_id": "r"})
        h.deliver(c)
        h.session.disconnect()
        h.pipeline.session_closed()
        before = len(self.frames_at(h, c["id"]))
        self.run_for(h, 300)
        self.assertEqual(len(self.frames_at(h, c["id"])), before)
        h.session.connected = True
        back = h.clock.seconds()
        h.pipeline.session_opened()
        after = self.frames_at(h, c["id"])[before:]
        self.assertEqual([(t, f["type"], f["phase"]) for t, f in after], [(back, "command_progress", "start")])
        self.run_for(h, 65)
        times = [t for t, _ in self.frames_at(h, c["id"])[before:]]
        self.assertLessEqual(max(gaps(times + [h.clock.seconds()])), 30.0 + 1e-6)

    def test_redispatch_joined_is_acked_then_told_the_phase(self) -> None:
        """Re-dispatched while running: ack, then progress with its phase (the backend's status ends 'running')."""
        h = self.harness()
        c = command("gated", {"runtime_id": "r"})
        h.deliver(c)
        h.pipeline.session_closed()
        h.pipeline.frame_received({"type": "hello_ack", "commands": [dict(c, redispatch=True)]})
        h.drain()
        self.assertEqual(h.kinds_for(c["id"])[-2:], ["command_ack", "command_progress"])
        self.assertEqual(h.frames_for(c["id"])[-1]["phase"], "start")

    def test_stop_leaves_nothing_scheduled(self) -> None:
        """A stop with commands running and queued cancels every keepalive timer."""
        h = self.harness()
        h.deliver(command("gated", {"runtime_id": "a"}), command("gated", {"runtime_id": "a"}),
                  command("gated", {"runtime_id": "b"}))
        self.assertEqual(len(h.pipeline._keepalives), 3)
        h.pipeline.stopService()
        self.assertEqual(h.pipeline._keepalives, {})
        pending = [c for c in h.clock.getDelayedCalls() if "ProgressKeepalive" in repr(c.func)]
        self.assertEqual(pending, [])

    def test_setting(self) -> None:
        """COMMAND_KEEPALIVE_SEC: 30 by default, 1-60, a one-line error naming it otherwise."""
        self.assertEqual(load_config({}, {}).command_keepalive_sec, 30.0)
        self.assertEqual(load_config({"LLM_PORT_NODE_AGENT_COMMAND_KEEPALIVE_SEC": "5"}, {}).command_keepalive_sec, 5)
        for raw in ("61", "0", "x"):
            with self.assertRaises(ConfigError) as e:
                load_config({"LLM_PORT_NODE_AGENT_COMMAND_KEEPALIVE_SEC": raw}, {})
            self.assertIn("LLM_PORT_NODE_AGENT_COMMAND_KEEPALIVE_SEC", str(e.exception))
            self.assertNotIn("\n", str(e.exception))
