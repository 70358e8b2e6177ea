# -*- test-case-name: tests.test_logs -*-
"""
The Loki shipper: batches of log lines, pushed in order, spooled to disk while Loki is away.

B{Lines in.} L{LokiShipper.push} (any thread: log observers run wherever an event was emitted)
and L{LokiShipper.push_many} (reactor thread: the journal and container readers) add lines to
the I{open batch}. Each line gets a sequence number; L{LokiShipper.delivered_through} says up to
which one every line is I{done}: accepted by Loki, written to the spool, or dropped (counted).
Readers advance their saved positions (journal cursor, container log positions) only that far,
so a restart resumes exactly behind what is safe.

B{Batches.} The open batch is closed when it holds C{batch_bytes} (1 MiB by default), when its
first line has waited C{max_wait} seconds (1 s, at most C{LOG_FLUSH_INTERVAL_SEC}), or when it
holds C{batch_size} lines (C{LOG_BATCH_SIZE}) while nothing else is waiting to be sent. So an idle
agent pushes a line within a second, a busy one pushes few, large batches. A closed batch is
encoded (streams grouped by label set, each stream's entries in time order and never before its
previous push, JSON, gzip) on the worker pool when it is large, then pushed. One push is in
flight at a time, so every stream reaches Loki in order.

B{Answers.} 2xx: done. 429, 5xx, 401/403, timeouts and network errors: retried with jittered
exponential backoff (1 s to 60 s), never sooner than a C{Retry-After} asks (up to 10 minutes);
meanwhile batches go to the L{Spool}. 413 (too large): the batch is split in halves and each sent
on its own; a single line still too large is dropped (C{too_large}). Other 4xx: the batch is
dropped, counted by reason (C{out_of_order}, C{too_old}, C{too_large} or C{rejected} from
Loki's text). A 401/403 also makes the credentials be read again from their files.

B{Spool.} While pushes fail, while more than C{spool_after} bytes of closed batches wait (Loki is
slower than the input), and at stop, closed batches are appended to the spool (fsynced) and
count as done; pushes then come from the spool head, in order, each record removed once Loki
took it. Everything on disk is older than everything in memory.

B{Memory} is bounded by C{memory_bytes} (lines counted with their overhead, batches by their
encoded size). L{pressure} says how full it is; readers pause above 80 % and resume below 50 %
(L{when_room}), so when the spool is full (or off) they stop reading and their positions stand.
Lines from L{push} that do not fit are dropped (C{queue_full}); L{push_many} never drops.

B{No feedback.} Everything this package logs is under C{llmport_agent.logs}, which the agent
log observer never ships: a failing Loki does not feed itself.
"""

from __future__ import annotations

import email.utils
import random
import threading
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from itertools import accumulate, repeat
from operator import add, itemgetter
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.threadable import isInIOThread
from zope.interface import Interface, implementer

from llmport_agent import VERSION
from llmport_agent.core.backoff import Backoff
from llmport_agent.core.httpbody import read_prefix
from llmport_agent.core.threads import BlockingRunner
from llmport_agent.core.values import define
from llmport_agent.logs.auth import LokiAuth
from llmport_agent.logs.encoding import (
    ENTRY_OVERHEAD,
    Entry,
    LabelKey,
    decode_body,
    encode_batch,
    label_key,
)
from llmport_agent.logs.spool import Spool, SpoolCorrupt

__all__ = [
    "DROP_REASONS",
    "ILogSink",
    "LokiShipper",
    "RoomWaiter",
    "PUSH_PATH",
    "loki_http_client",
    "push_target",
]

PUSH_PATH = "/loki/api/v1/push"

#: Lines longer than this many characters are cut (Loki's default line limit is 256 KB).
MAX_LINE_CHARS = 64 * 1024
#: The most bytes of Loki's answer to a push read (its error text).
LOKI_ANSWER_LIMIT = 64 * 1024

#: Batches with more raw bytes than this are encoded on the worker pool (below it, inline
#: encoding takes well under a millisecond).
_OFF_REACTOR_BYTES = 16 * 1024

#: Bytes an entry adds to a push body besides its line (time, quotes, brackets).
_ENTRY_JSON_BYTES = 32

_LINE = itemgetter(2)

#: Streams whose last pushed time is remembered (for the ordering clamp).
_MAX_STREAM_FLOORS = 4096

#: The longest wait a Retry-After may impose.
MAX_RETRY_AFTER = 600.0

#: Why lines were dropped (every reason has a counter, also when it is 0).
DROP_REASONS = (
    "queue_full",  # push() while memory was full (the spool full or off)
    "rejected",  # a final 4xx from Loki
    "too_large",  # a single line Loki refused as too large
    "out_of_order",  # Loki refused entries as out of order
    "too_old",  # Loki refused entries as too old
    "invalid",  # not a loggable line (bad labels or time)
    "encode_failed",  # the batch could not be encoded
    "spool_corrupt",  # records damaged on disk
    "stopped",  # still in memory when the agent stopped, with no room in the spool
)

_SENT = "sent"
_RETRY = "retry"
_CANCELLED = -1


