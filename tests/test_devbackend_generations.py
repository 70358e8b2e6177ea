"""
The stand-in backend's two generations (protocol 10): C{"current"} (the default) pushes
commands, re-dispatches overdue in-flight commands at C{hello_ack}, fails in-flight commands
when the node's last stream closes, reaps silent ones, closes stale sessions, has the
C{canceled}/C{timed_out} statuses and retires idempotency keys; C{"2026-04"} does none of it.

Table semantics are unit-tested on L{BackendState} with a L{Clock}; push, re-dispatch and the
stream-lost failure also over real loopback with a minimal client that is not the agent.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmport_agent.devbackend import DevBackend
from llmport_agent.devbackend._state import (
    GENERATION_APRIL,
    GENERATION_CURRENT,
    REAPER_INTERVAL_SEC,
    BackendState,
)
from tests.test_devbackend import LoopbackMixin

START = 1_700_000_000


def _state(generation: str = GENERATION_CURRENT, **kw: Any) -> tuple[BackendState, Clock, str]:
    clock = Clock()
    clock.advance(START)
    state = BackendState(clock, generation=generation, **kw)
    token = state.mint_token()["token"]
    node_id = state.enroll(token, "node-a", "10.0.0.5", {}, "1.0", "127.0.0.1")["node_id"]
    return state, clock, node_id


def _frame(state: BackendState, node_id: str, kind: str, command_id: str, **fields: Any) -> None:
    state.apply_frame(node_id, {"type": kind, "command_id": command_id, **fields})


class OptionTests(SynchronousTestCase):
    def test_generation_and_scale_are_checked(self) -> None:
        """An unknown generation or a reaper scale <= 0 is refused with a clear message."""
        with self.assertRaisesRegex(ValueError, "unknown backend generation '2025'"):
            BackendState(Clock(), generation="2025")
        with self.assertRaisesRegex(ValueError, "reaper_scale must be greater than 0"):
            BackendState(Clock(), reaper_scale=0)
        from twisted.internet import reactor

        backend = DevBackend(reactor)
        self.assertEqual((backend.generation, backend.reaper_scale), ("current", 1.0))
        backend = DevBackend(reactor, generation="2026-04", reaper_scale=0.5)
        self.assertEqual((backend.generation, backend.reaper_scale), ("2026-04", 0.5))

    def test_cli_options(self) -> None:
        """--generation (default current) and --reaper-scale reach the parser."""
        from llmport_agent.devbackend import cli

        args = cli.build_parser().parse_args([])
        self.assertEqual((args.generation, args.reaper_scale), ("current", 1.0))
        args = cli.build_parser().parse_args(["--generation", "2026-04", "--reaper-scale", "0.01"])
        self.assertEqual((args.generation, args.reaper_scale), ("2026-04", 0.01))
        self.assertEqual(cli.main(["--generation", "2025"]), cli.EX_USAGE)
        self.assertEqual(cli.main(["--reaper-scale", "0"]), cli.EX_USAGE)


class IdempotencyTests(SynchronousTestCase):
    def test_current_retires_terminal_keys(self) -> None:
        """A key blocks while its command is in flight; a terminal one's key becomes <key>::retired::<id>."""
        state, _clock, node_id = _state()
        first = state.issue_command(node_id, "refresh_inventory", {}, idempotency_key="k")
        self.assertEqual(
            state.issue_command(node_id, "refresh_inventory", {}, idempotency_key="k")["id"],
            first["id"],
        )
        _frame(state, node_id, "command_ack", first["id"])
        _frame(state, node_id, "command_result", first["id"], success=False)
        second = state.issue_command(node_id, "refresh_inventory", {}, idempotency_key="k")
        self.assertNotEqual(second["id"], first["id"])
        self.assertEqual(state.commands[first["id"]].idempotency_key, f"k::retired::{first['id']}")
        self.assertEqual(second["idempotency_key"], "k")

    def test_april_keeps_keys(self) -> None:
        """2026-04: the terminal command keeps its key (only in-flight ones block)."""
        state, _clock, node_id = _state(GENERATION_APRIL)
        first = state.issue_command(node_id, "refresh_inventory", {}, idempotency_key="k")
        _frame(state, node_id, "command_result", first["id"], success=True)
        second = state.issue_command(node_id, "refresh_inventory", {}, idempotency_key="k")
        self.assertNotEqual(second["id"], first["id"])
        self.assertEqual(state.commands[first["id"]].idempotency_key, "k")


