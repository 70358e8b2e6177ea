"""
C{start --user NAME} makes the model store and state directories and gives them to that user:
what it chowns is the directory it just made, never a link put in its place (a user who can
write the parent swapping the new directory for a link to a root file would get that file).
"""

from __future__ import annotations

import os

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from llmport_agent.host import installer


class MakedirsTests(SynchronousTestCase):
    def test_a_link_swapped_in_after_mkdir_is_not_chowned(self) -> None:
        if os.geteuid() != 0:
            raise SkipTest("chown to another user needs root")
        base = os.path.abspath(self.mktemp())
        os.makedirs(base)
        victim = os.path.join(base, "victim")
        with open(victim, "w") as f:
            f.write("root's\n")
        target = os.path.join(base, "store")
        real_mkdir = os.mkdir

        def racing_mkdir(path: str, mode: int = 0o777, **kw: object) -> None:
            real_mkdir(path, mode)
            if path == target:  # the other user's move between the mkdir and the chown
                os.rmdir(path)
                os.symlink(victim, path)

        self.patch(installer.os, "mkdir", racing_mkdir)
        undo = installer._Undo()
        self.assertRaises(OSError, installer._makedirs, target, undo, 0o755, 65534, 65534)
        self.assertEqual(os.stat(victim).st_uid, 0)

    def test_made_directories_belong_to_the_user(self) -> None:
        if os.geteuid() != 0:
            raise SkipTest("chown to another user needs root")
        base = os.path.abspath(self.mktemp())
        os.makedirs(base)
        target = os.path.join(base, "a", "b")
        installer._makedirs(target, installer._Undo(), 0o700, 65534, 65534)
        for d in (os.path.join(base, "a"), target):
            st = os.lstat(d)
            self.assertEqual((st.st_uid, st.st_gid, st.st_mode & 0o777), (65534, 65534, 0o700))


class StatusTests(SynchronousTestCase):
    def test_what_answers_on_the_ops_port_reaches_the_terminal_without_escapes(self) -> None:
        """
        `sudo llmport-agent status` reads /readyz from the loopback ops port, where any local
        user can listen while the agent is down: its words are shown without control characters,
        and a body of the wrong shape does not crash it.
        """
        from llmport_agent.core.config import load_config
        from tests.test_installer import Host

        esc = "\x1b]0;owned\x07\x1b[2J"
        body = {"status": "ok" + esc, "ready": True,
                "agent": {"version": esc, "node_id": esc, "heartbeat_status": esc, "workloads": esc},
                "checks": {"session" + esc: {"ok": True, "detail": esc}, "bad": "not an object"}}
        h = Host(self, systemd=False)
        from llmport_agent.ops import probe as opsprobe

        # Trusted (the agent itself): its words are still cleaned.
        self.patch(opsprobe, "probe", lambda port, state, **kw: opsprobe.OpsAnswer(True, body, True, 4242))
        config = load_config({"LLM_PORT_NODE_AGENT_BACKEND_URL": "http://127.0.0.1:9",
                              "LLM_PORT_NODE_AGENT_STATE_PATH": os.path.join(h.root, "state.json")})
        rc = installer.Installer(h.system()).status(config)
        out = h.out.getvalue()
        self.assertEqual(rc, 0, out)
        self.assertNotIn("\x1b", out)
        self.assertIn("agent:      ok?]0;owned??[2J (version", out)
        self.assertIn("BAD bad", out)
        body["checks"] = ["not", "a", "mapping"]
        body["agent"] = "nor this"
        self.assertEqual(installer.Installer(h.system()).status(config), 0)
