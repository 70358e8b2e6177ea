"""
HTTP plumbing of model delivery: a body receiver that streams a blob into a part file
through the blocking runner with back-pressure, C{Content-Range} parsing, and small helpers
for bodies that are not wanted.

The receiver never writes on the reactor thread: received chunks are batched and handed to
the runner one job at a time (L{SerialRunner}); when too much is waiting for the disk the
transport is paused, and resumed once the backlog drains. A body that stops flowing for
C{idle_timeout} seconds (not counting pauses of our own) is aborted.
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar
from typing import Protocol as TypingProtocol

from attrs import frozen
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss

from llmport_agent.models import _fs
from llmport_agent.threads import BlockingRunner

T = TypeVar("T")


class DelayedCall(TypingProtocol):
    """The part of L{twisted.internet.interfaces.IDelayedCall} used here."""

    def active(self) -> bool: ...

    def cancel(self) -> None: ...


class ReactorTime(TypingProtocol):
    """
    The part of L{twisted.internet.interfaces.IReactorTime} used here (a structural type,
    so mypy checks calls without the mypy-zope plugin).
    """

    def seconds(self) -> float: ...

    def callLater(
        self, delay: float, callable: Callable[..., Any], *args: Any, **kw: Any
    ) -> Any: ...


_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", re.IGNORECASE)


@frozen
class ContentRange:
    """A parsed C{Content-Range: bytes <start>-<end>/<total>} (total C{None} for C{*})."""

    start: int
    end: int
    total: int | None


def parse_content_range(value: str | bytes | None) -> ContentRange | None:
    """Parse a C{Content-Range} header value; C{None} when absent or malformed."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    m = _CONTENT_RANGE.match(value)
    if m is None:
        return None
    start, end = int(m.group(1)), int(m.group(2))
    total = None if m.group(3) == "*" else int(m.group(3))
    if end < start or (total is not None and end >= total):
        return None
    return ContentRange(start, end, total)


class TransferInterrupted(Exception):
    """The body stopped before it was complete (connection lost, stalled): resumable."""


class BodyTooLong(Exception):
    """The server sent more bytes than the blob can have."""


class SerialRunner:
    """
    Runs jobs on a L{BlockingRunner} strictly one after another, in submission order.
    Cancelling a returned Deferred only detaches the caller; the job still runs, and later
    jobs still wait for it (so C{close} never overtakes a C{write}).
    """

    log = Logger()

    def __init__(self, runner: BlockingRunner) -> None:
        self._runner = runner
        self._queue: deque[tuple[Callable[..., Any], tuple[Any, ...], Deferred[Any]]] = deque()
        self._busy = False

    @property
    def idle(self) -> bool:
        """True when no job is running or queued."""
        return not self._busy and not self._queue

    def run(self, fn: Callable[..., T], *args: Any) -> Deferred[T]:
        """Queue C{fn(*args)}; the Deferred fires with its result."""
        d: Deferred[T] = Deferred()
        self._queue.append((fn, args, d))
        self._next()
        return d

    def _next(self) -> None:
        if self._busy or not self._queue:
            return
        fn, args, d = self._queue.popleft()
        self._busy = True
        job = self._runner.run(fn, *args)

        def done(result: object) -> None:
            self._busy = False
            if not d.called:
                d.callback(result) if not isinstance(result, Failure) else d.errback(result)
            elif isinstance(result, Failure):
                self.log.failure(
                    "file job {job} failed after its caller went away", result, job=fn.__name__
                )
            self._next()

        job.addBoth(done)


