# -*- test-case-name: tests.test_logs -*-
"""
The Loki shipper: a bounded, thread-safe queue of log lines and a reactor-side flusher.

L{LokiShipper.push} may be called from any thread (log observers run on whichever thread
emitted the event): it only appends to a bounded deque under a lock, dropping (and counting)
the oldest line when the queue is full. A L{LoopingCall} on the injected reactor drains the
queue every C{flush_interval} seconds (sooner once C{batch_size} lines are waiting) in pushes of
at most C{batch_size} lines, one push in flight at a time:

 - the lines are grouped by label set into C{{"streams": [{"stream": {...}, "values":
   [["<ns>", "<line>"], ...]}]}}, each stream's values in non-decreasing timestamp order, also
   across pushes (a line older than what that stream already shipped is stamped with the last
   shipped time, so a Loki that rejects out-of-order entries accepts it);
 - the body is JSON, gzip-encoded by default, POSTed to C{<LOKI_URL>/loki/api/v1/push} (a base
   path in the URL is kept; user:password in the URL becomes basic auth and is never logged);
 - 2xx: done. 429, 5xx, timeouts and network errors: the same batch is retried, in order, after
   a jittered exponential backoff (1 s floor, 60 s ceiling) while the queue keeps filling up to
   its bound. Other answers (4xx): the batch is dropped, counted, with one log line.

Stopping does one last drain (no retries) bounded by C{stop_timeout}, then stops.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple
from urllib.parse import unquote, urlsplit, urlunsplit

from attrs import frozen
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.task import LoopingCall, deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import Interface, implementer

from llmport_agent import VERSION
from llmport_agent.backoff import Backoff
from llmport_agent.threads import BlockingRunner

__all__ = [
    "ILogSink",
    "LokiShipper",
    "PUSH_PATH",
    "loki_http_client",
    "push_target",
]

PUSH_PATH = "/loki/api/v1/push"

#: Lines longer than this many characters are cut (Loki's default line limit is 256 KB).
MAX_LINE_CHARS = 64 * 1024

#: Raw JSON bodies larger than this are encoded in a worker thread when a runner is given.
_OFF_REACTOR_CHARS = 256 * 1024

#: Streams whose last shipped timestamp is remembered (for the ordering clamp).
_MAX_STREAM_FLOORS = 4096

_LABEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LABEL_BAD_CHARS = re.compile(r"[^A-Za-z0-9_]")

LabelKey = tuple[tuple[str, str], ...]


class ILogSink(Interface):
    """Where log sources put their lines (the shipper, or a test double)."""

    def push(labels: Mapping[str, str], ts_ns: int, line: str) -> int:
        """
        Queue one line; thread-safe, never blocks, never raises. Returns the line's sequence
        number (increasing in call order).
        """

    def delivered_through() -> int:
        """
        The highest sequence number such that it and every line before it is done with (sent
        or dropped). Reactor thread only.
        """

    def flush(timeout: float) -> Deferred[bool]:
        """
        Fire C{True} once every line pushed so far is done with, C{False} after C{timeout}
        seconds (or at once when delivery is failing). Reactor thread only.
        """

    def pressure() -> float:
        """How full the queue is, 0.0 (empty) to 1.0 (full)."""


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

    pool = HTTPConnectionPool(reactor, persistent=True)
    pool._factory.noisy = False
    pool.maxPersistentPerHost = 2
    pool.cachedConnectionTimeout = 60
    kwargs: dict[str, Any] = {"pool": pool, "connectTimeout": connect_timeout}
    if tls_policy is not None:
        kwargs["contextFactory"] = tls_policy
    return HTTPClient(Agent(reactor, **kwargs)), pool


class _Entry(NamedTuple):
    seq: int
    labels: LabelKey
    ts_ns: int
    line: str


@frozen
class _Batch:
    """One push: its lines' sequence range, the encoded body, and the new stream floors."""

    first_seq: int
    last_seq: int
    lines: int
    body: bytes
    floors: dict[LabelKey, int]