class CancelTests(SynchronousTestCase):
    def test_cancel_current(self) -> None:
        """Canceled is terminal: never dispatched again, its key retired on reuse; a second cancel is refused."""
        state, _clock, node_id = _state()
        cmd = state.issue_command(node_id, "collect_diagnostics", {}, idempotency_key="d")
        out = state.cancel_command(cmd["id"])
        self.assertEqual(out["status"], "canceled")
        self.assertIsNotNone(out["completed_at"])
        self.assertEqual(state.commands[cmd["id"]].timeline[-1]["event_type"], "canceled")
        self.assertEqual(state.take_dispatch(node_id), [])
        self.assertEqual(state.hello_commands(node_id), [])
        with self.assertRaisesRegex(ValueError, "already canceled"):
            state.cancel_command(cmd["id"])
        again = state.issue_command(node_id, "collect_diagnostics", {}, idempotency_key="d")
        self.assertNotEqual(again["id"], cmd["id"])

    def test_cancel_april_refused(self) -> None:
        state, _clock, node_id = _state(GENERATION_APRIL)
        cmd = state.issue_command(node_id, "collect_diagnostics", {})
        with self.assertRaisesRegex(ValueError, "2026-04 backend cannot cancel"):
            state.cancel_command(cmd["id"])
        self.assertEqual(state.commands[cmd["id"]].status, "queued")


class CommandIdTests(SynchronousTestCase):
    def test_current_skips_a_frame_with_a_bad_command_id(self) -> None:
        """Current: a command_* frame without a UUID command_id is skipped (no dispatch pass), noted; 2026-04 drops."""
        state, _clock, node_id = _state()
        for value in ("nope", None, 5):
            frame = {"type": "command_ack", "command_id": value}
            self.assertIs(state.apply_frame(node_id, frame), False)
        self.assertEqual(len(state.anomalies[node_id]), 3)
        self.assertIn("not a UUID", state.anomalies[node_id][0])
        self.assertIn("without command_id", state.anomalies[node_id][1])
        self.assertIs(state.apply_frame(node_id, {"type": "heartbeat"}), True)


class FieldsReadTests(SynchronousTestCase):
    def test_current_heartbeat_and_event_batch_are_read_leniently(self) -> None:
        """Current: status str()-ed, a non-string version left out, advertise_host stripped; events
        not a list or not objects left out, event_type defaulting to type then "event"."""
        state, _clock, node_id = _state()
        state.apply_frame(node_id, {"type": "heartbeat", "status": 5, "version": 7,
                                    "advertise_host": " 10.1.2.3 "})
        node = state.nodes[node_id]
        self.assertEqual((node.status, node.version, node.host), ("5", "1.0", "10.1.2.3"))
        state.apply_frame(node_id, {"type": "heartbeat", "status": ""})
        self.assertEqual(node.status, "healthy")
        state.apply_frame(node_id, {"type": "event_batch", "events": "nope"})
        state.apply_frame(node_id, {"type": "event_batch", "events": [
            "junk", {"type": "custom.kind", "severity": None}, {"payload": {}}]})
        self.assertEqual(
            [(e["event_type"], e["severity"]) for e in state.events[node_id]],
            [("custom.kind", "info"), ("event", "info")],
        )
        self.assertEqual(len(state.anomalies[node_id]), 2)  # the non-list and the non-object

    def test_health_running_waits_for_the_provisioning_command(self) -> None:
        """Current: workload.health.running does not promote a starting runtime while its deploy is in flight."""
        for generation, promoted in ((GENERATION_CURRENT, False), (GENERATION_APRIL, True)):
            state, _clock, node_id = _state(generation)
            cmd = state.issue_command(node_id, "deploy_workload", {"runtime_id": "rt-5"})
            state.take_dispatch(node_id)
            _frame(state, node_id, "command_ack", cmd["id"])
            event = {"event_type": "workload.health.running",
                     "payload": {"runtime_id": "rt-5", "endpoint_url": "http://h:1"}}
            state.apply_frame(node_id, {"type": "event_batch", "events": [event]})
            self.assertEqual(state.runtimes["rt-5"].status == "running", promoted, generation)
            _frame(state, node_id, "command_result", cmd["id"], success=False, error_message="x")
            state.apply_frame(node_id, {"type": "event_batch", "events": [event]})
            self.assertEqual(state.runtimes["rt-5"].status, "running", generation)  # from error: promoted


