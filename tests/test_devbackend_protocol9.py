"""
The stand-in backend reproduces protocol section 9 as the real backend does: the payloads its
runtime API builds (the ipc_mode rule, image_source on start/restart/update), node deletion
with an open session (drop, then 403), and the hanging-enrollment fault.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmport_agent.devbackend import DevBackend, Provider, Runtime, build_payload
from tests.test_devbackend import NODES, LoopbackMixin

CPU_VLLM = {"type": "vllm", "image": "vllm/vllm-openai:latest", "gpu_request": "none"}


def runtime(**provider: Any) -> Runtime:
    return Runtime(id="r-1", name="Llama CPU", node_id="n-1", provider=Provider(**provider))


class PayloadTests(SynchronousTestCase):
    """build_payload: the deploy payload (protocol 4.1) with the backend's quirks (protocol 9)."""

    def test_ipc_host_for_any_non_empty_gpu_request(self) -> None:
        """vllm/tgi get ipc_mode "host" (and shm 1g) whenever gpu_request is non-empty, "none"/"0" too."""
        for ptype in ("vllm", "tgi"):
            for gpu in ("none", "0", "all", "2"):
                p = build_payload("deploy_workload", runtime(type=ptype, gpu_request=gpu))
                self.assertEqual((p["gpu_request"], p["ipc_mode"], p["shm_size"]), (gpu, "host", "1g"))
                self.assertEqual(p["provider_config"]["ipc_mode"], "host")
        # The default gpu_request of vllm/tgi is "all": host IPC too.
        self.assertEqual(build_payload("deploy_workload", runtime(type="vllm"))["ipc_mode"], "host")

    def test_no_host_ipc_otherwise(self) -> None:
        """llama.cpp and ollama never get it by default; an empty gpu_request gets nothing."""
        for ptype in ("llamacpp", "ollama"):
            p = build_payload("deploy_workload", runtime(type=ptype, gpu_request="none"))
            self.assertEqual((p["ipc_mode"], p["shm_size"]), ("", "1g"))
        p = build_payload("deploy_workload", runtime(type="vllm", gpu_request=""))
        self.assertEqual((p["ipc_mode"], p["shm_size"]), ("", ""))
        p = build_payload("deploy_workload", runtime(type="llamacpp"))
        self.assertEqual((p["gpu_request"], p["ipc_mode"]), ("", ""))

    def test_image_source_by_command(self) -> None:
        """Only deploy carries null; start/restart/update send pull_from_registry by default."""
        local = runtime(type="llamacpp")
        self.assertIsNone(build_payload("deploy_workload", local)["image_source"])
        for ctype in ("start_workload", "restart_workload", "update_workload"):
            self.assertEqual(build_payload(ctype, local)["image_source"], "pull_from_registry")
        transfer = runtime(type="llamacpp", image_source="transfer_from_server")
        for ctype in ("deploy_workload", "start_workload", "restart_workload", "update_workload"):
            self.assertEqual(build_payload(ctype, transfer)["image_source"], "transfer_from_server")

    def test_shapes(self) -> None:
        """Every deploy-payload field is present; start's model_sync may be {}; hints on deploy/update."""
        rt = runtime(type="vllm", gpu_request="none")
        deploy = build_payload("deploy_workload", rt)
        for key in ("runtime_id", "runtime_name", "container_name", "provider_id", "provider_type",
                    "model_id", "generic_config", "provider_config", "openai_compat", "model_sync",
                    "image_source", "gpu_request", "ipc_mode", "shm_size", "memory_limit", "cpu_limit",
                    "container_port", "placement_hints"):
            self.assertIn(key, deploy)
        self.assertEqual(build_payload("start_workload", rt)["model_sync"], {})
        self.assertNotIn("placement_hints", build_payload("restart_workload", rt))
        self.assertIn("placement_hints", build_payload("update_workload", rt))
        self.assertEqual(build_payload("stop_workload", rt),
                         {"runtime_id": "r-1", "runtime_name": "Llama CPU", "container_name": ""})
        self.assertEqual(build_payload("fetch_container_logs", rt, tail=50)["tail"], 50)


