"""
Fabric probes (protocol 10.6) over real loopback connections (127.0.0.x): a listen+connect pair
with the source IP pinned, a wrong probe token, nothing listening (with and without retry), the
listener closed afterwards; and the timeouts on a Clock with MemoryReactor-free pieces.
"""

from __future__ import annotations

import socket
from typing import Any

from twisted.internet import reactor as real_reactor
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock, deferLater
from twisted.internet.testing import StringTransport
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import TestCase

from llmport_agent.ray import fabric
from tests.support.context import RecordingContext, make_command

TOKEN = "probe-" + "x9" * 12


def _free_port(ip: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


class LoopbackProbeTests(TestCase):
    """A listener and a dialler on loopback, on the real reactor."""

    async def _pair(self, listen_token: str | None, connect_token: str | None, expected: int = 1,
                    dials: int = 1, source_ip: str | None = "127.0.0.3") -> tuple[dict[str, Any], list[dict[str, Any]]]:
        port = _free_port("127.0.0.2")
        lp: dict[str, Any] = {"ip": "127.0.0.2", "port": port, "timeout_sec": 5, "expected_probes": expected}
        if listen_token is not None:
            lp["probe_token"] = listen_token
        listening = ensureDeferred(fabric.listen(real_reactor, lp))
        answers = []
        for _ in range(dials):
            cp: dict[str, Any] = {"target_ip": "127.0.0.2", "target_port": port, "timeout_sec": 5, "retry_for_sec": 3}
            if source_ip:
                cp["source_ip"] = source_ip
            if connect_token is not None:
                cp["probe_token"] = connect_token
            answers.append(await fabric.connect(real_reactor, cp))
        return await listening, answers

    async def test_pair_with_pinned_source(self) -> None:
        listened, [connected] = await self._pair(TOKEN, TOKEN)
        self.assertEqual(connected["reachable"], True)
        self.assertGreaterEqual(connected["rtt_ms"], 0)
        self.assertEqual((connected["target_ip"], connected["target_port"] > 0), ("127.0.0.2", True))
        self.assertGreaterEqual(connected["attempts"], 1)
        self.assertEqual(listened["listening"], True)
        self.assertEqual(listened["connected"], True)
        self.assertEqual((listened["probes_accepted"], listened["expected_probes"]), (1, 1))
        # The source IP was pinned: the listener saw the probe come from 127.0.0.3.
        self.assertEqual(listened["peer"][0], "127.0.0.3")

    async def test_listener_closed_after(self) -> None:
        port = _free_port("127.0.0.2")
        listening = ensureDeferred(fabric.listen(real_reactor, {"ip": "127.0.0.2", "port": port, "timeout_sec": 5}))
        first = await fabric.connect(real_reactor, {"target_ip": "127.0.0.2", "target_port": port, "retry_for_sec": 3})
        self.assertTrue(first["reachable"])
        await listening
        again = await fabric.connect(real_reactor, {"target_ip": "127.0.0.2", "target_port": port, "timeout_sec": 2})
        self.assertFalse(again["reachable"])
        self.assertIn("refused", again["error"])

    async def test_two_probes_expected(self) -> None:
        listened, answers = await self._pair(TOKEN, TOKEN, expected=2, dials=2)
        self.assertEqual([a["reachable"] for a in answers], [True, True])
        self.assertEqual(listened["probes_accepted"], 2)
        self.assertTrue(listened["connected"])

    async def test_wrong_token(self) -> None:
        port = _free_port("127.0.0.2")
        listening = ensureDeferred(fabric.listen(
            real_reactor, {"ip": "127.0.0.2", "port": port, "probe_token": TOKEN, "timeout_sec": 1}))
        seen: list[str] = []

        def observer(event: dict[str, Any]) -> None:
            seen.append(formatEvent(event))

        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        answer = await fabric.connect(real_reactor, {
            "target_ip": "127.0.0.2", "target_port": port, "probe_token": "guess", "retry_for_sec": 3})
        self.assertFalse(answer["reachable"])
        self.assertEqual(answer["error"], "probe rejected: ERR_AUTH")
        # A definitive answer is not retried.
        self.assertEqual(answer["attempts"], 1)
        listened = await listening
        self.assertEqual((listened["listening"], listened["connected"], listened["probes_accepted"]), (True, False, 0))
        self.assertIn("wrong probe token", listened["error"])
        for text in [str(answer), str(listened), *seen]:
            self.assertNotIn(TOKEN, text)

    async def test_nothing_listening(self) -> None:
        port = _free_port("127.0.0.2")
        answer = await fabric.connect(real_reactor, {"target_ip": "127.0.0.2", "target_port": port})
        self.assertEqual(answer["reachable"], False)
        self.assertIn("refused", answer["error"])
        self.assertEqual(answer["attempts"], 1)
        self.assertNotIn("rtt_ms", answer)

    async def test_retry_until_listener_starts(self) -> None:
        port = _free_port("127.0.0.2")
        started: Deferred[Any] = Deferred()

        def start() -> None:
            started.callback(ensureDeferred(fabric.listen(
                real_reactor, {"ip": "127.0.0.2", "port": port, "timeout_sec": 5})))

        real_reactor.callLater(0.6, start)
        answer = await fabric.connect(real_reactor, {"target_ip": "127.0.0.2", "target_port": port, "retry_for_sec": 5})
        self.assertTrue(answer["reachable"])
        self.assertGreater(answer["attempts"], 1)
        listened = await (await started)
        self.assertTrue(listened["connected"])

    async def test_listen_port_taken(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
            s.listen(1)
            port = s.getsockname()[1]
            answer = await fabric.listen(real_reactor, {"ip": "127.0.0.2", "port": port})
        self.assertEqual(answer["listening"], False)
        self.assertIn("cannot listen", answer["error"])

    async def test_through_the_handlers(self) -> None:
        specs = fabric.fabric_handler_specs()
        port = _free_port("127.0.0.2")
        lctx = RecordingContext(make_command("validate_fabric_listen", {"ip": "127.0.0.2", "port": port}), real_reactor)
        cctx = RecordingContext(make_command("validate_fabric_connect", {
            "target_ip": "127.0.0.2", "target_port": port, "source_ip": "127.0.0.4", "retry_for_sec": 3}), real_reactor)
        listening = ensureDeferred(specs["validate_fabric_listen"].handler(lctx))
        connected = await specs["validate_fabric_connect"].handler(cctx)
        listened = await listening
        self.assertTrue(connected["reachable"])
        self.assertEqual(listened["peer"][0], "127.0.0.4")


class InputTests(TestCase):
    """Bad payloads are answered as C{success: true} failures naming the field."""

    async def test_listen_inputs(self) -> None:
        for payload, word in [
            ({"port": 1}, "ip is required"),
            ({"ip": "fabric-host", "port": 1}, "not an IP address"),
            ({"ip": "0.0.0.0", "port": 1}, "unicast"),
            ({"ip": "224.0.0.1", "port": 1}, "unicast"),
            ({"ip": "ff02::1", "port": 1}, "unicast"),
            ({"ip": "127.0.0.2", "port": 0}, "port"),
            ({"ip": "127.0.0.2", "port": 70000}, "port"),
            ({"ip": "127.0.0.2", "port": "x"}, "port"),
            ({"ip": "127.0.0.2", "port": 5, "timeout_sec": "soon"}, "timeout_sec"),
            ({"ip": "127.0.0.2", "port": 5, "probe_token": "a\nb"}, "probe_token"),
        ]:
            answer = await fabric.listen(Clock(), payload)
            self.assertEqual(answer["listening"], False, payload)
            self.assertIn(word, answer["error"], payload)

    async def test_connect_inputs(self) -> None:
        for payload, word in [
            ({"target_port": 1}, "target_ip is required"),
            ({"target_ip": "127.0.0.2", "target_port": True}, "target_port"),
            ({"target_ip": "127.0.0.2", "target_port": 5, "source_ip": "me"}, "source_ip"),
            ({"target_ip": "127.0.0.2", "target_port": 5, "source_ip": "::1"}, "both be IPv4"),
            ({"target_ip": "239.1.2.3", "target_port": 5}, "unicast"),
            ({"target_ip": "127.0.0.2", "target_port": 5, "source_ip": "224.0.0.5"}, "unicast"),
        ]:
            answer = await fabric.connect(Clock(), payload)
            self.assertEqual((answer["reachable"], answer["attempts"]), (False, 0), payload)
            self.assertIn(word, answer["error"], payload)


class FakePort:
    def __init__(self) -> None:
        self.stopped = False

    def getHost(self) -> Any:
        class H:
            port = 4321

        return H()

    def stopListening(self) -> Deferred[None]:
        self.stopped = True
        d: Deferred[None] = Deferred()
        d.callback(None)
        return d


class ClockedListener:
    """A Clock that can also listen (returns a fake port) and connect (never answers)."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.port = FakePort()
        self.connects: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.clock, name)

    def listenTCP(self, port: int, factory: Any, backlog: int = 50, interface: str = "") -> FakePort:
        self.factory = factory
        return self.port

    def connectTCP(self, host: str, port: int, factory: Any, timeout: float = 30, bindAddress: Any = None) -> Any:
        self.connects.append((host, port, bindAddress, timeout))

        class Connector:
            def stopConnecting(self) -> None:
                pass

            def disconnect(self) -> None:
                pass

            def getDestination(self) -> Any:
                return (host, port)

        connector = Connector()
        factory.startedConnecting(connector)
        return connector


class ClockTimeoutTests(TestCase):
    """The timeouts, on a Clock (no real waiting)."""

    def test_listener_times_out_and_closes(self) -> None:
        r = ClockedListener()
        d = ensureDeferred(fabric.listen(r, {"ip": "127.0.0.2", "port": 9, "timeout_sec": 5}))
        self.assertNoResult(d)
        r.clock.advance(4.9)
        self.assertNoResult(d)
        r.clock.advance(0.2)
        answer = self.successResultOf(d)
        self.assertEqual(answer, {"listening": True, "connected": False, "probes_accepted": 0,
                                  "expected_probes": 1, "error": "timeout_waiting_for_probe"})
        self.assertTrue(r.port.stopped)
        self.assertEqual(r.clock.getDelayedCalls(), [])

    def test_listener_timeout_capped(self) -> None:
        r = ClockedListener()
        d = ensureDeferred(fabric.listen(r, {"ip": "127.0.0.2", "port": 9, "timeout_sec": 10 ** 9}))
        r.clock.advance(fabric.MAX_TIMEOUT_SEC * 5 + 0.1)
        self.assertFalse(self.successResultOf(d)["connected"])

    def test_connect_timeout_and_retry_capped(self) -> None:
        r = ClockedListener()
        d = ensureDeferred(fabric.connect(r, {
            "target_ip": "127.0.0.2", "target_port": 9, "source_ip": "127.0.0.5",
            "timeout_sec": 10 ** 6, "retry_for_sec": 10 ** 6}))
        self.assertEqual(r.connects[0][2], ("127.0.0.5", 0))
        # Every attempt gives up after the capped timeout; retries stop at the capped window.
        for _ in range(10000):
            if d.called:
                break
            r.clock.advance(fabric.MAX_TIMEOUT_SEC)
        answer = self.successResultOf(d)
        self.assertFalse(answer["reachable"])
        self.assertIn("timeout", answer["error"])
        total = fabric.MAX_RETRY_SEC + fabric.MAX_TIMEOUT_SEC
        self.assertLessEqual(r.clock.seconds(), total + fabric.MAX_TIMEOUT_SEC)
        self.assertGreater(answer["attempts"], 1)
        self.assertLessEqual(answer["attempts"], int(total / fabric.MAX_TIMEOUT_SEC) + 1)


class OriginalListener(Protocol):
    """
    A byte-exact stand-in of the original agent 0.1.13's probe listener (its
    C{run_ephemeral_listener}): read up to the first C{\\n}, decode and strip it, compare it
    with the token, write C{ACK\\n} or C{ERR_AUTH\\n}, close.
    """

    def __init__(self, token: str, seen: list[bytes]) -> None:
        self.token = token
        self.seen = seen
        self.buf = b""

    def dataReceived(self, data: bytes) -> None:
        self.buf += data
        if b"\n" not in self.buf:
            return
        line = self.buf[: self.buf.index(b"\n") + 1]
        self.seen.append(line)
        given = line.decode("utf-8").strip()
        self.transport.write(b"ERR_AUTH\n" if self.token and given != self.token else b"ACK\n")
        self.transport.loseConnection()


class OriginalProber(Protocol):
    """
    A byte-exact stand-in of the original agent's prober (its C{run_ephemeral_connect}):
    write C{<token>\\n}, read one line, reachable when it strips to C{ACK}.
    """

    def __init__(self, token: str) -> None:
        self.token = token
        self.buf = b""
        self.reachable: Deferred[tuple[bool, bytes]] = Deferred()

    def connectionMade(self) -> None:
        self.transport.write((self.token or "probe").encode() + b"\n")

    def dataReceived(self, data: bytes) -> None:
        self.buf += data
        if b"\n" in self.buf and not self.reachable.called:
            line = self.buf[: self.buf.index(b"\n") + 1]
            self.reachable.callback((line.strip() == b"ACK", line))

    def connectionLost(self, reason: Any = None) -> None:
        if not self.reachable.called:
            self.reachable.callback((False, self.buf))


class MixedFleetTests(TestCase):
    """This agent's prober and listener against the original agent's, over loopback."""

    async def test_original_listener_accepts_this_probe(self) -> None:
        seen: list[bytes] = []
        factory = Factory.forProtocol(lambda: OriginalListener(TOKEN, seen))
        port = real_reactor.listenTCP(0, factory, interface="127.0.0.2")
        self.addCleanup(port.stopListening)
        answer = await fabric.connect(real_reactor, {"target_ip": "127.0.0.2", "target_port": port.getHost().port,
                                                     "probe_token": TOKEN, "source_ip": "127.0.0.3"})
        self.assertTrue(answer["reachable"], answer)
        self.assertEqual(seen, [TOKEN.encode() + b"\r\n"])
        wrong = await fabric.connect(real_reactor, {"target_ip": "127.0.0.2", "target_port": port.getHost().port,
                                                    "probe_token": "guess"})
        self.assertEqual((wrong["reachable"], wrong["error"]), (False, "probe rejected: ERR_AUTH"))

    async def _original_probe(self, port: int, token: str) -> tuple[bool, bytes]:
        prober = OriginalProber(token)
        endpoint = TCP4ClientEndpoint(real_reactor, "127.0.0.2", port, bindAddress=("127.0.0.3", 0))
        for _ in range(40):
            try:
                await connectProtocol(endpoint, prober)
                break
            except ConnectionRefusedError:
                await deferLater(real_reactor, 0.05, lambda: None)
        return await prober.reachable

    async def test_this_listener_answers_the_original_probe(self) -> None:
        port = _free_port("127.0.0.2")
        listening = ensureDeferred(fabric.listen(real_reactor, {"ip": "127.0.0.2", "port": port, "timeout_sec": 5,
                                                                "probe_token": TOKEN, "expected_probes": 2}))
        ok, line = await self._original_probe(port, TOKEN)
        self.assertTrue(ok, line)
        bad, line = await self._original_probe(port, TOKEN + "x")
        self.assertEqual((bad, line.strip()), (False, b"ERR_AUTH"))
        ok, _line = await self._original_probe(port, TOKEN)
        self.assertTrue(ok)
        listened = await listening
        self.assertEqual((listened["connected"], listened["probes_accepted"]), (True, 2))


def _connection(factory: Any, host: str, port: int = 40000) -> tuple[Any, StringTransport]:
    proto = factory.buildProtocol(IPv4Address("TCP", host, port))
    transport = StringTransport(peerAddress=IPv4Address("TCP", host, port))
    proto.makeConnection(transport)
    return proto, transport


class ListenerLineTests(TestCase):
    """One probe line, read exactly; idle connections bounded (StringTransport, Clock)."""

    def listener(self, expected: int = 1, timeout: float = 60) -> tuple[ClockedListener, Deferred[dict[str, Any]]]:
        r = ClockedListener()
        d = ensureDeferred(fabric.listen(r, {"ip": "127.0.0.2", "port": 9, "timeout_sec": timeout,
                                             "probe_token": TOKEN, "expected_probes": expected}))
        return r, d

    def test_lf_and_crlf_lines(self) -> None:
        r, d = self.listener(expected=2)
        for ending in (b"\n", b"\r\n"):
            _p, t = _connection(r.factory, "10.0.0.2")
            _p.dataReceived(TOKEN.encode() + ending)
            self.assertEqual(t.value(), b"ACK\r\n")
        self.assertTrue(self.successResultOf(d)["connected"])

    def test_only_the_exact_token_passes(self) -> None:
        r, d = self.listener()
        for line in (TOKEN + "x", TOKEN + " ", " " + TOKEN, TOKEN[:-1], TOKEN + "\r\r", "x" + TOKEN, ""):
            _p, t = _connection(r.factory, "10.0.0.2")
            _p.dataReceived(line.encode() + b"\n")
            self.assertEqual(t.value(), b"ERR_AUTH\r\n", repr(line))
        r.clock.advance(61)
        answer = self.successResultOf(d)
        self.assertEqual((answer["probes_accepted"], answer["connected"]), (0, False))

    def test_a_silent_connection_is_dropped_at_the_header_deadline(self) -> None:
        r, d = self.listener(timeout=60)
        _p, t = _connection(r.factory, "10.0.0.66")
        r.clock.advance(fabric.HEADER_DEADLINE - 0.1)
        self.assertFalse(t.disconnected)
        r.clock.advance(0.2)
        self.assertTrue(t.disconnected)
        self.assertNoResult(d)
        r.clock.advance(60)
        self.successResultOf(d)

    def test_idle_sockets_cannot_keep_the_real_peer_out(self) -> None:
        """
        Anyone on the fabric opening as many silent connections as the listener holds: the
        real peer still gets in (the busiest address's oldest is dropped), at once.
        """
        r, d = self.listener(expected=1)
        capacity = r.factory.capacity
        idle = [_connection(r.factory, "10.0.0.66", 50000 + i)[1] for i in range(capacity * 3)]
        self.assertEqual(sum(not t.disconnected for t in idle), capacity)
        proto, t = _connection(r.factory, "10.0.0.2")
        self.assertEqual(sum(not t.disconnected for t in idle), capacity - 1)
        proto.dataReceived(TOKEN.encode() + b"\n")
        self.assertEqual(t.value(), b"ACK\r\n")
        answer = self.successResultOf(d)
        self.assertEqual((answer["connected"], answer["peer"]), (True, ["10.0.0.2", 40000]))


class JournalTests(TestCase):
    def test_probe_token_not_journaled(self) -> None:
        from llmport_agent.commands.parse import scrub_for_journal

        copy = scrub_for_journal({"command_type": "validate_fabric_connect",
                                  "payload": {"target_ip": "127.0.0.2", "probe_token": TOKEN}})
        self.assertNotIn(TOKEN, str(copy))
        self.assertEqual(copy["payload"]["target_ip"], "127.0.0.2")
        # A probe cut by a restart is not re-run with the scrubbed token.
        self.assertEqual({s.idempotent for s in fabric.fabric_handler_specs().values()}, {False})
