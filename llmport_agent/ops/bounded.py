"""
The ops endpoint's HTTP server, bounded: any local process can reach 127.0.0.1 (a workload on
the host network too), so what one client can hold is capped.

 - at most L{MAX_CONNECTIONS} open connections. One more takes the place of the connection
   that has waited longest on its client (its output unread the longest, else one holding
   pipelined requests, else idle or half-sent the longest); when every connection has a request being answered, it is closed
   as soon as it is accepted (it never reaches the HTTP parser). So the endpoint holds at
   most that many descriptors, and a flood of connections that do not read cannot keep
   another client (a monitor's C{/healthz}) out;
 - the request line and headers within L{HEADER_BYTES} bytes and L{MAX_HEADERS} lines, and
   complete within L{HEADER_DEADLINE_S} seconds of the connection (or of the previous
   response): a client sending a byte now and then is dropped;
 - no request body: the endpoint is GET-only, a request announcing one (C{Content-Length}
   above 0, C{Transfer-Encoding}) is answered 413 and the connection closed; nothing is ever
   spooled to a temporary file;
 - idle keep-alive connections closed after L{IDLE_TIMEOUT_S} seconds;
 - one request at a time per connection, and no work for a client that does not read: the
   channel hands the parser one request head, then stops reading the socket until that
   response is complete, and takes the next pipelined request only on a later turn of the
   reactor and only while the transport's output buffer is below its bound (the transport
   tells its producer, the channel, to pause when it is over it and to resume when the client
   has read it). Pipelined bytes held beyond L{PIPELINE_BYTES} drop the connection. A flood of
   pipelined C{GET /metrics} (issue 29: 64 connections x 64 KiB stalled the reactor 43 s and
   took 700 MiB) thus renders about one response per connection per reactor turn, and none for
   a connection whose output is not being read.
"""

from __future__ import annotations

import socket
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
    "PIPELINE_BYTES",
    "BoundedSite",
]

MAX_CONNECTIONS = 64
HEADER_BYTES = 8192
MAX_HEADERS = 32
HEADER_DEADLINE_S = 10.0
IDLE_TIMEOUT_S = 15.0
#: Request bytes a connection may have sent ahead of the request being answered (pipelined).
PIPELINE_BYTES = 16384
#: One read from a client's socket (Twisted's default is 64 KiB): a request head is at most
#: L{HEADER_BYTES}, so this bounds what a read can add to the pipelined bytes.
READ_BYTES = 16384
#: The kernel's send buffer for a client (Linux doubles it): what a client that does not read
#: can make the agent render before its output is paused.
SEND_BUFFER_BYTES = 32768


class _NoBodyRequest(Request):
    """A request whose body, should one get this far, is never kept (no temporary file)."""

    def gotLength(self, length: int | None) -> None:  # noqa: N802 - Twisted's name
        self.content = BytesIO()

    def handleContentChunk(self, data: bytes) -> None:  # noqa: N802
        pass


_HEAD_END = b"\r\n\r\n"


