"""
Integration: workloads end to end, agent + stand-in backend + real Docker engine.

Deploy with progress phases and the real endpoint; the backend's runtime goes running; logs of
a running deploy within 2 s; re-announcement after a backend reconnect restores runtimes the
backend marked error; stop and remove; SIGKILL in the middle of an update, resolved at restart.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

from twisted.internet import reactor
from twisted.internet.task import deferLater

from tests.agentharness import AgentTestCase, agent_env
from tests.support.docker_env import require_docker
from tests.support.rig import httpd_payload

TERMINAL = ("succeeded", "failed")


class Missing:
    state = "missing"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _WorkloadBase(AgentTestCase):
    timeout = 120

    async def setup_agent(self, **extra: str) -> tuple[Any, Any, str]:
        env = require_docker()
        backend = await self.start_backend()
        agent = self.start_agent(backend, docker_host=env.host, WORKLOAD_NETWORK="host",
                                 READINESS_TIMEOUT_SEC="30", STOP_GRACE_SEC="2", **extra)
        node_id = await self.wait_connected(backend, agent)
        await backend.wait_for(lambda: agent.engine.available, 20)
        return backend, agent, node_id

    async def done(self, backend: Any, cid: str, timeout: float = 60) -> dict[str, Any]:
        """The command once the agent answered it (the current backend's own node_stream_lost
        failure, when the agent's stream dropped, is not the answer)."""
        await backend.wait_for(
            lambda: backend.command(cid)["status"] in TERMINAL
            and any(e["event_type"] == "result" for e in backend.timeline(cid)),
            timeout,
        )
        return backend.command(cid)

    async def _remove(self, backend: Any, node_id: str, payload: dict[str, Any]) -> None:
        env = require_docker()
        import docker

        client = docker.DockerClient(base_url=env.host)
        try:
            for c in client.containers.list(all=True, filters={"label": f"io.llmport.runtime-id={payload['runtime_id']}"}):
                c.remove(force=True)
        finally:
            client.close()


class WorkloadFlowTests(_WorkloadBase):
    async def test_deploy_logs_reannounce_stop_remove(self) -> None:
        """The whole life of a workload through the backend, with a reconnect in the middle."""
        backend, agent, node_id = await self.setup_agent()
        payload = httpd_payload()
        rid = payload["runtime_id"]
        self.addCleanup(self._remove, backend, node_id, payload)
        deploy = backend.issue_command(node_id, "deploy_workload", payload)
        # logs of the same runtime while the deploy runs: answered fast, not behind the deploy
        await backend.wait_for(lambda: backend.command(deploy["id"])["status"] in ("acked", "running", *TERMINAL))
        logs = backend.issue_command(node_id, "fetch_container_logs",
                                     {"runtime_id": rid, "runtime_name": payload["runtime_name"], "tail": 50})
        issued = reactor.seconds()
        await self.done(backend, logs["id"], 10)
        self.assertLess(reactor.seconds() - issued, 2.5 + agent.config.command_poll_interval_sec)
        self.assertEqual(backend.command(logs["id"])["status"], "succeeded")
        rec = await self.done(backend, deploy["id"])
        self.assertEqual(rec["status"], "succeeded", rec.get("error_message"))
        endpoint = rec["result"]["endpoint_url"]
        self.assertTrue(endpoint.startswith("http://127.0.0.1:"))
        phases = [e["payload"].get("phase") for e in backend.timeline(deploy["id"]) if e["event_type"] == "progress"]
        for phase in ("validate", "start_container", "waiting_for_ready", "ready"):
            self.assertIn(phase, phases)
        await backend.wait_for(lambda: (backend.runtime(rid) or {}).get("status") == "running")
        # No race with anything else that could bring the runtime back after the drop: the
        # deploy's result is confirmed delivered (no resend after reconnecting), no delayed
        # post-command announcement is pending, no health check is in flight and every event
        # is confirmed delivered (the outbox would send it again after reconnecting, after the
        # backend marked the runtime error). Only the announcement at connect can restore it.
        await backend.wait_for(lambda: (agent.journal.get(deploy["id"]) or Missing).state == "delivered", 10)
        await backend.wait_for(lambda: not agent.health._timers and not agent.health._busy, 10)
        await backend.wait_for(lambda: agent.outbox.depth == 0, 10)  # no event left to resend
        health_events = len([e for e in backend.events(node_id) if e["event_type"] == "workload.health.running"])
        # The link drops: the backend marks the node offline and the runtime error...
        backend.drop_connections(node_id)
        await backend.wait_for(lambda: (backend.runtime(rid) or {}).get("status") == "error", 10)
        # ...and the agent's announcement after reconnecting brings it back.
        await backend.wait_for(lambda: (backend.runtime(rid) or {}).get("status") == "running", 20)
        self.assertGreater(
            len([e for e in backend.events(node_id) if e["event_type"] == "workload.health.running"]), health_events
        )
        stop = backend.issue_command(node_id, "stop_workload", {"runtime_id": rid, "runtime_name": payload["runtime_name"], "container_name": ""})
        self.assertEqual((await self.done(backend, stop["id"]))["status"], "succeeded")
        await backend.wait_for(lambda: (backend.runtime(rid) or {}).get("status") == "stopped")
        remove = backend.issue_command(node_id, "remove_workload", {"runtime_id": rid, "runtime_name": payload["runtime_name"], "container_name": ""})
        self.assertEqual((await self.done(backend, remove["id"]))["status"], "succeeded")
        again = backend.issue_command(node_id, "remove_workload", {"runtime_id": rid, "runtime_name": payload["runtime_name"], "container_name": ""})
        self.assertEqual((await self.done(backend, again["id"]))["status"], "succeeded")

    async def test_kill_9_mid_update_resolved(self) -> None:
        """
        The agent is killed with SIGKILL while an update waits for readiness; at the next start
        the interrupted (non-idempotent) update gets exactly one failed result, agent_restarted.
        """
        env = require_docker()
        backend = await self.start_backend()
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        agent_vars = agent_env(backend, d, ENROLLMENT_TOKEN=backend.mint_token()["token"],
                               WORKLOAD_NETWORK="host", READINESS_TIMEOUT_SEC="60", OPS_PORT="0")
        full = dict(os.environ, PYTHONPATH=ROOT, DOCKER_HOST=env.host, **agent_vars)
        log = open(os.path.join(d, "agent.log"), "ab")
        self.addCleanup(log.close)
        cmd = [sys.executable, "-m", "llmport_agent.cli", "run"]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full, stdout=log, stderr=subprocess.STDOUT)
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait()))
        agent_id = agent_vars["LLM_PORT_NODE_AGENT_AGENT_ID"]
        await backend.wait_for(lambda: backend.node_by_agent_id(agent_id) is not None, 30)
        node_id = backend.node_by_agent_id(agent_id)["id"]
        payload = httpd_payload(script="sleep 300")  # never becomes ready
        self.addCleanup(self._remove, backend, node_id, payload)
        upd = backend.issue_command(node_id, "update_workload", payload)
        await backend.wait_for(
            lambda: any(e["payload"].get("phase") == "waiting_for_ready" for e in backend.timeline(upd["id"])
                        if e["event_type"] == "progress"), 60)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        full.pop("LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN")
        proc2 = subprocess.Popen(cmd, cwd=ROOT, env=full, stdout=log, stderr=subprocess.STDOUT)

        def stop2() -> None:
            if proc2.poll() is None:
                proc2.send_signal(signal.SIGTERM)
                proc2.wait(30)

        self.addCleanup(stop2)
        # The current backend fails the command itself (node_stream_lost) when the agent's
        # stream drops; the agent's own answer after the restart is what this test is about.
        await backend.wait_for(
            lambda: any(e["event_type"] == "result" for e in backend.timeline(upd["id"])), 60
        )
        await deferLater(reactor, 1.0, lambda: None)
        rec = backend.command(upd["id"])
        self.assertEqual(rec["status"], "failed")
        results = [e for e in backend.timeline(upd["id"]) if e["event_type"] == "result"]
        self.assertEqual(len(results), 1)
        self.assertIs(results[0]["payload"]["success"], False)
        self.assertEqual(results[0]["payload"]["error_code"], "agent_restarted")


