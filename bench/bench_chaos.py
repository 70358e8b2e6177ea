"""
Chaos figures: random cuts of the agent's backend link with commands flowing (agent and
stand-in backend in one process, real loopback sockets, a ChaosProxy between them).

Each step waits until the agent is connected, issues 0-3 commands (a 0-0.4 s work command,
inventory refreshes, an unknown type), degrades the link at random (nothing, a stall, a slow
link, a flipped or garbled byte either way) for 0-0.4 s, then cuts every connection (one step
in seven also refuses reconnects for up to 0.8 s). Printed: commands resolved / commands acked
(must read 100 %), repeats (results seen twice in the documented window), anomalies at the
stand-in backend, problems found by the shared invariant checker (tests/chaos/invariants.py),
and the time from issue to result, against a baseline of the same load without faults measured
in the same run.

--cuts counts cuts that reset an open connection (steps whose connection a damaged byte had
already closed are made up for). Usage: python3 bench/bench_chaos.py [--cuts 500] [--baseline 50] [--seed N]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import summary  # noqa: E402
from twisted.internet.task import react  # noqa: E402

from llmport_agent.agent.service import AgentService
from llmport_agent.commands.parse import parse_iso8601  # noqa: E402
from llmport_agent.core.config import load_config
from llmport_agent.devbackend import DevBackend  # noqa: E402
from llmport_agent.inventory.gpu import NoGPUSource  # noqa: E402
from tests.agentharness import agent_env  # noqa: E402
from tests.chaos.invariants import settle  # noqa: E402
from tests.chaos.scenarios import (  # noqa: E402
    ChaosRun,
    cheap_issuer,
    converge,
    install_work_handler,
    run_random,
)
from tests.support.chaosproxy import ChaosProxy  # noqa: E402

TYPES = ("chaos_work", "chaos_work", "refresh_inventory", "frobnicate")


def latencies(backend: DevBackend, ids: list[str]) -> list[float]:
    out = []
    for cid in ids:
        c = backend.command(cid)
        if c["completed_at"]:
            out.append((parse_iso8601(c["completed_at"]) or 0.0) - (parse_iso8601(c["issued_at"]) or 0.0))
    return out


async def main(reactor: Any, args: argparse.Namespace) -> None:
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    backend = DevBackend(reactor)
    await backend.listen(0, "127.0.0.1")
    proxy = ChaosProxy(reactor, backend.port)
    await proxy.start()
    state = tempfile.mkdtemp(prefix="bench-chaos-")
    env = agent_env(backend, state, ENROLLMENT_TOKEN=backend.mint_token()["token"],
                    BACKEND_URL=f"http://127.0.0.1:{proxy.listening_port}", LOG_LEVEL="WARN")
    agent = AgentService(reactor, load_config(env, {}), fatal=lambda code, msg: None, gpu_source=NoGPUSource(),
                         docker_enabled=False)
    agent.startService()
    try:
        install_work_handler(agent, reactor, random.Random(seed ^ 1))
        await backend.wait_for(lambda: agent.session.node_id is not None, 30)
        node_id = agent.session.node_id
        assert node_id is not None

        def connected() -> bool:
            return bool(agent.session.connected) and backend.connection_count(node_id) == 1

        await settle(reactor, connected, 30)
        issue = cheap_issuer(backend, node_id, TYPES)

        async def nothing(rng: random.Random) -> None:
            return None

        base = await run_random(reactor, backend, node_id, proxy, steps=args.baseline, seed=seed ^ 2,
                                issue=issue, connected=connected, disrupt=nothing, degrade=("none",))
        base_tally = await converge(reactor, backend, node_id, base, connected)
        print(f"seed {seed}")
        print(f"baseline, {args.baseline} steps without faults: {base_tally.line()}")
        print(f"  issue to result: {summary(latencies(backend, base.commands), ' s')}")
        cuts_before, live_before, opens_before = (
            proxy.counts.get("cut", 0), proxy.live_cuts, agent.session.stats.opens)
        # Steps until --cuts of them reset an open connection (a flipped byte may have closed
        # it just before the cut: such a step is repeated, with the next seed).
        run = ChaosRun(seed=seed, steps=0)
        part = 0
        while proxy.live_cuts - live_before < args.cuts and not run.stuck:
            more = await run_random(reactor, backend, node_id, proxy, seed=seed + part,
                                    steps=args.cuts - (proxy.live_cuts - live_before),
                                    issue=issue, connected=connected)
            part += 1
            run.steps += more.steps
            run.commands += more.commands
            run.stuck += more.stuck
            run.seconds += more.seconds
            for k, v in more.degraded.items():
                run.degraded[k] = run.degraded.get(k, 0) + v
        tally = await converge(reactor, backend, node_id, run, connected, timeout=120)
        print(f"chaos, {proxy.counts.get('cut', 0) - cuts_before} random cuts in {run.seconds:.0f} s, "
              f"{proxy.live_cuts - live_before} of them reset an open connection "
              f"(degraded before the cut: {run.degraded}; refused reconnects {proxy.counts.get('refuse', 0)}):")
        print(f"  {tally.line()}")
        print(f"  issue to result: {summary(latencies(backend, run.commands), ' s')}")
        print(f"  agent stream opens during the cuts: {agent.session.stats.opens - opens_before}")
        problems = run.stuck + tally.problems
        print(f"  invariant problems: {len(problems)}")
        for p in problems[:20]:
            print(f"    {p}")
        other = [a for a in tally.anomalies if not a.startswith("second command_result")]
        print(f"  anomalies other than windowed repeats: {len(other)} {sorted(set(other))[:5]}")
    finally:
        await agent.stopService()
        await proxy.stop()
        await backend.stop()
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--cuts", type=int, default=500)
    parser.add_argument("--baseline", type=int, default=50)
    parser.add_argument("--seed", type=int, default=None)
    react(main, [parser.parse_args()])
