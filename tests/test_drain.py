"""
Graceful stop: running commands finish (result delivered) within SHUTDOWN_GRACE_SEC while the
agent keeps heartbeating as `draining`; new commands are left to the next start; the bound or a
second stop request ends the drain, the rest stays in the journal. In process, against the
stand-in backend, and as a process with SIGTERM during a real deploy.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater

from llmport_agent.commands.base import HandlerSpec
from tests.agentharness import AgentTestCase, agent_env
from tests.support.docker_env import require_docker
from tests.support.rig import httpd_payload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Slow:
    """A handler that finishes when told."""

    def __init__(self) -> None:
        self.started = 0
        self.release: Deferred[None] = Deferred()

    async def __call__(self, ctx: Any) -> dict[str, Any]:
        self.started += 1
        await self.release
        return {"slow": True}


class DrainTests(AgentTestCase):
    timeout = 60

    def stop(self, agent: Any) -> tuple[Deferred[None], list[bool]]:
        finished: list[bool] = []
        d = agent.stopService()

        def done(result: Any) -> Any:
            finished.append(True)
            return result

        d.addBoth(done)
        return d, finished

    async def agent_with_slow_command(
        self, generation: str = "current", **extra: str
    ) -> tuple[Any, Any, str, _Slow]:
        backend = await self.start_backend(generation=generation)
        agent = self.start_agent(backend, HEARTBEAT_INTERVAL_SEC="1", **extra)
        slow = _Slow()
        agent.pipeline.registry["collect_diagnostics"] = HandlerSpec(slow, lane="node", idempotent=True, deadline=600)
        node_id = await self.wait_connected(backend, agent)
        return backend, agent, node_id, slow

    async def test_running_command_finishes_and_is_delivered(self) -> None:
        """A stop during a command: it finishes, its result reaches the backend, heartbeats say draining."""
        await self._running_command_finishes("2026-04", "dispatched")

    async def test_running_command_finishes_and_is_delivered_current(self) -> None:
        """The same against the current backend, which fails the unacked command when the stream closes."""
        await self._running_command_finishes("current", "failed")

    async def _running_command_finishes(self, generation: str, left: str) -> None:
        backend, agent, node_id, slow = await self.agent_with_slow_command(generation)
        cmd = backend.issue_command(node_id, "collect_diagnostics", {})
        await backend.wait_for(lambda: slow.started == 1, 10)
        stopped, finished = self.stop(agent)
        await backend.wait_for(lambda: (backend.node(node_id) or {}).get("status") == "draining", 10)
        # A command issued while draining is neither acked nor run: it stays for the next start.
        later = backend.issue_command(node_id, "refresh_inventory", {})
        await deferLater(reactor, 1.5, lambda: None)
        self.assertFalse(finished)
        self.assertNotEqual(backend.command(later["id"])["status"], "acked")
        reactor.callLater(0.2, slow.release.callback, None)
        await stopped
        self.assertEqual(backend.command(cmd["id"])["status"], "succeeded")
        # April: it waits for the next start; current: the backend failed it with the stream.
        self.assertEqual(backend.command(later["id"])["status"], left)
        if left == "failed":
            self.assertEqual(backend.command(later["id"])["error_code"], "node_stream_lost")
        self.assertEqual(agent.drain.report["left"], 0)
        self.assertEqual(agent.pipeline.stats["deferred_by_stop"], 1)
        self.assertIsNone(agent.journal.get(later["id"]))

    async def test_grace_bounds_the_drain(self) -> None:
        """A command longer than the grace: the stop goes on, the command stays in the journal."""
        backend, agent, node_id, slow = await self.agent_with_slow_command(SHUTDOWN_GRACE_SEC="0.5")
        cmd = backend.issue_command(node_id, "collect_diagnostics", {})
        await backend.wait_for(lambda: slow.started == 1, 10)
        started = reactor.seconds()
        await agent.stopService()
        self.assertLess(reactor.seconds() - started, 10)
        self.assertEqual(agent.drain.report["left"], 1)
        self.assertFalse(agent.journal.get(cmd["id"]).finished)

    async def test_second_request_forces_the_stop(self) -> None:
        backend, agent, node_id, slow = await self.agent_with_slow_command(SHUTDOWN_GRACE_SEC="600")
        backend.issue_command(node_id, "collect_diagnostics", {})
        await backend.wait_for(lambda: slow.started == 1, 10)
        stopped, finished = self.stop(agent)
        await deferLater(reactor, 0.3, lambda: None)
        self.assertFalse(finished)
        agent.drain.stop_requested(signal.SIGTERM)  # the stop was the first request: this one forces
        await stopped
        self.assertEqual(agent.drain.report["left"], 1)


class SigtermDuringDeployTests(AgentTestCase):
    timeout = 180

    async def test_sigterm_during_a_running_deploy(self) -> None:
        """`llmport-agent run` gets SIGTERM mid-deploy: the deploy completes, its result is delivered, exit 0."""
        docker = require_docker()
        backend = await self.start_backend()
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        env = dict(os.environ, PYTHONPATH=ROOT, DOCKER_HOST=docker.host)
        env.update(agent_env(backend, d, ENROLLMENT_TOKEN=backend.mint_token()["token"],
                             WORKLOAD_NETWORK="host", SHUTDOWN_GRACE_SEC="60", HEARTBEAT_INTERVAL_SEC="1"))
        log = open(os.path.join(d, "agent.log"), "wb")
        proc = subprocess.Popen([sys.executable, "-m", "llmport_agent.cli", "run"], env=env, cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)

        def cleanup() -> None:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

        self.addCleanup(cleanup)
        agent_id = env["LLM_PORT_NODE_AGENT_AGENT_ID"]
        await backend.wait_for(lambda: backend.node_by_agent_id(agent_id) is not None, 30)
        node_id = backend.node_by_agent_id(agent_id)["id"]
        await backend.wait_for(lambda: backend.connection_count(node_id) == 1, 20)
        # The workload answers its health path only after 3 s: the deploy is mid-way at SIGTERM.
        payload = httpd_payload(script="sleep 3; mkdir -p /www && echo ok > /www/health && "
                                       "exec httpd -f -p $LLAMA_ARG_PORT -h /www")
        self.addCleanup(self._remove, payload["runtime_id"])
        cmd = backend.issue_command(node_id, "deploy_workload", payload)
        await backend.wait_for(lambda: any(
            e["event_type"] == "progress" and e["payload"].get("phase") == "start_container"
            for e in backend.timeline(cmd["id"])), 60)
        proc.send_signal(signal.SIGTERM)
        await backend.wait_for(lambda: proc.poll() is not None, 90)
        with open(os.path.join(d, "agent.log"), errors="replace") as f:
            output = f.read()
        self.assertEqual(proc.returncode, 0, output[-3000:])
        record = backend.command(cmd["id"])
        self.assertEqual(record["status"], "succeeded", output[-3000:])
        results = [e for e in backend.timeline(cmd["id"]) if e["event_type"] == "result"]
        self.assertEqual(len(results), 1)
        self.assertEqual(backend.connection_count(node_id), 0)

    def _remove(self, runtime_id: str) -> None:
        import docker as docker_py

        client = docker_py.DockerClient(base_url=require_docker().host)
        try:
            for c in client.containers.list(all=True, filters={"label": f"io.llmport.runtime-id={runtime_id}"}):
                c.remove(force=True)
        finally:
            client.close()
