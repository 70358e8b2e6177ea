"""
How long the agent process lives after its "llmport-agent stopped" line.

A real `llmport-agent run` against the stand-in backend (both on loopback), connected and
idle, gets SIGTERM; its stdout is read line by line as it comes, and the script prints the
time from SIGTERM to the "stopped" line and from that line to the process's exit (median and
spread over the runs). The goal is under 0.5 s from "stopped" to exit.

    PYTHONPATH=$PWD python3 bench/bench_stop_exit.py [runs] [--docker] [--loki]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import ROOT, DevBackendProcess, summary  # noqa: E402


def one_run(backend: DevBackendProcess, state_dir: str, extra: dict[str, str]) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.update({
        "LLM_PORT_NODE_AGENT_BACKEND_URL": backend.url,
        "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN": backend.token(),
        "LLM_PORT_NODE_AGENT_AGENT_ID": "bench-" + uuid.uuid4().hex[:8],
        "LLM_PORT_NODE_AGENT_HOST": "127.0.0.1",
        "LLM_PORT_NODE_AGENT_STATE_PATH": os.path.join(state_dir, "state.json"),
        "LLM_PORT_NODE_AGENT_MODEL_STORE": os.path.join(state_dir, "models"),
        "LLM_PORT_NODE_AGENT_OPS_PORT": "0",
        "LLM_PORT_NODE_AGENT_LOG_FORMAT": "json",
    })
    env.update(extra)
    proc = subprocess.Popen([sys.executable, *(os.environ.get("BENCH_AGENT_ARGV") or "-m llmport_agent.cli run").split()], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: dict[str, float] = {}
    connected = threading.Event()

    def reader() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace")
            if "Connected to the backend stream" in line:
                connected.set()
            if line.startswith("TIMING"):
                sys.stderr.write(line)
            if "llmport-agent stopped" in line:
                seen.setdefault("stopped", time.monotonic())

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        if not connected.wait(60):
            raise RuntimeError("the agent did not connect")
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        exited = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    thread.join(5)
    if "stopped" not in seen:
        raise RuntimeError("no 'stopped' line")
    return seen["stopped"] - sent, exited - seen["stopped"]


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    runs = int(args[0]) if args else 5
    extra: dict[str, str] = {}
    if "--docker" in sys.argv:
        # A private engine (tests/support/docker_env.py), so the Docker executor, the workload
        # watcher's event stream and the container log reader run as on a real node.
        from tests.support.docker_env import require_docker

        extra["DOCKER_HOST"] = require_docker().host
    if "--loki" in sys.argv:
        from bench._common import free_port

        extra["LLM_PORT_NODE_AGENT_LOKI_URL"] = f"http://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as tmp:
        backend = DevBackendProcess()
        try:
            to_stopped: list[float] = []
            to_exit: list[float] = []
            for i in range(runs):
                d = os.path.join(tmp, f"run{i}")
                os.makedirs(d)
                a, b = one_run(backend, d, extra)
                to_stopped.append(a)
                to_exit.append(b)
        finally:
            backend.stop()
    print(f"SIGTERM -> 'stopped' line: {summary(to_stopped, ' s', 3)}")
    print(f"'stopped' line -> exit:    {summary(to_exit, ' s', 3)}  (goal: under 0.5 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
