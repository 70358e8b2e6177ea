"""
Peer seeding at the speed of the link: the seeder's HTTP site (L{seeding.seeding_site}) and the
receiver's download (L{seeding.fetch_attempt} on a pool thread) in one process, over a real
loopback connection, with the seeder's file reads on a real bounded pool.

The seed site's channels are the ops endpoint's bounded ones, which lock each connection's
kernel send buffer at 32 KiB (a client that does not read must not make the agent render much).
For the tar that made every window wait for the receiver's delayed ACK (40 ms): about 1.6 MB/s
whatever the link, 400 s for the 642 MB runtime image of the air-gapped integration test. The
seed site keeps the kernel's own (autotuned) send buffer; the ops endpoint keeps its bound.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
from typing import Any

from twisted.internet import reactor
from twisted.internet.address import IPv4Address
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.resource import Resource

from llmport_agent.core.threads import PoolService
from llmport_agent.ops import bounded as opshttp
from llmport_agent.ray import seeding
from llmport_agent.workloads.engine import StreamControl

TOKEN = b"seed-token-0123456789"


class _Handle:
    """A socket that records the options set on it."""

    def __init__(self) -> None:
        self.options: list[tuple[int, int, int]] = []

    def setsockopt(self, level: int, option: int, value: int) -> None:
        self.options.append((level, option, value))


class _HandleTransport(StringTransport):
    def __init__(self) -> None:
        super().__init__(peerAddress=IPv4Address("TCP", "10.0.0.9", 40000))
        self.handle = _Handle()

    def getHandle(self) -> _Handle:  # noqa: N802
        return self.handle


def _connect(site: Any) -> _Handle:
    transport = _HandleTransport()
    proto = site.buildProtocol(IPv4Address("TCP", "10.0.0.9", 40000))
    proto.makeConnection(transport)
    return transport.handle


class SendBufferTests(SynchronousTestCase):
    def test_the_seed_site_keeps_the_kernels_send_buffer(self) -> None:
        """No SO_SNDBUF on a seeding connection (a locked small one makes the tar ACK-bound)."""
        state = seeding._Serving(Clock(), None, None, 0, TOKEN, 1, "sha256:" + "a" * 64)
        handle = _connect(seeding.seeding_site(state, Clock()))
        self.assertEqual([o for o in handle.options if o[1] == socket.SO_SNDBUF], [])

    def test_the_ops_endpoint_keeps_its_bound(self) -> None:
        handle = _connect(opshttp.BoundedSite(Resource(), Clock()))
        self.assertIn((socket.SOL_SOCKET, socket.SO_SNDBUF, opshttp.SEND_BUFFER_BYTES), handle.options)


class LoopbackTransferTests(TestCase):
    """
    A 48 MiB tar from the seeder to a receiver thread over loopback, one of the seeder's two
    I/O threads held by other work the whole time. With the 32 KiB send buffer this takes
    about 30 s (ACK-bound), past this test's timeout; with the kernel's own buffer, well under
    a second on an idle machine.
    """

    timeout = 15
    SIZE = 48 * 1024 * 1024

    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.data = os.urandom(1024 * 1024) * (self.SIZE // (1024 * 1024))
        with open(os.path.join(self.dir, "src.tar"), "wb") as f:
            f.write(self.data)
        self.pool = PoolService(reactor, "io", 2)
        self.pool.startService()
        self.addCleanup(self.pool.stopService)
        self.downloads = PoolService(reactor, "download", 1)
        self.downloads.startService()
        self.addCleanup(self.downloads.stopService)

    async def test_a_tar_goes_at_the_speed_of_the_link(self) -> None:
        fd = os.open(os.path.join(self.dir, "src.tar"), os.O_RDONLY)
        self.addCleanup(os.close, fd)
        state = seeding._Serving(reactor, self.pool, fd, self.SIZE, TOKEN, 1, "sha256:" + "a" * 64)
        site = seeding.seeding_site(state, reactor)
        port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(site)
        self.addCleanup(port.stopListening)
        release = threading.Event()
        self.addCleanup(release.set)
        busy = self.pool.run(release.wait, 60)  # other work holds one of the two I/O threads
        meter = seeding.Meter()
        control = StreamControl()
        self.addCleanup(control.close)  # a download still running at the timeout ends
        attempt = await self.downloads.run(
            seeding.fetch_attempt, None, control, "127.0.0.1", port.getHost().port, "/image", TOKEN,
            "dl-0123456789", self.dir, "out.tar", 0, 30.0, meter)
        release.set()
        await busy
        self.assertEqual((attempt.kind, attempt.complete, attempt.have), ("body", True, self.SIZE), attempt)
        await state.done  # the seeder counted the peer as served
        self.assertEqual((state.completed, state.bytes_sent), (1, self.SIZE))
        with open(os.path.join(self.dir, "out.tar"), "rb") as f:
            self.assertEqual(hashlib.sha256(f.read()).digest(), hashlib.sha256(self.data).digest())
