"""The backend session: protocol in memory (iosim), enrollment, refusals, rotation, polling."""

from __future__ import annotations

import json
import os
from typing import Any

import txaio
import txaio.testutil
from autobahn.twisted.websocket import WebSocketServerFactory, WebSocketServerProtocol
from autobahn.websocket.types import ConnectionDeny
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import formatEvent, globalLogPublisher
from twisted.test import iosim
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.core.config import load_config
from llmport_agent.core.state import StateStore, token_fingerprint
from llmport_agent.demo.testing import SynchronousRunner
from llmport_agent.session.backend_http import Enrollment, Rejected, Transient
from llmport_agent.session.protocol import AgentClientFactory, ConnectionGone
from llmport_agent.session.rotation import ROTATION_INTERVAL
from llmport_agent.session.service import SessionService, stream_url
from llmport_agent.session.shared import EXIT_NEEDS_OPERATOR
from llmport_agent.session.stop import CRITICAL_STOP_GRACE

CRED = "11111111-2222-3333-4444-555555555555." + "s" * 43


class UrlTests(SynchronousTestCase):
    def test_stream_url(self) -> None:
        """ws for http, wss for https, base path kept."""
        self.assertEqual(stream_url("http://h:8000"), "ws://h:8000/api/admin/system/nodes/stream")
        self.assertEqual(stream_url("https://h/llm"), "wss://h/llm/api/admin/system/nodes/stream")


class Sink:
    """Stands in for SessionService towards the protocol."""

    def __init__(self) -> None:
        self.opened: list[Any] = []
        self.frames: list[dict[str, Any]] = []
        self.closed: list[tuple[Any, ...]] = []

    def connection_opened(self, proto: Any) -> None:
        self.opened.append(proto)

    def frame_received(self, proto: Any, frame: dict[str, Any]) -> None:
        self.frames.append(frame)

    def connection_closed(self, proto: Any, *args: Any) -> None:
        self.closed.append(args)


class Server(WebSocketServerProtocol):
    deny: int | None = None
    instances: list[Server] = []

    def onConnect(self, request: Any) -> None:
        self.headers = request.headers
        Server.instances.append(self)
        if self.deny:
            raise ConnectionDeny(self.deny)

    def onPing(self, payload: bytes) -> None:
        if not getattr(self, "no_pong", False):
            super().onPing(payload)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        self.received = getattr(self, "received", []) + [json.loads(payload)]


class ProtocolTests(SynchronousTestCase):
    def connect(self, deny: int | None = None) -> tuple[Any, Any, Any, Sink]:
        clock = Clock()
        self.loop = txaio.testutil.replace_loop(clock)
        self.loop.__enter__()
        self.addCleanup(self.loop.__exit__, None, None, None)
        sink = Sink()
        factory = AgentClientFactory(
            "ws://backend:8000/llm/api/admin/system/nodes/stream",
            session=sink,  # type: ignore[arg-type]
            credential=lambda: CRED,
            clock=clock,
            useragent="test",
        )
        factory.setProtocolOptions(openHandshakeTimeout=0, closeHandshakeTimeout=0)
        client = factory.buildProtocol(None)
        Server.deny = deny
        Server.instances = []
        sf = WebSocketServerFactory()
        sf.protocol = Server
        sf.setProtocolOptions(openHandshakeTimeout=0, closeHandshakeTimeout=0)
        server = sf.buildProtocol(None)
        pump = iosim.connect(
            server, iosim.makeFakeServer(server), client, iosim.makeFakeClient(client), greet=False
        )
        pump.flush()
        return client, server, pump, sink

    def test_bearer_header_and_path(self) -> None:
        """The upgrade carries 'Authorization: Bearer <credential>' on the base-path stream URL."""
        client, server, pump, sink = self.connect()
        self.assertEqual(server.headers["authorization"], "Bearer " + CRED)
        self.assertEqual(server.http_request_path, "/llm/api/admin/system/nodes/stream")
        self.assertEqual(sink.opened, [client])

    def test_seq_increases_from_one(self) -> None:
        """seq starts at 1 on each connection and strictly increases."""
        client, server, pump, sink = self.connect()
        for _ in range(3):
            client.send_frame({"type": "poll"})
        pump.flush()
        self.assertEqual([f["seq"] for f in server.received], [1, 2, 3])

    def test_bad_inbound_frames(self) -> None:
        """Non-JSON, a JSON list, a binary frame: one log line each, nothing delivered."""
        client, server, pump, sink = self.connect()
        server.sendMessage(b"not json")
        server.sendMessage(b"[1,2]")
        server.sendMessage(b"\x00\x01", isBinary=True)
        server.sendMessage(b'{"type":"commands","items":[]}')
        pump.flush()
        self.assertEqual(sink.frames, [{"type": "commands", "items": []}])
        self.assertEqual(sink.closed, [])

    def test_confirm_by_pong(self) -> None:
        """confirm() fires when the server answers the ping sent after the frames."""
        client, server, pump, sink = self.connect()
        client.send_frame({"type": "command_result"})
        d = client.confirm()
        self.assertNoResult(d)
        pump.flush()
        self.successResultOf(d)

    def test_confirm_fails_on_close(self) -> None:
        """A confirmation pending when the connection drops fails with ConnectionGone."""
        client, server, pump, sink = self.connect()
        server.no_pong = True
        d = client.confirm()
        pump.flush()
        self.assertNoResult(d)
        client.transport.loseConnection()
        pump.flush()
        self.failureResultOf(d, ConnectionGone)

    def test_refused_upgrade_reports_status(self) -> None:
        """A 403 at the upgrade is reported with its HTTP status and without an open."""
        client, server, pump, sink = self.connect(deny=403)
        pump.flush()
        self.assertEqual(sink.opened, [])
        self.assertEqual(sink.closed[-1][-1], 403)