class ILogSink(Interface):
    """Where log readers put their lines (the shipper, or a test double)."""

    def push(labels: Mapping[str, str], ts_ns: int, line: str) -> int:
        """
        Queue one line; thread-safe, never blocks, never raises; may drop it when memory is
        full (counted). Returns the highest sequence number given so far.
        """

    def push_many(entries: Sequence[Entry], size: int | None = None) -> int:
        """
        Queue C{(label_key, ts_ns, line)} entries in order; reactor thread; never drops (the
        caller watches L{pressure}). Returns the sequence number of the last one. With C{size}
        (the sum of C{len(line) + ENTRY_OVERHEAD}, lines already cut to L{MAX_LINE_CHARS}, as
        a reader thread computes it) this costs O(1) per call on the reactor.
        """

    def delivered_through() -> int:
        """
        The highest sequence number such that it and every line before it is done with
        (accepted, spooled or dropped). Reactor thread only.
        """

    def flush(timeout: float) -> Deferred[bool]:
        """
        Push what is queued; after C{timeout} seconds (at once while Loki is failing) spool
        the rest. Fires C{True} once every line queued so far is done with. Reactor thread.
        """

    def pressure() -> float:
        """How full memory is, 0.0 (empty) to 1.0 (full)."""

    def when_room() -> Deferred[None]:
        """Fires once L{pressure} is at or below the resume level (at once if it is)."""


class RoomWaiter:
    """
    For a reader: asks the sink for room (L{ILogSink.when_room}) at most once at a time and
    calls C{callback} when there is some. Reactor thread.
    """

    def __init__(self, sink: ILogSink, callback: Callable[[], None]) -> None:
        self._sink = sink
        self._callback = callback
        self.waiting = False

    def wait(self) -> None:
        if self.waiting:
            return
        self.waiting = True
        self._sink.when_room().addCallback(self._room)

    def _room(self, _: object) -> None:
        self.waiting = False
        self._callback()


def push_target(loki_url: str) -> tuple[str, tuple[str, str] | None, str]:
    """
    Split the configured Loki URL into C{(push_url, basic_auth, display_url)}.

    A base path is kept (C{http://h/loki-gw} -> C{http://h/loki-gw/loki/api/v1/push}); a URL
    already ending in the push path is used as it is; C{user:password@} becomes basic auth and
    is absent from both URLs.

    @raise ValueError: the URL is not http(s) with a host (the message shows no password).
    """
    parts = urlsplit(loki_url.strip())
    netloc = parts.netloc.rpartition("@")[2]
    if parts.scheme not in ("http", "https") or not parts.hostname:
        shown = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
        raise ValueError(f"LOKI_URL {shown!r} is not an http(s) URL with a host")
    auth: tuple[str, str] | None = None
    if parts.username is not None:
        auth = (unquote(parts.username), unquote(parts.password or ""))
    path = parts.path.rstrip("/")
    if not path.endswith(PUSH_PATH):
        path += PUSH_PATH
    url = urlunsplit((parts.scheme, netloc, path, "", ""))
    return url, auth, url


def loki_http_client(
    reactor: Any, *, tls_policy: Any = None, connect_timeout: float = 10.0
) -> tuple[Any, Any]:
    """
    A treq C{HTTPClient} for Loki with its own quiet persistent pool: C{(client, pool)}.

    The pool's factory is not noisy, so pushing does not log "Starting factory" lines that
    would be shipped in turn. Close it with C{pool.closeCachedConnections()} after the
    shipper has stopped.
    """
    from treq.client import HTTPClient
    from twisted.web.client import Agent, HTTPConnectionPool

    from llmport_agent.core.twistedapi import quiet_pool_factory

    pool = HTTPConnectionPool(reactor, persistent=True)
    quiet_pool_factory(pool)
    pool.maxPersistentPerHost = 2
    pool.cachedConnectionTimeout = 60
    kwargs: dict[str, Any] = {"pool": pool, "connectTimeout": connect_timeout}
    if tls_policy is not None:
        kwargs["contextFactory"] = tls_policy
    return HTTPClient(Agent(reactor, **kwargs)), pool


