"""
Idle cost of the agent at default settings, against the stand-in backend on loopback.

Prints, over N agents idling for M minutes after a warm-up: frames per minute each sends to
the backend, RSS at the end and CPU use (percent of one core). Targets: RSS <= 80 MB,
CPU <= 0.5 % of one core. Usage: python3 bench/bench_idle.py [--minutes 10] [--agents 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import AgentProcess, DevBackendProcess, summary  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--agents", type=int, default=3)
    p.add_argument("--warmup", type=float, default=30.0)
    args = p.parse_args()
    backend = DevBackendProcess()
    agents = []
    tmp = tempfile.mkdtemp(prefix="bench-idle-")
    try:
        for i in range(args.agents):
            d = os.path.join(tmp, f"a{i}")
            os.makedirs(d)
            agents.append(AgentProcess(backend.url, backend.token(), d, f"idle-{i}"))
        time.sleep(args.warmup)
        nodes = {n["agent_id"]: n["id"] for n in backend.get("/dev/nodes")}
        start_frames = {a: len(backend.get(f"/dev/nodes/{nodes[f'idle-{i}']}/frames")) for i, a in enumerate(agents)}
        procs = [psutil.Process(a.proc.pid) for a in agents]
        cpu0 = [pr.cpu_times() for pr in procs]
        t0 = time.monotonic()
        time.sleep(args.minutes * 60)
        elapsed = time.monotonic() - t0
        cpu1 = [pr.cpu_times() for pr in procs]
        rss = [pr.memory_info().rss / 1e6 for pr in procs]
        frames = []
        for i, a in enumerate(agents):
            n = len(backend.get(f"/dev/nodes/{nodes[f'idle-{i}']}/frames"))
            frames.append((n - start_frames[a]) / (elapsed / 60))
        cpu = [100 * ((c1.user + c1.system) - (c0.user + c0.system)) / elapsed for c0, c1 in zip(cpu0, cpu1, strict=True)]
        print(f"idle agents: {args.agents}, window {args.minutes:g} min after {args.warmup:g} s warm-up, default settings")
        print(f"frames/min sent to the backend: {summary(frames, '', 1)}")
        print(f"RSS at end (MB):                 {summary(rss, ' MB', 1)}")
        print(f"CPU (% of one core):             {summary(cpu, ' %', 3)}")
    finally:
        for a in agents:
            a.stop()
        backend.stop()


if __name__ == "__main__":
    main()
