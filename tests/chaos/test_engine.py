"""
Docker engine restarts (the same dockerd stopped and started again) under running workloads,
mixed with cuts of the backend link and commands flowing (logs of those runtimes, inventory):
the commands' invariants hold, and every runtime whose container runs again ends C{running} at
the backend.
"""

from __future__ import annotations

import random
from typing import Any

from twisted.internet import reactor
from twisted.internet.threads import deferToThread

from tests.chaos.base import ChaosTestCase
from tests.chaos.invariants import TERMINAL, check_runtimes, settle, sleep
from tests.chaos.scenarios import chaos_cuts, chaos_seed, converge, run_random
from tests.support.docker_env import require_docker
from tests.support.rig import httpd_payload


class EngineChaosTests(ChaosTestCase):
    timeout = 240

    async def test_engine_restarts_under_running_workloads(self) -> None:
        """Engine restarts and cuts: runtimes end running, commands resolved exactly once."""
        self.allow_link_anomalies()
        docker = require_docker()
        seed = chaos_seed()
        backend = await self.start_backend()
        proxy = await self.proxy_to(backend.port)
        agent = self.start_agent(backend, docker_host=docker.host, BACKEND_URL=self.proxied(proxy),
                                 WORKLOAD_NETWORK="host", READINESS_TIMEOUT_SEC="30", STOP_GRACE_SEC="1")
        node_id = await self.wait_connected(backend, agent)
        await backend.wait_for(lambda: agent.engine.available, 30)
        payloads = [httpd_payload() for _ in range(2)]
        self.addCleanup(self._remove, docker, payloads)
        deploys = [backend.issue_command(node_id, "deploy_workload", p)["id"] for p in payloads]
        await backend.wait_for(lambda: all(backend.command(c)["status"] in TERMINAL for c in deploys), 90)
        for c in deploys:
            self.assertEqual(backend.command(c)["status"], "succeeded", backend.command(c)["error_message"])
        rids = [p["runtime_id"] for p in payloads]

        def issue(rng: random.Random) -> str:
            p = rng.choice(payloads)
            kind = rng.choice(("fetch_container_logs", "refresh_inventory"))
            body: dict[str, Any] = {}
            if kind == "fetch_container_logs":
                body = {"runtime_id": p["runtime_id"], "runtime_name": p["runtime_name"], "tail": 20}
            return str(backend.issue_command(node_id, kind, body)["id"])

        def connected() -> bool:
            return bool(agent.session.connected) and backend.connection_count(node_id) == 1

        restarts = [0]
        during: list[str] = []  # issued while the engine is down or starting

        async def restart_engine(rng: random.Random) -> None:
            restarting = deferToThread(docker.restart)
            await sleep(reactor, rng.uniform(0, 1.0))
            during.extend(issue(rng) for _ in range(rng.randint(1, 3)))
            await sleep(reactor, rng.uniform(0, 1.0))
            proxy.cut()
            await restarting
            during.append(issue(rng))
            restarts[0] += 1

        run = await run_random(reactor, backend, node_id, proxy, steps=max(2, chaos_cuts(25) // 12),
                               seed=seed, issue=issue, connected=connected, disrupt=restart_engine,
                               max_dwell=0.5, max_commands=4)
        run.commands[:0] = deploys
        run.commands.extend(during)
        tally = await converge(reactor, backend, node_id, run, connected, timeout=90)

        def containers_and_runtimes() -> bool:
            client = docker.client()
            return not check_runtimes(backend, client, rids) and all(
                client.containers.list(filters={"label": f"io.llmport.runtime-id={r}", "status": "running"})
                for r in rids)

        await settle(reactor, containers_and_runtimes, 60, step=0.5)
        problems = check_runtimes(backend, docker.client(), rids)
        for r in rids:
            if not docker.client().containers.list(filters={"label": f"io.llmport.runtime-id={r}", "status": "running"}):
                problems.append(f"runtime {r}: the container did not come back after the engine restart")
        self.assertInvariants(tally, run, proxy, problems)
        self.assertGreater(restarts[0], 0)

    @staticmethod
    def _remove(docker: Any, payloads: list[dict[str, Any]]) -> None:
        client = docker.client()
        for p in payloads:
            for c in client.containers.list(all=True, filters={"label": f"io.llmport.runtime-id={p['runtime_id']}"}):
                c.remove(force=True)
