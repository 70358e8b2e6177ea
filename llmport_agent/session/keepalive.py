"""
The stream's keep-alive: a dead link (the backend gone silently, a proxy that stopped
forwarding, a half-open TCP connection) is found by asking, since the backend sends nothing
unasked.

It rides the connection's heartbeat loop (L{llmport_agent.session.reporting.HeartbeatReporter}
calls L{KeepAlive.tick}): each tick sends one WebSocket ping in the same reactor turn as the
heartbeat (one wake-up, one write), and judges the previous tick's ping. Nothing received from
the backend since that ping (no pong, no frame, not a byte), even after one more pass over
the sockets (a late tick runs before the reads), and the connection is dropped; ClientService
reconnects. There is no timer of its own, and no pong timeout left in the
reactor's heap: a link that dies is found within two ticks. The heartbeat loop ticks at least
every L{KEEPALIVE_MAX_SEC} whatever the heartbeat interval (a 60 s heartbeat goes every 4th
tick), so that is at most 30 s, as quick as Autobahn's 20 s ping with its 10 s pong timeout
that it replaces (a ping is given at least L{KEEPALIVE_MIN_WAIT_SEC} to be answered, however
short the heartbeat interval); and the loop ticks while the heartbeat itself is not sent (its fields fail
to build, the session refuses the frame).

WebSocket pings do not keep the backend's side open (protocol 3.2: only JSON frames do); the
heartbeat does that.
"""

from __future__ import annotations

from typing import Any, Protocol

from twisted.logger import Logger

#: The longest tick of the heartbeat loop: a dead link is dropped within two of them.
KEEPALIVE_MAX_SEC = 15.0
#: The least time a ping is given to be answered (Autobahn's pong timeout was 10 s): with a
#: short HEARTBEAT_INTERVAL_SEC the ticks in between neither judge it nor send another.
KEEPALIVE_MIN_WAIT_SEC = 10.0


class Pingable(Protocol):
    """What the keep-alive needs of a connection (L{AgentClientProtocol} provides it)."""

    @property
    def bytes_received(self) -> int: ...
    def send_keepalive_ping(self) -> bool: ...
    def drop_unanswered(self, reason: str) -> None: ...


class KeepAlive:
    """
    Liveness of the open connection, judged at each tick (see the module docstring).

    @ivar dropped: connections dropped for an unanswered ping (diagnostics).
    """

    log = Logger()

    def __init__(self, clock: Any) -> None:
        self._clock = clock
        self._proto: Pingable | None = None
        #: Bytes received when the outstanding ping went (None: no ping outstanding).
        self._mark: int | None = None
        self._sent_at = 0.0
        self._judging = False
        self.pings = 0
        self.dropped = 0

    def opened(self, proto: Pingable) -> None:
        """A connection opened: it is judged from its first ping on."""
        self._proto = proto
        self._mark = None
        self._judging = False

    def closed(self, proto: Pingable) -> None:
        if proto is self._proto:
            self._proto = None
            self._mark = None

    def tick(self) -> None:
        """Judge the previous tick's ping, then send the next one."""
        proto = self._proto
        if proto is None or self._judging:
            return
        if self._mark is not None and self._clock.seconds() - self._sent_at < KEEPALIVE_MIN_WAIT_SEC:
            return  # the outstanding ping is young: judged at a later tick
        if self._mark is not None and proto.bytes_received == self._mark:
            # Judged after one more pass over the sockets: a tick that ran late (the reactor
            # busy) runs before the reads, and the pong may be waiting in the socket. Only a
            # link that looks dead pays for this call; it is in the same wake-up.
            self._judging = True
            self._clock.callLater(0, self._judge, proto)
            return
        self._ping(proto)

    def _judge(self, proto: Pingable) -> None:
        self._judging = False
        if proto is not self._proto:
            return
        if self._mark is not None and proto.bytes_received == self._mark:
            self.dropped += 1
            self._proto = self._mark = None
            waited = max(0.0, self._clock.seconds() - self._sent_at)
            self.log.warn(
                "The backend did not answer a keep-alive ping in {seconds:.0f} s (nothing received "
                "since): the link is dead or stalled; dropping it and reconnecting",
                seconds=waited,
            )
            proto.drop_unanswered(f"keep-alive ping not answered in {waited:.0f} s")
            return
        self._ping(proto)

    def _ping(self, proto: Pingable) -> None:
        now = self._clock.seconds()
        mark = proto.bytes_received
        if proto.send_keepalive_ping():
            self.pings += 1
            self._mark = mark
            self._sent_at = now
        else:
            self._mark = None
