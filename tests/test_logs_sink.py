"""
Tests for log-sink discovery (protocol 10.7, L{llmport_agent.logs.sink}): the URL check, when
the agent asks and asks again, the client call against the stand-in backend's route, and a
whole agent without C{LOKI_URL} shipping to the sink the backend names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import formatEvent
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.core.backoff import Backoff
from llmport_agent.logs.sink import REASK_SEC, LogSinkDiscovery, ServiceSlot, validate_sink_url
from llmport_agent.session.backend_http import Rejected, Transient
from tests.agentharness import AgentTestCase
from tests.support.logs import capture_events

PASSWORD = "s3cr3t-LOKI-pass"


class ValidateTests(SynchronousTestCase):
    """What a backend may name as the sink."""

    def test_accepted(self) -> None:
        """http(s) with a host, a port, a base path, user info; the trailing / dropped."""
        for url in ("http://127.0.0.1:3100", "https://loki.example/loki-gw/", f"http://u:{PASSWORD}@h:3100"):
            self.assertEqual(validate_sink_url(url), url.rstrip("/"))

    def test_refused(self) -> None:
        """Other schemes, no host, query, fragment, control characters, too long, not a string."""
        bad: list[object] = [
            "ftp://h", "http://", "h:3100", f"http://u:{PASSWORD}@h/?x=1", "http://h/#f",
            "http://h/a b", "http://h/\x00", "http://h:99999", "http://h:x", "http://" + "a" * 3000,
            5, None, ["http://h"], {"url": "http://h"},
        ]
        for raw in bad:
            with self.assertRaises(ValueError, msg=repr(raw)[:60]) as ctx:
                validate_sink_url(raw)
            self.assertNotIn(PASSWORD, str(ctx.exception))


class Script:
    """A scripted C{ask}: each call takes the next answer (a value, or an exception to raise)."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.calls = 0

    async def __call__(self) -> object:
        self.calls += 1
        answer = self.answers.pop(0) if self.answers else None
        if isinstance(answer, Exception):
            raise answer
        if isinstance(answer, Deferred):
            return await answer
        return answer


