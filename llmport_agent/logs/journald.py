# -*- test-case-name: tests.test_logs -*-
"""
The host journal as Loki lines: C{journalctl --follow --output=json} as a child process.

Every journal entry becomes one line C{"<unit>: <MESSAGE>"} (redacted) with exactly the labels
of protocol section 8, C{{job: "node-agent", host, container: "node-<agent_id>", level}}, and the
entry's own time (C{__REALTIME_TIMESTAMP}, microseconds -> nanoseconds). C{level} comes from
C{PRIORITY} (0-2 critical, 3 error, 4 warn, 5-6 info, 7 debug); the unit is C{_SYSTEMD_UNIT},
else C{SYSLOG_IDENTIFIER}, else C{_COMM}. Entries written by the agent's own process (C{_PID})
are skipped: the agent ships its own log lines itself, and its complaints about Loki must not
come back through the journal.

B{Parsing.} The reactor splits journalctl's output into lines; a few pending lines (up to
L{INLINE_LINES}) are parsed (JSON, redaction) right there, a backlog in chunks on the worker
pool, one chunk at a time so the order holds; each chunk goes to the shipper in one call.

B{Position.} C{<state dir>/journal.cursor} holds where to resume: the cursor of the last entry
the shipper is done with (sent to Loki, spooled, or dropped), or C{@<unix seconds>} before the first
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
cannot be found, one log line says so and nothing else happens. While the shipper's memory is
80% full (Loki away and the spool full or off), or more than L{MAX_PENDING_BYTES} of output wait
to be parsed, journalctl's pipe is not read (the journal keeps the lines and the position
stands) until there is room again.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from twisted.application.service import Service
from twisted.internet.abstract import FileDescriptor
from twisted.internet.defer import Deferred, DeferredLock
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.fdesc import setNonBlocking
from twisted.internet.main import CONNECTION_DONE, CONNECTION_LOST
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmport_agent.core.backoff import Backoff
from llmport_agent.core.storage import atomic_write
from llmport_agent.core.threads import BlockingRunner
from llmport_agent.core.values import frozen
from llmport_agent.logs.encoding import ENTRY_OVERHEAD, Entry, LabelKey, label_key
from llmport_agent.logs.loki import MAX_LINE_CHARS, ILogSink, RoomWaiter
from llmport_agent.logs.redact import Redactor

__all__ = [
    "CURSOR_FILE",
    "JournalEntry",
    "JournaldSource",
    "PRIORITY_LEVELS",
    "cursor_time",
    "parse_chunk",
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

_FIELDS = "MESSAGE,PRIORITY,_SYSTEMD_UNIT,SYSLOG_IDENTIFIER,_COMM,_PID"
_STDERR_KEEP = 2000

#: One read of journalctl's output.
PIPE_READ_BYTES = 256 * 1024

#: Output waiting to be parsed beyond which journalctl's pipe is no longer read.
MAX_PENDING_BYTES = 4 * 1024 * 1024

#: The most lines parsed in one job (about 10 ms of work per 1000 lines).
CHUNK_LINES = 5000

#: Up to this many pending lines are parsed at once on the reactor (under a millisecond), so a
#: busy journal does not pay a thread hand-over per pipe read; more go to the worker pool.
INLINE_LINES = 256


@frozen
class JournalEntry:
    """One journal entry, reduced to what is shipped."""

    cursor: str | None
    ts_ns: int
    level: str
    unit: str
    message: str
    pid: str | None = None


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
        pid=_text(obj.get("_PID")),
    )


@frozen
class ParsedChunk:
    """What one parse job made of a chunk of journalctl lines (plain data)."""

    entries: list[Entry]
    cursor: str | None  # of the last entry in the chunk that had one
    skipped: int  # entries without a MESSAGE
    own: int  # entries of the agent's own process
    bad: int  # lines that are not JSON objects
    first_error: str | None
    size: int = 0  # what the entries count against the shipper's memory bound


def parse_chunk(
    lines: Sequence[bytes],
    now_ns: int,
    base: Mapping[str, str],
    redact: Callable[[str], str],
    own_pid: str | None,
) -> ParsedChunk:
    """
    Parse journalctl lines into shipper entries: labels C{base} plus C{level}, line
    C{"<unit>: <message>"}, redacted. Pure apart from C{redact}; runs on the worker pool.
    """
    keys: dict[str, LabelKey] = {}
    entries: list[Entry] = []
    cursor: str | None = None
    skipped = own = bad = size = 0
    first_error: str | None = None
    for raw in lines:
        try:
            entry = parse_entry(raw, now_ns)
        except ValueError as e:
            bad += 1
            if first_error is None:
                first_error = str(e)
            continue
        if entry is None:
            skipped += 1
            continue
        if entry.cursor is not None:
            cursor = entry.cursor
        if own_pid is not None and entry.pid == own_pid:
            own += 1
            continue
        key = keys.get(entry.level)
        if key is None:
            key = keys[entry.level] = label_key({**base, "level": entry.level})
        line = redact(f"{entry.unit}: {entry.message}")
        if len(line) > MAX_LINE_CHARS:
            line = line[:MAX_LINE_CHARS] + " [truncated]"
        size += len(line) + ENTRY_OVERHEAD
        entries.append((key, entry.ts_ns, line))
    return ParsedChunk(entries, cursor, skipped, own, bad, first_error, size)


def cursor_time(cursor: str) -> float | None:
    """The Unix time (seconds) of the entry a journal cursor names (its C{t=} part), if any."""
    for part in cursor.split(";"):
        if part.startswith("t="):
            try:
                return int(part[2:], 16) / 1_000_000
            except ValueError:
                return None
    return None


def _grow_pipe(fd: int) -> None:
    """Let journalctl run ahead by up to 1 MiB (Linux; the default pipe holds 64 KiB)."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_READ_BYTES * 4)
    except (OSError, ImportError, ValueError):
        pass  # not Linux, or above /proc/sys/fs/pipe-max-size: the default size does


