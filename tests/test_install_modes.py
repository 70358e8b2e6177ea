"""
The install paths, driven end to end: the standalone executable (`demo`, `run` against the
stand-in backend, a configuration error, `config`, `devbackend`, `start`) with no Python on
PATH; `twistd -n llmport-agent` from a fresh `pip install -e .` venv and from a wheel install.

`.ci/run` builds them and names them in the environment (LLMPORT_AGENT_BINARY,
LLMPORT_AGENT_EDITABLE_VENV, LLMPORT_AGENT_WHEEL_VENV, LLMPORT_AGENT_PIPX_BIN); without them the
tests skip, unless LLMPORT_REQUIRE_INSTALL=1 (CI), which makes a missing one a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from typing import Any

from twisted.internet import reactor
from twisted.trial.unittest import SkipTest, TestCase

from tests.agentharness import AnomalyGuard, agent_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _artifact(var: str) -> str:
    path = os.environ.get(var, "")
    if path and os.path.exists(path):
        return os.path.abspath(path)
    reason = f"{var} is not set (run .ci/run, or build it: see the README)"
    if os.environ.get("LLMPORT_REQUIRE_INSTALL") == "1":
        raise AssertionError(reason)
    raise SkipTest(reason)


class _Spawning(AnomalyGuard, TestCase):
    timeout = 120

    async def backend(self) -> Any:
        return await self.start_watched_backend()

    def bare_env(self, **extra: str) -> dict[str, str]:
        """No Python anywhere on PATH; a HOME and cwd outside the checkout."""
        empty = os.path.abspath(self.mktemp())
        os.makedirs(empty)
        env = {"PATH": empty, "HOME": empty, "LANG": "C.UTF-8"}
        env.update(extra)
        self.cwd = empty
        return env

    def spawn(self, args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
        log = os.path.abspath(self.mktemp() + ".log")
        out = open(log, "wb")
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT,
                                cwd=getattr(self, "cwd", "/"))

        def cleanup() -> None:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close()

        self.addCleanup(cleanup)
        return proc, log

    async def run_against_backend(self, args: list[str], env: dict[str, str]) -> str:
        """Enroll, first heartbeat, SIGTERM, exit 0, clean close. Returns the output."""
        b = await self.backend()
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        full = dict(env)
        full.update(agent_env(b, d, ENROLLMENT_TOKEN=b.mint_token()["token"]))
        proc, log = self.spawn(args, full)
        agent_id = full["LLM_PORT_NODE_AGENT_AGENT_ID"]
        await b.wait_for(lambda: (b.node_by_agent_id(agent_id) or {}).get("status") in ("healthy", "degraded")
                         or proc.poll() is not None, 60)
        def output() -> str:
            with open(log, errors="replace") as f:
                return f.read()

        self.assertIsNone(proc.poll(), output()[-3000:])
        node_id = b.node_by_agent_id(agent_id)["id"]
        proc.send_signal(signal.SIGTERM)
        await b.wait_for(lambda: proc.poll() is not None, 60)
        self.assertEqual(proc.returncode, 0, output()[-3000:])
        self.assertEqual(b.connection_count(node_id), 0)
        return output()


class BinaryTests(_Spawning):
    def binary(self) -> str:
        return _artifact("LLMPORT_AGENT_BINARY")

    def test_demo_without_python(self) -> None:
        done = subprocess.run([self.binary(), "demo"], env=self.bare_env(), cwd=self.cwd,
                              capture_output=True, text=True, timeout=120)
        self.assertEqual(done.returncode, 0, done.stdout[-3000:] + done.stderr[-3000:])
        self.assertIn("demo finished", done.stdout)

    def test_config_and_config_error(self) -> None:
        exe = self.binary()
        done = subprocess.run([exe, "config"], env=self.bare_env(), cwd=self.cwd, capture_output=True,
                              text=True, timeout=60)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("LLM_PORT_NODE_AGENT_BACKEND_URL", done.stdout)
        done = subprocess.run([exe, "run"], env=self.bare_env(LLM_PORT_NODE_AGENT_BACKEND_URL="ftp://x"),
                              cwd=self.cwd, capture_output=True, text=True, timeout=60)
        self.assertEqual(done.returncode, 2)
        self.assertEqual(len(done.stderr.strip().splitlines()), 1, done.stderr)
        self.assertIn("LLM_PORT_NODE_AGENT_BACKEND_URL", done.stderr)

    async def test_run_against_the_stand_in_backend(self) -> None:
        from tests.test_sdnotify import Receiver

        r = Receiver()
        self.addCleanup(r.close)
        env = self.bare_env(NOTIFY_SOCKET=r.address)
        output = await self.run_against_backend([self.binary(), "run"], env)
        # The notification comes from the agent process under the one-file bootloader.
        self.assertTrue(any(m.startswith("READY=1") for m in r.texts()), r.texts())
        self.assertIn("llmport-agent", output)

    async def test_devbackend(self) -> None:
        proc, log = self.spawn([self.binary(), "devbackend", "--port", "0"], self.bare_env())
        from twisted.internet.task import deferLater

        for _ in range(200):
            text = open(log, errors="replace").read()
            if "token" in text.lower() and "http://127.0.0.1:" in text:
                break
            await deferLater(reactor, 0.1, lambda: None)
        else:
            self.fail(open(log, errors="replace").read()[-2000:])
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)

    def test_start_writes_a_unit_for_the_binary(self) -> None:
        """`start` from the binary (stand-in systemctl, a fake root): ExecStart is the binary, NotifyAccess=all."""
        exe = self.binary()
        root = os.path.abspath(self.mktemp())
        for d in ("etc/systemd/system", "run/systemd/system", "bin"):
            os.makedirs(os.path.join(root, d))
        stand_in = os.path.join(root, "bin", "systemctl")
        with open(stand_in, "w") as f:
            f.write('#!/bin/sh\necho "$*" >> "$SYSTEMCTL_LOG"\n[ "$1" = is-enabled ] && exit 1\nexit 0\n')
        os.chmod(stand_in, 0o755)
        if os.geteuid() != 0:
            raise SkipTest("start needs root")
        if os.path.realpath(exe).startswith(("/tmp/", "/var/tmp/")):
            # Built in a checkout under /tmp (CI's clone may be): start rightly refuses that
            # place, so install it somewhere stable first, as an operator would.
            import uuid

            place = f"/run/llmport-test-{uuid.uuid4().hex[:8]}"
            os.makedirs(place)
            self.addCleanup(shutil.rmtree, place, True)
            shutil.copy2(exe, os.path.join(place, "llmport-agent"))
            exe = os.path.join(place, "llmport-agent")
        env = self.bare_env(LLMPORT_AGENT_SYSTEM_ROOT=root, SYSTEMCTL_LOG=os.path.join(root, "calls"),
                            LLM_PORT_NODE_AGENT_BACKEND_URL="https://llm-port.example",
                            LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN="t" * 32)
        env["PATH"] = os.path.join(root, "bin") + ":/bin:/usr/bin"
        done = subprocess.run([exe, "start"], env=env, cwd=self.cwd, capture_output=True, text=True, timeout=60)
        self.assertEqual(done.returncode, 0, done.stderr)
        unit_path = os.path.join(root, "etc/systemd/system/llmport-agent.service")
        unit = open(unit_path).read()
        self.assertIn(f"ExecStart={exe} run\n", unit)
        self.assertIn("NotifyAccess=all\n", unit)
        analyze = shutil.which("systemd-analyze")
        if analyze:
            v = subprocess.run([analyze, "verify", unit_path], capture_output=True, text=True, timeout=60)
            self.assertEqual(v.returncode, 0, v.stderr)


class VenvTests(_Spawning):
    async def test_twistd_from_an_editable_install(self) -> None:
        """A fresh venv with `pip install -e .`: `twistd -n llmport-agent` finds the plugin and runs."""
        venv = _artifact("LLMPORT_AGENT_EDITABLE_VENV")
        env = self.bare_env()
        await self.run_against_backend([os.path.join(venv, "bin", "twistd"), "-n", "--pidfile=",
                                        "llmport-agent"], env)

    def test_twistd_config_error_from_the_wheel(self) -> None:
        """From a wheel install (not the checkout): the plugin is found; a bad variable is exit 2."""
        venv = _artifact("LLMPORT_AGENT_WHEEL_VENV")
        twistd = os.path.join(venv, "bin", "twistd")
        done = subprocess.run([twistd, "--help"], env=self.bare_env(), cwd=self.cwd, capture_output=True,
                              text=True, timeout=60)
        self.assertIn("llmport-agent", done.stdout)
        done = subprocess.run([twistd, "-n", "--pidfile=", "llmport-agent"], cwd=self.cwd,
                              env=self.bare_env(LLM_PORT_NODE_AGENT_OPS_PORT="99999"),
                              capture_output=True, text=True, timeout=60)
        self.assertEqual(done.returncode, 2, done.stdout + done.stderr)
        self.assertEqual(len((done.stdout + done.stderr).strip().splitlines()), 1)

    def test_pipx_install(self) -> None:
        bindir = _artifact("LLMPORT_AGENT_PIPX_BIN")
        done = subprocess.run([os.path.join(bindir, "llmport-agent"), "config", "--json"], env=self.bare_env(),
                              cwd=self.cwd, capture_output=True, text=True, timeout=60)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("LLM_PORT_NODE_AGENT_BACKEND_URL", done.stdout)
