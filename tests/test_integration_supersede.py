"""
On the real engine, through the stand-in backend (issue 26): a remove of a runtime whose deploy
is still waiting for readiness, and a stop of an adopted runtime (the original agent's
container, named in the state's C{workloads} mapping) whose start is, end that wait: the
deploy/start answers FAILED (C{superseded}) naming the remove/stop, which goes ahead at once
(READINESS_TIMEOUT_SEC is 600 s here; everything is answered within a minute).
"""

from __future__ import annotations

import json
import os
from typing import Any

from tests.support.docker_env import BUSYBOX, free_port, require_docker
from tests.support.rig import httpd_payload
from tests.test_integration_workloads import _WorkloadBase

NEVER_READY = "echo starting; exec sleep 600"  # serves nothing: /health never answers


class SupersedeOnEngineTests(_WorkloadBase):
    timeout = 180

    def containers(self, runtime_id: str) -> list[Any]:
        client = require_docker().client()
        return list(client.containers.list(all=True, filters={"label": f"io.llmport.runtime-id={runtime_id}"}))

    async def waiting_for_ready(self, backend: Any, cid: str) -> None:
        def waiting() -> bool:
            return any(e["event_type"] == "progress" and e["payload"].get("phase") == "waiting_for_ready"
                       for e in backend.timeline(cid))

        await backend.wait_for(waiting, 60)

    async def agent_on_engine(self, backend: Any, state_dir: str | None = None) -> tuple[Any, str]:
        agent = self.start_agent(backend, state_dir=state_dir, docker_host=require_docker().host,
                                 WORKLOAD_NETWORK="host", READINESS_TIMEOUT_SEC="600", STOP_GRACE_SEC="2")
        node_id = await self.wait_connected(backend, agent)
        await backend.wait_for(lambda: agent.engine.available, 20)
        return agent, node_id

    async def test_remove_ends_a_deploy_waiting_for_readiness(self) -> None:
        backend = await self.start_backend()
        agent, node_id = await self.agent_on_engine(backend)
        payload = httpd_payload(script=NEVER_READY)
        rid = payload["runtime_id"]
        self.addCleanup(self._remove, backend, node_id, payload)
        deploy = backend.issue_command(node_id, "deploy_workload", payload)
        await self.waiting_for_ready(backend, deploy["id"])
        self.assertEqual(len(self.containers(rid)), 1)
        remove = backend.issue_command(node_id, "remove_workload", {
            "runtime_id": rid, "runtime_name": payload["runtime_name"], "container_name": ""})
        removed = await self.done(backend, remove["id"], 60)
        self.assertEqual(removed["status"], "succeeded", removed.get("error_message"))
        self.assertEqual(removed["result"]["removed"], 1)
        deployed = await self.done(backend, deploy["id"], 5)
        self.assertEqual(deployed["status"], "failed")
        self.assertEqual(deployed["error_code"], "superseded")
        self.assertIn(f"superseded by remove_workload {remove['id']}", deployed["error_message"])
        self.assertEqual(self.containers(rid), [])

    async def test_stop_ends_an_adopted_start_waiting_for_readiness(self) -> None:
        env = require_docker()
        client = env.client()
        backend = await self.start_backend()
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        rid = "a0d0e1f2-0000-4000-8000-" + os.urandom(6).hex()
        name = f"llm-port-supersede-{os.urandom(3).hex()}"
        # The original agent's container: no labels of ours, a published port, not running.
        c = client.containers.create(BUSYBOX, ["sh", "-c", NEVER_READY], name=name,
                                     ports={"8000/tcp": free_port()})
        self.addCleanup(lambda: c.remove(force=True))
        with open(os.path.join(d, "state.json"), "w") as f:
            json.dump({"workloads": {rid: {"container_name": name, "image": BUSYBOX,
                                           "container_id": c.id[:12]}}}, f)
        agent, node_id = await self.agent_on_engine(backend, d)
        await agent.adoption.ready()
        self.assertEqual(agent.adoption.snapshot(), {c.id: rid})
        ids = {"runtime_id": rid, "runtime_name": "supersede", "container_name": name}
        start = backend.issue_command(node_id, "start_workload", ids)
        await self.waiting_for_ready(backend, start["id"])
        c.reload()
        self.assertEqual(c.status, "running")
        stop = backend.issue_command(node_id, "stop_workload", ids)
        stopped = await self.done(backend, stop["id"], 60)
        self.assertEqual(stopped["status"], "succeeded", stopped.get("error_message"))
        self.assertTrue(stopped["result"]["was_running"], stopped)
        started = await self.done(backend, start["id"], 5)
        self.assertEqual(started["status"], "failed")
        self.assertEqual(started["error_code"], "superseded")
        self.assertIn(f"superseded by stop_workload {stop['id']}", started["error_message"])
        c.reload()
        self.assertEqual(c.status, "exited")
