"""
What a flood of pipelined requests on the ops endpoint costs the agent (issue 29.3).

An agent runs against the stand-in backend with its ops endpoint on loopback. Two windows:
idle (nobody but the probe), then a flood: C{--connections} clients (64) each writing
C{--ahead} KiB (64) of pipelined C{GET /metrics} and never reading, reconnecting whenever the
agent drops them. Throughout, a probe asks C{/healthz} every 0.2 s on its own connection. For
each window it prints the probe's answer times, the agent's reactor lateness (its own
C{llmport_agent_reactor_lateness_seconds} histogram over the window), its RSS (peak and at the
end) and CPU, and whether the backend stream stayed up. C{--root} runs another tree's agent
(e.g. the main branch before the fix) for a before/after figure in the same run.

Usage: python3 bench/bench_ops_flood.py [--seconds 20] [--connections 64] [--ahead 64]
       [--root /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import select
import shutil
import socket
import sys
import tempfile
import time
import urllib.request
from typing import Any

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from _common import AgentProcess, DevBackendProcess, free_port, summary  # noqa: E402

GET = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def scrape_lateness(port: int) -> dict[str, float]:
    """
    The agent's reactor lateness histogram (a 1 s timer, cumulative): bucket counts by bound,
    C{sum} and C{count}. (Not the "max since the previous scrape" gauge: every scrape of the
    flood's own /metrics resets that one.)
    """
    deadline = time.monotonic() + 300
    while True:  # an agent still digesting a flood may refuse or reset the first tries
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=120) as r:
                text = r.read().decode()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    out: dict[str, float] = {}
    for m in re.finditer(r'^llmport_agent_reactor_lateness_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    for key in ("sum", "count"):
        found = re.search(rf"^llmport_agent_reactor_lateness_seconds_{key} (\S+)$", text, re.M)
        out[key] = float(found.group(1)) if found else 0.0
    return out


def lateness_between(a: dict[str, float], b: dict[str, float]) -> str:
    """The ticks of the window: how many, their mean lateness, and the worst bucket reached."""
    ticks = b["count"] - a["count"]
    if ticks <= 0:
        return "no timer tick in the window (the reactor was stalled throughout)"
    mean = (b["sum"] - a["sum"]) / ticks
    bounds = sorted((float(k) if k != "+Inf" else float("inf"), k) for k in b if k not in ("sum", "count"))
    worst = "<= 1 ms"
    below = 0.0
    for value, key in bounds:
        in_bucket = (b[key] - a.get(key, 0.0)) - below
        below = b[key] - a.get(key, 0.0)
        if in_bucket > 0:
            worst = f"<= {value * 1000:g} ms" if value != float("inf") else "> 5 s"
    late = ticks - (b.get("0.1", 0.0) - a.get("0.1", 0.0))
    return f"{ticks:.0f} ticks of the 1 s timer, mean {mean * 1000:.1f} ms late, worst {worst}, {late:.0f} over 100 ms"


class Probe:
    """A /healthz every interval on a fresh connection; answer times in ms (a miss counts 30 s)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.times: list[float] = []
        self.failed = 0

    def once(self) -> None:
        t0 = time.monotonic()
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=30) as s:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    data += chunk
            if not data.startswith(b"HTTP/1.1 200"):
                raise OSError("no answer")
            self.times.append((time.monotonic() - t0) * 1000)
        except OSError:
            self.failed += 1
            self.times.append(30_000.0)


