"""
C{start --user} and C{join} under a real systemd as PID 1 (L{tests.support.systemd_pid1}), with
login sessions: the system bus, polkit and logind run inside the private /run, a user created in
the private /etc (home under the private /var/lib) logs in with C{runuser -l} (pam_systemd, so
logind starts its C{user@.service}). The agent runs from a copy of this tree under the private
/opt. Each test checks at the end that the host's /etc/passwd, /home, linger directory and /tmp
were not touched. Skips with one line when not root or systemd is missing; fails under CI=true.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import time
from typing import Any

from twisted.internet import reactor
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, TestCase

from tests.agentharness import AnomalyGuard
from tests.support.systemd_pid1 import BootedSystemd, sessions_unavailable, unavailable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNIT = "llmport-agent.service"
USER = "llmnode"
VENV = "/opt/llmport-agent"
EXE = VENV + "/bin/llmport-agent"
CLI = [EXE]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HostUntouched:
    """What the host has before a test, compared after it (the namespace's writes stay inside)."""

    def __init__(self, base: str) -> None:
        self.passwd = self._read("/etc/passwd")
        self.group = self._read("/etc/group")
        self.home = self._list("/home")
        self.mail = self._list("/var/mail")  # not overlaid: useradd must not make a spool there
        self.linger = self._linger()
        self.sentinel = os.path.join("/tmp", "llmport-pid1-sentinel-" + os.path.basename(base))
        with open(self.sentinel, "w") as f:
            f.write("still here\n")

    @staticmethod
    def _read(path: str) -> str:
        with open(path) as f:
            return f.read()

    @staticmethod
    def _list(path: str) -> list[str] | None:
        return sorted(os.listdir(path)) if os.path.isdir(path) else None

    @staticmethod
    def _linger() -> list[str]:
        d = "/var/lib/systemd/linger"
        return sorted(os.listdir(d)) if os.path.isdir(d) else []

    def check(self, test: TestCase) -> None:
        try:
            test.assertEqual(self._read("/etc/passwd"), self.passwd)
            test.assertEqual(self._read("/etc/group"), self.group)
            test.assertEqual(self._list("/home"), self.home)
            test.assertEqual(self._list("/var/mail"), self.mail)
            test.assertEqual(self._linger(), self.linger)
            test.assertTrue(os.path.exists(self.sentinel), "the host's /tmp was emptied")
        finally:
            if os.path.exists(self.sentinel):
                os.unlink(self.sentinel)


class SessionTests(AnomalyGuard, TestCase):
    timeout = 180

    def setUp(self) -> None:
        why = unavailable() or sessions_unavailable()
        if why:
            if os.environ.get("CI") == "true":
                raise AssertionError(why)
            raise SkipTest(why)

    async def boot(self) -> BootedSystemd:
        base = os.path.join(ROOT, "_trial_temp", "pid1-" + os.urandom(4).hex())
        host = HostUntouched(base)
        # Last cleanup to run: after the namespace is gone (cleanups run in reverse order).
        self.addCleanup(host.check, self)
        box = BootedSystemd(base, sessions=True)
        self.addCleanup(box.stop)
        await deferToThread(box.wait_booted, 60)
        await deferToThread(box.start_sessions)
        # The agent: this tree copied where any user can read it, a venv, the executable wrapper.
        python = os.path.realpath(sys.executable)
        await deferToThread(self._reachable, box, sys.base_prefix)
        await deferToThread(box.run, python, "-m", "venv", "--system-site-packages", "--without-pip", VENV)
        await deferToThread(box.run, "mkdir", "-p", VENV + "/src")
        await deferToThread(box.run, "cp", "-r", os.path.join(ROOT, "llmport_agent"), VENV + "/src/llmport_agent")
        await deferToThread(box.run, "chmod", "-R", "a+rX", VENV)
        await deferToThread(box.write, EXE, f"#!/bin/sh\nexport PYTHONPATH={VENV}/src\n"
                            f"exec {VENV}/bin/python -m llmport_agent.cli \"$@\"\n", 0o755)
        return box

    def _reachable(self, box: BootedSystemd, prefix: str) -> None:
        """
        An interpreter under root's home (pyenv), which the user cannot enter: inside the mount
        namespace only, a tmpfs (0755) over /root holding the interpreter's top directory bound
        at the same path (nothing on the host changes).
        """
        parts = os.path.realpath(prefix).split("/")
        if len(parts) < 3 or parts[1] != "root":
            return
        top = "/root/" + parts[2]
        box.run("sh", "-c", 'mkdir -p /run/hostroot && mount --bind /root /run/hostroot && '
                'mount -t tmpfs -o mode=755 tmpfs /root && mkdir -p "$1" && mount --bind "/run/hostroot/${1#/root/}" "$1" '
                '&& umount /run/hostroot', "sh", top)

    def as_user(self, box: BootedSystemd, *args: str, env: dict[str, str] | None = None,
                check: bool = True) -> Any:
        """A login of the user (runuser -l: PAM with pam_systemd, a logind session); it ends with the command."""
        words = ["env", *(f"{k}={v}" for k, v in (env or {}).items()), *args] if env else list(args)
        return box.run("runuser", "-l", USER, "-c", shlex.join(words), check=check)

    def user_systemctl(self, box: BootedSystemd, uid: int, *args: str) -> Any:
        """The user's manager asked without a new login (no session: what linger keeps is seen)."""
        return box.run("runuser", "-u", USER, "--", "env", f"XDG_RUNTIME_DIR=/run/user/{uid}",
                       f"DBUS_SESSION_BUS_ADDRESS=unix:path=/run/user/{uid}/bus", "systemctl", "--user",
                       *args, check=False)

    def user_props(self, box: BootedSystemd, uid: int) -> dict[str, str]:
        out = self.user_systemctl(box, uid, "show", UNIT, "--property=ActiveState,MainPID,UnitFileState").stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def sessions(self, box: BootedSystemd) -> list[str]:
        out = box.run("loginctl", "list-sessions", "--no-legend", "--no-pager").stdout
        return [line for line in out.splitlines() if line.strip()]

    def stat(self, box: BootedSystemd, path: str) -> tuple[str, str]:
        """(octal mode, owner) of a path inside."""
        mode, owner = box.run("stat", "-c", "%a %U", path).stdout.split()
        return mode, owner

    async def test_start_user_under_the_users_systemd_with_linger(self) -> None:
        box = await self.boot()
        uid = await deferToThread(box.add_user, USER)
        home = f"/var/lib/{USER}-home"
        b = await self.start_watched_backend()
        agent_id = "agent-" + os.urandom(4).hex()
        port = _free_port()
        env = {"LLM_PORT_NODE_AGENT_" + k: v for k, v in {
            "BACKEND_URL": b.url, "AGENT_ID": agent_id, "HOST": "127.0.0.1", "OPS_PORT": str(port),
            "ENROLLMENT_TOKEN": b.mint_token()["token"], "RECONNECT_MIN_SEC": "0.2",
            "RECONNECT_MAX_SEC": "1", "GPU_SOURCE": "none"}.items()}
        # A rootless engine's socket in the user's runtime directory (nothing answers on it), made
        # in the same login as `start --user` (the directory goes with the user's last session).
        sock = f"/run/user/{uid}/docker.sock"
        bind = f"import socket; socket.socket(socket.AF_UNIX).bind({sock!r})"
        login = (f"{VENV}/bin/python -c {shlex.quote(bind)} && exec "
                 + shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), *CLI, "start", "--user"]))
        done = await deferToThread(box.run, "runuser", "-l", USER, "-c", login)
        said = done.stdout + done.stderr
        self.assertIn(f"running under systemd (as a user service of {USER}, executable {EXE})", said)
        self.assertNotIn("linger could not be enabled", said)
        state_path = f"{home}/.local/share/llmport-agent/state.json"
        self.assertIn(f"user mode: LLM_PORT_NODE_AGENT_STATE_PATH={state_path}", said)
        # /srv is root's (a tmpfs inside): the model store goes to the user's data directory.
        self.assertIn(f"user mode: LLM_PORT_NODE_AGENT_MODEL_STORE={home}/.local/share/llmport-agent/models", said)
        # Docker's own socket is not this user's (no docker group, none inside): the rootless one.
        self.assertIn(f"user mode: DOCKER_HOST=unix://{sock}", said)
        # The original's layout, the user's own files.
        unit_path = f"{home}/.config/systemd/user/{UNIT}"
        env_path = f"{home}/.config/llmport-agent/agent.env"
        self.assertEqual(await deferToThread(self.stat, box, env_path), ("600", USER))
        self.assertEqual(await deferToThread(self.stat, box, unit_path), ("644", USER))
        unit = (await deferToThread(box.run, "cat", unit_path)).stdout
        self.assertIn(f"ExecStart={EXE} run\n", unit)
        self.assertIn(f"EnvironmentFile={env_path}\n", unit)
        self.assertIn("WantedBy=default.target\n", unit)
        self.assertNotIn("User=", unit)
        # Linger, as logind keeps it (the private /var/lib).
        linger = await deferToThread(box.run, "loginctl", "show-user", USER, "--property=Linger")
        self.assertEqual(linger.stdout.strip(), "Linger=yes")
        # The agent under the user's manager; the backend sees the node (degraded: no Docker engine).
        await b.wait_for(lambda: (b.node_by_agent_id(agent_id) or {}).get("status") in ("healthy", "degraded"), 60)
        props = await deferToThread(self.user_props, box, uid)
        self.assertEqual((props["ActiveState"], props["UnitFileState"]), ("active", "enabled"), props)
        pid = props["MainPID"]
        self.assertEqual((await deferToThread(self.stat, box, f"/proc/{pid}"))[1], USER)
        node_id = b.node_by_agent_id(agent_id)["id"]  # type: ignore[index]
        self.assertEqual(await deferToThread(self.stat, box, state_path), ("600", USER))
        with_state = json.loads((await deferToThread(box.run, "cat", state_path)).stdout)
        self.assertEqual(with_state["node_id"], node_id)
        # The login that started it is over: with linger the user manager and the agent stay
        # (logind here stops an unlingered user's manager 1 s after its last session).
        await b.wait_for(lambda: not self.sessions(box), 30)
        await deferToThread(time.sleep, 4)
        self.assertEqual((await deferToThread(box.run, "systemctl", "is-active", f"user@{uid}.service",
                                              check=False)).stdout.strip(), "active")
        props = await deferToThread(self.user_props, box, uid)
        self.assertEqual((props["ActiveState"], props["MainPID"]), ("active", pid))
        # What works without root: `status --user` reads the user's unit and the agent's readiness.
        status = await deferToThread(self.as_user, box, *CLI, "status", "--user", check=False)
        self.assertIn("service:    active (running)", status.stdout, status.stdout + status.stderr)
        self.assertIn(f"node id {node_id}", status.stdout)
        self.assertIn("BAD engine   Docker engine at unix://" + sock, status.stdout)
        self.assertIn(sock, status.stdout)
        journal = await deferToThread(box.run, "journalctl", f"_SYSTEMD_USER_UNIT={UNIT}", "--no-pager", "-o", "cat")
        said = [line for line in journal.stdout.splitlines() if "Docker engine at unix://" + sock in line]
        self.assertTrue(said and "the node reports degraded until it answers" in said[0], journal.stdout[-2000:])
        await b.wait_for(lambda: b.node_by_agent_id(agent_id)["status"] == "degraded", 30)  # type: ignore[index]
        # stop --user: stopped and disabled, a clean close.
        stopped = await deferToThread(self.as_user, box, *CLI, "stop", "--user")
        self.assertIn("llmport-agent stopped and disabled", stopped.stdout)
        self.assertIn("llmport-agent start --user", stopped.stdout)
        self.assertNotIn("sudo", stopped.stdout)
        props = await deferToThread(self.user_props, box, uid)
        self.assertEqual((props["ActiveState"], props["UnitFileState"]), ("inactive", "disabled"))
        await b.wait_for(lambda: any(n == node_id for n, _ in b.stream_closes), 10)  # type: ignore[attr-defined]
        self.assertEqual([c for n, c in b.stream_closes if n == node_id], [1000])  # type: ignore[attr-defined]

    async def rejoin(self, b: Any, before: int, running: Any) -> Any:
        """A rerun of join on the enrolled node: done, or failed at once when it files a new request."""
        await b.wait_for(lambda: running.called or len(b.onboarding.requests) > before, 90)
        self.assertEqual(len(b.onboarding.requests), before, "the rerun filed a new join request")
        return await running

    async def test_join_then_a_rerun_upgrades(self) -> None:
        """`join URL` as root: the code, the approval, the credential, the unit active; again: a member, restarted."""
        box = await self.boot()
        b = await self.start_watched_backend()
        agent_id = "agent-" + os.urandom(4).hex()
        env = ["env", *(f"LLM_PORT_NODE_AGENT_{k}={v}" for k, v in {
            "AGENT_ID": agent_id, "HOST": "127.0.0.1", "OPS_PORT": "0", "GPU_SOURCE": "none",
            "RECONNECT_MIN_SEC": "0.2", "RECONNECT_MAX_SEC": "1"}.items())]
        hostport = b.url.split("://", 1)[1]  # as a person types it (http only when said: the stand-in is http)
        joined = deferToThread(box.run, *env, *CLI, "join", "--insecure-http", hostport, check=False)
        await b.wait_for(lambda: bool(b.onboarding.pending()) or joined.called, 60)
        if joined.called:
            early = await joined
            self.fail(f"join ended before asking: {early.stdout}{early.stderr}")
        row = b.onboarding.pending()[0]
        self.assertEqual(row.agent_id, agent_id)
        b.onboarding.decide(row.code, True)
        done = await joined
        said = done.stdout + done.stderr
        if done.returncode:
            journal = await deferToThread(box.run, "journalctl", "-u", UNIT, "--no-pager", "-o", "cat")
            said += journal.stdout[-3000:]
        self.assertEqual(done.returncode, 0, said[-5000:])
        self.assertIn(f"Join code:  {row.code}", said)
        self.assertIn("Approved: this machine is node", said)
        self.assertIn("running under systemd (as root, executable " + EXE, said)
        await b.wait_for(lambda: (b.node_by_agent_id(agent_id) or {}).get("status") in ("healthy", "degraded"), 60)
        node_id = b.node_by_agent_id(agent_id)["id"]  # type: ignore[index]
        props = await deferToThread(box.show, UNIT, "ActiveState", "MainPID", "UnitFileState")
        self.assertEqual((props["ActiveState"], props["UnitFileState"]), ("active", "enabled"))
        pid = props["MainPID"]
        self.assertEqual(await deferToThread(self.stat, box, "/etc/llmport-agent.env"), ("600", "root"))
        values = (await deferToThread(box.run, "cat", "/etc/llmport-agent.env")).stdout
        self.assertIn(f"LLM_PORT_NODE_AGENT_BACKEND_URL={b.url}\n", values)
        self.assertNotIn("ENROLLMENT_TOKEN", values)
        state = json.loads((await deferToThread(box.run, "cat", "/var/lib/llmport-agent/state.json")).stdout)
        self.assertEqual(state["node_id"], node_id)
        self.assertNotIn("pending_join", state)
        # Again, on the enrolled node: a member (whoami), no new request, the unit restarted.
        self.allow_anomalies("stream", "the old process's stream may still be open when the restarted one connects")
        before = len(b.onboarding.requests)
        again = await self.rejoin(b, before, deferToThread(box.run, *CLI, "join", b.url, check=False))
        said = again.stdout + again.stderr
        self.assertEqual(again.returncode, 0, said[-3000:])
        self.assertIn("Already a member", said)
        self.assertNotIn("Join code", said)
        self.assertEqual(len(b.onboarding.requests), before)
        props = await deferToThread(box.show, UNIT, "ActiveState", "MainPID")
        self.assertEqual(props["ActiveState"], "active")
        self.assertNotEqual(props["MainPID"], pid)
        await b.wait_for(lambda: b.node_by_agent_id(agent_id)["status"] in ("healthy", "degraded"), 60)  # type: ignore[index]
        self.assertEqual(len(b.state.nodes), 1)  # type: ignore[attr-defined]
        await deferToThread(box.run, "systemctl", "stop", UNIT)

    async def test_join_user(self) -> None:
        """`join --user URL` as the user: approved, the user's unit active; again: a member, restarted."""
        box = await self.boot()
        uid = await deferToThread(box.add_user, USER)
        home = f"/var/lib/{USER}-home"
        b = await self.start_watched_backend()
        agent_id = "agent-" + os.urandom(4).hex()
        env = {"LLM_PORT_NODE_AGENT_" + k: v for k, v in {
            "AGENT_ID": agent_id, "HOST": "127.0.0.1", "OPS_PORT": "0", "GPU_SOURCE": "none",
            "RECONNECT_MIN_SEC": "0.2", "RECONNECT_MAX_SEC": "1"}.items()}
        joined = deferToThread(self.as_user, box, *CLI, "join", "--user", "--insecure-http", b.url, env=env,
                               check=False)
        await b.wait_for(lambda: bool(b.onboarding.pending()) or joined.called, 60)
        if joined.called:
            early = await joined
            self.fail(f"join --user ended before asking: {early.stdout}{early.stderr}")
        row = b.onboarding.pending()[0]
        self.assertEqual(row.agent_id, agent_id)
        b.onboarding.decide(row.code, True)
        done = await joined
        said = done.stdout + done.stderr
        self.assertEqual(done.returncode, 0, said[-3000:])
        self.assertIn(f"Join code:  {row.code}", said)
        self.assertIn(f"running under systemd (as a user service of {USER}", said)
        self.assertNotIn("linger could not be enabled", said)
        await b.wait_for(lambda: (b.node_by_agent_id(agent_id) or {}).get("status") in ("healthy", "degraded"), 60)
        node_id = b.node_by_agent_id(agent_id)["id"]  # type: ignore[index]
        props = await deferToThread(self.user_props, box, uid)
        self.assertEqual((props["ActiveState"], props["UnitFileState"]), ("active", "enabled"), props)
        env_path = f"{home}/.config/llmport-agent/agent.env"
        self.assertEqual(await deferToThread(self.stat, box, env_path), ("600", USER))
        values = (await deferToThread(box.run, "cat", env_path)).stdout
        self.assertIn(f"LLM_PORT_NODE_AGENT_BACKEND_URL={b.url}\n", values)
        self.assertNotIn("ENROLLMENT_TOKEN", values)
        state_path = f"{home}/.local/share/llmport-agent/state.json"
        state = json.loads((await deferToThread(box.run, "cat", state_path)).stdout)
        self.assertEqual(state["node_id"], node_id)
        self.allow_anomalies("stream", "the old process's stream may still be open when the restarted one connects")
        before = len(b.onboarding.requests)
        again = await self.rejoin(b, before, deferToThread(self.as_user, box, *CLI, "join", "--user", b.url,
                                                           check=False))
        said = again.stdout + again.stderr
        self.assertEqual(again.returncode, 0, said[-3000:])
        self.assertIn("Already a member", said)
        self.assertEqual(len(b.onboarding.requests), before)
        props2 = await deferToThread(self.user_props, box, uid)
        self.assertEqual(props2["ActiveState"], "active")
        self.assertNotEqual(props2["MainPID"], props["MainPID"])
        await deferToThread(self.as_user, box, *CLI, "stop", "--user")


_ = reactor