def retry_after(value: str | None, now: float) -> float | None:
    """Seconds a C{Retry-After} header value asks to wait (delta seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - now)


def _drop_reason(detail: str) -> str:
    text = detail.lower()
    if "out of order" in text or "too far behind" in text:
        return "out_of_order"
    if "too old" in text or "greater than" in text and "old" in text:
        return "too_old"
    if "line too long" in text or "max entry size" in text or "too large" in text:
        return "too_large"
    return "rejected"


@define(eq=False)
class _Batch:
    """
    A closed batch in memory: its lines' sequence range, then (once encoded) the body.

    @ivar size: what it counts against the memory bound now.
    """

    first_seq: int
    last_seq: int
    lines: int
    raw_bytes: int
    size: int
    entries: list[Entry] | None
    body: bytes | None = None


def _encode(
    entries: list[Entry], floors: dict[LabelKey, int], gzip_level: int
) -> tuple[bytes, dict[LabelKey, int]]:
    return encode_batch(entries, floors, gzip_level)


@implementer(ILogSink)
class LokiShipper(Service):
    """
    Ships log lines to Loki. See the module docstring for the behaviour.

    @param reactor: provides C{IReactorTime} (and C{callFromThread}).
    @param http: a treq C{HTTPClient} (or L{treq.testing.StubTreq}).
    @param loki_url: the configured C{LOKI_URL} (base URL, optionally with a base path and
        C{user:password@}).
    @param batch_size: C{LOG_BATCH_SIZE}: a batch is closed at this many lines when nothing
        else waits to be sent.
    @param flush_interval: C{LOG_FLUSH_INTERVAL_SEC}: the longest a line waits in the open
        batch (together with C{max_wait}, whichever is shorter).
    @param batch_bytes: a batch is closed at this many bytes of lines.
    @param max_wait: the longest a line waits in the open batch.
    @param memory_bytes: the memory bound (default: 8 batches).
    @param spool: where batches wait while Loki cannot take them (C{None}: memory only).
    @param spool_after: closed batches waiting in memory beyond this many bytes are spooled
        even while Loki answers (default: 2 batches).
    @param auth: tenant and credentials (basic auth from C{loki_url} otherwise).
    @param timeout: seconds one push may take before it counts as failed.
    @param gzip_level: 1-9, or 0 for plain JSON.
    @param stop_timeout: seconds the last delivery at stop may take before the rest is spooled.
    @param runner: where large batches are encoded and decoded (inline when C{None}).
    @param backoff: the retry delays (jittered exponential, 1 s to 60 s by default).
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        http: Any,
        loki_url: str,
        *,
        batch_size: int,
        flush_interval: float,
        batch_bytes: int = 1 << 20,
        max_wait: float = 1.0,
        memory_bytes: int | None = None,
        spool: Spool | None = None,
        spool_after: int | None = None,
        auth: LokiAuth | None = None,
        timeout: float = 10.0,
        gzip_body: bool = True,
        gzip_level: int = 1,
        stop_timeout: float = 5.0,
        runner: BlockingRunner | None = None,
        backoff: Backoff | None = None,
        jitter: Callable[[], float] = random.random,
        pause_at: float = 0.8,
        resume_at: float = 0.5,
        wallclock: Callable[[], float] = time.time,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, not {batch_size!r}")
        if flush_interval <= 0:
            raise ValueError(f"flush_interval must be > 0, not {flush_interval!r}")
        if batch_bytes < 1024:
            raise ValueError(f"batch_bytes must be >= 1024, not {batch_bytes!r}")
        self.setName("loki")
        self._reactor = reactor
        self._http = http
        self._url, url_auth, self.display_url = push_target(loki_url)
        if auth is None:
            auth = LokiAuth()
        if url_auth is not None and auth.username is None and auth.bearer_token is None:
            auth = LokiAuth(
                tenant=auth.tenant,
                username=url_auth[0],
                password=url_auth[1],
                bearer_token_file=auth.bearer_token_file,
            )
        self.auth = auth
        self._batch_size = int(batch_size)
        self._max_wait = min(float(max_wait), float(flush_interval))
        self.batch_bytes = int(batch_bytes)
        self.memory_bytes = int(memory_bytes if memory_bytes is not None else 8 * batch_bytes)
        self._spool = spool
        self._spool_after = int(spool_after if spool_after is not None else 2 * batch_bytes)
        self._timeout = float(timeout)
        self._gzip_level = int(gzip_level) if gzip_body else 0
        self._stop_timeout = float(stop_timeout)
        self._runner = runner
        self._backoff = backoff if backoff is not None else Backoff(1.0, 60.0, jitter)
        self._pause_at = pause_at
        self._resume_at = resume_at
        self._wallclock = wallclock

        # Shared with other threads (push): guarded by the lock.
        self._lock = threading.Lock()
        self._seq = 0
        self._open: list[Entry] = []
        self._open_first = 1
        self._open_bytes = 0
        self._open_since = 0.0
        self._wake_pending = False
        self._sealed_bytes = 0  # written on the reactor thread, read anywhere

        # Reactor thread only.
        self._sealed: deque[_Batch] = deque()
        self._encoding = False
        self._encode_looping = False
        self._floors: dict[LabelKey, int] = {}
        self._age_call: Any = None
        self._loop_d: Deferred[None] | None = None
        self._waiting: Deferred[None] | None = None
        self._wait_timer: Any = None
        self._attempt: Deferred[Any] | None = None
        self._retry_at = 0.0
        self._failing = False
        self._force_spool = False
        self._spool_retry_at = 0.0
        self._stopped = False
        self._done_waiters: list[tuple[int, Deferred[None]]] = []
        self._room_waiters: list[Deferred[None]] = []
        self._spool_waiters: list[Deferred[None]] = []
        self._encode_waiters: list[Deferred[None]] = []
        self._inflight_disk = False
        self._spool_task: Deferred[None] | None = None
        self._stopping = False
        self._ready: Deferred[None] | None = None

        # Statistics.
        self.lines_in = 0
        self.lines_sent = 0
        self.pushes_ok = 0
        self.pushes_failed = 0
        self.pushes_rejected = 0
        self.splits = 0
        self.truncated = 0
        self.dropped: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        self.consecutive_failures = 0
        self.last_error: str | None = None
        self.last_success_at: float | None = None
        self.paused_readers = 0

    # -- any thread ------------------------------------------------------------------------

    def push(self, labels: Mapping[str, str], ts_ns: int, line: str) -> int:
        """
        Queue one line for C{labels} at C{ts_ns} (Unix nanoseconds). Thread-safe and cheap;
        dropped (and counted as C{queue_full}) when memory is full. Never raises.
        """
        try:
            key = label_key(labels)
            ts = int(ts_ns)
            if ts < 0:
                raise ValueError("negative timestamp")
            text = line if isinstance(line, str) else str(line)
        except Exception:
            with self._lock:
                self.dropped["invalid"] += 1
                return self._seq
        if len(text) > MAX_LINE_CHARS:
            text = text[:MAX_LINE_CHARS] + " [truncated]"
            self.truncated += 1
        size = len(text) + ENTRY_OVERHEAD
        with self._lock:
            if self._open_bytes + self._sealed_bytes + size > self.memory_bytes:
                self.dropped["queue_full"] += 1
                return self._seq
            self._add(key, ts, text, size)
            seq = self._seq
        self._poke()
        return seq

    def _add(self, key: LabelKey, ts: int, text: str, size: int) -> None:
        # Called with the lock held.
        if not self._open:
            self._open_first = self._seq + 1
            self._open_since = self._reactor.seconds()
        self._seq += 1
        self._open.append((key, ts, text))
        self._open_bytes += size
        self.lines_in += 1

    def _poke(self) -> None:
        """Let the reactor look at the open batch (close it, or arm its age timer)."""
        if isInIOThread():
            self._check_open()
            return
        with self._lock:
            if self._wake_pending:
                return
            self._wake_pending = True
        try:
            self._reactor.callFromThread(self._wake)
        except Exception:
            with self._lock:
                self._wake_pending = False

    def pressure(self) -> float:
        """How full memory is (0.0 to 1.0, above 1.0 briefly after L{push_many})."""
        return (self._open_bytes + self._sealed_bytes) / self.memory_bytes

    # -- reactor thread: lines in -------------------------------------------------------------

    def push_many(self, entries: Sequence[Entry], size: int | None = None) -> int:
        """See L{ILogSink.push_many}. Without C{size}, lines over L{MAX_LINE_CHARS} are cut here."""
        with self._lock:
            if size is not None and entries:
                if not self._open:
                    self._open_first = self._seq + 1
                    self._open_since = self._reactor.seconds()
                self._open.extend(entries)
                self._seq += len(entries)
                self._open_bytes += size
                self.lines_in += len(entries)
            else:
                for key, ts, text in entries:
                    if len(text) > MAX_LINE_CHARS:
                        text = text[:MAX_LINE_CHARS] + " [truncated]"
                        self.truncated += 1
                    self._add(key, ts, text, len(text) + ENTRY_OVERHEAD)
            seq = self._seq
        if entries:
            self._check_open()  # a large hand-over is cut into batches by _seal
        return seq

    def when_room(self) -> Deferred[None]:
        """See L{ILogSink.when_room}."""
        d: Deferred[None] = Deferred()
        if self.pressure() <= self._resume_at:
            d.callback(None)
        else:
            self._room_waiters.append(d)
        return d

    def _wake(self) -> None:
        with self._lock:
            self._wake_pending = False
        self._check_open()

    def _sender_idle(self) -> bool:
        return (
            not self._sealed
            and self._attempt is None
            and not (self._spool is not None and self._spool.records)
        )

    def _check_open(self) -> None:
        """Close the open batch if it is due, else make sure its age timer runs."""
        with self._lock:
            count = len(self._open)
            size = self._open_bytes
            since = self._open_since
        if not count:
            return
        due = (
            size >= self.batch_bytes
            or self._reactor.seconds() - since >= self._max_wait
            or (count >= self._batch_size and self._sender_idle())
        )
        if due:
            self._seal()
        elif self._age_call is None and self.running:
            delay = max(0.0, since + self._max_wait - self._reactor.seconds())
            self._age_call = self._reactor.callLater(delay, self._aged)

    def _aged(self) -> None:
        self._age_call = None
        self._check_open()

    def _seal(self) -> None:
        """Close the open batch: cut into batches of at most C{batch_bytes} of lines."""
        with self._lock:
            entries, self._open = self._open, []
            self._open_bytes = 0
            first = self._open_first
            self._open_first = self._seq + 1
            if not entries:
                return
            # Exact sizes, counted at C speed (a batch can hold thousands of lines).
            cum = list(accumulate(map(add, map(len, map(_LINE, entries)), repeat(_ENTRY_JSON_BYTES))))
            self._sealed_bytes += cum[-1] + (ENTRY_OVERHEAD - _ENTRY_JSON_BYTES) * len(entries)
        if self._age_call is not None and self._age_call.active():
            self._age_call.cancel()
        self._age_call = None
        bound = self.batch_bytes
        start = base = 0
        n = len(entries)
        while start < n:
            end = bisect_right(cum, base + bound, start)
            if end == start:
                end = start + 1  # one line larger than the bound goes alone
            self._add_batch(first + start, entries[start:end] if start or end < n else entries,
                            cum[end - 1] - base)
            base = cum[end - 1]
            start = end
        self._encode_next()

    def _add_batch(self, first: int, entries: list[Entry], raw: int) -> None:
        size = raw + (ENTRY_OVERHEAD - _ENTRY_JSON_BYTES) * len(entries)
        self._sealed.append(_Batch(first, first + len(entries) - 1, len(entries), raw, size, entries))

    def _set_size(self, batch: _Batch, size: int) -> None:
        with self._lock:
            self._sealed_bytes += size - batch.size
        batch.size = size

    # -- reactor thread: encoding -----------------------------------------------------------

    def _encode_next(self) -> None:
        """Encode the closed batches in order, one at a time (a loop, not a recursion)."""
        self._wake_sender()
        self._spool_behind()
        if self._encode_looping:
            return
        self._encode_looping = True
        try:
            while not self._encoding:
                batch = next((b for b in self._sealed if b.body is None), None)
                if batch is None:
                    waiters, self._encode_waiters = self._encode_waiters, []
                    for w in waiters:
                        w.callback(None)
                    return
                self._encoding = True
                d = Deferred.fromCoroutine(self._encode_one(batch))
                d.addErrback(lambda f: self.log.failure("Encoding log lines for Loki failed", failure=f))
        finally:
            self._encode_looping = False

    def _encoded(self) -> None:
        """One encoding ended: let the sender go, and go on with the next one."""
        self._encoding = False
        self._progress()
        self._wake_sender()
        self._spool_behind()
        if not self._encode_looping:
            self._encode_next()

    async def _encode_one(self, batch: _Batch) -> None:
        entries = batch.entries
        assert entries is not None
        floors = {}
        for key, _, _ in entries:
            if key in self._floors and key not in floors:
                floors[key] = self._floors[key]
        try:
            if self._runner is not None and batch.raw_bytes > _OFF_REACTOR_BYTES:
                body, last = await self._runner.run(_encode, entries, floors, self._gzip_level)
            else:
                body, last = _encode(entries, floors, self._gzip_level)
        except Exception as e:
            self.log.error(
                "Encoding {lines} log lines for Loki failed ({error}); they are dropped",
                lines=batch.lines,
                error=f"{type(e).__name__}: {e}",
            )
            self._count_drop("encode_failed", batch.lines)
            if batch in self._sealed:
                self._sealed.remove(batch)
                self._set_size(batch, 0)
            self._encoded()
            return
        self._floors.update(last)
        if len(self._floors) > _MAX_STREAM_FLOORS:
            for key in list(self._floors)[: len(self._floors) - _MAX_STREAM_FLOORS]:
                del self._floors[key]
        batch.body = body
        batch.entries = None
        self._set_size(batch, len(body) + 256)
        self._encoded()

    # -- reactor thread: done-tracking ------------------------------------------------------

    def delivered_through(self) -> int:
        """See L{ILogSink.delivered_through}."""
        if self._sealed:
            return self._sealed[0].first_seq - 1
        with self._lock:
            if self._open:
                return self._open_first - 1
            return self._seq

    def _count_drop(self, reason: str, lines: int) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + lines

    def _progress(self) -> None:
        """Something was delivered, spooled, dropped or shrunk: tell whoever waits."""
        if self._done_waiters:
            through = self.delivered_through()
            ready = [w for w in self._done_waiters if w[0] <= through]
            for entry in ready:
                self._done_waiters.remove(entry)
                entry[1].callback(None)
        if self._room_waiters and self.pressure() <= self._resume_at:
            waiters, self._room_waiters = self._room_waiters, []
            for d in waiters:
                d.callback(None)

    def _wait_done(self, target: int, timeout: float) -> Deferred[bool]:
        d: Deferred[None] = Deferred()
        entry = (target, d)
        self._done_waiters.append(entry)
        result: Deferred[bool] = Deferred()

        def expire() -> None:
            if entry in self._done_waiters:
                self._done_waiters.remove(entry)
                result.callback(False)

        timer = self._reactor.callLater(timeout, expire)

        def fired(_: object) -> None:
            if timer.active():
                timer.cancel()
            result.callback(True)

        d.addCallback(fired)
        return result

    # -- flush and lifecycle ----------------------------------------------------------------

    def flush(self, timeout: float) -> Deferred[bool]:
        """See L{ILogSink.flush}."""
        return Deferred.fromCoroutine(self._flush(timeout))

    async def _flush(self, timeout: float) -> bool:
        target = self._seq
        self._seal()
        if self.delivered_through() >= target:
            return True
        spool = self._spool is not None and self._spool.available
        if self._loop_d is not None and not (self._failing and spool):
            waiting = self._wait_done(target, timeout)
            if self._failing:
                # No spool to fall back on: one attempt now rather than after the backoff.
                self._retry_at = 0.0
                self._wake_sender()
            await waiting
            if self.delivered_through() >= target:
                return True
        if spool:
            await self._spool_everything()
        return self.delivered_through() >= target

    async def _spool_everything(self) -> None:
        """Spool every closed batch now (an in-flight push is given up and spooled too)."""
        self._force_spool = True
        try:
            if self._loop_d is None:
                await self._spool_memory()
                return
            d: Deferred[None] = Deferred()
            self._spool_waiters.append(d)
            if self._attempt is not None:
                self._attempt.cancel()
            self._wake_sender()
            await d
        finally:
            # Once stopping, whatever comes later goes to disk too.
            self._force_spool = self._stopping

    def describe(self) -> dict[str, Any]:
        """Counters for diagnostics and metrics (no secrets: the URL has no password)."""
        return {
            "enabled": True,
            "url": self.display_url,
            "running": bool(self.running),
            **self.auth.describe(),
            **self.stats(),
            "spool": self._spool.describe() if self._spool is not None else {"enabled": False},
        }

    def stats(self) -> dict[str, Any]:
        """
        The shipping counters, under stable names (see the metrics reference in docs/metrics.md): lines in,
        sent, dropped by reason, pushes by outcome, memory and the retry state.
        """
        with self._lock:
            open_lines = len(self._open)
        spool = self._spool
        return {
            "lines_in": self.lines_in,
            "sent": self.lines_sent,
            "dropped": sum(self.dropped.values()),
            "dropped_by_reason": dict(self.dropped),
            "truncated": self.truncated,
            "pushes": self.pushes_ok,
            "failed_pushes": self.pushes_failed,
            "rejected_pushes": self.pushes_rejected,
            "splits": self.splits,
            "queue_lines": open_lines + sum(b.lines for b in self._sealed),
            "queue_depth": open_lines + sum(b.lines for b in self._sealed) + (spool.lines if spool else 0),
            "memory_bytes": self._open_bytes + self._sealed_bytes,
            "memory_max_bytes": self.memory_bytes,
            "pressure": round(self.pressure(), 3),
            "spool_bytes": spool.bytes_used if spool is not None else 0,
            "spool_max_bytes": spool.max_bytes if spool is not None else 0,
            "spool_lines": spool.lines if spool is not None else 0,
            "spool_available": bool(spool is not None and spool.available),
            "consecutive_failures": self.consecutive_failures,
            "retrying": self._failing,
            "last_error": self.last_error,
            "last_success_at": self.last_success_at,
        }

    def secrets(self) -> list[str]:
        """Secret values this shipper holds (for the redaction filter)."""
        return self.auth.secrets()

    def startService(self) -> None:
        super().startService()
        self._stopped = False
        self._stopping = False
        self._force_spool = False
        d = Deferred.fromCoroutine(self._start())
        d.addErrback(lambda f: self.log.failure("Starting the Loki shipper failed", failure=f))
        self._ready = d

    async def _start(self) -> None:
        if self.auth.password_file or self.auth.bearer_token_file:
            await self._load_auth()
        if self._spool is not None:
            await self._spool.open()
            if self._spool.corrupt_lines:
                self._count_drop("spool_corrupt", self._spool.corrupt_lines)
        if self._stopped:
            return
        loop = Deferred.fromCoroutine(self._run())
        loop.addErrback(lambda f: self.log.failure("The Loki sender stopped", failure=f))
        if not loop.called:
            self._loop_d = loop
        self._check_open()

    async def _load_auth(self) -> None:
        try:
            if self._runner is not None:
                await self._runner.run(self.auth.load)
            else:
                self.auth.load()
        except ValueError as e:
            self.log.error("{error}; Loki pushes go without it", error=str(e))

    def stopService(self) -> Deferred[None]:
        """Push what is left (bounded by C{stop_timeout}), spool the rest, then stop."""
        super().stopService()
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        self._stopping = True
        if self._ready is not None and not self._ready.called:
            await self._ready
        target = self._seq
        done = await self._flush(self._stop_timeout)
        self._stopped = True
        if self._attempt is not None:
            self._attempt.cancel()
        self._wake_sender()
        loop, self._loop_d = self._loop_d, None
        if loop is not None and not loop.called:
            await loop
        if self._age_call is not None and self._age_call.active():
            self._age_call.cancel()
        self._age_call = None
        if not done:
            left = target - self.delivered_through()
            if left > 0:
                self._count_drop("stopped", sum(b.lines for b in self._sealed))
                self.log.warn(
                    "{lines} log lines were neither shipped to Loki nor spooled before stopping "
                    "({error}); the journal and container logs are read again from there at the "
                    "next start",
                    lines=left,
                    error=self.last_error or "stop timeout",
                )
        if self._spool is not None:
            await self._spool.close()
        for d in self._spool_waiters:
            d.callback(None)
        self._spool_waiters = []

    # -- reactor thread: the sender -----------------------------------------------------------

    def _wake_sender(self) -> None:
        waiting, self._waiting = self._waiting, None
        if self._wait_timer is not None and self._wait_timer.active():
            self._wait_timer.cancel()
        self._wait_timer = None
        if waiting is not None:
            waiting.callback(None)

    def _sleep_until(self, when: float | None) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        self._waiting = d
        if when is not None:
            self._wait_timer = self._reactor.callLater(
                max(0.0, when - self._reactor.seconds()), self._wake_sender
            )
        return d

    async def _run(self) -> None:
        while not self._stopped:
            try:
                await self._step()
            except CancelledError:
                if self._stopped:
                    return
            except Exception:
                self.log.failure("The Loki sender failed; it carries on in 1 s")
                await self._sleep_until(self._reactor.seconds() + 1.0)

    def _should_spool(self) -> bool:
        if self._spool is None or not self._spool.available or not self._sealed:
            return False
        if self._force_spool:
            return True
        if self._reactor.seconds() < self._spool_retry_at:
            return False
        if self._sealed[0].body is None:
            return False
        return self._failing or self._sealed_bytes > self._spool_after

    def _spool_behind(self) -> None:
        """
        While the sender waits on a push of a I{spooled} record, closed batches can go to disk
        behind it (the order holds); a push of a batch from memory must end first.
        """
        if self._inflight_disk and self._spool_task is None and self._should_spool():
            d = Deferred.fromCoroutine(self._spool_guarded())
            d.addErrback(lambda f: self.log.failure("Spooling log lines failed", failure=f))

    async def _spool_guarded(self) -> None:
        """L{_spool_memory}, one at a time."""
        while self._spool_task is not None:
            await _observe(self._spool_task)
        if not self._should_spool():
            return
        task = Deferred.fromCoroutine(self._spool_memory())
        if not task.called:
            self._spool_task = task
        try:
            await task
        finally:
            self._spool_task = None

    async def _spool_memory(self) -> None:
        """Move the encoded batches at the front of memory to the spool (in order)."""
        assert self._spool is not None
        if self._force_spool and (self._encoding or any(b.body is None for b in self._sealed)):
            # Everything is to go to disk: wait for the encodings first.
            d: Deferred[None] = Deferred()
            self._encode_waiters.append(d)
            self._encode_next()
            await d
        ready: list[_Batch] = []
        for b in self._sealed:
            if b.body is None:
                break
            ready.append(b)
        if not ready:
            return
        n = await self._spool.append([(b.body, b.lines) for b in ready if b.body is not None])
        for b in ready[:n]:
            self._sealed.popleft()
            self._set_size(b, 0)
        if n < len(ready):
            # Full (or a write error): try again in a while, or after an acknowledgement.
            self._spool_retry_at = self._reactor.seconds() + 1.0
        if n:
            self._progress()

    def _head(self) -> tuple[str, Any] | None:
        if self._spool is not None and self._spool.records:
            return "disk", self._spool.records[0]
        if self._sealed:
            return "memory", self._sealed[0]
        return None

    async def _step(self) -> None:
        await self._spool_guarded()
        if self._force_spool:
            waiters, self._spool_waiters = self._spool_waiters, []
            for d in waiters:
                d.callback(None)
        if self._stopped:
            return
        head = self._head()
        now = self._reactor.seconds()
        if head is None:
            await self._sleep_until(None)
            return
        if self._retry_at > now:
            await self._sleep_until(self._retry_at)
            return
        kind, item = head
        if kind == "memory" and item.body is None:
            await self._sleep_until(None)  # woken when it is encoded
            return
        if kind == "disk":
            assert self._spool is not None
            try:
                body = await self._spool.read(item)
            except (SpoolCorrupt, OSError) as e:
                self.log.error(
                    "A Loki spool record could not be read back ({error}); its {lines} lines "
                    "are dropped",
                    error=str(e),
                    lines=item.lines,
                )
                self._count_drop("spool_corrupt", item.lines)
                self._spool.drop_head()
                return
        else:
            body = item.body
        self._inflight_disk = kind == "disk"
        try:
            outcome = await self._send(body, item.lines)
        finally:
            self._inflight_disk = False
        if self._stopped and outcome == _RETRY:
            return
        self._finish_head(kind, item, outcome)

    def _finish_head(self, kind: str, item: Any, outcome: str) -> None:
        if outcome == _RETRY:
            return
        if kind == "disk":
            assert self._spool is not None
            if self._spool.records and self._spool.records[0] is item:
                self._spool.drop_head()
            self._spool_retry_at = 0.0
        elif self._sealed and self._sealed[0] is item:
            self._sealed.popleft()
            self._set_size(item, 0)
        self._progress()
        if self._sealed or not self._open_empty():
            self._check_open()

    def _open_empty(self) -> bool:
        with self._lock:
            return not self._open

    async def _send(self, body: bytes, lines: int) -> str:
        """Deliver one body (split on 413); returns C{_SENT} (or dropped) or C{_RETRY}."""
        code, detail, after = await self._post_once(body)
        if code == _CANCELLED:
            return _RETRY  # given up on purpose (spooling or stopping): not a failure
        if code is None or code == 429 or code >= 500 or code in (401, 403):
            self._retry(lines, code, after)
            return _RETRY
        self._recovered()
        if 200 <= code < 300:
            self.lines_sent += lines
            self.pushes_ok += 1
            self.last_success_at = self._wallclock()
            return _SENT
        if code == 413:
            return await self._split(body, lines)
        reason = _drop_reason(detail)
        self.pushes_rejected += 1
        self._count_drop(reason, lines)
        self.log.error(
            "Loki refused {lines} log lines with HTTP {code} ({detail}); they are dropped "
            "(counted as {reason})",
            lines=lines,
            code=code,
            detail=detail or "no detail",
            reason=reason,
        )
        return _SENT

    async def _split(self, body: bytes, lines: int) -> str:
        """413: send the batch in halves (each retried on its own until it is done)."""
        try:
            if self._runner is not None:
                entries: list[Entry] = await self._runner.run(decode_body, body)
            else:
                entries = decode_body(body)
        except ValueError as e:
            self._count_drop("encode_failed", lines)
            self.log.error("A batch Loki refused as too large cannot be split ({error})", error=str(e))
            return _SENT
        if len(entries) <= 1:
            self._count_drop("too_large", max(lines, len(entries)))
            self.log.error("Loki refused a single log line as too large (HTTP 413); it is dropped")
            return _SENT
        self.splits += 1
        new_bound = max(16 * 1024, len(body) // 2)
        if self.batch_bytes > new_bound:
            self.batch_bytes = new_bound
            self.log.warn(
                "Loki (or a proxy in front of it) refused a push of {size} bytes as too large "
                "(HTTP 413); batches are now closed at {bound} bytes",
                size=len(body),
                bound=new_bound,
            )
        half = len(entries) // 2
        for part in (entries[:half], entries[half:]):
            if self._runner is not None:
                sub, _ = await self._runner.run(_encode, part, {}, self._gzip_level)
            else:
                sub, _ = _encode(part, {}, self._gzip_level)
            while True:
                outcome = await self._send(sub, len(part))
                if outcome != _RETRY:
                    break
                if self._stopped:
                    return _RETRY
                await self._sleep_until(self._retry_at)
        return _SENT

    def _recovered(self) -> None:
        if self.consecutive_failures:
            self.log.info(
                "Loki takes log lines again after {failures} failed pushes",
                failures=self.consecutive_failures,
            )
        self.consecutive_failures = 0
        self._failing = False
        self._retry_at = 0.0
        self.last_error = None

    def _retry(self, lines: int, code: int | None, after: float | None) -> None:
        self.pushes_failed += 1
        self.consecutive_failures += 1
        self._failing = True
        delay = self._backoff.delay(self.consecutive_failures)
        if after is not None:
            delay = max(delay, min(after, MAX_RETRY_AFTER))
        self._retry_at = self._reactor.seconds() + delay
        if code in (401, 403):
            d = Deferred.fromCoroutine(self._load_auth())
            d.addErrback(lambda f: None)
        if self.consecutive_failures == 1 or self.consecutive_failures % 10 == 0:
            hint = ""
            if code in (401, 403):
                hint = " (check LOKI_USERNAME/LOKI_PASSWORD or LOKI_BEARER_TOKEN and LOKI_TENANT)"
            where = "spooled" if self._spool is not None and self._spool.available else "kept in memory"
            self.log.warn(
                "Pushing {lines} log lines to Loki failed ({error}){hint}; retry {attempt} in "
                "{delay:.1f} s, lines are {where} meanwhile",
                lines=lines,
                error=self.last_error,
                hint=hint,
                attempt=self.consecutive_failures,
                delay=delay,
                where=where,
            )

    async def _post_once(self, body: bytes) -> tuple[int | None, str, float | None]:
        """One POST: C{(status or None, detail, retry-after seconds)}; sets C{last_error}."""
        attempt: Deferred[Any] = Deferred.fromCoroutine(self._post(body))
        self._attempt = attempt
        timed_out = False

        def expire() -> None:
            nonlocal timed_out
            timed_out = True
            attempt.cancel()

        timer = self._reactor.callLater(self._timeout, expire)
        try:
            code, content, after_header = await attempt
        except Exception as e:
            if timed_out:
                self.last_error = f"no answer within {self._timeout:g} s"
            elif isinstance(e, CancelledError):
                return _CANCELLED, "", None
            else:
                self.last_error = _describe_error(e)
            return None, "", None
        finally:
            self._attempt = None
            if timer.active():
                timer.cancel()
        detail = content[:300].decode("utf-8", "replace").strip()
        if not 200 <= code < 300:
            self.last_error = f"HTTP {code}: {detail}" if detail else f"HTTP {code}"
        return code, detail, retry_after(after_header, self._wallclock())

    async def _post(self, body: bytes) -> tuple[int, bytes, str | None]:
        headers = {
            "Content-Type": "application/json",
            "User-Agent": f"llmport-agent/{VERSION}",
        }
        if self._gzip_level > 0 or body[:2] == b"\x1f\x8b":
            headers["Content-Encoding"] = "gzip"
        headers.update(self.auth.headers())
        kwargs: dict[str, Any] = {"data": body, "headers": headers}
        basic = self.auth.basic()
        if basic is not None:
            kwargs["auth"] = basic
        response = await self._http.post(self._url, unbuffered=True, **kwargs)
        content = await read_prefix(response, LOKI_ANSWER_LIMIT)
        values = response.headers.getRawHeaders(b"retry-after") or []
        after = values[0].decode("latin-1") if values else None
        return int(response.code), bytes(content), after


def _observe(d: Deferred[Any]) -> Deferred[None]:
    """A Deferred that fires (with None) when C{d} does, leaving C{d}'s result alone."""
    out: Deferred[None] = Deferred()

    def done(result: object) -> object:
        out.callback(None)
        return result

    d.addBoth(done)
    return out


def _describe_error(e: BaseException) -> str:
    reasons = getattr(e, "reasons", None)
    if reasons:
        inner = reasons[0]
        value = getattr(inner, "value", inner)
        return f"{type(e).__name__}: {type(value).__name__}: {value}"[:300]
    return f"{type(e).__name__}: {e}"[:300]

