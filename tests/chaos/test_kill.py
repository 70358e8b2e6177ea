"""
C{kill -9} of the agent running as a real process (C{llmport-agent run}) behind the chaos proxy,
at random moments while commands flow, mixed with cuts: after each restart the journal resolves
what was in flight, and the invariants hold.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys

from twisted.internet import reactor

from tests.agentharness import agent_env
from tests.chaos.base import ChaosTestCase
from tests.chaos.invariants import settle
from tests.chaos.scenarios import chaos_cuts, chaos_seed, cheap_issuer, converge, run_random
from tests.test_process import spawn

TYPES = ("refresh_inventory", "refresh_inventory", "frobnicate", "set_maintenance_mode")


class KillChaosTests(ChaosTestCase):
    timeout = 180

    async def test_kill_9_at_random_moments(self) -> None:
        """SIGKILL at random moments with commands in flight: every acked command resolved once."""
        self.allow_link_anomalies()
        seed = chaos_seed()
        backend = await self.start_backend()
        proxy = await self.proxy_to(backend.port)
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        env = agent_env(backend, d, ENROLLMENT_TOKEN=backend.mint_token()["token"],
                        BACKEND_URL=self.proxied(proxy))
        procs: list[subprocess.Popen[bytes]] = []
        kills = [0]

        def start() -> None:
            proc = spawn([sys.executable, "-m", "llmport_agent.cli", "run"], env,
                         os.path.join(d, f"agent-{len(procs)}.log"))
            procs.append(proc)

        def cleanup() -> None:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

        self.addCleanup(cleanup)
        start()
        agent_id = env["LLM_PORT_NODE_AGENT_AGENT_ID"]
        await backend.wait_for(lambda: backend.node_by_agent_id(agent_id) is not None, 30)
        node = backend.node_by_agent_id(agent_id)
        assert node is not None
        node_id = node["id"]
        env.pop("LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN")

        def connected() -> bool:
            return procs[-1].poll() is None and backend.connection_count(node_id) == 1

        async def kill_or_cut(rng: random.Random) -> None:
            # The first disruption is always a kill (a seed whose every draw was a cut killed
            # nothing, and the test then had nothing to show); later ones are 60 % kills.
            if kills[0] == 0 or rng.random() < 0.6:
                os.kill(procs[-1].pid, signal.SIGKILL)
                await settle(reactor, lambda: procs[-1].poll() is not None, 10)
                kills[0] += 1
                start()
            else:
                proxy.cut()

        issue = cheap_issuer(backend, node_id, TYPES)

        def issue_valid(rng: random.Random) -> str:
            cid = issue(rng)
            if backend.command(cid)["command_type"] == "set_maintenance_mode":
                backend.state.commands[cid].payload = {"enabled": rng.random() < 0.5}
            return cid

        run = await run_random(reactor, backend, node_id, proxy, steps=max(3, chaos_cuts(25) // 4),
                               seed=seed, issue=issue_valid, connected=connected, disrupt=kill_or_cut,
                               max_dwell=1.0, max_commands=4)
        tally = await converge(reactor, backend, node_id, run, connected)
        self.assertInvariants(tally, run, proxy)
        self.assertEqual([p.returncode for p in procs[:-1]], [-signal.SIGKILL] * (len(procs) - 1))
        self.assertGreater(kills[0], 0)

