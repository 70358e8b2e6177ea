# -*- test-case-name: tests.test_logs_containers -*-
"""
Workload (container) logs as Loki lines (protocol section 8, "container logs").

L{ContainerLogSource} polls the Docker engine every C{interval} seconds (a L{LoopingCall} on
the injected reactor; iterations never overlap):

 1. one engine call lists the managed containers (L{list_managed});
 2. for each running one (and once more for one that stopped since the last poll, to catch
    its last lines), one engine call fetches C{logs(stdout, stderr, timestamps=True,
    since=<whole seconds of the last shipped line>, tail=max_lines_per_poll)}, parses the
    RFC3339Nano timestamp prefix of each line into Unix ns, drops lines at or before the last
    shipped ns (C{since} has second granularity, so the last second comes back every time)
    and redacts secrets, all inside the thread function;
 3. back on the reactor thread the lines are pushed to the sink with the labels
    C{{job: "node-container", host, container: <container name>, runtime_id}}.

A container seen for the first time starts from its start, or its last
L{NEW_CONTAINER_TAIL} lines (never more than C{max_lines_per_poll}). Containers that
disappear from the list are forgotten. A poll is skipped while the engine is unavailable or
while the sink's queue is at least L{HIGH_PRESSURE} full (the engine keeps the lines; the next
poll picks them up with C{since}). A failing poll is logged once when polls start failing and
once when they work again; it never stops the loop.

B{Position.} Per container (by id) the ns of the last line the sink is done with (sent to Loki
or dropped, per C{sink.delivered_through()} when the sink has it) is saved as small JSON in
C{<state_dir>/container-logs.json} (atomic write, through the engine's pool, at most every
C{save_interval} seconds and at stop), so an agent restart resumes where delivery stopped: at
worst it re-sends a few lines, which Loki stores once (same stream, time and line).
"""

from __future__ import annotations

import calendar
import json
import os
import re
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol

from attrs import define, field, frozen
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from llmport_agent.logs.loki import ILogSink
from llmport_agent.logs.redact import Redactor
from llmport_agent.storage import atomic_write
from llmport_agent.workloads.containers import list_managed
from llmport_agent.workloads.spec import LABEL_RUNTIME_ID

__all__ = [
    "CONTAINER_JOB",
    "ContainerLogSource",
    "HIGH_PRESSURE",
    "NEW_CONTAINER_TAIL",
    "STATE_FILE",
    "Fetched",
    "parse_log_output",
    "parse_timestamp",
]

CONTAINER_JOB = "node-container"
STATE_FILE = "container-logs.json"

#: Lines fetched at most for a container seen for the first time.
NEW_CONTAINER_TAIL = 1000

#: Polls are skipped while the sink's queue is at least this full.
HIGH_PRESSURE = 0.8

#: Positions not yet known delivered, remembered per container (oldest dropped first).
_MAX_PENDING = 64

_STATE_VERSION = 1

#: Container states whose logs are polled (a crash-looping container is mostly "restarting").
_ACTIVE = ("running", "restarting")

#: Seconds the stop waits for the sink to deliver what this source queued.
_STOP_FLUSH_TIMEOUT = 5.0

_TIMESTAMP = re.compile(
    rb"^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(?:[.,](\d{1,9}))?"
    rb"(Z|[+-]\d{2}:?\d{2})(?: |$)"
)


class _Engine(Protocol):
    """The part of L{llmport_agent.workloads.engine.DockerEngine} used here."""

    available: bool

    def call(self, fn: Callable[..., Any], *args: Any, what: str | None = None) -> Awaitable[Any]:
        """Run C{fn(client, *args)} off the reactor thread."""


