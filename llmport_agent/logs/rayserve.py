# -*- test-case-name: tests.test_logs_rayserve -*-
"""
Ray Serve replica logs as Loki lines (protocol 10.6): every
C{<RAY_SESSION_DIR>/session_*/logs/serve/replica_<app>_<deployment>_<replica>.log} followed
as a stream, labelled C{{job: "ray-serve", host, level, app, deployment, replica}}.

C{RAY_SESSION_DIR} is the host side of the Ray runtime container's C{/tmp/ray}: the container
idles on C{sleep infinity} and each replica writes its own file, so C{docker logs} shows
nothing of them.

B{Hostile files.} The container writes that directory: nothing in it is followed. The
current session is the one C{session_latest} names (read with C{readlink}, never followed:
Ray writes it as an absolute path inside the container) when that is a real directory, else
the newest C{session_*} directory. Directories are entered and files opened through
L{llmport_agent.core.safefs} (no symbolic link, no FIFO or device), at most L{MAX_FILES} files are
followed, lines are cut at L{MAX_LINE_CHARS}, a pass reads at most L{PASS_BYTES} (a file
L{FILE_BYTES}; the rest next pass), and every line is redacted.

B{Positions.} Each file is known by C{<session>/<name>} with its device, inode and the
offset read; the offset saved in C{<state dir>/ray-serve-logs.json} advances only as far as
the shipper is done with the lines (accepted, spooled or dropped), so a restart resumes
exactly behind the last line shipped. Rotation (Ray renames C{x.log} to C{x.log.1} and
starts a new C{x.log}): the old inode is found among the renamed files and read to its end,
the new file is read from its start; a file truncated in place is read again from its start.
A session's files that stop growing after a new session started are still read to their end.
On the very first start (no positions file) existing files are taken from their end, so a
new agent does not replay days of history; afterwards every new file is read whole.

B{Level and time} come from the line: Ray's JSON lines (C{levelname}, C{timestamp_ns},
C{created} or C{asctime}) or its text format (C{"INFO 2026-09-22 09:48:00,673 ..."}); a line
saying neither is C{unknown} at the time it was read.

B{Back-pressure.} While the shipper is full, nothing is read; the files keep the lines.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from attrs import field
from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredLock
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmport_agent.core import safefs
from llmport_agent.core.storage import atomic_write
from llmport_agent.core.threads import BlockingRunner
from llmport_agent.core.values import define
from llmport_agent.logs.encoding import ENTRY_OVERHEAD, Entry, label_key
from llmport_agent.logs.loki import MAX_LINE_CHARS, ILogSink, RoomWaiter
from llmport_agent.logs.redact import Redactor

__all__ = [
    "RAY_SERVE_JOB",
    "RayServeLogSource",
    "STATE_FILE",
    "line_fields",
    "replica_labels",
    "scan",
]

RAY_SERVE_JOB = "ray-serve"
STATE_FILE = "ray-serve-logs.json"
_STATE_VERSION = 1

#: Files followed at most (known ones first).
MAX_FILES = 256
#: Bytes read per pass in all, and from one file.
PASS_BYTES = 4 << 20
FILE_BYTES = 1 << 20
#: Directory entries looked at when listing sessions or a serve directory.
MAX_ENTRIES = 4096
#: Renamed copies of a rotated file looked at (C{x.log.1} .. C{x.log.<n>}).
MAX_ROTATED = 5
#: Checkpoints not yet delivered, kept at most (the next one covers a dropped one).
_MAX_CHECKPOINTS = 256

_SESSION = re.compile(r"^session_[A-Za-z0-9_.:-]{1,128}$")
_REPLICA = re.compile(r"^replica_(?P<rest>[^/]{1,240})\.log$")
_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "warn": "warn",
           "error": "error", "critical": "critical", "fatal": "critical"}
_TEXT_TIME = re.compile(r"^(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d:\d\d)(?:[,.](\d{1,9}))?")


def replica_labels(name: str) -> dict[str, str]:
    """
    C{app}, C{deployment} and C{replica} from C{replica_<app>_<deployment>_<replica>.log}. The
    replica id is the last C{_} field; llm-port's app names (C{llmport-<id>}) hold no C{_}, so
    the app is the first field and the deployment the rest. Missing parts are C{unknown}.
    """
    out = {"app": "unknown", "deployment": "unknown", "replica": "unknown"}
    m = _REPLICA.match(name)
    if not m:
        return out
    head, sep, replica = m.group("rest").rpartition("_")
    if not sep:
        out["replica"] = replica[:128]
        return out
    out["replica"] = replica[:128] or "unknown"
    app, _, deployment = head.partition("_")
    out["app"] = app[:128] or "unknown"
    out["deployment"] = deployment[:128] or "unknown"
    return out


def _level(value: Any) -> str:
    return _LEVELS.get(str(value).strip().lower(), "unknown") if value is not None else "unknown"


def _parse_time(date: str, clock: str, frac: str | None) -> int | None:
    try:
        when = datetime.fromisoformat(f"{date}T{clock}").replace(tzinfo=UTC)
    except ValueError:
        return None
    ns = int(when.timestamp()) * 1_000_000_000
    if frac:
        ns += int(frac.ljust(9, "0")[:9])
    return ns


def line_fields(line: str, now_ns: int) -> tuple[int, str]:
    """C{(time in ns, level label)} of one replica log line (see the module docstring)."""
    ts: int | None = None
    level = "unknown"
    text = line.lstrip()
    if text.startswith("{"):
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError):  # a container's line: nested too deep is not JSON
            doc = None
        if isinstance(doc, dict):
            level = _level(doc.get("levelname", doc.get("level")))
            raw_ns, created, asctime = doc.get("timestamp_ns"), doc.get("created"), doc.get("asctime")
            if isinstance(raw_ns, int) and not isinstance(raw_ns, bool):
                ts = raw_ns
            elif isinstance(created, int | float) and not isinstance(created, bool):
                ts = int(float(created) * 1_000_000_000) if created == created else None
            elif isinstance(asctime, str):
                m = _TEXT_TIME.match(asctime)
                ts = _parse_time(*m.groups()) if m else None
    else:
        first, _, rest = text.partition(" ")
        if first.lower() in _LEVELS:
            level = _LEVELS[first.lower()]
            m = _TEXT_TIME.match(rest)
            ts = _parse_time(*m.groups()) if m else None
    # A time far from now is a parse accident (or a hostile line): the read time instead.
    if ts is None or not now_ns - 30 * 86400 * 1_000_000_000 <= ts <= now_ns + 86400 * 1_000_000_000:
        ts = now_ns
    return ts, level


# ----------------------------------------------------------------------------- the scan


@define(frozen=True)
class Known:
    """Where a file was read to."""

    dev: int
    ino: int
    offset: int


@define
class FileRead:
    """One file's part of a pass: its lines and where reading got to (C{None}: forget it)."""

    key: str
    known: Known | None
    entries: list[tuple[int, str, str]] = field(factory=list)  # (ts_ns, level, line)
    size: int = 0


