"""
One blob from the backend into its part file: a single stream or several ranged connections.

The pipeline keeps the socket, the disk and the hash busy at the same time. The reactor
only collects the buffers the transport delivers and hands them on in batches; each batch
is written with one C{pwritev} at its offset (a serial job of the blob's writer) and fed to
the running sha256 (a serial job of the blob's hasher, in offset order) - the same buffer
objects, no copy, and the file is never read back (its written pages leave the page cache
32 MiB behind the writes). The part file is fsynced once, at the end.

Ranged mode (a large sha256 blob, C{connections > 1}): the blob's missing bytes are cut into
segments of C{segment_size} bytes, fetched with bounded C{Range: bytes=s-e} requests by up to
C{connections} workers. Segments are handed out in order, so the workers stay close to the
hash's frontier: bytes ahead of it wait in memory (bounded by the syncer's L{FlowBudget};
a receiver ahead of the frontier pauses while the budget is spent, the one at the frontier
never does) until the hash reaches them. Progress per range is kept in C{<hash>.progress},
so an interrupted range - in this run or after a restart - resumes where it stopped. The
adaptive setting (L{ConnectionScaler}) starts as one open-ended stream; when it adds a
connection, the stream is cut at a segment boundary and ranged requests take the rest. While
the backend's C{Range} support is not known yet, one request for a single byte
(C{bytes=n-n}) beside the stream confirms it first: only its C{206} lets the stream be cut;
any other answer (C{200}, C{416}, an error, a dropped connection) costs that request alone,
and the stream goes on to the end of the blob with nothing lost.

Fallbacks: a server that answers a bounded range with more than was asked (it ignored the
end) gets exactly the wanted bytes read and the connection dropped, and from then on one
open-ended stream (C{bytes=s-}) for the rest of this blob and every later one; a server
that answers C{Range} with C{200} (ignores ranges altogether) makes the blob start over
from zero as one stream (a fixed count of connections, or a stream resumed from an offset; the
adaptive setting's confirmation never does).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmport_agent.commands.base import CommandFailed
from llmport_agent.core.values import define, frozen
from llmport_agent.models import _fs
from llmport_agent.models._http import (
    BlobBodyReceiver,
    BodyTooLong,
    FlowBudget,
    Retry,
    SerialRunner,
    TransferInterrupted,
    abandon,
    describe_error,
    parse_content_range,
    read_limited,
)
from llmport_agent.models._jobs import run_together
from llmport_agent.models.errors import CHECKSUM_MISMATCH, DOWNLOAD_FAILED
from llmport_agent.models.manifest import BlobSpec

#: Progress records are rewritten after this many newly written bytes.
CHECKPOINT_BYTES = 64 * 1024 * 1024
#: How often one blob may start over from zero (server ignoring Range, spliced content).
MAX_START_OVERS = 3


class Ranges:
    """A set of byte offsets as sorted, merged, half-open C{[a, b)} ranges."""

    def __init__(self, ranges: list[tuple[int, int]] | None = None) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        for a, b in ranges or []:
            self.add(a, b)

    def __bool__(self) -> bool:
        return bool(self._starts)

    def __iter__(self) -> Any:
        return iter(zip(self._starts, self._ends, strict=True))

    def items(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))

    @property
    def total(self) -> int:
        return sum(b - a for a, b in self)

    def add(self, a: int, b: int) -> None:
        if b <= a:
            return
        i = bisect.bisect_left(self._ends, a)  # first range that ends at or after a
        j = bisect.bisect_right(self._starts, b)  # ranges starting after b are untouched
        if i < j:
            a = min(a, self._starts[i])
            b = max(b, self._ends[j - 1])
        self._starts[i:j] = [a]
        self._ends[i:j] = [b]

    def pop_first(self, limit: int | None) -> tuple[int, int] | None:
        """Remove and return the first C{limit} bytes (or the whole first range)."""
        if not self._starts:
            return None
        a, b = self._starts[0], self._ends[0]
        if limit is not None and b - a > limit:
            self._starts[0] = a + limit
            return a, a + limit
        del self._starts[0], self._ends[0]
        return a, b

    def starting_at(self, offset: int) -> tuple[int, int] | None:
        """The range that begins exactly at C{offset}, if any."""
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and self._starts[i] == offset:
            return self._starts[i], self._ends[i]
        return None


@frozen
class CpuSample:
    """Running CPU counters, read at the edges of a L{ConnectionScaler} window."""

    #: CPU-seconds this process has used, all threads together.
    process: float
    #: CPU-seconds the host's CPUs have been idle, all together (C{None}: not known).
    idle: float | None
    #: CPUs of the host.
    cpus: int


_CLK_TCK: int | None = None


def read_cpu() -> CpuSample:
    """
    This process's CPU time (C{os.times}) and the host's idle time (the first line of
    C{/proc/stat}: idle and iowait; a read of a few hundred bytes from procfs, no disk).
    """
    global _CLK_TCK
    t = os.times()
    idle: float | None = None
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
        if _CLK_TCK is None:
            _CLK_TCK = os.sysconf("SC_CLK_TCK")
        if fields[:1] == [b"cpu"] and len(fields) > 5:
            idle = (int(fields[4]) + int(fields[5])) / _CLK_TCK
    except (OSError, ValueError):
        idle = None
    return CpuSample(t.user + t.system, idle, os.cpu_count() or 1)


class ConnectionScaler:
    """
    How many connections one blob should use, learnt while it arrives: start with one,
    let a first window pass unmeasured (C{warmup}), then double while there is CPU to
    spare for more and the last step made the blob arrive at least C{gain} times as fast
    (over a window of C{window_bytes} and C{min_seconds}); settle on the best count as soon
    as a step does not pay or the CPU is the limit.

    An extra connection helps where each connection is held to a rate by something outside
    this host (a link, a proxy or a server that limits each connection). Where this host's
    CPU is the limit (the reactor, the hash, the server on the same machine), it only adds
    work - more requests, bytes held out of order, more wake-ups - and makes the blob slower
    (4 GiB over loopback on 2 cores: 0.68x of curl with two connections, 0.89x with one).
    So after each measured window it compares the host's idle CPU with what this process
    used: doubling the connections would need about as much CPU again; with less than
    C{cpu_share} of that idle, the CPU and not the link is the limit, and the count stays.

    L{observe} takes the clock and the bytes written so far; the CPU counters come from
    C{cpu} (L{read_cpu}, or a fake), read only at the edges of a window (without them only
    the rates decide).
    """

    def __init__(self, maximum: int, window_bytes: int, *, min_seconds: float = 0.5,
                 gain: float = 1.2, start: int = 1, warmup: bool = True,
                 cpu: Callable[[], CpuSample | None] | None = None,
                 cpu_share: float = 0.5, min_idle: float = 0.1) -> None:
        self.maximum = max(1, maximum)
        self.allowed = min(self.maximum, max(1, start))
        self.settled = self.allowed >= self.maximum
        #: Why it settled (a short phrase for the log), once it has.
        self.reason = "the maximum" if self.settled else ""
        #: The last measured window: (bytes per second, this process's CPUs busy, host CPUs
        #: idle or C{None}).
        self.last: tuple[float, float | None, float | None] | None = None
        self._window = window_bytes
        self._min_seconds = min_seconds
        self._gain = gain
        self._cpu = cpu
        self._cpu_share = cpu_share
        self._min_idle = min_idle
        self._t0: float | None = None
        self._b0 = 0
        self._c0: CpuSample | None = None
        self._best: tuple[float, int] | None = None  # (rate, connections)
        # The first window is not measured: it holds the first request, TCP's slow start and
        # the process's first buffers, and made one connection look slower than it is (a
        # second one then "paid" on loopback, where it only costs CPU).
        self._warming = warmup

    def restart_window(self, now: float, total: int) -> None:
        self._t0, self._b0 = now, total
        self._c0 = self._cpu() if self._cpu is not None else None

    def _cpu_room(self, elapsed: float, cpu: CpuSample | None) -> tuple[bool, float | None,
                                                                         float | None]:
        """Whether the host has the CPU for twice the connections; (room, busy, idle)."""
        c0 = self._c0
        if cpu is None or c0 is None or elapsed <= 0:
            return True, None, None
        busy = max(0.0, (cpu.process - c0.process) / elapsed)
        if cpu.idle is not None and c0.idle is not None:
            idle = max(0.0, (cpu.idle - c0.idle) / elapsed)
        else:  # nothing known of the others: assume this process is alone
            idle = max(0.0, cpu.cpus - busy)
        return idle >= max(self._min_idle, self._cpu_share * busy), busy, idle

    def _settle(self, reason: str) -> None:
        self.settled = True
        self.reason = reason

    def stop_at_one(self, reason: str) -> None:
        """Settle on one connection whatever the windows say (more cannot be used)."""
        self.allowed = 1
        self._settle(reason)

    def observe(self, now: float, total: int) -> int | None:
        """@return: the new number of connections, when it changes."""
        if self.settled:
            return None
        if self._t0 is None:
            self.restart_window(now, total)
            return None
        elapsed, got = now - self._t0, total - self._b0
        if got < self._window or elapsed < self._min_seconds:
            return None
        rate = got / elapsed
        sample = self._cpu() if self._cpu is not None else None
        room, busy, idle = self._cpu_room(elapsed, sample)
        self.last = (rate, busy, idle)
        self._t0, self._b0, self._c0 = now, total, sample
        if self._warming:
            self._warming = False
            return None
        if self._best is None or rate >= self._best[0] * self._gain:
            self._best = (rate, self.allowed)
            if self.allowed >= self.maximum:
                self._settle("the maximum")
                return None
            if not room:
                self._settle("the CPU is the limit")
                return None
            self.allowed = min(self.maximum, self.allowed * 2)
            return self.allowed
        self._settle("the last step did not pay")
        if self.allowed != self._best[1]:
            self.allowed = self._best[1]
            return self.allowed
        return None


class _StartOver(Exception):
    """The blob must be fetched again from zero as one stream (the reason is the message)."""


@define(eq=False)
class _Batch:
    offset: int
    chunks: list[bytes]
    n: int
    receiver: BlobBodyReceiver
    waiting: int  # jobs (write, hash) still to finish before its memory is free


class ProgressSink(Protocol):
    """Where a transfer counts the bytes it wrote (or takes back, when it starts over)."""

    def add(self, n: int) -> None: ...

    def rewind(self, n: int) -> None: ...


class TransferRun(Protocol):
    """
    The sync a transfer belongs to: what it reports into and what the first large blob
    learnt for the later ones. The syncer's run record provides it.
    """

    retries: int
    range_ignored: int
    range_end_ignored: int
    learned_connections: int | None

    @property
    def label(self) -> str: ...

    @property
    def progress(self) -> ProgressSink: ...


class RangeSupport:
    """
    What one backend has shown about C{Range}: C{bounded} is C{None} until a bounded
    request is answered, then whether the server honours the end of a range. Owned by the
    syncer and shared by all its transfers, so one blob's discovery holds for the next.
    """

    def __init__(self) -> None:
        self.bounded: bool | None = None


@frozen
class TransferSettings:
    """How a syncer fetches blobs (fixed for the syncer's lifetime)."""

    #: Most connections per blob.
    connections: int
    #: Whether the count is learnt per sync (L{ConnectionScaler}) or fixed at C{connections}.
    adaptive: bool
    segment_size: int
    batch_size: int
    #: Bytes one open-ended stream may hold in memory ahead of the hash.
    stream_high_water: int
    idle_timeout: float
    #: Failed attempts in a row before one connection gives up.
    retry_max: int


@frozen
class BlobSource:
    """
    Everything a L{BlobTransfer} needs from the one that drives it, passed in: the clock,
    the settings, the shared range knowledge, the flow budget and the few requests it makes.
    The transfer knows nothing else of its syncer (and does not import it).
    """

    reactor: Any
    settings: TransferSettings
    ranges: RangeSupport
    budget: FlowBudget
    #: The request headers (credential included); raises L{CommandFailed} without one.
    headers: Callable[[], dict[bytes | str, bytes | str]]
    #: One GET of a URL with headers; raises L{Retry} on a transient failure.
    get: Callable[[str, dict[bytes | str, bytes | str]], Awaitable[Any]]
    #: Turns a non-success response into L{Retry} or L{CommandFailed} (never returns).
    refuse: Callable[[Any, str], Awaitable[None]]
    #: Waits before retry C{failures} of C{what}, or raises once there were too many.
    pause: Callable[[int, str, str], Awaitable[None]]
    #: Counts bytes received from the backend (all syncs together).
    downloaded: Callable[[int], None]
    #: CPU counters for the connection scaler (L{read_cpu}).
    cpu: Callable[[], CpuSample | None] = read_cpu


class BlobTransfer:
    """
    Fetches the missing bytes of one blob into its open part file, then verifies and
    renames it. The syncer creates one per attempt at a blob.
    """

    log = Logger()

    def __init__(
        self,
        source: BlobSource,
        run: TransferRun,
        blob: BlobSpec,
        url: str,
        part: _fs.PartFile,
        writer: SerialRunner,
        hasher: SerialRunner,
    ) -> None:
        self._source = source
        self._settings = source.settings
        self._ranges = source.ranges
        self._reactor = source.reactor
        self._run = run
        self._blob = blob
        self._part = part
        self._writer = writer
        self._hasher = hasher
        self._budget = source.budget
        self.what = f"blob {blob.hash} of {run.label}"
        self._url = url
        self._start_state()
        self.start_overs = 0
        self._write_error: Failure | None = None
        self._active = 0
        self._streamer: int | None = None
        self._stream: tuple[_Attempt, BlobBodyReceiver] | None = None  # the open-ended one
        self._confirming: Deferred[None] | None = None  # the request that confirms Range
        self._gate: list[Deferred[None]] = []
        self._waiting = 0
        self.found = ""
        self.stamp: _fs.Stamp | None = None
        self.connections_used = 1
        settings = self._settings
        learned = run.learned_connections
        self._scaler = ConnectionScaler(
            settings.connections if settings.adaptive else 1,
            2 * settings.segment_size,
            start=learned or 1,
            cpu=source.cpu,
        )
        if not settings.adaptive or learned:
            self._scaler.settled = True

    # -- state ------------------------------------------------------------------------------

    def _start_state(self) -> None:
        blob, part = self._blob, self._part
        self.done = Ranges(list(part.done))  # written (resumed + this run)
        self._disk = Ranges(list(part.done))  # on disk but never seen: hashed from the file
        missing = Ranges([(0, blob.size)] if blob.size else [])
        gaps = Ranges()
        pos = 0
        for a, b in self.done:
            gaps.add(pos, a)
            pos = b
        gaps.add(pos, blob.size)
        self._missing = gaps if self.done else missing
        self._hash_next = 0
        self._held: dict[int, _Batch] = {}
        self._since_checkpoint = 0
        self.spliced = bool(self.done)  # content from more than one response
        self._drain()

    @property
    def _rangeable(self) -> bool:
        """Whether this blob may be fetched with several bounded requests."""
        s = self._settings
        return (
            self._part.tracked
            and s.connections > 1
            and self._ranges.bounded is not False
            and self._blob.size >= 2 * s.segment_size
            and not self._stream_only
        )

    @property
    def ranged(self) -> bool:
        """
        Several bounded requests for this blob (else one open-ended stream). The adaptive
        setting fetches as one stream while it allows one connection (a bounded request per
        segment costs a round trip and a drained pipeline at each end); when it adds one
        and the backend has shown that it honours bounded ranges (L{_confirm_range}), the
        stream is cut at a segment boundary and ranged requests take the rest.
        """
        if not self._rangeable:
            return False
        if not self._settings.adaptive:
            return True
        # Adaptive: only once more than one is wanted and the backend has shown that it
        # honours bounded ranges (until then a cut stream could not be fetched as ranges).
        return self._scaler.allowed > 1 and self._ranges.bounded is True

    @property
    def _may_grow(self) -> bool:
        """Whether the adaptive setting may still add connections to this blob."""
        return self._settings.adaptive and not self._scaler.settled and self._rangeable

    _stream_only = False

    # -- the sink for receivers ----------------------------------------------------------------

    def at_frontier(self, offset: int) -> bool:
        return self._part.hasher is None or offset <= self._hash_next

    def accept(self, receiver: BlobBodyReceiver, offset: int, chunks: list[bytes], n: int) -> None:
        hashing = self._part.hasher is not None
        batch = _Batch(offset, chunks, n, receiver, 2 if hashing else 1)
        self._writer.run(_fs.write_batch, self._part, offset, chunks).addCallbacks(
            self._written, self._job_failed, callbackArgs=(batch,), errbackArgs=(batch,)
        )
        if hashing:
            if offset == self._hash_next:
                self._hash(batch)
                self._drain()
            else:
                self._held[offset] = batch
        if self._part.hasher is not None:
            self._budget.poke()

    def _hash(self, batch: _Batch) -> None:
        self._hash_next = batch.offset + batch.n
        self._hasher.run(_fs.hash_batch, self._part, batch.chunks).addCallbacks(
            self._settled, self._job_failed, callbackArgs=(batch,), errbackArgs=(batch,)
        )

    def _drain(self) -> None:
        """Feed the hash whatever is now contiguous with its frontier."""
        if self._part.hasher is None:
            return
        while True:
            batch = self._held.pop(self._hash_next, None)
            if batch is not None:
                self._hash(batch)
                continue
            region = self._disk.starting_at(self._hash_next)
            if region is not None:
                a, b = region
                self._hash_next = b
                self._hasher.run(_fs.hash_region, self._part, a, b).addErrback(self._hash_failed)
                continue
            break

    def _written(self, _n: int, batch: _Batch) -> None:
        self.done.add(batch.offset, batch.offset + batch.n)
        self._source.downloaded(batch.n)
        self._run.progress.add(batch.n)
        if not self._scaler.settled and self._rangeable and self._confirming is None:
            self._scale(self._scaler.observe(self._reactor.seconds(), self.done.total))
        batch.receiver.written(batch.n)
        self._since_checkpoint += batch.n
        if self._since_checkpoint >= CHECKPOINT_BYTES and self._part.tracked:
            self._since_checkpoint = 0
            self._writer.run(_fs.save_progress, self._part, self.done.items()).addErrback(
                lambda f: self.log.failure("Could not record download progress", f)
            )
        self._settled(None, batch)

    def _settled(self, _result: object, batch: _Batch) -> None:
        batch.waiting -= 1
        if batch.waiting == 0:
            batch.chunks = []
            self._budget.give(batch.n)
            batch.receiver.released(batch.n)

    def _job_failed(self, failure: Failure, batch: _Batch) -> None:
        if self._write_error is None:
            self._write_error = failure
        batch.receiver.fail(failure)
        self._settled(None, batch)

    def _hash_failed(self, failure: Failure) -> None:
        if self._write_error is None:
            self._write_error = failure

    def _scale(self, allowed: int | None) -> None:
        scaler = self._scaler
        if allowed is not None:
            self.log.debug("{what}: {n} connections (last window {window})", what=self.what,
                           n=allowed, window=_describe(scaler.last))
            if allowed > 1 and self._ranges.bounded is None:
                # Not known yet whether ranged requests work here: confirm that first,
                # beside the stream, which goes on untouched meanwhile.
                d = Deferred.fromCoroutine(self._confirm_range())
                if not d.called:  # (a fake client may answer at once)
                    self._confirming = d
                return
        self._note_settled()
        if allowed is not None:
            self._grow(allowed)

    def _note_settled(self) -> None:
        """Once the scaler has settled, later blobs of this sync start at its count."""
        scaler = self._scaler
        if scaler.settled and self._settings.adaptive:
            self._run.learned_connections = scaler.allowed
            self.log.debug("{what}: settled on {n} connections ({reason}; last window "
                           "{window})", what=self.what, n=scaler.allowed, reason=scaler.reason,
                           window=_describe(scaler.last))

    def _grow(self, allowed: int) -> None:
        self.connections_used = max(self.connections_used, allowed)
        if allowed > 1:
            self._cut_stream()
        self._open_gate()

    async def _confirm_range(self) -> None:
        """
        Ask for one byte with a bounded C{Range} beside the running stream (the first byte
        after the point where the stream would be cut now, so that a server ignoring the end
        of a range shows it). A C{206} with exactly that byte: the backend honours bounded
        ranges, the stream is cut and the extra connections start. Anything else - C{200}, a C{206} with more than the byte,
        C{416}, another status, an error - costs this request alone: the blob stays one
        stream to its end (a C{200} or an ignored end are remembered for later blobs too).
        """
        source = self._source
        blob = self._blob
        n = min(self._cut_point(), blob.size - 2)
        failed = ""
        cancelled = False
        response: Any = None
        try:
            headers = source.headers()
            headers["Range"] = f"bytes={n}-{n}"
            response = await source.get(self._url, headers)
            code = response.code
            if code == 206:
                header = response.headers.getRawHeaders("content-range") or [None]
                cr = parse_content_range(header[0])
                if (cr is not None and cr.start == n and cr.end > n
                        and (cr.total is None or cr.total == blob.size)):
                    abandon(response)
                    response = None
                    self._ignored_end(f"Content-Range {header[0]}")
                    failed = "the backend ignores the end of bounded ranges"
                elif (cr is None or cr.start != n or cr.end != n
                        or (cr.total is not None and cr.total != blob.size)):
                    failed = f"unusable Content-Range {header[0]!r}"
                else:
                    reading, response = read_limited(response, 2), None
                    body = await reading.addTimeout(self._settings.idle_timeout, self._reactor)
                    if len(body) != 1:
                        failed = f"{len(body)} bytes for a range of one"
            elif code == 200:
                self._run.range_ignored += 1
                self._ranges.bounded = False  # no ranged requests to this server again
                self.log.info("The backend ignores Range ({blob}); downloading as one stream",
                              blob=blob.hash)
                failed = "the backend ignores Range"
            else:
                failed = f"HTTP {code} for a ranged request"
        except CancelledError:
            cancelled = True
        except Exception as e:  # noqa: BLE001 - any failure here only stops the growth
            failed = describe_error(e)
        finally:
            if response is not None:
                abandon(response)
            self._confirming = None
        if cancelled:
            return
        if failed:
            self._scaler.stop_at_one(f"ranged requests unusable: {failed}")
            self.log.debug("{what}: one connection ({reason})", what=self.what,
                           reason=self._scaler.reason)
            self._open_gate()  # the workers waiting for more connections leave
            return
        self._ranges.bounded = True
        if not self._rangeable or (self._stream is None and not self._missing):
            return  # the blob started over, or has all come, meanwhile
        self._scaler.restart_window(self._reactor.seconds(), self.done.total)
        self._note_settled()
        self._grow(self._scaler.allowed)

    def _stop_confirming(self) -> None:
        """Cancel the request that confirms Range (the blob is fetched, or starts over)."""
        d, self._confirming = self._confirming, None
        if d is not None:
            d.cancel()

    def _cut_stream(self) -> None:
        """
        End the open-ended stream at the first segment boundary beyond what it has received
        (and one batch more); the bytes after it go back to be fetched as ranges.
        """
        if self._stream is None:
            return
        attempt, receiver = self._stream
        cut = self._cut_point()
        if cut < attempt.end and receiver.shorten(cut - receiver.offset):
            self._missing.add(cut, attempt.end)
            attempt.end = attempt.end_asked = cut
            self._stream = None

    def _cut_point(self) -> int:
        """The first segment boundary beyond what the stream has received, and a batch more."""
        if self._stream is None:
            return 0
        receiver = self._stream[1]
        seg = self._settings.segment_size
        here = receiver.offset + receiver.received + self._settings.batch_size
        return -(-here // seg) * seg

    def _open_gate(self) -> None:
        gate, self._gate = self._gate, []
        for d in gate:
            if not d.called:
                d.callback(None)

    def _connections_now(self) -> int:
        """Workers allowed to fetch now (the rest wait at the gate)."""
        if not self.ranged:
            return 1
        return self._scaler.allowed if self._settings.adaptive else self._settings.connections

    def _release_held(self) -> None:
        held, self._held = self._held, {}
        for batch in held.values():
            batch.waiting -= 1  # its hash will never run
            if batch.waiting == 0:
                self._budget.give(batch.n)
                batch.receiver.released(batch.n)

    # -- running ------------------------------------------------------------------------------

    async def run(self) -> bool:
        """
        Fetch every missing byte; then hash, fsync, verify and rename.

        @return: whether the blob is in place (C{False}: it failed verification and was
            removed; the caller decides whether to try again).
        @raise CommandFailed: C{download_failed}, C{checksum_mismatch}.
        @raise OSError: the store could not be written.
        """
        try:
            while True:
                try:
                    await self._fetch_all()
                    break
                except _StartOver as e:
                    await self._start_over(str(e))
            self._stop_confirming()
            # Every receiver has seen its writes done (or failed); the digest comes after
            # every hash job, and finishing after every write.
            if self._missing or self.done.total != self._blob.size:
                raise CommandFailed(DOWNLOAD_FAILED, f"Could not fetch all of {self.what}.")
            assert self._hash_next == self._blob.size or self._part.hasher is None
            digest = await self._hasher.run(_fs.digest_of, self._part)
            if self._write_error is not None:
                self._write_error.raiseException()
            ok, found, stamp = await self._writer.run(_fs.finish_part, self._part, digest)
        finally:
            self._stop_confirming()
            self._release_held()
        self.found = found
        self.stamp = stamp
        return ok

    def _count_start_over(self, reason: str) -> None:
        self.start_overs += 1
        if self.start_overs > MAX_START_OVERS:
            raise CommandFailed(
                DOWNLOAD_FAILED,
                f"Could not fetch {self.what}: it had to start over {MAX_START_OVERS} times "
                f"(last: {reason}).",
            )

    async def _start_over(self, reason: str) -> None:
        self._count_start_over(reason)
        self.log.info("Downloading {blob} from the start: {reason}", blob=self._blob.hash,
                      reason=reason)
        await self._reset()

    async def _reset(self) -> None:
        """Empty the part file once this blob's jobs are done; go on as one stream."""
        self._stop_confirming()
        await self._writer.run(_noop)
        await self._hasher.run(_noop)
        self._release_held()
        self._run.progress.rewind(self.done.total)
        await self._writer.run(_fs.reset_part, self._part)
        self._stream_only = True
        self._start_state()

    async def _fetch_all(self) -> None:
        """Run the workers until nothing is missing (or one fails)."""
        while self._missing:
            workers = 1
            if self._rangeable:  # the adaptive stream's workers wait until they are wanted
                segments = -(-self._missing.total // self._settings.segment_size)
                workers = max(1, min(self._settings.connections, segments))
            self._active = workers
            if self.ranged:  # a fixed count opens them all at once; the adaptive one, as it learns
                self.connections_used = max(self.connections_used,
                                            min(workers, self._connections_now()))
            self._streamer = None
            if self._may_grow:
                self._scaler.restart_window(self._reactor.seconds(), self.done.total)
            await run_together(self._worker(i) for i in range(workers))
            # Bytes may still be missing: put back by a worker after the others had stopped
            # (a switch to one stream), or left by connections that gave up.

    def _take(self, worker: int) -> tuple[int, int] | None:
        if self.ranged:
            return self._missing.pop_first(self._settings.segment_size)
        # One open-ended stream: one worker takes whole gaps, the others stop.
        if self._streamer is None:
            self._streamer = worker
        if self._streamer != worker:
            return None
        return self._missing.pop_first(None)

    async def _worker(self, worker: int) -> None:
        failures = 0
        try:
            while True:
                if worker >= self._connections_now():
                    # Not needed (yet): wait until the scaler wants more connections, or
                    # until the others are done (nobody else fetching: the outer loop
                    # starts again for whatever is still missing).
                    if self._fetching() <= 1 or (not self._missing and not self._may_grow):
                        return
                    d: Deferred[None] = Deferred()
                    self._gate.append(d)
                    self._waiting += 1
                    try:
                        await d
                    finally:
                        self._waiting -= 1
                    continue
                interval = self._take(worker)
                if interval is None:
                    break
                attempt = _Attempt(*interval)
                try:
                    await self._fetch_interval(attempt)
                    failures = 0
                except Retry as e:
                    self._run.retries += 1
                    failures = 1 if attempt.progressed else failures + 1
                    if failures > self._settings.retry_max and self._fetching() > 1:
                        self.log.info(
                            "Giving up one connection for {what} after {n} failed attempts "
                            "({reason}); {left} others go on",
                            what=self.what, n=failures, reason=str(e), left=self._active - 1,
                        )
                        return
                    await self._source.pause(failures, self.what, str(e))
                finally:
                    if attempt.next < attempt.end_asked:
                        self._missing.add(attempt.next, attempt.end_asked)
        finally:
            self._active -= 1
            if self._streamer == worker:
                self._streamer = None
            self._open_gate()  # waiting workers look again: the work may be theirs now

    def _fetching(self) -> int:
        """Workers fetching (not waiting at the gate)."""
        return self._active - self._waiting

    async def _fetch_interval(self, attempt: _Attempt) -> None:
        """
        One GET for bytes C{[attempt.start, attempt.end)}; C{attempt.next} says how far it
        got (bytes before it are written or being written).

        @raise Retry: a transient failure.
        @raise _StartOver: the blob must start over from zero.
        """
        source = self._source
        settings = self._settings
        blob = self._blob
        a, b = attempt.start, attempt.end
        bounded = self.ranged
        headers = source.headers()
        if bounded:
            headers["Range"] = f"bytes={a}-{b - 1}"
        elif a > 0:
            headers["Range"] = f"bytes={a}-"
        response = await source.get(self._url, headers)
        code = response.code
        in_place = False  # the whole blob came for a ranged request: start over with it
        if code == 200:
            length = response.length
            if isinstance(length, int) and length != blob.size:
                abandon(response)
                raise CommandFailed(
                    CHECKSUM_MISMATCH,
                    f"The backend serves {length} bytes for {self.what}, but the manifest says "
                    f"{blob.size}.",
                    {"blob": blob.hash},
                )
            if a > 0:
                self._run.range_ignored += 1
                if bounded:
                    self._ranges.bounded = False  # no ranged requests to this server again
                if bounded or self._fetching() > 1:
                    abandon(response)
                    raise _StartOver("the backend ignored Range")
                self.log.info(
                    "The backend ignored Range for {blob}; downloading it from the start",
                    blob=blob.hash,
                )
                in_place = True
            elif bounded and b < blob.size:
                self._ignored_end("HTTP 200 with the whole blob")
        elif code == 206 and (bounded or a > 0):
            header = response.headers.getRawHeaders("content-range") or [None]
            cr = parse_content_range(header[0])
            if (
                cr is None
                or cr.start != a
                or cr.end >= blob.size
                or (cr.total is not None and cr.total != blob.size)
            ):
                abandon(response)
                raise _StartOver(f"unusable Content-Range {header[0]!r}")
            if cr.end + 1 < b:
                attempt.end = b = cr.end + 1  # a shorter range than asked: the rest goes back
            elif bounded and cr.end + 1 > b:
                self._ignored_end(f"Content-Range {header[0]}")
            elif bounded:
                self._ranges.bounded = True
        elif code == 416 and (bounded or a > 0):
            abandon(response)
            raise _StartOver("the backend refused the range (HTTP 416)")
        else:
            await source.refuse(response, self.what)
        if in_place:
            attempt.start = attempt.next = a = 0
            attempt.end = attempt.end_asked = b = blob.size
        if a > 0 or self._fetching() > 1 or self.done:
            self.spliced = True
        receiver = BlobBodyReceiver(
            self._reactor,
            self,
            self._budget,
            a,
            b - a,
            at_eof=b == blob.size,
            idle_timeout=settings.idle_timeout,
            batch_size=settings.batch_size,
            # A connection ahead of the hash may hold its whole segment in memory.
            high_water=(settings.segment_size if bounded else settings.stream_high_water)
            + settings.batch_size,
            hold=in_place,
        )
        response.deliverBody(receiver)
        if not bounded:
            self._stream = (attempt, receiver)
        try:
            if in_place:
                await self._restart_in_place()
                receiver.release_hold()
            await receiver.done
        except TransferInterrupted as e:
            raise Retry(str(e)) from None
        except BodyTooLong:
            raise CommandFailed(
                CHECKSUM_MISMATCH,
                f"The backend sent more than {blob.size} bytes for {self.what}.",
                {"blob": blob.hash},
            ) from None
        except BaseException:
            if not receiver.done.called:
                receiver.done.cancel()
            raise
        finally:
            attempt.next = receiver.next_offset
            if self._stream is not None and self._stream[1] is receiver:
                self._stream = None

    async def _restart_in_place(self) -> None:
        """Start over with a response that holds the whole blob (it waits, paused)."""
        self._count_start_over("the backend ignored Range")
        await self._reset()
        self._missing = Ranges()  # this response brings all of it

    def _ignored_end(self, what: str) -> None:
        if self._ranges.bounded is not False:
            self.log.info(
                "The backend ignores the end of bounded ranges ({what}); fetching the rest "
                "of each blob as one stream",
                what=what,
            )
        self._ranges.bounded = False
        self._run.range_end_ignored += 1


class _Attempt:
    """One request's interval and how far it got."""

    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end
        self.end_asked = end
        self.next = start

    @property
    def progressed(self) -> bool:
        return self.next > self.start


def _noop() -> None:
    return None


def _describe(window: tuple[float, float | None, float | None] | None) -> str:
    """A scaler's last window for the log: its rate and the CPUs busy and idle."""
    if window is None:
        return "none"
    rate, busy, idle = window
    text = f"{rate / 1e6:.0f} MB/s"
    if busy is not None and idle is not None:
        text += f", this process {busy:.2f} CPUs busy, the host {idle:.2f} idle"
    return text

