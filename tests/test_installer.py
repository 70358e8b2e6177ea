"""
`llmport-agent start / stop / status / config --set`: against a stand-in `systemctl` on PATH that
records its calls, without one, without root, from an unstable path; nothing left behind on a
failure; the unit as `start` writes it passes `systemd-analyze verify`.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import sys
from typing import Any

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from llmport_agent.core.config import ConfigError
from llmport_agent.host.installer import EnvFile, Installer, System, render_unit, unit_template

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STAND_IN = """#!/bin/sh
# A stand-in systemctl: records its arguments, fails where told.
echo "$*" >> "$SYSTEMCTL_LOG"
[ "$1" = --user ] && shift
case " $* " in
  *" $SYSTEMCTL_FAIL "*) echo "Failed to $1 llmport-agent.service: stand-in failure" >&2; exit 1;;
esac
case "$1" in
  show) printf 'LoadState=loaded\\nActiveState=active\\nSubState=running\\nUnitFileState=enabled\\nMainPID=4242\\nNRestarts=0\\nExecMainStatus=0\\nStatusText=connected, node n-1\\n';;
  is-active) [ -n "$SYSTEMCTL_ACTIVE" ] || exit 3;;
  is-enabled) exit 1;;
esac
exit 0
"""

TOKEN = "tok-" + "z" * 28


class Host:
    """A fake root with /run/systemd/system, a stand-in systemctl and an executable."""

    def __init__(self, test: SynchronousTestCase, systemd: bool = True, systemctl: bool = True) -> None:
        self.root = os.path.abspath(test.mktemp())
        os.makedirs(os.path.join(self.root, "etc/systemd/system"))
        if systemd:
            os.makedirs(os.path.join(self.root, "run/systemd/system"))
        self.bin = os.path.join(self.root, "bin")
        os.makedirs(self.bin)
        self.log = os.path.join(self.root, "systemctl.log")
        if systemctl:
            path = os.path.join(self.bin, "systemctl")
            with open(path, "w") as f:
                f.write(STAND_IN)
            os.chmod(path, 0o755)
        self.exe = "/opt/llmport-agent/bin/llmport-agent"
        self.fail_on = ""
        self.active = ""
        self.out = io.StringIO()
        self.err = io.StringIO()

    def system(self, euid: int = 0, environ: dict[str, str] | None = None, exe: str | None = None,
               user_mode: bool = False, access: Any = None) -> System:
        env = {"PATH": self.bin, "SYSTEMCTL_LOG": self.log, "SYSTEMCTL_FAIL": self.fail_on,
               "SYSTEMCTL_ACTIVE": self.active}
        env.update(environ or {})
        return System(
            root=self.root,
            environ=env,
            geteuid=lambda: euid,
            which=lambda name: shutil.which(name, path=self.bin),
            executable=exe or self.exe,
            one_process=True,
            user_mode=user_mode,
            access=access or os.access,
            out=self.out,
            err=self.err,
        )

    def calls(self) -> list[str]:
        if not os.path.exists(self.log):
            return []
        with open(self.log) as f:
            return f.read().splitlines()

    def path(self, p: str) -> str:
        return os.path.join(self.root, p.lstrip("/"))

    def files(self) -> list[str]:
        out = []
        for d, _, names in os.walk(self.root):
            for n in names:
                rel = os.path.relpath(os.path.join(d, n), self.root)
                if not rel.startswith(("bin/", "systemctl.log")):
                    out.append(rel)
        dirs = [os.path.relpath(d, self.root) for d, _, _ in os.walk(self.root)]
        return sorted(out + [d + "/" for d in dirs if d.startswith(("srv", "var"))])


def agent_vars(**extra: str) -> dict[str, str]:
    env = {"LLM_PORT_NODE_AGENT_BACKEND_URL": "https://llm-port.example.internal",
           "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN": TOKEN}
    env.update({"LLM_PORT_NODE_AGENT_" + k: v for k, v in extra.items()})
    return env


class StartTests(SynchronousTestCase):
    def test_start_installs_configures_and_starts(self) -> None:
        """Env file 0600 from the variables, the unit with the real executable, daemon-reload, enable, restart."""
        h = Host(self)
        rc = Installer(h.system(environ=agent_vars())).start()
        self.assertEqual(rc, 0, h.err.getvalue())
        env_path = h.path("/etc/llmport-agent.env")
        self.assertEqual(stat.S_IMODE(os.stat(env_path).st_mode), 0o600)
        values = EnvFile.parse(open(env_path).read()).values()
        self.assertEqual(values["LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN"], TOKEN)
        unit = open(h.path("/etc/systemd/system/llmport-agent.service")).read()
        self.assertIn(f"ExecStart={h.exe} run\n", unit)
        self.assertIn("NotifyAccess=main\n", unit)
        self.assertIn("Type=notify\n", unit)
        self.assertIn("ReadWritePaths=-/srv/llm-port/models\n", unit)
        self.assertTrue(os.path.isdir(h.path("/srv/llm-port/models")))
        self.assertEqual(h.calls()[-3:], ["daemon-reload", "enable --quiet llmport-agent.service",
                                          "restart llmport-agent.service"])
        out = h.out.getvalue()
        self.assertIn("journalctl -u llmport-agent -f", out)
        self.assertNotIn(TOKEN, out + h.err.getvalue())

    def test_existing_env_file_is_kept_merged_and_tightened(self) -> None:
        """llm-port's installer writes the file 0644: start keeps its values and makes it 0600."""
        h = Host(self)
        env_path = h.path("/etc/llmport-agent.env")
        with open(env_path, "w") as f:
            f.write("# written by llmport deploy\nLLM_PORT_NODE_AGENT_BACKEND_URL=http://10.0.0.1:8000\n"
                    f"LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN={TOKEN}\n")
        os.chmod(env_path, 0o644)
        rc = Installer(h.system(environ={"LLM_PORT_NODE_AGENT_MODEL_STORE": "/data/models"})).start()
        self.assertEqual(rc, 0, h.err.getvalue())
        text = open(env_path).read()
        self.assertIn("# written by llmport deploy", text)
        self.assertIn("LLM_PORT_NODE_AGENT_BACKEND_URL=http://10.0.0.1:8000", text)
        self.assertIn("LLM_PORT_NODE_AGENT_MODEL_STORE=/data/models", text)
        self.assertEqual(stat.S_IMODE(os.stat(env_path).st_mode), 0o600)
        unit = open(h.path("/etc/systemd/system/llmport-agent.service")).read()
        self.assertIn("ReadWritePaths=-/data/models\n", unit)
        self.assertIn("ExecStartPre=+/bin/mkdir -p /data/models\n", unit)

    def test_binary_gets_notify_access_all(self) -> None:
        """The one-file executable is two processes: its notifications come from the child."""
        h = Host(self)
        system = h.system(environ=agent_vars())
        system.one_process = False
        self.assertEqual(Installer(system).start(), 0, h.err.getvalue())
        unit = open(h.path("/etc/systemd/system/llmport-agent.service")).read()
        self.assertIn("NotifyAccess=all\n", unit)

    def test_dedicated_user(self) -> None:
        """--user: User=, Group=, SupplementaryGroups=docker (and the journal group where present)."""
        import grp
        import pwd

        try:
            grp.getgrnam("docker")
        except KeyError:
            raise SkipTest("no docker group on this host") from None
        user = pwd.getpwuid(os.getuid()).pw_name
        h = Host(self)
        self.assertEqual(Installer(h.system(environ=agent_vars())).start(user=user), 0, h.err.getvalue())
        unit = open(h.path("/etc/systemd/system/llmport-agent.service")).read()
        self.assertIn(f"User={user}\n", unit)
        self.assertIn("SupplementaryGroups=docker", unit)

    def test_unknown_user(self) -> None:
        h = Host(self)
        rc = Installer(h.system(environ=agent_vars())).start(user="no-such-user-xyz")
        self.assertEqual(rc, 1)
        self.assertIn("no user 'no-such-user-xyz'", h.err.getvalue())
        self.assertEqual(h.files(), [])

    def assertRefused(self, h: Host, rc: int, expected_rc: int, words: str) -> None:
        self.assertEqual(rc, expected_rc, h.err.getvalue())
        err = h.err.getvalue()
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertIn(words, err)
        self.assertEqual(h.files(), [])

    def test_not_root(self) -> None:
        h = Host(self)
        self.assertRefused(h, Installer(h.system(euid=1000, environ=agent_vars())).start(), 1, "needs root")
        self.assertEqual(h.calls(), [])

    def test_without_systemd(self) -> None:
        """PID 1 is not systemd: one line, nothing written, systemctl never called."""
        h = Host(self, systemd=False)
        self.assertRefused(h, Installer(h.system(environ=agent_vars())).start(), 1, "systemd is not running")
        self.assertEqual(h.calls(), [])

    def test_without_systemctl(self) -> None:
        h = Host(self, systemctl=False)
        self.assertRefused(h, Installer(h.system(environ=agent_vars())).start(), 1, "llmport-agent run")

    def test_unstable_path(self) -> None:
        """A temporary venv: the unit could not see it (PrivateTmp) and it would not survive a reboot."""
        h = Host(self)
        rc = Installer(h.system(environ=agent_vars(), exe="/tmp/venv-x/bin/llmport-agent")).start()
        self.assertRefused(h, rc, 1, "under /tmp")

    def test_no_configuration(self) -> None:
        """No variables and no env file: refused, no empty env file written."""
        h = Host(self)
        self.assertRefused(h, Installer(h.system()).start(), 2, "no configuration")

    def test_invalid_configuration(self) -> None:
        h = Host(self)
        rc = Installer(h.system(environ=agent_vars(HEARTBEAT_INTERVAL_SEC="abc"))).start()
        self.assertRefused(h, rc, 2, "LLM_PORT_NODE_AGENT_HEARTBEAT_INTERVAL_SEC")

    def test_no_token_and_no_credential(self) -> None:
        h = Host(self)
        rc = Installer(h.system(environ={"LLM_PORT_NODE_AGENT_BACKEND_URL": "http://127.0.0.1:1"})).start()
        self.assertRefused(h, rc, 2, "no LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN")

    def test_systemctl_failure_leaves_nothing_behind(self) -> None:
        """restart fails: the unit, the env file and the directories are removed, the unit disabled."""
        h = Host(self)
        h.fail_on = "restart"
        rc = Installer(h.system(environ=agent_vars())).start()
        self.assertEqual(rc, 1)
        self.assertIn("systemctl restart failed", h.err.getvalue())
        self.assertEqual(h.files(), [])
        self.assertIn("disable --quiet llmport-agent.service", h.calls())
        self.assertEqual(h.calls()[-1], "daemon-reload")

    def test_systemctl_failure_restores_previous_files(self) -> None:
        h = Host(self)
        env_path = h.path("/etc/llmport-agent.env")
        with open(env_path, "w") as f:
            f.write(f"LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN={TOKEN}\n")
        os.chmod(env_path, 0o640)
        h.fail_on = "daemon-reload"
        rc = Installer(h.system(environ=agent_vars())).start()
        self.assertEqual(rc, 1)
        self.assertEqual(open(env_path).read(), f"LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN={TOKEN}\n")
        self.assertEqual(stat.S_IMODE(os.stat(env_path).st_mode), 0o640)
        self.assertFalse(os.path.exists(h.path("/etc/systemd/system/llmport-agent.service")))


