"""
Durable files: atomic replacement and an append-only JSON-lines log with group commit.

The blocking functions here run in worker threads (through a L{BlockingRunner}); the reactor-side
classes never touch the disk themselves.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmport_agent.core.safefs import atomic_write_at, fsync_fd, open_dir
from llmport_agent.core.threads import BlockingRunner

log = Logger()


def ensure_private_dir(directory: str) -> None:
    """Create C{directory} (and parents) with mode 0700; tighten an existing one we own."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.stat(directory)
    if st.st_uid == os.geteuid() and (st.st_mode & 0o077):
        os.chmod(directory, 0o700)


def fsync_dir(directory: str) -> None:
    """fsync a directory (a name made in it is durable); a file system that cannot sync a
    directory is not an error (L{fsync_fd})."""
    fd = open_dir(directory)
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)


def nothing_there(path: str) -> bool:
    """Whether C{path} names nothing, or an empty regular file (not through a link). Blocking."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    return stat.S_ISREG(st.st_mode) and st.st_size == 0


def read_log(path: str) -> tuple[list[dict[str, Any]], int, bool]:
    """
    A JSON-lines log's load (the command journal's, the event outbox's): its directory made
    private, its records and damaged lines (L{read_json_lines}), and whether nothing is there
    (L{nothing_there}: no rewrite is then needed). Blocking.
    """
    ensure_private_dir(os.path.dirname(os.path.abspath(path)))
    return (*read_json_lines(path), nothing_there(path))


def atomic_write(path: str, data: bytes, mode: int = 0o600, *, private_dir: bool = True) -> None:
    """
    Replace C{path} with C{data} atomically and durably: a new temporary file beside it
    (C{O_EXCL|O_NOFOLLOW}), fsync, rename over the target (a link there is replaced, never
    followed), fsync of the directory. Blocking. See L{llmport_agent.core.safefs.atomic_write_at}.

    @param private_dir: create/tighten the target's directory to 0700 (state files).
    """
    directory = os.path.dirname(os.path.abspath(path))
    if private_dir:
        ensure_private_dir(directory)
    dir_fd = open_dir(directory)
    try:
        atomic_write_at(dir_fd, os.path.basename(path), data, mode)
    finally:
        os.close(dir_fd)


def move_aside(path: str, now: float | None = None) -> str:
    """Rename a damaged file to C{<path>.corrupt-<UTC timestamp>} and return the new name."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    target = f"{path}.corrupt-{stamp}"
    n = 1
    while os.path.exists(target):
        n += 1
        target = f"{path}.corrupt-{stamp}-{n}"
    os.replace(path, target)
    return target


def append_lines(
    path: str, lines: Iterable[bytes], write: Callable[[int, memoryview], int] | None = None
) -> None:
    """
    Append lines to C{path} (mode 0600; a symbolic link there is refused, never followed) and
    fsync, all or nothing; to an empty file (perhaps created here), its directory too. Blocking.

    A full disk makes C{write} return short before it raises C{ENOSPC}: the part that fit is
    cut off again (C{ftruncate} to the size before), so no torn line is left to swallow the
    next record, and the error is raised (the caller counts the lines as not written).
    """
    # Never through a link (a journal is root's words: they must not land in another file).
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        start = os.fstat(fd).st_size
        append_all_or_nothing(fd, b"".join(lines), start, path, write)
    finally:
        os.close(fd)
    if start == 0:
        # The file may be new (a log not written at its load: nothing to compact): its name
        # must be as durable as its first lines.
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def append_all_or_nothing(
    fd: int, data: bytes, start: int, name: str, write: Callable[[int, memoryview], int] | None = None
) -> None:
    """
    Write all of C{data} to C{fd} (opened C{O_APPEND}, C{start} bytes long) and fsync, or cut
    the file back to C{start} and raise: short writes are continued, so no torn record is left.
    """
    view = memoryview(data)
    write = write or os.write  # looked up per call: tests patch os.write
    try:
        while view:
            n = write(fd, view)
            if n <= 0:
                raise OSError(errno.EIO, f"short write appending to {name}")
            view = view[n:]
        os.fsync(fd)
    except BaseException:
        try:
            os.ftruncate(fd, start)
        except OSError:
            pass
        raise


