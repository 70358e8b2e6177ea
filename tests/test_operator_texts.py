"""
What an operator reads on the first day (issue 9, item 8): each failure one line that says what
happened and what to do, and nothing repeated forever.

 - no Docker engine: one line, not a reconnect line every 30 s for ever;
 - a TLS verification failure: one line naming CA_BUNDLE / VERIFY_TLS (enrollment and stream),
   no raw Failure repr, no duplicate Autobahn line;
 - `config`: no Python None/True/False;
 - "started" comes before the critical "no credential and no token" line;
 - `demo --help`: plain text, no epytext markup;
 - (issue 26) short `status --help`, descriptions and option help for start/stop/status,
   `config --help` with a real usage line, modes said as a sentence, the engine named once,
   unset secrets and unset settings alike in `config --json`, the demo's story without NVML's
   back-off warning.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

from twisted.internet import reactor
from twisted.internet.task import Clock, deferLater
from twisted.logger import LogLevel, formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.devbackend import DevBackend, make_test_tls
from llmport_agent.session.backend_http import describe_network_error
from llmport_agent.session.tls import describe_connection_error
from llmport_agent.workloads.engine import DockerEngine
from llmport_agent.workloads.health import HealthWatcher
from llmport_agent.workloads.settings import WorkloadSettings
from tests.agentharness import AgentTestCase
from tests.test_workloads_engine import ADDR, FakeDocker, SyncPool


class Captured:
    """Log events (level, namespace, text) seen while the test runs."""

    def __init__(self, case: Any) -> None:
        self.events: list[tuple[Any, str, str]] = []
        globalLogPublisher.addObserver(self)
        case.addCleanup(globalLogPublisher.removeObserver, self)

    def __call__(self, event: dict[str, Any]) -> None:
        self.events.append((event.get("log_level"), str(event.get("log_namespace", "")), formatEvent(event) or ""))

    def lines(self, min_level: Any = LogLevel.info) -> list[str]:
        order = [LogLevel.debug, LogLevel.info, LogLevel.warn, LogLevel.error, LogLevel.critical]
        return [t for lvl, _ns, t in self.events if lvl in order and order.index(lvl) >= order.index(min_level)]


class NoDockerTests(SynchronousTestCase):
    def test_no_engine_logs_once(self) -> None:
        """
        A host without Docker: over an hour, the agent says once that the engine is unreachable
        and what to do, and nothing about reconnecting event streams.
        """
        captured = Captured(self)
        clock, fake = Clock(), FakeDocker()
        fake.down = True
        engine = DockerEngine(clock, environ={"DOCKER_HOST": ADDR}, client_factory=fake,
                              socket_exists=lambda path: True)
        engine._short = SyncPool()  # type: ignore[assignment]
        engine._streams = SyncPool()  # type: ignore[assignment]
        watcher = HealthWatcher(clock, engine, WorkloadSettings(agent_id="n"), lambda *a: None)
        engine.startService()
        watcher.startService()
        for _ in range(3600):
            clock.advance(1)
        lines = captured.lines()
        unreachable = [t for t in lines if "unreachable" in t]
        self.assertEqual(len(unreachable), 1, lines)
        self.assertIn("start dockerd or point DOCKER_HOST", unreachable[0])
        self.assertEqual([t for t in lines if "event stream" in t], [])
        self.assertLessEqual(len(lines), 2, lines)
        # When it comes back: one line, and the event stream starts.
        fake.down = False
        clock.advance(31)
        self.assertTrue(engine.available)
        self.assertTrue(any("is available" in t for t in captured.lines()))
        self.successResultOf(watcher.stopService())
        self.successResultOf(engine.stopService())


class TlsTextTests(SynchronousTestCase):
    def test_descriptions(self) -> None:
        """Wrapped SSL errors become one line naming CA_BUNDLE; non-TLS errors are not TLS."""
        from OpenSSL import SSL
        from twisted.python.failure import Failure
        from twisted.web._newclient import RequestTransmissionFailed, ResponseNeverReceived

        try:
            raise SSL.Error([("SSL routines", "", "certificate verify failed")])
        except SSL.Error:
            failure = Failure()
        text = describe_network_error(RequestTransmissionFailed([failure]))
        self.assertIn("TLS verification of the backend's certificate failed", text)
        self.assertIn("LLM_PORT_NODE_AGENT_CA_BUNDLE", text)
        self.assertIn("VERIFY_TLS", text)
        self.assertNotIn("Failure", text)
        try:
            raise SSL.Error([("SSL routines", "", "wrong version number")])
        except SSL.Error:
            other = Failure()
        self.assertIn("https only for a TLS endpoint", describe_connection_error(other) or "")
        refused = ResponseNeverReceived([Failure(ConnectionRefusedError("refused"))])
        self.assertIsNone(describe_connection_error(refused))
        self.assertEqual(describe_network_error(refused), "ConnectionRefusedError: refused")


class TlsAgentTests(AgentTestCase):
    async def _tls_backend(self) -> DevBackend:
        return await self.start_backend(tls=make_test_tls(self.mktemp()))

    async def test_enrollment_tls_failure_says_what_to_set(self) -> None:
        """Enrolling with a certificate from an unknown CA: the retry line names CA_BUNDLE, no repr."""
        captured = Captured(self)
        backend = await self._tls_backend()
        self.start_agent(backend)
        await backend.wait_for(lambda: any("Enrollment failed" in t for t in captured.lines()), 10)
        line = next(t for t in captured.lines() if "Enrollment failed" in t)
        self.assertIn("LLM_PORT_NODE_AGENT_CA_BUNDLE", line)
        self.assertNotIn("<twisted.python.failure.Failure", line)

    async def test_stream_tls_failure_says_what_to_set(self) -> None:
        """The stream with a stored credential: one line per attempt naming CA_BUNDLE, no Autobahn error."""
        captured = Captured(self)
        backend = await self._tls_backend()
        reply = backend.enroll_node("tls-node")
        state_dir = self.mktemp()
        import json
        import os

        os.makedirs(state_dir)
        with open(os.path.join(state_dir, "state.json"), "w") as f:
            json.dump({"credential": reply["credential"], "node_id": reply["node_id"]}, f)
        self.start_agent(backend, state_dir=state_dir, token=False, AGENT_ID="tls-node")
        await backend.wait_for(lambda: any("Could not open the backend stream" in t for t in captured.lines()), 10)
        line = next(t for t in captured.lines() if "Could not open the backend stream" in t)
        self.assertIn("TLS verification", line)
        self.assertIn("LLM_PORT_NODE_AGENT_CA_BUNDLE", line)
        self.assertEqual([ns for _l, ns, t in captured.events if ns.startswith("autobahn") and "SSL" in t], [])

    async def test_started_before_the_critical_line(self) -> None:
        """No credential and no token: "started" is logged first, then the critical line."""
        captured = Captured(self)
        backend = await self.start_backend()
        fatal: list[tuple[int, str]] = []
        self.start_agent(backend, token=False, fatal=fatal)
        await backend.wait_for(lambda: bool(fatal), 10)
        await deferLater(reactor, 0, lambda: None)
        lines = captured.lines()
        started = next(i for i, t in enumerate(lines) if " started (agent id " in t)
        critical = next(i for i, t in enumerate(lines) if "no enrollment token" in t)
        self.assertLess(started, critical)


class CliTextTests(SynchronousTestCase):
    def run_cli(self, argv: list[str], env: dict[str, str] | None = None) -> str:
        from llmport_agent.cli import main

        out = io.StringIO()
        patch = {"LLM_PORT_NODE_AGENT_STATE_PATH": self.mktemp() + "/state.json", **(env or {})}
        import os

        saved = {k: os.environ.get(k) for k in patch}
        os.environ.update(patch)
        try:
            with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
                main(argv)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return out.getvalue()

    def test_config_prints_env_values(self) -> None:
        """`config` shows true/false, (unset) and plain numbers, never Python's None/True/False."""
        text = self.run_cli(["config"], {"LLM_PORT_NODE_AGENT_VERIFY_TLS": "false"})
        values = {line.split()[0]: line.split(None, 1)[1] for line in text.splitlines() if line.strip()}
        self.assertEqual(values["LLM_PORT_NODE_AGENT_VERIFY_TLS"], "false")
        self.assertEqual(values["LLM_PORT_NODE_AGENT_ALLOW_HOST_IPC"], "true")
        self.assertEqual(values["LLM_PORT_NODE_AGENT_CA_BUNDLE"], "(unset)")
        self.assertEqual(values["LLM_PORT_NODE_AGENT_HEARTBEAT_INTERVAL_SEC"], "15")
        for word in ("None", "True", "False"):
            self.assertNotIn(word, text.split())

    def test_demo_help_is_plain_text(self) -> None:
        """`demo --help` shows no epytext markup."""
        from llmport_agent.demo.run import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(["--help"])
        text = out.getvalue()
        self.assertIn("usage: llmport-agent demo", text)
        for markup in ("C{", "L{", "I{", "@param"):
            self.assertNotIn(markup, text)


