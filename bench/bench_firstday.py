"""
Issue 9 figures, each with a baseline measured in the same run:

 - re-enrollment: a node deleted while connected, then the agent restarted with a fresh token:
   restart -> connected again; baseline: a brand-new agent's first enrollment -> connected;
 - stop: SIGTERM -> process exit of a real agent whose enrollment request hangs
   (REQUEST_TIMEOUT_SEC=120); baseline: SIGTERM of an idle connected agent;
 - heartbeat on change: a heartbeat field changes on the node (maintenance on/off, set
   locally: the same path as the engine's availability or GPU health) -> the backend's node
   status follows; baseline: the same with the on-change heartbeat switched off (the next
   periodic one, HEARTBEAT_INTERVAL_SEC=5).

Usage: python3 bench/bench_firstday.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import ROOT, summary  # noqa: E402
from twisted.internet import defer, task  # noqa: E402

from llmport_agent.agent.service import AgentService
from llmport_agent.core.config import load_config
from llmport_agent.devbackend import DevBackend  # noqa: E402
from llmport_agent.inventory.gpu import NoGPUSource  # noqa: E402


def env_for(backend: DevBackend, state_dir: str, agent_id: str, **extra: str) -> dict[str, str]:
    values = {
        "BACKEND_URL": backend.url, "AGENT_ID": agent_id, "HOST": "127.0.0.1",
        "STATE_PATH": os.path.join(state_dir, "state.json"), "MODEL_STORE": os.path.join(state_dir, "m"),
        "OPS_PORT": "0", **extra,
    }
    return {"LLM_PORT_NODE_AGENT_" + k: v for k, v in values.items()}


def agent(reactor: Any, backend: DevBackend, state_dir: str, agent_id: str, **extra: str) -> AgentService:
    config = load_config(env_for(backend, state_dir, agent_id, **extra), {})
    svc = AgentService(reactor, config, fatal=lambda c, m: None, gpu_source=NoGPUSource(),
                       docker_enabled=False)
    svc.startService()
    return svc


async def reenroll(reactor: Any, backend: DevBackend, n: int) -> tuple[list[float], list[float]]:
    fresh, again = [], []
    for i in range(n):
        d = tempfile.mkdtemp(prefix="bench-fd-")
        start = reactor.seconds()
        a = agent(reactor, backend, d, f"bench-{i}", ENROLLMENT_TOKEN=backend.mint_token()["token"])
        await backend.wait_for(lambda a=a: a.session.connected, 30)
        fresh.append(reactor.seconds() - start)
        node_id = a.session.node_id
        backend.delete_node(node_id)
        await backend.wait_for(lambda a=a: a.session.stats.refused >= 1, 30)
        await a.stopService()
        start = reactor.seconds()
        b = agent(reactor, backend, d, f"bench-{i}", ENROLLMENT_TOKEN=backend.mint_token()["token"])
        await backend.wait_for(lambda b=b: b.session.connected, 60)
        again.append(reactor.seconds() - start)
        await b.stopService()
    return fresh, again


async def heartbeat_on_change(reactor: Any, backend: DevBackend, n: int, on_change: bool) -> list[float]:
    """A heartbeat field changes on the node (maintenance on/off) -> the backend's node status follows."""
    d = tempfile.mkdtemp(prefix="bench-fd-")
    a = agent(reactor, backend, d, f"hb-{on_change}", HEARTBEAT_INTERVAL_SEC="5",
              ENROLLMENT_TOKEN=backend.mint_token()["token"])
    await backend.wait_for(lambda: a.session.connected, 30)
    if not on_change:
        a.heartbeat.notify_changed = lambda: None  # type: ignore[method-assign]
    node_id = a.session.node_id
    out = []
    for i in range(n):
        on = i % 2 == 0
        wanted = "maintenance" if on else "healthy"
        await task.deferLater(reactor, 1.2, lambda: None)  # past min_change_gap
        start = reactor.seconds()
        await a.modes.set(maintenance=on)
        await backend.wait_for(lambda w=wanted: (backend.node(node_id) or {}).get("status") == w, 30)
        out.append(reactor.seconds() - start)
    await a.stopService()
    return out


def sigterm_exit(backend_url: str, token: str, d: str, wait_for: Any) -> float:
    env = dict(os.environ, PYTHONPATH=ROOT, DOCKER_HOST="unix:///nonexistent/bench/docker.sock",
               LLM_PORT_NODE_AGENT_BACKEND_URL=backend_url, LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN=token,
               LLM_PORT_NODE_AGENT_STATE_PATH=os.path.join(d, "state.json"),
               LLM_PORT_NODE_AGENT_MODEL_STORE=os.path.join(d, "m"), LLM_PORT_NODE_AGENT_OPS_PORT="0",
               LLM_PORT_NODE_AGENT_AGENT_ID=os.path.basename(d), LLM_PORT_NODE_AGENT_REQUEST_TIMEOUT_SEC="120")
    proc = subprocess.Popen([sys.executable, "-m", "llmport_agent.cli", "run"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for()
        time.sleep(0.3)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        return time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stop_figures(n: int) -> tuple[list[float], list[float]]:
    """Against a devbackend child process (the agent is a child too: both off this reactor)."""
    from _common import DevBackendProcess

    hanging, idle = [], []
    backend = DevBackendProcess()
    try:
        for i in range(n):
            d = tempfile.mkdtemp(prefix=f"bench-stop-{i}-")
            before = len(backend.get("/dev/nodes"))
            idle.append(sigterm_exit(backend.url, backend.token(), d,
                                     lambda b=before: _poll(lambda: len(backend.get("/dev/nodes")) > b)))
    finally:
        backend.stop()
    return hanging, idle


def _poll(predicate: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.05)


async def hanging_stop(reactor: Any, backend: DevBackend, n: int) -> list[float]:
    from twisted.internet import threads

    backend.faults.hang_enroll = True
    out = []
    try:
        for i in range(n):
            d = tempfile.mkdtemp(prefix=f"bench-hang-{i}-")
            seen = backend.enroll_requests
            out.append(await threads.deferToThread(
                sigterm_exit, backend.url, backend.mint_token()["token"], d,
                lambda s=seen: _poll(lambda: backend.enroll_requests > s)))
    finally:
        backend.faults.hang_enroll = False
    return out


async def main(reactor: Any, repeat: int) -> None:
    backend = DevBackend(reactor)
    await backend.listen(0, "127.0.0.1")
    try:
        fresh, again = await reenroll(reactor, backend, repeat)
        print(f"first enrollment -> connected (baseline):          {summary(fresh, ' s')}")
        print(f"deleted node, restart with a fresh token -> connected: {summary(again, ' s')}")
        hang = await hanging_stop(reactor, backend, repeat)
    finally:
        await backend.stop()
    _, idle = stop_figures(repeat)
    print(f"SIGTERM -> exit, idle connected agent (baseline):  {summary(idle, ' s')}")
    print(f"SIGTERM -> exit, enrollment hanging (timeout 120 s): {summary(hang, ' s')}")
    backend = DevBackend(reactor)
    await backend.listen(0, "127.0.0.1")
    try:
        base = await heartbeat_on_change(reactor, backend, repeat * 2, on_change=False)
        fast = await heartbeat_on_change(reactor, backend, repeat * 2, on_change=True)
    finally:
        await backend.stop()
    print(f"field change -> node status, periodic heartbeat only (5 s, baseline): {summary(base, ' s')}")
    print(f"field change -> node status, heartbeat on change:                    {summary(fast, ' s', 3)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, args.repeat)))
