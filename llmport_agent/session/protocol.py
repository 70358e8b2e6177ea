"""
The WebSocket client protocol and factory for the backend stream (protocol 3).

Per connection: the C{Authorization: Bearer} header is built in C{onConnecting} from the current
credential; C{seq} starts at 1 and strictly increases; inbound frames are parsed defensively and
handed to the session as dicts; delivery confirmation uses WebSocket pings: a frame sent before a
ping whose pong came back has reached the backend's WebSocket stack. The keep-alive's pings
(L{llmport_agent.session.keepalive}) are sent from here too; any byte read proves the link.

Nothing here knows about commands; it moves JSON objects.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, Protocol

from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from autobahn.websocket.types import ConnectingRequest
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from llmport_agent.session.framesplit import salvage_frame
from llmport_agent.session.tls import describe_connection_error

#: Frames above this size are ignored with a log line (the connection stays up).
SOFT_MAX_FRAME = 8 * 1024 * 1024
#: Frames above this size make Autobahn fail the connection (memory bound).
HARD_MAX_FRAME = 32 * 1024 * 1024


class ConnectionGone(Exception):
    """The connection closed before a frame's delivery was confirmed."""


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def parse_http_status(status_line: str | None) -> int | None:
    if not status_line:
        return None
    parts = status_line.split()
    if len(parts) >= 2 and parts[1].isdigit():
        return int(parts[1])
    return None


_log = Logger(namespace="llmport_agent.session.protocol")

#: Deliveries confirmed by one pong are reported this many per reactor turn.
CONFIRM_SLICE = 128


def fire_in_slices(clock: Any, waiters: list[Deferred[None]], size: int = CONFIRM_SLICE) -> None:
    """
    Fire C{waiters} in order, C{size} per reactor turn: one pong can confirm thousands of
    frames, and each confirmation has work attached (journal updates).
    """
    now, rest = waiters[:size], waiters[size:]
    for d in now:
        if not d.called:
            d.callback(None)
    if rest:
        clock.callLater(0, fire_in_slices, clock, rest, size)


