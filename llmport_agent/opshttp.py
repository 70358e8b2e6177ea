"""
The ops endpoint's HTTP server, bounded: any local process can reach 127.0.0.1 (a workload on
the host network too), so what one client can hold is capped.

 - at most L{MAX_CONNECTIONS} open connections; one more is closed as soon as it is accepted
   (it never reaches the HTTP parser), so the endpoint holds at most that many descriptors;
 - the request line and headers within L{HEADER_BYTES} bytes and L{MAX_HEADERS} lines, and
   complete within L{HEADER_DEADLINE_S} seconds of the connection (or of the previous
   response): a client sending a byte now and then is dropped;
 - no request body: the endpoint is GET-only, a request announcing one (C{Content-Length}
   above 0, C{Transfer-Encoding}) is answered 413 and the connection closed; nothing is ever
   spooled to a temporary file;
 - idle keep-alive connections closed after L{IDLE_TIMEOUT_S} seconds.
"""

from __future__ import annotations

from io import BytesIO
from typing import Any

from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel
from twisted.web.server import Request, Site

__all__ = [
    "HEADER_BYTES",
    "HEADER_DEADLINE_S",
    "IDLE_TIMEOUT_S",
    "MAX_CONNECTIONS",
    "MAX_HEADERS",
    "BoundedSite",
]

MAX_CONNECTIONS = 64
HEADER_BYTES = 8192
MAX_HEADERS = 32
HEADER_DEADLINE_S = 10.0
IDLE_TIMEOUT_S = 15.0


class _NoBodyRequest(Request):
    """A request whose body, should one get this far, is never kept (no temporary file)."""

    def gotLength(self, length: int | None) -> None:  # noqa: N802 - Twisted's name
        self.content = BytesIO()

    def handleContentChunk(self, data: bytes) -> None:  # noqa: N802
        pass


class _BoundedChannel(HTTPChannel):
    maxHeaders = MAX_HEADERS
    totalHeadersSize = HEADER_BYTES

    site: BoundedSite  # set by Site.buildProtocol
    transport: Any
    _deadline: IDelayedCall | None = None
    _counted = False

    def connectionMade(self) -> None:  # noqa: N802
        super().connectionMade()
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.callLater(self.site.header_deadline, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
        self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        self.site.timed_out += 1
        self.transport.abortConnection()

    def headerReceived(self, line: bytes) -> bool:  # noqa: N802
        ok = bool(super().headerReceived(line))
        if ok and self.length != 0:  # a Content-Length above 0, or chunked (None)
            self.site.bodies_refused += 1
            self.transport.write(
                b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self.transport.loseConnection()
            return False
        return ok

    def allHeadersReceived(self) -> None:  # noqa: N802
        self._disarm()
        super().allHeadersReceived()

    def requestDone(self, request: Any) -> None:  # noqa: N802
        super().requestDone(request)
        if not self.transport.disconnecting:
            self._arm()

    def connectionLost(self, reason: Failure = connectionDone) -> None:  # noqa: N802
        self._disarm()
        if self._counted:
            self._counted = False
            self.site.open_connections -= 1
        super().connectionLost(reason)


class BoundedSite(Site):
    """A L{Site} with the bounds above (overridable per instance, for tests)."""

    protocol = _BoundedChannel  # type: ignore[assignment]  # plain HTTP/1.1, no protocol switching
    requestFactory = _NoBodyRequest

    def __init__(
        self,
        resource: Any,
        reactor: Any,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout: float = IDLE_TIMEOUT_S,
        header_deadline: float = HEADER_DEADLINE_S,
    ) -> None:
        super().__init__(resource, requestFactory=_NoBodyRequest, timeout=idle_timeout, reactor=reactor)
        self.max_connections = max_connections
        self.header_deadline = header_deadline
        self.open_connections = 0
        self.refused = 0
        self.timed_out = 0
        self.bodies_refused = 0
        self.noisy = False

    def buildProtocol(self, addr: Any) -> Any:  # noqa: N802
        if self.open_connections >= self.max_connections:
            self.refused += 1
            return None  # the transport is closed at once
        channel = super().buildProtocol(addr)
        channel._counted = True
        self.open_connections += 1
        return channel