class UpgradeTests(SynchronousTestCase):
    def test_an_upgrade_restarts(self) -> None:
        """A running agent: start again ends with restart (never `enable --now`), state and env kept."""
        h = Host(self)
        self.assertEqual(Installer(h.system(environ=agent_vars())).start(), 0)
        state = h.path("/var/lib/llmport-agent/state.json")
        os.makedirs(os.path.dirname(state), exist_ok=True)
        with open(state, "w") as f:
            f.write('{"node_id": "n-1", "credential": "c"}')
        env_before = open(h.path("/etc/llmport-agent.env")).read()
        h.active = "1"
        rc = Installer(h.system(environ={}, exe="/opt/llmport-agent-2/bin/llmport-agent")).start()
        self.assertEqual(rc, 0, h.err.getvalue())
        self.assertEqual(h.calls()[-1], "restart llmport-agent.service")
        self.assertFalse([c for c in h.calls() if "--now" in c])
        self.assertEqual(open(h.path("/etc/llmport-agent.env")).read(), env_before)
        self.assertEqual(open(state).read(), '{"node_id": "n-1", "credential": "c"}')
        self.assertIn("ExecStart=/opt/llmport-agent-2/bin/llmport-agent run\n",
                      open(h.path("/etc/systemd/system/llmport-agent.service")).read())

    def test_a_failed_upgrade_puts_the_previous_unit_back_and_starts_it(self) -> None:
        h = Host(self)
        self.assertEqual(Installer(h.system(environ=agent_vars())).start(), 0)
        unit_path = h.path("/etc/systemd/system/llmport-agent.service")
        unit_before = open(unit_path).read()
        env_before = open(h.path("/etc/llmport-agent.env")).read()
        h.active = "1"
        h.fail_on = "restart"
        rc = Installer(h.system(environ=agent_vars(LOG_LEVEL="debug"),
                                exe="/opt/llmport-agent-2/bin/llmport-agent")).start()
        self.assertEqual(rc, 1)
        self.assertEqual(open(unit_path).read(), unit_before)
        self.assertEqual(open(h.path("/etc/llmport-agent.env")).read(), env_before)
        # put back, reloaded, and the previous configuration started again
        self.assertEqual(h.calls()[-2:], ["daemon-reload", "restart llmport-agent.service"])
        self.assertIn("put back as they were", h.err.getvalue())


