"""
Production figures (printed, never asserted), each against a baseline of the same run:

 - the standalone executable: size, and start-up (process launch -> first heartbeat at the
   stand-in backend) against the same agent from the Python install (`python -m
   llmport_agent.cli run`);
 - SIGTERM -> exit: idle, and during a running deploy (needs root and the Debian Docker
   packages, as the tests do; the deploy's workload answers its health path 5 s after start);
 - /metrics scrape time and size with 8 (fake NVML) GPUs and 20 workloads, against /healthz;
 - `systemd-analyze security` exposure of the previous unit, the unit as committed, and as
   `start --user` writes it.

Usage: python3 bench/bench_prod.py [--repeat 5] [--binary dist/llmport-agent] [--scrapes 200]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import ROOT, DevBackendProcess, summary  # noqa: E402


def agent_env(backend: DevBackendProcess, state_dir: str, agent_id: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=ROOT)  # this checkout, not another install
    env.update({
        "LLM_PORT_NODE_AGENT_BACKEND_URL": backend.url,
        "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN": backend.token(),
        "LLM_PORT_NODE_AGENT_AGENT_ID": agent_id,
        "LLM_PORT_NODE_AGENT_HOST": "127.0.0.1",
        "LLM_PORT_NODE_AGENT_STATE_PATH": os.path.join(state_dir, "state.json"),
        "LLM_PORT_NODE_AGENT_MODEL_STORE": os.path.join(state_dir, "models"),
        "LLM_PORT_NODE_AGENT_OPS_PORT": "0",
    })
    env.update({"LLM_PORT_NODE_AGENT_" + k: v for k, v in extra.items()})
    return env


def node_of(backend: DevBackendProcess, agent_id: str) -> dict[str, Any] | None:
    for node in backend.get("/dev/nodes"):
        if node.get("agent_id") == agent_id:
            return dict(node)
    return None


def wait(predicate: Any, timeout: float, step: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return False


def start_and_term(backend: DevBackendProcess, args: list[str], work: str, **extra: str) -> tuple[float, float, subprocess.Popen[bytes], str]:
    """(seconds to the first heartbeat, seconds from SIGTERM to exit, process, node id)."""
    agent_id = "bench-" + uuid.uuid4().hex[:8]
    d = tempfile.mkdtemp(dir=work)
    env = agent_env(backend, d, agent_id, **extra)
    log = open(os.path.join(d, "agent.log"), "wb")
    started = time.monotonic()
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=d)
    ok = wait(lambda: (node_of(backend, agent_id) or {}).get("status") in ("healthy", "degraded"), 60)
    first = time.monotonic() - started if ok else float("nan")
    node = node_of(backend, agent_id) or {}
    return first, 0.0, proc, str(node.get("id", ""))


def term(proc: subprocess.Popen[bytes]) -> float:
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return time.monotonic() - t


def startup(backend: DevBackendProcess, binary: str | None, repeat: int, work: str) -> None:
    modes = [("python install", [sys.executable, "-m", "llmport_agent.cli", "run"])]
    if binary:
        size = os.path.getsize(binary)
        print(f"binary {binary}: {size / 1e6:.1f} MB")
        modes.insert(0, ("binary", [binary, "run"]))
    else:
        print("binary: not built (packaging/build-binary), skipped")
    exits: list[float] = []
    for name, args in modes:
        firsts = []
        for _ in range(repeat):
            first, _, proc, _ = start_and_term(backend, args, work)
            try:
                firsts.append(first)
                exits.append(term(proc))
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        print(f"start-up to the first heartbeat, {name:<14}: {summary(firsts, ' s')}")
    print(f"SIGTERM -> exit, idle agent:                  {summary(exits, ' s')}")


def sigterm_during_deploy(backend: DevBackendProcess, repeat: int, work: str) -> None:
    try:
        from tests.support.docker_env import require_docker
        from tests.support.rig import httpd_payload

        docker = require_docker()
    except Exception as e:  # SkipTest and friends
        print(f"SIGTERM -> exit during a deploy: skipped ({e})")
        return
    values, remaining = [], []
    os.environ["DOCKER_HOST"] = docker.host  # for the agents started below
    for _ in range(repeat):
        first, _, proc, node_id = start_and_term(
            backend, [sys.executable, "-m", "llmport_agent.cli", "run"], work,
            WORKLOAD_NETWORK="host", SHUTDOWN_GRACE_SEC="60")
        try:
            _deploy_and_term(backend, docker, proc, node_id, values, remaining, httpd_payload)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    print(f"SIGTERM -> exit during a running deploy:      {summary(values, ' s')} "
          "(includes the rest of the deploy: its workload answers 5 s after start)")


def _deploy_and_term(backend: DevBackendProcess, docker: Any, proc: subprocess.Popen[bytes], node_id: str,
                 values: list[float], remaining: list[float], httpd_payload: Any) -> None:
    payload = httpd_payload(script="sleep 5; mkdir -p /www && echo ok > /www/health && "
                                   "exec httpd -f -p $LLAMA_ARG_PORT -h /www")
    cmd = backend.post(f"/dev/nodes/{node_id}/commands",
                       {"command_type": "deploy_workload", "payload": payload})
    timeline = f"/dev/commands/{cmd['id']}/timeline"
    wait(lambda t=timeline: any(e.get("event_type") == "progress"
                                and (e.get("payload") or {}).get("phase") == "start_container"
                                for e in backend.get(t)), 60, 0.02)
    sent = time.monotonic()
    values.append(term(proc))
    status = backend.get(f"/dev/commands/{cmd['id']}")["status"]
    done_at = time.monotonic()
    remaining.append(done_at - sent)
    if status != "succeeded":
        record = backend.get(f"/dev/commands/{cmd['id']}")
        print(f"  deploy ended {status}: {record.get('error_message')}")
    client = docker.client()
    for c in client.containers.list(all=True, filters={"label": f"io.llmport.runtime-id={payload['runtime_id']}"}):
        c.remove(force=True)


def scrape(scrapes: int) -> None:
    """In process: an agent with 8 fake GPUs and 20 workloads; /metrics against /healthz."""
    import treq
    from twisted.internet import task

    from llmport_agent.agent.service import AgentService
    from llmport_agent.core.config import load_config
    from llmport_agent.devbackend import DevBackend
    from llmport_agent.inventory.nvml import NVMLGPUSource
    from llmport_agent.ops.endpoint import OpsService
    from tests.agentharness import agent_env as test_env
    from tests.test_ops import _Health, fake_gpus

    async def run(reactor: Any) -> None:
        backend = DevBackend(reactor)
        await backend.listen(0, "127.0.0.1")
        d = tempfile.mkdtemp(prefix="bench-metrics-")
        config = load_config(test_env(backend, d, ENROLLMENT_TOKEN=backend.mint_token()["token"]), {})
        agent = AgentService(reactor, config, fatal=lambda *a: None,
                             gpu_source=NVMLGPUSource(fake_gpus(8)), docker_enabled=False)
        agent.health = _Health(20)
        agent.startService()
        while not (agent.session.connected and agent.inventory.sent):
            await task.deferLater(reactor, 0.05, lambda: None)
        ops = OpsService(reactor, agent, 0)
        ops.startService()
        while ops._listening is None:
            await task.deferLater(reactor, 0.01, lambda: None)
        base = f"http://127.0.0.1:{ops._listening.getHost().port}"
        from twisted.web.client import HTTPConnectionPool

        pool = HTTPConnectionPool(reactor)
        figures: dict[str, list[float]] = {"/metrics": [], "/healthz": []}
        size = 0
        for _ in range(scrapes):
            for path in ("/healthz", "/metrics"):
                t = time.perf_counter()
                response = await treq.get(base + path, pool=pool)
                body = await response.content()
                figures[path].append((time.perf_counter() - t) * 1000)
                if path == "/metrics":
                    size = len(body)
        print(f"/metrics (8 GPUs, 20 workloads): {size / 1000:.1f} KB, {summary(figures['/metrics'], ' ms')}")
        print(f"/healthz (baseline, same run):   {summary(figures['/healthz'], ' ms')}")
        await pool.closeCachedConnections()
        await ops.stopService()
        await agent.stopService()
        await backend.stop()
        shutil.rmtree(d, ignore_errors=True)

    task.react(lambda reactor: __import__("twisted.internet.defer", fromlist=["x"]).Deferred.fromCoroutine(run(reactor)))


def exposure() -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        print("systemd-analyze: not installed, exposure skipped")
        return
    from llmport_agent.host.installer import render_unit, unit_template

    d = tempfile.mkdtemp(prefix="bench-unit-")
    units = {}
    for rev in ("54c51f0:llmport_agent/data/llmport-agent.service",):
        try:
            units["previous unit (54c51f0)"] = subprocess.run(
                ["git", "show", rev], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        except (subprocess.CalledProcessError, OSError):
            pass
    units["committed unit (root)"] = unit_template()
    units["start --user llmport"] = render_unit(unit_template(), executable="/usr/local/bin/llmport-agent",
                                                one_process=True, model_store="/srv/llm-port/models",
                                                state_dir="/var/lib/llmport-agent", user="llmport",
                                                group="llmport", supplementary=("docker",))
    for name, text in units.items():
        path = os.path.join(d, "llmport-agent.service")
        with open(path, "w") as f:
            f.write(text)
        out = subprocess.run([analyze, "security", "--offline=yes", path], capture_output=True, text=True)
        last = [line for line in out.stdout.splitlines() if "Overall exposure level" in line]
        score = last[-1].split(":", 1)[1].strip() if last else out.stderr.strip()[:100]
        print(f"systemd-analyze security, {name:<22}: {score}")
    shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--binary", default=os.path.join(ROOT, "dist", "llmport-agent"))
    p.add_argument("--scrapes", type=int, default=200)
    p.add_argument("--skip-deploy", action="store_true")
    args = p.parse_args()
    print(f"load: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} cores")
    exposure()
    work = tempfile.mkdtemp(prefix="bench-prod-")
    backend = DevBackendProcess()
    import threading

    # Its log goes to a pipe: drain it, or the child blocks once the pipe is full.
    threading.Thread(target=lambda: [None for _ in backend.proc.stdout or ()], daemon=True).start()
    try:
        binary = args.binary if os.path.exists(args.binary) else None
        startup(backend, binary, args.repeat, work)
        if not args.skip_deploy:
            sigterm_during_deploy(backend, max(1, args.repeat // 2), work)
    finally:
        backend.stop()
        shutil.rmtree(work, ignore_errors=True)
    scrape(args.scrapes)


if __name__ == "__main__":
    main()