@define
class ScanResult:
    session: str | None
    files: list[FileRead] = field(factory=list)
    more: bool = False  # the byte budget ran out: read again soon
    problems: list[str] = field(factory=list)


def _current_session(root_fd: int) -> str | None:
    try:
        target = os.readlink("session_latest", dir_fd=root_fd)
    except OSError:
        target = ""
    name = os.path.basename(target.rstrip("/"))
    if _SESSION.match(name):
        st = safefs.lstat_at(root_fd, name)
        if st is not None and stat.S_ISDIR(st.st_mode):
            return name
    best: tuple[float, str] | None = None
    with os.scandir(root_fd) as it:
        for i, entry in enumerate(it):
            if i >= MAX_ENTRIES:
                break
            if not _SESSION.match(entry.name) or not entry.is_dir(follow_symlinks=False):
                continue
            mtime = entry.stat(follow_symlinks=False).st_mtime
            if best is None or (mtime, entry.name) > best:
                best = (mtime, entry.name)
    return best[1] if best else None


def _serve_dir(root_fd: int, session: str) -> int | None:
    try:
        return safefs.open_path_at(root_fd, [session, "logs", "serve"])
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
            return None
        raise


def _list_replicas(dir_fd: int) -> list[str]:
    names: list[str] = []
    with os.scandir(dir_fd) as it:
        for i, entry in enumerate(it):
            if i >= MAX_ENTRIES:
                break
            if _REPLICA.match(entry.name):
                names.append(entry.name)
    return sorted(names)


def _open(dir_fd: int, name: str) -> tuple[int, os.stat_result] | None:
    try:
        return safefs.open_file_at(dir_fd, name)
    except (FileNotFoundError, safefs.NotRegularFile):
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOENT, errno.EISDIR, errno.ENOTDIR):
            return None
        raise