class RuntimeEffectTests(SynchronousTestCase):
    def test_current_failure_text_and_kept_endpoint(self) -> None:
        """Current: a failure without a message shows its code (2000 characters at most); a success without an endpoint keeps the old one."""
        for generation in (GENERATION_CURRENT, GENERATION_APRIL):
            state, _clock, node_id = _state(generation)
            state.add_runtime("rt-7", node_id, status="running", endpoint_url="http://10.0.0.5:9")
            start = state.issue_command(node_id, "start_workload", {"runtime_id": "rt-7"})
            _frame(state, node_id, "command_result", start["id"], success=True, result={})
            kept = state.runtimes["rt-7"].endpoint_url
            self.assertEqual(kept, "http://10.0.0.5:9" if generation == GENERATION_CURRENT else None)
            logs = state.issue_command(node_id, "fetch_container_logs", {"runtime_id": "rt-7"})
            _frame(state, node_id, "command_result", logs["id"], success=False, error_code="runtime_error")
            message = state.runtimes["rt-7"].error_message
            self.assertEqual(message, "runtime_error" if generation == GENERATION_CURRENT else None)
            again = state.issue_command(node_id, "fetch_container_logs", {"runtime_id": "rt-7"})
            _frame(state, node_id, "command_result", again["id"], success=False, error_message="x" * 5000)
            self.assertEqual(
                len(state.runtimes["rt-7"].error_message or ""),
                2000 if generation == GENERATION_CURRENT else 5000,
            )


class RedispatchTests(SynchronousTestCase):
    def test_overdue_rule(self) -> None:
        """Acked: overdue after timeout_sec since the ack; running: after twice it; null means 900 s."""
        state, clock, node_id = _state()
        cmd = state.issue_command(node_id, "refresh_inventory", {}, timeout_sec=60)
        state.take_dispatch(node_id)
        record = state.commands[cmd["id"]]
        clock.advance(30)
        self.assertFalse(state.is_overdue(record))
        clock.advance(31)  # 61 s since dispatch
        self.assertTrue(state.is_overdue(record))
        _frame(state, node_id, "command_ack", cmd["id"])
        clock.advance(60)
        self.assertFalse(state.is_overdue(record))
        clock.advance(1)
        self.assertTrue(state.is_overdue(record))
        _frame(state, node_id, "command_progress", cmd["id"])
        clock.advance(119)
        self.assertFalse(state.is_overdue(record))
        clock.advance(2)
        self.assertTrue(state.is_overdue(record))
        default = state.issue_command(node_id, "refresh_inventory", {}, timeout_sec=0)
        state.take_dispatch(node_id)
        clock.advance(900)
        self.assertFalse(state.is_overdue(state.commands[default["id"]]))
        clock.advance(1)
        self.assertTrue(state.is_overdue(state.commands[default["id"]]))

    def test_hello_ack_redispatches_overdue_current(self) -> None:
        """hello_ack: queued commands as before, then overdue in-flight ones with redispatch: true."""
        state, clock, node_id = _state()
        acked = state.issue_command(node_id, "sync_model", {}, timeout_sec=60)
        fresh = state.issue_command(node_id, "refresh_inventory", {}, timeout_sec=60)
        state.take_dispatch(node_id)
        _frame(state, node_id, "command_ack", acked["id"])
        _frame(state, node_id, "command_ack", fresh["id"])
        clock.advance(30)
        _frame(state, node_id, "command_ack", fresh["id"])  # acked_at stays the first ack
        clock.advance(31)
        queued = state.issue_command(node_id, "collect_diagnostics", {})
        items = state.hello_commands(node_id)
        self.assertEqual(
            [(c["id"], c.get("redispatch")) for c in items],
            [(queued["id"], None), (acked["id"], True), (fresh["id"], True)],
        )
        self.assertEqual(items[1]["status"], "acked")
        timeline = state.commands[acked["id"]].timeline
        self.assertEqual(timeline[-1]["event_type"], "re-dispatched")
        # Not on the per-frame path: later replies carry only queued/dispatched commands.
        self.assertEqual([c["id"] for c in state.take_dispatch(node_id)], [queued["id"]])

    def test_hello_ack_april_never_resends_acked(self) -> None:
        state, clock, node_id = _state(GENERATION_APRIL)
        acked = state.issue_command(node_id, "sync_model", {}, timeout_sec=60)
        state.take_dispatch(node_id)
        _frame(state, node_id, "command_ack", acked["id"])
        clock.advance(10_000)
        self.assertEqual(state.hello_commands(node_id), [])
        self.assertNotIn("re-dispatched", [e["event_type"] for e in state.commands[acked["id"]].timeline])


