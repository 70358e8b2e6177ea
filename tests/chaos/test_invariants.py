"""
The chaos suite's own checks fail when their claims break: the invariant checker on planted
histories (a second result with no disconnect, a re-run with another outcome, an ack after the
result, a lost command, an unexpected anomaly, a Loki line lost or doubled), and the proxy's
faults on a loopback echo server (a cut resets, a stall holds and heal releases in order, a
slow link delivers everything, corruption is always invalid UTF-8).
"""

from __future__ import annotations

import random
from typing import Any

from twisted.internet import reactor as _global_reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmport_agent.devbackend import DevBackend
from llmport_agent.logs.testing import FakeLoki
from tests.chaos.invariants import check_commands, check_loki, settle
from tests.support.chaosproxy import DOWN, UP, ChaosProxy

reactor: Any = _global_reactor


class CheckerTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1_000_000)
        self.backend = DevBackend(reactor, clock=self.clock)
        self.node = self.backend.enroll_node("n1")["node_id"]
        self.state = self.backend.state

    def frame(self, kind: str, cid: str, **extra: Any) -> None:
        self.clock.advance(0.01)
        self.state.apply_frame(self.node, {"type": kind, "command_id": cid, **extra})

    def command(self) -> str:
        cid = str(self.backend.issue_command(self.node, "refresh_inventory", {})["id"])
        self.state.take_dispatch(self.node)
        return cid

    def disconnect(self) -> None:
        self.clock.advance(0.01)
        session = self.state.session_opened(self.node)
        self.clock.advance(0.01)
        self.state.session_closed(session, last=True)

    def test_clean_history_passes(self) -> None:
        cid = self.command()
        self.frame("command_ack", cid)
        self.frame("command_result", cid, success=True)
        tally = check_commands(self.backend, self.node, [cid])
        self.assertEqual((tally.problems, tally.acked, tally.resolved, tally.repeats), ([], 1, 1, 0))

    def test_repeat_across_a_disconnect_is_the_window(self) -> None:
        cid = self.command()
        self.frame("command_ack", cid)
        self.frame("command_result", cid, success=True)
        self.disconnect()
        self.frame("command_result", cid, success=True)
        tally = check_commands(self.backend, self.node, [cid])
        self.assertEqual((tally.problems, tally.repeats), ([], 1))

    def test_repeat_without_a_disconnect_fails(self) -> None:
        cid = self.command()
        self.frame("command_ack", cid)
        self.frame("command_result", cid, success=True)
        self.frame("command_result", cid, success=True)
        problems = check_commands(self.backend, self.node, [cid]).problems
        self.assertTrue(any("outside the documented window" in p for p in problems), problems)

    def test_repeat_with_another_outcome_fails(self) -> None:
        cid = self.command()
        self.frame("command_ack", cid)
        self.frame("command_result", cid, success=True)
        self.disconnect()
        self.frame("command_result", cid, success=False)
        problems = check_commands(self.backend, self.node, [cid]).problems
        self.assertTrue(any("re-run" in p for p in problems), problems)

    def test_ack_after_result_fails(self) -> None:
        cid = self.command()
        self.frame("command_ack", cid)
        self.frame("command_result", cid, success=True)
        self.frame("command_ack", cid)
        problems = check_commands(self.backend, self.node, [cid]).problems
        self.assertTrue(any("regressed" in p for p in problems), problems)
        self.assertTrue(any("anomaly: command_ack after the result" in p for p in problems), problems)

    def test_stream_lost_then_result_is_clean(self) -> None:
        """Current generation: the backend's node_stream_lost failure, then the agent's result, is no regression."""
        session = self.state.session_opened(self.node)
        cid = self.command()
        self.frame("command_ack", cid)
        self.frame("command_progress", cid)
        self.clock.advance(0.01)
        self.state.session_closed(session, last=True)
        self.assertEqual(self.backend.command(cid)["error_code"], "node_stream_lost")
        self.frame("command_progress", cid)
        self.frame("command_result", cid, success=True)
        tally = check_commands(self.backend, self.node, [cid])
        self.assertEqual((tally.problems, tally.resolved, tally.lost_with_stream), ([], 1, 0))

    def test_never_answered_and_lost_with_the_stream_is_resolved(self) -> None:
        session = self.state.session_opened(self.node)
        cid = self.command()
        self.clock.advance(0.01)
        self.state.session_closed(session, last=True)
        tally = check_commands(self.backend, self.node, [cid])
        self.assertEqual((tally.problems, tally.resolved, tally.lost_with_stream), ([], 1, 1))
        # Acked and lost, with no result from the agent: still a problem.
        session = self.state.session_opened(self.node)
        acked = self.command()
        self.frame("command_ack", acked)
        self.clock.advance(0.01)
        self.state.session_closed(session, last=True)
        self.assertIn("without a result", check_commands(self.backend, self.node, [acked]).problems[0])

    def test_acked_without_result_fails(self) -> None:
        cid = self.command()
        self.frame("command_ack", cid)
        tally = check_commands(self.backend, self.node, [cid])
        self.assertEqual((tally.acked, tally.resolved), (1, 0))
        self.assertIn("without a result", tally.problems[0])
        self.assertEqual(tally.ratio, 0.0)

    def test_unexpected_anomaly_fails_allowed_one_passes(self) -> None:
        self.state.note(self.node, "command_ack for unknown command x ignored")
        self.state.note(self.node, "connection dropped: frame is not valid JSON")
        problems = check_commands(self.backend, self.node, []).problems
        self.assertEqual(problems, ["anomaly: command_ack for unknown command x ignored"])

    def test_loki_lost_and_doubled(self) -> None:
        loki = FakeLoki()
        loki._entries = []
        from llmport_agent.logs.testing import StoredEntry

        for ts, line in ((1, "a"), (2, "b"), (3, "b")):
            loki._entries.append(StoredEntry({"job": "x"}, (("job", "x"),), ts, line))
        problems = check_loki(loki, ["a", "b", "c"])
        self.assertEqual(len(problems), 2)
        self.assertIn("1 of 3 lines lost, first 'c'", problems[0])
        self.assertIn("1 lines stored twice, first 'b'", problems[1])
        self.assertEqual(check_loki(loki, ["a"]), [])