def parse_timestamp(raw: bytes) -> tuple[int, int] | None:
    """
    The RFC3339Nano timestamp at the start of C{raw} (as Docker writes it with
    C{timestamps=True}): C{(unix_ns, length of the prefix including the separating space)}, or
    C{None} when C{raw} does not start with one.
    """
    m = _TIMESTAMP.match(raw)
    if m is None:
        return None
    try:
        year, month, day, hour, minute, second = (int(m.group(i)) for i in range(1, 7))
        if not (1 <= month <= 12 and 1 <= day <= 31 and hour < 24 and minute < 60 and second < 61):
            return None
        seconds = calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0))
    except (ValueError, OverflowError):
        return None
    frac = m.group(7) or b""
    nanos = int(frac.ljust(9, b"0")) if frac else 0
    zone = m.group(8)
    if zone != b"Z":
        sign = -1 if zone[:1] == b"-" else 1
        digits = zone[1:].replace(b":", b"")
        seconds -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    ns = seconds * 1_000_000_000 + nanos
    if ns < 0:
        return None
    return ns, m.end()


@frozen
class Fetched:
    """
    The new lines of one container from one poll (plain data, built in a worker thread).

    @ivar lines: C{(unix_ns, redacted line)} in log order, all after the last shipped ns.
    @ivar returned: lines the engine returned (before dropping already shipped ones).
    @ivar duplicates: lines dropped as at or before the last shipped ns.
    @ivar unparsed: lines without a timestamp prefix, shipped with the previous line's time
        (or dropped when no line before them had one).
    """

    lines: list[tuple[int, str]]
    returned: int
    duplicates: int
    unparsed: int


def parse_log_output(raw: bytes, after_ns: int, redact: Callable[[str], str]) -> Fetched:
    """
    Split C{docker logs --timestamps} output into C{(ns, line)}, keeping lines after
    C{after_ns}, decoded as UTF-8 (bad bytes replaced), C{\\r} endings dropped, redacted. Pure.
    """
    if not isinstance(raw, (bytes, bytearray)):
        raw = b"".join(raw) if raw is not None else b""
    chunks = bytes(raw).split(b"\n")
    if chunks and chunks[-1] == b"":
        chunks.pop()
    out: list[tuple[int, str]] = []
    duplicates = unparsed = 0
    previous: int | None = None
    for chunk in chunks:
        parsed = parse_timestamp(chunk)
        if parsed is None:
            unparsed += 1
            if previous is None:
                continue
            ts, body = previous, chunk
        else:
            ts, body = parsed[0], chunk[parsed[1] :]
            previous = ts
        if ts <= after_ns:
            duplicates += 1
            continue
        if body.endswith(b"\r"):
            body = body[:-1]
        out.append((ts, redact(body.decode("utf-8", "replace"))))
    return Fetched(out, len(chunks), duplicates, unparsed)


def _fetch(
    client: Any,
    container_id: str,
    since: float | None,
    tail: int,
    after_ns: int,
    redact: Callable[[str], str],
) -> Fetched:
    """Thread function: one C{logs} request for a container, parsed and redacted."""
    raw = client.api.logs(
        container_id, stdout=True, stderr=True, timestamps=True, since=since, tail=tail
    )
    return parse_log_output(raw, after_ns, redact)


def _list(client: Any) -> list[dict[str, Any]]:
    """Thread function: the managed containers (one request)."""
    return list_managed(client)


def _read_state(_client: Any, path: str) -> bytes | None:
    """Thread function: the state file's bytes, C{None} when there is none."""
    try:
        with open(path, "rb") as f:
            return f.read(4 * 1024 * 1024)
    except FileNotFoundError:
        return None


def _write_state(_client: Any, path: str, data: bytes) -> None:
    """Thread function: replace the state file atomically."""
    atomic_write(path, data)


@define
class _Tracked:
    """What is known about one container's logs."""

    name: str
    runtime_id: str
    shipped_ns: int = 0
    saved_ns: int = 0
    running: bool = True
    final_fetch: bool = False
    pending: deque[tuple[int, int]] = field(factory=lambda: deque(maxlen=_MAX_PENDING))


