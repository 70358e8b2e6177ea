"""
The unit as shipped (C{deploy/systemd/llmport-agent.service}, ExecStart=/usr/local/bin/llmport-agent)
under a real systemd as PID 1 (L{tests.support.systemd_pid1}): Type=notify readiness, kill -9
and a SIGSTOP under the watchdog restarted, a bad setting exits 2 without a restart loop, a clean
stop. The agent runs from this tree (a wrapper at /usr/local/bin on a tmpfs private to the
namespace). Skips with one line when not root or systemd is missing; fails instead under CI=true.
"""

from __future__ import annotations

import os
import sys
import time

from twisted.internet import reactor
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, TestCase

from tests.agentharness import AnomalyGuard
from tests.support.systemd_pid1 import BootedSystemd, unavailable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNIT = "llmport-agent.service"


class ShippedUnitTests(AnomalyGuard, TestCase):
    timeout = 180

    def setUp(self) -> None:
        why = unavailable()
        if why:
            if os.environ.get("CI") == "true":
                raise AssertionError(why)
            raise SkipTest(why)

    async def boot(self) -> BootedSystemd:
        base = os.path.join(ROOT, "_trial_temp", "pid1-" + os.urandom(4).hex())
        box = BootedSystemd(base)
        self.addCleanup(box.stop)
        await deferToThread(box.wait_booted, 60)
        python = os.path.realpath(sys.executable)
        await deferToThread(box.run, "mount", "-t", "tmpfs", "tmpfs", "/usr/local/bin")
        await deferToThread(box.write, "/usr/local/bin/llmport-agent",
                            f"#!/bin/sh\nexport PYTHONPATH={ROOT}\nexec {python} -m llmport_agent.cli \"$@\"\n",
                            0o755)
        with open(os.path.join(ROOT, "deploy", "systemd", UNIT)) as f:
            await deferToThread(box.write, "/etc/systemd/system/" + UNIT, f.read())
        return box

    async def configure(self, box: BootedSystemd, **extra: str) -> tuple[object, str]:
        b = await self.start_watched_backend()
        agent_id = "agent-" + os.urandom(4).hex()
        env = {"BACKEND_URL": b.url, "AGENT_ID": agent_id, "HOST": "127.0.0.1", "OPS_PORT": "0",
               "ENROLLMENT_TOKEN": b.mint_token()["token"], "RECONNECT_MIN_SEC": "0.2",
               "RECONNECT_MAX_SEC": "1"}
        env.update(extra)
        text = "".join(f"LLM_PORT_NODE_AGENT_{k}={v}\n" for k, v in env.items())
        await deferToThread(box.write, "/etc/llmport-agent.env", text, 0o600)
        await deferToThread(box.run, "systemctl", "daemon-reload")
        return b, agent_id

    async def up(self, box: BootedSystemd, b: object, agent_id: str) -> str:
        await b.wait_for(lambda: (b.node_by_agent_id(agent_id) or {}).get("status")  # type: ignore[attr-defined]
                         in ("healthy", "degraded"), 60)
        props = await deferToThread(box.show, UNIT, "ActiveState", "MainPID")
        self.assertEqual(props["ActiveState"], "active")
        return props["MainPID"]

    async def test_readiness_kill9_watchdog_and_clean_stop(self) -> None:
        box = await self.boot()
        b, agent_id = await self.configure(box)
        # Type=notify: `systemctl start` returns once READY=1 came (it fails otherwise).
        await deferToThread(box.run, "systemctl", "start", UNIT)
        pid = await self.up(box, b, agent_id)
        self.allow_anomalies(".", "kill -9 and the watchdog's SIGABRT drop the stream without a close")
        # kill -9: Restart=on-failure brings it back (RestartSec=5), same node.
        await deferToThread(box.run, "kill", "-9", pid)
        await b.wait_for(lambda: self._restarted(box, pid), 40)
        pid2 = await self.up(box, b, agent_id)
        self.assertNotEqual(pid2, pid)
        # Watchdog: a SIGSTOPped agent is killed and restarted (WatchdogSec shortened by a drop-in).
        await deferToThread(box.write, f"/etc/systemd/system/{UNIT}.d/watchdog.conf",
                            "[Service]\nWatchdogSec=4\n")
        await deferToThread(box.run, "systemctl", "daemon-reload")
        await deferToThread(box.run, "systemctl", "restart", UNIT)
        pid3 = await self.up(box, b, agent_id)
        await deferToThread(box.run, "kill", "-STOP", pid3)
        await b.wait_for(lambda: self._restarted(box, pid3), 40)
        await self.up(box, b, agent_id)
        journal = await deferToThread(box.run, "journalctl", "-u", UNIT, "--no-pager", "-o", "cat")
        self.assertIn("Watchdog timeout", journal.stdout)
        # Clean stop: exit 0, inactive.
        await deferToThread(box.run, "systemctl", "stop", UNIT)
        props = await deferToThread(box.show, UNIT, "ActiveState", "ExecMainStatus", "Result")
        self.assertEqual((props["ActiveState"], props["ExecMainStatus"], props["Result"]),
                         ("inactive", "0", "success"))
        self.assertEqual(len(b.state.nodes), 1)  # type: ignore[attr-defined]

    async def test_clean_stop_closes_with_1000(self) -> None:
        box = await self.boot()
        b, agent_id = await self.configure(box)
        await deferToThread(box.run, "systemctl", "start", UNIT)
        await self.up(box, b, agent_id)
        node_id = b.node_by_agent_id(agent_id)["id"]  # type: ignore[attr-defined]
        await deferToThread(box.run, "systemctl", "stop", UNIT)
        props = await deferToThread(box.show, UNIT, "ActiveState", "ExecMainStatus")
        self.assertEqual((props["ActiveState"], props["ExecMainStatus"]), ("inactive", "0"))
        await b.wait_for(lambda: any(n == node_id for n, _ in b.stream_closes), 10)  # type: ignore[attr-defined]
        self.assertEqual([c for n, c in b.stream_closes if n == node_id], [1000])  # type: ignore[attr-defined]

    async def test_the_journal_has_readable_lines_priorities_and_fields(self) -> None:
        """
        Issue 26: under the unit the operator read raw JSON lines, all at priority 6. Now
        `journalctl -p warning` shows only warnings and worse, as lines, with the fields in -o json.
        """
        import json

        box = await self.boot()
        # A Docker engine that is not there: the agent warns about it (a known WARN line).
        b, agent_id = await self.configure(box, LOG_LEVEL="INFO")
        await deferToThread(box.run, "systemctl", "start", UNIT)
        await self.up(box, b, agent_id)
        await deferToThread(box.run, "systemctl", "stop", UNIT)
        every = await deferToThread(box.run, "journalctl", "-u", UNIT, "--no-pager", "-o", "json")
        entries = [json.loads(line) for line in every.stdout.splitlines() if line.strip()]
        mine = [e for e in entries if e.get("SYSLOG_IDENTIFIER") == "llmport-agent"]
        self.assertTrue(mine, every.stdout[-3000:])
        self.assertFalse([e for e in mine if str(e.get("MESSAGE", "")).startswith("{")])  # no JSON lines
        self.assertTrue(all("LOGGER" in e and "PRIORITY" in e for e in mine))
        self.assertTrue({e["PRIORITY"] for e in mine} >= {"6", "4"}, {e["PRIORITY"] for e in mine})
        warned = await deferToThread(box.run, "journalctl", "-u", UNIT, "--no-pager", "-p", "warning",
                                     "-o", "json")
        picked = [json.loads(line) for line in warned.stdout.splitlines() if line.strip()]
        ours = [e for e in picked if e.get("SYSLOG_IDENTIFIER") == "llmport-agent"]
        self.assertTrue(ours)
        self.assertTrue(all(int(e["PRIORITY"]) <= 4 for e in ours))
        self.assertLess(len(ours), len(mine))

    def _restarted(self, box: BootedSystemd, old: str) -> bool:
        props = box.show(UNIT, "ActiveState", "MainPID")
        return props["ActiveState"] == "active" and props["MainPID"] not in ("0", old)

    async def test_bad_setting_exits_2_without_a_restart_loop(self) -> None:
        box = await self.boot()
        await self.configure(box, LOG_LEVEL="bogus")
        done = await deferToThread(box.run, "systemctl", "start", UNIT, check=False)
        self.assertNotEqual(done.returncode, 0)
        # RestartSec=5: wait past two restart periods; RestartPreventExitStatus=2 holds.
        await deferToThread(time.sleep, 11)
        props = await deferToThread(box.show, UNIT, "ActiveState", "ExecMainStatus", "NRestarts")
        self.assertEqual((props["ActiveState"], props["ExecMainStatus"], props["NRestarts"]),
                         ("failed", "2", "0"))


    async def test_unit_as_start_writes_it_and_an_upgrade_restart(self) -> None:
        """`start` from a venv under /opt writes and starts the unit; a replaced build and `start` again runs the new one."""
        box = await self.boot()
        b = await self.start_watched_backend()
        agent_id = "agent-" + os.urandom(4).hex()
        python = os.path.realpath(sys.executable)
        await deferToThread(box.run, python, "-m", "venv", "--system-site-packages", "--without-pip",
                            "/opt/llmport-agent")

        def build(n: int) -> str:
            return (f"#!/bin/sh\nexport PYTHONPATH={ROOT} LLMPORT_TEST_BUILD={n}\n"
                    "exec /opt/llmport-agent/bin/python -m llmport_agent.cli \"$@\"\n")

        await deferToThread(box.write, "/opt/llmport-agent/bin/llmport-agent", build(1), 0o755)
        env = {"BACKEND_URL": b.url, "AGENT_ID": agent_id, "HOST": "127.0.0.1", "OPS_PORT": "0",
               "ENROLLMENT_TOKEN": b.mint_token()["token"], "RECONNECT_MIN_SEC": "0.2", "RECONNECT_MAX_SEC": "1"}
        args = ["env", *(f"LLM_PORT_NODE_AGENT_{k}={v}" for k, v in env.items()),
                "/opt/llmport-agent/bin/python", "-m", "llmport_agent.cli", "start"]
        done = await deferToThread(box.run, *args)
        self.assertIn("running under systemd", done.stdout)
        unit = (await deferToThread(box.run, "cat", "/etc/systemd/system/" + UNIT)).stdout
        self.assertIn("ExecStart=/opt/llmport-agent/bin/llmport-agent run\n", unit)
        pid = await self.up(box, b, agent_id)
        node_id = b.node_by_agent_id(agent_id)["id"]  # type: ignore[index]
        self.assertEqual(await deferToThread(self._build_of, box, pid), "1")
        state = (await deferToThread(box.run, "cat", "/var/lib/llmport-agent/state.json")).stdout
        self.assertIn(node_id, state)
        # The upgrade: a new build in place, `start` again with no variables (the env file holds them).
        self.allow_anomalies("stream", "an old build's stream may still be open when the restarted one connects")
        await deferToThread(box.write, "/opt/llmport-agent/bin/llmport-agent", build(2), 0o755)
        await deferToThread(box.run, "/opt/llmport-agent/bin/python", "-m", "llmport_agent.cli", "start")
        await b.wait_for(lambda: self._restarted(box, pid), 60)
        pid2 = await self.up(box, b, agent_id)
        self.assertEqual(await deferToThread(self._build_of, box, pid2), "2")
        self.assertEqual(b.node_by_agent_id(agent_id)["id"], node_id)  # type: ignore[index]
        self.assertEqual(len(b.state.nodes), 1)  # type: ignore[attr-defined]
        state2 = (await deferToThread(box.run, "cat", "/var/lib/llmport-agent/state.json")).stdout
        self.assertIn(node_id, state2)
        await deferToThread(box.run, "systemctl", "stop", UNIT)

    async def test_a_failed_upgrade_goes_back_to_the_previous_build(self) -> None:
        """A new build that never gets ready: `start` puts the previous executable back and restarts it."""
        box = await self.boot()
        b = await self.start_watched_backend()
        agent_id = "agent-" + os.urandom(4).hex()
        python = os.path.realpath(sys.executable)
        await deferToThread(box.run, python, "-m", "venv", "--system-site-packages", "--without-pip",
                            "/opt/llmport-agent")
        exe = "/opt/llmport-agent/bin/llmport-agent"
        good = (f"#!/bin/sh\nexport PYTHONPATH={ROOT} LLMPORT_TEST_BUILD=1\n"
                "exec /opt/llmport-agent/bin/python -m llmport_agent.cli \"$@\"\n")
        await deferToThread(box.write, exe, good, 0o755)
        env = {"BACKEND_URL": b.url, "AGENT_ID": agent_id, "HOST": "127.0.0.1", "OPS_PORT": "0",
               "ENROLLMENT_TOKEN": b.mint_token()["token"], "RECONNECT_MIN_SEC": "0.2", "RECONNECT_MAX_SEC": "1"}
        cli = ["/opt/llmport-agent/bin/python", "-m", "llmport_agent.cli", "start"]
        await deferToThread(box.run, "env", *(f"LLM_PORT_NODE_AGENT_{k}={v}" for k, v in env.items()), *cli)
        pid = await self.up(box, b, agent_id)
        node_id = b.node_by_agent_id(agent_id)["id"]  # type: ignore[index]
        unit = (await deferToThread(box.run, "cat", "/etc/systemd/system/" + UNIT)).stdout
        env_file = (await deferToThread(box.run, "cat", "/etc/llmport-agent.env")).stdout
        # The new build as llm-port's install script puts it in place (install -m 0755): it exits at once.
        self.allow_anomalies("stream", "the previous build's stream closes while the broken one is tried")
        await deferToThread(box.write, "/opt/new-build", "#!/bin/sh\necho this build is broken >&2\nexit 1\n", 0o755)
        await deferToThread(box.run, "install", "-m", "0755", "/opt/new-build", exe)
        done = await deferToThread(box.run, "env", "LLM_PORT_NODE_AGENT_LOG_LEVEL=debug", *cli, check=False)
        self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
        self.assertEqual(len(done.stderr.strip().splitlines()), 1, done.stderr)
        self.assertIn("systemctl restart failed", done.stderr)
        self.assertIn(f"the previous executable (kept as {exe}.previous), the unit and the configuration were "
                      "put back as they were and the agent was started again with them", done.stderr)
        self.assertIn("journalctl -u llmport-agent -n 50", done.stderr)
        self.assertEqual((await deferToThread(box.run, "cat", exe)).stdout, good)
        self.assertEqual((await deferToThread(box.run, "cat", "/etc/systemd/system/" + UNIT)).stdout, unit)
        self.assertEqual((await deferToThread(box.run, "cat", "/etc/llmport-agent.env")).stdout, env_file)
        await b.wait_for(lambda: self._restarted(box, pid), 60)
        pid2 = await self.up(box, b, agent_id)
        self.assertEqual(await deferToThread(self._build_of, box, pid2), "1")
        self.assertEqual(b.node_by_agent_id(agent_id)["id"], node_id)  # type: ignore[index]
        self.assertEqual(len(b.state.nodes), 1)  # type: ignore[attr-defined]
        journal = await deferToThread(box.run, "journalctl", "-u", UNIT, "--no-pager", "-o", "cat")
        self.assertIn("this build is broken", journal.stdout)
        await deferToThread(box.run, "systemctl", "stop", UNIT)

    def _build_of(self, box: BootedSystemd, pid: str) -> str:
        environ = box.run("cat", f"/proc/{pid}/environ").stdout
        for item in environ.split("\0"):
            if item.startswith("LLMPORT_TEST_BUILD="):
                return item.split("=", 1)[1]
        return ""


_ = reactor
