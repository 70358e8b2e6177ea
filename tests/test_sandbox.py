"""
The agent under its unit's hardening (system-call allow list, address families, no new
privileges, capability bounding set, read-only file system but the state directory and the model
store), emulated without systemd by tests/support/sandbox.py: it enrolls, heartbeats, reports
inventory (psutil), runs diagnostics and a deploy on the real Docker engine, reads the journal
with journalctl and ships to Loki, and stops cleanly, with no "not permitted" anywhere.
A control run shows the sandbox does refuse what the unit forbids.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from typing import Any

from twisted.internet import reactor
from twisted.trial.unittest import SkipTest
from twisted.web.server import Site

from llmport_agent.logs.testing import FakeLoki
from tests.agentharness import AgentTestCase, agent_env
from tests.support.docker_env import require_docker
from tests.support.rig import httpd_payload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SANDBOX = os.path.join(ROOT, "tests", "support", "sandbox.py")
SYSTEM_PYTHON = "/usr/bin/python3"


def sandbox_available() -> None:
    reason = None
    if os.geteuid() != 0:
        reason = "needs root (mount namespace, capability bounding set)"
    elif shutil.which("systemd-analyze") is None:
        reason = "needs Debian package systemd (systemd-analyze is missing): sudo apt-get install systemd"
    elif subprocess.run([SYSTEM_PYTHON, "-c", "import seccomp"], capture_output=True).returncode != 0:
        reason = ("needs Debian package python3-seccomp (import seccomp failed): "
                  "sudo apt-get install python3-seccomp")
    if reason:
        if os.environ.get("CI") == "true":
            raise AssertionError(reason)
        raise SkipTest(reason)


class SandboxTests(AgentTestCase):
    timeout = 180

    def test_the_sandbox_refuses_what_the_unit_forbids(self) -> None:
        sandbox_available()
        rw = f"/run/llmport-sbx-{uuid.uuid4().hex[:8]}"
        os.makedirs(rw)
        self.addCleanup(shutil.rmtree, rw, True)
        probe = (
            "import errno, os, socket\n"
            "def t(f):\n"
            "    try: f(); return 'ok'\n"
            "    except OSError as e: return errno.errorcode[e.errno]\n"
            f"print(t(lambda: open('/etc/llmport-sbx', 'w')), t(lambda: open('{rw}/x', 'w')),"
            " t(lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW)), t(lambda: socket.socket()),"
            f" t(lambda: os.chown('{rw}/x', 1, 1)), t(lambda: os.setuid(0)))\n"
        )
        done = subprocess.run([SYSTEM_PYTHON, SANDBOX, "--shared-tmp", "--rw", rw, "--", sys.executable, "-c", probe],
                              capture_output=True, text=True, timeout=60)
        self.assertEqual(done.stdout.split(), ["EROFS", "ok", "EAFNOSUPPORT", "ok", "EPERM", "EPERM"], done.stderr)

    async def test_agent_runs_under_the_unit_hardening(self) -> None:
        sandbox_available()
        docker = require_docker()
        backend = await self.start_backend()
        loki = FakeLoki()
        port = reactor.listenTCP(0, Site(loki), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        base = f"/run/llmport-sbx-{uuid.uuid4().hex[:8]}"
        state, store = os.path.join(base, "state"), os.path.join(base, "models")
        os.makedirs(state)
        os.makedirs(store)
        self.addCleanup(shutil.rmtree, base, True)
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONDONTWRITEBYTECODE="1", DOCKER_HOST=docker.host)
        env.update(agent_env(backend, state, ENROLLMENT_TOKEN=backend.mint_token()["token"],
                             MODEL_STORE=store, WORKLOAD_NETWORK="host", LOG_FORMAT="text",
                             LOKI_URL=f"http://127.0.0.1:{port.getHost().port}", LOG_FLUSH_INTERVAL_SEC="0.5"))
        log = os.path.join(base, "agent.log")
        out = open(log, "wb")
        proc = subprocess.Popen([SYSTEM_PYTHON, SANDBOX, "--shared-tmp", "--rw", state, "--rw", store, "--",
                                 sys.executable, "-m", "llmport_agent.cli", "run"],
                                env=env, cwd="/", stdout=out, stderr=subprocess.STDOUT)

        def cleanup() -> None:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close()

        self.addCleanup(cleanup)

        def output() -> str:
            with open(log, errors="replace") as f:
                return f.read()

        agent_id = env["LLM_PORT_NODE_AGENT_AGENT_ID"]
        # Enrolled (the first heartbeat may already have made the node "degraded") or exited.
        await backend.wait_for(lambda: backend.node_by_agent_id(agent_id) is not None
                               or proc.poll() is not None, 60)
        self.assertIsNone(proc.poll(), output()[-3000:])
        with open(f"/proc/{proc.pid}/status") as f:
            status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        # The agent itself runs filtered (exec keeps the pid), without new privileges, 3 capabilities.
        self.assertEqual(status["Seccomp"].strip(), "2")
        self.assertEqual(status["NoNewPrivs"].strip(), "1")
        self.assertEqual(int(status["CapBnd"], 16), 0b1110)
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            self.assertIn(b"llmport_agent.cli", f.read())
        node_id = backend.node_by_agent_id(agent_id)["id"]
        results: dict[str, Any] = {}
        payload = httpd_payload()
        self.addCleanup(self._remove, docker, payload["runtime_id"])
        for kind, body in (("refresh_inventory", {}), ("collect_diagnostics", {}), ("deploy_workload", payload)):
            cmd = backend.issue_command(node_id, kind, body)
            await backend.wait_for(lambda c=cmd: backend.command(c["id"])["status"] in ("succeeded", "failed"), 90)
            results[kind] = backend.command(cmd["id"])
        for kind, record in results.items():
            self.assertEqual(record["status"], "succeeded", f"{kind}: {record.get('error_message')}\n{output()[-3000:]}")
        diagnostics = results["collect_diagnostics"]["result"]
        self.assertTrue(diagnostics["engine"].get("version") or diagnostics["engine"].get("server_version"),
                        diagnostics["engine"])
        await backend.wait_for(lambda: bool(loki.lines(job="node-agent")), 30)
        # The journal reader (journalctl) runs as a child under the same filter.
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            children = f.read().split()
        commands = []
        for child in children:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                commands.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
        self.assertTrue(any("journalctl" in c for c in commands), commands)
        proc.send_signal(signal.SIGTERM)
        await backend.wait_for(lambda: proc.poll() is not None, 60)
        text = output()
        self.assertEqual(proc.returncode, 0, text[-3000:])
        for word in ("not permitted", "Read-only file system", "Address family not supported", "EPERM"):
            self.assertNotIn(word, text)

    def _remove(self, docker: Any, runtime_id: str) -> None:
        client = docker.client()
        for c in client.containers.list(all=True, filters={"label": f"io.llmport.runtime-id={runtime_id}"}):
            c.remove(force=True)
