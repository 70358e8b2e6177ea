"""
Dispatch against the two backend generations (issue 18, protocol 10.1), one run, one process,
agent and stand-in backend on real loopback sockets:

 1. idle backend cost per node: frames a minute and the backend CPU they cost (protocol 3.2's
    weights: 4.4 ms per frame with seq, 2.9 ms without), after the first command (which on the
    current generation proves push), next to the original agent's 26.4 ms/min (6 frames, seq);
 2. pickup latency of commands issued to an idle node (issue -> the agent's ack processed by
    the backend), p50/p95: pushed on the current generation, polled on the April one.

Settings are the defaults except COMMAND_POLL_ACTIVE_WINDOW_SEC (--window, default 5 s; the
default 600 s would keep both generations polling fast for 10 minutes after the connect, so
the idle phase would start only then).

Usage: python3 bench/bench_push.py [--minutes 2] [--pickups 40] [--window 5]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import percentile, summary  # noqa: E402
from twisted.internet.defer import Deferred  # noqa: E402
from twisted.internet.task import deferLater, react  # noqa: E402

from llmport_agent.config import load_config  # noqa: E402
from llmport_agent.devbackend import DevBackend  # noqa: E402
from llmport_agent.devbackend._state import CPU_MS_WITH_SEQ  # noqa: E402
from llmport_agent.inventory.gpu import NoGPUSource  # noqa: E402
from llmport_agent.service import AgentService  # noqa: E402

ORIGINAL_IDLE_MS_PER_MIN = 6 * CPU_MS_WITH_SEQ


async def one_generation(reactor: Any, generation: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    backend = DevBackend(reactor, generation=generation)
    await backend.listen(0, "127.0.0.1")
    name = f"push-{generation}"
    env = {
        "LLM_PORT_NODE_AGENT_BACKEND_URL": backend.url,
        "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN": backend.mint_token()["token"],
        "LLM_PORT_NODE_AGENT_AGENT_ID": name,
        "LLM_PORT_NODE_AGENT_HOST": "127.0.0.1",
        "LLM_PORT_NODE_AGENT_STATE_PATH": os.path.join(tmp, name, "state.json"),
        "LLM_PORT_NODE_AGENT_OPS_PORT": "0",
        "LLM_PORT_NODE_AGENT_COMMAND_POLL_ACTIVE_WINDOW_SEC": str(args.window),
    }
    agent = AgentService(reactor, load_config(env, {}), gpu_source=NoGPUSource(), docker_enabled=False)
    agent.startService()
    try:
        await backend.wait_for(lambda: agent.session.connected and agent.session.node_id is not None, 30)
        node_id = agent.session.node_id
        assert node_id is not None

        async def pickup() -> float:
            cmd = backend.issue_command(node_id, "refresh_inventory", {})
            issued = reactor.seconds()
            await backend.wait_for(
                lambda: backend.command(cmd["id"])["status"] not in ("queued", "dispatched"), 30)
            took = reactor.seconds() - issued
            await backend.wait_for(lambda: backend.command(cmd["id"])["status"] == "succeeded", 30)
            return took

        # Past the active window, then the first command of an idle node (proves push there).
        await deferLater(reactor, args.window + 1.0, lambda: None)
        while reactor.seconds() - agent.session._last_sent_at < 3.5:
            await deferLater(reactor, 0.05, lambda: None)
        await pickup()
        mode_after_first = agent.session.dispatch.mode
        # Idle cost.
        await deferLater(reactor, args.window + 1.0, lambda: None)
        start = backend.costs(node_id)
        t0 = reactor.seconds()
        await deferLater(reactor, args.minutes * 60, lambda: None)
        minutes = (reactor.seconds() - t0) / 60
        end = backend.costs(node_id)
        frames = (end["frames"] - start["frames"]) / minutes
        cpu = (end["cpu_ms"] - start["cpu_ms"]) / minutes
        polls = sum(1 for f in backend.frames(node_id) if f.get("type") == "poll")
        # Pickups of an idle node: each after a random pause longer than the active window.
        latencies = []
        for _ in range(args.pickups):
            await deferLater(reactor, args.window + random.uniform(0.5, 8.0), lambda: None)
            latencies.append(await pickup())
        return {
            "generation": generation,
            "mode": mode_after_first,
            "final_mode": agent.session.dispatch.mode,
            "frames_per_min": frames,
            "cpu_ms_per_min": cpu,
            "polls_total": polls,
            "latencies": latencies,
        }
    finally:
        await agent.stopService()
        await backend.stop()


async def run(reactor: Any, args: argparse.Namespace) -> None:
    tmp = tempfile.mkdtemp(prefix="bench-push-")
    rows = [await one_generation(reactor, g, args, tmp) for g in ("2026-04", "current")]
    print(f"idle window {args.minutes:g} min after the first command; {args.pickups} pickups of an idle node; "
          f"COMMAND_POLL_ACTIVE_WINDOW_SEC={args.window:g}, other settings default")
    for r in rows:
        lat = r["latencies"]
        print(f"{r['generation']:>8}: dispatch mode {r['mode']} (at the end: {r['final_mode']}); "
              f"idle {r['frames_per_min']:.1f} frames/min = {r['cpu_ms_per_min']:.1f} ms backend CPU/min "
              f"({r['cpu_ms_per_min'] / ORIGINAL_IDLE_MS_PER_MIN:.2f}x the original agent's "
              f"{ORIGINAL_IDLE_MS_PER_MIN:.1f}); pickup {summary(lat, ' s', 3)}; "
              f"p50 {percentile(lat, 0.5):.3f} s, p95 {percentile(lat, 0.95):.3f} s")
    current = next(r for r in rows if r["generation"] == "current")
    print(f"targets (current generation): idle <= {ORIGINAL_IDLE_MS_PER_MIN:.1f} ms/min: "
          f"{'met' if current['cpu_ms_per_min'] <= ORIGINAL_IDLE_MS_PER_MIN else 'MISSED'}; pickup p95 <= 0.3 s: "
          f"{'met' if percentile(current['latencies'], 0.95) <= 0.3 else 'MISSED'}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--pickups", type=int, default=40)
    p.add_argument("--window", type=float, default=5.0)
    args = p.parse_args()
    react(lambda reactor: Deferred.fromCoroutine(run(reactor, args)))


if __name__ == "__main__":
    main()