class ContainerLogSource(Service):
    """
    Ships managed containers' logs to a L{ILogSink}. See the module docstring.

    @param reactor: provides C{IReactorTime}; the poll loop runs on it.
    @param engine: the L{DockerEngine} (C{call(fn, *args, what=)} and C{available}).
    @param sink: where lines go (the L{LokiShipper}): C{push}, C{pressure} and, optionally,
        C{delivered_through}.
    @param host: returns the C{host} label (what the backend stores as the node host).
    @param interval: seconds between polls.
    @param max_lines_per_poll: the most lines fetched for one container in one poll.
    @param secrets: returns the exact secret values to mask in every line.
    @param state_dir: where C{container-logs.json} is kept; positions only in memory if C{None}.
    @param save_interval: the least seconds between two writes of the state file.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        engine: _Engine,
        sink: ILogSink,
        host: Callable[[], str],
        *,
        interval: float = 5.0,
        max_lines_per_poll: int = 2000,
        secrets: Callable[[], Iterable[str | None]] | None = None,
        state_dir: str | None = None,
        save_interval: float = 30.0,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, not {interval!r}")
        if max_lines_per_poll < 1:
            raise ValueError(f"max_lines_per_poll must be >= 1, not {max_lines_per_poll!r}")
        self.setName("container-logs")
        self._reactor = reactor
        self._engine = engine
        self._sink = sink
        self._host = host
        self._interval = float(interval)
        self._max_lines = int(max_lines_per_poll)
        self._redact = Redactor(secrets)
        self._path = os.path.join(state_dir, STATE_FILE) if state_dir else None
        self._save_interval = float(save_interval)
        self._tracked: dict[str, _Tracked] = {}
        self._loaded = self._path is None
        self._dirty = False
        self._last_save: float | None = None
        self._saved_text: bytes | None = None
        self._loop: LoopingCall | None = None
        self._tick_d: Deferred[None] | None = None
        self._error: str | None = None
        self._stopping = False

        # Counters.
        self.polls = 0
        self.polls_failed = 0
        self.skipped_unavailable = 0
        self.skipped_pressure = 0
        self.polls_truncated = 0
        self.lines_shipped = 0
        self.lines_duplicate = 0
        self.lines_unparsed = 0
        self.containers_forgotten = 0
        self.state_saves = 0
        self.state_save_failures = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._stopping = False
        loop = LoopingCall(self._tick)
        loop.clock = self._reactor
        self._loop = loop
        loop.start(self._interval, now=True).addErrback(
            lambda f: self.log.failure("container log loop died", failure=f)
        )

    def stopService(self) -> Deferred[None]:
        super().stopService()
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        self._stopping = True
        loop, self._loop = self._loop, None
        if loop is not None and loop.running:
            loop.stop()
        tick = self._tick_d
        if tick is not None:
            tick.cancel()
        flush = getattr(self._sink, "flush", None)
        if flush is not None and any(info.pending for info in self._tracked.values()):
            # Let the sink deliver what this source queued, so the saved position is exact.
            try:
                await flush(_STOP_FLUSH_TIMEOUT)
            except Exception:
                self.log.failure("Waiting for the log sink at stop failed")
        if self._loaded and (self._dirty or self._tracked):
            await self._save(force=True)

    def describe(self) -> dict[str, Any]:
        """Counters for diagnostics and metrics."""
        return {
            "containers": len(self._tracked),
            "polls": self.polls,
            "polls_failed": self.polls_failed,
            "skipped_unavailable": self.skipped_unavailable,
            "skipped_pressure": self.skipped_pressure,
            "polls_truncated": self.polls_truncated,
            "lines_shipped": self.lines_shipped,
            "lines_duplicate": self.lines_duplicate,
            "lines_unparsed": self.lines_unparsed,
            "containers_forgotten": self.containers_forgotten,
            "state_saves": self.state_saves,
            "state_save_failures": self.state_save_failures,
            "last_error": self._error,
        }

    # -- polling -------------------------------------------------------------------------------

    def _tick(self) -> Deferred[None]:
        d = Deferred.fromCoroutine(self._poll_safely())
        self._tick_d = d

        def done(result: object) -> None:
            self._tick_d = None

        d.addBoth(done)
        return d

    async def _poll_safely(self) -> None:
        try:
            await self._poll()
        except CancelledError:
            return
        except Exception as e:
            self.polls_failed += 1
            message = getattr(e, "error_message", None)
            if isinstance(message, str):
                self._failed(message)  # an engine error: expected now and then
            else:
                if self._error is None:
                    self.log.failure("Polling container logs failed")
                self._error = f"{type(e).__name__}: {e}"

    async def _poll(self) -> None:
        if not self._engine.available:
            self.skipped_unavailable += 1
            return
        try:
            pressure = float(self._sink.pressure())
        except Exception:
            pressure = 0.0
        if pressure >= HIGH_PRESSURE:
            self.skipped_pressure += 1
            return
        if not self._loaded:
            await self._load()
        self.polls += 1
        rows = await self._engine.call(_list, what="list managed containers for logs")
        errors = self._reconcile(rows)
        for cid, info in list(self._tracked.items()):
            if self._stopping:
                return
            error = await self._fetch_one(cid, info)
            if error is not None:
                errors.append(error)
                if getattr(error, "unreachable", False):
                    break
        if errors:
            self.polls_failed += 1
            self._failed(str(getattr(errors[0], "error_message", None) or errors[0]))
        elif self._error is not None:
            self.log.info("Container logs are fetched again")
            self._error = None
        await self._save()

    def _reconcile(self, rows: Any) -> list[Any]:
        """Update the tracked set from a C{list_managed} answer; returns bad-row errors."""
        seen: set[str] = set()
        errors: list[Any] = []
        for row in rows if isinstance(rows, list) else []:
            try:
                cid = str(row["id"])
                name = str(row.get("name") or cid[:12])
                labels = row.get("labels") or {}
                runtime_id = str(labels.get(LABEL_RUNTIME_ID) or "")
                running = row.get("state") in _ACTIVE or row.get("running") is True
            except (KeyError, TypeError, AttributeError) as e:
                errors.append(ValueError(f"container list entry without a usable id/name: {e}"))
                continue
            seen.add(cid)
            info = self._tracked.get(cid)
            if info is None:
                if running:
                    self._tracked[cid] = _Tracked(name, runtime_id)
                continue
            info.name, info.runtime_id = name, runtime_id
            if running:
                info.running = True
            elif info.running:
                info.running = False
                info.final_fetch = True  # its last lines, once
        for cid in [c for c in self._tracked if c not in seen]:
            del self._tracked[cid]
            self.containers_forgotten += 1
            self._dirty = True
        return errors

    async def _fetch_one(self, cid: str, info: _Tracked) -> Exception | None:
        if not info.running:
            if not info.final_fetch:
                return None
            info.final_fetch = False
        if info.shipped_ns > 0:
            since: float | None = float(max(1, info.shipped_ns // 1_000_000_000))
            tail = self._max_lines
        else:
            since = None
            tail = min(self._max_lines, NEW_CONTAINER_TAIL)
        try:
            fetched: Fetched = await self._engine.call(
                _fetch, cid, since, tail, info.shipped_ns, self._redact, what="container logs"
            )
        except CancelledError:
            raise
        except Exception as e:
            if getattr(e, "status_code", None) == 404:
                # Removed between the list and the fetch: forgotten at the next list.
                return None
            return e
        self.lines_duplicate += fetched.duplicates
        self.lines_unparsed += fetched.unparsed
        if fetched.returned >= tail and since is not None:
            self.polls_truncated += 1
        if not fetched.lines:
            return None
        labels = {
            "job": CONTAINER_JOB,
            "host": str(self._host()),
            "container": info.name,
            "runtime_id": info.runtime_id,
        }
        seq = 0
        last = info.shipped_ns
        for ts, line in fetched.lines:
            seq = self._sink.push(labels, ts, line)
            if ts > last:
                last = ts
        self.lines_shipped += len(fetched.lines)
        info.shipped_ns = last
        info.pending.append((int(seq) if isinstance(seq, int) else 0, last))
        self._dirty = True
        return None

    def _failed(self, message: str) -> None:
        if self._error is None:
            self.log.warn(
                "Fetching container logs failed: {error} (retrying every {interval} s)",
                error=message,
                interval=self._interval,
            )
        self._error = message

    # -- position ------------------------------------------------------------------------------

    def _advance(self) -> None:
        """Move each container's saved position up to what the sink is done with."""
        through_fn = getattr(self._sink, "delivered_through", None)
        through: int | None = None
        if through_fn is not None:
            try:
                through = int(through_fn())
            except Exception:
                through = None
        for info in self._tracked.values():
            while info.pending:
                seq, ns = info.pending[0]
                if through is not None and seq > through:
                    break
                info.pending.popleft()
                if ns > info.saved_ns:
                    info.saved_ns = ns

    def _state_bytes(self) -> bytes:
        containers = {
            cid: {"ns": info.saved_ns, "name": info.name}
            for cid, info in self._tracked.items()
            if info.saved_ns > 0
        }
        doc = {"version": _STATE_VERSION, "containers": containers}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    async def _save(self, force: bool = False) -> None:
        if self._path is None:
            return
        now = self._reactor.seconds()
        if not force and self._last_save is not None and now - self._last_save < self._save_interval:
            return
        self._advance()
        data = self._state_bytes()
        if data == self._saved_text:
            self._dirty = False
            return
        self._last_save = now
        try:
            await self._engine.call(_write_state, self._path, data, what="save container log positions")
        except CancelledError:
            raise
        except Exception as e:
            self.state_save_failures += 1
            if self.state_save_failures == 1 or self.state_save_failures % 100 == 0:
                self.log.warn(
                    "Saving container log positions to {path} failed: {error}",
                    path=self._path,
                    error=str(getattr(e, "error_message", None) or e),
                )
            return
        self._saved_text = data
        self._dirty = False
        self.state_saves += 1

    async def _load(self) -> None:
        assert self._path is not None
        raw = await self._engine.call(_read_state, self._path, what="read container log positions")
        self._loaded = True
        if raw is None:
            return
        try:
            positions = _parse_state(raw)
        except ValueError as e:
            self.log.warn(
                "Ignoring unreadable container log positions in {path}: {error}",
                path=self._path,
                error=str(e),
            )
            return
        for cid, (ns, name) in positions.items():
            if cid not in self._tracked:
                # running=True: if it stopped while the agent was down, fetch its last lines.
                self._tracked[cid] = _Tracked(name, "", shipped_ns=ns, saved_ns=ns)
        self._saved_text = raw


def _parse_state(raw: bytes) -> dict[str, tuple[int, str]]:
    """C{{container id: (ns, name)}} from the state file. @raise ValueError: bad content."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(doc, Mapping):
        raise ValueError("the document is not an object")
    if doc.get("version") != _STATE_VERSION:
        raise ValueError(f"field 'version' is {doc.get('version')!r}, not {_STATE_VERSION}")
    containers = doc.get("containers")
    if not isinstance(containers, Mapping):
        raise ValueError("field 'containers' is not an object")
    out: dict[str, tuple[int, str]] = {}
    for cid, entry in containers.items():
        if not isinstance(entry, Mapping):
            raise ValueError(f"field 'containers.{cid}' is not an object")
        ns = entry.get("ns")
        name = entry.get("name", "")
        if not isinstance(ns, int) or isinstance(ns, bool) or ns < 0:
            raise ValueError(f"field 'containers.{cid}.ns' is not a non-negative integer")
        if not isinstance(name, str):
            raise ValueError(f"field 'containers.{cid}.name' is not a string")
        out[str(cid)] = (ns, name)
    return out
