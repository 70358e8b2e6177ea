"""
Ray benchmark (issue 19): time from C{start_ray_head} to a C{get_ray_status} that shows 2
alive nodes, on loopback. Prints figures; asserts nothing.

Two agents (in this process) on one private Docker engine (started like the tests do; needs
root and the Ray test image, which C{tests/support/rayimage/build.sh} builds and caches),
driven by the stand-in backend: per repeat, the runtime containers are made ready (not
timed), then C{start_ray_head} is issued, C{join_ray_cluster} follows its result, and
C{get_ray_status} is issued back to back until it answers 2 nodes. Split: start, join,
first 2-node status.

Baseline, same run, same containers: the same three steps as plain C{docker exec} (C{ray start
--head}, C{ray start --address}, the helper's C{cluster-status} until 2 nodes) with nothing
of the agent in between. The difference is what the agent (token fetch, idempotency checks,
command round trips) adds.

Usage: python3 bench/bench_ray.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twisted.internet.defer import Deferred, ensureDeferred  # noqa: E402
from twisted.internet.task import react  # noqa: E402
from twisted.internet.threads import deferToThread  # noqa: E402

from bench._common import free_port  # noqa: E402
from llmport_agent.agent.service import AgentService
from llmport_agent.core.config import load_config
from llmport_agent.devbackend import DevBackend  # noqa: E402
from llmport_agent.devbackend.rayenv import TERMINAL, RayEnvironment, RayNode  # noqa: E402
from llmport_agent.inventory.gpu import NoGPUSource  # noqa: E402
from llmport_agent.ray.imagepin import rootfs_digest  # noqa: E402
from tests.support.docker_env import require_docker  # noqa: E402
from tests.support.ray_env import IMAGE, import_ray_image, require_ray_image  # noqa: E402

HEAD, WORKER = "llm-port-ray-runtime", "llm-port-ray-runtime-worker"


def fmt(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"median {statistics.median(values):6.2f} s  [{min(values):.2f} .. {max(values):.2f}]  n={len(values)}"


def docker(host: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", "-H", host, *args], capture_output=True, text=True, timeout=timeout)


def baseline(host: str, port: int, token_path: str) -> dict[str, float]:
    """The three steps as plain docker exec (blocking; runs in a thread)."""
    env = ["-e", "RAY_AUTH_MODE=token", "-e", f"RAY_AUTH_TOKEN_PATH={token_path}"]
    t0 = time.monotonic()
    r = docker(host, "exec", *env, HEAD, "ray", "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.2",
               "--include-dashboard=false", "--num-cpus=1", "--disable-usage-stats")
    if r.returncode != 0:
        raise RuntimeError(f"baseline ray start --head failed: {r.stderr[-400:]}")
    t1 = time.monotonic()
    r = docker(host, "exec", *env, WORKER, "ray", "start", f"--address=127.0.0.2:{port}",
               "--node-ip-address=127.0.0.3", "--num-cpus=1", "--disable-usage-stats")
    if r.returncode != 0:
        raise RuntimeError(f"baseline ray start --address failed: {r.stderr[-400:]}")
    t2 = time.monotonic()
    deadline = t2 + 90
    while time.monotonic() < deadline:
        r = docker(host, "exec", HEAD, "llm-port-ray-runtime", "cluster-status", timeout=60)
        doc: dict[str, Any] = next((json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")), {})
        if doc.get("num_nodes") == 2:
            break
    t3 = time.monotonic()
    for name in (WORKER, HEAD):
        docker(host, "exec", name, "ray", "stop", "--force")
    return {"start": t1 - t0, "join": t2 - t1, "status": t3 - t2, "total": t3 - t0}


async def command(backend: DevBackend, node_id: str, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
    cmd = backend.issue_command(node_id, kind, payload, timeout_sec=300)
    await backend.wait_for(lambda: backend.command(cmd["id"])["status"] in TERMINAL, 300)
    rec = dict(backend.command(cmd["id"]))
    if rec["status"] != "succeeded":
        raise RuntimeError(f"{kind}: {rec.get('error_code')}: {rec.get('error_message')}")
    return rec


async def main(reactor: Any, repeats: int) -> None:
    tar = require_ray_image()
    engine = require_docker()
    info = await deferToThread(import_ray_image, engine, tar)
    workdir = tempfile.mkdtemp(prefix="bench-ray-")
    backend = DevBackend(reactor)
    await backend.listen(0, "127.0.0.1")
    agents: list[AgentService] = []
    nodes: list[str] = []
    try:
        for role in ("head", "worker"):
            config = load_config({
                "LLM_PORT_NODE_AGENT_BACKEND_URL": backend.url,
                "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN": backend.mint_token(role)["token"],
                "LLM_PORT_NODE_AGENT_AGENT_ID": f"bench-ray-{role}",
                "LLM_PORT_NODE_AGENT_HOST": "127.0.0.1",
                "LLM_PORT_NODE_AGENT_STATE_PATH": f"{workdir}/{role}/state.json",
                "LLM_PORT_NODE_AGENT_MODEL_STORE": f"{workdir}/{role}/models",
                # One token directory: the baseline's plain docker exec reads the same file.
                "LLM_PORT_NODE_AGENT_RAY_TOKEN_DIR": f"{workdir}/ray-token",
                "LLM_PORT_NODE_AGENT_OPS_PORT": "0",
            }, {})
            agent = AgentService(reactor, config, fatal=lambda c, m: print(m), gpu_source=NoGPUSource(),
                                 docker_enabled=True, docker_environ={"DOCKER_HOST": engine.host})
            agent.startService()
            agents.append(agent)
            await backend.wait_for(lambda a=agent: a.session.node_id is not None, 20)  # type: ignore[misc]
            nodes.append(str(agent.session.node_id))
        await backend.wait_for(lambda: all(a.engine.available for a in agents), 30)
        bundle = {"image": IMAGE, "digest": info["Id"], "rootfs_digest": rootfs_digest(info["RootFS"]["Layers"]),
                  "requirements": {"gpus": "none"}}
        env = RayEnvironment(backend, "bench-" + uuid.uuid4().hex[:6], head=RayNode(nodes[0], "127.0.0.2"),
                             workers=[RayNode(nodes[1], "127.0.0.3", container_name=WORKER)], bundle=bundle)
        backend.add_cluster_secret(env.credential_ref, nodes)
        agent_runs: list[dict[str, float]] = []
        base_runs: list[dict[str, float]] = []
        probes: list[int] = []
        for i in range(repeats):
            for node in env.nodes:
                await command(backend, node.node_id, "ensure_runtime_image",
                              {"runtime_bundle": env.bundle_for(node), "ensure_container": True})
            port = free_port()
            t0 = reactor.seconds()
            await command(backend, nodes[0], "start_ray_head", {
                "credential_ref": env.credential_ref, "port": port, "node_ip_address": "127.0.0.2",
                "include_dashboard": False, "num_cpus": 1, "runtime_bundle": env.bundle_for(env.head)})
            t1 = reactor.seconds()
            await command(backend, nodes[1], "join_ray_cluster", {
                "credential_ref": env.credential_ref, "head_address": f"127.0.0.2:{port}",
                "node_ip_address": "127.0.0.3", "num_cpus": 1, "runtime_bundle": env.bundle_for(env.workers[0])})
            t2 = reactor.seconds()
            n = 0
            while True:
                n += 1
                rec = await command(backend, nodes[0], "get_ray_status", {"include_serve": False})
                if rec["result"].get("num_nodes") == 2 or reactor.seconds() - t2 > 90:
                    break
            t3 = reactor.seconds()
            probes.append(n)
            agent_runs.append({"start": t1 - t0, "join": t2 - t1, "status": t3 - t2, "total": t3 - t0})
            # Baseline in the same containers (Ray stopped by the agent first, token kept).
            for name in (WORKER, HEAD):
                await deferToThread(docker, engine.host, "exec", name, "ray", "stop", "--force")
            base_runs.append(await deferToThread(baseline, engine.host, free_port(),
                                                 agents[0].ray.tokens.path))
            print(f"  repeat {i + 1}/{repeats}: agent {agent_runs[-1]['total']:.2f} s, "
                  f"plain docker exec {base_runs[-1]['total']:.2f} s", flush=True)
        await command(backend, nodes[1], "leave_ray_cluster", {"runtime_bundle": env.bundle_for(env.workers[0])})
        await command(backend, nodes[0], "stop_ray", {"force": True, "runtime_bundle": env.bundle_for(env.head)})
        print(f"\nstart_ray_head -> get_ray_status with 2 alive nodes, loopback (head 127.0.0.2, worker 127.0.0.3), "
              f"{repeats} repeats, Ray 2.58.0 in the test bundle image")
        for key, label in (("start", "start_ray_head"), ("join", "join_ray_cluster"),
                           ("status", "status until 2 nodes"), ("total", "total")):
            print(f"  {label:<22} agent    {fmt([r[key] for r in agent_runs])}")
            print(f"  {'':<22} baseline {fmt([r[key] for r in base_runs])}")
        print(f"  get_ray_status probes until 2 nodes: {probes}")
    finally:
        for agent in agents:
            await agent.stopService()
        await backend.stop()
        for name in (HEAD, WORKER):
            docker(engine.host, "rm", "-f", name)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    def run(reactor: Any) -> Deferred[None]:
        return ensureDeferred(main(reactor, args.repeats))

    react(run)