class StreamLostTests(SynchronousTestCase):
    def _deploy(self, state: BackendState, node_id: str) -> dict[str, Any]:
        cmd = state.issue_command(
            node_id, "deploy_workload", {"runtime_id": "rt-1", "runtime_name": "r"}
        )
        state.take_dispatch(node_id)
        _frame(state, node_id, "command_ack", cmd["id"])
        _frame(state, node_id, "command_progress", cmd["id"], phase="pull_image")
        return cmd

    def test_current_fails_in_flight_and_a_later_result_corrects(self) -> None:
        """Last stream closed: in-flight -> failed node_stream_lost, runtime error; a result afterwards wins."""
        state, _clock, node_id = _state()
        session = state.session_opened(node_id)
        cmd = self._deploy(state, node_id)
        queued = state.issue_command(node_id, "refresh_inventory", {})
        state.session_closed(session, last=True)
        record = state.commands[cmd["id"]]
        self.assertEqual((record.status, record.error_code), ("failed", "node_stream_lost"))
        self.assertEqual(record.timeline[-1]["event_type"], "failed")
        self.assertEqual(state.runtimes["rt-1"].status, "error")
        self.assertEqual(state.runtimes["rt-1"].error_message, record.error_message)
        self.assertEqual(state.commands[queued["id"]].status, "queued")  # never sent: not lost
        # The agent finished the work and reports it after reconnecting.
        state.session_opened(node_id)
        _frame(state, node_id, "command_progress", cmd["id"], phase="ready")
        _frame(
            state, node_id, "command_result", cmd["id"], success=True,
            result={"endpoint_url": "http://127.0.0.1:9001"},
        )
        self.assertEqual((record.status, record.error_code), ("succeeded", None))
        self.assertEqual(state.runtimes["rt-1"].status, "running")
        self.assertEqual(record.history, ["queued", "dispatched", "acked", "running", "failed", "running", "succeeded"])
        self.assertEqual(state.anomalies, {})

    def test_model_sync_lost_with_the_stream_reads_failed(self) -> None:
        """Current: a sync_model in flight when the stream closes leaves the model failed on the node, not syncing."""
        state, _clock, node_id = _state()
        session = state.session_opened(node_id)
        cmd = state.issue_command(node_id, "sync_model", {"model_sync": {"model_id": "m-1"}})
        state.take_dispatch(node_id)
        _frame(state, node_id, "command_progress", cmd["id"], progress_pct=10, message="copying")
        self.assertEqual(state.model_availability[node_id]["m-1"]["status"], "syncing")
        state.session_closed(session, last=True)
        self.assertEqual(state.model_availability[node_id]["m-1"]["status"], "failed")

    def test_april_leaves_in_flight_alone(self) -> None:
        """2026-04: the command stays running; only the runtime goes to error (Node offline)."""
        state, _clock, node_id = _state(GENERATION_APRIL)
        session = state.session_opened(node_id)
        cmd = self._deploy(state, node_id)
        state.session_closed(session, last=True)
        self.assertEqual(state.commands[cmd["id"]].status, "running")
        self.assertEqual(
            (state.runtimes["rt-1"].status, state.runtimes["rt-1"].error_message),
            ("error", "Node offline"),
        )

    def test_replayed_result_after_stream_lost_is_dropped_and_noted(self) -> None:
        """A replayed result cannot correct a stream-lost failure: the backend keeps its own, noted as an anomaly."""
        state, _clock, node_id = _state()
        session = state.session_opened(node_id)
        cmd = self._deploy(state, node_id)
        state.session_closed(session, last=True)
        _frame(state, node_id, "command_result", cmd["id"], success=True, result={"replayed": True})
        self.assertEqual(state.commands[cmd["id"]].error_code, "node_stream_lost")
        self.assertEqual(state.commands[cmd["id"]].timeline[-1]["event_type"], "duplicate")
        self.assertIn("replayed command_result", state.anomalies[node_id][0])

    def test_replayed_duplicate_keeps_the_first_result(self) -> None:
        """Current: a replayed second result is a 'duplicate' row, no anomaly, no side effect twice."""
        state, _clock, node_id = _state()
        cmd = self._deploy(state, node_id)
        _frame(state, node_id, "command_result", cmd["id"], success=True, result={"endpoint_url": "http://h:1"})
        _frame(state, node_id, "command_result", cmd["id"], success=False, result={"replayed": True})
        self.assertEqual(state.commands[cmd["id"]].status, "succeeded")
        self.assertEqual(state.anomalies, {})
        # Not replayed: still a second result, and still an anomaly (the status changes).
        _frame(state, node_id, "command_result", cmd["id"], success=False)
        self.assertEqual(state.anomalies[node_id], [f"second command_result for {cmd['id']}"])

    def test_ack_after_result_is_still_an_anomaly(self) -> None:
        for generation in (GENERATION_CURRENT, GENERATION_APRIL):
            state, _clock, node_id = _state(generation)
            cmd = state.issue_command(node_id, "refresh_inventory", {})
            _frame(state, node_id, "command_result", cmd["id"], success=True)
            _frame(state, node_id, "command_ack", cmd["id"])
            _frame(state, node_id, "command_progress", cmd["id"])
            self.assertEqual(
                [n.split(" (")[0] for n in state.anomalies[node_id]],
                [f"command_ack after the result of {cmd['id']}",
                 f"command_progress after the result of {cmd['id']}"],
                generation,
            )