class AgentClientProtocol(WebSocketClientProtocol):
    """
    One connection to the backend stream.

    Autobahn's own C{log} (a txaio logger, which drops debug events unless asked) is left in
    place: replacing it with a plain twisted Logger would emit Autobahn's debug events,
    handshake details included, to every observer.
    """

    factory: AgentClientFactory

    def __init__(self) -> None:
        super().__init__()
        self.seq = 0
        self.opened_at: float | None = None
        self._unconfirmed: list[Deferred[None]] = []
        self._ping_waiters: dict[bytes, list[Deferred[None]]] = {}
        self._ping_counter = 0
        self.frames_sent = 0
        self.frames_received = 0
        #: Bytes read from the backend on this connection (the keep-alive's proof of life).
        self.bytes_received = 0
        self.lost_reason: Any = None

    # -- handshake -------------------------------------------------------------------------

    def onConnecting(self, transport_details: Any) -> ConnectingRequest:
        f = self.factory
        headers = dict(f.headers or {})
        headers["Authorization"] = "Bearer " + f.credential()
        return ConnectingRequest(
            host=f.host,
            port=f.port,
            resource=f.resource,
            headers=headers,
            useragent=f.useragent,
            origin=f.origin,
            protocols=[],
        )

    def onOpen(self) -> None:
        self.opened_at = self.factory.clock.seconds()
        self.factory.session.connection_opened(self)

    # -- inbound ---------------------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        self.bytes_received += len(data)
        super().dataReceived(data)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        self.frames_received += 1
        if isBinary:
            _log.warn("Ignored a binary frame from the backend ({size} bytes)", size=len(payload))
            return
        if len(payload) > SOFT_MAX_FRAME:
            # Still parsed (Autobahn bounds frames at HARD_MAX_FRAME): ignoring a big commands
            # list would block every command behind the one that makes it big. Oversized
            # commands are refused one by one by the pipeline.
            _log.warn("Large frame from the backend ({size} bytes)", size=len(payload))
        try:
            frame = json.loads(payload)
        except (ValueError, RecursionError) as e:
            # One bad command must not cost the others listed with it: take the frame apart.
            salvaged = salvage_frame(payload)
            if salvaged is None:
                _log.warn(
                    "Ignored a frame from the backend that is not usable JSON: {error}",
                    error=f"{type(e).__name__}: {str(e)[:200]}",
                )
                return
            frame, problems = salvaged
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            _log.warn(
                "A frame from the backend did not parse as a whole ({error}); its parts were "
                "handled one by one: {problems}",
                error=f"{type(e).__name__}: {str(e)[:120]}",
                problems=shown or "nothing was lost",
            )
        if not isinstance(frame, dict):
            _log.warn(
                "Ignored a frame from the backend that is not a JSON object (got {kind})",
                kind=type(frame).__name__,
            )
            return
        self.factory.session.frame_received(self, frame)

    @property
    def can_send(self) -> bool:
        """True while frames can be sent (open, not closing)."""
        return self.state == WebSocketClientProtocol.STATE_OPEN

    # -- outbound --------------------------------------------------------------------------

    def send_frame(self, frame: dict[str, Any], *, seq: bool = True) -> int:
        """
        Stamp the next C{seq} on C{frame} and send it as one text frame; with C{seq=False}
        the frame goes without one (the backend then skips its check and its session-offset
        write) and the counter stays where it is. Returns the C{seq} stamped (0 for none).
        """
        if seq:
            self.seq += 1
            frame["seq"] = self.seq
        else:
            frame.pop("seq", None)
        try:
            data = json.dumps(frame, separators=(",", ":"), default=str, allow_nan=False).encode()
        except ValueError:
            # NaN/Infinity are not JSON and break the backend's insert: send null instead.
            data = json.dumps(_finite(frame), separators=(",", ":"), default=str).encode()
        self.sendMessage(data, isBinary=False)
        self.frames_sent += 1
        return self.seq if seq else 0

    def confirm(self) -> Deferred[None]:
        """
        Fires once everything sent so far has reached the backend (a ping sent after it was
        answered); fails with L{ConnectionGone} if the connection closes first.
        """
        d: Deferred[None] = Deferred()
        self._unconfirmed.append(d)
        if not self._ping_waiters:
            self._send_confirm_ping()
        return d

    def _send_confirm_ping(self) -> None:
        self._ping_counter += 1
        token = b"llmport-confirm-%d-" % self._ping_counter + os.urandom(4).hex().encode()
        waiters, self._unconfirmed = self._unconfirmed, []
        self._ping_waiters[token] = waiters
        self.sendPing(token)

    def onPong(self, payload: bytes) -> None:
        waiters = self._ping_waiters.pop(payload, None)
        if waiters is None:
            return
        fire_in_slices(self.factory.clock, waiters)
        if self._unconfirmed and not self._ping_waiters:
            self._send_confirm_ping()

    # -- keep-alive (L{llmport_agent.session.keepalive}) ----------------------------------

    def send_keepalive_ping(self) -> bool:
        """Send one keep-alive ping (its pong is not matched: any byte back proves the link)."""
        if not self.can_send:
            return False
        self.sendPing(b"llmport-keepalive")
        return True

    def drop_unanswered(self, reason: str) -> None:
        """The backend answered nothing since the last keep-alive ping: abort the connection."""
        self.wasClean = False
        self.wasNotCleanReason = reason
        self.dropConnection(abort=True)

    # -- close -----------------------------------------------------------------------------

    def connectionLost(self, reason: Any = None) -> None:
        # Kept for the session, which says what a TLS failure means and what to set; Autobahn's
        # own error line for it ("SSL error: certificate verify failed") would only repeat it.
        self.lost_reason = reason
        if reason is not None and describe_connection_error(reason):
            self._connectionLost(reason)
            return
        super().connectionLost(reason)

    def onClose(self, wasClean: bool, code: int | None, reason: str | None) -> None:
        pending = self._unconfirmed + [d for ws in self._ping_waiters.values() for d in ws]
        self._unconfirmed, self._ping_waiters = [], {}
        for d in pending:
            d.errback(ConnectionGone("connection closed before delivery was confirmed"))
        status = None if self.opened_at is not None else parse_http_status(
            getattr(self, "http_status_line", None)
        )
        self.factory.session.connection_closed(self, wasClean, code, reason, status)


class StreamEvents(Protocol):
    """What a connection tells its session (L{SessionService} provides it)."""

    def connection_opened(self, proto: AgentClientProtocol) -> None: ...
    def frame_received(self, proto: AgentClientProtocol, frame: dict[str, Any]) -> None: ...
    def connection_closed(
        self, proto: AgentClientProtocol, wasClean: bool, code: int | None, reason: str | None,
        http_status: int | None,
    ) -> None: ...


class AgentClientFactory(WebSocketClientFactory):
    """Builds L{AgentClientProtocol}s for one L{SessionService}."""

    protocol = AgentClientProtocol  # type: ignore[assignment]

    def __init__(
        self,
        url: str,
        *,
        session: StreamEvents,
        credential: Callable[[], str],
        clock: Any,
        useragent: str,
    ) -> None:
        super().__init__(url, useragent=useragent)
        self.noisy = False
        self.session = session
        self.credential = credential
        self.clock = clock
