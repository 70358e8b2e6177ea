"""
The stand-in backend's WebSocket stream (protocol 3): C{.../api/admin/system/nodes/stream}.

One L{StreamProtocol} per connection. It authenticates before the upgrade (HTTP 403 on any
credential problem), sends C{hello_ack} on open, answers every accepted frame with the
node's pending C{commands}, drops frames whose C{seq} does not increase, drops the
connection on a frame its handler cannot take, and closes with 4408 after
C{faults.idle_timeout} seconds without a text frame.

The April 2026 generation sends C{commands} only in reply to an agent frame. The current one
also pushes (protocol 10.1): queuing a command wakes every open stream of its node, which
then runs a dispatch pass of its own (L{StreamProtocol.wake}), as the real backend's stream
loop waits on "a frame or a wake-up"; a frame dropped for its C{seq} still runs a dispatch
pass. A wake-up for a node with no open stream stays pending and is served right after the
next stream's C{hello_ack} (the real per-node event stays set), so commands queued while
offline arrive in C{hello_ack} and once more in a C{commands} frame.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from autobahn.twisted.websocket import WebSocketServerFactory, WebSocketServerProtocol
from autobahn.websocket.types import ConnectionDeny, ConnectionRequest
from twisted.logger import Logger

from llmport_agent.devbackend._state import AuthError, FrameRejected

if TYPE_CHECKING:
    from llmport_agent.devbackend.backend import DevBackend

#: Close code the real backend uses for an idle connection.
IDLE_CLOSE_CODE = 4408

#: Seconds a server-initiated close may take before the TCP connection is aborted.
CLOSE_GUARD = 2.0


_log = Logger(namespace="llmport_agent.devbackend.stream")


class StreamProtocol(WebSocketServerProtocol):  # type: ignore[misc]
    """
    One node connection.

    @ivar node_id: the authenticated node (set in C{onConnect}).
    @ivar session_id: set once open.
    @ivar last_seq: the per-connection C{seq} counter (starts at 0).
    """

    factory: StreamFactory

    def __init__(self) -> None:
        super().__init__()
        self.node_id: str | None = None
        self.session_id: str | None = None
        self.last_seq = 0
        self._idle: Any = None
        self._close_guard: Any = None
        self._registered = False
        self._woken: Any = None

    @property
    def backend(self) -> DevBackend:
        return self.factory.backend

    # -- handshake --------------------------------------------------------------------------

    def onConnect(self, request: ConnectionRequest) -> None:
        deny = self.backend.faults.stream_deny_status
        if deny is not None:
            raise ConnectionDeny(deny, "Stream refused (fault injection)")
        try:
            node, _record = self.backend.state.authenticate(request.headers.get("authorization"))
        except AuthError as e:
            _log.info("devbackend: stream refused: {why}", why=e.detail)
            raise ConnectionDeny(403, "Forbidden") from None
        self.node_id = node.id
        return None

    def onOpen(self) -> None:
        assert self.node_id is not None
        node = self.backend.state.nodes.get(self.node_id)
        if node is None:
            self.dropConnection(abort=False)
            return
        self.session_id = self.backend.state.session_opened(self.node_id)
        self.backend.register_stream(self)
        self._registered = True
        commands = [] if self.backend.faults.hold_commands else self.backend.state.hello_commands(
            self.node_id
        )
        self._send_json(
            {
                "type": "hello_ack",
                "session_id": self.session_id,
                "node_id": self.node_id,
                "commands": commands,
                "profile": node.profile,
            }
        )
        self._arm_idle()
        if self.backend.take_pending_wake(self.node_id):
            self.wake()

    # -- push (current generation) ------------------------------------------------------------

    def wake(self) -> None:
        """
        A command was queued for this node: run a dispatch pass soon (on the reactor, as
        the real wake-up fires after the issuing transaction commits). Wake-ups that arrive
        before the pass runs are served by it.
        """
        if self._woken is None and self._is_open():
            self._woken = self.backend.reactor.callLater(0, self._on_woken)

    def _on_woken(self) -> None:
        self._woken = None
        if self.node_id is None or not self._is_open():
            return
        self.backend.state.cost(self.node_id).wakeup_drains += 1
        self._dispatch(self.node_id)

    def _dispatch(self, node_id: str) -> None:
        """Send the node's queued/dispatched commands, if any (one pending-commands query)."""
        if not self._is_open() or self.backend.faults.hold_commands:
            return
        items = self.backend.state.take_dispatch(node_id)
        if items:
            self._send_json({"type": "commands", "items": items})

    # -- frames -----------------------------------------------------------------------------

    def _send_json(self, message: dict[str, Any]) -> None:
        self.sendMessage(json.dumps(message).encode("utf-8"), isBinary=False)

    def _is_open(self) -> bool:
        return bool(self.state == WebSocketServerProtocol.STATE_OPEN)

    def fail(self, reason: str) -> None:
        """The real handler raised: drop the TCP connection without a close frame."""
        if self.node_id is not None:
            self.backend.state.note(self.node_id, f"connection dropped: {reason}")
        _log.info(
            "devbackend: dropping stream of node {node_id}: {why}",
            node_id=self.node_id,
            why=reason,
        )
        self._cancel_idle()
        self.dropConnection(abort=False)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        if not self._is_open() or self.node_id is None:
            return
        self._arm_idle()
        if isBinary:
            self.fail("binary frame")
            return
        try:
            self._on_text(self.node_id, payload)
        except FrameRejected as e:
            self.fail(str(e))
        except RecursionError:
            self.fail("frame is nested too deeply")
        except Exception:
            # A bug here, or in a test's hook: the real backend's handler would fail too.
            _log.failure("devbackend: stream handler failed")
            self.fail("handler error")

    def _on_text(self, node_id: str, payload: bytes) -> None:
        """
        Handle one text frame.

        @raise FrameRejected: when the real backend's handler would fail on it.
        """
        try:
            frame = json.loads(payload.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            raise FrameRejected("frame is not valid JSON") from None
        if not isinstance(frame, dict):
            raise FrameRejected("frame is not a JSON object")
        state = self.backend.state
        cost = state.cost(node_id)
        cost.frames += 1
        seq = frame.get("seq")
        if seq is not None:
            try:
                seq_value = int(seq)
            except (TypeError, ValueError, OverflowError):
                state.record_frame(node_id, frame, accepted=False)
                raise FrameRejected("seq is not an integer") from None
            if seq_value <= self.last_seq:
                state.record_frame(node_id, frame, accepted=False)
                if state.current:
                    # The current backend drains the queue after a replayed frame too.
                    cost.dispatch_queries += 1
                    self._dispatch(node_id)
                return
            self.last_seq = seq_value
        inbound_filter = self.backend.inbound_filter
        if inbound_filter is not None and not inbound_filter(node_id, frame):
            state.record_frame(node_id, frame, accepted=False)
            return
        # What the real backend does for an accepted frame: the offset-row write (frames
        # with seq), then, after processing, one pending-commands query and a commit.
        if seq is not None:
            cost.offset_writes += 1
            state.session_offset_accepted(self.session_id)
        state.record_frame(node_id, frame, accepted=True)
        dispatch = state.apply_frame(node_id, frame)
        if dispatch:
            cost.dispatch_queries += 1
        hook = self.backend.frame_hook
        if hook is not None:
            hook(node_id, frame)
        if dispatch:
            self._dispatch(node_id)

    # -- idle timeout -----------------------------------------------------------------------

    def _arm_idle(self) -> None:
        self._cancel_idle()
        self._idle = self.backend.clock.callLater(self.backend.faults.idle_timeout, self._on_idle)

    def _cancel_idle(self) -> None:
        idle, self._idle = self._idle, None
        if idle is not None and idle.active():
            idle.cancel()

    def _on_idle(self) -> None:
        self._idle = None
        if self._is_open():
            _log.info("devbackend: idle stream of node {node_id} closed", node_id=self.node_id)
            self.close(IDLE_CLOSE_CODE, "Idle timeout")

    def close(self, code: int, reason: str) -> None:
        """Start a closing handshake; abort the connection if it does not finish in time."""
        if not self._is_open():
            return
        self.sendClose(code=code, reason=reason)
        if self._close_guard is None:
            self._close_guard = self.backend.reactor.callLater(CLOSE_GUARD, self._abort)

    def _abort(self) -> None:
        self._close_guard = None
        self.dropConnection(abort=True)

    # -- teardown ---------------------------------------------------------------------------

    def onClose(self, wasClean: bool, code: int | None, reason: str | None) -> None:
        self.backend.stream_closes.append((self.node_id, code if wasClean else None))
        self._cancel_idle()
        woken, self._woken = self._woken, None
        if woken is not None and woken.active():
            woken.cancel()
        guard, self._close_guard = self._close_guard, None
        if guard is not None and guard.active():
            guard.cancel()
        if self._registered:
            self._registered = False
            self.backend.unregister_stream(self)


class StreamFactory(WebSocketServerFactory):  # type: ignore[misc]
    """Builds L{StreamProtocol}s bound to one L{DevBackend}."""

    protocol = StreamProtocol  # type: ignore[assignment]

    def __init__(self, backend: DevBackend) -> None:
        super().__init__(reactor=backend.reactor)
        self.backend = backend
        # No Autobahn timers: they run on txaio's global loop and would outlive tests. The
        # protocol guards its own closing handshake on the backend's reactor instead.
        self.setProtocolOptions(
            openHandshakeTimeout=0,
            closeHandshakeTimeout=0,
            maxMessagePayloadSize=16 * 1024 * 1024,
        )