class UserModeTests(SynchronousTestCase):
    def user_host(self, **env: str) -> tuple[Host, dict[str, str]]:
        h = Host(self)
        home = h.path("/home/ann")
        os.makedirs(home)
        environ = {"HOME": home, **agent_vars(), **env}
        return h, environ

    def test_user_mode_lays_out_the_originals_paths(self) -> None:
        h, environ = self.user_host()
        home = environ["HOME"]
        rc = Installer(h.system(euid=1000, environ=environ, user_mode=True)).start()
        self.assertEqual(rc, 0, h.err.getvalue())
        unit_path = os.path.join(home, ".config/systemd/user/llmport-agent.service")
        env_path = os.path.join(home, ".config/llmport-agent/agent.env")
        self.assertEqual(stat.S_IMODE(os.stat(env_path).st_mode), 0o600)
        values = EnvFile.parse(open(env_path).read()).values()
        state = os.path.join(home, ".local/share/llmport-agent/state.json")
        self.assertEqual(values["LLM_PORT_NODE_AGENT_STATE_PATH"], state)
        self.assertTrue(os.path.isdir(os.path.dirname(state)))
        self.assertFalse(os.path.exists(h.path("/etc/llmport-agent.env")))
        self.assertEqual(h.calls()[-3:], ["--user daemon-reload", "--user enable --quiet llmport-agent.service",
                                          "--user restart llmport-agent.service"])
        unit = open(unit_path).read()
        from llmport_agent.host.installer import ROOT_ONLY_DIRECTIVES

        for line in unit.splitlines():
            self.assertFalse(line.startswith(ROOT_ONLY_DIRECTIVES) and not line.startswith("EnvironmentFile="), line)
        for line in ("Type=notify", "WatchdogSec=60", "RestartPreventExitStatus=78 2", "WantedBy=default.target",
                     f"EnvironmentFile={env_path}", f"ExecStart={h.exe} run", "NoNewPrivileges=yes"):
            self.assertIn(line + "\n", unit)
        self.assertIn("journalctl --user -u llmport-agent -f", h.out.getvalue())
        # no loginctl here: one line saying what an administrator runs
        self.assertIn("sudo loginctl enable-linger", h.out.getvalue())

    def test_linger_is_enabled(self) -> None:
        h, environ = self.user_host()
        with open(os.path.join(h.bin, "loginctl"), "w") as f:
            f.write('#!/bin/sh\necho "loginctl $*" >> "$SYSTEMCTL_LOG"\n')
        os.chmod(os.path.join(h.bin, "loginctl"), 0o755)
        rc = Installer(h.system(euid=1000, environ=environ, user_mode=True)).start()
        self.assertEqual(rc, 0, h.err.getvalue())
        self.assertTrue([c for c in h.calls() if c.startswith("loginctl enable-linger ")])
        self.assertNotIn("enable-linger", h.out.getvalue())

    def test_model_store_moves_home_when_srv_is_not_writable(self) -> None:
        h, environ = self.user_host()
        srv = h.path("/srv")
        os.makedirs(srv)
        denied = lambda p, mode: not p.startswith(srv) and os.access(p, mode)  # noqa: E731
        rc = Installer(h.system(euid=1000, environ=environ, user_mode=True, access=denied)).start()
        self.assertEqual(rc, 0, h.err.getvalue())
        store = os.path.join(environ["HOME"], ".local/share/llmport-agent/models")
        values = EnvFile.parse(open(os.path.join(environ["HOME"], ".config/llmport-agent/agent.env")).read()).values()
        self.assertEqual(values["LLM_PORT_NODE_AGENT_MODEL_STORE"], store)
        self.assertTrue(os.path.isdir(store))
        self.assertIn(f"LLM_PORT_NODE_AGENT_MODEL_STORE={store}", h.out.getvalue())

    def test_writable_srv_keeps_the_default_store(self) -> None:
        h, environ = self.user_host()
        rc = Installer(h.system(euid=1000, environ=environ, user_mode=True)).start()
        self.assertEqual(rc, 0, h.err.getvalue())
        values = EnvFile.parse(open(os.path.join(environ["HOME"], ".config/llmport-agent/agent.env")).read()).values()
        self.assertNotIn("LLM_PORT_NODE_AGENT_MODEL_STORE", values)

    def test_rootless_docker_socket(self) -> None:
        h, environ = self.user_host()
        runtime = h.path("/run/user/1000")
        os.makedirs(runtime)
        open(os.path.join(runtime, "docker.sock"), "w").close()
        environ["XDG_RUNTIME_DIR"] = runtime
        no_group = lambda p, mode: not p.endswith("/var/run/docker.sock") and os.access(p, mode)  # noqa: E731
        rc = Installer(h.system(euid=1000, environ=environ, user_mode=True, access=no_group)).start()
        self.assertEqual(rc, 0, h.err.getvalue())
        values = EnvFile.parse(open(os.path.join(environ["HOME"], ".config/llmport-agent/agent.env")).read()).values()
        self.assertEqual(values["DOCKER_HOST"], "unix://" + os.path.join(runtime, "docker.sock"))
        # in the docker group: Docker's own socket, nothing written
        h2, environ2 = self.user_host(XDG_RUNTIME_DIR=runtime)
        os.makedirs(h2.path("/var/run"))
        open(h2.path("/var/run/docker.sock"), "w").close()
        self.assertEqual(Installer(h2.system(euid=1000, environ=environ2, user_mode=True)).start(), 0)
        values = EnvFile.parse(open(os.path.join(environ2["HOME"], ".config/llmport-agent/agent.env")).read()).values()
        self.assertNotIn("DOCKER_HOST", values)

    def test_user_mode_as_root_is_refused(self) -> None:
        h, environ = self.user_host()
        rc = Installer(h.system(euid=0, environ=environ, user_mode=True)).start()
        self.assertEqual(rc, 1)
        self.assertIn("run it as that user", h.err.getvalue())
        self.assertEqual(h.calls(), [])

    def test_stop_user(self) -> None:
        h, environ = self.user_host()
        self.assertEqual(Installer(h.system(euid=1000, environ=environ, user_mode=True)).start(), 0)
        self.assertEqual(Installer(h.system(euid=1000, environ=environ, user_mode=True)).stop(), 0)
        self.assertEqual(h.calls()[-1], "--user disable --now --quiet llmport-agent.service")
        said = h.out.getvalue().splitlines()[-1]
        self.assertIn("`llmport-agent start --user` starts it again", said)
        self.assertNotIn("sudo", said)

    def test_status_user_asks_the_users_manager(self) -> None:
        h, environ = self.user_host()
        Installer(h.system(euid=1000, environ=environ, user_mode=True)).status()
        self.assertTrue(any(c.startswith("--user show llmport-agent.service") for c in h.calls()), h.calls())