class ReaperTests(SynchronousTestCase):
    def test_silent_command_reaped_at_scaled_time(self) -> None:
        """Scale 0.01: overdue and silent for max(3 s, timeout_sec) -> timed_out, runtime error, anomaly."""
        state, clock, node_id = _state(reaper_scale=0.01)
        session = state.session_opened(node_id)
        cmd = state.issue_command(
            node_id, "start_workload", {"runtime_id": "rt-2"}, timeout_sec=1
        )
        state.take_dispatch(node_id)
        _frame(state, node_id, "command_ack", cmd["id"])
        record = state.commands[cmd["id"]]
        clock.advance(2.9)  # overdue (> 1 s) but not silent for 3 s yet
        state.sweep()
        self.assertEqual(record.status, "acked")
        _frame(state, node_id, "command_progress", cmd["id"])  # sign of life
        state.session_offset_accepted(session)  # the node's frames keep the session fresh
        clock.advance(2.9)
        state.session_offset_accepted(session)
        state.sweep()
        self.assertEqual(record.status, "running")  # running: overdue only after 2 s, silent after 3 s
        clock.advance(0.2)
        state.sweep()
        self.assertEqual((record.status, record.error_code), ("timed_out", "command_timed_out"))
        self.assertEqual(state.nodes[node_id].status, "healthy")  # connected all along
        self.assertIsNotNone(record.completed_at)
        self.assertEqual(record.timeline[-1]["event_type"], "timed_out")
        self.assertEqual(state.runtimes["rt-2"].status, "error")
        self.assertIn("timed out by the silence reaper", state.anomalies[node_id][0])
        # A late result still overwrites it.
        _frame(state, node_id, "command_result", cmd["id"], success=True, result={"endpoint_url": "http://h:2"})
        self.assertEqual(record.status, "succeeded")

    def test_ten_minute_command_with_progress_never_reaped_at_real_300s(self) -> None:
        """Real constants: a 10-minute command with progress every 60 s survives; silent 300 s past its budget it does not."""
        state, clock, node_id = _state()
        state.session_opened(node_id)
        cmd = state.issue_command(node_id, "sync_model", {}, timeout_sec=60)
        state.take_dispatch(node_id)
        _frame(state, node_id, "command_ack", cmd["id"])
        record = state.commands[cmd["id"]]
        for _ in range(10):
            clock.advance(60)
            _frame(state, node_id, "command_progress", cmd["id"], seq=1)
            state.session_offset_accepted(next(iter(state.sessions)))
            state.sweep()
            self.assertEqual(record.status, "running")
        _frame(state, node_id, "command_result", cmd["id"], success=True)
        self.assertEqual(record.status, "succeeded")
        silent = state.issue_command(node_id, "sync_model", {}, timeout_sec=60)
        state.take_dispatch(node_id)
        _frame(state, node_id, "command_ack", silent["id"])
        clock.advance(299)
        state.session_offset_accepted(next(iter(state.sessions)))
        state.sweep()
        self.assertEqual(state.commands[silent["id"]].status, "acked")
        clock.advance(1)
        state.sweep()
        self.assertEqual(state.commands[silent["id"]].status, "timed_out")

    def test_offline_grace(self) -> None:
        """Offline node: overdue commands time out only 600 s (x scale) after the agent took them on."""
        state, clock, node_id = _state(reaper_scale=0.01)
        cmd = state.issue_command(node_id, "sync_model", {}, timeout_sec=1)
        state.take_dispatch(node_id)
        state.nodes[node_id].status = "offline"  # e.g. a node marked offline without a session
        clock.advance(5.9)
        state.sweep()
        self.assertEqual(state.commands[cmd["id"]].status, "dispatched")
        clock.advance(0.2)
        state.sweep()
        self.assertEqual(state.commands[cmd["id"]].status, "timed_out")
        self.assertNotIn(node_id, state.anomalies)  # offline: not the agent's silence

    def test_stale_session_counts_as_disconnected(self) -> None:
        """No accepted seq frame for 300 s: the session closes, the node goes offline, in-flight commands fail."""
        state, clock, node_id = _state()
        session = state.session_opened(node_id)
        cmd = state.issue_command(node_id, "sync_model", {}, timeout_sec=3600)
        state.take_dispatch(node_id)
        clock.advance(299)
        state.session_offset_accepted(session)
        clock.advance(299)
        state.sweep()
        self.assertIsNone(state.sessions[session]["closed_at"])
        clock.advance(2)
        state.sweep()
        self.assertIsNotNone(state.sessions[session]["closed_at"])
        self.assertEqual(state.nodes[node_id].status, "offline")
        self.assertEqual(state.commands[cmd["id"]].error_code, "node_stream_lost")

    def test_april_has_no_reapers(self) -> None:
        state, clock, node_id = _state(GENERATION_APRIL, reaper_scale=0.01)
        session = state.session_opened(node_id)
        cmd = state.issue_command(node_id, "sync_model", {}, timeout_sec=1)
        state.take_dispatch(node_id)
        clock.advance(100_000)
        state.sweep()
        self.assertEqual(state.commands[cmd["id"]].status, "dispatched")
        self.assertIsNone(state.sessions[session]["closed_at"])