class MoreCommandsFlowTests(_WorkloadBase):
    async def test_start_restart_update_rollback_diagnostics(self) -> None:
        """start, restart, update (success and rollback) and diagnostics, all through the backend."""
        backend, agent, node_id = await self.setup_agent()
        payload = httpd_payload()
        rid = payload["runtime_id"]
        ids = {"runtime_id": rid, "runtime_name": payload["runtime_name"], "container_name": ""}
        self.addCleanup(self._remove, backend, node_id, payload)
        for ctype, body in [("deploy_workload", payload), ("stop_workload", ids),
                            ("start_workload", payload), ("restart_workload", payload),
                            ("update_workload", payload)]:
            c = backend.issue_command(node_id, ctype, body)
            rec = await self.done(backend, c["id"])
            self.assertEqual(rec["status"], "succeeded", f"{ctype}: {rec.get('error_message')}")
            if ctype in ("start_workload", "restart_workload"):
                self.assertTrue(rec["result"]["endpoint_url"].startswith("http://127.0.0.1:"))
            if ctype == "update_workload":
                # The current backend leaves an updated runtime starting until a
                # workload.health.running that follows the result (protocol 4).
                await backend.wait_for(lambda: (backend.runtime(rid) or {}).get("status") == "running", 20)
        # An update to a workload that never becomes ready rolls back to the old one.
        broken = dict(payload, provider_config=dict(payload["provider_config"], command=["sh", "-c", "exit 3"]))
        bad = backend.issue_command(node_id, "update_workload", broken)
        rec = await self.done(backend, bad["id"])
        self.assertEqual(rec["status"], "failed")
        self.assertIn("rolled back", rec["error_message"])
        await backend.wait_for(lambda: (backend.runtime(rid) or {}).get("status") == "running", 20)
        diag = backend.issue_command(node_id, "collect_diagnostics", {})
        rec = await self.done(backend, diag["id"])
        engine = rec["result"]["engine"]
        self.assertIsInstance(engine, dict)
        self.assertIn(rid, str(engine))


