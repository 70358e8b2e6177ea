"""
The entry points in-process: the C{llmport-agent} console script (L{llmport_agent.cli.main}),
the demo's failure paths (L{llmport_agent.demo.run}) and the ops endpoint's liveness, readiness
and port-in-use behaviour (L{llmport_agent.ops.endpoint}). Behaviour, not "it runs": what each
subcommand dispatches to with which arguments, exit statuses, what is printed, what is cleaned
up.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import socket
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent import VERSION, cli
from llmport_agent.demo import run as demo
from llmport_agent.host import installer
from llmport_agent.inventory.gpu import NoGPUSource
from llmport_agent.ops.endpoint import OpsService, gpu_readiness
from tests.agentharness import AgentTestCase

P = "LLM_PORT_NODE_AGENT_"


class _FakeInstaller:
    calls: list[tuple[str, Any]] = []
    systems: list[Any] = []

    def __init__(self, system: Any = None) -> None:
        # Installer(system): None is the root layout, a user-mode system for --user.
        self.systems.append(system)

    def start(self, user: str | None = None) -> int:
        self.calls.append(("start", user))
        return 0

    def stop(self) -> int:
        self.calls.append(("stop", None))
        return 0

    def edit_config(self, sets: list[str], unsets: list[str]) -> int:
        self.calls.append(("edit_config", (list(sets), list(unsets))))
        return 0

    def status(self, config: Any) -> int:
        self.calls.append(("status", config.backend_url))
        return 3


class CliTests(SynchronousTestCase):
    def setUp(self) -> None:
        _FakeInstaller.calls = []
        _FakeInstaller.systems = []
        self.patch(installer, "Installer", _FakeInstaller)
        self.runs: list[tuple[Any, bool]] = []
        self.patch(cli, "run_agent", lambda config, json_logs=False: self.runs.append((config, json_logs)) or 0)
        saved = {k: v for k, v in os.environ.items() if k.startswith(P)}
        for k in saved:
            del os.environ[k]
        os.environ[P + "STATE_PATH"] = os.path.abspath(self.mktemp()) + "/state.json"

        def restore() -> None:
            for k in [k for k in os.environ if k.startswith(P)]:
                del os.environ[k]
            os.environ.update(saved)

        self.addCleanup(restore)

    def main(self, argv: list[str]) -> tuple[int | None, str, str]:
        out, err = io.StringIO(), io.StringIO()
        code: int | None
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(argv)
            except SystemExit as e:
                code = int(e.code) if isinstance(e.code, int) else (0 if e.code is None else 1)
        return code, out.getvalue(), err.getvalue()

    def test_no_arguments_runs_the_agent(self) -> None:
        code, _, _ = self.main([])
        self.assertEqual(code, 0)
        self.assertEqual(len(self.runs), 1)
        self.assertFalse(self.runs[0][1])

    def test_options_alone_mean_run(self) -> None:
        """`llmport-agent --backend-url URL` is `run --backend-url URL`; the option beats the environment."""
        os.environ[P + "BACKEND_URL"] = "http://from-env:1"
        code, _, _ = self.main(["--backend-url", "http://from-option:2"])
        self.assertEqual(code, 0)
        self.assertEqual(self.runs[0][0].backend_url, "http://from-option:2")

    def test_run_json_logs(self) -> None:
        self.main(["run", "--json-logs"])
        self.assertTrue(self.runs[0][1])

    def test_run_propagates_the_exit_status(self) -> None:
        self.patch(cli, "run_agent", lambda config, json_logs=False: 78)
        self.assertEqual(self.main(["run"])[0], 78)

    def test_config_error_is_one_line_and_exit_2(self) -> None:
        os.environ[P + "HEARTBEAT_INTERVAL_SEC"] = "often"
        code, out, err = self.main(["run"])
        self.assertEqual(code, cli.EX_USAGE)
        self.assertEqual(self.runs, [])
        self.assertEqual(len(err.strip().splitlines()), 1)
        self.assertTrue(err.startswith("llmport-agent: configuration error: "), err)
        self.assertIn(P + "HEARTBEAT_INTERVAL_SEC", err)

    def test_config_json_masks_the_token(self) -> None:
        os.environ[P + "ENROLLMENT_TOKEN"] = "tok-SECRET-value-1234567890abcdef"
        code, out, _ = self.main(["config", "--json"])
        self.assertEqual(code, 0)
        self.assertNotIn("SECRET", out)
        shown = json.loads(out)
        self.assertEqual(shown[P + "BACKEND_URL"], "http://127.0.0.1:8000")
        self.assertIn(P + "ENROLLMENT_TOKEN", shown)
        self.assertNotEqual(shown[P + "ENROLLMENT_TOKEN"], "tok-SECRET-value-1234567890abcdef")

    def test_config_table_uses_options(self) -> None:
        code, out, _ = self.main(["config", "--heartbeat-interval-sec", "7"])
        self.assertEqual(code, 0)
        rows = dict(line.split(None, 1) for line in out.splitlines() if line.strip())
        self.assertEqual(rows[P + "HEARTBEAT_INTERVAL_SEC"].strip(), "7")

    def record_parsers(self) -> tuple[list[str | None], Any]:
        """cli.build_parser wrapped: the subcommand of each parser built, and the real one."""
        built: list[str | None] = []
        real = cli.build_parser

        def recording(command: str | None = None) -> Any:
            built.append(command)
            return real(command)

        self.patch(cli, "build_parser", recording)
        return built, real

    def test_settings_options_only_for_the_subcommand_run(self) -> None:
        """
        Each subcommand that takes setting options gets them when it is the one run (through
        main, as the console script runs it); a parser built for one has none on the others.
        """
        built, real = self.record_parsers()
        code, _, _ = self.main(["run", "--heartbeat-interval-sec", "9"])
        self.assertEqual(code, 0)
        self.assertEqual(built, ["run"])  # not every subcommand's two hundred options
        self.assertEqual(self.runs[-1][0].heartbeat_interval_sec, 9)
        code, out, _ = self.main(["config", "--json", "--heartbeat-interval-sec", "7"])
        self.assertEqual(code, 0)
        self.assertEqual(float(json.loads(out)[P + "HEARTBEAT_INTERVAL_SEC"]), 7.0)
        for command in ("run", "config", "status"):
            for other in {"run", "config", "status"} - {command}:
                parser = cli.build_parser(command)
                with self.assertRaises(SystemExit):
                    with contextlib.redirect_stderr(io.StringIO()):
                        parser.parse_args([other, "--heartbeat-interval-sec", "7"])
                args = parser.parse_args([command, "--heartbeat-interval-sec", "7"])
                self.assertEqual(args.heartbeat_interval_sec, "7")
        # The whole command line (the reference's): every one of the three has them.
        whole = cli.build_parser()
        for command in ("run", "config", "status"):
            self.assertEqual(whole.parse_args([command, "--heartbeat-interval-sec", "7"]).heartbeat_interval_sec, "7")

    def test_bare_run_builds_no_parser(self) -> None:
        """
        `run` alone (the unit's command line) and no arguments at all run the agent without
        building argparse's parser, with exactly what the parser would have given.
        """
        built, real = self.record_parsers()
        os.environ[P + "HEARTBEAT_INTERVAL_SEC"] = "11"
        for argv in (["run"], []):
            code, _, _ = self.main(argv)
            self.assertEqual(code, 0)
            self.assertEqual(self.runs[-1][0].heartbeat_interval_sec, 11)
            self.assertFalse(self.runs[-1][1])
        self.assertEqual(built, [])
        # The same namespace as the parser's: an option added to `run` turns this red until
        # run_defaults knows it.
        self.assertEqual(vars(cli.run_defaults()), vars(real("run").parse_args(["run"])))
        self.assertEqual(vars(cli.run_defaults()), vars(real().parse_args(["run"])))

    def test_installer_commands(self) -> None:
        self.assertEqual(self.main(["start", "--user", "llmport"])[0], 0)
        self.assertEqual(self.main(["stop"])[0], 0)
        self.assertEqual(self.main(["config", "--set", "HEARTBEAT_INTERVAL_SEC=20", "--unset", "CA_BUNDLE"])[0], 0)
        os.environ[P + "BACKEND_URL"] = "http://backend.example:8000"
        self.assertEqual(self.main(["status"])[0], 3)  # the installer's status code is the exit status
        self.assertEqual(_FakeInstaller.calls, [
            ("start", "llmport"),
            ("stop", None),
            ("edit_config", (["HEARTBEAT_INTERVAL_SEC=20"], ["CA_BUNDLE"])),
            ("status", "http://backend.example:8000"),
        ])
        self.assertEqual(self.runs, [])
        self.assertEqual(_FakeInstaller.systems, [None, None, None, None])

    def test_user_mode_stop_gets_the_user_layout(self) -> None:
        self.patch(cli, "_user_system", lambda: "user-system")
        self.assertEqual(self.main(["stop", "--user"])[0], 0)
        self.assertEqual(_FakeInstaller.systems, ["user-system"])
        self.assertEqual(_FakeInstaller.calls, [("stop", None)])

    def test_demo_and_devbackend_get_the_rest_of_the_line(self) -> None:
        seen: list[tuple[str, list[str]]] = []
        import llmport_agent.devbackend.cli as devcli

        self.patch(demo, "main", lambda argv: seen.append(("demo", argv)) or 0)
        self.patch(devcli, "main", lambda argv: seen.append(("devbackend", argv)) or 5)
        self.assertEqual(self.main(["demo", "--docker"])[0], 0)
        self.assertEqual(self.main(["devbackend", "--port", "9"])[0], 5)
        self.assertEqual(seen, [("demo", ["--docker"]), ("devbackend", ["--port", "9"])])

    def test_version(self) -> None:
        code, out, _ = self.main(["--version"])
        self.assertEqual(code, 0)
        self.assertEqual(out.strip(), f"llmport-agent {VERSION}")

    def test_unknown_command(self) -> None:
        code, _, err = self.main(["frobnicate"])
        self.assertEqual(code, 2)
        self.assertIn("invalid choice", err)
        self.assertEqual(self.runs, [])


class DemoFailureTests(AgentTestCase):
    timeout = 60

    async def run_demo(self) -> tuple[int, list[str], str]:
        made: list[str] = []
        real = demo.tempfile.mkdtemp

        def mkdtemp(**kw: Any) -> str:
            made.append(real(**kw))
            return made[-1]

        self.patch(demo.tempfile, "mkdtemp", mkdtemp)
        lines: list[str] = []
        code = await demo._demo(reactor, argparse.Namespace(verbose=False, docker=False), lines.append,
                                gpu_source=NoGPUSource())
        return code, lines, made[0]

    async def test_a_broken_step_says_what_and_cleans_up(self) -> None:
        async def broken(*a: Any, **k: Any) -> Any:
            raise RuntimeError("the backend went away")

        self.patch(demo, "_run_commands", broken)
        code, lines, workdir = await self.run_demo()
        self.assertEqual(code, 1)
        self.assertEqual(lines[-1], "demo failed: RuntimeError: the backend went away")
        self.assertFalse(os.path.exists(workdir), "the demo's temporary state was left behind")
        port = int(next(t for t in lines if "listening on" in t).rsplit(":", 1)[1])
        with socket.socket() as s:  # the stand-in backend is stopped too
            self.assertNotEqual(s.connect_ex(("127.0.0.1", port)), 0)

    async def test_refused_token_is_reported(self) -> None:
        """The agent cannot enroll: the demo prints the agent's own reason and exits 1."""
        from llmport_agent.devbackend import DevBackend

        real_mint = DevBackend.mint_token

        def bad_token(self: Any, note: str | None = None) -> dict[str, Any]:
            token = real_mint(self, note)
            return dict(token, token="x" * 32)

        self.patch(DevBackend, "mint_token", bad_token)
        code, lines, workdir = await self.run_demo()
        self.assertEqual(code, 1)
        failed = [t for t in lines if t.startswith("[agent]   could not enroll: ")]
        self.assertEqual(len(failed), 1, lines)
        self.assertIn("invalid, expired or already used", failed[0])
        self.assertFalse(os.path.exists(workdir))

    def test_sizes(self) -> None:
        self.assertEqual(demo._fmt_bytes(512), "512.0 B")
        self.assertEqual(demo._fmt_bytes(3 * 1024**3), "3.0 GiB")
        self.assertEqual(demo._fmt_bytes(5 * 1024**5), "5120.0 TiB")
        self.assertEqual(demo._fmt_bytes(None), "?")


class OpsEndpointTests(AgentTestCase):
    timeout = 60

    async def get(self, url: str) -> tuple[int, Any]:
        response = await treq.get(url, persistent=False)
        return response.code, json.loads(await response.content())

    async def test_liveness_stays_green_while_not_ready(self) -> None:
        """No backend reachable: /readyz 503 naming the session, /healthz 200 (do not restart me)."""
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        await self.wait_connected(backend, agent)
        await backend.stop()
        ops = OpsService(reactor, agent, 0)
        ops.startService()
        self.addCleanup(ops.stopService)
        while ops._listening is None or agent.session.connected:
            await deferLater(reactor, 0.05, lambda: None)
        base = f"http://127.0.0.1:{ops._listening.getHost().port}"
        code, body = await self.get(base + "/readyz")
        self.assertEqual(code, 503)
        self.assertFalse(body["ready"])
        self.assertFalse(body["checks"]["session"]["ok"])
        code, body = await self.get(base + "/healthz")
        self.assertEqual((code, body), (200, {"status": "ok"}))

    async def test_port_in_use_warns_and_runs_without(self) -> None:
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        self.addCleanup(held.close)
        port = held.getsockname()[1]
        logged: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(logged.append)
        self.addCleanup(globalLogPublisher.removeObserver, logged.append)
        ops = OpsService(reactor, object(), port)
        ops.startService()
        await deferLater(reactor, 0, lambda: None)
        self.assertTrue(ops.running)
        self.assertIsNone(ops._listening)
        warnings = [e for e in logged if "could not listen" in str(e.get("log_format", ""))]
        self.assertEqual(len(warnings), 1)
        self.assertEqual(warnings[0]["port"], port)
        await ops.stopService()  # nothing to stop: fine

    def test_gpu_check_before_the_first_read(self) -> None:
        self.assertEqual(gpu_readiness(None), {"ok": True, "detail": "not read yet", "gpus": 0})