class StopStatusTests(SynchronousTestCase):
    def test_stop(self) -> None:
        h = Host(self)
        Installer(h.system(environ=agent_vars())).start()
        self.assertEqual(Installer(h.system()).stop(), 0)
        self.assertEqual(h.calls()[-1], "disable --now --quiet llmport-agent.service")
        self.assertIn("stopped and disabled", h.out.getvalue())

    def test_stop_without_root_or_systemd(self) -> None:
        h = Host(self, systemd=False)
        self.assertEqual(Installer(h.system()).stop(), 1)
        self.assertIn("systemd is not running", h.err.getvalue())
        h2 = Host(self)
        self.assertEqual(Installer(h2.system(euid=1000)).stop(), 1)
        self.assertEqual(h2.calls(), [])

    def test_stop_when_not_installed(self) -> None:
        h = Host(self)
        self.assertEqual(Installer(h.system()).stop(), 0)
        self.assertIn("not installed", h.out.getvalue())
        self.assertEqual(h.calls(), [])

    def test_status_shows_systemd_and_the_state_file(self) -> None:
        """systemd's view (with the agent's STATUS= line) plus the state file when the agent does not answer."""
        h = Host(self)
        state = h.path("/var/lib/llmport-agent/state.json")
        os.makedirs(os.path.dirname(state))
        with open(state, "w") as f:
            json.dump({"credential": "c", "node_id": "n-1"}, f)
        with open(h.path("/etc/llmport-agent.env"), "w") as f:
            f.write("LLM_PORT_NODE_AGENT_OPS_PORT=1\n")
        rc = Installer(h.system()).status()
        out = h.out.getvalue()
        self.assertIn("active (running)", out)
        self.assertIn("its status: connected, node n-1", out)
        self.assertIn("node id n-1", out)
        self.assertIn("not answering", out)
        self.assertEqual(rc, 1)  # running, but the agent does not answer: not ready

    def test_status_without_systemd(self) -> None:
        h = Host(self, systemd=False)
        with open(h.path("/etc/llmport-agent.env"), "w") as f:
            f.write("LLM_PORT_NODE_AGENT_OPS_PORT=0\n")
        rc = Installer(h.system()).status()
        self.assertIn("systemd is not running", h.out.getvalue())
        self.assertEqual(rc, 3)