class RuntimeApiTests(SynchronousTestCase):
    """DevBackend.create_runtime / runtime_action issue what the backend's runtime API issues."""

    def setUp(self) -> None:
        self.backend = DevBackend(reactor)
        self.node_id = self.backend.enroll_node("node-1")["node_id"]

    def test_create_start_update(self) -> None:
        """Create issues deploy (null image_source); start pulls by default; update applies edits."""
        cmd = self.backend.create_runtime(self.node_id, dict(CPU_VLLM), name="cpu")
        self.assertEqual(cmd["command_type"], "deploy_workload")
        self.assertEqual((cmd["payload"]["ipc_mode"], cmd["payload"]["image_source"]), ("host", None))
        rid = cmd["payload"]["runtime_id"]
        self.assertEqual(self.backend.runtime(rid)["status"], "creating")
        start = self.backend.runtime_action(rid, "start")
        self.assertEqual(start["payload"]["image_source"], "pull_from_registry")
        self.assertEqual(start["idempotency_key"], f"runtime-start-{rid}")
        upd = self.backend.runtime_action(rid, "update", provider_changes={"image": "vllm/vllm-openai:v2"})
        self.assertEqual(upd["payload"]["provider_config"]["image"], "vllm/vllm-openai:v2")
        self.assertEqual(upd["payload"]["image_source"], "pull_from_registry")

    def test_unknown(self) -> None:
        """Unknown runtimes and actions are KeyErrors."""
        with self.assertRaises(KeyError):
            self.backend.runtime_action("nope", "start")
        rid = self.backend.create_runtime(self.node_id, {"type": "ollama"})["payload"]["runtime_id"]
        with self.assertRaises(KeyError):
            self.backend.runtime_action(rid, "explode")


class LoopbackProtocol9Tests(LoopbackMixin, TestCase):
    """Over loopback: node deletion with an open session, the runtime HTTP API, hanging enrollment."""

    timeout = 20

    async def test_deleted_node_drop_then_403(self) -> None:
        """Deleted while its session is open: the stream drops (no close frame), then every upgrade is 403."""
        self.allow_anomalies(r"^connection dropped: node no longer exists$",
                             "the test deletes the node while its stream is open")
        await self.start()
        reply = await self.enroll()
        client = await self.open_stream(reply["credential"])
        self.backend.delete_node(reply["node_id"])
        client.send({"type": "poll"})
        was_clean, code, _ = await client.factory.closed
        self.assertFalse(was_clean)
        self.assertEqual(code, 1006)
        for _ in range(2):
            factory = await self.connect(reply["credential"])
            with self.assertRaises(ConnectionError):
                await factory.opened
            self.assertIn("[403]", (await factory.closed)[2] or "")
        # Re-enrolling the same agent id after the deletion makes a new node.
        again = await self.enroll()
        self.assertNotEqual(again["node_id"], reply["node_id"])

    async def test_runtime_http_api(self) -> None:
        """POST /dev/runtimes creates and deploys; POST /dev/runtimes/<id>/<action> issues the rest."""
        await self.start()
        node_id = (await self.enroll())["node_id"]
        code, cmd = await self.post("/dev/runtimes", {"node_id": node_id, "name": "cpu", "provider": CPU_VLLM})
        self.assertEqual((code, cmd["command_type"], cmd["payload"]["ipc_mode"]), (200, "deploy_workload", "host"))
        rid = cmd["payload"]["runtime_id"]
        code, start = await self.post(f"/dev/runtimes/{rid}/restart", {})
        self.assertEqual((code, start["payload"]["image_source"]), (200, "pull_from_registry"))
        code, logs = await self.post(f"/dev/runtimes/{rid}/logs", {"tail": 20})
        self.assertEqual((code, logs["payload"]["tail"]), (200, 20))
        self.assertEqual((await self.post("/dev/runtimes/nope/start", {}))[0], 404)
        self.assertEqual((await self.post(f"/dev/runtimes/{rid}/explode", {}))[0], 404)
        self.assertEqual((await self.post("/dev/runtimes", {"node_id": node_id}))[0], 422)

    async def test_hang_enroll_fault(self) -> None:
        """hang_enroll: the request is received and never answered (until the backend stops)."""
        await self.start()
        self.backend.faults.hang_enroll = True
        token = self.backend.mint_token()["token"]
        body = json.dumps({"enrollment_token": token, "agent_id": "a"}).encode()
        d = self.http.post(self.backend.url + NODES + "/enroll", data=body,
                           headers={"Content-Type": ["application/json"]})
        answered: list[Any] = []
        d.addBoth(answered.append)
        await self.backend.wait_for(lambda: self.backend.enroll_requests == 1)
        await deferLater(reactor, 0.3, lambda: None)
        self.assertEqual(answered, [])
        d.cancel()
        self.assertEqual(len(answered), 1)