def read_json_lines(path: str) -> tuple[list[dict[str, Any]], int]:
    """
    Read a JSON-lines file. Returns the records and the number of damaged lines skipped (a torn
    last line after a crash is normal). Blocking.
    """
    records: list[dict[str, Any]] = []
    damaged = 0
    try:
        with open(path, "rb") as f:
            for raw in f:
                raw = raw.strip()
                if not raw:
                    continue
                try:
                    rec = json.loads(raw)
                except ValueError:
                    damaged += 1
                    continue
                if isinstance(rec, dict):
                    records.append(rec)
                else:
                    damaged += 1
    except FileNotFoundError:
        pass
    return records, damaged


def encode_line(record: dict[str, Any]) -> bytes:
    return json.dumps(record, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def append_records(path: str, records: list[dict[str, Any]]) -> int:
    """Serialise C{records} as JSON lines, append them to C{path} and fsync. Blocking. Returns bytes."""
    data = b"".join(encode_line(r) for r in records)
    append_lines(path, [data])
    return len(data)


def rewrite_records(path: str, records: list[dict[str, Any]]) -> int:
    """Replace C{path} atomically with C{records} as JSON lines. Blocking. Returns bytes."""
    data = b"".join(encode_line(r) for r in records)
    atomic_write(path, data)
    return len(data)


class GroupCommitLog:
    """
    An append-only JSON-lines file written with group commit: records appended while a write is
    in flight are written together by the next write, with one fsync. C{append} fires once its
    record is durable. C{rewrite} compacts the file atomically (used by the owner when the log
    grows well past its live content).

    Records are serialised on the worker thread, not on the reactor: the caller hands over
    dicts it does not change afterwards. One write takes at most L{MAX_BATCH_RECORDS} records,
    so the callbacks that run when it completes are bounded too.

    @ivar lines_written: lines in the file since the last rewrite (or since opening).
    @ivar bytes_written: bytes appended since the last rewrite, plus what the rewrite wrote.
    @ivar rewritten_bytes: the size of the file right after the last rewrite.
    """

    MAX_BATCH_RECORDS = 256

    def __init__(self, runner: BlockingRunner, path: str) -> None:
        self._runner = runner
        self.path = path
        # Operations in order: (records, waiter, is_rewrite).
        self._queue: deque[tuple[list[dict[str, Any]], Deferred[None], bool]] = deque()
        self._writing = False
        self._rewrites = 0  # queued or being written
        self.lines_written = 0
        self.bytes_written = 0
        self.rewritten_bytes = 0

    def append(self, record: dict[str, Any]) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        self._queue.append(([record], d, False))
        self._kick()
        return d

    def rewrite(self, records: Iterable[dict[str, Any]]) -> Deferred[None]:
        """Replace the whole file with C{records}, in order with the appends around it."""
        d: Deferred[None] = Deferred()
        self._rewrites += 1
        self._queue.append((list(records), d, True))
        self._kick()
        return d

    @property
    def idle(self) -> bool:
        return not self._writing and not self._queue

    @property
    def rewrite_pending(self) -> bool:
        """A rewrite is queued or being written."""
        return self._rewrites > 0

    def _kick(self) -> None:
        if self._writing or not self._queue:
            return
        self._writing = True
        if self._queue[0][2]:
            records, waiter, _ = self._queue.popleft()
            d = self._runner.run(rewrite_records, self.path, records)
            d.addBoth(self._done, [waiter], len(records), True)
            return
        batch: list[dict[str, Any]] = []
        waiters: list[Deferred[None]] = []
        while self._queue and not self._queue[0][2] and len(batch) < self.MAX_BATCH_RECORDS:
            records, waiter, _ = self._queue.popleft()
            batch.extend(records)
            waiters.append(waiter)
        d = self._runner.run(append_records, self.path, batch)
        d.addBoth(self._done, waiters, len(batch), False)

    def _done(self, result: Any, waiters: list[Deferred[None]], count: int, rewrite: bool) -> None:
        self._writing = False
        if rewrite:
            self._rewrites -= 1
        if isinstance(result, Failure):
            log.failure("Writing {path} failed", failure=result, path=self.path)
            for w in waiters:
                w.errback(result)
        else:
            size = int(result) if isinstance(result, int) else 0
            if rewrite:
                self.lines_written = count
                self.bytes_written = self.rewritten_bytes = size
            else:
                self.lines_written += count
                self.bytes_written += size
            for w in waiters:
                w.callback(None)
        self._kick()