def _read_lines(fd: int, offset: int, limit: int, now_ns: int, redact: Callable[[str], str],
                out: FileRead) -> int:
    """Read whole lines from C{offset} (at most C{limit} bytes); returns the new offset."""
    os.lseek(fd, offset, os.SEEK_SET)
    data = os.read(fd, limit) if limit > 0 else b""
    if not data:
        return offset
    cut = data.rfind(b"\n")
    if cut < 0:
        if len(data) < MAX_LINE_CHARS:
            return offset  # a partial line: wait for its end
        cut = len(data) - 1  # a line longer than the cap so far: ship what there is, in pieces
    usable = data[: cut + 1]
    for raw in usable.split(b"\n"):
        # A line longer than Loki takes goes in pieces (nothing of it is lost).
        for start in range(0, len(raw), MAX_LINE_CHARS):
            line = redact(raw[start:start + MAX_LINE_CHARS].decode("utf-8", "replace").rstrip("\r"))
            if not line:
                continue
            ts, level = line_fields(line, now_ns)
            out.entries.append((ts, level, line))
            out.size += len(line) + ENTRY_OVERHEAD
    return offset + len(usable)


def _finish_rotated(dir_fd: int, name: str, before: Known, limit: int, now_ns: int,
                    redact: Callable[[str], str], read: FileRead) -> tuple[Known | None, int]:
    """
    Read the rest of a rotated file (C{name.1} .. C{name.<MAX_ROTATED>} holding C{before}'s
    inode): C{(where it got to if not at its end, bytes read)}.
    """
    for i in range(1, MAX_ROTATED + 1):
        old = _open(dir_fd, f"{name}.{i}")
        if old is None:
            continue
        fd, st = old
        try:
            if (st.st_dev, st.st_ino) != (before.dev, before.ino):
                continue
            if st.st_size <= before.offset:
                return None, 0
            end = _read_lines(fd, before.offset, min(st.st_size - before.offset, limit), now_ns,
                              redact, read)
            if end < st.st_size:
                return Known(before.dev, before.ino, end), end - before.offset
            return None, end - before.offset
        finally:
            os.close(fd)
    return None, 0


def scan(
    root: str,
    known: Mapping[str, Known],
    *,
    first_run: bool,
    redact: Callable[[str], str] = lambda s: s,
    now_ns: int | None = None,
    pass_bytes: int = PASS_BYTES,
    file_bytes: int = FILE_BYTES,
    max_files: int = MAX_FILES,
) -> ScanResult:
    """
    One pass over the replica logs under C{root} (blocking: on the logs pool). C{known} is
    where each file was read to; the result says where it got to now and carries the lines.
    """
    now_ns = time.time_ns() if now_ns is None else now_ns
    try:
        root_fd = safefs.open_dir(root)
    except OSError:
        return ScanResult(None)
    dirs: dict[str, int | None] = {}
    try:
        session = _current_session(root_fd)
        result = ScanResult(session)
        keys = list(known)[:max_files]
        if session is not None:
            serve = dirs[session] = _serve_dir(root_fd, session)
            if serve is not None:
                for name in _list_replicas(serve):
                    key = f"{session}/{name}"
                    if key not in known and len(keys) < max_files:
                        keys.append(key)
        budget = pass_bytes
        for key in keys:
            sess, _, name = key.partition("/")
            if sess not in dirs:
                dirs[sess] = _serve_dir(root_fd, sess) if _SESSION.match(sess) else None
            dir_fd = dirs[sess]
            read = FileRead(key, None)
            result.files.append(read)
            if dir_fd is None or not _REPLICA.match(name):
                continue  # the session is gone: forget the file
            before = known.get(key)
            opened = _open(dir_fd, name)
            if before is not None and (opened is None or (opened[1].st_dev, opened[1].st_ino)
                                       != (before.dev, before.ino)):
                # Rotated (or removed): finish the old inode if a renamed copy holds it.
                pending, used = _finish_rotated(dir_fd, name, before, min(file_bytes, budget),
                                                now_ns, redact, read)
                budget -= used
                if pending is not None:  # not done with the old one: come back to it
                    result.more = True
                    read.known = pending
                    if opened is not None:
                        os.close(opened[0])
                    continue
                before = None  # the file now at that name is a new one
            if opened is None:
                continue
            fd, st = opened
            try:
                offset = before.offset if before is not None else (st.st_size if first_run else 0)
                if offset > st.st_size:
                    offset = 0  # truncated in place
                take = min(st.st_size - offset, file_bytes, budget)
                end = _read_lines(fd, offset, take, now_ns, redact, read) if take > 0 else offset
                budget -= end - offset
                if end < st.st_size and (take == file_bytes or budget <= 0):
                    result.more = True
                read.known = Known(st.st_dev, st.st_ino, end)
            finally:
                os.close(fd)
        return result
    finally:
        for dfd in dirs.values():
            if dfd is not None:
                os.close(dfd)
        os.close(root_fd)


