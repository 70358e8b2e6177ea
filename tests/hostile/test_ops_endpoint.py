"""
A local attacker against the ops endpoint (127.0.0.1:OPS_PORT, which any host-network workload
reaches): many idle or half-sent connections, a byte now and then, a huge request body. The
endpoint holds a bounded number of descriptors, spools nothing, and drops slow clients.

The first class uses real loopback connections to a real OpsService; the second drives the
bounded HTTP channel with StringTransport and task.Clock (the timers).
"""

from __future__ import annotations

import errno
import os
import socket
from typing import Any

import psutil
from twisted.internet import reactor as _global_reactor
from twisted.internet.task import Clock, deferLater
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.resource import Resource

from llmport_agent.host import fdlimit
from llmport_agent.ops import bounded as opshttp
from llmport_agent.ops.endpoint import OpsService

reactor: Any = _global_reactor


def _server_side(port: int) -> int:
    """Established connections of this process whose local end is the ops port."""
    return sum(1 for c in psutil.Process().net_connections(kind="tcp")
               if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(65536, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError as e:
        return e.errno in (errno.ECONNRESET, errno.EPIPE)


class LoopbackTests(TestCase):
    timeout = 60

    async def start_ops(self) -> int:
        ops = OpsService(reactor, object(), 0)
        ops.startService()
        self.addCleanup(ops.stopService)
        for _ in range(200):
            if ops._listening is not None:
                break
            await deferLater(reactor, 0.01)
        self.ops = ops
        return int(ops._listening.getHost().port)

    def client(self, port: int) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.settimeout(None)  # blocking again: reads below use MSG_DONTWAIT
        self.addCleanup(s.close)
        return s

    async def test_half_sent_requests_hold_a_bounded_number_of_descriptors(self) -> None:
        """
        300 connections each sending half a request: the agent keeps at most MAX_CONNECTIONS
        of them (before, it kept all of them, and 1,100 exhausted its descriptors).
        """
        port = await self.start_ops()
        socks = []
        for i in range(300):
            s = self.client(port)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            socks.append(s)
            if i % 20 == 19:  # the listen backlog is 50: let the reactor accept
                await deferLater(reactor, 0.01)
        # Let the reactor accept everything queued: each socket is either held or closed.
        for _ in range(500):
            held = _server_side(port)
            closed = sum(1 for s in socks if _closed_by_peer(s))
            if held + closed >= len(socks):
                break
            await deferLater(reactor, 0.02)
        self.assertLessEqual(_server_side(port), opshttp.MAX_CONNECTIONS)
        # Once they go, the endpoint answers again.
        for s in socks:
            s.close()
        for _ in range(500):
            if _server_side(port) == 0:
                break
            await deferLater(reactor, 0.02)
        ok = self.client(port)
        ok.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        got = b""
        for _ in range(500):
            try:
                chunk = ok.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                await deferLater(reactor, 0.01)
                continue
            if not chunk:
                break
            got += chunk
        self.assertTrue(got.startswith(b"HTTP/1.1 200"), got[:200])

    async def test_a_pipelining_flood_that_never_reads_leaves_room_for_a_monitor(self) -> None:
        """
        Issue 29: 64 connections x 64 KiB of pipelined requests, never read, kept a monitor's
        /healthz out for 46 s and took 700 MiB. Now: the agent holds a bounded amount (each
        connection is dropped for sending too much ahead or makes room for the monitor), and
        the monitor is answered while the flood goes on.
        """
        port = await self.start_ops()
        site = self.ops.site
        flood = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 1700  # about 64 KiB
        rss_before = psutil.Process().memory_info().rss
        socks = []
        for i in range(opshttp.MAX_CONNECTIONS):
            s = self.client(port)
            s.setblocking(False)
            try:
                s.send(flood)
            except BlockingIOError:
                pass
            socks.append(s)
            if i % 16 == 15:
                await deferLater(reactor, 0.01)
        for _ in range(50):
            await deferLater(reactor, 0.01)
        monitor = self.client(port)
        monitor.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        got = b""
        for _ in range(3000):  # up to 30 s on a loaded machine
            try:
                chunk = monitor.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                await deferLater(reactor, 0.01)
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
        self.assertTrue(got.startswith(b"HTTP/1.1 200"), got[:200])
        # Every flood connection was dropped for what it sent ahead, or made room.
        self.assertGreaterEqual(site.pipelining_dropped + site.evicted + site.timed_out, 1)
        self.assertLessEqual(site.open_connections, opshttp.MAX_CONNECTIONS)
        # What the flood got rendered is far below what it asked for (64 x 1700 requests).
        self.assertLess(site.requests_parsed, opshttp.MAX_CONNECTIONS * 1700 // 4)
        self.assertLess(psutil.Process().memory_info().rss - rss_before, 64 << 20)

    async def test_a_huge_body_is_refused_not_spooled(self) -> None:
        """A POST announcing 100 GB gets 413 at once; no temporary file is ever opened."""
        opened: list[Any] = []
        import tempfile

        real = tempfile.TemporaryFile

        def spy(*a: Any, **k: Any) -> Any:
            f = real(*a, **k)
            opened.append(f)
            return f

        self.patch(tempfile, "TemporaryFile", spy)
        port = await self.start_ops()
        s = self.client(port)
        s.sendall(b"POST /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000000000\r\n\r\n")
        s.sendall(b"x" * 65536)
        got = b""
        for _ in range(300):
            try:
                chunk = s.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                await deferLater(reactor, 0.01)
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
        self.assertTrue(got.startswith(b"HTTP/1.1 413"), got[:200])
        self.assertEqual(opened, [])


def channel(clock: Clock, **kwargs: Any) -> tuple[Any, StringTransport, opshttp.BoundedSite]:
    root = Resource()
    leaf = Resource()
    leaf.isLeaf = True
    leaf.render_GET = lambda request: b"ok"  # type: ignore[attr-defined]
    root.putChild(b"healthz", leaf)
    site = opshttp.BoundedSite(root, clock, **kwargs)
    proto = site.buildProtocol(None)
    transport = StringTransport()
    proto.makeConnection(transport)
    return proto, transport, site


class ChannelTests(SynchronousTestCase):
    def test_a_byte_now_and_then_is_dropped_at_the_deadline(self) -> None:
        """Each byte resets the idle timer; the header deadline still ends the connection."""
        clock = Clock()
        proto, transport, site = channel(clock)
        step = opshttp.IDLE_TIMEOUT_S / 2
        elapsed = 0.0
        for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\n":
            proto.dataReceived(bytes([byte]))
            clock.advance(step)
            elapsed += step
            if transport.disconnecting or getattr(transport, "disconnected", False):
                break
        self.assertLessEqual(elapsed, opshttp.HEADER_DEADLINE_S + step)
        self.assertTrue(transport.disconnecting or transport.disconnected)
        self.assertEqual(site.timed_out, 1)

    def test_keep_alive_then_idle(self) -> None:
        """A complete request is answered; the kept-alive connection is closed when idle."""
        clock = Clock()
        proto, transport, site = channel(clock)
        proto.dataReceived(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 200"))
        self.assertFalse(transport.disconnecting)
        clock.advance(opshttp.HEADER_DEADLINE_S + 1)
        self.assertTrue(transport.disconnecting or transport.disconnected)

    def test_bodies_are_refused(self) -> None:
        for headers in (b"Content-Length: 5\r\n", b"Transfer-Encoding: chunked\r\n"):
            clock = Clock()
            proto, transport, site = channel(clock)
            proto.dataReceived(b"POST /healthz HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\nhello")
            self.assertTrue(transport.value().startswith(b"HTTP/1.1 413"), transport.value())
            self.assertTrue(transport.disconnecting)
            self.assertEqual(site.bodies_refused, 1)

    def test_header_limits(self) -> None:
        clock = Clock()
        proto, transport, _ = channel(clock)
        proto.dataReceived(b"GET /healthz HTTP/1.1\r\n" + b"X-A: " + b"a" * opshttp.HEADER_BYTES + b"\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 400"))
        proto, transport, _ = channel(clock)
        proto.dataReceived(b"GET /healthz HTTP/1.1\r\n" + b"X-A: a\r\n" * (opshttp.MAX_HEADERS + 1) + b"\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 400"))

    def test_connection_cap(self) -> None:
        """
        At the cap a new connection takes the place of the one that waited longest on its
        client, its output unread first; when all are being answered it is refused.
        """
        from twisted.web.server import NOT_DONE_YET

        clock = Clock()
        root = Resource()
        slow = Resource()
        slow.isLeaf = True
        pending: list[Any] = []
        slow.render_GET = lambda request: pending.append(request) or NOT_DONE_YET  # type: ignore[attr-defined]
        root.putChild(b"slow", slow)
        site = opshttp.BoundedSite(root, clock, max_connections=3)
        protos = []
        for _ in range(3):
            p = site.buildProtocol(None)
            p.makeConnection(StringTransport())
            protos.append(p)
            clock.advance(1)
        protos[1].pauseProducing()  # its client does not read
        clock.advance(1)
        protos[2].pauseProducing()
        newcomer = site.buildProtocol(None)
        self.assertIsNotNone(newcomer)
        self.assertEqual(site.evicted, 1)
        self.assertTrue(protos[1].transport.disconnecting or protos[1].transport.disconnected)
        self.assertFalse(protos[0].transport.disconnecting)
        newcomer.makeConnection(StringTransport())
        # All answering a request: no room is made.
        for p in (protos[0], protos[2], newcomer):
            p.resumeProducing()
            p.dataReceived(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(len(pending), 3)
        self.assertIsNone(site.buildProtocol(None))
        self.assertEqual(site.refused, 1)
        protos[0].connectionLost(None)
        self.assertIsNotNone(site.buildProtocol(None))


def pipelining_channel(clock: Clock, body: bytes = b"m" * 1000, **kwargs: Any
                       ) -> tuple[Any, StringTransport, opshttp.BoundedSite, list[int]]:
    """A channel whose /metrics counts its renders."""
    rendered: list[int] = []
    root = Resource()
    leaf = Resource()
    leaf.isLeaf = True

    def render(request: Any) -> bytes:
        rendered.append(1)
        return body

    leaf.render_GET = render  # type: ignore[attr-defined]
    root.putChild(b"metrics", leaf)
    site = opshttp.BoundedSite(root, clock, **kwargs)
    proto = site.buildProtocol(None)
    transport = StringTransport()
    proto.makeConnection(transport)
    return proto, transport, site, rendered


GET = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


def turn(clock: Clock) -> None:
    """
    One turn of a reactor: the calls due now, not those they schedule (Clock.advance would run
    a call added for "now" by a call it runs, a real reactor leaves it to its next turn).
    """
    due = [c for c in clock.getDelayedCalls() if c.getTime() <= clock.seconds()]
    for call in due:
        if call.active():
            clock.calls.remove(call)
            call.called = 1
            call.func(*call.args, **call.kw)


class PipeliningTests(SynchronousTestCase):
    """
    Issue 29: 64 connections x 64 KiB of pipelined GET /metrics rendered thousands of responses
    in one turn of the reactor (43 s late, 700 MiB of unsent output). One request at a time,
    one per turn, none while the client does not read, and a bound on what may be sent ahead.
    """

    def test_one_request_per_reactor_turn(self) -> None:
        clock = Clock()
        proto, transport, site, rendered = pipelining_channel(clock)
        proto.dataReceived(GET * 10)
        self.assertEqual(len(rendered), 1)  # before: all 10 at once
        self.assertEqual(transport.producerState, "paused")  # the socket is not read meanwhile
        for n in range(2, 11):
            turn(clock)
            self.assertEqual(len(rendered), n)
        turn(clock)
        self.assertEqual(len(rendered), 10)
        self.assertEqual(transport.value().count(b"HTTP/1.1 200"), 10)
        self.assertEqual(transport.producerState, "producing")  # all answered: reading again
        self.assertEqual(site.requests_parsed, 10)

    def test_more_data_before_the_next_turn_waits_for_it(self) -> None:
        """A client that ignores the paused socket (writes more at once) still gets one per turn."""
        clock = Clock()
        proto, transport, site, rendered = pipelining_channel(clock)
        proto.dataReceived(GET * 2)
        proto.dataReceived(GET)
        proto.dataReceived(GET)
        self.assertEqual(len(rendered), 1)
        turn(clock)
        self.assertEqual(len(rendered), 2)

    def test_no_work_for_a_client_that_does_not_read(self) -> None:
        """The transport says its output is over its bound: nothing more is rendered until it drains."""
        clock = Clock()
        proto, transport, site, rendered = pipelining_channel(clock)
        proto.dataReceived(GET * 50)
        proto.pauseProducing()  # what the transport does when its buffer is full
        for _ in range(100):
            turn(clock)
        clock.advance(opshttp.HEADER_DEADLINE_S / 2)
        self.assertEqual(len(rendered), 1)
        self.assertEqual(transport.producerState, "paused")
        proto.resumeProducing()  # the client read it
        turn(clock)
        self.assertEqual(len(rendered), 2)

    def test_a_request_split_anywhere_is_one_request(self) -> None:
        """The head's end found across reads ("\r\n" + "\r\n", "\r" + "\n\r\n", ...)."""
        for cut in range(1, len(GET) * 2):
            clock = Clock()
            proto, transport, site, rendered = pipelining_channel(clock)
            data = GET * 2
            proto.dataReceived(data[:cut])
            proto.dataReceived(data[cut:])
            for _ in range(3):
                turn(clock)
            self.assertEqual(len(rendered), 2, cut)
            self.assertEqual(transport.value().count(b"HTTP/1.1 200"), 2, cut)
            self.assertFalse(transport.disconnecting, cut)

    def test_pipelining_beyond_the_bound_drops_the_connection(self) -> None:
        clock = Clock()
        proto, transport, site, rendered = pipelining_channel(clock)
        flood = GET * (65536 // len(GET))
        proto.dataReceived(flood)
        self.assertEqual(rendered, [])
        self.assertEqual(site.pipelining_dropped, 1)
        self.assertTrue(transport.disconnecting or transport.disconnected)
        # Sent ahead a little at a time while one is in flight: the same bound.
        proto, transport, site, rendered = pipelining_channel(clock)
        proto.dataReceived(GET)
        proto.pauseProducing()
        sent = 0
        while not (transport.disconnecting or transport.disconnected) and sent < 100_000:
            proto.dataReceived(GET)
            sent += len(GET)
        self.assertLessEqual(sent, opshttp.PIPELINE_BYTES + len(GET))
        self.assertEqual(site.pipelining_dropped, 1)
        self.assertEqual(len(rendered), 1)

    def test_a_flood_of_64_connections_costs_a_bounded_amount_of_work(self) -> None:
        """
        64 connections pipelining as much as the bound allows, none reading: per turn of the
        reactor at most one response per connection, and after the transports fill no more
        work at all (counted, not timed).
        """
        clock = Clock()
        root = Resource()
        rendered: list[int] = []
        leaf = Resource()
        leaf.isLeaf = True
        leaf.render_GET = lambda request: rendered.append(1) or b"m" * 20000  # type: ignore[attr-defined]
        root.putChild(b"metrics", leaf)
        site = opshttp.BoundedSite(root, clock)
        conns = []
        for _ in range(64):
            proto = site.buildProtocol(None)
            transport = StringTransport()
            proto.makeConnection(transport)
            proto.dataReceived(GET * (opshttp.PIPELINE_BYTES // len(GET)))
            conns.append((proto, transport))
        self.assertEqual(len(rendered), 64)
        full: set[int] = set()
        for _round in range(3):
            before = len(rendered)
            turn(clock)
            self.assertLessEqual(len(rendered) - before, 64)
            # A transport pauses its producer once 64 KiB wait unsent (FileDescriptor.write).
            for i, (proto, transport) in enumerate(conns):
                if len(transport.value()) > 65536 and i not in full:
                    full.add(i)
                    proto.pauseProducing()
        before = len(rendered)
        for _ in range(50):
            turn(clock)
        self.assertEqual(len(rendered), before)
        self.assertLessEqual(len(rendered), 64 * 4)


class FakeRlimit:
    def __init__(self, soft: int, hard: int) -> None:
        self.limits = (soft, hard)

    def getrlimit(self, which: int) -> tuple[int, int]:
        return self.limits

    def setrlimit(self, which: int, limits: tuple[int, int]) -> None:
        self.limits = limits


class OpenFilesLimitTests(SynchronousTestCase):
    def test_soft_limit_raised_to_the_hard_one(self) -> None:
        fake = FakeRlimit(1024, 524288)
        self.assertEqual(fdlimit.raise_open_files_limit(rlimit=fake), fdlimit.WANTED)
        self.assertEqual(fake.limits, (fdlimit.WANTED, 524288))
        fake = FakeRlimit(1024, 4096)
        self.assertEqual(fdlimit.raise_open_files_limit(rlimit=fake), 4096)
        fake = FakeRlimit(100000, 524288)
        self.assertEqual(fdlimit.raise_open_files_limit(rlimit=fake), 100000)

    def test_the_unit_sets_limit_nofile(self) -> None:
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        with open(os.path.join(here, "deploy", "systemd", "llmport-agent.service")) as f:
            self.assertIn(f"\nLimitNOFILE={fdlimit.WANTED}\n", f.read())
