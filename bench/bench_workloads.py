"""
Workload benchmarks against a real Docker engine (started like the tests do; needs root,
docker.io, busybox-static, docker-registry). Prints figures; asserts nothing.

 1. deploy of the local test workload, command to C{ready}, split by phase
    (baseline: the bare engine create+start call);
 2. C{fetch_container_logs} while a deploy of the same runtime waits for readiness
    (baseline: the same fetch with nothing else running);
 3. reactor lateness of a heartbeat-like timer during a pull of a large image from the
    local registry (baseline: the same timer with no pull);
 4. engine calls per minute at idle with N managed workloads (event stream + reconcile).

Usage: python3 bench/bench_workloads.py [--repeats 5] [--big-mb 200] [--workloads 20]
       [--idle-seconds 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twisted.internet.defer import Deferred, ensureDeferred  # noqa: E402
from twisted.internet.task import LoopingCall, deferLater, react  # noqa: E402

from llmport_agent.workloads import containers as ops  # noqa: E402
from llmport_agent.workloads.policy import parse_image_ref  # noqa: E402
from llmport_agent.workloads.spec import build_spec, render  # noqa: E402
from tests.support.docker_env import require_docker, require_registry  # noqa: E402
from tests.support.rig import SERVE, Rig, httpd_payload, ids_of  # noqa: E402

PHASES = [
    "validate",
    "remove_stale",
    "sync_model",
    "pull_image",
    "start_container",
    "resolve_endpoint",
    "waiting_for_ready",
    "ready",
]


def summary(values: list[float], unit: str = "ms", scale: float = 1000.0) -> str:
    """median [min..max] (n)."""
    if not values:
        return "n/a"
    v = [x * scale for x in values]
    return f"median {statistics.median(v):8.1f} {unit}  [{min(v):.1f} .. {max(v):.1f}]  n={len(v)}"


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    k = min(len(ordered) - 1, max(0, int(round(pct / 100 * (len(ordered) - 1)))))
    return ordered[k]


async def bench_deploy(reactor: Any, rig: Rig, repeats: int) -> None:
    print("\n== deploy of the local test workload: command -> ready, time spent per phase ==")
    per_phase: dict[str, list[float]] = {p: [] for p in ["(before validate)", *PHASES[:-1]]}
    totals: list[float] = []
    for _ in range(repeats):
        payload = httpd_payload()
        ctx = rig.ctx("deploy_workload", payload)
        stamps: list[tuple[str, float]] = []

        def record(frame: dict[str, Any], stamps: list[tuple[str, float]] = stamps) -> None:
            stamps.append((frame["phase"], reactor.seconds()))

        ctx.on_progress.append(record)
        start = reactor.seconds()
        await rig.manager.deploy(ctx)
        first: dict[str, float] = {}
        for phase, t in stamps:
            first.setdefault(phase, t)
        order = [p for p in PHASES if p in first]
        per_phase["(before validate)"].append(first[order[0]] - start)
        for phase, nxt in zip(order, order[1:], strict=False):
            per_phase[phase].append(first[nxt] - first[phase])
        totals.append(first["ready"] - start)
        await rig.run("remove_workload", ids_of(payload))
    for phase, values in per_phase.items():
        print(f"  {phase:22s} {summary(values)}")
    print(f"  TOTAL to ready         {summary(totals)}   (target <= 5000 ms)")
    # Baseline: the bare engine create + start of the same container.
    base: list[float] = []
    for _ in range(repeats):
        payload = httpd_payload()
        spec = build_spec(payload, rig.settings, ())
        args = render(spec, host_port=spec.container_port, command_id="bench", agent_id="bench")
        t0 = reactor.seconds()
        created = await rig.engine.call(ops.create_and_start, args)
        base.append(reactor.seconds() - t0)
        await rig.engine.call(ops.remove, created["id"])
    print(f"  baseline create+start  {summary(base)}")


async def bench_logs(reactor: Any, rig: Rig, repeats: int) -> None:
    print("\n== fetch_container_logs while a deploy of the same runtime runs ==")
    during: list[float] = []
    idle: list[float] = []
    for _ in range(repeats):
        payload = httpd_payload(script="echo booting; sleep 2; " + SERVE)
        ctx = rig.ctx("deploy_workload", payload)
        reached: Deferred[None] = Deferred()

        def watch(frame: dict[str, Any], d: Deferred[None] = reached) -> None:
            if frame["phase"] == "waiting_for_ready" and not d.called:
                d.callback(None)

        ctx.on_progress.append(watch)
        deploy = ensureDeferred(rig.manager.deploy(ctx))
        await reached
        t0 = reactor.seconds()
        await rig.run("fetch_container_logs", ids_of(payload))
        during.append(reactor.seconds() - t0)
        await deploy
        t0 = reactor.seconds()
        await rig.run("fetch_container_logs", ids_of(payload))
        idle.append(reactor.seconds() - t0)
        await rig.run("remove_workload", ids_of(payload))
    print(f"  during deploy           {summary(during)}   (target <= 2000 ms)")
    print(f"  baseline (idle)         {summary(idle)}")


async def _lateness(reactor: Any, work: Any, interval: float = 0.02) -> list[float]:
    samples: list[float] = []
    expected = [reactor.seconds() + interval]

    def tick() -> None:
        now = reactor.seconds()
        samples.append(max(0.0, now - expected[0]))
        expected[0] = now + interval

    loop = LoopingCall(tick)
    loop.clock = reactor
    loop.start(interval, now=False)
    try:
        await work()
    finally:
        loop.stop()
    return samples


async def bench_pull(reactor: Any, rig: Rig, big_mb: int) -> None:
    print(f"\n== timer lateness during a pull of a {big_mb} MB image from the local registry ==")
    registry = require_registry()
    print("  (building and pushing the image...)", flush=True)
    ref = registry.make_layered_image(f"llmport/bench-{big_mb}mb:1", big_mb * 1024 * 1024)
    rig.env.remove_image(ref)
    frames: list[dict[str, Any]] = []
    elapsed: list[float] = []

    async def pull() -> None:
        t0 = reactor.seconds()
        await rig.manager.images.pull(parse_image_ref(ref), lambda m, **kw: frames.append(kw))
        elapsed.append(reactor.seconds() - t0)

    during = await _lateness(reactor, pull)

    async def idle() -> None:
        await deferLater(reactor, max(1.0, elapsed[0]), lambda: None)

    base = await _lateness(reactor, idle)
    rig.env.remove_image(ref)
    print(f"  pull took {elapsed[0]:.1f} s, {len(frames)} progress reports")
    print(
        f"  lateness during pull    p50 {percentile(during, 50) * 1000:6.1f} ms  "
        f"p99 {percentile(during, 99) * 1000:6.1f} ms  max {max(during) * 1000:6.1f} ms  "
        f"n={len(during)}   (target p99 <= 50 ms)"
    )
    print(
        f"  baseline (no pull)      p50 {percentile(base, 50) * 1000:6.1f} ms  "
        f"p99 {percentile(base, 99) * 1000:6.1f} ms  max {max(base) * 1000:6.1f} ms  n={len(base)}"
    )


async def bench_idle(reactor: Any, rig: Rig, count: int, seconds: float) -> None:
    print(f"\n== engine calls per minute at idle with {count} managed workloads ==")
    payloads = [httpd_payload() for _ in range(count)]
    for p in payloads:
        await rig.run("deploy_workload", p)
    assert rig.watcher is not None
    await rig.watcher.reconcile()
    await deferLater(reactor, 1.0, lambda: None)
    before = rig.engine.calls
    await deferLater(reactor, seconds, lambda: None)
    calls = rig.engine.calls - before
    print(f"  {calls} engine HTTP requests in {seconds:.0f} s = {calls / seconds * 60:.1f} per minute")
    print(f"  (a 30 s poll inspecting each workload would make {count * 2 + 2} per minute)")
    for p in payloads:
        await rig.run("remove_workload", ids_of(p))


async def main(reactor: Any, argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--big-mb", type=int, default=200)
    parser.add_argument("--workloads", type=int, default=20)
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--skip", action="append", default=[], choices=["deploy", "logs", "pull", "idle"])
    args = parser.parse_args(argv)
    try:
        env = require_docker()
    except Exception as exc:  # SkipTest or a failure: say why and stop
        print(f"Docker test engine unavailable: {exc}")
        return
    rig = Rig(reactor, env, health=True, readiness_interval_sec=0.05)
    await rig.start()
    try:
        if "deploy" not in args.skip:
            await bench_deploy(reactor, rig, args.repeats)
        if "logs" not in args.skip:
            await bench_logs(reactor, rig, args.repeats)
        if "pull" not in args.skip:
            await bench_pull(reactor, rig, args.big_mb)
        if "idle" not in args.skip:
            await bench_idle(reactor, rig, args.workloads, args.idle_seconds)
    finally:
        await rig.stop()
        env.remove_all_containers()


if __name__ == "__main__":
    react(lambda reactor: ensureDeferred(main(reactor, sys.argv[1:])))
