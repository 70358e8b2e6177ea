"""
What an operator reads on the first day (issue 9, item 8): each failure one line that says what
happened and what to do, and nothing repeated forever.

 - no Docker engine: one line, not a reconnect line every 30 s for ever;
 - a TLS verification failure: one line naming CA_BUNDLE / VERIFY_TLS (enrollment and stream),
   no raw Failure repr, no duplicate Autobahn line;
 - `config`: no Python None/True/False;
 - "started" comes before the critical "no credential and no token" line;
 - `demo --help`: plain text, no epytext markup.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

from twisted.internet import reactor
from twisted.internet.task import Clock, deferLater
from twisted.logger import LogLevel, formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.backend_http import describe_network_error
from llmport_agent.devbackend import DevBackend, make_test_tls
from llmport_agent.tls import describe_connection_error
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
        from llmport_agent.demo import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(["--help"])
        text = out.getvalue()
        self.assertIn("usage: llmport-agent demo", text)
        for markup in ("C{", "L{", "I{", "@param"):
            self.assertNotIn(markup, text)
