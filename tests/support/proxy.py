"""
Loopback TCP proxies for fault injection.

L{LoopbackProxy} forwards bytes both ways between a client and C{127.0.0.1:target_port};
subclasses decide what happens to each chunk (L{LoopbackProxy.to_server},
L{LoopbackProxy.to_client}). L{StallingProxy} forwards faithfully until a byte budget (server
to client) is spent, then stops forwarding while keeping every connection open: a registry
that "stops sending" in the middle of a blob. The chaos proxy (cuts, stalls, slow links,
corruption) is L{tests.support.chaosproxy.ChaosProxy}.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.python.failure import Failure


def _t(proto: Protocol) -> Any:
    """The protocol's transport, untyped (zope interfaces confuse mypy without its plugin)."""
    return proto.transport


class _Upstream(Protocol):
    def __init__(self, front: _Front) -> None:
        self.front = front
        self.closed: Deferred[None] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.front.proxy.to_client(self.front, data)

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.front.upstreamLost()
        self.closed.callback(None)


class _Front(Protocol):
    def __init__(self, proxy: LoopbackProxy) -> None:
        self.proxy = proxy
        self.upstream: _Upstream | None = None
        self.pending: list[bytes] = []
        self.closed: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        _t(self).pauseProducing()
        self.proxy.fronts.add(self)
        up = _Upstream(self)
        factory: Any = _OneShot(up)
        d = TCP4ClientEndpoint(self.proxy.reactor, "127.0.0.1", self.proxy.target_port).connect(factory)

        def connected(proto: _Upstream) -> None:
            self.upstream = proto
            self.proxy.upstreams.add(proto)
            for chunk in self.pending:
                _t(proto).write(chunk)
            self.pending = []
            if self.transport is not None:
                _t(self).resumeProducing()

        def failed(_: Failure) -> None:
            _t(self).loseConnection()

        d.addCallbacks(connected, failed)

    def dataReceived(self, data: bytes) -> None:
        self.proxy.to_server(self, data)

    # What the policies call to move bytes on.

    def write_server(self, data: bytes) -> None:
        if self.upstream is None or self.upstream.transport is None:
            self.pending.append(data)
        else:
            _t(self.upstream).write(data)

    def write_client(self, data: bytes) -> None:
        if self.transport is not None:
            _t(self).write(data)

    def abort(self) -> None:
        """Cut both sides at once (a reset, no FIN)."""
        if self.transport is not None:
            _t(self).abortConnection()
        if self.upstream is not None and self.upstream.transport is not None:
            _t(self.upstream).abortConnection()

    def upstreamLost(self) -> None:
        if self.transport is not None and self.proxy.forward_close(self):
            _t(self).loseConnection()

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.proxy.fronts.discard(self)
        self.proxy.front_lost(self)
        if self.upstream is not None and self.upstream.transport is not None:
            _t(self.upstream).loseConnection()
        self.closed.callback(None)


class _OneShot(Factory):
    def __init__(self, proto: Protocol) -> None:
        self.proto = proto

    def buildProtocol(self, addr: Any) -> Protocol:
        return self.proto


class _FrontFactory(Factory):
    def __init__(self, proxy: LoopbackProxy) -> None:
        self.proxy = proxy

    def buildProtocol(self, addr: Any) -> Protocol | None:
        if not self.proxy.accepting():
            return None
        return _Front(self.proxy)


class LoopbackProxy:
    """
    Listen on 127.0.0.1:<free port> and forward to C{127.0.0.1:target_port}, faithfully
    unless a subclass overrides the hooks.
    """

    def __init__(self, reactor: Any, target_port: int) -> None:
        self.reactor = reactor
        self.target_port = target_port
        self.fronts: set[_Front] = set()
        self.upstreams: set[_Upstream] = set()
        self.port: Any = None

    # -- hooks -----------------------------------------------------------------------------

    def to_server(self, front: _Front, data: bytes) -> None:
        front.write_server(data)

    def to_client(self, front: _Front, data: bytes) -> None:
        front.write_client(data)

    def forward_close(self, front: _Front) -> bool:
        """Whether the server closing its side closes the client's."""
        return True

    def accepting(self) -> bool:
        """Whether a new client connection is taken (False: closed at once)."""
        return True

    def front_lost(self, front: _Front) -> None:
        """A client connection is gone."""

    # -- life ------------------------------------------------------------------------------

    async def start(self) -> int:
        """Start listening; return the port."""
        self.port = await TCP4ServerEndpoint(self.reactor, 0, interface="127.0.0.1").listen(
            _FrontFactory(self)
        )
        return int(self.port.getHost().port)

    @property
    def listening_port(self) -> int:
        return int(self.port.getHost().port)

    def stop(self) -> Deferred[Any]:
        """Close every connection and stop listening; fires when all are closed."""
        waits: list[Deferred[Any]] = []
        for front in list(self.fronts):
            waits.append(front.closed)
            if front.transport is not None:
                _t(front).abortConnection()
        for up in list(self.upstreams):
            if not up.closed.called:
                waits.append(up.closed)
                if up.transport is not None:
                    _t(up).abortConnection()
        if self.port is not None:
            waits.append(self.port.stopListening() or succeed(None))
            self.port = None
        return DeferredList(waits, consumeErrors=True)


class StallingProxy(LoopbackProxy):
    """
    Forward to C{127.0.0.1:target_port} until C{stall_after} bytes went to the client.

    @ivar stall_after: bytes (server to client, all connections together) to forward
        before going silent; C{None} forwards everything.
    """

    def __init__(self, reactor: Any, target_port: int, stall_after: int | None = None) -> None:
        super().__init__(reactor, target_port)
        self.stall_after = stall_after
        self.forwarded = 0
        self.withheld = 0

    @property
    def stalled(self) -> bool:
        return self.stall_after is not None and self.forwarded >= self.stall_after

    def to_client(self, front: _Front, data: bytes) -> None:
        budget = self.stall_after
        if budget is not None:
            room = budget - self.forwarded
            if room <= 0:
                self.withheld += len(data)
                return
            if len(data) > room:
                self.withheld += len(data) - room
                data = data[:room]
        self.forwarded += len(data)
        front.write_client(data)

    def forward_close(self, front: _Front) -> bool:
        return not self.stalled