def _label_key(labels: Mapping[str, str]) -> LabelKey:
    items: dict[str, str] = {}
    for name, value in labels.items():
        name = str(name)
        if not _LABEL_NAME.match(name):
            name = _LABEL_BAD_CHARS.sub("_", name) or "_"
            if name[0].isdigit():
                name = "_" + name
        text = str(value)
        if text:
            items[name] = text
    if not items:
        items["job"] = "llmport-agent"
    return tuple(sorted(items.items()))


def encode_batch(
    entries: Sequence[_Entry], floors: Mapping[LabelKey, int], gzip_body: bool
) -> tuple[bytes, dict[LabelKey, int]]:
    """
    The push body for C{entries}: streams grouped by label set (first-seen order), each
    stream's values sorted by time and clamped to at least C{floors[stream]}. Returns the
    (optionally gzipped) body and each stream's last timestamp. Pure; safe in any thread.
    """
    grouped: dict[LabelKey, list[tuple[int, str]]] = {}
    for entry in entries:
        grouped.setdefault(entry.labels, []).append((entry.ts_ns, entry.line))
    streams: list[dict[str, Any]] = []
    last: dict[LabelKey, int] = {}
    for key, values in grouped.items():
        values.sort(key=lambda v: v[0])
        floor = floors.get(key, 0)
        out: list[list[str]] = []
        for ts, line in values:
            if ts < floor:
                ts = floor
            floor = ts
            out.append([str(ts), line])
        last[key] = floor
        streams.append({"stream": dict(key), "values": out})
    raw = json.dumps({"streams": streams}, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "replace"
    )
    if gzip_body:
        raw = gzip.compress(raw, compresslevel=6, mtime=0)
    return raw, last


_SENT = "sent"
_REJECTED = "rejected"
_RETRY = "retry"


