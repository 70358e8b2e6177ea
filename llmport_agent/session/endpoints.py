"""
Endpoints for the agent's HTTP client to the backend: TCP for C{http}, TCP+TLS for
C{https} (as Twisted's own Agent makes them), with large socket reads.

Twisted reads a TCP socket 64 KiB at a time. A model blob arrives at a GB/s or more, and
each read is a trip through the reactor and the HTTP parser and a hand-back of the GIL by
the threads that write and hash it; reading up to L{READ_SIZE} bytes at once (when the
socket has that much) cuts those trips by up to 16. Small responses are unaffected.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.web.client import URI
from twisted.web.error import SchemeNotSupported
from twisted.web.iweb import IAgentEndpointFactory, IPolicyForHTTPS
from zope.interface import implementer

#: Bytes read from a socket at once.
READ_SIZE = 1024 * 1024


@implementer(IStreamClientEndpoint)
class _LargeReads:
    """A TCP endpoint whose connections read up to C{read_size} bytes at a time."""

    def __init__(self, inner: IStreamClientEndpoint, read_size: int) -> None:
        self._inner = inner
        self._read_size = read_size

    def connect(self, factory: Any) -> Deferred[Any]:
        def sized(protocol: Any) -> Any:
            transport = getattr(protocol, "transport", None)
            if transport is not None and hasattr(transport, "bufferSize"):
                transport.bufferSize = self._read_size
            return protocol

        d: Deferred[Any] = self._inner.connect(factory)
        return d.addCallback(sized)


@implementer(IAgentEndpointFactory)
class BackendEndpointFactory:
    """
    For C{Agent.usingEndpointFactory}: the standard endpoints (C{HostnameEndpoint}, TLS
    through C{policy}) with large reads.
    """

    def __init__(
        self,
        reactor: Any,
        policy: IPolicyForHTTPS,
        connect_timeout: float | None = None,
        read_size: int = READ_SIZE,
    ) -> None:
        self._reactor = reactor
        self._policy = policy
        self._connect_timeout = connect_timeout
        self._read_size = read_size

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:  # noqa: N802 - interface
        kwargs: dict[str, Any] = {}
        if self._connect_timeout is not None:
            kwargs["timeout"] = self._connect_timeout
        host = uri.host.decode("ascii")  # an IDNA host name or an address literal
        tcp = _LargeReads(HostnameEndpoint(self._reactor, host, uri.port, **kwargs),
                          self._read_size)
        if uri.scheme == b"http":
            return tcp
        if uri.scheme == b"https":
            return wrapClientTLS(self._policy.creatorForNetloc(uri.host, uri.port), tcp)
        raise SchemeNotSupported(f"Unsupported scheme: {uri.scheme!r}")


def backend_agent(reactor: Any, policy: IPolicyForHTTPS, pool: Any,
                  connect_timeout: float | None = None) -> Any:
    """A twisted.web C{Agent} for the backend (see L{BackendEndpointFactory})."""
    from twisted.web.client import Agent

    return Agent.usingEndpointFactory(
        reactor, BackendEndpointFactory(reactor, policy, connect_timeout), pool=pool
    )