class ConfigSetTests(SynchronousTestCase):
    def test_set_and_unset(self) -> None:
        h = Host(self)
        inst = Installer(h.system())
        self.assertEqual(inst.edit_config(["BACKEND_URL=https://a.example", f"enrollment_token={TOKEN}"], []), 0)
        env_path = h.path("/etc/llmport-agent.env")
        self.assertEqual(stat.S_IMODE(os.stat(env_path).st_mode), 0o600)
        values = EnvFile.parse(open(env_path).read()).values()
        self.assertEqual(values["LLM_PORT_NODE_AGENT_BACKEND_URL"], "https://a.example")
        out = h.out.getvalue()
        self.assertNotIn(TOKEN, out)
        self.assertIn("takes effect at the next start", out)
        self.assertEqual(inst.edit_config([], ["LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN"]), 0)
        self.assertNotIn("ENROLLMENT_TOKEN", open(env_path).read())

    def test_a_url_password_is_not_shown(self) -> None:
        """`config --set LOKI_URL=https://user:pass@...` writes it, and says so without the password."""
        h = Host(self)
        inst = Installer(h.system())
        self.assertEqual(inst.edit_config(["BACKEND_URL=https://a.example",
                                           "LOKI_URL=https://loki:s3cret-pw@logs.example"], []), 0)
        out = h.out.getvalue()
        self.assertNotIn("s3cret-pw", out)
        self.assertIn("LLM_PORT_NODE_AGENT_LOKI_URL=https://loki:***@logs.example written to", out)
        values = EnvFile.parse(open(h.path("/etc/llmport-agent.env")).read()).values()
        self.assertEqual(values["LLM_PORT_NODE_AGENT_LOKI_URL"], "https://loki:s3cret-pw@logs.example")

    def test_restart_needed_when_running(self) -> None:
        h = Host(self)
        h.active = "1"
        open(h.path("/etc/systemd/system/llmport-agent.service"), "w").close()
        self.assertEqual(Installer(h.system()).edit_config(["LOG_LEVEL=debug"], []), 0)
        self.assertIn("restart needed: sudo systemctl restart llmport-agent", h.out.getvalue())
        h.out.truncate(0)
        self.assertEqual(Installer(h.system()).edit_config(["LOG_LEVEL=debug"], []), 0)
        self.assertIn("unchanged; no restart needed", h.out.getvalue())
        self.assertEqual(Installer(h.system()).edit_config(["MODEL_STORE=/data/m"], []), 0)
        self.assertIn("sudo llmport-agent start", h.out.getvalue())

    def test_invalid_value_changes_nothing(self) -> None:
        """Validated exactly as at start-up: exit 2, one line, the file untouched."""
        h = Host(self)
        env_path = h.path("/etc/llmport-agent.env")
        with open(env_path, "w") as f:
            f.write("LLM_PORT_NODE_AGENT_LOG_LEVEL=INFO\n")
        rc = Installer(h.system()).edit_config(["HEARTBEAT_INTERVAL_SEC=600"], [])
        self.assertEqual(rc, 2)
        self.assertIn("HEARTBEAT_INTERVAL_SEC", h.err.getvalue())
        self.assertEqual(open(env_path).read(), "LLM_PORT_NODE_AGENT_LOG_LEVEL=INFO\n")
        self.assertEqual(Installer(h.system()).edit_config(["NOT_A_SETTING=1"], []), 2)
        self.assertIn("unknown variable", h.err.getvalue())

    def test_quoting_round_trip(self) -> None:
        env = EnvFile.parse('# c\nA="x y \\" z"\nB=\'q\'\nexport C=1\n')
        self.assertEqual(env.values(), {"A": 'x y " z', "B": "q", "C": "1"})
        env.set("A", 'new "v" \\ w')
        self.assertEqual(EnvFile.parse(env.text()).values()["A"], 'new "v" \\ w')


