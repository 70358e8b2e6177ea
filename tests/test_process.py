"""
The agent as a process: `llmport-agent run` and `twistd -n llmport-agent` against the stand-in
backend; SIGTERM stops cleanly (close 1000, exit 0); SIGKILL mid-command is resolved at the next
start; the configuration reference in docs/ (generated from SETTINGS, tests/test_docs.py) documents every variable.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from typing import Any

from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import SynchronousTestCase, TestCase

from tests.agentharness import AnomalyGuard, agent_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spawn(args: list[str], env: dict[str, str], log: str) -> subprocess.Popen[bytes]:
    full = dict(os.environ, PYTHONPATH=ROOT, LLM_PORT_NODE_AGENT_OPS_PORT="0")
    full.update(env)
    out = open(log, "wb")
    return subprocess.Popen(args, cwd=ROOT, env=full, stdout=out, stderr=subprocess.STDOUT)


class _ProcessBase(AnomalyGuard, TestCase):
    timeout = 120

    async def backend(self) -> Any:
        return await self.start_watched_backend()

    def start(self, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = os.path.join(self.mktemp() + ".log")
        proc = spawn(args, env, log)
        self.log_path = log

        def cleanup() -> None:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

        self.addCleanup(cleanup)
        return proc

    def output(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()



class ProcessTests(_ProcessBase):
    async def _run_and_term(self, args: list[str]) -> None:
        b = await self.backend()
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        env = agent_env(b, d, ENROLLMENT_TOKEN=b.mint_token()["token"])
        token = env["LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN"]
        proc = self.start(args, env)
        agent_id = env["LLM_PORT_NODE_AGENT_AGENT_ID"]
        await b.wait_for(lambda: (b.node_by_agent_id(agent_id) or {}).get("status") in ("healthy", "degraded"), 30)
        node_id = b.node_by_agent_id(agent_id)["id"]
        await b.wait_for(lambda: b.connection_count(node_id) == 1, 10)
        proc.send_signal(signal.SIGTERM)
        await b.wait_for(lambda: proc.poll() is not None, 30)
        self.assertEqual(proc.returncode, 0, self.output()[-3000:])
        self.assertEqual(b.connection_count(node_id), 0)
        close_notes = [a for a in b.anomalies(node_id) if "1006" in a or "abort" in a]
        self.assertEqual(close_notes, [])
        with open(env["LLM_PORT_NODE_AGENT_STATE_PATH"]) as f:
            stored = json.load(f)
        self.assertEqual(stored["node_id"], node_id)
        output = self.output()
        self.assertNotIn(token, output)
        self.assertNotIn(stored["credential"].split(".")[1], output)
        self.assertNotIn("#debug]", output)

    async def test_run_sigterm(self) -> None:
        """`llmport-agent run` enrolls, connects, and exits 0 on SIGTERM with a clean close."""
        await self._run_and_term([sys.executable, "-m", "llmport_agent.cli", "run"])

    async def test_twistd_plugin(self) -> None:
        """`twistd -n llmport-agent` runs the same service and stops cleanly on SIGTERM."""
        await self._run_and_term([sys.executable, "-c", "import sys; from twisted.scripts.twistd import run; "
                                  "sys.argv=['twistd','-n','--pidfile=','llmport-agent']; run()"])

    async def test_sigkill_mid_command_resolved(self) -> None:
        """
        SIGKILL while a command is running: at the next start the journal resolves it and
        exactly one result reaches the backend.
        """
        b = await self.backend()
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        env = agent_env(b, d, ENROLLMENT_TOKEN=b.mint_token()["token"])
        agent_id = env["LLM_PORT_NODE_AGENT_AGENT_ID"]
        args = [sys.executable, "-m", "llmport_agent.cli", "run"]
        proc = self.start(args, env)
        await b.wait_for(lambda: b.node_by_agent_id(agent_id) is not None, 30)
        node_id = b.node_by_agent_id(agent_id)["id"]
        await b.wait_for(lambda: b.connection_count(node_id) == 1, 10)
        # update_workload is not idempotent; hold its progress frames so the kill lands mid-command:
        # the engine is absent here, so the handler fails quickly unless killed first. Kill on ack.
        killed: list[bool] = []

        def hook(nid: str, frame: dict[str, Any]) -> None:
            if frame.get("type") == "command_ack" and not killed:
                killed.append(True)
                os.kill(proc.pid, signal.SIGKILL)

        def lose_results(nid: str, frame: dict[str, Any]) -> bool:
            return frame.get("type") != "command_result" or bool(killed) is False

        b.frame_hook = hook
        b.inbound_filter = lose_results
        cmd = b.issue_command(node_id, "refresh_inventory", {})
        await b.wait_for(lambda: proc.poll() is not None, 30)
        b.frame_hook = None
        b.inbound_filter = None
        self.assertEqual(proc.returncode, -signal.SIGKILL)
        env.pop("LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN")
        self.start(args, env)
        await b.wait_for(lambda: b.command(cmd["id"])["status"] == "succeeded", 30)
        await deferLater(reactor, 1.0, lambda: None)
        results = [e for e in b.timeline(cmd["id"]) if e["event_type"] == "result"]
        self.assertEqual(len(results), 1)


class NotifyAndLogsTests(_ProcessBase):
    async def test_run_notifies_systemd_and_logs_json(self) -> None:
        """Under a notify socket: READY=1, STATUS= (connected, node id), WATCHDOG=1, STOPPING=1; JSON lines."""
        from tests.test_sdnotify import Receiver

        r = Receiver()
        self.addCleanup(r.close)
        b = await self.backend()
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        env = agent_env(b, d, ENROLLMENT_TOKEN=b.mint_token()["token"])
        env.update(NOTIFY_SOCKET=r.address, WATCHDOG_USEC="400000")
        proc = self.start([sys.executable, "-m", "llmport_agent.cli", "run"], env)
        agent_id = env["LLM_PORT_NODE_AGENT_AGENT_ID"]
        await b.wait_for(lambda: b.node_by_agent_id(agent_id) is not None, 30)
        node_id = b.node_by_agent_id(agent_id)["id"]
        await b.wait_for(lambda: any(m.startswith("STATUS=connected") for m in r.texts()), 20)
        await b.wait_for(lambda: r.texts().count("WATCHDOG=1") >= 4, 10)
        proc.send_signal(signal.SIGTERM)
        await b.wait_for(lambda: proc.poll() is not None, 30)
        self.assertEqual(proc.returncode, 0, self.output()[-2000:])
        texts = r.texts()
        ready = [m for m in texts if m.startswith("READY=1")]
        self.assertEqual(len(ready), 1)
        self.assertTrue(any(m.startswith("STATUS=connected, node " + node_id) for m in texts), texts)
        self.assertTrue(any(m.startswith("STOPPING=1") for m in texts))
        self.assertLess(texts.index(ready[0]), [i for i, m in enumerate(texts) if m.startswith("STOPPING=1")][0])
        lines = [json.loads(line) for line in self.output().splitlines() if line.startswith("{")]
        self.assertTrue(lines)
        for line in lines:
            self.assertLessEqual({"time", "level", "logger", "message"}, set(line))
        self.assertTrue(any("Received SIGTERM" in str(line["message"]) for line in lines))

    def test_twistd_config_error_is_one_line_and_exit_2(self) -> None:
        """Under twistd a bad variable is one line and exit 2 (RestartPreventExitStatus applies)."""
        env = dict(os.environ, PYTHONPATH=ROOT, LLM_PORT_NODE_AGENT_HEARTBEAT_INTERVAL_SEC="abc")
        done = subprocess.run(
            [sys.executable, "-c", "import sys; from twisted.scripts.twistd import run; "
             "sys.argv=['twistd','-n','--pidfile=','llmport-agent']; run()"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
        self.assertEqual(done.returncode, 2, done.stdout + done.stderr)
        lines = (done.stdout + done.stderr).strip().splitlines()
        self.assertEqual(len(lines), 1, lines)
        self.assertIn("LLM_PORT_NODE_AGENT_HEARTBEAT_INTERVAL_SEC", lines[0])


class TwistdJSONTests(SynchronousTestCase):
    def test_twistd_json_logger(self) -> None:
        """`twistd --logger llmport_agent.core.logsetup.twistd_json_observer`: the same JSON lines; exit 78 kept."""
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        env = dict(os.environ, PYTHONPATH=ROOT, LLM_PORT_NODE_AGENT_OPS_PORT="0",
                   LLM_PORT_NODE_AGENT_STATE_PATH=os.path.join(d, "state.json"))
        env.pop("LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN", None)
        done = subprocess.run(
            [sys.executable, "-c", "import sys; from twisted.scripts.twistd import run; "
             "sys.argv=['twistd','-n','--pidfile=','--logger','llmport_agent.core.logsetup.twistd_json_observer',"
             "'llmport-agent']; run()"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
        self.assertEqual(done.returncode, 78, done.stdout + done.stderr)
        lines = [json.loads(line) for line in done.stdout.splitlines()]
        critical = [x for x in lines if x["level"] == "critical"]
        self.assertEqual(len(critical), 1)
        self.assertIn("no enrollment token", critical[0]["message"])
        self.assertEqual(critical[0]["logger"], "llmport_agent.agent.service.AgentService")


_ = uuid
