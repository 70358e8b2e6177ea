# -*- test-case-name: tests.test_logs -*-
"""
The host journal as Loki lines: C{journalctl --follow --output=json} as a child process.

Every journal entry becomes one line (its C{MESSAGE}, redacted) with the labels C{{job:
"node-agent", host, container: "node-<agent_id>", level, unit}} and the entry's own time
(C{__REALTIME_TIMESTAMP}, microseconds -> nanoseconds). C{level} comes from C{PRIORITY}
(0-2 critical, 3 error, 4 warn, 5-6 info, 7 debug); C{unit} is C{_SYSTEMD_UNIT}, else
C{SYSLOG_IDENTIFIER}, else C{_COMM}.

B{Position.} C{<state dir>/journal.cursor} holds where to resume: the cursor of the last entry
the shipper is done with (sent to Loki, or dropped), or C{@<unix seconds>} before the first
entry. It advances only behind the shipper, so a restart (or a crash) never skips a line that
was still queued; at worst a crash re-sends the last few seconds, which Loki stores once
(identical stream, time and line are de-duplicated). At a clean stop the source waits (bounded)
for the shipper to deliver what it queued, so a restart neither loses nor repeats lines. A
position older than C{replay_window} is not replayed in full (journalctl gets C{--since}
instead). The file is managed here rather than with C{journalctl --cursor-file}, because
journalctl would record lines it printed but the shipper never delivered.

B{Process.} Spawned without a shell, stdout parsed as JSON lines (lines over 1 MiB are
skipped), stderr kept for the log line when it exits. When journalctl exits it is restarted
after a jittered exponential backoff (reset after it ran C{stable_after} seconds). When it
cannot be found, one log line says so and nothing else happens. While the shipper's queue is
over 80% full, reading pauses (the journal keeps the lines) until it is under 50%.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from attrs import frozen
from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredLock
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmport_agent.backoff import Backoff
from llmport_agent.logs.loki import ILogSink
from llmport_agent.logs.redact import Redactor
from llmport_agent.storage import atomic_write
from llmport_agent.threads import BlockingRunner

__all__ = [
    "CURSOR_FILE",
    "JournalEntry",
    "JournaldSource",
    "PRIORITY_LEVELS",
    "cursor_time",
    "parse_entry",
]

CURSOR_FILE = "journal.cursor"

#: The C{level} label for each syslog priority.
PRIORITY_LEVELS: dict[int, str] = {
    0: "critical",
    1: "critical",
    2: "critical",
    3: "error",
    4: "warn",
    5: "info",
    6: "info",
    7: "debug",
}

#: A journalctl output line longer than this is skipped (journald's own limit is 48 KiB a field).
MAX_LINE_BYTES = 1024 * 1024

_FIELDS = "MESSAGE,PRIORITY,_SYSTEMD_UNIT,SYSLOG_IDENTIFIER,_COMM"
_STDERR_KEEP = 2000


@frozen
class JournalEntry:
    """One journal entry, reduced to what is shipped."""

    cursor: str | None
    ts_ns: int
    level: str
    unit: str
    message: str


def _first(value: Any) -> Any:
    # A field that occurs several times in one entry is a JSON array of its values.
    if isinstance(value, list) and value and not all(isinstance(v, int) for v in value):
        return value[0]
    return value


def _text(value: Any) -> str | None:
    value = _first(value)
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        # Non-UTF-8 field values come as arrays of byte values.
        try:
            return bytes(value).decode("utf-8", "replace")
        except (ValueError, TypeError):
            return None
    return None


def parse_entry(raw: bytes | str, now_ns: int) -> JournalEntry | None:
    """
    One C{journalctl --output=json} line as a L{JournalEntry}; C{None} for an entry without
    a C{MESSAGE}. A missing or bad C{__REALTIME_TIMESTAMP} becomes C{now_ns}, a missing or bad
    C{PRIORITY} level C{info}.

    @raise ValueError: the line is not a JSON object (the message says what is wrong).
    """
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"not a JSON object but {type(obj).__name__}")
    message = _text(obj.get("MESSAGE"))
    if message is None:
        return None
    ts_ns = now_ns
    realtime = _first(obj.get("__REALTIME_TIMESTAMP"))
    if isinstance(realtime, str) and realtime.isdigit():
        ts_ns = int(realtime) * 1000
    level = "info"
    priority = _first(obj.get("PRIORITY"))
    if isinstance(priority, str) and priority.isdigit() and int(priority) in PRIORITY_LEVELS:
        level = PRIORITY_LEVELS[int(priority)]
    unit = (
        _text(obj.get("_SYSTEMD_UNIT"))
        or _text(obj.get("SYSLOG_IDENTIFIER"))
        or _text(obj.get("_COMM"))
        or "unknown"
    )
    cursor = obj.get("__CURSOR")
    return JournalEntry(
        cursor=cursor if isinstance(cursor, str) and cursor else None,
        ts_ns=ts_ns,
        level=level,
        unit=unit,
        message=message.rstrip("\n"),
    )


def cursor_time(cursor: str) -> float | None:
    """The Unix time (seconds) of the entry a journal cursor names (its C{t=} part), if any."""
    for part in cursor.split(";"):
        if part.startswith("t="):
            try:
                return int(part[2:], 16) / 1_000_000
            except ValueError:
                return None
    return None


class _JournalProtocol(ProcessProtocol):
    """Line-buffered reader of one journalctl run."""

    def __init__(self, source: JournaldSource) -> None:
        self._source = source
        self._buffer = b""
        self._skipping = False
        self.stderr = b""
        self.ended = False
        self.waiters: list[Deferred[bool]] = []

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.closeStdin()

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        if childFD == 2:
            first = not self.stderr
            if len(self.stderr) < _STDERR_KEEP:
                self.stderr = (self.stderr + data)[:_STDERR_KEEP]
            if first:
                self._source._stderr(self.stderr)
            return
        if childFD != 1:
            return
        lines = (self._buffer + data).split(b"\n")
        self._buffer = lines.pop()
        for line in lines:
            if self._skipping:
                self._skipping = False
                continue
            if line:
                self._source._line(line)
        if len(self._buffer) > MAX_LINE_BYTES:
            self._buffer = b""
            self._skipping = True
            self._source.oversized += 1
        self._source._check_pressure(self)

    def processEnded(self, reason: Failure) -> None:
        if self._buffer and not self._skipping:
            self._source._line(self._buffer)
        self._buffer = b""
        self.ended = True
        waiters, self.waiters = self.waiters, []
        for w in waiters:
            if not w.called:
                w.callback(True)
        self._source._ended(self, reason)


class JournaldSource(Service):
    """
    Follows the host journal and pushes every entry into a L{ILogSink}.

    @param reactor: provides C{IReactorProcess} and C{IReactorTime}.
    @param sink: the shipper.
    @param labels_fn: returns the base labels (C{job}, C{host}, C{container}); C{level} and
        C{unit} are added per entry.
    @param runner: runs the blocking bits (reading and writing the position file, finding
        journalctl) off the reactor.
    @param state_dir: where C{journal.cursor} lives.
    @param units: only these systemd units (C{--unit} each); all of the journal when C{None}.
    @param directory: read journal files from this directory (C{--directory}) instead of the
        system journal.
    @param journalctl: the executable, looked up on C{PATH} unless it holds a C{/}.
    @param max_priority: the least urgent priority shipped (6 = info; 7 ships debug too).
    @param secrets: returns the exact secret values to mask.
    @param replay_window: at start, never go back further than this many seconds.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        sink: ILogSink,
        labels_fn: Callable[[], Mapping[str, str]],
        runner: BlockingRunner,
        *,
        state_dir: str,
        units: Sequence[str] | None = None,
        directory: str | None = None,
        journalctl: str = "journalctl",
        max_priority: int = 6,
        secrets: Callable[[], Iterable[str | None]] | None = None,
        cursor_interval: float = 5.0,
        replay_window: float = 6 * 3600.0,
        stop_timeout: float = 5.0,
        flush_timeout: float = 5.0,
        stable_after: float = 30.0,
        backoff: Backoff | None = None,
        pause_at: float = 0.8,
        resume_at: float = 0.5,
        wallclock: Callable[[], float] = time.time,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        if not 0 <= max_priority <= 7:
            raise ValueError(f"max_priority must be 0-7, not {max_priority!r}")
        self.setName("journald")
        self._reactor = reactor
        self._sink = sink
        self._labels_fn = labels_fn
        self._runner = runner
        self.cursor_path = os.path.join(state_dir, CURSOR_FILE)
        self._units = tuple(units) if units else ()
        self._directory = directory
        self._journalctl = journalctl
        self._max_priority = max_priority
        self._redact = Redactor(secrets)
        self._cursor_interval = cursor_interval
        self._replay_window = replay_window
        self._stop_timeout = stop_timeout
        self._flush_timeout = flush_timeout
        self._stable_after = stable_after
        self._backoff = backoff if backoff is not None else Backoff(1.0, 60.0)
        self._pause_at = pause_at
        self._resume_at = resume_at
        self._wallclock = wallclock
        self._environ = environ if environ is not None else os.environ

        self._executable: str | None = None
        self._position: str | None = None  # persisted form: a cursor or "@<unix seconds>"
        self._saved: str | None = None
        self._last_pushed: str | None = None
        self._cursors: deque[tuple[int, str]] = deque()
        self._save_lock = DeferredLock()
        self._proto: _JournalProtocol | None = None
        self._restart_call: Any = None
        self._resume_call: Any = None
        self._loop: LoopingCall | None = None
        self._stopping = False
        self._paused = False
        self._started_at = 0.0
        self._used_cursor = False
        self._run_entries = 0
        self._failures = 0

        self.state = "stopped"
        self.entries = 0
        self.skipped = 0
        self.bad_lines = 0
        self.oversized = 0
        self.errors = 0
        self.restarts = 0

    def describe(self) -> dict[str, Any]:
        """Counters for diagnostics."""
        return {
            "state": self.state,
            "entries": self.entries,
            "skipped_without_message": self.skipped,
            "bad_lines": self.bad_lines,
            "oversized_lines": self.oversized,
            "errors": self.errors,
            "restarts": self.restarts,
            "paused": self._paused,
            "units": list(self._units),
            "directory": self._directory,
        }

    # -- lifecycle -------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._stopping = False
        self.state = "starting"
        d = Deferred.fromCoroutine(self._start())
        d.addErrback(lambda f: self.log.failure("Starting the journal reader failed", failure=f))

    def _prepare(self) -> tuple[str | None, str | None]:
        """Blocking: find journalctl and read the saved position."""
        if "/" in self._journalctl:
            exe = self._journalctl if os.access(self._journalctl, os.X_OK) else None
        else:
            exe = shutil.which(self._journalctl, path=self._environ.get("PATH"))
        try:
            with open(self.cursor_path, encoding="utf-8") as f:
                saved: str | None = f.read(4096).strip() or None
        except FileNotFoundError:
            saved = None
        except (OSError, UnicodeDecodeError) as e:
            self.log.warn(
                "Cannot read the journal position {path}: {error}; starting from now",
                path=self.cursor_path,
                error=str(e),
            )
            saved = None
        return exe, saved

    async def _start(self) -> None:
        exe, saved = await self._runner.run(self._prepare)
        if not self.running or self._stopping:
            return
        if exe is None:
            self.state = "unavailable"
            self.log.warn(
                "journalctl was not found ({journalctl!r}); the host journal will not be "
                "shipped to Loki",
                journalctl=self._journalctl,
            )
            return
        self._executable = exe
        self._saved = saved
        self._position = saved
        if saved is None:
            # Before the first entry: remember when we started, so a restart picks up from here.
            self._position = f"@{int(self._wallclock())}"
            await self._save()
            if not self.running or self._stopping:
                return
        loop = LoopingCall(self._tick)
        loop.clock = self._reactor
        self._loop = loop
        loop.start(self._cursor_interval, now=False).addErrback(
            lambda f: self.log.failure("The journal position loop failed", failure=f)
        )
        self._spawn()

    def stopService(self) -> Deferred[None]:
        super().stopService()
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        self._stopping = True
        for name in ("_restart_call", "_resume_call"):
            call = getattr(self, name)
            if call is not None and call.active():
                call.cancel()
            setattr(self, name, None)
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        proto = self._proto
        if proto is not None and not proto.ended:
            self._signal(proto, "TERM")
            if not await self._wait_ended(proto, self._stop_timeout):
                self.log.warn("journalctl did not stop on SIGTERM; killing it")
                self._signal(proto, "KILL")
                await self._wait_ended(proto, 2.0)
        if self._cursors:
            # Let the shipper deliver what this source queued, so the saved position is exact.
            await self._sink.flush(self._flush_timeout)
        self._advance()
        if self._executable is not None:
            await self._save()
        self.state = "stopped"

    def _signal(self, proto: _JournalProtocol, signal: str) -> None:
        transport: Any = proto.transport
        if transport is None:
            return
        try:
            transport.resumeProducing()
            transport.signalProcess(signal)
        except ProcessExitedAlready:
            pass
        except Exception as e:
            self.log.warn("Signalling journalctl failed: {error}", error=str(e))

    def _wait_ended(self, proto: _JournalProtocol, timeout: float) -> Deferred[bool]:
        d: Deferred[bool] = Deferred()
        if proto.ended:
            d.callback(True)
            return d
        proto.waiters.append(d)

        def expire() -> None:
            if not d.called:
                proto.waiters.remove(d)
                d.callback(False)

        timer = self._reactor.callLater(timeout, expire)

        def done(result: bool) -> bool:
            if timer.active():
                timer.cancel()
            return result

        return d.addCallback(done)

    # -- the child process -----------------------------------------------------------------

    def _args(self) -> list[str]:
        assert self._executable is not None
        args = [
            self._executable,
            "--follow",
            "--output=json",
            "--all",
            "--no-pager",
            f"--output-fields={_FIELDS}",
            f"--priority={self._max_priority}",
        ]
        if self._directory:
            args.append(f"--directory={self._directory}")
        args.extend(f"--unit={unit}" for unit in self._units)
        args.extend(self._start_position())
        return args

    def _start_position(self) -> list[str]:
        now = self._wallclock()
        oldest = now - self._replay_window
        position = self._last_pushed or self._position
        self._used_cursor = False
        if position and not position.startswith("@"):
            when = cursor_time(position)
            if when is None or when >= oldest:
                self._used_cursor = True
                return [f"--after-cursor={position}"]
            self.log.info(
                "The saved journal position is {age:.0f} s old; resuming {window:.0f} s back",
                age=now - when,
                window=self._replay_window,
            )
            return [f"--since=@{int(oldest)}"]
        since = now
        if position:
            try:
                since = max(float(position[1:]), oldest)
            except ValueError:
                since = now
        return [f"--since=@{int(since)}"]

    def _env(self) -> dict[str, str]:
        return {
            "PATH": self._environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "SYSTEMD_COLORS": "0",
            "SYSTEMD_PAGER": "",
        }

    def _spawn(self) -> None:
        self._restart_call = None
        if not self.running or self._stopping or self._executable is None:
            return
        proto = _JournalProtocol(self)
        args = self._args()
        self._started_at = self._reactor.seconds()
        self._run_entries = 0
        self._paused = False
        try:
            self._reactor.spawnProcess(
                proto, self._executable, args, env=self._env(), childFDs={0: "w", 1: "r", 2: "r"}
            )
        except Exception as e:
            self._schedule_restart(f"it could not be started: {e}")
            return
        self._proto = proto
        self.state = "running"

    def _stderr(self, text: bytes) -> None:
        self.log.warn(
            "journalctl says: {stderr}", stderr=text[:500].decode("utf-8", "replace").strip()
        )

    def _ended(self, proto: _JournalProtocol, reason: Failure) -> None:
        if proto is not self._proto:
            return
        self._proto = None
        self._paused = False
        if self._resume_call is not None and self._resume_call.active():
            self._resume_call.cancel()
        self._resume_call = None
        if self._stopping or not self.running:
            return
        code = getattr(reason.value, "exitCode", None)
        signal = getattr(reason.value, "signal", None)
        if self._run_entries == 0 and self._used_cursor and code not in (0, None):
            self.log.warn(
                "journalctl refused the saved journal position; starting from now instead"
            )
            self._position = f"@{int(self._wallclock())}"
            self._last_pushed = None
        if self._reactor.seconds() - self._started_at >= self._stable_after:
            self._failures = 0
        detail = proto.stderr[:500].decode("utf-8", "replace").strip()
        self._schedule_restart(
            f"it exited with code {code}" if signal is None else f"it was killed by signal {signal}",
            detail,
        )

    def _schedule_restart(self, why: str, detail: str = "") -> None:
        self._failures += 1
        self.restarts += 1
        delay = self._backoff.delay(self._failures)
        self.state = "restarting"
        self.log.warn(
            "Reading the journal stopped: {why} ({detail}); journalctl restarts in {delay:.1f} s",
            why=why,
            detail=detail or "no message",
            delay=delay,
        )
        self._restart_call = self._reactor.callLater(delay, self._spawn)

    def _line(self, raw: bytes) -> None:
        try:
            entry = parse_entry(raw, int(self._wallclock() * 1_000_000_000))
        except ValueError as e:
            self.bad_lines += 1
            if self.bad_lines == 1 or self.bad_lines % 1000 == 0:
                self.log.warn(
                    "journalctl printed a line that is not a journal entry ({error}); "
                    "{count} so far",
                    error=str(e),
                    count=self.bad_lines,
                )
            return
        if entry is None:
            self.skipped += 1
            return
        try:
            labels = dict(self._labels_fn())
            labels["level"] = entry.level
            labels["unit"] = entry.unit
            seq = self._sink.push(labels, entry.ts_ns, self._redact(entry.message))
        except Exception:
            self.errors += 1
            if self.errors == 1:
                self.log.failure("Shipping a journal entry failed")
            return
        self.entries += 1
        self._run_entries += 1
        if entry.cursor is not None:
            self._last_pushed = entry.cursor
            self._cursors.append((seq, entry.cursor))

    # -- back-pressure ---------------------------------------------------------------------

    def _check_pressure(self, proto: _JournalProtocol) -> None:
        if self._paused or self._stopping or proto is not self._proto:
            return
        if self._sink.pressure() >= self._pause_at:
            transport: Any = proto.transport
            if transport is None:
                return
            transport.pauseProducing()
            self._paused = True
            self.log.info("The Loki queue is nearly full; reading the journal pauses")
            self._resume_call = self._reactor.callLater(1.0, self._maybe_resume)

    def _maybe_resume(self) -> None:
        self._resume_call = None
        proto = self._proto
        if not self._paused or proto is None:
            return
        if self._sink.pressure() <= self._resume_at:
            self._paused = False
            transport: Any = proto.transport
            if transport is not None:
                transport.resumeProducing()
            self.log.info("Reading the journal resumes")
            return
        self._resume_call = self._reactor.callLater(1.0, self._maybe_resume)

    # -- position --------------------------------------------------------------------------

    def _advance(self) -> None:
        through = self._sink.delivered_through()
        latest: str | None = None
        while self._cursors and self._cursors[0][0] <= through:
            latest = self._cursors.popleft()[1]
        if latest is not None:
            self._position = latest

    def _tick(self) -> None:
        self._advance()
        if self._position != self._saved:
            d = Deferred.fromCoroutine(self._save())
            d.addErrback(lambda f: self.log.failure("Saving the journal position failed", failure=f))

    async def _save(self) -> None:
        await self._save_lock.acquire()
        try:
            position = self._position
            if position is None or position == self._saved:
                return
            try:
                await self._runner.run(
                    atomic_write, self.cursor_path, position.encode("utf-8") + b"\n", 0o600
                )
            except OSError as e:
                self.log.warn(
                    "Cannot save the journal position to {path}: {error}",
                    path=self.cursor_path,
                    error=str(e),
                )
                return
            self._saved = position
        finally:
            self._save_lock.release()