class DiscoveryTests(SynchronousTestCase):
    """When it asks, on a Clock."""

    def make(self, *answers: Any) -> tuple[LogSinkDiscovery, Script, list[str]]:
        self.clock = Clock()
        script = Script(*answers)
        found: list[str] = []
        disc = LogSinkDiscovery(self.clock, script, found.append, backoff=Backoff(5.0, 300.0, random=lambda: 1.0))
        disc.startService()
        self.addCleanup(disc.stopService)
        return disc, script, found

    def test_found_at_connect_once(self) -> None:
        """Asked at connect; a sink starts shipping once; reconnects do not ask again."""
        disc, script, found = self.make(f"http://u:{PASSWORD}@127.0.0.1:3100/")
        events = capture_events(self)
        self.assertEqual(script.calls, 0)
        disc.session_opened()
        self.clock.advance(0)
        self.assertEqual(found, [f"http://u:{PASSWORD}@127.0.0.1:3100"])
        disc.session_closed()
        disc.session_opened()
        self.clock.advance(REASK_SEC * 3)
        self.assertEqual(script.calls, 1)
        self.assertEqual(found, [f"http://u:{PASSWORD}@127.0.0.1:3100"])
        text = "\n".join(formatEvent(e) for e in events) + json.dumps(disc.describe())
        self.assertNotIn(PASSWORD, text)
        self.assertIn("u:***@127.0.0.1:3100", text)

    def test_no_sink_asks_again_later_and_at_reconnect(self) -> None:
        """None (null or 404): asked again every REASK_SEC while connected, and at each connect; said once."""
        disc, script, found = self.make(None, None, None, "http://127.0.0.1:3100")
        events = capture_events(self)
        disc.session_opened()
        self.clock.advance(0)
        self.assertEqual(script.calls, 1)
        self.clock.advance(REASK_SEC - 1)
        self.assertEqual(script.calls, 1)
        self.clock.advance(1)
        self.assertEqual(script.calls, 2)
        disc.session_closed()
        self.clock.advance(REASK_SEC * 2)
        self.assertEqual(script.calls, 2)  # not while disconnected
        disc.session_opened()
        self.clock.advance(0)
        self.assertEqual(script.calls, 3)
        self.clock.advance(REASK_SEC)
        self.assertEqual(found, ["http://127.0.0.1:3100"])
        said = [e for e in events if "offers no log sink" in formatEvent(e)]
        self.assertEqual(len(said), 1)

    def test_failures_retried_with_backoff(self) -> None:
        """A failure to ask is retried while connected, backing off (10 s, 20 s, 40 s at the top of the jitter)."""
        disc, script, found = self.make(Transient("HTTP 502"), Transient("x"), Transient("y"), "http://h:1")
        disc.session_opened()
        self.clock.advance(0)
        for delay in (10.0, 20.0, 40.0):
            calls = script.calls
            self.clock.advance(delay - 0.01)
            self.assertEqual(script.calls, calls)
            self.clock.advance(0.01)
            self.assertEqual(script.calls, calls + 1)
        self.assertEqual(found, ["http://h:1"])

    def test_rejected_waits_for_next_connect(self) -> None:
        """401/403: no retry on this connection; the next connect asks again."""
        disc, script, found = self.make(Rejected(401, "Invalid node credential."), "http://h:1")
        disc.session_opened()
        self.clock.advance(0)
        self.clock.advance(REASK_SEC * 2)
        self.assertEqual(script.calls, 1)
        disc.session_closed()
        disc.session_opened()
        self.clock.advance(0)
        self.assertEqual(found, ["http://h:1"])

    def test_invalid_url_not_used(self) -> None:
        """An unusable URL starts nothing, is said (masked), and is asked again later."""
        disc, script, found = self.make(f"ftp://u:{PASSWORD}@h", 42, "http://h:1")
        events = capture_events(self)
        disc.session_opened()
        self.clock.advance(0)
        self.assertEqual(found, [])
        self.clock.advance(REASK_SEC)
        self.assertEqual(found, [])
        self.clock.advance(REASK_SEC)
        self.assertEqual(found, ["http://h:1"])
        text = "\n".join(formatEvent(e) for e in events)
        self.assertIn("not usable", text)
        self.assertNotIn(PASSWORD, text)

    def test_one_question_at_a_time_and_clean_stop(self) -> None:
        """A slow answer is not asked over; a stop cancels the question and leaves no timer behind."""
        cancelled: list[bool] = []
        slow: Deferred[object] = Deferred(lambda _: cancelled.append(True))
        disc, script, found = self.make(slow)
        disc.session_opened()
        self.clock.advance(0)
        self.clock.advance(REASK_SEC)
        self.assertEqual(script.calls, 1)
        events = capture_events(self)
        disc.stopService()
        self.assertEqual(cancelled, [True])  # the request was cancelled (its connection attempt ends)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertEqual([e for e in events if "log sink" in formatEvent(e)], [])

    def test_disconnect_cancels_the_question(self) -> None:
        """A disconnect cancels a question in flight quietly; the next connect asks again."""
        cancelled: list[bool] = []
        slow: Deferred[object] = Deferred(lambda _: cancelled.append(True))
        disc, script, found = self.make(slow, "http://h:1")
        disc.session_opened()
        self.clock.advance(0)
        disc.session_closed()
        self.assertEqual(cancelled, [True])
        self.assertEqual(self.clock.getDelayedCalls(), [])
        disc.session_opened()
        self.clock.advance(0)
        self.assertEqual((script.calls, found), (2, ["http://h:1"]))