class PushTests(LoopbackMixin, TestCase):
    """Push, re-dispatch and stream loss over real loopback."""

    timeout = 20

    async def test_push_without_an_agent_frame(self) -> None:
        """Current: a command queued while connected arrives with no frame from the agent."""
        await self.start()
        reply = await self.enroll()
        client = await self.open_stream(reply["credential"])
        cmd = self.backend.issue_command(reply["node_id"], "collect_diagnostics", {})
        await client.wait_messages(lambda m: len(m) >= 2)
        self.assertEqual(client.messages[1]["type"], "commands")
        self.assertEqual([c["id"] for c in client.messages[1]["items"]], [cmd["id"]])
        self.assertEqual(self.backend.frames(reply["node_id"]), [])
        self.assertEqual(self.backend.costs(reply["node_id"])["wakeup_drains"], 1)
        # Two commands queued in one go: one dispatch pass carries both (coalesced wake-up).
        a = self.backend.issue_command(reply["node_id"], "refresh_inventory", {})
        b = self.backend.issue_command(reply["node_id"], "refresh_inventory", {})
        await client.wait_messages(lambda m: len(m) >= 3)
        await client.barrier()
        self.assertEqual(len(client.messages), 3)
        self.assertEqual(
            [c["id"] for c in client.messages[2]["items"]], [cmd["id"], a["id"], b["id"]]
        )

    async def test_april_does_not_push(self) -> None:
        await self.start(generation="2026-04")
        reply = await self.enroll()
        client = await self.open_stream(reply["credential"])
        self.backend.issue_command(reply["node_id"], "collect_diagnostics", {})
        for _ in range(3):
            await client.barrier()
        self.assertEqual([m["type"] for m in client.messages], ["hello_ack"])

    async def test_every_stream_of_the_node_is_woken(self) -> None:
        """Two sessions of one node each get the pushed command."""
        await self.start()
        reply = await self.enroll()
        one = await self.open_stream(reply["credential"])
        two = await self.open_stream(reply["credential"])
        cmd = self.backend.issue_command(reply["node_id"], "collect_diagnostics", {})
        for client in (one, two):
            await client.wait_messages(lambda m: len(m) >= 2)
            self.assertEqual(client.messages[1]["items"][0]["id"], cmd["id"])

    async def test_stale_seq_frame_still_dispatches(self) -> None:
        """Current: a frame dropped for its seq runs a dispatch pass (costed as a frame without seq)."""
        await self.start()
        reply = await self.enroll()
        node_id = reply["node_id"]
        client = await self.open_stream(reply["credential"])
        cmd = self.backend.issue_command(node_id, "collect_diagnostics", {})
        await client.wait_messages(lambda m: len(m) >= 2)
        client.send({"type": "heartbeat", "status": "degraded", "seq": 0})
        await client.wait_messages(lambda m: len(m) >= 3)
        self.assertEqual(client.messages[2]["items"][0]["id"], cmd["id"])
        self.assertEqual([f["_accepted"] for f in self.backend.frames(node_id)], [False])
        self.assertEqual(self.backend.node(node_id)["status"], "healthy")  # type: ignore[index]
        cost = self.backend.costs(node_id)
        self.assertEqual((cost["offset_writes"], cost["dispatch_queries"]), (0, 1))

    async def test_bad_command_id_frame_gets_no_reply(self) -> None:
        """Current: a command_ack with a non-UUID id is skipped: no dispatch pass, no drop, no cost of a query."""
        await self.start()
        self.allow_anomalies("not a UUID", "the test sends one on purpose")
        reply = await self.enroll()
        node_id = reply["node_id"]
        client = await self.open_stream(reply["credential"])
        self.backend.issue_command(node_id, "collect_diagnostics", {})
        await client.wait_messages(lambda m: len(m) >= 2)  # pushed; still dispatched
        client.send({"type": "command_ack", "command_id": "nope"})
        await self.backend.wait_for(lambda: len(self.backend.frames(node_id)) == 1)
        for _ in range(2):
            await client.barrier()
        self.assertEqual([m["type"] for m in client.messages], ["hello_ack", "commands"])
        self.assertEqual(self.backend.connection_count(node_id), 1)
        self.assertEqual(self.backend.costs(node_id)["dispatch_queries"], 0)
        client.send({"type": "heartbeat"})  # any other frame: the dispatch pass lists it again
        await client.wait_messages(lambda m: len(m) >= 3)
        self.assertEqual(client.messages[2]["type"], "commands")

    async def test_wake_while_offline_is_served_after_hello_ack(self) -> None:
        """Current: queued while no stream is open -> in hello_ack, then once more in a commands frame."""
        await self.start()
        reply = await self.enroll()
        cmd = self.backend.issue_command(reply["node_id"], "collect_diagnostics", {})
        client = await self.open_stream(reply["credential"])
        self.assertEqual([c["id"] for c in client.messages[0]["commands"]], [cmd["id"]])
        await client.wait_messages(lambda m: len(m) >= 2)
        self.assertEqual(client.messages[1]["items"][0]["id"], cmd["id"])
        await client.barrier()
        self.assertEqual(len(client.messages), 2)

    async def test_redispatch_at_next_hello_ack(self) -> None:
        """An overdue acked command comes back in the next session's hello_ack with redispatch: true."""
        clock = Clock()
        clock.advance(START)
        await self.start(clock=clock)
        reply = await self.enroll()
        node_id = reply["node_id"]
        old = await self.open_stream(reply["credential"])
        cmd = self.backend.issue_command(node_id, "sync_model", {}, timeout_sec=60)
        await old.wait_messages(lambda m: len(m) >= 2)
        old.send({"type": "command_ack", "command_id": cmd["id"]})
        await self.backend.wait_for(lambda: self.backend.command(cmd["id"])["status"] == "acked")
        clock.advance(30)
        # A reconnect while the old session still looks open (a half-open link).
        early = await self.open_stream(reply["credential"])
        self.assertEqual(early.messages[0]["commands"], [])
        clock.advance(31)
        late = await self.open_stream(reply["credential"])
        items = late.messages[0]["commands"]
        self.assertEqual([(c["id"], c["redispatch"], c["status"]) for c in items], [(cmd["id"], True, "acked")])
        self.assertIn("re-dispatched", [e["event_type"] for e in self.backend.timeline(cmd["id"])])

    async def test_april_never_redispatches(self) -> None:
        clock = Clock()
        clock.advance(START)
        await self.start(clock=clock, generation="2026-04")
        reply = await self.enroll()
        node_id = reply["node_id"]
        old = await self.open_stream(reply["credential"])
        cmd = self.backend.issue_command(node_id, "sync_model", {}, timeout_sec=60)
        old.send({"type": "command_ack", "command_id": cmd["id"]})
        await self.backend.wait_for(lambda: self.backend.command(cmd["id"])["status"] == "acked")
        clock.advance(10_000)
        late = await self.open_stream(reply["credential"])
        self.assertEqual(late.messages[0]["commands"], [])

    async def _deploy_then_drop(self, **kw: Any) -> tuple[str, str, dict[str, Any]]:
        await self.start(**kw)
        reply = await self.enroll()
        node_id = reply["node_id"]
        client = await self.open_stream(reply["credential"])
        cmd = self.backend.create_runtime(node_id, {"type": "vllm"}, name="r1", runtime_id="rt-9")
        if self.backend.generation == GENERATION_APRIL:
            client.send({"type": "heartbeat"})
        await client.wait_messages(lambda m: len(m) >= 2)
        client.send({"type": "command_ack", "command_id": cmd["id"]})
        client.send({"type": "command_progress", "command_id": cmd["id"], "phase": "pull_image"})
        await self.backend.wait_for(lambda: self.backend.command(cmd["id"])["status"] == "running")
        client.dropConnection(abort=True)
        await self.backend.wait_for(lambda: self.backend.connection_count(node_id) == 0)
        return node_id, reply["credential"], cmd

    async def test_stream_lost_then_result_corrects(self) -> None:
        """Current: the drop fails the deploy (runtime error); the result sent after reconnecting wins."""
        node_id, credential, cmd = await self._deploy_then_drop()
        final = self.backend.command(cmd["id"])
        self.assertEqual((final["status"], final["error_code"]), ("failed", "node_stream_lost"))
        self.assertEqual(self.backend.runtime("rt-9")["status"], "error")  # type: ignore[index]
        client = await self.open_stream(credential)
        self.assertEqual(client.messages[0]["commands"], [])  # failed: not in flight, not re-sent
        client.send({"type": "command_result", "command_id": cmd["id"], "success": True,
                     "result": {"endpoint_url": "http://127.0.0.1:8000"}})
        await self.backend.wait_for(lambda: self.backend.command(cmd["id"])["status"] == "succeeded")
        self.assertEqual(self.backend.runtime("rt-9")["status"], "running")  # type: ignore[index]

    async def test_april_stream_lost_leaves_the_command(self) -> None:
        _node_id, _credential, cmd = await self._deploy_then_drop(generation="2026-04")
        self.assertEqual(self.backend.command(cmd["id"])["status"], "running")
        runtime = self.backend.runtime("rt-9")
        assert runtime is not None
        self.assertEqual((runtime["status"], runtime["error_message"]), ("error", "Node offline"))

    async def test_reaper_runs_on_the_backend_clock(self) -> None:
        """The sweep runs every 60 s x scale on the injected clock; stop() stops it."""
        clock = Clock()
        clock.advance(START)
        await self.start(clock=clock, reaper_scale=0.01)
        self.allow_anomalies("timed out by the silence reaper", "the test leaves the command silent")
        reply = await self.enroll()
        client = await self.open_stream(reply["credential"])
        cmd = self.backend.issue_command(reply["node_id"], "sync_model", {}, timeout_sec=1)
        await client.wait_messages(lambda m: len(m) >= 2)
        for _ in range(4):
            clock.advance(REAPER_INTERVAL_SEC * 0.01)
        self.assertEqual(self.backend.command(cmd["id"])["status"], "dispatched")  # 2.4 s: not yet
        client.send({"type": "heartbeat"})  # keeps the session fresh, says nothing of the command
        await self.backend.wait_for(lambda: len(self.backend.frames(reply["node_id"])) == 1)
        for _ in range(2):
            clock.advance(REAPER_INTERVAL_SEC * 0.01)
        self.assertEqual(self.backend.command(cmd["id"])["status"], "timed_out")
        self.assertEqual(self.backend.node(reply["node_id"])["status"], "healthy")  # type: ignore[index]
        await self.backend.stop()
        self.assertIsNone(self.backend._sweeper)

    async def test_cancel_api(self) -> None:
        """POST /dev/commands/<id>/cancel: 200, then 409 (terminal); 404 unknown; GET /dev/backend."""
        await self.start()
        reply = await self.enroll()
        cmd = self.backend.issue_command(reply["node_id"], "collect_diagnostics", {})
        code, body = await self.post(f"/dev/commands/{cmd['id']}/cancel")
        self.assertEqual((code, body["status"]), (200, "canceled"))
        code, body = await self.post(f"/dev/commands/{cmd['id']}/cancel")
        self.assertEqual((code, body["detail"]), (409, f"command {cmd['id']} is already canceled"))
        code, _ = await self.post("/dev/commands/nope/cancel")
        self.assertEqual(code, 404)
        code, body = await self.get("/dev/backend")
        self.assertEqual((code, body), (200, {"generation": "current", "reaper_scale": 1.0}))

    async def test_cancel_api_april(self) -> None:
        await self.start(generation="2026-04")
        reply = await self.enroll()
        cmd = self.backend.issue_command(reply["node_id"], "collect_diagnostics", {})
        code, body = await self.post(f"/dev/commands/{cmd['id']}/cancel")
        self.assertEqual(code, 409)
        self.assertIn("cannot cancel", body["detail"])
