"""
Re-dispatch (issue 18 point 2, protocol 10.2): a command listed again, with C{"redispatch": true}
at C{hello_ack} or as a plain duplicate, is never run twice. A finished one is answered from the
journal with its stored result marked C{"replayed": true} and no ack (an ack after a result moves
the command back in the backend); a running or queued one is joined (acked again, one execution,
one result); the age check is never applied to a re-dispatched command.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.journal import DELIVERED
from tests.test_pipeline import Harness, command


def hello(*items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "hello_ack", "session_id": "s", "node_id": "n", "commands": list(items), "profile": None}


def again(c: dict[str, Any]) -> dict[str, Any]:
    return dict(c, redispatch=True, status="running")


class RedispatchTests(SynchronousTestCase):
    def reconnect(self, h: Harness, *listed: dict[str, Any]) -> None:
        h.session.disconnect()
        h.pipeline.session_closed()
        h.session.connected = True
        h.pipeline.session_opened()
        h.pipeline.frame_received(hello(*listed))
        h.drain()

    def test_running_command_is_joined(self) -> None:
        """Re-dispatched while it runs: acked again, not started again, one result at the end."""
        h = Harness(self)
        c = command("gated", {"runtime_id": "r1"})
        h.deliver(c)
        self.assertEqual(h.calls, [("gated", c["id"])])
        self.reconnect(h, again(c))
        self.assertEqual(h.calls, [("gated", c["id"])])
        self.assertEqual(h.kinds_for(c["id"]).count("command_ack"), 2)
        self.assertEqual(h.pipeline.stats["redispatched"], 1)
        # Re-dispatched once more on the same connection (a second hello is not expected, but
        # a listing is a listing): still one ack per connection.
        h.pipeline.frame_received(hello(again(c)))
        h.drain()
        self.assertEqual(h.kinds_for(c["id"]).count("command_ack"), 2)
        h.gates[c["id"]].callback({"endpoint_url": "http://127.0.0.1:9"})
        kinds = h.kinds_for(c["id"])
        self.assertEqual(kinds.count("command_result"), 1)
        self.assertEqual(kinds[-1], "command_result")
        self.assertEqual(h.calls, [("gated", c["id"])])
        self.assertNotIn("replayed", h.frames_for(c["id"])[-1]["result"])

    def test_queued_command_is_joined(self) -> None:
        """Re-dispatched while it waits behind its lane: acked again, run once when its turn comes."""
        h = Harness(self)
        first = command("gated", {"runtime_id": "r1"})
        second = command("gated", {"runtime_id": "r1"})
        h.deliver(first, second)
        self.assertEqual(len(h.calls), 1)
        self.reconnect(h, again(second))
        h.gates[first["id"]].callback({})
        self.assertEqual(h.calls, [("gated", first["id"]), ("gated", second["id"])])
        h.gates[second["id"]].callback({})
        self.assertEqual(h.kinds_for(second["id"]).count("command_result"), 1)
        self.assertEqual(len(h.calls), 2)

    def test_finished_command_is_replayed_without_ack(self) -> None:
        """Re-dispatched after its result was delivered: the stored result, replayed, and no ack."""
        h = Harness(self)
        c = command("noop")
        h.deliver(c)
        self.assertEqual(h.journal.get(c["id"]).state, DELIVERED)
        original = h.frames_for(c["id"])[-1]
        self.reconnect(h, again(c))
        frames = h.frames_for(c["id"])
        self.assertEqual([f["type"] for f in frames],
                         ["command_ack", "command_progress", "command_result", "command_result"])
        replay = frames[-1]
        self.assertEqual(replay["result"], {"ok": True, "replayed": True})
        self.assertEqual((replay["success"], replay["error_code"]), (original["success"], original["error_code"]))
        self.assertEqual(h.calls, [("noop", c["id"])])
        # The journal keeps the result as it was (the mark is on the wire only).
        self.assertEqual(h.journal.get(c["id"]).result_frame["result"], {"ok": True})
        self.assertEqual(h.pipeline.stats["replayed"], 1)

    def test_finished_failure_replayed_as_failure(self) -> None:
        """A failed command re-dispatched gets its failure again, replayed, not a fresh run."""
        h = Harness(self)
        c = command("fails")
        h.deliver(c)
        self.reconnect(h, again(c))
        replay = h.frames_for(c["id"])[-1]
        self.assertEqual((replay["type"], replay["success"], replay["error_code"]),
                         ("command_result", False, "runtime_error"))
        self.assertEqual(replay["result"], {"replayed": True})

    def test_result_in_doubt_sent_once_after_reconnect(self) -> None:
        """Result unconfirmed when the stream dropped, then re-dispatched at hello_ack: one result frame, no ack."""
        h = Harness(self)
        h.session.auto_confirm = False
        c = command("noop")
        h.deliver(c)
        h.session.auto_confirm = True
        h.session.disconnect()
        h.pipeline.session_closed()
        h.session.connected = True
        h.session.auto_confirm = False
        h.pipeline.session_opened()  # results in doubt go first
        h.pipeline.frame_received(hello(again(c)))
        h.drain()
        kinds = h.kinds_for(c["id"])
        self.assertEqual(kinds, ["command_ack", "command_progress", "command_result", "command_result"])
        # Plain, not replayed: it may be the first the backend sees, and a replayed result
        # would not correct a node_stream_lost failure.
        self.assertEqual(h.frames_for(c["id"])[-1]["result"], {"ok": True})

    def test_unconfirmed_result_listed_again_is_sent_plain(self) -> None:
        """A result whose delivery was lost, listed again while connected: sent again, not marked replayed."""
        h = Harness(self)
        h.session.auto_confirm = False
        c = command("noop")
        h.deliver(c)
        h.session.disconnect()  # the confirmation is lost; the record stays finished, unconfirmed
        h.session.connected = True
        h.deliver(again(c))
        frames = h.frames_for(c["id"])
        self.assertEqual([f["type"] for f in frames][-2:], ["command_result", "command_result"])
        self.assertEqual(frames[-1]["result"], {"ok": True})
        self.assertEqual(h.pipeline.stats["replayed"], 0)

    def test_plain_duplicate_in_hello_is_replayed(self) -> None:
        """The same without the flag: a finished command listed at hello_ack is answered from the journal."""
        h = Harness(self)
        c = command("noop")
        h.deliver(c)
        self.reconnect(h, c)
        self.assertEqual(h.frames_for(c["id"])[-1]["result"], {"ok": True, "replayed": True})
        self.assertEqual(h.kinds_for(c["id"]).count("command_ack"), 1)
        self.assertEqual(len(h.calls), 1)
        # A listing on the same connection that only lags behind the result: nothing new.
        h.deliver(c)
        self.assertEqual(h.kinds_for(c["id"]).count("command_result"), 2)

    def test_plain_duplicate_of_running_acked_again_only_when_unconfirmed(self) -> None:
        """Without the flag, a running command is acked again only if its ack was not confirmed."""
        h = Harness(self)
        c = command("gated", {"runtime_id": "r"})
        h.deliver(c)
        self.reconnect(h, c)
        self.assertEqual(h.kinds_for(c["id"]).count("command_ack"), 1)
        self.assertEqual(len(h.calls), 1)

    def test_age_check_skipped_for_redispatch(self) -> None:
        """With COMMAND_MAX_AGE set, an old re-dispatched command still runs (one the agent lost)."""
        h = Harness(self, max_age=60)
        h.clock.advance(10**9)
        c = command("noop", issued_at="2001-01-01T00:00:00Z")
        h.deliver(again(c))
        self.assertTrue(h.frames_for(c["id"])[-1]["success"])
        self.assertEqual(h.calls, [("noop", c["id"])])
        old = command("noop", issued_at="2001-01-01T00:00:00Z")
        h.deliver(old)
        self.assertEqual(h.frames_for(old["id"])[-1]["error_code"], "command_expired")

    def test_no_ack_or_progress_after_result_whatever_is_listed(self) -> None:
        """Many listings of a finished command, flagged or not, over reconnects: the last frame is always a result."""
        h = Harness(self)
        c = command("noop")
        h.deliver(c)
        for i in range(6):
            listed = again(c) if i % 2 else c
            self.reconnect(h, listed)
            h.deliver(listed)
            h.deliver(again(c))
        kinds = h.kinds_for(c["id"])
        self.assertEqual(kinds[:3], ["command_ack", "command_progress", "command_result"])
        self.assertEqual(set(kinds[3:]), {"command_result"})
        self.assertEqual(len(h.calls), 1)

    def test_same_id_many_times_answered_once(self) -> None:
        """A hello_ack listing one running command 10 000 times: one ack, one progress, one log line."""
        from twisted.logger import globalLogPublisher

        logged: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(logged.append)
        self.addCleanup(globalLogPublisher.removeObserver, logged.append)
        h = Harness(self)
        c = command("gated", {"runtime_id": "r"})
        h.deliver(c)
        before = len(h.frames_for(c["id"]))
        self.reconnect(h, *([again(c)] * 10_000))
        frames = h.frames_for(c["id"])[before:]
        self.assertEqual([f["type"] for f in frames], ["command_progress", "command_ack", "command_progress"])
        self.assertEqual(len([e for e in logged if "re-dispatched" in str(e.get("log_format", ""))]), 1)
        self.assertEqual(len(h.calls), 1)

    def test_delivered_read_whose_result_was_dropped_runs_again(self) -> None:
        """
        A read whose result was dropped once delivered (logs, statuses), listed again: run again
        and answered with a new result after an ack, never with the stub that replaced it.
        """
        for kind, args in (("fetch_container_logs", {"runtime_id": "r", "tail": 5}), ("read_status", {})):
            h = Harness(self)
            c = command(kind, args)
            h.deliver(c)
            rec = h.journal.get(c["id"])
            self.assertEqual(rec.state, DELIVERED)
            self.assertIn("_dropped", rec.result_frame["result"], kind)
            # The copy of the command is what a re-run needs; it stays while the result is gone.
            self.assertEqual(rec.command["id"], c["id"])
            before = len(h.frames_for(c["id"]))
            self.reconnect(h, again(c))
            frames = h.frames_for(c["id"])[before:]
            self.assertEqual([f["type"] for f in frames][0], "command_ack", kind)
            self.assertEqual([f["type"] for f in frames][-1], "command_result", kind)
            result = frames[-1]["result"]
            self.assertNotIn("_dropped", result, kind)
            self.assertNotIn("replayed", result, kind)
            self.assertTrue(frames[-1]["success"], kind)
            self.assertEqual(len(h.calls), 2, kind)
            self.assertEqual(h.pipeline.stats["rerun"], 1)
            self.assertEqual(h.journal.get(c["id"]).state, DELIVERED)

    def test_keep_result_false_drops_even_a_small_result(self) -> None:
        """HandlerSpec.keep_result=False: a small result is dropped once delivered too."""
        h = Harness(self)
        c = command("read_status")
        h.deliver(c)
        self.assertEqual(h.frames_for(c["id"])[-1]["result"], {"run": 1})
        self.assertIn("_dropped", h.journal.get(c["id"]).result_frame["result"])
        # A small result of a spec that keeps results stays, and the command copy goes.
        n = command("noop")
        h.deliver(n)
        rec = h.journal.get(n["id"])
        self.assertEqual(rec.result_frame["result"], {"ok": True})
        self.assertIsNone(rec.command)

    def test_dropped_read_runs_again_after_an_agent_restart(self) -> None:
        """The kept command copy is in the journal file: a restarted agent runs the read again too."""
        h = Harness(self)
        c = command("read_status")
        h.deliver(c)
        h.pipeline.stopService()
        h2 = Harness(self, directory=h.dir)
        self.assertEqual(h2.calls, [])
        h2.pipeline.frame_received(hello(again(c)))
        h2.drain()
        self.assertEqual(h2.calls, [("status", c["id"])])
        self.assertEqual(h2.frames_for(c["id"])[-1]["result"], {"run": 1})

    def test_dropped_result_of_a_write_is_replayed_not_rerun(self) -> None:
        """A large result of a command that is not a read: never run again; the stub is replayed."""
        h = Harness(self)
        c = command("big_write", {"runtime_id": "r"})
        h.deliver(c)
        rec = h.journal.get(c["id"])
        self.assertIn("_dropped", rec.result_frame["result"])
        self.assertIsNone(rec.command)
        self.reconnect(h, again(c))
        replay = h.frames_for(c["id"])[-1]
        self.assertEqual(replay["type"], "command_result")
        self.assertTrue(replay["result"]["replayed"])
        self.assertEqual(h.calls, [("big", c["id"])])
