"""
Fabric probes (protocol 10.6) over real loopback connections (127.0.0.x): a listen+connect pair
with the source IP pinned, a wrong probe token, nothing listening (with and without retry), the
listener closed afterwards; and the timeouts on a Clock with MemoryReactor-free pieces.
"""

from __future__ import annotations

import socket
from typing import Any

from twisted.internet import reactor as real_reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.task import Clock
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


class JournalTests(TestCase):
    def test_probe_token_not_journaled(self) -> None:
        from llmport_agent.commands.parse import scrub_for_journal

        copy = scrub_for_journal({"command_type": "validate_fabric_connect",
                                  "payload": {"target_ip": "127.0.0.2", "probe_token": TOKEN}})
        self.assertNotIn(TOKEN, str(copy))
        self.assertEqual(copy["payload"]["target_ip"], "127.0.0.2")
        # A probe cut by a restart is not re-run with the scrubbed token.
        self.assertEqual({s.idempotent for s in fabric.fabric_handler_specs().values()}, {False})