class SlotTests(SynchronousTestCase):
    """ServiceSlot: later children start at once; stop one by one, last first."""

    def test_order(self) -> None:
        from twisted.application.service import Service

        log: list[str] = []
        gates: dict[str, Deferred[None]] = {}

        class Part(Service):
            def __init__(self, name: str) -> None:
                self.setName(name)

            def startService(self) -> None:
                super().startService()
                log.append(f"start {self.name}")

            def stopService(self) -> Deferred[None]:
                super().stopService()
                log.append(f"stop {self.name}")
                gates[self.name] = Deferred()
                return gates[self.name]

        clock = Clock()
        slot = ServiceSlot(clock, "slot")
        slot.startService()
        for name in ("pool", "shipper", "reader"):
            Part(name).setServiceParent(slot)
        self.assertEqual(log, ["start pool", "start shipper", "start reader"])
        d = slot.stopService()
        self.assertEqual(log[-1], "stop reader")
        gates["reader"].callback(None)
        self.assertEqual(log[-1], "stop shipper")
        d.cancel()  # the caller gives up waiting: the rest is still stopped
        self.failureResultOf(d)
        clock.advance(15)  # a stop that never ends is given up on
        self.assertEqual(log[-1], "stop pool")
        gates["pool"].callback(None)
        self.assertEqual(clock.getDelayedCalls(), [])


class RouteTests(AgentTestCase):
    """BackendHTTP.log_sink against the stand-in backend's route, over loopback."""

    async def node_credential(self, **kw: Any) -> tuple[Any, Callable[[str], Any]]:
        from treq.client import HTTPClient
        from twisted.web.client import Agent, HTTPConnectionPool

        from llmport_agent.session.backend_http import BackendHTTP

        backend = await self.start_backend(**kw)
        agent = self.start_agent(backend)
        await self.wait_connected(backend, agent)
        pool = HTTPConnectionPool(reactor, persistent=False)
        http = BackendHTTP(reactor, HTTPClient(Agent(reactor, pool=pool)), backend.url, 10)
        await agent.stopService()
        return backend, lambda cred: http.log_sink(cred or agent.state.credential)

    async def test_answers(self) -> None:
        """The URL when set; 404 (None) when none; 401 for a bad credential."""
        backend, ask = await self.node_credential()
        before = backend.log_sink_requests  # the agent asked once itself
        self.assertIsNone(await ask(""))
        backend.log_sink_url = "http://127.0.0.1:3100"
        self.assertEqual(await ask(""), "http://127.0.0.1:3100")
        with self.assertRaises(Rejected):
            await ask("00000000-0000-0000-0000-000000000000.nope")
        self.assertEqual(backend.log_sink_requests - before, 3)

    async def test_april_backend(self) -> None:
        """The April generation has no such route: 404, no sink."""
        backend, ask = await self.node_credential(generation="2026-04")
        backend.log_sink_url = "http://127.0.0.1:3100"
        self.assertIsNone(await ask(""))


class RawAnswerTests(AgentTestCase):
    """BackendHTTP.log_sink on answers the stand-in does not give: null, junk, too large, 5xx."""

    async def ask(self, code: int, body: bytes) -> object:
        from treq.client import HTTPClient
        from twisted.internet.endpoints import TCP4ServerEndpoint
        from twisted.web.client import Agent, HTTPConnectionPool
        from twisted.web.resource import Resource
        from twisted.web.server import Site

        from llmport_agent.session.backend_http import BackendHTTP

        seen: list[bytes | None] = []

        class Answer(Resource):
            isLeaf = True

            def render_GET(self, request: Any) -> bytes:
                seen.append(request.getHeader(b"authorization"))
                request.setResponseCode(code)
                return body

        port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Site(Answer()))
        self.addCleanup(port.stopListening)
        pool = HTTPConnectionPool(reactor, persistent=False)
        http = BackendHTTP(reactor, HTTPClient(Agent(reactor, pool=pool)),
                           f"http://127.0.0.1:{port.getHost().port}/base", 10)
        try:
            return await http.log_sink("cred.secret")
        finally:
            self.assertEqual(seen, [b"Bearer cred.secret"])

    async def test_null_and_empty(self) -> None:
        """{"loki_url": null} and "" are no sink; a non-string is handed on for the check to refuse."""
        self.assertIsNone(await self.ask(200, b'{"loki_url": null}'))
        self.assertIsNone(await self.ask(200, b'{"loki_url": ""}'))
        self.assertEqual(await self.ask(200, b'{"loki_url": 5}'), 5)

    async def test_failures_are_transient(self) -> None:
        """Junk, a list, a 502 and an answer over 64 KiB are failures worth retrying."""
        for code, body in ((200, b"<html>"), (200, b"[]"), (502, b"bad gateway"),
                           (200, b'{"loki_url": "http://h/' + b"a" * 70_000 + b'"}')):
            with self.assertRaises(Transient):
                await self.ask(code, body)


