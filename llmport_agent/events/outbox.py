"""
The event outbox: events for C{event_batch} frames, on disk until the backend has them.

Events are appended to C{<state dir>/events.jsonl} (group commit, off the reactor) and sent in
frames of at most 100 while connected, C{flush_interval} (0.5 s) after the first event of a
batch is emitted (so a burst goes in one frame), at once when 100 are waiting, and at each
connect. The flush is event-driven: while there is nothing to send, no timer is scheduled. A batch is removed
only once its delivery is confirmed (see L{SessionService.confirm}); a batch cut off by a
disconnect is sent again after the next connect. The outbox is bounded: beyond C{capacity} the
oldest events are dropped and every drop is counted (visible in diagnostics).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger

from llmport_agent.core.storage import GroupCommitLog, read_log
from llmport_agent.core.threads import BlockingRunner

BATCH_MAX = 100
SEVERITIES = ("info", "warning", "error")


def iso_now(wallclock: Callable[[], float] = time.time) -> str:
    t = wallclock()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


def make_event(
    event_type: str,
    payload: Mapping[str, Any],
    severity: str = "info",
    correlation_id: str | None = None,
    wallclock: Callable[[], float] = time.time,
) -> dict[str, Any]:
    """An event object within the backend's field limits (protocol 6)."""
    if severity not in SEVERITIES:
        severity = "info"
    return {
        "event_type": str(event_type)[:128],
        "severity": severity,
        "correlation_id": (str(correlation_id)[:128] if correlation_id else None),
        "payload": dict(payload),
        "ts": iso_now(wallclock),
    }


class Sender(Protocol):
    """What the outbox needs from the session."""

    @property
    def connected(self) -> bool: ...

    def send(self, frame: dict[str, Any]) -> bool: ...

    def confirm(self) -> Deferred[None] | None: ...