class CommandLineTests(SynchronousTestCase):
    """The same commands through the console script, with a stand-in systemctl on PATH."""

    def run_cli(self, h: Host, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        full = {"PATH": h.bin + ":/usr/bin:/bin", "LLMPORT_AGENT_SYSTEM_ROOT": h.root,
                "SYSTEMCTL_LOG": h.log, "PYTHONPATH": ROOT, "HOME": h.root}
        full.update(env)
        return subprocess.run([sys.executable, "-m", "llmport_agent.cli", *args], env=full,
                              capture_output=True, text=True, timeout=60, cwd=ROOT)

    def test_start_and_config_through_the_cli(self) -> None:
        if os.geteuid() != 0:
            raise SkipTest("start needs root")
        h = Host(self)
        done = self.run_cli(h, "start", **agent_vars())
        # The console script is next to the interpreter in this environment, or on PATH.
        if "no llmport-agent executable" in done.stderr:
            raise SkipTest("llmport-agent is not installed next to this interpreter")
        from llmport_agent.host.installer import unstable_place

        if unstable_place(sys.executable):
            # This interpreter lives under /tmp (a throw-away venv): start must refuse it.
            self.assertEqual(done.returncode, 1)
            self.assertIn("under /tmp", done.stderr)
            self.assertEqual(h.calls(), [])
            return
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("daemon-reload", h.calls())
        done = self.run_cli(h, "config", "--set", "LOG_LEVEL=bogus")
        self.assertEqual(done.returncode, 2)
        self.assertEqual(len(done.stderr.strip().splitlines()), 1)


class VerifyTests(SynchronousTestCase):
    def test_systemd_analyze_verify(self) -> None:
        """The unit as `start` writes it (a real executable path) passes systemd-analyze verify."""
        from tests.support.packages import require_package

        require_package("systemd", "systemd-analyze")
        analyze = shutil.which("systemd-analyze")
        assert analyze is not None
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        exe = os.path.join(d, "llmport-agent")
        with open(exe, "w") as f:
            f.write("#!/bin/sh\nexit 0\n")
        os.chmod(exe, 0o755)
        for one_process, user in ((True, None), (False, None), (True, "llmport")):
            unit = os.path.join(d, "llmport-agent.service")
            with open(unit, "w") as f:
                f.write(render_unit(unit_template(), executable=exe, one_process=one_process,
                                    model_store="/srv/llm-port/models", state_dir="/var/lib/llmport-agent",
                                    user=user, group=user, supplementary=("docker",) if user else ()))
            done = subprocess.run([analyze, "verify", unit], capture_output=True, text=True, timeout=60)
            problems = [line for line in (done.stdout + done.stderr).splitlines()
                        if "llmport-agent" in line and "docker.service" not in line]
            self.assertEqual((done.returncode, problems), (0, []), done.stderr)

    def test_packaged_unit_matches_deploy(self) -> None:
        """The unit in the wheel is the one in deploy/systemd (llm-port copies the latter as it is)."""
        with open(os.path.join(ROOT, "deploy/systemd/llmport-agent.service")) as f:
            deploy = f.read()
        self.assertEqual(unit_template(), deploy)
        for line in ("Type=notify", "WatchdogSec=", "EnvironmentFile=-/etc/llmport-agent.env",
                     "Restart=on-failure", "RestartPreventExitStatus=78 2", "StateDirectory=llmport-agent",
                     "ExecStart=/usr/local/bin/llmport-agent run", "ProtectSystem=strict",
                     "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK", "NoNewPrivileges=yes"):
            self.assertIn(line, deploy)


_ = Any


class TokenFileWarningTests(SynchronousTestCase):
    """
    The env file readable by other users (llm-port's installer writes it 0644, the token in it)
    is tightened to 0600 when the agent starts, and said once (issue 20); a link is left alone.
    """

    def check(self, mode: int, token_line: bool = True) -> tuple[list[str], str]:
        from twisted.logger import Logger, globalLogPublisher

        from llmport_agent.demo.testing import SynchronousRunner
        from llmport_agent.host.envfile import EnvFileCheck

        root = os.path.abspath(self.mktemp())
        os.makedirs(os.path.join(root, "etc"))
        path = os.path.join(root, "etc/llmport-agent.env")
        with open(path, "w") as f:
            f.write(f"LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN={TOKEN}\n" if token_line else "X=1\n")
        os.chmod(path, mode)
        seen: list[str] = []

        def observer(event: dict[str, Any]) -> None:
            from twisted.logger import formatEvent

            text = formatEvent(event)
            if "readable by other users" in text:
                seen.append(text)

        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        EnvFileCheck(SynchronousRunner().run, Logger(), path).check()
        return seen, path

    def test_world_readable_file_is_tightened(self) -> None:
        for token_line in (True, False):
            seen, path = self.check(0o644, token_line)
            self.assertEqual(os.stat(path).st_mode & 0o777, 0o600)
            self.assertEqual(len(seen), 1)
            self.assertIn("mode 0644", seen[0])
            self.assertIn("now 0600", seen[0])
            self.assertNotIn(TOKEN, seen[0])

    def test_private_file_is_quiet(self) -> None:
        seen, path = self.check(0o600)
        self.assertEqual(seen, [])
        self.assertEqual(os.stat(path).st_mode & 0o777, 0o600)

    def test_of_another_owner_warned_only_with_a_secret(self) -> None:
        """Run as another user (nobody): the file is not changed; a warning only if it holds a secret."""
        if os.geteuid() != 0:
            raise SkipTest("needs root to run the check as another user")
        import tempfile

        d = tempfile.mkdtemp(prefix="envcheck", dir="/tmp")  # a place nobody can reach
        self.addCleanup(shutil.rmtree, d, True)
        os.chmod(d, 0o755)
        results = []
        for content in (f"LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN={TOKEN}\n", "LLM_PORT_NODE_AGENT_HOST=h\n"):
            path = os.path.join(d, "llmport-agent.env")
            with open(path, "w") as f:
                f.write(content)
            os.chmod(path, 0o644)
            from llmport_agent.host.envfile import tighten_env_file

            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: as nobody, the check, its answer on the pipe
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    os.write(write, json.dumps(tighten_env_file(path)).encode())
                finally:
                    os._exit(0)
            os.close(write)
            os.waitpid(pid, 0)
            with os.fdopen(read) as f:
                results.append(json.loads(f.read()))
            self.assertEqual(os.stat(path).st_mode & 0o777, 0o644)
        self.assertEqual(results[0], ["it belongs to another user", os.path.join(d, "llmport-agent.env"), 0o644])
        self.assertIsNone(results[1])

    def test_a_link_is_not_followed(self) -> None:
        from llmport_agent.host.envfile import tighten_env_file

        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        target = os.path.join(d, "elsewhere")
        with open(target, "w") as f:
            f.write("X=1\n")
        os.chmod(target, 0o644)
        link = os.path.join(d, "llmport-agent.env")
        os.symlink(target, link)
        self.assertIsNone(tighten_env_file(link))
        self.assertEqual(os.stat(target).st_mode & 0o777, 0o644)


class LineInjectionTests(SynchronousTestCase):
    """
    Env files and units are line-based: a newline in a value must never become a directive or
    another variable (hostile review, issue 21: STATE_PATH with a newline gave a root
    ExecStartPre=+ outside the sandbox).
    """

    INJECTED = "/var/lib/x\nExecStartPre=+/bin/sh -c 'id > /tmp/pwned'\nX=/state.json"

    def test_newline_in_a_path_given_to_start(self) -> None:
        for name in ("STATE_PATH", "MODEL_STORE"):
            h = Host(self)
            rc = Installer(h.system(environ=agent_vars(**{name: self.INJECTED}))).start()
            self.assertEqual(rc, 2, name)
            err = h.err.getvalue()
            self.assertIn("control character", err)
            self.assertEqual(len(err.strip().splitlines()), 1, err)
            self.assertFalse(os.path.exists(h.path("/etc/systemd/system/llmport-agent.service")))
            self.assertFalse(os.path.exists(h.path("/etc/llmport-agent.env")))
            self.assertEqual(h.calls(), [])

    def test_every_control_character_is_refused(self) -> None:
        for ch in ("\r", "\x00", "\x0b", "\x1b", "\x7f", "\x85", "\u2028", "\u2029"):
            env = EnvFile()
            with self.assertRaises(ConfigError, msg=repr(ch)):
                env.set("LLM_PORT_NODE_AGENT_LOG_LEVEL", f"info{ch}X=1")
            self.assertEqual(env.lines, [])
            with self.assertRaises(ConfigError, msg=repr(ch)):
                render_unit(unit_template(), executable="/usr/local/bin/llmport-agent", one_process=True,
                            model_store=f"/srv/m{ch}ExecStartPre=+/bin/true", state_dir="/var/lib/llmport-agent")

    def test_config_set_with_a_newline_changes_nothing(self) -> None:
        h = Host(self)
        env_path = h.path("/etc/llmport-agent.env")
        with open(env_path, "w") as f:
            f.write("LLM_PORT_NODE_AGENT_LOG_LEVEL=INFO\n")
        rc = Installer(h.system()).edit_config(["BACKEND_URL=https://a.example\nLLM_PORT_NODE_AGENT_X=1"], [])
        self.assertEqual(rc, 2)
        self.assertIn("control character", h.err.getvalue())
        self.assertEqual(open(env_path).read(), "LLM_PORT_NODE_AGENT_LOG_LEVEL=INFO\n")
        # And the file stays readable by the next --set and start.
        self.assertEqual(Installer(h.system()).edit_config(["LOG_LEVEL=debug"], []), 0)

    def test_the_parser_splits_lines_where_systemd_does(self) -> None:
        """A Unicode line separator inside a value is not a line break for systemd, nor for us."""
        env = EnvFile.parse('A="x\u2028B=1"\r\nC=2\n')
        self.assertEqual(env.values(), {"A": "x\u2028B=1", "C": "2"})
        # systemd keeps a backslash that escapes nothing it knows.
        self.assertEqual(EnvFile.parse('A="a\\qb\\$c"\n').values(), {"A": "a\\qb$c"})

    def test_specifiers_and_variables_stay_literal_in_the_unit(self) -> None:
        unit = render_unit(unit_template(), executable="/opt/a$HOME/llmport-agent", one_process=True,
                           model_store="/srv/%h/models", state_dir="/var/lib/%n")
        self.assertIn("ExecStart=\"/opt/a$$HOME/llmport-agent\" run\n", unit)
        self.assertIn("ExecStartPre=+/bin/mkdir -p /srv/%%h/models\n", unit)
        self.assertIn("ReadWritePaths=-/srv/%%h/models -/var/lib/%%n\n", unit)