class _PipeReader(FileDescriptor):
    """
    journalctl's stdout, read up to L{PIPE_READ_BYTES} at a time (Twisted's own process pipes
    read 8 KiB per turn of the reactor, which would cap the journal near 20,000 lines/s).
    """

    def __init__(self, reactor: Any, fd: int, proto: _JournalProtocol) -> None:
        super().__init__(reactor)
        self.fd = fd
        self.proto = proto
        setNonBlocking(fd)

    def fileno(self) -> int:
        return self.fd

    # FileDescriptor's own resumeProducing needs a "connected" transport; a pipe is simpler.
    def pauseProducing(self) -> None:
        self.stopReading()

    def resumeProducing(self) -> None:
        if self.fd >= 0 and not self.disconnected:
            self.startReading()

    def doRead(self) -> Any:
        try:
            data = os.read(self.fd, PIPE_READ_BYTES)
        except BlockingIOError:
            return None
        except OSError:
            return CONNECTION_LOST
        if not data:
            return CONNECTION_DONE
        self.proto.childDataReceived(1, data)
        return None

    def connectionLost(self, reason: Failure) -> None:
        super().connectionLost(reason)
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1
        self.proto.stdout_closed()


class _JournalProtocol(ProcessProtocol):
    """
    Line splitter of one journalctl run (the lines are parsed elsewhere). It tells its
    source through the callables it is given: C{lines(lines, size)} for complete lines,
    C{stderr(text)} on journalctl's first complaint, C{oversized()} per dropped long line,
    C{ended(protocol, reason)} once.
    """

    def __init__(
        self,
        *,
        lines: Callable[[list[bytes], int], None],
        stderr: Callable[[bytes], None],
        oversized: Callable[[], None],
        ended: Callable[[_JournalProtocol, Failure], None],
    ) -> None:
        self._on_lines = lines
        self._on_stderr = stderr
        self._on_oversized = oversized
        self._on_ended = ended
        self._buffer = b""
        self._skipping = False
        self.stderr = b""
        self.ended = False
        self.waiters: list[Deferred[bool]] = []
        self.reader: _PipeReader | None = None
        self._exit: Failure | None = None
        self._stdout_done = False

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.closeStdin()

    def pause(self) -> None:
        """Stop reading journalctl's output (it blocks on a full pipe; the journal keeps lines)."""
        transport: Any = self.transport
        if self.reader is not None:
            self.reader.pauseProducing()
        elif transport is not None:
            transport.pauseProducing()

    def resume(self) -> None:
        transport: Any = self.transport
        if self.reader is not None:
            self.reader.resumeProducing()
        elif transport is not None:
            transport.resumeProducing()

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        if childFD == 2:
            first = not self.stderr
            if len(self.stderr) < _STDERR_KEEP:
                self.stderr = (self.stderr + data)[:_STDERR_KEEP]
            if first:
                self._on_stderr(self.stderr)
            return
        if childFD != 1:
            return
        lines = (self._buffer + data).split(b"\n")
        self._buffer = lines.pop()
        if self._skipping and lines:
            # The rest of an oversized line.
            self._skipping = False
            lines.pop(0)
        if len(self._buffer) > MAX_LINE_BYTES:
            self._buffer = b""
            self._skipping = True
            self._on_oversized()
        self._on_lines(lines, len(data))

    def stdout_closed(self) -> None:
        self._stdout_done = True
        if self._exit is not None:
            self._finish(self._exit)

    def processEnded(self, reason: Failure) -> None:
        self._exit = reason
        if self.reader is None or self._stdout_done:
            self._finish(reason)
        # else: the rest of its output is still in our pipe; the end comes with the pipe's.

    def _finish(self, reason: Failure) -> None:
        if self.ended:
            return
        if self._buffer and not self._skipping:
            self._on_lines([self._buffer], len(self._buffer))
        self._buffer = b""
        self.ended = True
        waiters, self.waiters = self.waiters, []
        for w in waiters:
            if not w.called:
                w.callback(True)
        self._on_ended(self, reason)