@implementer(ILogSink)
class LokiShipper(Service):
    """
    Ships log lines to Loki. See the module docstring for the behaviour.

    @param reactor: provides C{IReactorTime} (and C{callFromThread} for an early flush).
    @param http: a treq C{HTTPClient} (or L{treq.testing.StubTreq}).
    @param loki_url: the configured C{LOKI_URL} (base URL, optionally with a base path).
    @param batch_size: the most lines in one push.
    @param flush_interval: seconds between drains.
    @param max_queue: the most lines waiting; beyond it the oldest are dropped and counted.
    @param timeout: seconds one push may take before it counts as failed (and is retried).
    @param gzip_body: gzip the body (C{Content-Encoding: gzip}).
    @param stop_timeout: seconds the final drain at stop may take.
    @param runner: where large bodies are encoded (off the reactor); inline when C{None}.
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
        max_queue: int = 10000,
        timeout: float = 10.0,
        gzip_body: bool = True,
        stop_timeout: float = 5.0,
        runner: BlockingRunner | None = None,
        backoff: Backoff | None = None,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, not {batch_size!r}")
        if flush_interval <= 0:
            raise ValueError(f"flush_interval must be > 0, not {flush_interval!r}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, not {max_queue!r}")
        self.setName("loki")
        self._reactor = reactor
        self._http = http
        self._url, self._auth, self.display_url = push_target(loki_url)
        self._batch_size = int(batch_size)
        self._flush_interval = float(flush_interval)
        self._max_queue = int(max_queue)
        self._timeout = float(timeout)
        self._gzip = gzip_body
        self._stop_timeout = float(stop_timeout)
        self._runner = runner
        self._backoff = backoff if backoff is not None else Backoff(1.0, 60.0, jitter)
        self._call_from_thread: Callable[..., Any] | None = getattr(
            reactor, "callFromThread", None
        )

        self._lock = threading.Lock()
        self._queue: deque[_Entry] = deque()
        self._seq = 0
        self._wake_pending = False

        self._pending: _Batch | None = None
        self._held: tuple[int, int] | None = None  # (first seq, lines) taken from the queue
        self._floors: dict[LabelKey, int] = {}
        self._loop: LoopingCall | None = None
        self._draining: Deferred[None] | None = None
        self._sleeping: Deferred[None] | None = None
        self._stopping = False
        self._idle_waiters: list[Deferred[None]] = []
        self._seq_waiters: list[tuple[int, Deferred[bool]]] = []

        # Statistics.
        self.lines_sent = 0
        self.pushes_ok = 0
        self.pushes_failed = 0
        self.dropped_overflow = 0
        self.dropped_rejected = 0
        self.dropped_invalid = 0
        self.truncated = 0
        self.consecutive_failures = 0
        self.last_error: str | None = None
        self.last_success_at: float | None = None

    # -- any thread ------------------------------------------------------------------------

    def push(self, labels: Mapping[str, str], ts_ns: int, line: str) -> int:
        """
        Queue one line for C{labels} at C{ts_ns} (Unix nanoseconds). Thread-safe and cheap:
        the oldest line is dropped (and counted) when the queue is full. Never raises.
        """
        try:
            key = _label_key(labels)
            ts = int(ts_ns)
            if ts < 0:
                raise ValueError("negative timestamp")
            text = line if isinstance(line, str) else str(line)
        except Exception:
            with self._lock:
                self._seq += 1
                self.dropped_invalid += 1
                return self._seq
        if len(text) > MAX_LINE_CHARS:
            text = text[:MAX_LINE_CHARS] + " [truncated]"
            self.truncated += 1
        wake = False
        with self._lock:
            self._seq += 1
            seq = self._seq
            if len(self._queue) >= self._max_queue:
                self._queue.popleft()
                self.dropped_overflow += 1
            self._queue.append(_Entry(seq, key, ts, text))
            if (
                len(self._queue) >= self._batch_size
                and not self._wake_pending
                and self.running
                and self._call_from_thread is not None
            ):
                self._wake_pending = True
                wake = True
        if wake and self._call_from_thread is not None:
            try:
                self._call_from_thread(self._wake)
            except Exception:
                with self._lock:
                    self._wake_pending = False
        return seq

    def pressure(self) -> float:
        """How full the queue is (0.0 to 1.0)."""
        with self._lock:
            return min(1.0, len(self._queue) / self._max_queue)

    @property
    def queue_depth(self) -> int:
        """Lines waiting, including the batch being pushed."""
        with self._lock:
            depth = len(self._queue)
        return depth + (self._held[1] if self._held is not None else 0)

    # -- reactor thread --------------------------------------------------------------------

    def delivered_through(self) -> int:
        """See L{ILogSink.delivered_through}."""
        if self._held is not None:
            return self._held[0] - 1
        with self._lock:
            if self._queue:
                return self._queue[0].seq - 1
            return self._seq

    def flush(self, timeout: float) -> Deferred[bool]:
        """
        See L{ILogSink.flush}. Starts a drain now unless one is running. While Loki is failing
        (waiting to retry) it answers C{False} at once rather than waiting for the timeout.
        """
        target = self._seq
        if self.delivered_through() >= target:
            return succeed(True)
        if self._sleeping is not None:
            return succeed(False)
        d: Deferred[bool] = Deferred()
        entry = (target, d)
        self._seq_waiters.append(entry)

        def expire() -> None:
            if entry in self._seq_waiters:
                self._seq_waiters.remove(entry)
                d.callback(False)

        timer = self._reactor.callLater(timeout, expire)

        def cancel_timer(result: bool) -> bool:
            if timer.active():
                timer.cancel()
            return result

        d.addCallback(cancel_timer)
        self._kick()
        return d

    def describe(self) -> dict[str, Any]:
        """Counters for diagnostics and metrics (no secrets: the URL has no password)."""
        dropped = self.dropped_overflow + self.dropped_rejected + self.dropped_invalid
        return {
            "enabled": True,
            "url": self.display_url,
            "running": bool(self.running),
            "sent": self.lines_sent,
            "pushes": self.pushes_ok,
            "failed_pushes": self.pushes_failed,
            "dropped": dropped,
            "dropped_overflow": self.dropped_overflow,
            "dropped_rejected": self.dropped_rejected,
            "dropped_invalid": self.dropped_invalid,
            "truncated": self.truncated,
            "queue_depth": self.queue_depth,
            "queue_max": self._max_queue,
            "consecutive_failures": self.consecutive_failures,
            "retrying": self._sleeping is not None,
            "last_error": self.last_error,
            "last_success_at": self.last_success_at,
        }

    def startService(self) -> None:
        super().startService()
        self._stopping = False
        loop = LoopingCall(self._kick)
        loop.clock = self._reactor
        self._loop = loop
        loop.start(self._flush_interval, now=False).addErrback(
            lambda f: self.log.failure("The Loki flush loop failed", failure=f)
        )

    def stopService(self) -> Deferred[None]:
        """Stop the timer, make one last bounded drain (no retries), then stop."""
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        self._stopping = True
        if self._sleeping is not None:
            # Ends the backoff wait at once; the drain makes its last attempt.
            self._sleeping.cancel()
        if self._draining is None:
            self._kick()
        if self._draining is None:
            self._after_stop()
            return succeed(None)
        done: Deferred[None] = Deferred()
        self._idle_waiters.append(done)
        draining = self._draining
        timer = self._reactor.callLater(self._stop_timeout, draining.cancel)

        def finish(_: object) -> None:
            if timer.active():
                timer.cancel()
            self._after_stop()

        return done.addCallback(finish)

    def _after_stop(self) -> None:
        left = self.queue_depth
        if left:
            self.log.warn(
                "{lines} log lines were not shipped to Loki before stopping ({error})",
                lines=left,
                error=self.last_error or "stop timeout",
            )

    def _wake(self) -> None:
        with self._lock:
            self._wake_pending = False
        if self.running:
            self._kick()

    def _kick(self) -> None:
        """Start a drain unless one is running. Never raises (it is the loop's callable)."""
        try:
            if self._draining is not None:
                return
            if self._pending is None:
                with self._lock:
                    if not self._queue:
                        return
            d = Deferred.fromCoroutine(self._drain())
            d.addErrback(self._drain_failed)
            if not d.called:
                self._draining = d
                d.addBoth(self._drain_ended)
            else:
                self._notify_idle()
        except Exception:
            self.log.failure("Starting a Loki push failed")

    def _drain_failed(self, failure: Failure) -> None:
        if failure.check(CancelledError):
            return None
        self.log.failure("Shipping logs to Loki failed", failure=failure)
        return None

    def _drain_ended(self, _: object) -> None:
        self._draining = None
        self._notify_idle()

    def _notify_idle(self) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        for w in waiters:
            w.callback(None)

    def _take(self) -> list[_Entry]:
        with self._lock:
            n = min(self._batch_size, len(self._queue))
            return [self._queue.popleft() for _ in range(n)]

    async def _next_batch(self) -> _Batch | None:
        if self._pending is not None:
            return self._pending
        entries = self._take()
        if not entries:
            return None
        self._held = (entries[0].seq, len(entries))
        floors = {e.labels: self._floors[e.labels] for e in entries if e.labels in self._floors}
        size = sum(len(e.line) for e in entries)
        try:
            if self._runner is not None and size > _OFF_REACTOR_CHARS:
                body, last = await self._runner.run(encode_batch, entries, floors, self._gzip)
            else:
                body, last = encode_batch(entries, floors, self._gzip)
        except CancelledError:
            self._held = None
            self.dropped_invalid += len(entries)
            raise
        except Exception:
            self._held = None
            self.dropped_invalid += len(entries)
            self.log.failure("Encoding {lines} log lines for Loki failed; they are dropped",
                             lines=len(entries))
            self._notify_seq_waiters()
            return await self._next_batch()
        batch = _Batch(entries[0].seq, entries[-1].seq, len(entries), body, last)
        self._pending = batch
        return batch

    async def _drain(self) -> None:
        while True:
            batch = await self._next_batch()
            if batch is None:
                return
            outcome = await self._deliver(batch)
            if outcome == _RETRY:
                self.pushes_failed += 1
                self.consecutive_failures += 1
                if self._stopping:
                    return
                delay = self._backoff.delay(self.consecutive_failures)
                if self.consecutive_failures == 1 or self.consecutive_failures % 10 == 0:
                    self.log.warn(
                        "Pushing {lines} log lines to Loki failed ({error}); retry {attempt} "
                        "in {delay:.1f} s",
                        lines=batch.lines,
                        error=self.last_error,
                        attempt=self.consecutive_failures,
                        delay=delay,
                    )
                await self._sleep(delay)
                continue
            self._pending = None
            self._held = None
            if outcome == _SENT:
                if self.consecutive_failures:
                    self.log.info(
                        "Loki accepts log lines again after {failures} failed pushes",
                        failures=self.consecutive_failures,
                    )
                self.consecutive_failures = 0
                self.lines_sent += batch.lines
                self.pushes_ok += 1
                self.last_success_at = self._reactor.seconds()
                self._floors.update(batch.floors)
                if len(self._floors) > _MAX_STREAM_FLOORS:
                    for key in list(self._floors)[: len(self._floors) - _MAX_STREAM_FLOORS]:
                        del self._floors[key]
            else:
                self.dropped_rejected += batch.lines
            self._notify_seq_waiters()

    async def _sleep(self, delay: float) -> None:
        d: Deferred[None] = deferLater(self._reactor, delay, lambda: None)
        self._sleeping = d
        try:
            await d
        except CancelledError:
            if not self._stopping:
                raise
        finally:
            self._sleeping = None

    def _notify_seq_waiters(self) -> None:
        if not self._seq_waiters:
            return
        through = self.delivered_through()
        ready = [w for w in self._seq_waiters if w[0] <= through]
        for entry in ready:
            self._seq_waiters.remove(entry)
            entry[1].callback(True)

    async def _post(self, body: bytes) -> tuple[int, bytes]:
        headers = {
            "Content-Type": "application/json",
            "User-Agent": f"llmport-agent/{VERSION}",
        }
        if self._gzip:
            headers["Content-Encoding"] = "gzip"
        kwargs: dict[str, Any] = {"data": body, "headers": headers}
        if self._auth is not None:
            kwargs["auth"] = self._auth
        response = await self._http.post(self._url, **kwargs)
        content = await response.content()
        return int(response.code), bytes(content)

    async def _deliver(self, batch: _Batch) -> str:
        attempt: Deferred[tuple[int, bytes]] = Deferred.fromCoroutine(self._post(batch.body))
        timed_out = False

        def expire() -> None:
            nonlocal timed_out
            timed_out = True
            attempt.cancel()

        timer = self._reactor.callLater(self._timeout, expire)
        try:
            code, content = await attempt
        except Exception as e:
            if timed_out:
                self.last_error = f"no answer within {self._timeout:g} s"
                return _RETRY
            if isinstance(e, CancelledError):
                raise
            self.last_error = _describe_error(e)
            return _RETRY
        finally:
            if timer.active():
                timer.cancel()
        if 200 <= code < 300:
            self.last_error = None
            return _SENT
        detail = content[:300].decode("utf-8", "replace").strip()
        if code == 429 or code >= 500:
            self.last_error = f"HTTP {code}: {detail}" if detail else f"HTTP {code}"
            return _RETRY
        self.last_error = f"HTTP {code}: {detail}" if detail else f"HTTP {code}"
        self.log.error(
            "Loki refused {lines} log lines with HTTP {code} ({detail}); the batch is dropped",
            lines=batch.lines,
            code=code,
            detail=detail or "no detail",
        )
        return _REJECTED


def _describe_error(e: BaseException) -> str:
    reasons = getattr(e, "reasons", None)
    if reasons:
        inner = reasons[0]
        value = getattr(inner, "value", inner)
        return f"{type(e).__name__}: {type(value).__name__}: {value}"[:300]
    return f"{type(e).__name__}: {e}"[:300]
