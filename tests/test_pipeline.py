"""Unit tests of the command pipeline: receipt, journal, ack/progress/result, lanes, deadlines, recovery."""

from __future__ import annotations

import os
import uuid
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.base import CommandFailed, HandlerSpec
from llmport_agent.commands.journal import DELIVERED, FINISHED, CommandJournal
from llmport_agent.commands.node import PersistentModes, node_handler_specs
from llmport_agent.commands.parse import signature_for
from llmport_agent.commands.pipeline import CommandPipeline
from llmport_agent.core.state import StateStore
from llmport_agent.demo.testing import FakeSession, SynchronousRunner
from llmport_agent.events.outbox import EventOutbox


def command(
    ctype: str = "noop", payload: dict[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
    cid = str(uuid.uuid4())
    obj = {
        "id": cid,
        "node_id": str(uuid.uuid4()),
        "command_type": ctype,
        "status": "dispatched",
        "correlation_id": None,
        "idempotency_key": cid,
        "payload": payload if payload is not None else {},
        "result": None,
        "timeout_sec": None,
        "error_code": None,
        "error_message": None,
        "issued_at": "2020-01-01T00:00:00+00:00",
        "dispatched_at": "2020-01-01T00:00:01+00:00",
        "acked_at": None,
        "started_at": None,
        "completed_at": None,
    }
    obj.update(extra)
    return obj


class Harness:
    """A pipeline over a fake session, a synchronous runner, a Clock and a temp state dir."""

    def __init__(self, case: SynchronousTestCase, directory: str | None = None, **kw: Any) -> None:
        self.dir = directory or case.mktemp()
        os.makedirs(self.dir, exist_ok=True)
        self.clock = Clock()
        self.runner = SynchronousRunner()
        self.session = FakeSession()
        self.state = StateStore(self.runner, os.path.join(self.dir, "state.json"))
        case.successResultOf(self.state.load())
        self.journal = CommandJournal(
            self.runner, os.path.join(self.dir, "commands.jsonl"), self.clock.seconds
        )
        case.successResultOf(self.journal.load())
        self.outbox = EventOutbox(
            self.clock, self.runner, os.path.join(self.dir, "events.jsonl"), self.session
        )
        case.successResultOf(self.outbox.load())
        self.modes = PersistentModes(self.state)
        self.gates: dict[str, Deferred[dict[str, Any]]] = {}
        self.calls: list[tuple[str, str]] = []
        self.inventory_sent = 0
        registry = node_handler_specs(self.modes, self._refresh, self._diag)
        registry.update(
            {
                "noop": HandlerSpec(self._noop, lane="runtime", idempotent=True, deadline=60),
                "gated": HandlerSpec(self._gated, lane="runtime", idempotent=True, deadline=60),
                "gated_unsafe": HandlerSpec(
                    self._gated, lane="runtime", idempotent=False, deadline=60
                ),
                "deploy_workload": HandlerSpec(
                    self._gated,
                    lane="runtime",
                    idempotent=True,
                    deadline=60,
                    blocked_by_maintenance=True,
                    blocked_by_draining=True,
                ),
                "fetch_container_logs": HandlerSpec(
                    self._logs, lane="read", idempotent=True, deadline=30
                ),
                # A small read whose result is not kept after delivery (like get_ray_status).
                "read_status": HandlerSpec(
                    self._status, lane="read", idempotent=True, deadline=30, keep_result=False
                ),
                # A large result of a command that is not a read (never run again).
                "big_write": HandlerSpec(self._big, lane="runtime", idempotent=True, deadline=60),
                "boom": HandlerSpec(self._boom, lane="runtime", idempotent=True, deadline=60),
                "fails": HandlerSpec(self._fails, lane="runtime", idempotent=True, deadline=60),
            }
        )
        self.pipeline = CommandPipeline(
            self.clock,
            self.session,
            self.journal,
            registry,
            self.modes,
            self.outbox,
            credential=self.session.credential,
            max_concurrent=kw.get("max_concurrent", 8),
            max_age=kw.get("max_age", 0.0),
            wallclock=self.clock.seconds,
        )
        self.pipeline.startService()
        case.addCleanup(self._stop)

    def _stop(self) -> None:
        if self.pipeline.running:
            self.pipeline.stopService()

    async def _refresh(self) -> bool:
        self.inventory_sent += 1
        self.session.send({"type": "inventory", "inventory": {}, "utilization": {}})
        return True

    async def _diag(self) -> dict[str, Any]:
        return {"agent": {"version": "x"}}

    async def _noop(self, ctx: Any) -> dict[str, Any]:
        self.calls.append(("noop", ctx.command.id))
        ctx.progress("work", "working", progress_pct=50)
        return {"ok": True}

    async def _gated(self, ctx: Any) -> dict[str, Any]:
        self.calls.append((ctx.command.command_type, ctx.command.id))
        d: Deferred[dict[str, Any]] = Deferred()
        self.gates[ctx.command.id] = d
        ctx.progress("start", "started")
        return await d

    async def _logs(self, ctx: Any) -> dict[str, Any]:
        self.calls.append(("logs", ctx.command.id))
        return {"logs": "x" * 10000}

    async def _status(self, ctx: Any) -> dict[str, Any]:
        self.calls.append(("status", ctx.command.id))
        return {"run": len(self.calls)}

    async def _big(self, ctx: Any) -> dict[str, Any]:
        self.calls.append(("big", ctx.command.id))
        return {"report": "y" * 10000}

    async def _boom(self, ctx: Any) -> dict[str, Any]:
        raise RuntimeError("kaboom")

    async def _fails(self, ctx: Any) -> dict[str, Any]:
        raise CommandFailed("runtime_error", "the thing failed")

    def deliver(self, *objs: Any, kind: str = "commands") -> None:
        self.pipeline.frame_received({"type": kind, "items": list(objs)})
        self.drain()

    def drain(self) -> None:
        """Let the pipeline take in what arrived (a big frame takes several reactor turns)."""
        while self.pipeline._intake_call is not None:
            self.clock.advance(0)

    def frames_for(self, cid: str) -> list[dict[str, Any]]:
        return [f for f in self.session.frames if f.get("command_id") == cid]

    def kinds_for(self, cid: str) -> list[str]:
        return [f["type"] for f in self.frames_for(cid)]


class ReceiptTests(SynchronousTestCase):
    def test_ack_progress_result_once(self) -> None:
        """A command gets one ack, its progress, and exactly one result, in that order."""
        h = Harness(self)
        c = command("noop")
        h.deliver(c)
        self.assertEqual(
            h.kinds_for(c["id"]), ["command_ack", "command_progress", "command_result"]
        )
        result = h.frames_for(c["id"])[-1]
        self.assertTrue(result["success"])
        self.assertEqual(result["result"], {"ok": True})
        self.assertEqual(result["correlation_id"], c["id"])
        self.assertEqual(h.journal.get(c["id"]).state, DELIVERED)

    def test_long_session_keeps_no_ids_of_finished_commands(self) -> None:
        """
        Commands acked and finished within one session (no reconnect) leave nothing behind
        in the pipeline's per-session bookkeeping (the soak's slow growth), and a finished
        command delivered again is still not acked or run again.
        """
        h = Harness(self)
        cmds = [command("noop") for _ in range(200)]
        for c in cmds:
            h.deliver(c)
        self.assertEqual(h.pipeline._acked_here, set())
        h.deliver(cmds[0])
        self.assertEqual(h.kinds_for(cmds[0]["id"]).count("command_ack"), 1)
        self.assertEqual(len(h.calls), 200)

    def test_unknown_frame_types_remembered_within_a_bound(self) -> None:
        """
        Frames of unknown types are ignored with one warning per type; the backend picks the
        names, so the set that remembers them is bounded (a stream of fresh names does not grow
        it, nor flood the log), and commands still run afterwards.
        """
        from twisted.logger import globalLogPublisher

        from llmport_agent.commands.pipeline import MAX_UNKNOWN_FRAME_TYPES

        logged: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(logged.append)
        self.addCleanup(globalLogPublisher.removeObserver, logged.append)
        h = Harness(self)
        for i in range(5000):
            h.pipeline.frame_received({"type": f"novel-{i}"})
        h.pipeline.frame_received({"type": "novel-0"})
        self.assertEqual(len(h.pipeline._unknown_frame_types), MAX_UNKNOWN_FRAME_TYPES)
        warned = [e for e in logged if "unknown type" in str(e.get("log_format", ""))]
        self.assertEqual(len(warned), MAX_UNKNOWN_FRAME_TYPES)
        c = command("noop")
        h.deliver(c)
        self.assertIn("command_result", h.kinds_for(c["id"]))

    def test_journal_before_ack(self) -> None:
        """The command is in the journal file before the ack frame is sent."""
        h = Harness(self)
        c = command("noop")
        seen: list[bool] = []
        original = h.session.send

        def send(frame: dict[str, Any]) -> bool:
            if frame.get("type") == "command_ack":
                with open(os.path.join(h.dir, "commands.jsonl")) as f:
                    seen.append(c["id"] in f.read())
            return original(frame)

        h.session.send = send  # type: ignore[method-assign]
        h.deliver(c)
        self.assertEqual(seen, [True])

    def test_duplicates_run_once(self) -> None:
        """The same command delivered 50 times (hello_ack and commands frames) runs once."""
        h = Harness(self)
        c = command("noop")
        h.pipeline.frame_received({"type": "hello_ack", "commands": [c], "profile": None})
        for _ in range(49):
            h.deliver(c)
        self.assertEqual(h.calls, [("noop", c["id"])])
        self.assertEqual(h.kinds_for(c["id"]).count("command_ack"), 1)
        self.assertEqual(h.kinds_for(c["id"]).count("command_result"), 1)
        self.assertEqual(h.pipeline.stats["duplicates"], 49)

    def test_single_command_frame(self) -> None:
        """A {"type": "command", "command": {...}} frame is accepted too."""
        h = Harness(self)
        c = command("noop")
        h.pipeline.frame_received({"type": "command", "command": c})
        self.assertEqual(h.calls, [("noop", c["id"])])

    def test_old_command_is_run(self) -> None:
        """A command issued long ago is not refused (no maximum age by default)."""
        h = Harness(self)
        c = command("noop", issued_at="2001-01-01T00:00:00Z")
        h.clock.advance(10**9)
        h.deliver(c)
        self.assertTrue(h.frames_for(c["id"])[-1]["success"])

    def test_max_age_when_configured(self) -> None:
        """With a maximum age set, an older command fails with command_expired."""
        h = Harness(self, max_age=60)
        h.clock.advance(1577836800 + 3600)  # 2020-01-01 + 1 h
        c = command("noop")
        h.deliver(c)
        result = h.frames_for(c["id"])[-1]
        self.assertEqual(result["error_code"], "command_expired")


class BadCommandTests(SynchronousTestCase):
    def test_unknown_type(self) -> None:
        """Unknown command types get a failed result naming the type, never silence."""
        h = Harness(self)
        c = command("frobnicate")
        h.deliver(c)
        result = h.frames_for(c["id"])[-1]
        self.assertEqual(result["type"], "command_result")
        self.assertFalse(result["success"])
        self.assertEqual(result["error_code"], "invalid_command")
        self.assertEqual(result["error_message"], "unsupported command type: frobnicate")

    def test_malformed_with_id(self) -> None:
        """Wrong field types get invalid_command with a message naming the field."""
        h = Harness(self)
        cases = {
            "command_type": command(None),  # type: ignore[arg-type]
            "payload": command("noop", payload=None, **{}),
        }
        cases["payload"]["payload"] = ["not", "an", "object"]
        cases["timeout_sec"] = command("noop", timeout_sec="soon")
        cases["payload.runtime_id"] = command("noop", {"runtime_id": 5})
        cases["command_type "] = command(12)  # type: ignore[arg-type]
        for field_name, c in cases.items():
            h.deliver(c)
            result = h.frames_for(c["id"])[-1]
            self.assertEqual(result["error_code"], "invalid_command", field_name)
            self.assertIn(field_name.strip(), result["error_message"])
        self.assertEqual(h.calls, [])

    def test_malformed_without_id(self) -> None:
        """No id, or an id that is not a UUID: one log line, nothing sent, nothing breaks."""
        h = Harness(self)
        no_id = command("noop")
        del no_id["id"]
        bad_id = command("noop", id="not-a-uuid")
        h.deliver(no_id, bad_id, "garbage", 5, None, [1, 2])  # type: ignore[arg-type]
        self.assertEqual(h.session.frames, [])
        good = command("noop")
        h.deliver(good)
        self.assertTrue(h.frames_for(good["id"])[-1]["success"])

    def test_items_not_a_list(self) -> None:
        """A commands frame whose items is not a list changes nothing."""
        h = Harness(self)
        h.pipeline.frame_received({"type": "commands", "items": {"a": 1}})
        h.pipeline.frame_received({"type": "mystery"})
        self.assertEqual(h.session.frames, [])

    def test_handler_crash_is_internal_error(self) -> None:
        """An unexpected exception in a handler becomes internal_error, and is logged."""
        h = Harness(self)
        c = command("boom")
        h.deliver(c)
        result = h.frames_for(c["id"])[-1]
        self.assertEqual(result["error_code"], "internal_error")
        self.assertNotIn("kaboom", result["error_message"])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_command_failed(self) -> None:
        """CommandFailed carries its code and message to the result."""
        h = Harness(self)
        c = command("fails")
        h.deliver(c)
        result = h.frames_for(c["id"])[-1]
        self.assertEqual(
            (result["error_code"], result["error_message"]), ("runtime_error", "the thing failed")
        )

    def test_signature(self) -> None:
        """A present signature is verified: right runs, wrong gets signature_invalid."""
        h = Harness(self)
        good = command("noop")
        good["signature"] = signature_for(good, h.session.credential())
        bad = command("noop")
        bad["signature"] = "0" * 64
        h.deliver(good, bad)
        self.assertTrue(h.frames_for(good["id"])[-1]["success"])
        self.assertEqual(h.frames_for(bad["id"])[-1]["error_code"], "signature_invalid")


class LaneTests(SynchronousTestCase):
    def test_same_runtime_serialized_logs_overtake(self) -> None:
        """Same-runtime commands run one at a time in order; a logs command does not wait."""
        h = Harness(self)
        a = command("gated", {"runtime_id": "r1"})
        b = command("gated", {"runtime_id": "r1"})
        other = command("gated", {"runtime_id": "r2"})
        logs = command("fetch_container_logs", {"runtime_id": "r1", "tail": 10})
        h.deliver(a, b, other, logs)
        self.assertEqual([c for _, c in h.calls], [a["id"], other["id"], logs["id"]])
        self.assertTrue(h.frames_for(logs["id"])[-1]["success"])
        h.gates[a["id"]].callback({"n": 1})
        self.assertEqual(h.calls[-1][1], b["id"])
        h.gates[b["id"]].callback({"n": 2})
        h.gates[other["id"]].callback({"n": 3})
        for c in (a, b, other):
            self.assertEqual(h.kinds_for(c["id"])[-1], "command_result")

    def test_concurrency_limit(self) -> None:
        """At most max_concurrent commands run at once; the rest start as slots free up."""
        h = Harness(self, max_concurrent=3)
        cs = [command("gated", {"runtime_id": f"r{i}"}) for i in range(5)]
        h.deliver(*cs)
        self.assertEqual(len(h.calls), 3)
        h.gates[cs[0]["id"]].callback({})
        self.assertEqual(len(h.calls), 4)

    def test_twenty_in_parallel(self) -> None:
        """20 commands for different runtimes run in parallel with a limit of 20."""
        h = Harness(self, max_concurrent=20)
        cs = [command("gated", {"runtime_id": f"r{i}"}) for i in range(20)]
        h.deliver(*cs)
        self.assertEqual(len(h.calls), 20)
        for c in cs:
            h.gates[c["id"]].callback({})
        self.assertEqual(h.pipeline.stats["succeeded"], 20)


class DeadlineTests(SynchronousTestCase):
    def test_deadline_cancels(self) -> None:
        """Past its deadline a command is cancelled and fails with timed_out."""
        h = Harness(self)
        c = command("gated", {"runtime_id": "r"})
        h.deliver(c)
        h.clock.advance(61)
        result = h.frames_for(c["id"])[-1]
        self.assertEqual(result["error_code"], "timed_out")
        # The lane is free again.
        c2 = command("noop", {"runtime_id": "r"})
        h.deliver(c2)
        self.assertTrue(h.frames_for(c2["id"])[-1]["success"])


class DeliveryTests(SynchronousTestCase):
    def test_no_frames_after_result(self) -> None:
        """Progress after the result is never sent."""
        h = Harness(self)
        captured: list[Any] = []

        async def handler(ctx: Any) -> dict[str, Any]:
            captured.append(ctx)
            return {}

        h.pipeline.registry["late"] = HandlerSpec(handler, lane="read", idempotent=True, deadline=5)
        c = command("late")
        h.deliver(c)
        captured[0].progress("late", "too late")
        self.assertEqual(h.kinds_for(c["id"]), ["command_ack", "command_result"])

    def test_after_result_runs_once_the_result_is_confirmed(self) -> None:
        """An after_result action waits for the backend's confirmation, across a reconnect, and runs once."""
        h = Harness(self)
        ran: list[str] = []

        async def handler(ctx: Any) -> dict[str, Any]:
            ctx.after_result(lambda: ran.append("after"))
            return {}

        h.pipeline.registry["then"] = HandlerSpec(handler, lane="read", idempotent=True, deadline=5)
        h.session.auto_confirm = False
        c = command("then")
        h.deliver(c)
        self.assertEqual(h.kinds_for(c["id"]).count("command_result"), 1)
        self.assertEqual(ran, [])  # sent, not confirmed
        h.session.disconnect()
        self.assertEqual(ran, [])
        h.session.connected = True
        h.session.auto_confirm = True
        h.pipeline.session_opened()
        self.assertEqual(ran, ["after"])
        h.pipeline.session_opened()
        self.assertEqual(ran, ["after"])

    def test_unconfirmed_result_resent_after_reconnect(self) -> None:
        """A result whose delivery was not confirmed before a disconnect is sent again on connect."""
        h = Harness(self)
        h.session.auto_confirm = False
        c = command("noop")
        h.deliver(c)
        self.assertEqual(h.kinds_for(c["id"]).count("command_result"), 1)
        h.session.disconnect()
        self.assertEqual(h.journal.get(c["id"]).state, FINISHED)
        h.session.connected = True
        h.session.auto_confirm = True
        h.pipeline.session_opened()
        kinds = h.kinds_for(c["id"])
        self.assertEqual(kinds.count("command_result"), 2)
        self.assertNotIn("command_ack", kinds[kinds.index("command_result") :])
        self.assertEqual(h.journal.get(c["id"]).state, DELIVERED)

    def test_result_while_disconnected(self) -> None:
        """A command finishing while disconnected has its result sent at the next connect."""
        h = Harness(self)
        c = command("gated", {"runtime_id": "x"})
        h.deliver(c)
        h.session.disconnect()
        h.gates[c["id"]].callback({"done": 1})
        self.assertEqual(h.kinds_for(c["id"]).count("command_result"), 0)
        h.session.connected = True
        h.pipeline.session_opened()
        self.assertEqual(h.kinds_for(c["id"]).count("command_result"), 1)

    def test_ack_not_sent_gets_sent_on_connect(self) -> None:
        """A command received while the ack could not be sent is acked after the next connect."""
        h = Harness(self)
        h.session.connected = False
        c = command("gated", {"runtime_id": "x"})
        h.deliver(c)
        self.assertEqual(h.session.frames, [])
        h.session.connected = True
        h.pipeline.session_opened()
        # The ack first, then where the running command is (its keepalive, issue 18).
        self.assertEqual(h.kinds_for(c["id"]), ["command_ack", "command_progress"])
        self.assertEqual(h.frames_for(c["id"])[1]["phase"], "start")

    def test_large_result_dropped_after_delivery(self) -> None:
        """Large results (logs) are not kept in the journal once delivered."""
        h = Harness(self)
        c = command("fetch_container_logs", {"runtime_id": "r", "tail": 5})
        h.deliver(c)
        rec = h.journal.get(c["id"])
        self.assertEqual(rec.state, DELIVERED)
        self.assertNotIn("logs", rec.result_frame["result"])

    def test_command_finished_event(self) -> None:
        """Each finished command emits a small command.finished event."""
        h = Harness(self)
        c = command("fetch_container_logs", {"runtime_id": "r", "tail": 5})
        h.deliver(c)
        h.outbox.flush()
        batches = h.session.of_type("event_batch")
        events = [e for b in batches for e in b["events"] if e["event_type"] == "command.finished"]
        self.assertEqual(len(events), 1)
        self.assertEqual(events[0]["payload"]["command_id"], c["id"])
        self.assertNotIn("logs", events[0]["payload"])


class RecoveryTests(SynchronousTestCase):
    def _restart(self, h: Harness) -> Harness:
        """Simulate a crash: drop the pipeline without stopping it, start a new one on the same dir."""
        h.pipeline.stopService()  # like a crash: running commands keep no result
        return Harness(self, directory=h.dir)

    def test_idempotent_rerun_after_crash(self) -> None:
        """An idempotent command interrupted by a crash is re-run at the next start: one result."""
        h = Harness(self)
        c = command("gated", {"runtime_id": "r"})
        h.deliver(c)
        h2 = self._restart(h)
        self.assertEqual(h2.calls, [("gated", c["id"])])
        h2.gates[c["id"]].callback({"again": True})
        self.assertEqual(h2.kinds_for(c["id"])[-1], "command_result")
        self.assertEqual(h2.kinds_for(c["id"]).count("command_result"), 1)
        # Duplicate delivery from the backend after the restart does not run it a third time.
        h2.deliver(c)
        self.assertEqual(len(h2.calls), 1)

    def test_unsafe_fails_agent_restarted(self) -> None:
        """A non-idempotent command interrupted by a crash fails with agent_restarted."""
        h = Harness(self)
        c = command("gated_unsafe", {"runtime_id": "r"})
        h.deliver(c)
        h2 = self._restart(h)
        self.assertEqual(h2.calls, [])
        result = h2.frames_for(c["id"])[-1]
        self.assertEqual(result["error_code"], "agent_restarted")
        self.assertIn("not safe to repeat", result["error_message"])

    def test_finished_undelivered_resent_after_restart(self) -> None:
        """A result computed but not confirmed before a crash is sent after the restart, not re-run."""
        h = Harness(self)
        h.session.auto_confirm = False
        c = command("noop")
        h.deliver(c)
        h2 = self._restart(h)
        self.assertEqual(h2.calls, [])
        h2.pipeline.session_opened()
        self.assertEqual(h2.kinds_for(c["id"]), ["command_result"])

    def test_clean_stop_leaves_command_for_next_start(self) -> None:
        """A clean stop cancels running handlers without a result; the next start resolves them."""
        h = Harness(self)
        c = command("gated", {"runtime_id": "r"})
        h.deliver(c)
        h.pipeline.stopService()
        self.assertEqual(h.kinds_for(c["id"]).count("command_result"), 0)
        h2 = Harness(self, directory=h.dir)
        self.assertEqual(h2.calls, [("gated", c["id"])])


class NodeCommandTests(SynchronousTestCase):
    def test_maintenance_values(self) -> None:
        """enabled accepts booleans and "true"/"false"/"1"/"0"; anything else is invalid_command."""
        h = Harness(self)
        for value, expected in [
            (True, True),
            ("false", False),
            ("1", True),
            ("0", False),
            (False, False),
        ]:
            c = command("set_maintenance_mode", {"enabled": value})
            h.deliver(c)
            self.assertEqual(h.frames_for(c["id"])[-1]["result"], {"maintenance_mode": expected})
        for value in ("yes", None, 2, [1]):
            c = command("set_maintenance_mode", {"enabled": value})
            h.deliver(c)
            self.assertEqual(h.frames_for(c["id"])[-1]["error_code"], "invalid_command")

    def test_maintenance_and_drain_block_and_persist(self) -> None:
        """Maintenance blocks deploys with policy_violation, persists across restarts; drain too."""
        h = Harness(self)
        h.deliver(command("set_maintenance_mode", {"enabled": "true"}))
        c = command("deploy_workload", {"runtime_id": "r"})
        h.deliver(c)
        self.assertEqual(h.frames_for(c["id"])[-1]["error_code"], "policy_violation")
        h2 = Harness(self, directory=h.dir)
        self.assertTrue(h2.modes.maintenance)
        self.assertEqual(h2.modes.status(), "maintenance")
        h2.deliver(command("set_maintenance_mode", {"enabled": False}), command("drain_node"))
        self.assertEqual(h2.modes.status(), "draining")
        c2 = command("deploy_workload", {"runtime_id": "r"})
        h2.deliver(c2)
        self.assertIn("draining", h2.frames_for(c2["id"])[-1]["error_message"])
        logs = command("fetch_container_logs", {"runtime_id": "r"})
        h2.deliver(logs)
        self.assertTrue(h2.frames_for(logs["id"])[-1]["success"])
        h2.deliver(command("resume_node"))
        self.assertEqual(h2.modes.status(), "healthy")

    def test_refresh_inventory_before_result(self) -> None:
        """refresh_inventory sends the inventory frame before its result."""
        h = Harness(self)
        c = command("refresh_inventory")
        h.deliver(c)
        kinds = [
            f["type"] for f in h.session.frames if f["type"] in ("inventory", "command_result")
        ]
        self.assertEqual(kinds, ["inventory", "command_result"])

    def test_profile_flat_and_wrapped(self) -> None:
        """sync_node_profile accepts the flat profile and one wrapped in 'profile'."""
        h = Harness(self)
        h.deliver(command("sync_node_profile", {"id": "p1", "name": "flat", "gpu_config": {}}))
        self.assertEqual(h.modes.profile["name"], "flat")
        h.deliver(command("sync_node_profile", {"profile": {"id": "p2", "name": "wrapped"}}))
        self.assertEqual(h.modes.profile["name"], "wrapped")

    def test_host_op_refused(self) -> None:
        """host_op is refused with a failed result."""
        h = Harness(self)
        c = command("host_op", {"op": "reboot"})
        h.deliver(c)
        result = h.frames_for(c["id"])[-1]
        self.assertFalse(result["success"])
        self.assertEqual(result["error_code"], "policy_violation")

    def test_diagnostics_is_object(self) -> None:
        """collect_diagnostics returns an object, not a JSON string."""
        h = Harness(self)
        c = command("collect_diagnostics")
        h.deliver(c)
        self.assertIsInstance(h.frames_for(c["id"])[-1]["result"]["agent"], dict)


class StaleListTests(SynchronousTestCase):
    def test_listed_again_before_ack_processed(self) -> None:
        """A command listed again on the same connection (stale list) is not acked twice."""
        h = Harness(self)
        h.session.auto_confirm = False
        c = command("gated", {"runtime_id": "r"})
        for _ in range(5):
            h.deliver(c)
        self.assertEqual(h.kinds_for(c["id"]).count("command_ack"), 1)

    def test_reack_after_reconnect(self) -> None:
        """An ack not confirmed before a disconnect is sent again after the reconnect."""
        h = Harness(self)
        h.session.auto_confirm = False
        c = command("gated", {"runtime_id": "r"})
        h.deliver(c)
        h.session.disconnect()
        h.pipeline.session_closed()
        h.session.connected = True
        h.pipeline.session_opened()
        self.assertEqual(h.kinds_for(c["id"]).count("command_ack"), 2)


class ReviewFixTests(SynchronousTestCase):
    def test_null_signature_is_absent(self) -> None:
        """A "signature": null field is treated as no signature."""
        h = Harness(self)
        c = command("noop", signature=None)
        h.deliver(c)
        self.assertTrue(h.frames_for(c["id"])[-1]["success"])

    def test_relisted_in_hello_after_delivery_resends_result(self) -> None:
        """A delivered command listed again in hello_ack gets its stored result again."""
        h = Harness(self)
        c = command("noop")
        h.deliver(c)
        self.assertEqual(h.kinds_for(c["id"]).count("command_result"), 1)
        h.deliver(c)  # a stale list on the same connection: ignored
        self.assertEqual(h.kinds_for(c["id"]).count("command_result"), 1)
        h.pipeline.frame_received({"type": "hello_ack", "commands": [c], "profile": None})
        self.assertEqual(h.kinds_for(c["id"]).count("command_result"), 2)
        self.assertEqual(len(h.calls), 1)

    def test_node_lane_not_behind_deploy_slots(self) -> None:
        """Node commands do not wait for the runtime lanes' concurrency slots."""
        h = Harness(self, max_concurrent=1)
        h.deliver(command("gated", {"runtime_id": "a"}), command("gated", {"runtime_id": "b"}))
        c = command("drain_node")
        h.deliver(c)
        self.assertTrue(h.frames_for(c["id"])[-1]["success"])

    def test_never_started_unsafe_command_runs_after_restart(self) -> None:
        """A non-idempotent command that never started (queued behind its lane) is run after a restart."""
        h = Harness(self)
        first = command("gated_unsafe", {"runtime_id": "r"})
        second = command("gated_unsafe", {"runtime_id": "r"})
        h.deliver(first, second)
        h.pipeline.stopService()
        h2 = Harness(self, directory=h.dir)
        self.assertEqual(h2.frames_for(first["id"])[-1]["error_code"], "agent_restarted")
        self.assertIn(("gated_unsafe", second["id"]), h2.calls)


class ProfileSecretTests(SynchronousTestCase):
    def test_profile_registry_credentials_stay_in_memory(self) -> None:
        """A profile's registry credentials are used from memory and never written to state.json."""
        h = Harness(self)
        secret = "PROFILE-SECRET-123"
        profile = {"id": "p", "name": "gpu", "runtime_config": {"registry_auth": {"username": "u", "password": secret}}}
        h.deliver(command("sync_node_profile", profile))
        self.assertEqual(h.modes.profile["runtime_config"]["registry_auth"]["password"], secret)
        with open(h.state.path) as f:
            self.assertNotIn(secret, f.read())