class EventOutbox(Service):
    log = Logger()

    def __init__(
        self,
        reactor: Any,
        runner: BlockingRunner,
        path: str,
        session: Sender,
        *,
        capacity: int = 10000,
        flush_interval: float = 0.5,
        wallclock: Callable[[], float] = time.time,
    ) -> None:
        self.setName("events")
        self._reactor = reactor
        self._runner = runner
        self.path = path
        self.session = session
        self.capacity = capacity
        self.flush_interval = flush_interval
        self._wallclock = wallclock
        self._queue: deque[tuple[int, dict[str, Any]]] = deque()
        self._next = 1
        self._inflight: list[int] = []
        self.dropped = 0
        self.sent = 0
        self._log: GroupCommitLog | None = None
        #: The one-shot flush scheduled by L{emit} (and after a failed send); None when idle.
        self._flush_call: Any = None
        self._acked_upto = 0

    # -- lifecycle -------------------------------------------------------------------------

    def load(self) -> Deferred[None]:
        def replay(result: tuple[list[dict[str, Any]], int, bool]) -> Deferred[None]:
            acked = 0
            events: list[tuple[int, dict[str, Any]]] = []
            for line in result[0]:
                if "ack" in line:
                    ack, dropped = line.get("ack"), line.get("dropped", 0)
                    if isinstance(ack, int) and isinstance(dropped, int):
                        acked = max(acked, ack)
                        self.dropped = max(self.dropped, dropped)
                elif isinstance(line.get("n"), int) and isinstance(line.get("event"), dict):
                    events.append((line["n"], line["event"]))
            for n, event in events:
                if n > acked:
                    self._queue.append((n, event))
                self._next = max(self._next, n + 1)
            # Past the acknowledged ones too: a file compacted down to its ack line holds no
            # event, and a number at or below the ack would be taken as delivered at the next load.
            self._next = max(self._next, acked + 1)
            self._acked_upto = acked
            self._trim()
            self._log = GroupCommitLog(self._runner, self.path)
            if result[2] and not self._queue and not self.dropped:
                # No file (or an empty regular one) and nothing to keep: a rewrite would write
                # the defaults that an absent file means (a first start: issue 27). Anything
                # else there (a link, say) is replaced by the rewrite, as always.
                return succeed(None)
            return self._compact()

        return self._runner.run(read_log, self.path).addCallback(replay)

    def startService(self) -> None:
        super().startService()
        self._schedule()

    def stopService(self) -> Deferred[None]:
        super().stopService()
        self._cancel_flush()
        return self.drained()

    def _schedule(self) -> None:
        """Flush in C{flush_interval} seconds, unless a flush is scheduled or nothing waits."""
        if self._flush_call is not None or not self._queue or not self.running:
            return
        self._flush_call = self._reactor.callLater(self.flush_interval, self._flush_due)

    def _flush_due(self) -> None:
        self._flush_call = None
        self.flush()

    def _cancel_flush(self) -> None:
        call, self._flush_call = self._flush_call, None
        if call is not None and call.active():
            call.cancel()

    def drained(self) -> Deferred[None]:
        if self._log is None or self._log.idle:
            return succeed(None)
        return self._log.append({"ack": self._acked_upto, "dropped": self.dropped})

    # -- API -------------------------------------------------------------------------------

    def emit(
        self,
        event_type: str,
        payload: Mapping[str, Any],
        severity: str = "info",
        correlation_id: str | None = None,
    ) -> None:
        """Queue an event (durably, in the background)."""
        event = make_event(event_type, payload, severity, correlation_id, self._wallclock)
        n = self._next
        self._next += 1
        self._queue.append((n, event))
        self._trim()
        if self._log is not None:
            self._log.append({"n": n, "event": event}).addErrback(
                lambda f: self.log.failure("Could not store an event", failure=f)
            )
        if len(self._queue) >= BATCH_MAX:
            self.flush()
        else:
            self._schedule()

    @property
    def depth(self) -> int:
        return len(self._queue)

    def session_opened(self) -> None:
        self._inflight = []
        self.flush()

    def session_closed(self) -> None:
        self._inflight = []

    def frame_received(self, frame: dict[str, Any]) -> None:
        pass

    def flush(self) -> None:
        """
        Send the next batch if connected and none is awaiting confirmation. Not connected: the
        next connect flushes (L{session_opened}); a send refused while connected is tried again
        in C{flush_interval}.
        """
        self._cancel_flush()
        if self._inflight or not self._queue or not self.session.connected:
            return
        batch = [item for _, item in zip(range(BATCH_MAX), self._queue, strict=False)]
        numbers = [n for n, _ in batch]
        if not self.session.send({"type": "event_batch", "events": [e for _, e in batch]}):
            self._retry_later()
            return
        self._inflight = numbers
        confirm = self.session.confirm()
        if confirm is None:
            self._inflight = []
            self._retry_later()
            return
        confirm.addCallbacks(self._delivered, self._lost, callbackArgs=(numbers,), errbackArgs=(numbers,))

    def _delivered(self, _: object, numbers: list[int]) -> None:
        if self._inflight != numbers:
            return
        self._inflight = []
        upto = numbers[-1]
        while self._queue and self._queue[0][0] <= upto:
            self._queue.popleft()
        self.sent += len(numbers)
        self._acked_upto = max(self._acked_upto, upto)
        if self._log is not None:
            self._log.append({"ack": self._acked_upto, "dropped": self.dropped})
            if self._log.lines_written > 4 * len(self._queue) + 5000:
                self._compact()
        if self._queue:
            self.flush()

    def _lost(self, f: Any, numbers: list[int]) -> None:
        if self._inflight == numbers:
            self._inflight = []
            self._retry_later()

    def _retry_later(self) -> None:
        # Disconnected: session_opened flushes. Still connected (a refused send or confirm):
        # try again later rather than leave the events waiting for the next connect.
        if self.session.connected:
            self._schedule()

    def _trim(self) -> None:
        while len(self._queue) > self.capacity:
            n, event = self._queue.popleft()
            self.dropped += 1
            self._acked_upto = max(self._acked_upto, n)
            if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                self.log.warn(
                    "Event outbox full ({capacity}); dropped the oldest events ({dropped} so far)",
                    capacity=self.capacity,
                    dropped=self.dropped,
                )

    def _compact(self) -> Deferred[None]:
        assert self._log is not None
        lines: list[dict[str, Any]] = [{"ack": self._acked_upto, "dropped": self.dropped}]
        lines += [{"n": n, "event": e} for n, e in self._queue]
        return self._log.rewrite(lines)