class FakeBackend:
    def __init__(self) -> None:
        self.enrolls: list[Deferred[Enrollment]] = []
        self.rotations: list[Deferred[tuple[str, str]]] = []

    def enroll(self, token: str, agent_id: str, host: str, caps: dict[str, Any], version: str) -> Deferred[Enrollment]:
        d: Deferred[Enrollment] = Deferred()
        self.enrolls.append(d)
        return d

    def rotate(self, credential: str, timeout: float) -> Deferred[tuple[str, str]]:
        d: Deferred[tuple[str, str]] = Deferred()
        self.rotations.append(d)
        return d

    def whoami(self, credential: str, timeout: float | None = None) -> Deferred[dict[str, Any]]:
        """An April backend: the route does not exist (the current one is in test_deleted_node)."""
        from twisted.internet.defer import fail

        from llmport_agent.session.backend_http import RouteMissing

        self.whoami_calls = getattr(self, "whoami_calls", 0) + 1
        return fail(RouteMissing("GET /api/node-files/whoami: HTTP 404 (no such route)"))


class FakeProto:
    def __init__(self, opened_at: float | None) -> None:
        self.opened_at = opened_at
        self.frames_sent = 0
        self.sent: list[dict[str, Any]] = []
        self.is_closed: Deferred[None] = succeed(None)
        self.can_send = True

    def sendClose(self, code: int, reason: str) -> None:
        self.close = (code, reason)

    def send_frame(self, frame: dict[str, Any], *, seq: bool = True) -> int:
        self.sent.append(frame)
        return len(self.sent)


