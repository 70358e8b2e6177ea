"""
Leak hunt (the soak's RSS slope): the agent in this process, with tracemalloc, against the
stand-in backend and the Loki stand-in in child processes (so their heaps are not in the
picture), and the test Docker engine when it can be had. Issues bench_soak's command cycle
back to back (no interval), snapshots the heap after a warm-up and again after the measured
commands (after a full gc each time), and prints the top growers grouped by traceback, plus
the Python objects by type that grew. Prints figures; asserts nothing.

A growth that scales with the commands issued shows as a traceback whose size and count grow
with --commands; allocator behaviour (RSS up, Python heap flat) shows as "traced heap" flat.

Usage: python3 bench/bench_leak.py [--warmup 200] [--commands 1000] [--docker auto|yes|no]
       [--docker-every 3] [--top 15] [--frames 12]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import tracemalloc
from collections import Counter
from typing import Any

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench._common import DevBackendProcess  # noqa: E402
from bench.bench_soak import (  # noqa: E402
    RESOLVE_TIMEOUT,
    TERMINAL,
    Conductor,
    LokiProcess,
    chatty_script,
    prefill_journal,
    start_docker,
    wait_node,
)


def type_counts() -> Counter[str]:
    gc.collect()
    return Counter(type(o).__name__ for o in gc.get_objects())


def settle(snapshot_frames: int) -> tuple[tracemalloc.Snapshot, Counter[str], float]:
    t = time.monotonic()
    gc.collect()
    snap = tracemalloc.take_snapshot().filter_traces([
        tracemalloc.Filter(False, tracemalloc.__file__),
        tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
        tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>"),
        tracemalloc.Filter(False, "<unknown>"),
    ])
    types = type_counts()
    print(f"  snapshot: {len(snap.traces)} traces in {time.monotonic() - t:.1f} s", flush=True)
    return snap, types, psutil.Process().memory_info().rss / 1e6


def run_commands(conductor: Conductor, count: int, poll: float) -> dict[str, int]:
    """Issue C{count} commands one after the other, each after the previous one resolved."""
    ended: Counter[str] = Counter()
    for _ in range(count):
        conductor.issue_next()
        deadline = time.monotonic() + RESOLVE_TIMEOUT
        while not conductor.poll() and time.monotonic() < deadline:
            time.sleep(poll)
        ended[conductor.issued[-1]["status"]] += 1
    return dict(ended)


#: The conductor's own allocations (urllib to the backend, in its thread) are left out of the
#: figures (by traceback after grouping: an all_frames filter on the snapshot takes minutes).
CONDUCTOR = (os.path.join(ROOT, "bench", "_common.py"), os.path.join(ROOT, "bench", "bench_soak.py"))


def conductors(tb: tracemalloc.Traceback) -> bool:
    return any(f.filename in CONDUCTOR for f in tb)


def agent_site(tb: tracemalloc.Traceback) -> str:
    """The most recent frame in the agent's code (where the agent asked for it), else the first."""
    for frame in reversed(tb):  # oldest first: the most recent frame is the last
        if "llmport_agent" in frame.filename:
            return f"{os.path.relpath(frame.filename, ROOT)}:{frame.lineno}"
    return f"{tb[-1].filename}:{tb[-1].lineno}"