class AgentDiscoveryTests(AgentTestCase):
    """A whole agent without LOKI_URL."""

    async def loki(self) -> tuple[Any, str]:
        from twisted.internet.endpoints import TCP4ServerEndpoint
        from twisted.web.server import Site

        from llmport_agent.logs.testing import FakeLoki

        loki = FakeLoki(check_labels=True)
        port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Site(loki))
        self.addCleanup(port.stopListening)
        return loki, f"http://127.0.0.1:{port.getHost().port}"

    async def test_ships_to_the_backends_sink(self) -> None:
        """The backend names a sink: the agent's lines reach it, with agent_id; diagnostics say so."""
        loki, url = await self.loki()
        backend = await self.start_backend(log_sink_url=url)
        agent = self.start_agent(backend, LOG_FLUSH_INTERVAL_SEC="0.2")
        await self.wait_connected(backend, agent)
        agent_id = agent.config.agent_id
        await backend.wait_for(lambda: agent.log_shipping is not None, 10)
        agent.log.info("a line after the sink was found")
        await backend.wait_for(
            lambda: any("after the sink was found" in line for line in loki.lines(job="node-agent")), 10)
        entries = loki.entries(job="node-agent")
        self.assertTrue(all(e.labels["agent_id"] == agent_id for e in entries))
        self.assertTrue(all(e.labels["container"] == f"node-{agent_id}" for e in entries))
        self.assertEqual(loki.violations, [])
        diag = await agent.diagnostics()
        self.assertEqual(diag["logs"]["loki"]["url"], url + "/loki/api/v1/push")
        # The host journal is not the backend's (issue 29): no journal reader for its sink.
        self.assertIsNone(agent.journald)
        self.assertEqual(diag["logs"]["journal"], {})
        self.assertEqual(diag["logs"]["source"], "backend")
        self.assertIn("not shipped to this sink", diag["logs"]["host_journal"])
        self.assertNotIn(agent.state.credential.split(".")[1], "\n".join(loki.lines()))
        await agent.stopService()
        self.assertFalse(agent.log_shipping.shipper.running)

    async def test_the_operators_loki_credentials_never_go_to_the_backends_sink(self) -> None:
        """
        LOKI_USERNAME/LOKI_PASSWORD (or a bearer token) set without LOKI_URL: the sink the backend
        names (a plain-HTTP backend's answer can be anyone's) gets none of them; one line says so.
        """
        loki, url = await self.loki()
        backend = await self.start_backend(log_sink_url=url)
        events = capture_events(self)
        agent = self.start_agent(backend, LOG_FLUSH_INTERVAL_SEC="0.2", LOKI_USERNAME="ops",
                                 LOKI_PASSWORD="loki-pw-s3cret")
        await self.wait_connected(backend, agent)
        await backend.wait_for(lambda: agent.log_shipping is not None, 10)
        agent.log.info("a line after the sink was found")
        await backend.wait_for(lambda: bool(loki.pushes), 10)
        for push in loki.pushes:
            self.assertNotIn("authorization", push.headers)
        lines = [formatEvent(e) or "" for e in events]
        self.assertTrue(any("LLM_PORT_NODE_AGENT_LOKI_PASSWORD" in line and "not sent to the log sink" in line
                            for line in lines), lines)
        self.assertFalse(any("s3cret" in line for line in lines))
        await agent.stopService()

    async def test_no_sink(self) -> None:
        """No sink (404): nothing is shipped, diagnostics say the agent waits for one."""
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        await self.wait_connected(backend, agent)
        await backend.wait_for(lambda: backend.log_sink_requests >= 1, 10)
        await backend.wait_for(lambda: agent.log_sink.last == "no sink", 10)
        self.assertIsNone(agent.log_shipping)
        diag = await agent.diagnostics()
        self.assertIn("waiting for the backend's log sink", diag["logs"]["shipping"])
        self.assertEqual(diag["logs"]["log_sink"]["last"], "no sink")
        await agent.stopService()

    async def test_loki_url_set_no_question(self) -> None:
        """With LOKI_URL set the backend is never asked."""
        _loki, url = await self.loki()
        backend = await self.start_backend(log_sink_url="http://127.0.0.1:1")
        agent = self.start_agent(backend, LOKI_URL=url)
        await self.wait_connected(backend, agent)
        await defer_later(0.5)
        self.assertEqual(backend.log_sink_requests, 0)
        self.assertIsNone(agent.log_sink)
        await agent.stopService()


