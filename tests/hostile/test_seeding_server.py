"""
The peer seeding server (C{serve_runtime_image}) as an unauthenticated machine on the fabric
sees it: it listens on a fabric address before any token is checked, so what a client without
the token can make the root agent hold is bounded (connections, header time, no request body
spooled to disk), and the token still gates the tar.
"""

from __future__ import annotations

import os
from typing import Any

from twisted.internet.defer import succeed
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent import opshttp
from llmport_agent.ray import seeding

TOKEN = b"seed-token-0123456789"


class Pool:
    def run(self, fn: Any, *args: Any) -> Any:
        return succeed(fn(*args))


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

    def connect(self) -> tuple[Any, StringTransport]:
        proto = self.site.buildProtocol(None)
        transport = StringTransport()
        proto.makeConnection(transport)
        return proto, transport

    def test_a_body_is_refused_not_spooled(self) -> None:
        """A client without the token sending a large body: 413 and closed, nothing spooled."""
        proto, transport = self.connect()
        proto.dataReceived(b"POST /image HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n\r\n" + b"x" * 65536)
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 413"), transport.value()[:100])
        self.assertTrue(transport.disconnecting)
        self.assertEqual(self.site.bodies_refused, 1)

    def test_connections_are_capped(self) -> None:
        """Idle connections of clients that never authenticate: a bounded number held."""
        cap = self.state.max_active + seeding._EXTRA_CONNECTIONS
        held = [self.connect() for _ in range(cap)]
        self.assertIsNone(self.site.buildProtocol(None))
        held[0][0].connectionLost(None)
        self.assertIsNotNone(self.site.buildProtocol(None))

    def test_slow_headers_are_dropped(self) -> None:
        proto, transport = self.connect()
        proto.dataReceived(b"GET /image HTTP/1.1\r\n")
        self.clock.advance(opshttp.HEADER_DEADLINE_S + 1)
        self.assertTrue(transport.disconnecting or transport.disconnected)

    def test_the_token_still_gates_the_tar(self) -> None:
        proto, transport = self.connect()
        proto.dataReceived(b"GET /image HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 401"), transport.value()[:100])
        proto, transport = self.connect()
        proto.dataReceived(b"GET /image HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN
                           + b"\r\nRange: bytes=10-19\r\n\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 206"), transport.value()[:100])
        self.assertTrue(transport.value().endswith(b"t" * 10), transport.value()[-40:])

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