class WorkloadLogsToLokiTests(_WorkloadBase):
    async def test_workload_logs_reach_loki(self) -> None:
        """With LOKI_URL set, a deployed workload's output reaches Loki with the protocol 8 labels."""
        from twisted.internet.endpoints import TCP4ServerEndpoint
        from twisted.web.server import Site

        from llmport_agent.logs.testing import FakeLoki

        loki = FakeLoki()
        port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Site(loki))
        self.addCleanup(port.stopListening)
        backend, agent, node_id = await self.setup_agent(
            LOKI_URL=f"http://127.0.0.1:{port.getHost().port}", LOG_FLUSH_INTERVAL_SEC="0.2")
        script = "echo hello-from-workload; mkdir -p /www && echo ok > /www/health && exec httpd -f -p $LLAMA_ARG_PORT -h /www"
        payload = httpd_payload(script=script)
        self.addCleanup(self._remove, backend, node_id, payload)
        deploy = backend.issue_command(node_id, "deploy_workload", payload)
        self.assertEqual((await self.done(backend, deploy["id"]))["status"], "succeeded")
        await backend.wait_for(lambda: any("hello-from-workload" in line for line in
                                           loki.lines(job="node-container", runtime_id=payload["runtime_id"])), 20)
        entry = loki.entries(job="node-container")[0]
        self.assertEqual(entry.labels["host"], "127.0.0.1")
        self.assertTrue(entry.labels["container"].startswith("llm-port-"))


