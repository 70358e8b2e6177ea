"""
The link to the backend under random faults: cuts (resets) at random moments of commands'
lives, stalls, slow links, flipped and garbled bytes both ways, refused reconnects, and
backend restarts, with commands flowing. Every acked command gets exactly one result (repeats
only in the documented window), nothing regresses, the agent comes back.

Size: C{LLMPORT_CHAOS_CUTS} steps (CI default below); seed: C{LLMPORT_CHAOS_SEED} (printed on
failure).
"""

from __future__ import annotations

import random
from typing import Any

from twisted.internet import reactor

from tests.chaos.base import ChaosTestCase
from tests.chaos.invariants import sleep
from tests.chaos.scenarios import (
    chaos_cuts,
    chaos_seed,
    cheap_issuer,
    converge,
    install_work_handler,
    run_random,
)

TYPES = ("chaos_work", "chaos_work", "refresh_inventory", "frobnicate")


class LinkChaosTests(ChaosTestCase):
    async def setup_chaos(self) -> tuple[Any, Any, Any, str, int]:
        self.allow_link_anomalies()
        seed = chaos_seed()
        backend = await self.start_backend()
        proxy = await self.proxy_to(backend.port)
        agent = self.start_agent(backend, BACKEND_URL=self.proxied(proxy))
        install_work_handler(agent, reactor, random.Random(seed ^ 1))
        node_id = await self.wait_connected(backend, agent)
        return backend, proxy, agent, node_id, seed

    async def test_random_faults_with_commands_flowing(self) -> None:
        """Random cuts after random stalls, slow links and corruption: the invariants hold."""
        backend, proxy, agent, node_id, seed = await self.setup_chaos()

        def connected() -> bool:
            return bool(agent.session.connected) and backend.connection_count(node_id) == 1

        run = await run_random(reactor, backend, node_id, proxy, steps=chaos_cuts(25), seed=seed,
                               issue=cheap_issuer(backend, node_id, TYPES), connected=connected)
        tally = await converge(reactor, backend, node_id, run, connected)
        self.assertInvariants(tally, run, proxy)
        self.assertGreater(tally.acked, 0)

    async def test_backend_restarts_with_commands_flowing(self) -> None:
        """The backend stopped and listening again on the same port (same state), mixed with cuts."""
        backend, proxy, agent, node_id, seed = await self.setup_chaos()
        port = backend.port

        async def restart_or_cut(rng: random.Random) -> None:
            if rng.random() < 0.5:
                await backend.stop()
                await sleep(reactor, rng.uniform(0, 1.0))
                await backend.listen(port, "127.0.0.1")
            else:
                proxy.cut()

        def connected() -> bool:
            return bool(agent.session.connected) and backend.connection_count(node_id) == 1

        run = await run_random(reactor, backend, node_id, proxy, steps=max(4, chaos_cuts(25) // 3),
                               seed=seed, issue=cheap_issuer(backend, node_id, TYPES),
                               connected=connected, disrupt=restart_or_cut)
        tally = await converge(reactor, backend, node_id, run, connected)
        self.assertInvariants(tally, run, proxy)
