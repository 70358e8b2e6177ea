"""
HTTP plumbing of model delivery: a body receiver that hands a blob's bytes on in batches
with back-pressure, the byte budget shared by all downloads, C{Content-Range} parsing, and
small helpers for bodies that are not wanted.

The receiver never touches the disk: received buffers are collected (not copied) and
handed to its sink (L{llmport_agent.models.transfer.BlobTransfer}) in batches; while too
much waits for the disk or the hash the transport is paused, and resumed once that drains.
A body that stops flowing for C{idle_timeout} seconds (not counting pauses of our own) is
aborted.
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar
from typing import Protocol as TypingProtocol

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss

from llmport_agent.core.threads import BlockingRunner
from llmport_agent.core.values import frozen

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


class Retry(Exception):
    """A transient failure (network error, 5xx, interrupted body): back off and try again."""


class BodyTooLong(Exception):
    """The server sent more bytes than the blob can have."""


class SerialRunner:
    """
    Runs jobs on a L{BlockingRunner} strictly one after another, in submission order.
    Cancelling a returned Deferred only detaches the caller; the job still runs, and later
    jobs still wait for it (so C{close} never overtakes a C{write}).
    """

    log = Logger()

    def __init__(self, runner: BlockingRunner, *, tracker: Any = None) -> None:
        self._runner = runner
        self._tracker = tracker  # told enter() when a job is queued, leave() once it ran
        self._queue: deque[tuple[Callable[..., Any], tuple[Any, ...], Deferred[Any]]] = deque()
        self._busy = False

    @property
    def idle(self) -> bool:
        """True when no job is running or queued."""
        return not self._busy and not self._queue

    def run(self, fn: Callable[..., T], *args: Any) -> Deferred[T]:
        """Queue C{fn(*args)}; the Deferred fires with its result."""
        d: Deferred[T] = Deferred()
        if self._tracker is not None:
            self._tracker.enter()
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
            if self._tracker is not None:
                self._tracker.leave()

        job.addBoth(done)


class FlowBudget:
    """
    Bytes that every download of one syncer holds in memory (received, not yet written and
    hashed), bounded: while the budget is spent, a receiver whose bytes would only wait
    (they are beyond the point its blob's hash has reached) pauses its connection, and the
    receiver at a hash's frontier holds at most one batch - so memory stays under the
    budget plus one batch (and one socket read) per connection, and every download still
    progresses.
    """

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.used = 0
        self.peak = 0
        self._waiting: set[BlobBodyReceiver] = set()

    @property
    def spent(self) -> bool:
        return self.used >= self.limit

    def take(self, n: int) -> None:
        self.used += n
        if self.used > self.peak:
            self.peak = self.used

    def give(self, n: int) -> None:
        self.used -= n
        self.poke()

    def wait(self, receiver: BlobBodyReceiver) -> None:
        self._waiting.add(receiver)

    def forget(self, receiver: BlobBodyReceiver) -> None:
        self._waiting.discard(receiver)

    def poke(self) -> None:
        """Let paused receivers check whether they may go on."""
        if self._waiting:
            for receiver in list(self._waiting):
                receiver.check_resume()


class BatchSink(TypingProtocol):
    """Where a L{BlobBodyReceiver} hands its bytes (L{llmport_agent.models.transfer})."""

    def accept(self, receiver: BlobBodyReceiver, offset: int, chunks: list[bytes], n: int) -> None:
        """
        Take C{n} bytes (C{chunks}) at C{offset}. Call C{receiver.written(n)} once they are
        on disk, C{receiver.fail(failure)} if they cannot be written, and release their
        memory from the budget (C{budget.give}) once written and hashed.
        """

    def at_frontier(self, offset: int) -> bool:
        """Whether bytes at C{offset} would be hashed at once (nothing before them is missing)."""


class BlobBodyReceiver(Protocol):
    """
    Receives one response body: bytes C{[offset, offset + length)} of a blob.

    Received data is handed to the sink in batches of C{batch_size} bytes (the reactor only
    collects references to the buffers the transport delivered; nothing is copied or
    joined). The connection is paused while more than C{high_water} bytes of this body are
    waiting for the disk or the hash, or while the budget is spent and this body is ahead
    of the hash; it is resumed when that drains.

    L{done} fires with the number of bytes written once the wanted bytes are all on disk:
    when the body ends, or as soon as C{length} bytes arrived (a longer body - a server that
    ignored the end of a bounded range - is then cut off and C{overrun} is set). It fails
    with L{TransferInterrupted} when the body stopped early or stalled (everything received
    before that is written first, so a resume continues from C{offset + handed}), with
    L{BodyTooLong} when more than C{length} bytes came and C{at_eof} (they cannot belong to
    the blob), or with the sink's error (e.g. C{OSError} from a full disk). Cancelling it
    aborts the connection.
    """

    def __init__(
        self,
        reactor: ReactorTime,
        sink: BatchSink,
        budget: FlowBudget,
        offset: int,
        length: int,
        *,
        at_eof: bool = True,
        idle_timeout: float = 60.0,
        batch_size: int = 2 * 1024 * 1024,
        high_water: int = 16 * 1024 * 1024,
        hold: bool = False,
    ) -> None:
        self._reactor = reactor
        self._sink = sink
        self._budget = budget
        self.offset = offset
        self.length = length
        self._at_eof = at_eof
        self._idle_timeout = idle_timeout
        self._batch_size = batch_size
        self._high_water = high_water
        self._hold = hold
        self._pending: list[bytes] = []
        self._pending_len = 0
        self._received = 0
        self.handed = 0  # bytes handed to the sink (they will be written or fail the body)
        self._written = 0
        self._outstanding = 0  # received, not yet released (written and hashed)
        self._paused = False
        self._complete = False  # all wanted bytes received
        self.overrun = False
        self._shortened = False  # the response goes on past C{length} (L{shorten})
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

    @property
    def next_offset(self) -> int:
        """Offset of the first byte not yet handed to the sink."""
        return self.offset + self.handed

    # -- IProtocol ---------------------------------------------------------------------------

    def connectionMade(self) -> None:
        if self._hold:
            self._pause()
        self._schedule_idle(self._idle_timeout)

    def dataReceived(self, data: bytes) -> None:
        if self._error is not None or self._complete:
            return
        want = self.length - self._received
        if len(data) >= want:
            if len(data) > want:
                if self._at_eof:
                    self._fail(Failure(BodyTooLong(f"more than {self.length} bytes")))
                    return
                self.overrun = True
                data = data[:want]
            self._complete = True
        n = len(data)
        self._received += n
        self._last_data = self._reactor.seconds()
        if n:
            self._budget.take(n)
            self._outstanding += n
            self._pending.append(data)
            self._pending_len += n
        if self._complete:
            self._cancel_idle()
            self._flush()
            if (self.overrun or self._shortened) and self.transport is not None:
                self._producer.stopProducing()  # the rest is not ours: drop the connection
            self._maybe_finish()
            return
        if self._pending_len >= self._batch_size:
            self._flush()
        self.check_pause()

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:  # noqa: B008
        self._cancel_idle()
        self._budget.forget(self)
        if self._ended is None:
            self._ended = reason
        self._flush()
        self._maybe_finish()

    # -- flow control ------------------------------------------------------------------------

    def check_pause(self) -> None:
        if not self._paused and self._should_wait():
            self._pause()

    def check_resume(self) -> None:
        """Resume the connection if nothing holds it back any more (called by the budget)."""
        if not self._paused or self._hold or self._should_wait():
            return
        if self._ended is not None or self._error is not None or self._complete:
            self._budget.forget(self)
            return
        self._paused = False
        self._budget.forget(self)
        self._last_data = self._reactor.seconds()
        if self.transport is not None:
            self._producer.resumeProducing()

    @property
    def received(self) -> int:
        """Bytes of the body received so far (handed on or still pending)."""
        return self._received

    def shorten(self, length: int) -> bool:
        """
        Want only the first C{length} bytes of this body (more than have arrived): at that
        byte the body is complete and the connection is dropped, as for a server that sent
        more than was asked. Used to cut an open-ended stream where ranged requests take over.

        @return: whether the body was shortened (not when C{length} bytes have arrived, it
            already ended, or C{length} is not shorter).
        """
        if (length <= self._received or length >= self.length or self._complete
                or self._ended is not None or self._error is not None):
            return False
        self.length = length
        self._at_eof = False
        self._shortened = True
        return True

    def release_hold(self) -> None:
        """
        Start handing on a body that was delivered with C{hold=True} (bytes the HTTP client
        had already buffered arrive at once, and are kept until then).
        """
        self._hold = False
        if self._pending_len >= self._batch_size or self._complete or self._ended is not None:
            self._flush()
        self._maybe_finish()
        self.check_resume()

    def _should_wait(self) -> bool:
        if self._outstanding >= self._high_water:
            return True
        if not self._budget.spent:
            return False
        # The budget is spent: a body ahead of the hash waits; the one at the frontier may
        # still hold one batch (its bytes are hashed and freed next, so it always moves on).
        return (
            not self._sink.at_frontier(self.next_offset)
            or self._outstanding >= self._batch_size
        )

    def _pause(self) -> None:
        self._paused = True
        self._budget.wait(self)
        if self.transport is not None and self._ended is None:
            self._producer.pauseProducing()

    # -- the sink's side ---------------------------------------------------------------------

    def written(self, n: int) -> None:
        """C{n} handed bytes are on disk."""
        self._written += n
        self._maybe_finish()

    def released(self, n: int) -> None:
        """C{n} handed bytes are written and hashed (their memory is free)."""
        self._outstanding -= n
        self.check_resume()

    def fail(self, failure: Failure) -> None:
        """Writing failed: stop receiving; L{done} fails with C{failure}."""
        self._fail(failure)

    # -- internals ---------------------------------------------------------------------------

    def _flush(self) -> None:
        if not self._pending or self._error is not None or self._hold:
            return
        chunks, self._pending = self._pending, []
        n, self._pending_len = self._pending_len, 0
        offset = self.next_offset
        self.handed += n
        self._sink.accept(self, offset, chunks, n)

    def _drop_pending(self) -> None:
        if self._pending_len:
            self._budget.give(self._pending_len)
            self._outstanding -= self._pending_len
        self._pending = []
        self._pending_len = 0

    def _fail(self, failure: Failure) -> None:
        """Stop receiving; report C{failure} once the connection is gone."""
        if self._error is None:
            self._error = failure
        self._drop_pending()
        self._cancel_idle()
        self._budget.forget(self)
        if self._ended is None and not self._complete and self.transport is not None:
            self._producer.stopProducing()
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self.done.called:
            return
        if self._error is not None:
            if self._ended is not None or self._complete or self.transport is None:
                self.done.errback(self._error)
            return
        if self._pending or self._written < self.handed:
            return
        if self._complete:
            self.done.callback(self._written)
            return
        if self._ended is None:
            return
        if self._stalled is not None:
            self.done.errback(Failure(TransferInterrupted(self._stalled)))
        elif self._ended.check(ResponseDone, PotentialDataLoss) and self._received >= self.length:
            self.done.callback(self._written)
        else:
            why = (
                "the response ended before the range was complete"
                if self._ended.check(ResponseDone, PotentialDataLoss)
                else _describe(self._ended.value or Exception("connection lost"))
            )
            self.done.errback(Failure(TransferInterrupted(why)))

    def _cancel(self, d: Deferred[int]) -> None:
        self._error = self._error or Failure(CancelledError())
        self._drop_pending()
        self._cancel_idle()
        self._budget.forget(self)
        if self._ended is None and not self._complete and self.transport is not None:
            self._producer.stopProducing()

    def _schedule_idle(self, delay: float) -> None:
        self._idle_call = self._reactor.callLater(delay, self._idle_check)

    def _cancel_idle(self) -> None:
        call, self._idle_call = self._idle_call, None
        if call is not None and call.active():
            call.cancel()

    def _idle_check(self) -> None:
        self._idle_call = None
        if self._ended is not None or self._error is not None or self._complete:
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
    except (UnicodeDecodeError, ValueError, RecursionError):
        return ""
    detail = data.get("detail") if isinstance(data, dict) else None
    if isinstance(detail, str):
        return "".join(ch for ch in detail if ch.isprintable())[:200]
    return ""