def defer_later(seconds: float) -> Deferred[None]:
    from twisted.internet.task import deferLater

    return deferLater(reactor, seconds, lambda: None)



class SinkConfigTests(SynchronousTestCase):
    def test_a_bearer_token_is_left_out_too(self) -> None:
        from llmport_agent.core.config import load_config
        from llmport_agent.logs.sink import sink_config

        c = load_config({"LLM_PORT_NODE_AGENT_LOKI_BEARER_TOKEN": "loki-bearer-s3cret",
                         "LLM_PORT_NODE_AGENT_LOKI_TENANT": "t1"})
        out, note = sink_config(c, "https://u:p@logs.example")
        self.assertEqual((out.loki_url, out.loki_bearer_token, out.loki_tenant),
                         ("https://u:p@logs.example", None, "t1"))
        assert note is not None
        self.assertIn("LLM_PORT_NODE_AGENT_LOKI_BEARER_TOKEN", note)
        self.assertNotIn("s3cret", note)
        self.assertNotIn(":p@", note)
        self.assertEqual(sink_config(load_config({}), "http://l.example")[1], None)


class JournalConsentTests(SynchronousTestCase):
    """
    Issue 29: with LOKI_URL unset the backend's sink got every unit's journal (sshd logins, a
    sudo command line with its password). The host journal goes only where the operator chose:
    an own LOKI_URL (all of it, as the original agent shipped it), or LOG_JOURNAL_UNITS.
    """

    def config(self, **env: str) -> Any:
        from llmport_agent.core.config import load_config

        return load_config({f"LLM_PORT_NODE_AGENT_{k}": v for k, v in env.items()})

    def test_selection(self) -> None:
        from llmport_agent.logs.wiring import journal_selection

        for env, operator, backend in (
            ({}, (), None),  # the default: all to LOKI_URL, none to the backend's sink
            ({"LOG_JOURNAL_UNITS": "sshd.service,nginx.service"},
             ("sshd.service", "nginx.service"), ("sshd.service", "nginx.service")),
            ({"LOG_JOURNAL_UNITS": "*"}, (), ()),
            ({"LOG_JOURNAL_UNITS": "none"}, None, None),
        ):
            c = self.config(**env)
            self.assertEqual(journal_selection(c, backend_sink=False), operator, env)
            self.assertEqual(journal_selection(c, backend_sink=True), backend, env)

    def test_bad_unit_names_are_refused(self) -> None:
        from llmport_agent.core.config import ConfigError

        for bad in ("-x", "a b", "*,sshd.service", "x\ny", "none,sshd.service", ",".join(["u"] * 65)):
            with self.assertRaises(ConfigError, msg=bad):
                self.config(LOG_JOURNAL_UNITS=bad)

    def build(self, backend_sink: bool, **env: str) -> Any:
        from llmport_agent.logs.sink import sink_config
        from llmport_agent.logs.wiring import build_log_shipping

        c = self.config(STATE_PATH=os.path.join(os.path.abspath(self.mktemp()), "state.json"), **env)
        if backend_sink:
            c, _note = sink_config(c, "http://127.0.0.1:3100")
        return build_log_shipping(reactor, c, state_dir=os.path.dirname(c.state_path), host=lambda: "h",
                                  secrets=list, backend_sink=backend_sink)

    def test_the_backends_sink_gets_no_host_journal_unless_units_are_named(self) -> None:
        shipping = self.build(True)
        self.assertIsNone(shipping.journald)
        self.assertNotIn(shipping.journald, shipping.readers)
        self.assertEqual(shipping.describe()["journal"], {})
        # The agent's own lines and its workloads' still go there.
        self.assertIsNotNone(shipping.observer)
        self.assertIsNotNone(shipping.ray_serve)
        shipping = self.build(True, LOG_JOURNAL_UNITS="sshd.service")
        self.assertEqual(shipping.journald.describe()["units"], ["sshd.service"])

    def test_an_operators_loki_url_gets_the_journal(self) -> None:
        shipping = self.build(False, LOKI_URL="http://127.0.0.1:3100")
        self.assertIsNotNone(shipping.journald)
        self.assertEqual(shipping.journald.describe()["units"], [])
        shipping = self.build(False, LOKI_URL="http://127.0.0.1:3100", LOG_JOURNAL_UNITS="none")
        self.assertIsNone(shipping.journald)