class _BoundedChannel(HTTPChannel):
    maxHeaders = MAX_HEADERS
    totalHeadersSize = HEADER_BYTES

    site: BoundedSite  # set by Site.buildProtocol
    transport: Any
    _deadline: IDelayedCall | None = None
    _next: IDelayedCall | None = None
    #: A request head was given to the parser and its response is not complete.
    _in_flight = False
    #: The transport's output buffer is over its bound (it paused us; the client is not reading).
    _blocked = False
    _gone = False
    _waiting_since = 0.0
    _blocked_since = 0.0
    #: The kernel send buffer given to each connection (None: the kernel's own, autotuned).
    send_buffer: int | None = SEND_BUFFER_BYTES

    def connectionMade(self) -> None:  # noqa: N802
        self._inbox = bytearray()  # request bytes not yet given to the parser
        self._tail = b""  # the last bytes given to the parser of a head not yet complete
        self._waiting_since = self.site.reactor.seconds()
        if hasattr(self.transport, "bufferSize"):
            self.transport.bufferSize = READ_BYTES
        handle = getattr(self.transport, "getHandle", None)
        if handle is not None and self.send_buffer is not None:
            try:  # a client that does not read fills a small kernel buffer: less work for it
                handle().setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer)
            except (OSError, AttributeError):
                pass
        super().connectionMade()
        self._arm()

    def eviction_rank(self) -> tuple[int, float] | None:
        """
        Where this connection stands in line to make room for a new one (lowest first): one
        whose output has not been read, by how long; then one holding pipelined requests; then
        one idle or half-sent, by how long; C{None} while a request is being answered.
        """
        if self._gone:
            return (0, 0.0)
        if self._blocked:
            return (0, self._blocked_since)
        if self._in_flight:
            return None
        return (1 if self._inbox else 2, self._waiting_since)

    def evict(self) -> None:
        self._gone = True
        self.transport.abortConnection()

    # -- one request at a time

    def dataReceived(self, data: bytes) -> None:  # noqa: N802
        self._inbox += data
        if len(self._inbox) > self.site.pipeline_bytes:
            # More sent ahead than any client that waits for its answers needs.
            self.site.pipelining_dropped += 1
            self._inbox.clear()
            self._gone = True
            self.transport.abortConnection()
            return
        if self._next is None:  # else the next turn takes it
            self._feed()

    def _turn(self) -> None:
        self._next = None
        self._feed()

    def _feed(self) -> None:
        """
        Give the parser what it may have now: the bytes up to the end of one request head,
        then nothing until that request is answered (and a later reactor turn).
        """
        if self._in_flight or self._blocked or self._gone or self.transport.disconnecting:
            self._reading()
            return
        if self._inbox:
            found = (self._tail + bytes(self._inbox)).find(_HEAD_END)
            if found < 0:
                chunk = bytes(self._inbox)  # part of a head: the parser bounds its size
                self._tail = (self._tail + chunk)[-(len(_HEAD_END) - 1):]
            else:
                chunk = bytes(self._inbox[:found + len(_HEAD_END) - len(self._tail)])
                self._tail = b""
                self._in_flight = True
                self.site.requests_parsed += 1
            del self._inbox[:len(chunk)]
            super().dataReceived(chunk)
        self._reading()

    def _reading(self) -> None:
        """Read the socket only while nothing waits: no request in flight, none held, room out."""
        if self._gone or self.transport.disconnecting:
            return
        if self._in_flight or self._blocked or self._inbox:
            self.transport.pauseProducing()
        else:
            self.transport.resumeProducing()

    def _schedule_next(self) -> None:
        if self._next is None and self._inbox and not self._blocked and not self._gone:
            # On a later turn: other connections and the agent's own work go first.
            self._next = self.callLater(0, self._turn)

    def pauseProducing(self) -> None:  # noqa: N802 - the transport's output is over its bound
        if not self._blocked:
            self._blocked_since = self.site.reactor.seconds()
        self._blocked = True
        super().pauseProducing()
        self._reading()

    def resumeProducing(self) -> None:  # noqa: N802 - the client read it
        self._blocked = False
        super().resumeProducing()
        self._reading()
        self._schedule_next()

    # -- bounds on the head

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
        self._gone = True
        self.transport.abortConnection()

    def headerReceived(self, line: bytes) -> bool:  # noqa: N802
        ok = bool(super().headerReceived(line))
        if ok and self.length != 0:  # a Content-Length above 0, or chunked (None)
            self.site.bodies_refused += 1
            self.transport.write(
                b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self._gone = True
            self.transport.loseConnection()
            return False
        return ok

    def allHeadersReceived(self) -> None:  # noqa: N802
        self._disarm()
        super().allHeadersReceived()

    def requestDone(self, request: Any) -> None:  # noqa: N802
        super().requestDone(request)
        self._in_flight = False
        self._waiting_since = self.site.reactor.seconds()
        if not self.transport.disconnecting:
            self._arm()
        self._reading()
        self._schedule_next()

    def connectionLost(self, reason: Failure = connectionDone) -> None:  # noqa: N802
        self._gone = True
        self._disarm()
        if self._next is not None and self._next.active():
            self._next.cancel()
        self._next = None
        self._inbox = bytearray()
        self.site.release(self)
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
        pipeline_bytes: int = PIPELINE_BYTES,
    ) -> None:
        super().__init__(resource, requestFactory=_NoBodyRequest, timeout=idle_timeout, reactor=reactor)
        self.max_connections = max_connections
        self.header_deadline = header_deadline
        self.pipeline_bytes = pipeline_bytes
        #: Request heads given to the parser (each one request answered, or refused).
        self.requests_parsed = 0
        #: Connections dropped for sending more than C{pipeline_bytes} ahead.
        self.pipelining_dropped = 0
        self.open_connections = 0
        self.refused = 0
        self.timed_out = 0
        self.bodies_refused = 0
        #: Connections closed to make room for a new one.
        self.evicted = 0
        self.noisy = False
        self.channels: set[_BoundedChannel] = set()

    def buildProtocol(self, addr: Any) -> Any:  # noqa: N802
        if self.open_connections >= self.max_connections and not self._make_room():
            self.refused += 1
            return None  # the transport is closed at once
        channel = super().buildProtocol(addr)
        self.open_connections += 1
        self.channels.add(channel)
        return channel

    def _make_room(self) -> bool:
        """Close the connection that waited longest on its client (see the module's docstring)."""
        ranked = [(rank, id(c), c) for c in self.channels if (rank := c.eviction_rank()) is not None]
        if not ranked:
            return False
        _rank, _id, victim = min(ranked, key=lambda r: (r[0], r[1]))
        self.evicted += 1
        self.release(victim)
        victim.evict()
        return True

    def release(self, channel: _BoundedChannel) -> None:
        """A connection is gone (or evicted): it no longer counts against C{max_connections}."""
        if channel in self.channels:
            self.channels.discard(channel)
            self.open_connections -= 1
