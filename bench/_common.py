"""Shared helpers for the benchmark scripts (processes on loopback, statistics)."""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def summary(values: list[float], unit: str = "", digits: int = 2) -> str:
    if not values:
        return "n/a"
    ordered = sorted(values)
    med = statistics.median(ordered)
    p95 = ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return (f"median {med:.{digits}f}{unit}, p95 {p95:.{digits}f}{unit}, p99 {p99:.{digits}f}{unit}, "
            f"min {ordered[0]:.{digits}f}{unit}, max {ordered[-1]:.{digits}f}{unit} (n={len(ordered)})")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class DevBackendProcess:
    """`llmport-agent devbackend` in a child process on a free loopback port."""

    def __init__(self, log_path: str | None = None, **opts: Any) -> None:
        self.port = free_port()
        args = [sys.executable, "-m", "llmport_agent.cli", "devbackend", "--port", str(self.port)]
        for k, v in opts.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        # Its output goes to a file (or nowhere): a pipe nobody reads fills up and stalls it.
        out: Any = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONPATH=ROOT))
        if log_path:
            out.close()
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                self.get("/dev/nodes")
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("devbackend did not start")

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def token(self) -> str:
        return str(self.post("/api/admin/system/nodes/enrollment-tokens", {"note": "bench"})["token"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class AgentProcess:
    """`llmport-agent run` in a child process against a backend."""

    def __init__(self, backend_url: str, token: str, state_dir: str, agent_id: str, **env: str) -> None:
        full = dict(os.environ, PYTHONPATH=ROOT)
        full.update({
            "LLM_PORT_NODE_AGENT_BACKEND_URL": backend_url,
            "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN": token,
            "LLM_PORT_NODE_AGENT_AGENT_ID": agent_id,
            "LLM_PORT_NODE_AGENT_HOST": "127.0.0.1",
            "LLM_PORT_NODE_AGENT_STATE_PATH": os.path.join(state_dir, "state.json"),
            "LLM_PORT_NODE_AGENT_MODEL_STORE": os.path.join(state_dir, "models"),
            "LLM_PORT_NODE_AGENT_OPS_PORT": "0",
        })
        full.update({"LLM_PORT_NODE_AGENT_" + k: v for k, v in env.items()})
        self.log_path = os.path.join(state_dir, "agent.log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "llmport_agent.cli", "run"], cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT, env=full)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return int(self.proc.returncode)
