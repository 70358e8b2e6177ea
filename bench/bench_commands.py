"""
Command path figures, agent and stand-in backend on loopback (one process, real sockets), the
backend of the April 2026 generation (commands in reply to a frame: the polling path).

 1. pickup latency: the backend issues a command, the agent acks it (200 commands, spaced out),
    at default settings (poll every 2 s);
 2. throughput: 500 no-op commands issued at once, until the last result reaches the backend;
 3. heartbeat lateness (1 s heartbeats) while 50 commands run and a 1 GB file is hashed on the
    agent's I/O pool.

Usage: python3 bench/bench_commands.py [--pickups 200] [--noops 500] [--hash-mb 1024]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import percentile, summary  # noqa: E402
from twisted.internet.defer import Deferred, DeferredList  # noqa: E402
from twisted.internet.task import deferLater, react  # noqa: E402

from llmport_agent.agent.service import AgentService
from llmport_agent.commands.base import HandlerSpec  # noqa: E402
from llmport_agent.core.config import load_config
from llmport_agent.devbackend import DevBackend  # noqa: E402
from llmport_agent.inventory.gpu import NoGPUSource  # noqa: E402


def parse_ts(value: str) -> float:
    from llmport_agent.commands.parse import parse_iso8601

    return parse_iso8601(value) or 0.0


def hash_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


async def run(reactor: Any, args: argparse.Namespace) -> None:
    tmp = tempfile.mkdtemp(prefix="bench-cmd-")
    # The April 2026 generation: these figures are the polling path (bench_generations
    # measures pushed pickup against the current one).
    backend = DevBackend(reactor, generation="2026-04")
    await backend.listen(0, "127.0.0.1")

    def make_agent(name: str, **env: str) -> AgentService:
        base = {
            "LLM_PORT_NODE_AGENT_BACKEND_URL": backend.url,
            "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN": backend.mint_token()["token"],
            "LLM_PORT_NODE_AGENT_AGENT_ID": name,
            "LLM_PORT_NODE_AGENT_HOST": "127.0.0.1",
            "LLM_PORT_NODE_AGENT_STATE_PATH": os.path.join(tmp, name, "state.json"),
            "LLM_PORT_NODE_AGENT_OPS_PORT": "0",
        }
        base.update({"LLM_PORT_NODE_AGENT_" + k: v for k, v in env.items()})
        agent = AgentService(reactor, load_config(base, {}), gpu_source=NoGPUSource(), docker_enabled=False)

        async def noop(ctx: Any) -> dict[str, Any]:
            return {}

        async def sleeper(ctx: Any) -> dict[str, Any]:
            await deferLater(reactor, 10.0, lambda: None)
            return {}

        agent.pipeline.registry["bench_noop"] = HandlerSpec(noop, lane="read", idempotent=True, deadline=30)
        agent.pipeline.registry["bench_sleep"] = HandlerSpec(sleeper, lane="runtime", idempotent=True, deadline=30)
        agent.startService()
        return agent

    # 1. pickup latency at default settings
    agent = make_agent("pickup")
    await backend.wait_for(lambda: agent.session.connected, 15)
    node_id = agent.session.node_id
    latencies = []
    for _ in range(args.pickups):
        cmd = backend.issue_command(node_id, "bench_noop", {})
        issued = reactor.seconds()
        await backend.wait_for(lambda cmd=cmd: backend.command(cmd["id"])["status"] != "queued" and backend.command(cmd["id"])["status"] != "dispatched", 10)
        latencies.append(reactor.seconds() - issued)
        await deferLater(reactor, random.uniform(0.5, 3.0), lambda: None)
    print(f"pickup latency (issue -> ack at the backend), {args.pickups} commands, poll 2 s: {summary(latencies, ' s', 3)}")
    print(f"  p95 {percentile(latencies, 0.95):.3f} s (target <= 2.5 s)")

    # 2. throughput of no-op commands
    start = reactor.seconds()
    cmds = [backend.issue_command(node_id, "bench_noop", {}) for _ in range(args.noops)]
    await backend.wait_for(lambda: all(backend.command(c["id"])["status"] == "succeeded" for c in cmds[-1:]) and
                           all(backend.command(c["id"])["status"] == "succeeded" for c in cmds), 120)
    took = reactor.seconds() - start
    print(f"throughput: {args.noops} no-op commands end to end in {took:.2f} s = {args.noops / took:.0f} commands/s (target >= 100)")
    await agent.stopService()

    # 3. heartbeat lateness under load
    agent = make_agent("load", HEARTBEAT_INTERVAL_SEC="1", MAX_CONCURRENT_COMMANDS="50")
    await backend.wait_for(lambda: agent.session.connected, 15)
    node_id = agent.session.node_id
    big = os.path.join(tmp, "big.bin")
    with open(big, "wb") as f:
        block = os.urandom(1 << 20)
        for _ in range(args.hash_mb):
            f.write(block)
    await deferLater(reactor, 2, lambda: None)
    agent.heartbeat.lateness.clear()
    from twisted.internet.task import LoopingCall

    probe: list[float] = []
    expected = [reactor.seconds() + 0.1]

    def tick() -> None:
        now = reactor.seconds()
        probe.append(max(0.0, now - expected[0]) * 1000)
        expected[0] = now + 0.1

    loop = LoopingCall(tick)
    loop.clock = reactor
    loop.start(0.1, now=False)
    t0 = reactor.seconds()

    async def hash_passes() -> None:
        for _ in range(3):
            await agent.io_pool.run(hash_file, big)

    hashing: Deferred[Any] = Deferred.fromCoroutine(hash_passes())
    sleeps = [backend.issue_command(node_id, "bench_sleep", {"runtime_id": f"r{i}"}) for i in range(50)]
    hashed_at: list[float] = []
    hashing.addCallback(lambda _: hashed_at.append(reactor.seconds() - t0))
    await DeferredList([hashing])
    await backend.wait_for(lambda: all(backend.command(c["id"])["status"] == "succeeded" for c in sleeps), 60)
    loop.stop()
    lateness_ms = [x * 1000 for x in agent.heartbeat.lateness]
    print(f"reactor lateness (ms, 100 ms probe) in the same window: {summary(probe, ' ms', 1)}")
    print(f"heartbeat lateness (ms) while 50 commands ran and {args.hash_mb} MB were hashed "
          f"3 times (hashing took {hashed_at[0]:.1f} s): {summary(lateness_ms, ' ms', 1)}")
    print(f"  p99 {percentile(lateness_ms, 0.99):.1f} ms (target <= 50 ms)")
    await agent.stopService()
    await backend.stop()
    os.unlink(big)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pickups", type=int, default=200)
    p.add_argument("--noops", type=int, default=500)
    p.add_argument("--hash-mb", type=int, default=1024)
    args = p.parse_args()
    react(lambda reactor: Deferred.fromCoroutine(run(reactor, args)))


if __name__ == "__main__":
    main()
