"""
The peer seeding server (C{serve_runtime_image}) as an unauthenticated machine on the fabric
sees it: it listens on a fabric address before any token is checked, so what a client without
the token can make the root agent hold is bounded (connections, header time, no request body
spooled to disk) and never keeps the real peer out; the token still gates the tar; a token
holder cannot end the seeding with a few bytes; downloads at once and ranges are bounded.
"""

from __future__ import annotations

import os
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.base import CommandFailed
from llmport_agent.ops import bounded as opshttp
from llmport_agent.ray import seeding

TOKEN = b"seed-token-0123456789"


class Pool:
    def run(self, fn: Any, *args: Any) -> Any:
        return succeed(fn(*args))


class AbortingTransport(StringTransport):
    """As the reactor's: an aborted connection is lost (at once here)."""

    proto: Any = None

    def abortConnection(self) -> None:  # noqa: N802
        from twisted.internet.error import ConnectionAborted
        from twisted.python.failure import Failure

        if not self.disconnecting:
            super().abortConnection()
            if self.proto is not None:
                self.proto.connectionLost(Failure(ConnectionAborted()))


class SeedingServerTests(SynchronousTestCase):
    def setUp(self) -> None:
        path = self.mktemp()
        with open(path, "wb") as f:
            f.write(b"t" * 4096)
        self.fd = os.open(path, os.O_RDONLY)
        self.addCleanup(os.close, self.fd)
        self.clock = Clock()
        self.state = seeding._Serving(self.clock, Pool(), self.fd, 4096, TOKEN, 1, "sha256:" + "a" * 64)
        self.site = seeding.seeding_site(self.state, self.clock)

    def connect(self, host: str = "10.0.0.9", port: int = 40000) -> tuple[Any, StringTransport]:
        addr = IPv4Address("TCP", host, port)
        proto = self.site.buildProtocol(addr)
        transport = AbortingTransport(peerAddress=addr)
        transport.proto = proto
        proto.makeConnection(transport)
        return proto, transport

    def get(self, host: str = "10.0.0.9", headers: bytes = b"", port: int = 40000) -> tuple[Any, StringTransport]:
        proto, transport = self.connect(host, port)
        proto.dataReceived(b"GET /image HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN + b"\r\n" + headers
                           + b"\r\n")
        return proto, transport

    def test_a_body_is_refused_not_spooled(self) -> None:
        """A client without the token sending a large body: 413 and closed, nothing spooled."""
        proto, transport = self.connect()
        data = b"POST /image HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n\r\n" + b"x" * 65536
        # As the transport hands it over: at most opshttp.READ_BYTES a read.
        for at in range(0, len(data), opshttp.READ_BYTES):
            if not transport.disconnecting:
                proto.dataReceived(data[at:at + opshttp.READ_BYTES])
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 413"), transport.value()[:100])
        self.assertTrue(transport.disconnecting)
        self.assertEqual(self.site.bodies_refused, 1)

    def test_idle_sockets_never_lock_the_peer_out(self) -> None:
        """
        Twenty (or a thousand) idle connections from anyone on the fabric, before any token:
        the real peer still connects and downloads. A bounded number stay open: a new one
        makes the oldest unauthenticated one go, one address holds only a few.
        """
        idle = [self.connect("10.0.0.66", 1000 + i) for i in range(20)]
        idle += [self.connect(f"10.0.1.{i % 250}", 2000 + i) for i in range(1000)]
        open_ = [t for _p, t in idle if not t.disconnecting]
        self.assertLessEqual(len(open_), seeding.PRE_AUTH_MAX)
        self.assertLessEqual(len([t for _p, t in idle[:20] if not t.disconnecting]), seeding.PRE_AUTH_PER_HOST)
        self.assertLessEqual(self.site.unauthenticated, seeding.PRE_AUTH_MAX)
        _proto, transport = self.get("10.0.0.2", b"Range: bytes=10-19\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 206"), transport.value()[:100])
        self.assertTrue(transport.value().endswith(b"t" * 10))

    def test_pre_auth_header_deadline_is_short(self) -> None:
        """A connection that sends no token is dropped within a few seconds, not the listen timeout."""
        proto, transport = self.connect()
        proto.dataReceived(b"GET /image HTTP/1.1\r\n")
        self.clock.advance(seeding.PRE_AUTH_DEADLINE_S + 0.1)
        self.assertLessEqual(seeding.PRE_AUTH_DEADLINE_S, 5)
        self.assertTrue(transport.disconnecting or transport.disconnected)
        _proto, silent = self.connect("10.0.0.8")
        self.clock.advance(seeding.PRE_AUTH_DEADLINE_S + 0.1)
        self.assertTrue(silent.disconnecting or silent.disconnected)

    def test_the_token_still_gates_the_tar(self) -> None:
        for given in (b"nope", TOKEN + b"x", TOKEN[:-1], b""):
            proto, transport = self.connect()
            proto.dataReceived(b"GET /image HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + given + b"\r\n\r\n")
            self.assertTrue(transport.value().startswith(b"HTTP/1.1 401"), transport.value()[:100])
            self.assertTrue(transport.disconnecting)
        _proto, transport = self.get(headers=b"Range: bytes=10-19\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 206"), transport.value()[:100])
        self.assertTrue(transport.value().endswith(b"t" * 10), transport.value()[-40:])

    def test_a_range_past_the_end_is_clamped(self) -> None:
        _proto, transport = self.get(headers=b"Range: bytes=4000-999999\r\n")
        head, _, body = transport.value().partition(b"\r\n\r\n")
        self.assertIn(b"Content-Range: bytes 4000-4095/4096", head)
        self.assertIn(b"Content-Length: 96", head)
        self.assertEqual(body, b"t" * 96)
        _proto, transport = self.get(headers=b"Range: bytes=4096-\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 416"), transport.value()[:100])
        self.assertIn(b"Content-Range: bytes */4096", transport.value())

    def test_a_few_bytes_are_not_a_finished_download(self) -> None:
        """
        Token holders asking for the last byte only (or any part) are not served peers: a peer
        counts once every byte of the file went to it, each peer once.
        """
        self.state.expected = 3
        for i in range(3):
            self.get(f"10.0.0.{i + 2}", b"Range: bytes=4095-\r\n")
            self.get(f"10.0.0.{i + 2}", b"Range: bytes=4095-4095\r\n")
        self.get("10.0.0.2")  # a whole download, twice from one peer: one peer
        self.get("10.0.0.2")
        self.assertEqual((self.state.completed, self.state.finished), (1, False))
        self.get("10.0.0.3", b"Range: bytes=0-2047\r\n")  # a resumed download: two halves make it whole
        self.assertEqual(self.state.completed, 1)
        self.get("10.0.0.3", b"Range: bytes=2048-\r\n")
        self.get("10.0.0.4")
        self.assertEqual((self.state.completed, self.state.finished), (3, True))

    def test_receivers_behind_one_address_are_told_apart_by_download_id(self) -> None:
        """Two whole downloads from one address, each under its own download id: two peers."""
        self.state.expected = 2
        self.get("10.0.0.2", b"X-Llmport-Download: aaaaaaaa11111111\r\n")
        self.get("10.0.0.2", b"X-Llmport-Download: aaaaaaaa11111111\r\nRange: bytes=0-\r\n")
        self.assertEqual(self.state.completed, 1)
        self.get("10.0.0.2", b"X-Llmport-Download: bad id\r\n")  # not a valid id: the address alone
        self.assertEqual(self.state.completed, 2)
        self.assertTrue(self.state.finished)

    def test_no_more_downloads_at_once_than_max_active(self) -> None:
        reads: list[Deferred[bytes]] = []

        class SlowPool:
            def run(self, fn: Any, *args: Any) -> Deferred[bytes]:
                d: Deferred[bytes] = Deferred()
                reads.append(d)
                return d

        self.state.pool = SlowPool()
        for i in range(self.state.max_active):
            _proto, transport = self.get(f"10.0.0.{i + 2}")
            self.assertEqual(transport.value(), b"")  # running: waiting for its read
        self.assertEqual(len(self.state.active), self.state.max_active)
        _proto, transport = self.get("10.0.0.200")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 503"), transport.value()[:100])
        self.assertIn(b"Retry-After: 5", transport.value())
        self.assertEqual(len(self.state.active), self.state.max_active)

    def test_token_holders_connections_are_bounded_too(self) -> None:
        """Connections that presented the token are counted apart, and capped (503 beyond)."""
        held = [self.get(f"10.0.2.{i}", b"Range: bytes=0-0\r\n") for i in range(self.site.max_authenticated)]
        self.assertTrue(all(t.value().startswith(b"HTTP/1.1 206") and not t.disconnecting for _p, t in held))
        self.assertEqual(len(self.site.authenticated), self.site.max_authenticated)
        _proto, transport = self.get("10.0.3.1")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 503"), transport.value()[:100])
        held[0][0].connectionLost(None)
        _proto, transport = self.get("10.0.3.1", b"Range: bytes=0-0\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 206"), transport.value()[:100])

    def test_a_paused_download_survives_a_burst_of_bare_connections(self) -> None:
        """
        A token holder's download whose output is paused (a slow reader), then a burst of bare
        connections from one address accepted in one batch (their aborts not yet lost, as with
        the reactor): the evicted ones no longer count, and room is never made by closing an
        authenticated connection.
        """
        reads: list[Deferred[bytes]] = []

        class SlowPool:
            def run(self, fn: Any, *args: Any) -> Deferred[bytes]:
                d: Deferred[bytes] = Deferred()
                reads.append(d)
                return d

        self.state.pool = SlowPool()
        proto, transport = self.get("10.0.0.2")
        self.assertIn(proto, self.site.authenticated)
        proto.pauseProducing()  # the transport's output is over its bound
        burst: list[StringTransport] = []
        for i in range(3 * self.site.max_connections):
            addr = IPv4Address("TCP", "10.0.0.66", 1000 + i)
            bare = self.site.buildProtocol(addr)
            t = StringTransport(peerAddress=addr)  # an abort is not lost within the batch
            if bare is not None:
                bare.makeConnection(t)
                burst.append(t)
        self.assertFalse(transport.disconnecting)
        self.assertIn(proto, self.site.channels)
        still_open = [t for t in burst if not t.disconnecting]
        self.assertEqual(len(still_open), seeding.PRE_AUTH_PER_HOST)
        self.assertEqual(self.site.open_connections, 1 + len(still_open))
        self.assertEqual(self.site.unauthenticated, len(still_open))

    def test_room_is_made_only_from_unauthenticated_connections(self) -> None:
        """Every slot taken, the unauthenticated ones all answering: a newcomer is refused."""
        self.site.max_connections = 2
        proto, transport = self.get("10.0.0.2", b"Range: bytes=0-0\r\n")
        proto.pauseProducing()
        self.assertIn(proto, self.site.authenticated)
        bare, bare_t = self.connect("10.0.0.3")
        newcomer, newcomer_t = self.connect("10.0.0.4")  # the bare one goes for it
        self.assertTrue(bare_t.disconnecting)
        self.assertFalse(transport.disconnecting)
        newcomer_t.abortConnection()
        self.assertEqual(self.site.open_connections, 1)
        self.site.max_connections = 1
        self.assertIsNone(self.site.buildProtocol(IPv4Address("TCP", "10.0.0.5", 1)))
        self.assertFalse(transport.disconnecting)

    def test_503_while_exporting(self) -> None:
        """The holder listens before its docker save is written: token holders are told to retry."""
        self.state.fd = None
        _proto, transport = self.get()
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 503"), transport.value()[:100])
        self.assertIn(b"Retry-After: 5", transport.value())
        proto, transport = self.connect()
        proto.dataReceived(b"GET /image HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 401"), transport.value()[:100])
        self.state.ready(self.fd, 4096)
        _proto, transport = self.get(headers=b"Range: bytes=0-9\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 206"), transport.value()[:100])

    def test_a_token_with_whitespace_is_refused(self) -> None:
        for bad in ("tok en", "token\t", " token", "token\n", "tok\u00a0en", "tok\x00en", "t\u00e9", ""):
            with self.assertRaises(CommandFailed) as cm:
                seeding._token(bad, "token")
            self.assertEqual(cm.exception.error_code, "invalid_command")
        self.assertEqual(seeding._token("ab-CD_01.~", "token"), b"ab-CD_01.~")

    def test_a_peer_gone_during_a_read(self) -> None:
        """A peer that drops the connection while a read of the tar runs: no error, no sender left."""
        from twisted.internet.defer import Deferred
        from twisted.internet.error import ConnectionDone
        from twisted.python.failure import Failure

        reads: list[Deferred[bytes]] = []

        class SlowPool:
            def run(self, fn: Any, *args: Any) -> Deferred[bytes]:
                d: Deferred[bytes] = Deferred()
                reads.append(d)
                return d

        self.state.pool = SlowPool()
        proto, transport = self.connect()
        proto.dataReceived(b"GET /image HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN + b"\r\n\r\n")
        self.assertEqual((len(reads), len(self.state.active)), (1, 1))
        proto.connectionLost(Failure(ConnectionDone()))
        reads[0].callback(b"t" * 4096)
        self.assertEqual(self.state.active, set())
        self.assertEqual(self.flushLoggedErrors(), [])
        self.assertEqual(self.state.completed, 0)