class _Echo(Protocol):
    def dataReceived(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)


class _Client(Protocol):
    def __init__(self) -> None:
        self.received = b""
        self.lost: Deferred[list[Failure | None]] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.lost.callback([reason])  # a Failure itself would errback


class ProxyFaultTests(TestCase):
    timeout = 20

    async def setUp(self) -> None:  # type: ignore[override]
        port = reactor.listenTCP(0, Factory.forProtocol(_Echo), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.proxy = ChaosProxy(reactor, port.getHost().port)
        await self.proxy.start()
        self.addCleanup(self.proxy.stop)
        self.client = _Client()
        await TCP4ClientEndpoint(reactor, "127.0.0.1", self.proxy.listening_port).connect(
            Factory.forProtocol(lambda: self.client))
        self.addCleanup(self.abort)

    def abort(self) -> None:
        transport: Any = self.client.transport
        if transport is not None:
            transport.abortConnection()

    def send(self, data: bytes) -> None:
        assert self.client.transport is not None
        self.client.transport.write(data)

    async def until(self, size: int) -> None:
        self.assertTrue(await settle(reactor, lambda: len(self.client.received) >= size, 5, 0.01))

    async def test_cut_resets(self) -> None:
        self.send(b"x")
        await self.until(1)
        self.assertEqual(self.proxy.cut(), 1)
        (reason,) = await self.client.lost
        assert reason is not None
        self.assertEqual(type(reason.value).__name__, "ConnectionLost")  # a reset, not a clean close

    async def test_stall_holds_and_heal_releases_in_order(self) -> None:
        self.proxy.stall()
        for i in range(5):
            self.send(b"%d" % i)
        await settle(reactor, lambda: False, 0.3)
        self.assertEqual(self.client.received, b"")
        self.proxy.heal()
        await self.until(5)
        self.assertEqual(self.client.received, b"01234")

    async def test_slow_link_delivers_everything(self) -> None:
        self.proxy.slow(chunk=7, delay=0.001)
        data = bytes(range(256)) * 4
        self.send(data)
        await self.until(len(data))
        self.assertEqual(self.client.received, data)

    async def test_corruption_is_invalid_utf8_either_way(self) -> None:
        text = ('{"type": "command_result", "command_id": "%s"}' % ("a" * 36)).encode()
        for i, (direction, mode) in enumerate([(UP, "flip"), (DOWN, "flip"), (UP, "garble"), (DOWN, "garble")]):
            self.proxy.rng = random.Random(i)
            self.proxy.corrupt(direction, mode)
            before = len(self.client.received)
            self.send(text)
            await self.until(before + len(text))
            echoed = self.client.received[before:]
            self.assertNotEqual(echoed, text)
            self.assertRaises(UnicodeDecodeError, echoed.decode, "utf-8")