class BlobBodyReceiver(Protocol):
    """
    Receives one response body into a part file.

    C{on_bytes(n)} is called as bytes reach the file (progress counts only what is on disk).

    L{done} fires with the number of bytes written when the body ended cleanly; it fails
    with L{TransferInterrupted} when the body was cut off or stalled (everything received
    before that is written first, so a resume continues from there), with L{BodyTooLong}
    when the server sent more than C{limit} bytes, or with the runner's error (e.g.
    C{OSError} from a full disk). Cancelling it aborts the connection.
    """

    def __init__(
        self,
        reactor: ReactorTime,
        serial: SerialRunner,
        part: _fs.PartFile,
        limit: int,
        on_bytes: Callable[[int], None],
        *,
        idle_timeout: float = 60.0,
        write_size: int = 1024 * 1024,
        high_water: int = 8 * 1024 * 1024,
    ) -> None:
        self._reactor = reactor
        self._serial = serial
        self._part = part
        self._limit = limit
        self._on_bytes = on_bytes
        self._idle_timeout = idle_timeout
        self._write_size = write_size
        self._high_water = high_water
        self._low_water = high_water // 4
        self._pending: list[bytes] = []
        self._pending_len = 0
        self._inflight_len = 0
        self._writing = False
        self._paused = False
        self._received = 0
        self._bytes_written = 0
        self._last_data = reactor.seconds()
        self._idle_call: DelayedCall | None = None
        self._ended: Failure | None = None
        self._error: Failure | None = None
        self._stalled: str | None = None
        self.done: Deferred[int] = Deferred(self._cancel)

    @property
    def _producer(self) -> Any:
        """The body transport: an L{IPushProducer} (C{TransportProxyProducer})."""
        return self.transport

    # -- IProtocol ---------------------------------------------------------------------------

    def connectionMade(self) -> None:
        self._schedule_idle(self._idle_timeout)

    def dataReceived(self, data: bytes) -> None:
        if self._error is not None or self.done.called:
            return
        self._received += len(data)
        if self._received > self._limit:
            self._fail(Failure(BodyTooLong(f"more than {self._limit} bytes")))
            return
        self._last_data = self._reactor.seconds()
        self._pending.append(data)
        self._pending_len += len(data)
        if self._pending_len >= self._write_size:
            self._flush()
        if not self._paused and self._pending_len + self._inflight_len >= self._high_water:
            self._paused = True
            assert self.transport is not None
            self._producer.pauseProducing()

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:  # noqa: B008
        self._cancel_idle()
        if self._ended is None:
            self._ended = reason
        self._flush()
        self._maybe_finish()

    # -- internals ---------------------------------------------------------------------------

    def _flush(self) -> None:
        if self._writing or not self._pending or self._error is not None:
            return
        chunks, self._pending = self._pending, []
        self._inflight_len, self._pending_len = self._pending_len, 0
        self._writing = True
        self._serial.run(_fs.write_chunks, self._part, chunks).addCallbacks(
            self._written, self._write_failed
        )

    def _written(self, _offset: int) -> None:
        self._writing = False
        self._bytes_written += self._inflight_len
        written, self._inflight_len = self._inflight_len, 0
        self._on_bytes(written)
        if self._pending_len >= self._write_size or (self._ended is not None and self._pending):
            self._flush()
        # Resume once what is not yet handed to the disk is small again; the batch being
        # written overlaps with the next bytes arriving.
        if (
            self._paused
            and self._ended is None
            and self._error is None
            and self._pending_len < self._low_water
        ):
            self._paused = False
            self._last_data = self._reactor.seconds()
            assert self.transport is not None
            self._producer.resumeProducing()
        self._maybe_finish()

    def _write_failed(self, failure: Failure) -> None:
        self._writing = False
        self._inflight_len = 0
        self._fail(failure)

    def _fail(self, failure: Failure) -> None:
        """Stop receiving; report C{failure} once pending writes are settled."""
        if self._error is None:
            self._error = failure
        self._pending = []
        self._pending_len = 0
        self._cancel_idle()
        if self._ended is None and self.transport is not None:
            self._producer.stopProducing()
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self.done.called or self._writing:
            return
        if self._error is not None:
            if self._ended is not None or self.transport is None:
                self.done.errback(self._error)
            return
        if self._ended is None or self._pending:
            return
        if self._stalled is not None:
            self.done.errback(Failure(TransferInterrupted(self._stalled)))
        elif self._ended.check(ResponseDone, PotentialDataLoss):
            self.done.callback(self._bytes_written)
        else:
            self.done.errback(
                Failure(
                    TransferInterrupted(
                        _describe(self._ended.value or Exception("connection lost"))
                    )
                )
            )

    def _cancel(self, d: Deferred[int]) -> None:
        self._error = self._error or Failure(CancelledError())
        self._pending = []
        self._cancel_idle()
        if self._ended is None and self.transport is not None:
            self._producer.stopProducing()

    def _schedule_idle(self, delay: float) -> None:
        self._idle_call = self._reactor.callLater(delay, self._idle_check)

    def _cancel_idle(self) -> None:
        call, self._idle_call = self._idle_call, None
        if call is not None and call.active():
            call.cancel()

    def _idle_check(self) -> None:
        self._idle_call = None
        if self._ended is not None or self._error is not None:
            return
        now = self._reactor.seconds()
        if self._paused:
            self._schedule_idle(self._idle_timeout)
            return
        quiet = now - self._last_data
        if quiet < self._idle_timeout:
            self._schedule_idle(self._idle_timeout - quiet)
            return
        # Keep what arrived (it is written before done fires) and drop the connection.
        self._stalled = f"no data for {self._idle_timeout:g} seconds"
        if self.transport is not None:
            self._producer.stopProducing()


