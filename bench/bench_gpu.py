"""
GPU health figures (issue 13), against the faithful NVML fake (8 x H100):

 1. inventory collection time for 8 GPUs with health: a full snapshot on NVML's watchdog
    threads, and a health check; baseline: the same snapshot run inline (no watchdog threads);
 2. time from an injected Xid to the degraded heartbeat at the stand-in backend (agent and
    backend in one process, real loopback sockets, the fake's nvmlEventSetWait really
    blocking), with no heartbeat in the last second and 0.2 s after one (heartbeats on change
    are rate-limited to one a second); baseline: the heartbeat interval (15 s), which is when
    the degraded status would have left without the heartbeat on change;
 3. with --suites: the workload test suite's wall time on Docker and on Podman (the same test
    classes, tests.test_workloads_docker vs. their Podman re-run).

Usage: python3 bench/bench_gpu.py [--snapshots 200] [--xids 10] [--suites]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import ROOT, summary  # noqa: E402
from twisted.internet.defer import Deferred  # noqa: E402
from twisted.internet.task import deferLater, react  # noqa: E402

from llmport_agent.agent.service import AgentService
from llmport_agent.core.config import load_config
from llmport_agent.devbackend import DevBackend  # noqa: E402
from llmport_agent.inventory.fakes import h100_node  # noqa: E402
from llmport_agent.inventory.nvml import NVMLGPUSource  # noqa: E402
from llmport_agent.inventory.watchdog import WatchdogPool  # noqa: E402


def collection(n: int) -> None:
    watched = NVMLGPUSource(h100_node())
    inline = NVMLGPUSource(h100_node(), pool=WatchdogPool("inline", synchronous=True))
    for source in (watched, inline):
        source.snapshot()  # init
    rows = []
    for label, fn in (
        ("snapshot, 8 GPUs with health, watchdog threads", watched.snapshot),
        ("baseline: the same snapshot inline (no watchdog)", inline.snapshot),
        ("health check only, 8 GPUs, watchdog threads", watched.check_health),
    ):
        times = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1000)
        rows.append((label, summary(times, " ms")))
    print("1. inventory collection (fake NVML, 8 x H100)")
    for label, text in rows:
        print(f"   {label}: {text}")
    watched.close()
    inline.close()


async def xid_to_heartbeat(reactor: Any, rounds: int) -> None:
    fake = h100_node()  # nvmlEventSetWait blocks for real
    backend = DevBackend(reactor)
    await backend.listen(0, "127.0.0.1")
    state = tempfile.mkdtemp(prefix="bench-gpu-")
    env = {
        "LLM_PORT_NODE_AGENT_BACKEND_URL": backend.url,
        "LLM_PORT_NODE_AGENT_AGENT_ID": "bench-gpu",
        "LLM_PORT_NODE_AGENT_HOST": "127.0.0.1",
        "LLM_PORT_NODE_AGENT_STATE_PATH": os.path.join(state, "state.json"),
        "LLM_PORT_NODE_AGENT_MODEL_STORE": os.path.join(state, "models"),
        "LLM_PORT_NODE_AGENT_OPS_PORT": "0",
        "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN": backend.mint_token("bench")["token"],
    }
    config = load_config(env, {})
    agent = AgentService(reactor, config, gpu_source=NVMLGPUSource(fake), docker_enabled=False)
    agent.startService()
    await backend.wait_for(lambda: agent.session.node_id is not None and agent.session.connected, 20)
    node_id = agent.session.node_id
    assert node_id is not None
    await backend.wait_for(lambda: fake.event_sets == 1, 20)
    # Heartbeats on change go out at most one per HeartbeatReporter.min_change_gap (1 s): an
    # Xid right after another heartbeat (the recovery's) waits for the rest of that gap.
    delays: dict[str, list[float]] = {"quiet": [], "after": []}
    for r in range(rounds):
        gpu = r % 8
        kind = "quiet" if r % 2 == 0 else "after"
        if kind == "quiet":
            await deferLater(reactor, agent.heartbeat.min_change_gap + 0.1, lambda: None)
        seen = len(backend.frames(node_id))
        injected = time.monotonic()
        fake.inject_xid(gpu, 79)
        fake.gpus[gpu].lost = True

        def degraded(seen: int = seen) -> bool:
            return any(
                f.get("type") == "heartbeat" and f.get("status") == "degraded"
                for f in backend.frames(node_id)[seen:]
            )

        await backend.wait_for(degraded, 20)
        delays[kind].append(time.monotonic() - injected)
        # The next check sees the GPU lost; a reset then shows as it answering again.
        agent.gpu_monitor.check_now()
        await backend.wait_for(
            lambda gpu=gpu: any("lost" in r for r in agent.gpu_source.health()[gpu].reasons), 20
        )
        fake.reset_gpu(gpu)
        agent.gpu_monitor.check_now()
        await backend.wait_for(lambda: backend.node(node_id)["status"] == "healthy", 20)
        await deferLater(reactor, 0.2, lambda: None)
    print("2. injected Xid 79 -> degraded heartbeat at the backend (target <= 2 s)")
    print(f"   no heartbeat in the last second: {summary([d * 1000 for d in delays['quiet']], ' ms')}")
    print(f"   0.2 s after the previous heartbeat (rate limit of 1 s): "
          f"{summary([d * 1000 for d in delays['after']], ' ms')}")
    print(f"   baseline without the immediate heartbeat: up to {config.heartbeat_interval_sec:g} s (the interval)")
    await agent.stopService()
    await backend.stop()


def suites() -> None:
    print("3. workload test suite, wall time (same test classes)")
    docker_classes = ["DeployTests", "LifecycleTests", "UpdateTests", "LogsTests", "EngineOutageTests",
                      "EarlyPortConflictTests"]
    runs = [
        ("Docker", [f"tests.test_workloads_docker.{c}" for c in docker_classes]),
        ("Podman", [f"tests.test_workloads_podman.Podman{c}" for c in docker_classes]),
    ]
    for label, targets in runs:
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "twisted.trial", "--temp-directory",
             os.path.join(tempfile.gettempdir(), f"bench-trial-{os.getpid()}-{label.lower()}"),
             *targets],
            cwd=ROOT, capture_output=True, text=True, check=False,
        )
        elapsed = time.monotonic() - start
        last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-200:]
        print(f"   {label}: {elapsed:.1f} s ({last})")


def main(reactor: Any, args: argparse.Namespace) -> Any:
    collection(args.snapshots)
    d = Deferred.fromCoroutine(xid_to_heartbeat(reactor, args.xids))
    if args.suites:
        d.addCallback(lambda _: suites())
    return d


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--snapshots", type=int, default=200)
    parser.add_argument("--xids", type=int, default=10)
    parser.add_argument("--suites", action="store_true")
    args = parser.parse_args()
    react(main, [args])
