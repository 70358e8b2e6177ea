"""
The link to Loki under random faults (cuts, stalls, slow links, damaged responses), with the
agent's own log lines flowing and commands flowing on the backend link: once the link heals,
every line is in Loki exactly once (below the spool cap nothing is lost; a push repeated
because its answer was lost carries the same entries, which Loki stores once).

Requests are cut, stalled and slowed but not damaged: a damaged push body is a 400 from Loki,
which the agent rightly drops (README, "Answers"); TCP checksums and TLS make that case a
broken connection in practice, which the cuts cover.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from twisted.internet import reactor as _global_reactor
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.web.server import Site

from llmport_agent.logs.testing import FakeLoki
from tests.chaos.base import ChaosTestCase
from tests.chaos.invariants import check_loki, settle
from tests.chaos.scenarios import chaos_cuts, chaos_seed, cheap_issuer, converge, run_random
from tests.support.chaosproxy import DOWN

_log = Logger(namespace="chaos.lines")
reactor: Any = _global_reactor


class LokiChaosTests(ChaosTestCase):
    timeout = 180

    async def test_loki_link_faults_lose_and_double_nothing(self) -> None:
        """Random faults on the Loki link: every line of the agent's log arrives exactly once."""
        seed = chaos_seed()
        loki = FakeLoki(check_labels=True, require_gzip=True)
        port = reactor.listenTCP(0, Site(loki), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        proxy = await self.proxy_to(port.getHost().port)
        backend = await self.start_backend()
        agent = self.start_agent(backend, LOKI_URL=self.proxied(proxy), LOG_FLUSH_INTERVAL_SEC="0.2",
                                 LOG_BATCH_SIZE="50", LOKI_SPOOL_MAX_MB="16")
        node_id = await self.wait_connected(backend, agent)
        marker = uuid.uuid4().hex[:12]
        sent: list[str] = []

        def emit() -> None:
            for _ in range(10):
                text = f"chaos-line {marker} {len(sent):06d}"
                sent.append(text)
                _log.info("{text}", text=text)

        emitter = LoopingCall(emit)
        emitter.start(0.05)
        self.addCleanup(lambda: emitter.stop() if emitter.running else None)

        def connected() -> bool:
            return bool(agent.session.connected) and backend.connection_count(node_id) == 1

        run = await run_random(reactor, backend, node_id, proxy, steps=max(4, chaos_cuts(25) // 2), seed=seed,
                               issue=cheap_issuer(backend, node_id, ("refresh_inventory", "frobnicate")),
                               connected=connected, directions=(DOWN,), max_commands=1,
                               backend_link=False)
        # A quick run of the faults emits fewer lines: keep the stream going to a known amount.
        await settle(reactor, lambda: len(sent) >= 600, 30, step=0.05)
        emitter.stop()
        tally = await converge(reactor, backend, node_id, run, connected)
        pattern = re.compile(rf"chaos-line {marker} \d{{6}}")

        def key(line: str) -> str | None:
            m = pattern.search(line)
            return m.group(0) if m else None

        await settle(reactor, lambda: not check_loki(loki, sent, key, job="node-agent"), 90, step=0.25)
        problems = check_loki(loki, sent, key, job="node-agent")
        stats = agent.loki.stats()
        if problems:
            problems.append(f"shipper: {stats}")
        self.assertInvariants(tally, run, proxy, problems)
        self.assertGreater(len(sent), 500)