def print_growers(before: tracemalloc.Snapshot, mid: tracemalloc.Snapshot, after: tracemalloc.Snapshot,
                  per: int, top: int, frames: int) -> None:
    stats = [s for s in after.compare_to(before, "traceback") if not conductors(s.traceback)]
    late = {s.traceback: s.size_diff for s in after.compare_to(mid, "traceback") if not conductors(s.traceback)}
    total = sum(s.size_diff for s in stats)
    total_late = sum(late.values())
    print(f"\ntraced heap: {sum(s.size for s in before.statistics('filename')) / 1e6:.2f} MB -> "
          f"{sum(s.size for s in after.statistics('filename')) / 1e6:.2f} MB, net {total / 1e3:+.1f} KB "
          f"({total / max(1, per):+.1f} B per measured command; second half {total_late / 1e3:+.1f} KB)")
    sites: Counter[str] = Counter()
    sites_late: Counter[str] = Counter()
    for s in stats:
        sites[agent_site(s.traceback)] += s.size_diff
        sites_late[agent_site(s.traceback)] += late.get(s.traceback, 0)
    print("\nnet change by allocation site (the most recent frame in the agent's code; frees count):")
    ranked = sorted(sites.items(), key=lambda kv: -abs(kv[1]))[:top]
    for site, diff in ranked:
        print(f"  {diff / 1e3:+9.1f} KB (second half {sites_late[site] / 1e3:+8.1f} KB)  {site}")
    print(f"\ntop {top} growing tracebacks (whole run; second half in brackets):")
    for s in [s for s in stats if s.size_diff > 0][:top]:
        print(f"\n{s.size_diff / 1e3:+9.1f} KB [{late.get(s.traceback, 0) / 1e3:+.1f} KB] {s.count_diff:+7d} blocks "
              f"({s.size_diff / max(1, per):+.1f} B/command; now {s.size / 1e3:.1f} KB in {s.count})")
        for line in s.traceback.format(limit=frames, most_recent_first=True):
            print("    " + line)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=200, help="commands before the first snapshot")
    p.add_argument("--commands", type=int, default=1000, help="commands between the two snapshots")
    p.add_argument("--docker", choices=["auto", "yes", "no"], default="auto")
    p.add_argument("--docker-every", type=int, default=3, help="every Nth command is a workload step")
    p.add_argument("--prefill-journal", type=int, default=5000)
    p.add_argument("--poll", type=float, default=0.05, help="seconds between polls of a pending command")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--frames", type=int, default=16, help="frames kept per allocation (tracemalloc)")
    p.add_argument("--show-frames", type=int, default=12, help="frames printed per grower")
    args = p.parse_args(argv)

    from twisted.internet import reactor
    from twisted.logger import globalLogBeginner

    from llmport_agent.agent.service import AgentService
    from llmport_agent.core.config import load_config
    from llmport_agent.core.logsetup import make_observer

    tmp = tempfile.mkdtemp(prefix="bench-leak-")
    env = start_docker(args.docker)
    docker_host = env.host if env is not None else "unix:///nonexistent/bench-leak/docker.sock"
    backend = DevBackendProcess(log_path=os.path.join(tmp, "devbackend.log"))
    loki = LokiProcess()
    settings = {
        "BACKEND_URL": backend.url, "ENROLLMENT_TOKEN": backend.token(), "AGENT_ID": "leak",
        "HOST": "127.0.0.1", "STATE_PATH": os.path.join(tmp, "state.json"),
        "MODEL_STORE": os.path.join(tmp, "models"), "OPS_PORT": "0", "LOKI_URL": loki.url, "LOG_LEVEL": "INFO",
    }
    if env is not None:
        settings.update(WORKLOAD_NETWORK="host", READINESS_TIMEOUT_SEC="30", STOP_GRACE_SEC="1")
    if args.prefill_journal > 0:
        prefill_journal(tmp, args.prefill_journal)
    config = load_config({"LLM_PORT_NODE_AGENT_" + k: v for k, v in settings.items()}, {})
    log = open(os.path.join(tmp, "agent.log"), "w")  # noqa: SIM115
    globalLogBeginner.beginLoggingTo([make_observer(config.log_level, stream=log)], redirectStandardIO=False)
    tracemalloc.start(args.frames)
    agent = AgentService(reactor, config, fatal=lambda code, msg: print(f"agent fatal {code}: {msg}"),
                         docker_enabled=env is not None, docker_environ={"DOCKER_HOST": docker_host})
    result = {"code": 0}

    def drive() -> None:
        try:
            node_id = wait_node(backend, "leak")
            conductor = Conductor(backend, node_id, env is not None, args.docker_every)
            if env is not None:
                cmd = conductor.create_runtime("leak-chatty", chatty_script(2))
                chatty = cmd["payload"]["runtime_id"]
                conductor.track(cmd)
                conductor.wait_resolved(RESOLVE_TIMEOUT)
            t = time.monotonic()
            print(f"bench_leak: warm-up {args.warmup} commands, then {args.commands} measured; Docker engine: "
                  f"{'yes' if env is not None else 'no'} (every {args.docker_every}th a workload step)", flush=True)
            ended = run_commands(conductor, args.warmup, args.poll)
            print(f"warm-up: {ended} in {time.monotonic() - t:.0f} s", flush=True)
            before, types_before, rss_before = settle(args.frames)
            deployed = conductor.runtimes_deployed
            t = time.monotonic()
            ended = Counter(run_commands(conductor, args.commands // 2, args.poll))
            mid, _, _ = settle(args.frames)
            ended.update(run_commands(conductor, args.commands - args.commands // 2, args.poll))
            took = time.monotonic() - t
            after, types_after, rss_after = settle(args.frames)
            cycles = conductor.runtimes_deployed - deployed
            print(f"measured: {dict(ended)} in {took:.0f} s ({args.commands / took:.1f} commands/s), "
                  f"{cycles} workload cycles", flush=True)
            print(f"RSS {rss_before:.1f} -> {rss_after:.1f} MB ({(rss_after - rss_before) * 1e3:+.0f} KB; "
                  f"{(rss_after - rss_before) * 1e6 / args.commands:+.0f} B/command; tracemalloc's own "
                  f"overhead is in it)")
            print_growers(before, mid, after, args.commands, args.top, args.show_frames)
            grew = (types_after - types_before).most_common(args.top)
            print("\nPython objects by type that grew (gc.get_objects, after a full collection):")
            for name, n in grew:
                print(f"  {name:32s} {types_before[name]:8d} -> {types_after[name]:8d} ({n:+d})")
            unresolved = [c for c in conductor.issued if c["status"] not in TERMINAL]
            print(f"unresolved commands: {len(unresolved)}")
            if env is not None:
                conductor.track(conductor.runtime_action(chatty, "remove"))
                conductor.wait_resolved(60)
        except Exception:
            traceback.print_exc()
            result["code"] = 1
        finally:
            reactor.callFromThread(_stop, agent, reactor)  # type: ignore[attr-defined]

    reactor.callWhenRunning(agent.startService)  # type: ignore[attr-defined]
    reactor.callWhenRunning(lambda: threading.Thread(target=drive, daemon=True).start())  # type: ignore
    try:
        reactor.run()  # type: ignore[attr-defined]
    finally:
        loki.stop()
        backend.stop()
        if env is not None:
            env.remove_all_containers()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return result["code"]


def _stop(agent: Any, reactor: Any) -> None:
    d = agent.stopService() if agent.running else None
    if d is None:
        reactor.stop()
    else:
        d.addBoth(lambda _: reactor.stop())


if __name__ == "__main__":
    sys.exit(main())