class HelpTextTests(SynchronousTestCase):
    """`--help` of the main commands (issue 26 item 7)."""

    def help(self, command: str) -> str:
        from llmport_agent.cli import build_parser

        parser = build_parser()
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            parser.parse_args([command, "--help"])
        return out.getvalue()

    def option_help(self, text: str, option: str) -> str:
        """The help text given for C{option} (its line and continuation lines)."""
        lines = text.splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            if stripped.startswith(option + " ") or stripped == option:
                rest = [stripped[len(option):].strip()]
                for more in lines[i + 1:]:
                    if not more.startswith(" " * 6) or more.strip().startswith("-"):
                        break
                    rest.append(more.strip())
                return " ".join(r for r in rest if r)
        self.fail(f"{option} not in help:\n{text}")

    def test_status_help_is_short_and_shows_user(self) -> None:
        text = self.help("status")
        self.assertLess(len(text.splitlines()), 30, text)
        self.assertIn("your own systemd --user service", self.option_help(text, "--user"))
        self.assertNotIn("--heartbeat-interval-sec", text)
        self.assertIn("run --help", text)  # where the settings are listed

    def test_status_and_config_still_take_setting_options(self) -> None:
        from llmport_agent.cli import build_parser

        args = build_parser().parse_args(["status", "--user", "--state-path", "/x/state.json"])
        self.assertEqual((args.user_mode, args.state_path), (True, "/x/state.json"))
        args = build_parser().parse_args(["config", "--json", "--state-path", "/y/state.json"])
        self.assertEqual(args.state_path, "/y/state.json")
        self.assertIn("--heartbeat-interval-sec", self.help("run"))

    def test_start_stop_status_have_descriptions(self) -> None:
        for command, words in (("start", "Install (or update)"), ("stop", "Stop and disable"),
                               ("status", "Show the unit's state")):
            text = self.help(command)
            body = text.split("\n\n", 1)[1]  # after the usage line: the description
            self.assertTrue(body.startswith(words), text)
        self.assertIn("no root", self.option_help(self.help("stop"), "--user"))
        self.assertIn("--user service", self.option_help(self.help("start"), "--user [NAME]"))

    def test_config_help_has_a_proper_usage(self) -> None:
        text = self.help("config")
        self.assertNotIn("{show}", text)
        self.assertTrue(text.startswith("usage: llmport-agent config [show] [--json] [--set NAME=VALUE"), text)
        self.assertLess(len(text.splitlines()), 30, text)
        self.assertIn("unset: null", self.option_help(text, "--json"))


