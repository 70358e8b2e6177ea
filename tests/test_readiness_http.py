"""
Readiness with real status codes from a real loopback HTTP server, through the production probe
(L{make_treq_probe} on treq) and L{wait_ready}.

The rule (readiness.py, protocol 4.1): a 2xx or 3xx answer is ready; anything else is not. In
particular 503, which llama.cpp and TGI answer while the model loads, is not ready; neither are
500 and 404.
"""

from __future__ import annotations

from typing import Any

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Factory, Protocol
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.resource import Resource
from twisted.web.server import Site

from llmport_agent.commands.base import CommandFailed
from llmport_agent.workloads.readiness import (
    READINESS_TIMEOUT,
    make_treq_probe,
    probe_url,
    wait_ready,
)


class Scripted(Resource):
    """Answers GET /health with the next status of C{codes} (the last one repeats)."""

    isLeaf = True

    def __init__(self, codes: list[int]) -> None:
        super().__init__()
        self.codes = list(codes)
        self.served: list[int] = []

    def render_GET(self, request: Any) -> bytes:
        code = self.codes.pop(0) if len(self.codes) > 1 else self.codes[0]
        self.served.append(code)
        request.setResponseCode(code)
        if 300 <= code < 400:
            request.setHeader(b"location", b"http://127.0.0.1:1/elsewhere")
        return b"Loading model" if code == 503 else b"{}"


class ReadinessStatusTests(TestCase):
    timeout = 20

    def serve(self, codes: list[int]) -> tuple[Scripted, int]:
        res = Scripted(codes)
        site = Site(res)
        site.noisy = False
        port = reactor.listenTCP(0, site, interface="127.0.0.1")  # type: ignore[attr-defined]
        self.addCleanup(port.stopListening)
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.http = HTTPClient(Agent(reactor, pool=pool))
        return res, port.getHost().port

    async def wait(self, port: int, timeout: float) -> float:
        async def no_exit() -> None:
            return None

        return await wait_ready(
            reactor,
            url=probe_url(port, "/health"),
            container_name="llm-port-test",
            probe=make_treq_probe(self.http, timeout=5.0),
            check_exit=no_exit,
            progress=lambda _elapsed: None,
            timeout=timeout,
            interval=0.02,
        )

    async def test_200_is_ready(self) -> None:
        res, port = self.serve([200])
        await self.wait(port, 5)
        self.assertEqual(res.served, [200])

    async def test_redirect_is_an_answer(self) -> None:
        """A 3xx is ready, and is not followed (the Location points nowhere)."""
        res, port = self.serve([302])
        await self.wait(port, 5)
        self.assertEqual(res.served, [302])

    async def test_503_while_loading_then_200(self) -> None:
        """llama.cpp: 503 while the model loads, 500, 404, then 200: ready only at the 200."""
        res, port = self.serve([503, 503, 503, 500, 404, 200])
        await self.wait(port, 10)
        self.assertEqual(res.served, [503, 503, 503, 500, 404, 200])

    async def _never_ready(self, code: int) -> None:
        res, port = self.serve([code])
        d: Deferred[float] = Deferred.fromCoroutine(self.wait(port, 0.3))
        failure = await self.assertFailure(d, CommandFailed)
        self.assertEqual(failure.error_code, READINESS_TIMEOUT)
        self.assertIn(f"HTTP {code}", failure.error_message)
        self.assertGreater(len(res.served), 1)

    async def test_503_is_not_ready(self) -> None:
        await self._never_ready(503)

    async def test_500_is_not_ready(self) -> None:
        await self._never_ready(500)

    async def test_404_is_not_ready(self) -> None:
        await self._never_ready(404)

    async def test_nothing_listening_is_not_ready(self) -> None:
        """A refused connection is not ready either (the message names the error)."""
        _res, port = self.serve([200])
        closed = reactor.listenTCP(0, Site(Resource()), interface="127.0.0.1")  # type: ignore[attr-defined]
        dead = closed.getHost().port
        await closed.stopListening()
        d: Deferred[float] = Deferred.fromCoroutine(self.wait(dead, 0.2))
        failure = await self.assertFailure(d, CommandFailed)
        self.assertEqual(failure.error_code, READINESS_TIMEOUT)
        self.assertIn("ConnectionRefused", failure.error_message)
        del port


class _Endless(Protocol):
    """A health endpoint (raw HTTP/1.1) answering 200 with a body that never ends."""

    sent = 0

    def dataReceived(self, data: bytes) -> None:  # noqa: N802
        if b"\r\n\r\n" in data and not self.sent:
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
            self.transport.registerProducer(self, False)

    def resumeProducing(self) -> None:  # noqa: N802
        while self.sent < 512 * 1024 * 1024 and not self.transport.disconnecting:
            chunk = b"x" * (1 << 20)
            self.transport.write(chunk)
            type(self).sent += len(chunk)
            self.factory.sent = type(self).sent
            return

    def pauseProducing(self) -> None:  # noqa: N802
        pass

    def stopProducing(self) -> None:  # noqa: N802
        pass


class EndlessBodyTests(TestCase):
    """A workload's health endpoint answering 200 with an endless body: ready, at bounded cost."""

    timeout = 30

    async def test_endless_answer_is_read_with_a_bound(self) -> None:
        factory = Factory.forProtocol(_Endless)
        factory.sent = 0  # type: ignore[attr-defined]
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")  # type: ignore[attr-defined]
        self.addCleanup(port.stopListening)
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(pool.closeCachedConnections)
        probe = make_treq_probe(HTTPClient(Agent(reactor, pool=pool)), timeout=10)
        code = await probe(f"http://127.0.0.1:{port.getHost().port}/health")
        self.assertEqual(code, 200)
        # Before, treq buffered the body until the timeout (gigabytes on loopback).
        self.assertLess(_Endless.sent, 64 * 1024 * 1024)
