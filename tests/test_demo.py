"""
Snapshot tests of `llmport-agent demo` (issue 9): what a new user sees, line by line, with
times, ids, ports, paths and host figures normalised. The snapshots show progress rows in
the timelines, maintenance visibly switched on (the node's status says so) and off, and, with
`--docker` and no engine, "degraded" and FAILED rather than healthy/OK.

Set LLMPORT_UPDATE_SNAPSHOTS=1 to rewrite the files after an intended change.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import socket

from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from llmport_agent import VERSION
from llmport_agent.demo.run import _demo
from llmport_agent.inventory.gpu import NoGPUSource

SNAPSHOTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "snapshots")
NO_ENGINE = "unix:///nonexistent/llmport-demo/docker.sock"


def normalise(lines: list[str]) -> str:
    host = re.escape(socket.gethostname())
    system = re.escape(f"{platform.system()}/{platform.machine()}")
    rules = [
        (r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "<id>"),
        (r"\d{4}-\d\d-\d\dT[0-9:.]+(?:\+00:00|Z)?", "<datetime>"),
        (r"\b\d\d:\d\d:\d\d\.\d{3}\b", "<time>"),
        (r"127\.0\.0\.1:\d+", "127.0.0.1:<port>"),
        (r"\S*llmport-demo-[A-Za-z0-9_]+", "<workdir>"),
        (r"demo finished in \d+\.\d s", "demo finished in <s> s"),
        (re.escape(VERSION), "<version>"),
        (rf"inventory: {host} {system}", "inventory: <host> <os>/<machine>"),
        (r"\b\d+ CPUs", "<n> CPUs"),
        (r"\d+\.\d (?:B|KiB|MiB|GiB|TiB)\b", "<size>"),
        (r"cpu [0-9.?]+ %", "cpu <pct> %"),
    ]
    out = []
    for line in lines:
        for pattern, replacement in rules:
            line = re.sub(pattern, replacement, line)
        out.append(line)
    return "\n".join(out) + "\n"


class DemoSnapshotTests(TestCase):
    timeout = 60

    async def run_demo(self, *flags: str, environ: dict[str, str] | None = None) -> tuple[int, str]:
        args = argparse.Namespace(verbose=False, docker="--docker" in flags)
        lines: list[str] = []
        code = await _demo(reactor, args, lines.append, docker_environ=environ, gpu_source=NoGPUSource())
        return code, normalise(lines)

    def check(self, name: str, text: str) -> None:
        path = os.path.join(SNAPSHOTS, name)
        if os.environ.get("LLMPORT_UPDATE_SNAPSHOTS") == "1":
            with open(path, "w") as f:
                f.write(text)
        with open(path) as f:
            expected = f.read()
        self.assertEqual(text, expected, f"the demo's output changed; see {path}")

    async def test_demo(self) -> None:
        """The demo: enrollment, heartbeat, inventory, timelines with progress rows, maintenance on and off, OK."""
        code, text = await self.run_demo()
        self.assertEqual(code, 0, text)
        self.check("demo.txt", text)
        self.assertIn("progress   [collect]", text)
        self.assertIn("node status is now maintenance", text)
        self.assertTrue(text.rstrip().endswith(": OK"), text)

    async def test_demo_docker_without_engine(self) -> None:
        """`demo --docker` without an engine: degraded, the engine's line, FAILED, exit 1."""
        code, text = await self.run_demo("--docker", environ={"DOCKER_HOST": NO_ENGINE})
        self.assertEqual(code, 1, text)
        self.check("demo_docker_unreachable.txt", text)
        self.assertIn("heartbeat: status degraded", text)
        self.assertNotIn("status healthy", text)
        self.assertNotIn(": OK", text)