def _describe(exc: BaseException) -> str:
    """A short human description of a network error (never includes request headers)."""
    reasons = getattr(exc, "reasons", None)
    if reasons:
        inner = reasons[0]
        value = getattr(inner, "value", inner)
        return f"{type(exc).__name__}: {type(value).__name__}: {value}"[:300]
    return f"{type(exc).__name__}: {exc}"[:300]


describe_error = _describe


class _Limited(Protocol):
    """
    Reads up to C{limit} bytes of a body. More than that is dropped with the connection and
    C{done} fires with the first C{limit} bytes; a body cut off before its end fails
    C{done} with L{TransferInterrupted}.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._buf: list[bytes] = []
        self._size = 0
        self._stopped = False
        self.done: Deferred[bytes] = Deferred()

    def connectionMade(self) -> None:
        if self._limit <= 0:
            self._stop()

    def dataReceived(self, data: bytes) -> None:
        if self._stopped:
            return
        self._buf.append(data)
        self._size += len(data)
        if self._size >= self._limit:
            self._stop()

    def _stop(self) -> None:
        self._stopped = True
        transport: Any = self.transport
        if transport is not None:
            transport.stopProducing()

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:  # noqa: B008
        if self.done.called:
            return
        if self._stopped or reason.check(ResponseDone, PotentialDataLoss):
            self.done.callback(b"".join(self._buf)[: max(self._limit, 0)])
        else:
            self.done.errback(
                Failure(
                    TransferInterrupted(_describe(reason.value or Exception("connection lost")))
                )
            )


def read_limited(response: Any, limit: int) -> Deferred[bytes]:
    """Read at most C{limit} bytes of C{response}'s body (more is dropped with the connection)."""
    proto = _Limited(limit)
    response.deliverBody(proto)
    return proto.done


def read_small(response: Any, limit: int = 4096) -> Deferred[bytes]:
    """Read up to C{limit} bytes of an unwanted (error) body; any failure reads as C{b""}."""
    return read_limited(response, limit).addErrback(lambda _: b"")


def abandon(response: Any) -> None:
    """Drop a response whose body is not wanted (aborts its connection)."""
    read_small(response, 0)


def detail_of(body: bytes) -> str:
    """The backend's C{{"detail": "..."}} message, if the body is one, else C{""}."""
    try:
        data = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return ""
    detail = data.get("detail") if isinstance(data, dict) else None
    if isinstance(detail, str):
        return "".join(ch for ch in detail if ch.isprintable())[:200]
    return ""