class Flood:
    """Connections that write pipelined requests and never read; reconnect when dropped."""

    def __init__(self, port: int, connections: int, ahead: int) -> None:
        self.port = port
        self.payload = GET * max(1, ahead // len(GET))
        self.socks: dict[socket.socket, int] = {}  # socket -> bytes written
        self.dropped = 0
        self.connections = connections

    def _open(self) -> None:
        while len(self.socks) < self.connections:
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect(("127.0.0.1", self.port))
            except BlockingIOError:
                pass
            except OSError:
                s.close()
                return
            self.socks[s] = 0

    def step(self, timeout: float) -> None:
        self._open()
        _r, writable, _x = select.select([], list(self.socks), [], timeout)
        for s in writable:
            sent = self.socks[s]
            if sent >= len(self.payload):
                # All written: check whether the agent dropped it (without reading the answers).
                try:
                    if s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                        raise ConnectionResetError
                except BlockingIOError:
                    continue
                except OSError:
                    self._drop(s)
                continue
            try:
                self.socks[s] = sent + s.send(self.payload[sent:sent + 65536])
            except BlockingIOError:
                pass
            except OSError as e:
                if e.errno not in (errno.EAGAIN,):
                    self._drop(s)

    def _drop(self, s: socket.socket) -> None:
        self.dropped += 1
        self.socks.pop(s, None)
        s.close()

    def close(self) -> None:
        for s in list(self.socks):
            s.close()
        self.socks.clear()


def window(name: str, port: int, agent: Any, backend: Any, seconds: float, flood: Flood | None) -> None:
    proc = psutil.Process(agent.proc.pid)
    late0 = scrape_lateness(port)
    probe = Probe(port)
    cpu0 = proc.cpu_times()
    rss_start = proc.memory_info().rss / 2**20
    peak = rss_start
    t0 = time.monotonic()
    next_probe = t0
    while time.monotonic() - t0 < seconds:
        now = time.monotonic()
        if now >= next_probe:
            probe.once()
            next_probe = now + 0.2
            peak = max(peak, proc.memory_info().rss / 2**20)
        if flood is not None:
            flood.step(0.01)
        else:
            time.sleep(0.01)
    elapsed = time.monotonic() - t0
    cpu1 = proc.cpu_times()
    rss_end = proc.memory_info().rss / 2**20
    if flood is not None:
        flood.close()
    time.sleep(0.5)
    lateness = lateness_between(late0, scrape_lateness(port))
    nodes = backend.get("/dev/nodes")
    status = ", ".join(str(n.get("status")) for n in nodes)
    cpu = 100 * ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / elapsed
    print(f"{name}:")
    print(f"  /healthz answer time:   {summary(probe.times, ' ms', 1)}; failed {probe.failed}")
    print(f"  reactor lateness:       {lateness}")
    print(f"  RSS:                    {rss_start:.0f} MiB at start, peak {peak:.0f} MiB, {rss_end:.0f} MiB at end")
    print(f"  CPU:                    {cpu:.0f} % of one core")
    print(f"  node status at backend: {status}")
    if flood is not None:
        print(f"  flood connections found closed by the agent: {flood.dropped}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--ahead", type=int, default=64, help="KiB of pipelined requests per connection")
    p.add_argument("--root", default=None, help="run this checkout's agent instead (before/after)")
    args = p.parse_args()
    if args.root:
        _common.ROOT = os.path.abspath(args.root)
    backend = DevBackendProcess()
    tmp = tempfile.mkdtemp(prefix="bench-ops-flood-")
    port = free_port()
    agent = AgentProcess(backend.url, backend.token(), tmp, "flood-0", OPS_PORT=str(port),
                         LOG_LEVEL="WARN")
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                scrape_lateness(port)
                if any(n.get("status") in ("online", "degraded") for n in backend.get("/dev/nodes")):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        time.sleep(3)
        print(f"agent from {_common.ROOT}; {args.connections} connections x {args.ahead} KiB of "
              f"pipelined GET /metrics, never read, for {args.seconds:g} s")
        window("idle baseline", port, agent, backend, args.seconds, None)
        window("flood", port, agent, backend, args.seconds,
               Flood(port, args.connections, args.ahead * 1024))
        window("after the flood", port, agent, backend, min(args.seconds, 10.0), None)
    finally:
        agent.stop()
        backend.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