class ConfigJsonTests(SynchronousTestCase):
    run_cli = CliTextTests.run_cli

    def test_unset_secrets_and_unset_settings_alike(self) -> None:
        """`config --json`: every unset setting, secret or not, is null; text shows (unset) for both."""
        import json

        env = {"LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN": "", "LLM_PORT_NODE_AGENT_CA_BUNDLE": ""}
        shown = json.loads(self.run_cli(["config", "--json"], env))
        self.assertIsNone(shown["LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN"])
        self.assertIsNone(shown["LLM_PORT_NODE_AGENT_CA_BUNDLE"])
        self.assertNotIn("(unset)", shown.values())
        text = self.run_cli(["config"], env)
        values = {line.split()[0]: line.split(None, 1)[1] for line in text.splitlines() if line.strip()}
        self.assertEqual(values["LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN"], "(unset)")
        self.assertEqual(values["LLM_PORT_NODE_AGENT_CA_BUNDLE"], "(unset)")
        # A set secret is still masked, never shown.
        shown = json.loads(self.run_cli(["config", "--json"], {"LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN": "s3cret-token"}))
        self.assertEqual(shown["LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN"], "*** (12 chars)")


class SmallGlitchTests(SynchronousTestCase):
    def test_status_says_modes_as_a_sentence(self) -> None:
        import json
        import os

        from llmport_agent.host.installer import Installer
        from tests.test_installer import Host

        for modes, said in (({"maintenance": True, "draining": False}, "in maintenance mode, not draining"),
                            ({}, "not in maintenance mode, not draining"),
                            ({"draining": True}, "not in maintenance mode, draining")):
            h = Host(self)
            state = h.path("/var/lib/llmport-agent/state.json")
            os.makedirs(os.path.dirname(state))
            with open(state, "w") as f:
                json.dump({"credential": "c", "node_id": "n-1", **modes}, f)
            with open(h.path("/etc/llmport-agent.env"), "w") as f:
                f.write("LLM_PORT_NODE_AGENT_OPS_PORT=1\n")
            Installer(h.system()).status()
            line = next(t for t in h.out.getvalue().splitlines() if t.startswith("state file:"))
            self.assertTrue(line.endswith(f"node id n-1, {said}"), line)
            self.assertNotIn("True", line)
            self.assertNotIn("False", line)

    def test_readiness_names_the_engine_once(self) -> None:
        from types import SimpleNamespace

        from llmport_agent.ops.endpoint import readiness

        error = "Docker engine at unix:///run/docker.sock is unreachable: connection refused (is dockerd running?)"
        agent = SimpleNamespace(
            session=SimpleNamespace(connected=True, stats=SimpleNamespace(last_error=""), node_id="n-1"),
            engine=SimpleNamespace(available=False, last_error=error, version="", address="unix:///run/docker.sock"),
            config=SimpleNamespace(agent_id="gpu-1"), pipeline=SimpleNamespace(running_count=0),
            status=SimpleNamespace(heartbeat_fields=lambda: {"status": "degraded"}),
        )
        detail = readiness(agent)["checks"]["engine"]["detail"]
        self.assertEqual(detail, error)
        self.assertEqual(detail.count("Docker engine"), 1)
        agent.engine.last_error = "not checked yet"
        self.assertEqual(readiness(agent)["checks"]["engine"]["detail"], "Docker engine unreachable: not checked yet")

    def test_demo_keeps_nvml_back_off_out_of_its_story(self) -> None:
        from twisted.logger import PredicateResult

        from llmport_agent.demo.run import demo_log_predicate

        nvml = {"log_namespace": "llmport_agent.inventory.nvml.NVMLGPUSource", "log_level": LogLevel.warn}
        other = {"log_namespace": "llmport_agent.session.service", "log_level": LogLevel.warn}
        broken = {"log_namespace": "llmport_agent.inventory.nvml.NVMLGPUSource", "log_level": LogLevel.error}
        quiet = demo_log_predicate(False)
        self.assertEqual([quiet(e) for e in (nvml, other, broken)],
                         [PredicateResult.no, PredicateResult.maybe, PredicateResult.maybe])
        self.assertEqual(demo_log_predicate(True)(nvml), PredicateResult.maybe)


class ClosedStreamLineTests(AgentTestCase):
    async def test_a_dropped_stream_is_one_line_without_a_doubled_retry(self) -> None:
        """The backend drops an open stream: "Backend stream closed (...) after N s; retrying in ...", said once."""
        captured = Captured(self)
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        self.allow_anomalies(".", "the stream is dropped on purpose")
        backend.drop_connections(node_id)
        await backend.wait_for(lambda: any("Backend stream closed" in t for t in captured.lines()), 10)
        await self.wait_connected(backend, agent)
        said = [t for t in captured.lines() if "Backend stream closed" in t]
        self.assertEqual(len(said), 1, said)
        self.assertRegex(said[0], r"^Backend stream closed \(code \d+, .*[^.]\) after \d+ s; retrying in "
                                  r"\d+\.\d s \(attempt \d+\)$")
        self.assertNotIn("reconnecting; retrying", said[0])