class PlantedBugTests(SynchronousTestCase):
    """Issue 26's planted bugs in log-sink discovery that no test caught."""

    def test_no_loki_secret_setting_reaches_the_backends_sink(self) -> None:
        """
        Every one of the operator's Loki credentials, the file variants included, is left out
        of what ships to a sink the backend names: nothing of them in the shipper's headers.
        """
        from llmport_agent.core.config import load_config
        from llmport_agent.logs.sink import sink_config
        from llmport_agent.logs.wiring import build_log_shipping

        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        secret_file = os.path.join(d, "loki-secret")
        with open(secret_file, "w") as f:
            f.write("file-s3cret-value\n")
        os.chmod(secret_file, 0o600)
        for env in ({"LOKI_BEARER_TOKEN_FILE": secret_file},
                    {"LOKI_BEARER_TOKEN": "env-s3cret-value"},
                    {"LOKI_USERNAME": "ops", "LOKI_PASSWORD_FILE": secret_file},
                    {"LOKI_USERNAME": "ops", "LOKI_PASSWORD": "env-s3cret-value"}):
            full = {f"LLM_PORT_NODE_AGENT_{k}": v for k, v in env.items()}
            full["LLM_PORT_NODE_AGENT_STATE_PATH"] = os.path.join(d, "state.json")
            c, note = sink_config(load_config(full), "http://127.0.0.1:3100")
            shipping = build_log_shipping(reactor, c, state_dir=d, host=lambda: "h", secrets=list,
                                          backend_sink=True)
            auth = shipping.shipper.auth
            auth.load()
            shown = json.dumps([auth.headers(), auth.basic(), auth.describe()])
            self.assertNotIn("s3cret", shown, env)
            self.assertNotIn("authorization", shown.lower(), env)
            self.assertIsNone(auth.basic(), env)
            for name in env:
                self.assertIn(f"LLM_PORT_NODE_AGENT_{name}", note or "", env)

    def test_the_reask_period_is_one_hour(self) -> None:
        """docs/logs.md: asked again "every hour while connected and told there is none"."""
        clock = Clock()
        script = Script(None, None, None)
        disc = LogSinkDiscovery(clock, script, lambda url: None)  # the agent's own defaults
        disc.startService()
        self.addCleanup(disc.stopService)
        disc.session_opened()
        clock.advance(0)
        self.assertEqual(script.calls, 1)
        clock.advance(3600 - 1)
        self.assertEqual(script.calls, 1)
        clock.advance(1)
        self.assertEqual(script.calls, 2)
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with open(os.path.join(here, "docs", "logs.md")) as f:
            self.assertIn("every hour while connected and told there is none", " ".join(f.read().split()))