class JournaldSource(Service):
    """
    Follows the host journal and pushes every entry into a L{ILogSink}.

    @param reactor: provides C{IReactorProcess} and C{IReactorTime}.
    @param sink: the shipper.
    @param labels_fn: returns the base labels (C{job}, C{host}, C{container}); C{level} is
        added per entry.
    @param runner: runs the blocking and the CPU-heavy bits (the position file, finding
        journalctl, parsing) off the reactor.
    @param state_dir: where C{journal.cursor} lives.
    @param units: only these systemd units (C{--unit} each); all of the journal when C{None}.
    @param directory: read journal files from this directory (C{--directory}) instead of the
        system journal.
    @param journalctl: the executable, looked up on C{PATH} unless it holds a C{/}.
    @param max_priority: the least urgent priority shipped (6 = info; 7 ships debug too).
    @param secrets: returns the exact secret values to mask.
    @param replay_window: at start, never go back further than this many seconds.
    @param own_pid: entries of this process id are skipped (C{"self"}: this process, as it is
        when the service starts, after any daemonizing fork; C{None}: none).
    @param pause_at: the shipper pressure at which reading pauses (it resumes when the
        shipper says there is room again).
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
        own_pid: str | None = "self",
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
        self._own_pid_setting = own_pid
        self._own_pid: str | None = None
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
        self._loop: LoopingCall | None = None
        self._stopping = False
        self._paused = False
        self._room_waiter = RoomWaiter(sink, self._room)
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._parsing: Deferred[None] | None = None
        self._kicking = False
        self._respawn_after_parse = False
        self._started_at = 0.0
        self._used_cursor = False
        self._run_entries = 0
        self._failures = 0

        self.state = "stopped"
        self.entries = 0
        self.skipped = 0
        self.own_skipped = 0
        self.bad_lines = 0
        self.oversized = 0
        self.errors = 0
        self.restarts = 0
        self.pauses = 0
        self.parse_jobs = 0
        self.parse_inline = 0

    def describe(self) -> dict[str, Any]:
        """Counters for diagnostics."""
        return {
            "state": self.state,
            "entries": self.entries,
            "skipped_without_message": self.skipped,
            "skipped_own": self.own_skipped,
            "bad_lines": self.bad_lines,
            "oversized_lines": self.oversized,
            "errors": self.errors,
            "restarts": self.restarts,
            "paused": self._paused,
            "pauses": self.pauses,
            "parse_jobs": self.parse_jobs,
            "parsed_inline": self.parse_inline,
            "pending_bytes": self._pending_bytes,
            "units": list(self._units),
            "directory": self._directory,
        }

    @property
    def paused(self) -> bool:
        """Whether journalctl's output is not being read now (back-pressure)."""
        return self._paused

    # -- lifecycle -------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._stopping = False
        self._own_pid = str(os.getpid()) if self._own_pid_setting == "self" else self._own_pid_setting
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
            fd = os.open(self.cursor_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return exe, None
        except OSError as e:
            self.log.warn(
                "Cannot read the journal position {path}: {error}; starting from now",
                path=self.cursor_path,
                error=e.strerror or str(e),
            )
            return exe, None
        try:
            raw = os.read(fd, 4096)
        finally:
            os.close(fd)
        try:
            saved: str | None = raw.decode("utf-8").strip() or None
        except UnicodeDecodeError:
            self.log.warn("The journal position {path} is not text; starting from now",
                          path=self.cursor_path)
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
        if self._restart_call is not None and self._restart_call.active():
            self._restart_call.cancel()
        self._restart_call = None
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
        # Hand what journalctl printed to the shipper (bounded: with no room, the position
        # simply stays before those lines and they are read again at the next start).
        deadline = self._reactor.seconds() + self._flush_timeout
        while (self._pending or self._parsing is not None) and self._reactor.seconds() < deadline:
            if self._parsing is None:
                self._kick()
                if self._parsing is None:
                    break
            parsing = self._parsing
            assert parsing is not None
            await _bounded(self._reactor, parsing, deadline - self._reactor.seconds())
        if self._cursors:
            # Let the shipper deliver (or spool) what this source queued: the position is exact.
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
            proto.resume()
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
        if self._pending or self._parsing is not None:
            # The new run starts after the last entry parsed: parse what is left first.
            self._respawn_after_parse = True
            self._kick()
            return
        self._respawn_after_parse = False
        proto = _JournalProtocol(
            lines=self._lines, stderr=self._stderr, oversized=self._count_oversized,
            ended=self._ended,
        )
        args = self._args()
        self._started_at = self._reactor.seconds()
        self._run_entries = 0
        self._paused = False
        # Its stdout through a pipe of our own, read in large blocks (with a real reactor).
        pipe = os.pipe() if hasattr(self._reactor, "addReader") else None
        if pipe is not None:
            _grow_pipe(pipe[1])
        child_fds: dict[int, Any] = {0: "w", 1: pipe[1] if pipe else "r", 2: "r"}
        try:
            self._reactor.spawnProcess(proto, self._executable, args, env=self._env(), childFDs=child_fds)
        except Exception as e:
            if pipe is not None:
                os.close(pipe[0])
            self._schedule_restart(f"it could not be started: {e}")
            return
        finally:
            if pipe is not None:
                os.close(pipe[1])
        if pipe is not None:
            proto.reader = _PipeReader(self._reactor, pipe[0], proto)
            proto.reader.startReading()
        self._proto = proto
        self.state = "running"
        self._check_pause()

    def _count_oversized(self) -> None:
        self.oversized += 1

    def _stderr(self, text: bytes) -> None:
        self.log.warn(
            "journalctl says: {stderr}", stderr=text[:500].decode("utf-8", "replace").strip()
        )

    def _ended(self, proto: _JournalProtocol, reason: Failure) -> None:
        if proto is not self._proto:
            return
        self._proto = None
        self._paused = False
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

    # -- lines: split on the reactor, parsed on the pool ------------------------------------

    def _lines(self, lines: list[bytes], size: int = 0) -> None:
        if lines:
            self._pending.extend(line for line in lines if line)
            self._pending_bytes += sum(len(line) for line in lines) + len(lines)
            self._run_entries += len(lines)
            self._kick()
        self._check_pause()

    def _kick(self) -> None:
        """
        Parse what is pending, in order: a few lines at once on the reactor (a fraction of a
        millisecond), a backlog in chunks on the worker pool, one chunk at a time; not while
        the shipper has no room. A loop, not a recursion.
        """
        if self._kicking:
            return
        self._kicking = True
        try:
            while self._parsing is None:
                if not self._pending:
                    if self._respawn_after_parse:
                        self._spawn()
                    return
                try:
                    pressure = float(self._sink.pressure())
                except Exception:
                    pressure = 0.0
                if pressure >= self._pause_at:
                    self._wait_for_room()
                    return
                inline = len(self._pending) <= INLINE_LINES
                chunk = self._pending[:CHUNK_LINES]
                del self._pending[:CHUNK_LINES]
                if not self._pending:
                    self._pending_bytes = 0
                else:
                    self._pending_bytes = max(0, self._pending_bytes - sum(len(x) + 1 for x in chunk))
                try:
                    base = dict(self._labels_fn())
                except Exception:
                    self.errors += 1
                    base = {"job": "node-agent"}
                args = (chunk, int(self._wallclock() * 1_000_000_000), base, self._redact.snapshot(),
                        self._own_pid)
                if inline:
                    self.parse_inline += 1
                    try:
                        self._parsed(parse_chunk(*args))
                    except Exception:
                        self._parse_failed(Failure(), len(chunk))
                    self._check_pause()
                    continue
                self.parse_jobs += 1
                d: Deferred[None] = self._runner.run(parse_chunk, *args).addCallbacks(
                    self._parsed, self._parse_failed, errbackArgs=(len(chunk),)
                )
                if not d.called:
                    self._parsing = d
                    d.addBoth(self._parse_done)
                self._check_pause()
        finally:
            self._kicking = False

    def _parse_done(self, result: object) -> None:
        self._parsing = None
        self._check_pause()
        self._kick()

    def _parse_failed(self, failure: Failure, lines: int) -> None:
        self.errors += 1
        self.log.failure("Parsing {lines} journal lines failed; they are skipped", failure=failure,
                         lines=lines)

    def _parsed(self, chunk: ParsedChunk) -> None:
        self.skipped += chunk.skipped
        self.own_skipped += chunk.own
        if chunk.bad:
            before = self.bad_lines
            self.bad_lines += chunk.bad
            if before == 0 or before // 1000 != self.bad_lines // 1000:
                self.log.warn(
                    "journalctl printed a line that is not a journal entry ({error}); "
                    "{count} so far",
                    error=chunk.first_error,
                    count=self.bad_lines,
                )
        try:
            seq = self._sink.push_many(chunk.entries, chunk.size)
        except Exception:
            self.errors += 1
            if self.errors == 1:
                self.log.failure("Shipping journal entries failed")
            return
        self.entries += len(chunk.entries)
        if chunk.cursor is not None:
            self._last_pushed = chunk.cursor
            self._cursors.append((seq, chunk.cursor))

    # -- back-pressure ---------------------------------------------------------------------

    def _check_pause(self) -> None:
        """Read journalctl's pipe only while there is room downstream."""
        proto = self._proto
        if proto is None or proto.transport is None or self._stopping:
            return
        try:
            full = float(self._sink.pressure()) >= self._pause_at
        except Exception:
            full = False
        want_pause = full or self._pending_bytes > MAX_PENDING_BYTES
        if want_pause and not self._paused:
            proto.pause()
            self._paused = True
            self.pauses += 1
            if full:
                self.log.info("Loki cannot take lines as fast as the journal gives them; "
                              "reading the journal pauses")
                self._wait_for_room()
        elif not want_pause and self._paused:
            self._paused = False
            proto.resume()

    def _room(self) -> None:
        self._check_pause()
        self._kick()

    def _wait_for_room(self) -> None:
        self._room_waiter.wait()

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


async def _bounded(reactor: Any, d: Deferred[Any], timeout: float) -> None:
    """Wait for C{d} at most C{timeout} seconds (without cancelling it)."""
    if d.called:
        return
    waiter: Deferred[None] = Deferred()

    def done(result: object) -> object:
        if not waiter.called:
            waiter.callback(None)
        return result

    d.addBoth(done)
    def expire() -> None:
        if not waiter.called:
            waiter.callback(None)

    timer = reactor.callLater(max(0.0, timeout), expire)
    await waiter
    if timer.active():
        timer.cancel()