# ---------------------------------------------------------------------------- the source


def parse_state(raw: bytes) -> dict[str, Known]:
    """The positions in C{ray-serve-logs.json}. @raise ValueError: not that file's format."""
    doc = json.loads(raw)
    if not isinstance(doc, dict) or doc.get("version") != _STATE_VERSION:
        raise ValueError("unknown version")
    files = doc.get("files")
    if not isinstance(files, dict):
        raise ValueError("no files")
    out: dict[str, Known] = {}
    for key, value in list(files.items())[:MAX_FILES]:
        if not isinstance(key, str) or not isinstance(value, dict):
            continue
        nums = [value.get("dev"), value.get("ino"), value.get("offset")]
        if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in nums):
            out[key] = Known(int(nums[0]), int(nums[1]), int(nums[2]))  # type: ignore[arg-type]
    return out


def _read_state(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(4 << 20)
    except FileNotFoundError:
        return None


class RayServeLogSource(Service):
    """
    Follows the replica logs under C{session_dir} and hands their lines to C{sink}.

    @param host: returns the C{host} label (what the backend stores as the node host).
    @param runner: the logs pool (file reads, the positions file).
    @param interval: seconds between passes (sooner while a pass left bytes unread).
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        sink: ILogSink,
        host: Callable[[], str],
        runner: BlockingRunner,
        *,
        session_dir: str,
        state_dir: str,
        secrets: Callable[[], Iterable[str | None]] | None = None,
        interval: float = 2.0,
        save_interval: float = 5.0,
        flush_timeout: float = 5.0,
        pause_at: float = 0.8,
        wallclock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.setName("ray-serve-logs")
        self._reactor = reactor
        self._sink = sink
        self._host = host
        self._runner = runner
        self.session_dir = session_dir
        self.state_path = os.path.join(state_dir, STATE_FILE)
        self._redact = Redactor(secrets)
        self._interval = interval
        self._save_interval = save_interval
        self._flush_timeout = flush_timeout
        self._pause_at = pause_at
        self._now_ns = wallclock_ns
        self._read: dict[str, Known] = {}  # read (and pushed) this far
        self._saved: dict[str, Known] = {}  # the shipper is done this far (persisted)
        self._checkpoints: deque[tuple[int, dict[str, Known | None]]] = deque()
        self._first_run = False
        self._loop: LoopingCall | None = None
        self._pass: Deferred[Any] | None = None
        self._soon: Any = None
        self._room_waiter = RoomWaiter(sink, self._kick)
        self._saved_bytes: bytes | None = None
        self._save_lock = DeferredLock()
        self._last_save = 0.0
        self._problem_said = False
        self.session: str | None = None
        self.lines_shipped = 0
        self.passes = 0

    def describe(self) -> dict[str, Any]:
        return {"session_dir": self.session_dir, "session": self.session or "",
                "files": len(self._read), "lines_shipped": self.lines_shipped}

    # -- lifecycle

    def startService(self) -> None:
        super().startService()
        d = Deferred.fromCoroutine(self._start())
        d.addErrback(lambda f: self.log.failure("Starting the Ray Serve log reader failed", failure=f))

    async def _start(self) -> None:
        try:
            raw = await self._runner.run(_read_state, self.state_path)
        except OSError as e:
            self.log.warn("Cannot read Ray Serve log positions from {path}: {error}; new files are "
                          "read whole", path=self.state_path, error=e.strerror or str(e))
            raw = b""
        if raw is None:
            self._first_run = True  # never ran here: existing files are taken from their end
        elif raw:
            try:
                self._read = parse_state(raw)
                self._saved = dict(self._read)
                self._saved_bytes = raw
            except ValueError as e:
                self.log.warn("Ignoring unreadable Ray Serve log positions in {path}: {error}",
                              path=self.state_path, error=str(e))
        if not self.running:
            return
        self._loop = LoopingCall(self._kick)
        self._loop.clock = self._reactor
        self._loop.start(self._interval, now=True).addErrback(
            lambda f: self.log.failure("The Ray Serve log loop failed", failure=f))

    def stopService(self) -> Deferred[None]:
        super().stopService()
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        if self._soon is not None and self._soon.active():
            self._soon.cancel()
        self._soon = None
        if self._pass is not None:
            await _bounded(self._reactor, self._pass, self._flush_timeout)
        if self._checkpoints:
            await _bounded(self._reactor, self._sink.flush(self._flush_timeout), self._flush_timeout + 1)
        await self._save()

    # -- passes

    def _kick(self) -> None:
        if not self.running or self._pass is not None:
            return
        try:
            full = float(self._sink.pressure()) >= self._pause_at
        except Exception:
            full = False
        if full:
            self._room_waiter.wait()
            return
        d = self._runner.run(scan, self.session_dir, dict(self._read), first_run=self._first_run,
                             redact=self._redact.snapshot(), now_ns=self._now_ns())
        self._pass = d
        d.addCallbacks(self._scanned, self._scan_failed)
        d.addBoth(self._pass_done)

    def _pass_done(self, _: object) -> None:
        self._pass = None
        self.passes += 1
        self._advance()
        if self._reactor.seconds() - self._last_save >= self._save_interval:
            Deferred.fromCoroutine(self._save()).addErrback(
                lambda f: self.log.failure("Saving Ray Serve log positions failed", failure=f))

    def _scan_failed(self, f: Failure) -> None:
        if not self._problem_said:
            self._problem_said = True
            self.log.warn("Reading Ray Serve logs under {dir} failed: {error}; retrying every "
                          "{interval:g} s", dir=self.session_dir, error=f.getErrorMessage(),
                          interval=self._interval)

    def _scanned(self, result: ScanResult) -> None:
        self._first_run = False
        self._problem_said = False
        self.session = result.session
        host = str(self._host())
        changes: dict[str, Known | None] = {}
        pushed: int | None = None
        for read in result.files:
            if read.known != self._read.get(read.key) or read.entries:
                changes[read.key] = read.known
            if not read.entries:
                continue
            meta = replica_labels(read.key.partition("/")[2])
            by_level: dict[str, list[Entry]] = {}
            for ts, level, line in read.entries:
                labels = label_key({"job": RAY_SERVE_JOB, "host": host, "level": level, **meta})
                by_level.setdefault(level, []).append((labels, ts, line))
            for entries in by_level.values():
                size = sum(len(e[2]) + ENTRY_OVERHEAD for e in entries)
                pushed = self._sink.push_many(entries, size)
                self.lines_shipped += len(entries)
        for key, known in changes.items():
            if known is None:
                self._read.pop(key, None)
            else:
                self._read[key] = known
        if changes:
            # Without a line of its own it is due once what came before is delivered.
            if pushed is not None:
                seq = pushed
            elif self._checkpoints:
                seq = self._checkpoints[-1][0]
            else:
                seq = int(self._sink.delivered_through())
            self._checkpoints.append((seq, changes))
            while len(self._checkpoints) > _MAX_CHECKPOINTS:
                # Merge the two oldest (the later one covers the earlier one's files).
                first_seq, first = self._checkpoints.popleft()
                second_seq, second = self._checkpoints.popleft()
                self._checkpoints.appendleft((second_seq, {**first, **second}))
        if result.more and self.running:
            if self._soon is None or not self._soon.active():
                self._soon = self._reactor.callLater(0, self._kick)

    # -- positions

    def _advance(self) -> None:
        through = int(self._sink.delivered_through())
        while self._checkpoints and self._checkpoints[0][0] <= through:
            for key, known in self._checkpoints.popleft()[1].items():
                if known is None:
                    self._saved.pop(key, None)
                else:
                    self._saved[key] = known

    def _state_bytes(self) -> bytes:
        files = {k: {"dev": v.dev, "ino": v.ino, "offset": v.offset} for k, v in self._saved.items()}
        return json.dumps({"version": _STATE_VERSION, "files": files}, sort_keys=True,
                          separators=(",", ":")).encode()

    async def _save(self) -> None:
        # One write at a time: two in flight could land in the wrong order.
        await self._save_lock.acquire()
        try:
            self._advance()
            data = self._state_bytes()
            if data == self._saved_bytes:
                return
            self._last_save = self._reactor.seconds()
            try:
                await self._runner.run(atomic_write, self.state_path, data, 0o600)
            except OSError as e:
                self.log.warn("Saving Ray Serve log positions to {path} failed: {error}",
                              path=self.state_path, error=e.strerror or str(e))
                return
            self._saved_bytes = data
        finally:
            self._save_lock.release()


async def _bounded(reactor: Any, d: Deferred[Any], timeout: float) -> None:
    """Wait for C{d} at most C{timeout} seconds (never cancels it, never raises)."""
    waiter: Deferred[None] = Deferred()

    def done(result: object) -> object:
        if not waiter.called:
            waiter.callback(None)
        return result

    def expire() -> None:
        if not waiter.called:
            waiter.callback(None)

    call = reactor.callLater(timeout, expire)
    d.addBoth(done)
    try:
        await waiter
    finally:
        if call.active():
            call.cancel()