class ImageTransferFlowTests(_WorkloadBase):
    async def test_transfer_resumes_through_the_stand_in(self) -> None:
        """
        protocol 10.4 end to end: a deploy with transfer_from_server from the stand-in's export
        (Content-Length, X-Image-Id) whose every response is cut after 200 kB resumes with
        Range until the image is loaded, and the workload runs; a pin naming another build is
        server_image_mismatch, at once.
        """
        import uuid

        from tests.support.docker_env import BUSYBOX

        env = require_docker()
        backend, agent, node_id = await self.setup_agent()
        name = f"llmport/e2e-{uuid.uuid4().hex[:6]}"
        api = env.client().api
        api.tag(BUSYBOX, name, "1")
        image_id = api.inspect_image(f"{name}:1")["Id"]
        path = os.path.join(self.mktemp())
        with open(path, "wb") as f:
            for chunk in api.get_image(f"{name}:1"):
                f.write(chunk)
        layers = api.inspect_image(f"{name}:1")["RootFS"]["Layers"]
        api.remove_image(f"{name}:1")
        from llmport_agent.devbackend.imagetar import image_identity
        from llmport_agent.workloads.images import rootfs_digest

        # The identity the stand-in's command line reads from a tar is the engine's own.
        self.assertEqual(image_identity(path), (image_id, rootfs_digest(layers)))
        backend.add_image(name, "1", path, image_id=image_id)
        backend.faults.image_abort_after = 200_000
        payload = httpd_payload(image=f"{name}:1", image_source="transfer_from_server")
        self.addCleanup(self._remove, backend, node_id, payload)
        self.addCleanup(env.remove_image, f"{name}:1")
        deploy = backend.issue_command(node_id, "deploy_workload", payload)
        rec = await self.done(backend, deploy["id"])
        self.assertEqual(rec["status"], "succeeded", rec.get("error_message"))
        messages = [e["payload"].get("message", "") for e in backend.timeline(deploy["id"])
                    if e["event_type"] == "progress" and e["payload"].get("phase") == "transfer_image"]
        self.assertTrue(any("resuming" in m for m in messages), messages)
        self.assertTrue(rec["result"]["image_id"].startswith("sha256:"))
        self.assertEqual(api.inspect_image(f"{name}:1")["Id"], image_id)
        # Another build pinned on the node (the images API's expect_id) -> 409 -> mismatch.
        env.remove_image(f"{name}:1")
        from twisted.internet.defer import ensureDeferred

        from llmport_agent.commands.base import CommandFailed
        from llmport_agent.workloads.policy import parse_image_ref

        with self.assertRaises(CommandFailed) as cm:
            await ensureDeferred(agent.workloads.images.transfer(
                parse_image_ref(f"{name}:1"), lambda *a, **k: None, expect_id="sha256:" + "0" * 64))
        self.assertEqual(cm.exception.error_code, "server_image_mismatch")


    async def test_transfer_from_april_is_not_resumed(self) -> None:
        """
        The April route streams (X-Image-Size, no Content-Length, pins ignored): a cut
        connection fails the deploy with image_transfer_failed, nothing is loaded, and it
        was not asked again with a Range.
        """
        import uuid

        from tests.support.docker_env import BUSYBOX

        env = require_docker()
        backend = await self.start_backend(generation="2026-04")
        agent = self.start_agent(backend, docker_host=env.host, WORKLOAD_NETWORK="host",
                                 READINESS_TIMEOUT_SEC="30", STOP_GRACE_SEC="2")
        node_id = await self.wait_connected(backend, agent)
        await backend.wait_for(lambda: agent.engine.available, 20)
        name = f"llmport/e2e-{uuid.uuid4().hex[:6]}"
        api = env.client().api
        api.tag(BUSYBOX, name, "1")
        image_id = api.inspect_image(f"{name}:1")["Id"]
        path = self.mktemp()
        with open(path, "wb") as f:
            for chunk in api.get_image(f"{name}:1"):
                f.write(chunk)
        api.remove_image(f"{name}:1")
        backend.add_image(name, "1", path, image_id=image_id)
        backend.faults.image_abort_after = 200_000
        payload = httpd_payload(image=f"{name}:1", image_source="transfer_from_server")
        self.addCleanup(self._remove, backend, node_id, payload)
        self.addCleanup(env.remove_image, f"{name}:1")
        deploy = backend.issue_command(node_id, "deploy_workload", payload)
        rec = await self.done(backend, deploy["id"])
        self.assertEqual(rec["status"], "failed")
        self.assertEqual(rec["error_code"], "image_transfer_failed")
        self.assertIn("broke after", rec["error_message"])
        messages = [e["payload"].get("message", "") for e in backend.timeline(deploy["id"])
                    if e["event_type"] == "progress"]
        self.assertFalse(any("resuming" in m for m in messages))
        import docker

        with self.assertRaises(docker.errors.ImageNotFound):
            api.inspect_image(f"{name}:1")