class SessionServiceTests(SynchronousTestCase):
    def make(
        self, token: str | None = None, credential: str | None = None, state_dir: str | None = None,
        load_late: bool = False, **env: str,
    ) -> SessionService:
        self.reactor = MemoryReactorClock()
        self.wall = [1_000_000.0]
        self.logged: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(self.logged.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.logged.append)
        self.fatal: list[tuple[int, str]] = []
        self.backend = FakeBackend()
        environ = {"LLM_PORT_NODE_AGENT_BACKEND_URL": "http://127.0.0.1:8000"}
        if token:
            environ["LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN"] = token
        environ.update({"LLM_PORT_NODE_AGENT_" + k: v for k, v in env.items()})
        config = load_config(environ, {})
        d = state_dir or self.mktemp()
        os.makedirs(d, exist_ok=True)
        self.state = StateStore(SynchronousRunner(), os.path.join(d, "state.json"))
        if not load_late:
            self.successResultOf(self.state.load())
        if credential:
            self.successResultOf(self.state.update(credential=credential, node_id="n1"))
        svc = SessionService(
            self.reactor, config, self.state, self.backend,  # type: ignore[arg-type]
            lambda: succeed({"gpu_count": 0}), lambda code, msg: self.fatal.append((code, msg)),
            version="0.1.0",
            endpoint_factory=lambda host, port, tls: TCP4ClientEndpoint(self.reactor, host, port),
            rng=lambda: 1.0, wallclock=lambda: self.wall[0] + self.reactor.seconds(),
        )
        if load_late:
            # As the agent does: the session is built, then the state file is loaded.
            self.successResultOf(self.state.load())
        self.addCleanup(svc.stopService)
        return svc

    def test_no_credential_no_token(self) -> None:
        """Without credential and token the agent stops with the 'needs operator' status."""
        svc = self.make()
        svc.startService()
        self.assertEqual(self.fatal[0][0], EXIT_NEEDS_OPERATOR)
        self.assertIn("enrollment-tokens", self.fatal[0][1])
        self.assertEqual(self.reactor.tcpClients, [])

    def test_enroll_then_connect(self) -> None:
        """With a token, enroll, store the credential, then connect to the stream."""
        svc = self.make(token="tok-123")
        svc.startService()
        self.backend.enrolls[0].callback(Enrollment("n1", CRED, "10.1.2.3"))
        self.assertEqual(self.state.credential, CRED)
        self.assertEqual(self.state.get("backend_host"), "10.1.2.3")
        self.assertIn(token_fingerprint("tok-123"), self.state.get("used_tokens"))
        self.assertEqual(len(self.reactor.tcpClients), 1)
        self.assertEqual(self.reactor.tcpClients[0][:2], ("127.0.0.1", 8000))
        with open(self.state.path) as f:
            self.assertNotIn("tok-123", f.read())

    def test_enroll_rejected(self) -> None:
        """A rejected token: one clear message, the dedicated exit status, no retry."""
        svc = self.make(token="tok-123")
        svc.startService()
        self.backend.enrolls[0].errback(Rejected(401, "Enrollment token is invalid or expired."))
        self.assertEqual(self.fatal[0][0], EXIT_NEEDS_OPERATOR)
        self.assertIn("invalid, expired or already used", self.fatal[0][1])
        self.assertNotIn("tok-123", self.fatal[0][1])
        self.reactor.advance(3600)
        self.assertEqual(len(self.backend.enrolls), 1)

    def test_enroll_transient_retries_with_backoff(self) -> None:
        """Network errors and 5xx are retried after a backoff delay."""
        svc = self.make(token="tok-123")
        svc.startService()
        self.backend.enrolls[0].errback(Transient("HTTP 503"))
        self.assertEqual(len(self.backend.enrolls), 1)
        self.reactor.advance(1.9)
        self.assertEqual(len(self.backend.enrolls), 1)
        self.reactor.advance(10)
        self.assertEqual(len(self.backend.enrolls), 2)

    def test_stored_credential_token_unused(self) -> None:
        """With a credential stored, the token is not used again."""
        svc = self.make(token="tok-123", credential=CRED)
        svc.startService()
        self.assertEqual(self.backend.enrolls, [])
        self.assertEqual(len(self.reactor.tcpClients), 1)

    def test_connection_attempts_counted(self) -> None:
        """Diagnostics count every connection attempt, the refused ones too (not only opens)."""
        from twisted.internet.error import ConnectionRefusedError
        from twisted.python.failure import Failure

        svc = self.make(credential=CRED)
        svc.startService()
        self.assertEqual(svc.stats.connects, 1)
        for attempt in range(2, 5):
            self.reactor.tcpClients[-1][2].clientConnectionFailed(None, Failure(ConnectionRefusedError()))
            self.reactor.advance(60)
            self.assertEqual(len(self.reactor.tcpClients), attempt)
            self.assertEqual(svc.stats.connects, attempt)
        self.assertEqual(svc.stats.as_dict()["connects"], 4)
        self.assertEqual(svc.stats.opens, 0)

    def test_refused_connection_reads_as_one_sentence(self) -> None:
        """Twisted's "...: Connection refused." is said without its full stop before "; retrying"."""
        from twisted.internet.error import ConnectionRefusedError
        from twisted.python.failure import Failure

        svc = self.make(credential=CRED)
        svc.startService()
        self.reactor.tcpClients[-1][2].clientConnectionFailed(
            None, Failure(ConnectionRefusedError(111, "Connection refused")))
        retry = [t for t in self.lines() if "retrying in" in t]
        self.assertEqual(len(retry), 1, self.lines())
        self.assertIn("Connection refused; retrying in", retry[0])
        self.assertNotIn(".;", retry[0])
        self.assertNotIn(".;", svc.stats.last_error)

    def refuse(self, svc: SessionService, times: int, every: float) -> None:
        for _ in range(times):
            svc.connection_closed(FakeProto(None), False, 1006, "upgrade failed [403]", 403)  # type: ignore[arg-type]
            self.reactor.advance(every)

    def lines(self) -> list[str]:
        return [formatEvent(e) for e in self.logged]

    def test_fresh_token_tried_at_first_refusal(self) -> None:
        """
        A configured token this node never used is tried at the first 403 (not after minutes
        of refusals), and the agent reconnects at once with the new credential.
        """
        svc = self.make(token="new-token", credential=CRED)
        svc.startService()
        self.refuse(svc, 1, 0)
        self.assertEqual(len(self.backend.enrolls), 1)
        # Further refusals while it enrolls do not start a second enrollment.
        self.refuse(svc, 2, 0)
        self.assertEqual(len(self.backend.enrolls), 1)
        connects = len(self.reactor.tcpClients)
        new = "22222222-2222-3333-4444-555555555555." + "x" * 43
        self.backend.enrolls[0].callback(Enrollment("n1", new, None))
        self.assertEqual(self.state.credential, new)
        self.assertEqual(self.state.get("previous_credential"), CRED)
        self.assertIn(token_fingerprint("new-token"), self.state.get("used_tokens"))
        self.assertIsNone(self.state.get("refusals"))
        # A new connection attempt without waiting for the backoff delay.
        self.assertEqual(len(self.reactor.tcpClients), connects + 1)

    def test_used_token_not_tried_again(self) -> None:
        """A token this node already used is never sent again; refusals just count."""
        svc = self.make(token="old-token", credential=CRED)
        self.successResultOf(self.state.update(used_tokens=[token_fingerprint("old-token")]))
        svc.startService()
        self.refuse(svc, 3, 1)
        self.assertEqual(self.backend.enrolls, [])

    def test_rejected_fresh_token_does_not_stop_the_agent(self) -> None:
        """If the fresh token is rejected too, one clear line, no exit; the token is not tried again."""
        svc = self.make(token="expired-token", credential=CRED)
        svc.startService()
        self.refuse(svc, 1, 0)
        self.backend.enrolls[0].errback(Rejected(401, "Enrollment token is invalid or expired."))
        self.assertEqual(self.fatal, [])
        self.assertTrue(any("rejected the configured enrollment token" in line for line in self.lines()))
        self.refuse(svc, 2, 1)
        self.assertEqual(len(self.backend.enrolls), 1)
        self.assertEqual(self.state.credential, CRED)

    def test_refusal_count_survives_restart(self) -> None:
        """
        4 refusals over 4 minutes, a restart, one more refusal: the credential counts as
        revoked at once (the count and its start are kept in the state file).
        """
        d = self.mktemp()
        svc = self.make(credential=CRED, state_dir=d)
        svc.startService()
        self.refuse(svc, 4, 60)
        self.assertFalse(svc.refusals.revoked)
        self.assertEqual(self.state.get("refusals")["count"], 4)
        svc.stopService()
        wall = self.wall[0] + self.reactor.seconds()
        svc2 = self.make(credential=None, state_dir=d)  # loads the same state file
        self.wall[0] = wall + 5  # its reactor clock starts at 0 again: the wall clock goes on
        self.assertEqual(self.state.credential, CRED)
        svc2.startService()
        self.refuse(svc2, 1, 0)
        self.assertTrue(svc2.refusals.revoked)

    def test_refusal_count_read_when_the_session_starts(self) -> None:
        """
        The persisted count is read at startService, not when the session is built (the agent
        loads its state file in between): 4 refusals, a restart, one more: revoked.
        """
        d = self.mktemp()
        svc = self.make(credential=CRED, state_dir=d)
        svc.startService()
        self.refuse(svc, 4, 60)
        svc.stopService()
        wall = self.wall[0] + self.reactor.seconds()
        svc2 = self.make(credential=None, state_dir=d, load_late=True)
        self.wall[0] = wall + 5
        self.assertEqual(self.state.credential, CRED)
        svc2.startService()
        self.assertEqual(svc2.refusals.count, 4)
        self.refuse(svc2, 1, 0)
        self.assertTrue(svc2.refusals.revoked)

    def test_open_clears_persisted_refusals(self) -> None:
        """A session that opens resets the refusal count, on disk too."""
        svc = self.make(credential=CRED)
        svc.startService()
        self.refuse(svc, 2, 1)
        self.assertIsNotNone(self.state.get("refusals"))
        svc.connection_opened(FakeProto(self.reactor.seconds()))  # type: ignore[arg-type]
        self.assertIsNone(self.state.get("refusals"))
        with open(self.state.path) as f:
            self.assertNotIn("refusals", json.load(f))

    def test_token_line_only_after_the_credential_was_accepted(self) -> None:
        """'can be removed' is said once, after the backend accepted the stored credential."""
        svc = self.make(token="some-token", credential=CRED)
        svc.startService()
        self.refuse(svc, 1, 0)  # refused: the token is needed now, nothing said about removing it
        self.assertFalse(any("can be removed" in line for line in self.lines()))
        self.backend.enrolls[0].callback(Enrollment("n1", CRED, None))
        svc.connection_opened(FakeProto(self.reactor.seconds()))  # type: ignore[arg-type]
        said = [line for line in self.lines() if "can be removed" in line]
        self.assertEqual(len(said), 1)
        self.assertIn("used to enroll", said[0])
        svc.connection_opened(FakeProto(self.reactor.seconds()))  # type: ignore[arg-type]
        self.assertEqual(len([line for line in self.lines() if "can be removed" in line]), 1)

    def test_stop_cancels_the_retry_delay(self) -> None:
        """A stop during an enrollment's retry delay completes at once; no retry follows."""
        svc = self.make(token="tok-123", REQUEST_TIMEOUT_SEC="300")
        svc.startService()
        self.backend.enrolls[0].errback(Transient("HTTP 503"))
        self.successResultOf(svc.stopService())
        self.reactor.advance(3600)
        self.assertEqual(len(self.backend.enrolls), 1)
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_stop_cancels_a_hanging_enrollment(self) -> None:
        """
        An enrollment request that hangs (REQUEST_TIMEOUT_SEC=300) gets CRITICAL_STOP_GRACE
        to answer, then is cancelled: the stop completes, with no retry armed after it.
        """
        svc = self.make(token="tok-123", REQUEST_TIMEOUT_SEC="300")
        enrolls: list[Deferred[Enrollment]] = []

        def hanging(*args: Any) -> Deferred[Enrollment]:
            # Like BackendHTTP: a cancelled request surfaces as Transient ("no answer").
            d: Deferred[Enrollment] = Deferred(lambda d: d.errback(Transient("no answer within 300 s")))
            enrolls.append(d)
            return d

        self.backend.enroll = hanging  # type: ignore[method-assign]
        self.backend.enrolls = enrolls
        svc.startService()
        stopped = svc.stopService()
        self.assertNoResult(stopped)
        self.reactor.advance(CRITICAL_STOP_GRACE)
        self.successResultOf(stopped)
        self.assertTrue(self.backend.enrolls[0].called)  # cancelled
        self.assertEqual(self.reactor.getDelayedCalls(), [])
        self.assertEqual(self.fatal, [])
        self.assertEqual(self.reactor.tcpClients, [])

    def test_stop_keeps_a_credential_that_arrives_in_the_grace(self) -> None:
        """An enrollment answered within the grace is stored (the token is spent by then)."""
        svc = self.make(token="tok-123")
        svc.startService()
        stopped = svc.stopService()
        self.reactor.advance(CRITICAL_STOP_GRACE / 2)
        self.backend.enrolls[0].callback(Enrollment("n1", CRED, None))
        self.successResultOf(stopped)
        self.assertEqual(self.state.credential, CRED)

    def test_stop_cancels_a_hanging_rotation(self) -> None:
        """A rotation in flight at stop is cancelled after the grace; the current credential stays."""
        svc = self.make(credential=CRED)
        svc.startService()
        rotated = svc.rotate()
        stopped = svc.stopService()
        self.reactor.advance(CRITICAL_STOP_GRACE)
        self.successResultOf(stopped)
        self.assertFalse(self.successResultOf(rotated))
        self.assertEqual(self.state.credential, CRED)

    def test_unverified_tls_warned_before_the_first_request(self) -> None:
        """VERIFY_TLS=false on an https backend: the warning is logged before enrollment leaves."""
        seen_at_enroll: list[bool] = []
        svc = self.make(token="tok-123", BACKEND_URL="https://backend.example:8443", VERIFY_TLS="false")
        enroll = self.backend.enroll

        def spy(*args: Any) -> Deferred[Enrollment]:
            seen_at_enroll.append(any("TLS verification is OFF" in line for line in self.lines()))
            return enroll(*args)

        self.backend.enroll = spy  # type: ignore[method-assign]
        svc.startService()
        self.assertEqual(seen_at_enroll, [True])

    def test_revoked_without_token_keeps_retrying(self) -> None:
        """Without a usable token: a clear line, retries minutes apart, credential kept, no exit."""
        svc = self.make(credential=CRED)
        svc.startService()
        self.refuse(svc, 5, 60)
        self.assertEqual(self.fatal, [])
        self.assertEqual(self.state.credential, CRED)
        self.assertTrue(svc.refusals.revoked)
        self.assertGreaterEqual(svc.retry_policy(1), 120)  # type: ignore[union-attr]

    def test_phase_connect_fail_open_close_stop(self) -> None:
        """connecting, backing_off after a failed connect, connected, backing_off, stopped."""
        from twisted.internet.error import ConnectionRefusedError
        from twisted.python.failure import Failure

        svc = self.make(credential=CRED)
        self.assertEqual(svc.phase, "stopped")
        svc.startService()
        self.assertEqual(svc.phase, "connecting")
        self.reactor.tcpClients[-1][2].clientConnectionFailed(None, Failure(ConnectionRefusedError()))
        self.assertEqual(svc.phase, "backing_off")
        proto = FakeProto(self.reactor.seconds())
        svc.connection_opened(proto)  # type: ignore[arg-type]
        self.assertEqual(svc.phase, "connected")
        svc.connection_closed(proto, False, 1006, "gone", None)  # type: ignore[arg-type]
        self.assertEqual(svc.phase, "backing_off")
        svc.stopService()
        self.assertEqual(svc.phase, "stopped")

    def test_phase_superseded_connection_closing_keeps_connected(self) -> None:
        """An older connection closing while a newer one is open does not leave 'connected'."""
        svc = self.make(credential=CRED)
        svc.startService()
        old, new = FakeProto(0.0), FakeProto(0.0)
        svc.connection_opened(old)  # type: ignore[arg-type]
        svc.connection_opened(new)  # type: ignore[arg-type]
        svc.connection_closed(old, True, 1000, "superseded", None)  # type: ignore[arg-type]
        self.assertEqual(svc.phase, "connected")

    def test_phase_enrolling_then_backing_off_after_transient(self) -> None:
        """'enrolling' through an enrollment's retries; after them the stream connect is a retry."""
        svc = self.make(token="tok-123")
        svc.startService()
        self.assertEqual(svc.phase, "enrolling")
        self.backend.enrolls[0].errback(Transient("HTTP 503"))
        self.assertEqual(svc.phase, "enrolling")
        self.assertEqual(svc.stats.last_error, "enrollment failed: HTTP 503")
        self.reactor.advance(60)
        self.backend.enrolls[1].callback(Enrollment("n1", CRED, "10.1.2.3"))
        # A failed attempt happened since the start: the stream connect is a retry.
        self.assertEqual(svc.phase, "backing_off")

    def test_phase_revoked_says_refused(self) -> None:
        """Repeated refusals over time: 'refused' (not backing off), until the stream opens."""
        svc = self.make(credential=CRED)
        svc.startService()
        self.refuse(svc, 5, 60)
        self.assertTrue(svc.refusals.revoked)
        self.assertEqual(svc.phase, "refused")
        svc.connection_opened(FakeProto(self.reactor.seconds()))  # type: ignore[arg-type]
        self.assertFalse(svc.refusals.revoked)
        self.assertEqual(svc.phase, "connected")

    def test_quick_refusals_not_revoked(self) -> None:
        """Several 403s within seconds (a proxy blip) do not count as revocation."""
        svc = self.make(credential=CRED)
        svc.startService()
        self.refuse(svc, 10, 1)
        self.assertFalse(svc.refusals.revoked)

    def test_poll_frames(self) -> None:
        """While connected and idle, a poll frame goes out one interval after the last frame."""
        svc = self.make(credential=CRED)
        svc.startService()
        proto = FakeProto(self.reactor.seconds())
        svc.connection_opened(proto)  # type: ignore[arg-type]
        for _ in range(5):
            self.reactor.advance(2)
        self.assertEqual([f["type"] for f in proto.sent], ["poll"] * 5)
        self.reactor.advance(1.5)
        svc.send({"type": "heartbeat"})
        self.reactor.advance(1.9)
        # No poll yet: the heartbeat already asked for commands.
        self.assertEqual(proto.sent[-1]["type"], "heartbeat")
        self.reactor.advance(0.1)
        self.assertEqual(proto.sent[-1]["type"], "poll")
        # Never more than one interval without a frame.
        gaps = []
        last = self.reactor.seconds()
        for _ in range(10):
            self.reactor.advance(0.5)
            if proto.sent[-1].get("_t") is None:
                proto.sent[-1]["_t"] = self.reactor.seconds()
                gaps.append(self.reactor.seconds() - last)
                last = self.reactor.seconds()
        self.assertTrue(all(g <= 2.0 for g in gaps))

    def test_no_poll_when_disconnected(self) -> None:
        """After the connection closes no poll timer is left."""
        svc = self.make(credential=CRED)
        svc.startService()
        proto = FakeProto(self.reactor.seconds())
        svc.connection_opened(proto)  # type: ignore[arg-type]
        svc.connection_closed(proto, True, 1000, "", None)  # type: ignore[arg-type]
        self.reactor.advance(10)
        self.assertEqual(proto.sent, [])

    def test_rotation_every_12h(self) -> None:
        """Rotation runs after 12 h of wall-clock time over a healthy session; success stores the new one."""
        svc = self.make(credential=CRED)
        self.successResultOf(self.state.update(last_rotation_at=self.wall[0]))
        svc.startService()
        svc.connection_opened(FakeProto(self.reactor.seconds()))  # type: ignore[arg-type]
        self.reactor.advance(600)
        self.assertEqual(self.backend.rotations, [])
        self.wall[0] += ROTATION_INTERVAL
        self.reactor.advance(600)
        self.assertEqual(len(self.backend.rotations), 1)
        new = "33333333-2222-3333-4444-555555555555." + "r" * 43
        self.backend.rotations[0].callback(("n1", new))
        self.assertEqual(self.state.credential, new)
        self.assertIsNone(self.state.get("previous_credential"))

    def test_rotation_unknown_outcome_keeps_old(self) -> None:
        """A lost rotation reply keeps the current credential (both are kept when the new one arrived)."""
        svc = self.make(credential=CRED)
        svc.startService()
        d = svc.rotate()
        self.backend.rotations[0].errback(Transient("no answer within 10 s"))
        self.assertFalse(self.successResultOf(d))
        self.assertEqual(self.state.credential, CRED)
    def test_two_credentials_alternate(self) -> None:
        """With two credentials in doubt, each refusal tries the other; an open keeps the working one."""
        svc = self.make(credential=CRED)
        self.successResultOf(self.state.update(previous_credential="old.cred"))
        svc.startService()
        self.refuse(svc, 1, 1)
        self.assertEqual(self.state.credential, "old.cred")
        self.refuse(svc, 1, 1)
        self.assertEqual(self.state.credential, CRED)
        svc.connection_opened(FakeProto(self.reactor.seconds()))  # type: ignore[arg-type]
        self.assertIsNone(self.state.get("previous_credential"))

    def test_confirmed_rotation_forgets_old(self) -> None:
        """After a confirmed rotation the old (revoked) credential is not kept."""
        svc = self.make(credential=CRED)
        svc.startService()
        d = svc.rotate()
        new = "44444444-2222-3333-4444-555555555555." + "q" * 43
        self.backend.rotations[0].callback(("n1", new))
        self.assertTrue(self.successResultOf(d))
        self.assertIsNone(self.state.get("previous_credential"))

    def test_enroll_422_keeps_token(self) -> None:
        """A 422 at enrollment stops the agent but does not mark the token as used."""
        svc = self.make(token="tok-422")
        svc.startService()
        self.backend.enrolls[0].errback(Rejected(422, "field required"))
        self.assertEqual(self.fatal[0][0], EXIT_NEEDS_OPERATOR)
        self.assertIn("malformed", self.fatal[0][1])
        self.assertNotIn(token_fingerprint("tok-422"), self.state.get("used_tokens", []))
