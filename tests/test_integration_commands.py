"""
Integration: the command path against the stand-in backend over loopback.

Duplicates, parallelism, lanes, the connection cut at every step of a command's life, malformed
commands, maintenance and drain across a restart.
"""

from __future__ import annotations

import json
import os
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater

from llmport_agent.commands.base import CommandContext, HandlerSpec
from llmport_agent.devbackend import OMIT
from tests.agentharness import AgentTestCase

TERMINAL = ("succeeded", "failed")


def sleep(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


class Gate:
    """A test command type whose handler waits until released."""

    def __init__(self) -> None:
        self.running: dict[str, Deferred[dict[str, Any]]] = {}
        self.started: list[str] = []
        self.peak = 0

    async def handler(self, ctx: CommandContext) -> dict[str, Any]:
        cid = ctx.command.id
        self.started.append(cid)
        d: Deferred[dict[str, Any]] = Deferred()
        self.running[cid] = d
        self.peak = max(self.peak, len(self.running))
        ctx.progress("work", "waiting for the test")
        try:
            return await d
        finally:
            self.running.pop(cid, None)

    def release(self, cid: str) -> None:
        self.running[cid].callback({"released": cid})


class CommandFlowTests(AgentTestCase):
    async def setup_agent(self, **extra: str) -> tuple[Any, Any, str, Gate]:
        backend = await self.start_backend()
        agent = self.start_agent(backend, **extra)
        gate = Gate()
        agent.pipeline.registry["test_gate"] = HandlerSpec(gate.handler, lane="runtime", idempotent=True, deadline=60)

        async def logs(ctx: CommandContext) -> dict[str, Any]:
            return {"logs": "hello"}

        agent.pipeline.registry["fetch_container_logs"] = HandlerSpec(logs, lane="read", idempotent=True, deadline=30)
        node_id = await self.wait_connected(backend, agent)
        return backend, agent, node_id, gate

    def results(self, backend: Any, cid: str) -> list[dict[str, Any]]:
        return [e for e in backend.timeline(cid) if e["event_type"] == "result"]

    def assertNoRegression(self, backend: Any, cid: str) -> None:
        history = backend.status_history(cid)
        first_terminal = next(i for i, s in enumerate(history) if s in TERMINAL)
        self.assertTrue(all(s in TERMINAL for s in history[first_terminal:]), history)

    async def test_same_command_50_times_runs_once(self) -> None:
        """The same command delivered 50 times runs once, with one ack and one result."""
        backend, agent, node_id, gate = await self.setup_agent()
        cmd = backend.issue_command(node_id, "test_gate", {"runtime_id": "r1"})
        await backend.wait_for(lambda: cmd["id"] in gate.running)
        proto = next(iter(backend.streams(node_id)))
        wire = dict(cmd, status="dispatched")
        for _ in range(50):
            proto.sendMessage(json.dumps({"type": "commands", "items": [wire]}).encode())
        await sleep(0.5)
        gate.release(cmd["id"])
        await backend.wait_for(lambda: backend.command(cmd["id"])["status"] in TERMINAL)
        await sleep(0.5)
        kinds = [e["event_type"] for e in backend.timeline(cmd["id"])]
        self.assertEqual(kinds.count("acked"), 1)
        self.assertEqual(kinds.count("result"), 1)
        self.assertEqual(gate.started, [cmd["id"]])

    async def test_twenty_in_parallel(self) -> None:
        """20 commands for 20 runtimes run at the same time."""
        backend, agent, node_id, gate = await self.setup_agent(MAX_CONCURRENT_COMMANDS="20")
        cmds = [backend.issue_command(node_id, "test_gate", {"runtime_id": f"r{i}"}) for i in range(20)]
        await backend.wait_for(lambda: len(gate.running) == 20)
        for c in cmds:
            gate.release(c["id"])
        await backend.wait_for(lambda: all(backend.command(c["id"])["status"] == "succeeded" for c in cmds))
        self.assertEqual(gate.peak, 20)

    async def test_same_runtime_serialized_logs_overtake(self) -> None:
        """Same-runtime commands run in order, one at a time; a logs command answers meanwhile."""
        backend, agent, node_id, gate = await self.setup_agent()
        a = backend.issue_command(node_id, "test_gate", {"runtime_id": "rt"})
        b = backend.issue_command(node_id, "test_gate", {"runtime_id": "rt"})
        await backend.wait_for(lambda: a["id"] in gate.running)
        logs = backend.issue_command(node_id, "fetch_container_logs", {"runtime_id": "rt", "runtime_name": "x", "tail": 10})
        await backend.wait_for(lambda: backend.command(logs["id"])["status"] == "succeeded")
        self.assertNotIn(b["id"], gate.started)
        gate.release(a["id"])
        await backend.wait_for(lambda: b["id"] in gate.running)
        gate.release(b["id"])
        await backend.wait_for(lambda: backend.command(b["id"])["status"] == "succeeded")
        self.assertEqual(gate.started, [a["id"], b["id"]])

    async def _cut_at(self, frame_type: str, processed: bool) -> None:
        backend, agent, node_id, gate = await self.setup_agent()
        cut = {"done": False}

        def matches(frame: dict[str, Any]) -> bool:
            return not cut["done"] and frame.get("type") == frame_type and frame.get("command_id") == cmd["id"]

        if processed:
            def hook(nid: str, frame: dict[str, Any]) -> None:
                if matches(frame):
                    cut["done"] = True
                    backend.drop_connections(nid)

            backend.frame_hook = hook
        else:
            def drop(nid: str, frame: dict[str, Any]) -> bool:
                if matches(frame):
                    cut["done"] = True
                    reactor.callLater(0, backend.drop_connections, nid)
                    return False
                return True

            backend.inbound_filter = drop
        cmd = backend.issue_command(node_id, "test_gate", {"runtime_id": "cut"})
        await backend.wait_for(lambda: cmd["id"] in gate.running or cut["done"], 10)
        await backend.wait_for(lambda: cmd["id"] in gate.running, 15)
        gate.release(cmd["id"])
        await backend.wait_for(lambda: backend.command(cmd["id"])["status"] == "succeeded", 15)
        await backend.wait_for(lambda: backend.connection_count(node_id) == 1, 10)
        await sleep(1.0)
        self.assertTrue(cut["done"])
        self.assertNoRegression(backend, cmd["id"])
        self.assertEqual(gate.started, [cmd["id"]])
        return backend, cmd  # type: ignore[return-value]

    async def test_cut_before_ack_processed(self) -> None:
        """The ack is lost with the connection: re-acked after reconnect, one result."""
        backend, cmd = await self._cut_at("command_ack", processed=False)
        self.assertEqual(len(self.results(backend, cmd["id"])), 1)

    async def test_cut_after_ack(self) -> None:
        """The connection drops right after the ack was processed: one result."""
        backend, cmd = await self._cut_at("command_ack", processed=True)
        self.assertEqual(len(self.results(backend, cmd["id"])), 1)

    async def test_cut_mid_progress(self) -> None:
        """The connection drops while progress is being reported: one result."""
        backend, cmd = await self._cut_at("command_progress", processed=False)
        self.assertEqual(len(self.results(backend, cmd["id"])), 1)

    async def test_cut_result_lost(self) -> None:
        """The result is lost with the connection: sent again after reconnect, exactly once."""
        backend, cmd = await self._cut_at("command_result", processed=False)
        self.assertEqual(len(self.results(backend, cmd["id"])), 1)

    async def test_cut_right_after_result(self) -> None:
        """
        The connection drops right after the backend processed the result, before the agent
        could learn it: the agent sends it again (at-least-once: a lost result would leave the
        command stuck forever; a duplicate is harmless per protocol 3.2). Never a regression.
        """
        self.allow_anomalies(r"^second command_result for ",
                             "the documented at-least-once window: result processed, cut before the agent learnt it")
        backend, cmd = await self._cut_at("command_result", processed=True)
        self.assertIn(len(self.results(backend, cmd["id"])), (1, 2))

    async def test_malformed_commands(self) -> None:
        """Each kind of malformed command gets a failed invalid_command result naming the field."""
        backend, agent, node_id, gate = await self.setup_agent()
        cases = {
            "payload": backend.issue_command(node_id, "test_gate", ["a"], raw_override={"payload": ["a"]}),
            "command_type": backend.issue_command(node_id, "x", {}, raw_override={"command_type": 42}),
            "command_type ": backend.issue_command(node_id, "x", {}, raw_override={"command_type": OMIT}),
            "timeout_sec": backend.issue_command(node_id, "test_gate", {}, raw_override={"timeout_sec": "soon"}),
            "unsupported command type: frobnicate": backend.issue_command(node_id, "frobnicate", {}),
            "signature": backend.issue_command(node_id, "test_gate", {}, raw_override={"signature": "00" * 32}),
        }
        await backend.wait_for(lambda: all(backend.command(c["id"])["status"] == "failed" for c in cases.values()))
        for name, c in cases.items():
            rec = backend.command(c["id"])
            if name == "signature":
                self.assertEqual(rec["error_code"], "signature_invalid")
                self.assertIn("signature", rec["error_message"].lower())
            else:
                self.assertEqual(rec["error_code"], "invalid_command", name)
                self.assertIn(name.strip(), rec["error_message"])
        self.assertEqual(gate.started, [])
        self.assertTrue(agent.session.connected)

    async def test_maintenance_and_drain_survive_restart(self) -> None:
        """Maintenance blocks deploys, shows in the heartbeat and survives a restart; drain too."""
        backend, agent, node_id, gate = await self.setup_agent()
        state_dir = agent.state_dir  # type: ignore[attr-defined]
        c = backend.issue_command(node_id, "set_maintenance_mode", {"enabled": "true"})
        await backend.wait_for(lambda: backend.command(c["id"])["status"] == "succeeded")
        await backend.wait_for(lambda: backend.node(node_id)["status"] == "maintenance")
        await agent.stopService()
        agent2 = self.start_agent(backend, state_dir=state_dir, AGENT_ID=agent.config.agent_id)
        agent2.pipeline.registry["deploy_workload"] = HandlerSpec(
            gate.handler, lane="runtime", idempotent=True, deadline=60,
            blocked_by_maintenance=True, blocked_by_draining=True)
        await self.wait_connected(backend, agent2)
        await backend.wait_for(lambda: backend.node(node_id)["status"] == "maintenance")
        d = backend.issue_command(node_id, "deploy_workload", {"runtime_id": "r"})
        await backend.wait_for(lambda: backend.command(d["id"])["status"] == "failed")
        self.assertEqual(backend.command(d["id"])["error_code"], "policy_violation")
        for ctype, payload in [("set_maintenance_mode", {"enabled": False}), ("drain_node", {})]:
            c = backend.issue_command(node_id, ctype, payload)
            await backend.wait_for(lambda c=c: backend.command(c["id"])["status"] == "succeeded")
        await backend.wait_for(lambda: backend.node(node_id)["status"] == "draining")
        d2 = backend.issue_command(node_id, "deploy_workload", {"runtime_id": "r"})
        await backend.wait_for(lambda: backend.command(d2["id"])["status"] == "failed")
        self.assertIn("draining", backend.command(d2["id"])["error_message"])


class ModelSyncFlowTests(AgentTestCase):
    async def test_sync_model_command_end_to_end(self) -> None:
        """sync_model through the backend: a valid HF cache appears in MODEL_STORE; a repeat reuses it."""
        backend = await self.start_backend(base_path="/llm")
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        files = {"config.json": b'{"a": 1}', "weights/model.bin": os.urandom(3 * 1024 * 1024)}
        manifest = backend.models.add_model("m1", "org/tiny", files)
        cmd = backend.issue_command(node_id, "sync_model", {"model_sync": manifest})
        await backend.wait_for(lambda: backend.command(cmd["id"])["status"] in TERMINAL, 30)
        rec = backend.command(cmd["id"])
        self.assertEqual(rec["status"], "succeeded", rec.get("error_message"))
        snap = os.path.join(agent.config.model_store, manifest["model_dir_name"], "snapshots",
                            manifest["snapshots"][0]["commit"])
        with open(os.path.join(snap, "weights", "model.bin"), "rb") as f:
            self.assertEqual(f.read(), files["weights/model.bin"])
        phases = {e["payload"].get("phase") for e in backend.timeline(cmd["id"]) if e["event_type"] == "progress"}
        self.assertIn("sync_model", phases)
        again = backend.issue_command(node_id, "sync_model", {"model_sync": manifest})
        await backend.wait_for(lambda: backend.command(again["id"])["status"] in TERMINAL, 30)
        self.assertEqual(backend.command(again["id"])["result"]["fetched"]["count"], 0)

    async def test_sync_model_marks_ready(self) -> None:
        """
        protocol 10.4: the backend reads sync_model's progress (progress_pct, message: SYNCING)
        and result (root_path, revision, manifest_sha256, total_size: READY on the node).
        """
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        files = {"config.json": b'{"a": 1}', "weights/model.bin": os.urandom(2 * 1024 * 1024)}
        manifest = backend.models.add_model("m2", "org/ready", files, commit="c" * 40)
        cmd = backend.issue_command(node_id, "sync_model", {"model_sync": manifest})
        await backend.wait_for(lambda: backend.command(cmd["id"])["status"] in TERMINAL, 30)
        rec = backend.command(cmd["id"])
        self.assertEqual(rec["status"], "succeeded", rec.get("error_message"))
        progress = [e["payload"] for e in backend.timeline(cmd["id"]) if e["event_type"] == "progress"]
        self.assertTrue(progress)
        for frame in progress:
            self.assertIsNotNone(frame.get("progress_pct"))
            self.assertTrue(frame.get("message"))
        [row] = backend.model_availability(node_id)
        root = os.path.join(agent.config.model_store, manifest["model_dir_name"], "snapshots", "c" * 40)
        self.assertEqual(row["status"], "ready")
        self.assertEqual(row["model_id"], "m2")
        self.assertEqual(row["root_path"], root)
        self.assertTrue(os.path.isdir(root))
        self.assertEqual(row["revision"], "c" * 40)
        self.assertEqual(row["manifest_sha256"], manifest["manifest_sha256"])
        self.assertEqual(row["size_bytes"], manifest["total_size"])
        self.assertEqual(row["progress"], 100.0)
        for key in ("synced", "model_id", "hf_repo_id", "model_dir_name", "cache_root", "files_synced"):
            self.assertIn(key, rec["result"])
        self.assertEqual(backend.anomalies(node_id), [])

    async def test_sync_model_against_april(self) -> None:
        """The April backend reads nothing of sync_model: the same result, no availability kept."""
        backend = await self.start_backend(generation="2026-04")
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        manifest = backend.models.add_model("m3", "org/april", {"config.json": b"{}"}, commit="d" * 40)
        cmd = backend.issue_command(node_id, "sync_model", {"model_sync": manifest})
        await backend.wait_for(lambda: backend.command(cmd["id"])["status"] in TERMINAL, 30)
        rec = backend.command(cmd["id"])
        self.assertEqual(rec["status"], "succeeded", rec.get("error_message"))
        self.assertEqual(rec["result"]["revision"], "d" * 40)
        self.assertEqual(backend.model_availability(node_id), [])
