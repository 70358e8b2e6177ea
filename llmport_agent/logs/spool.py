# -*- test-case-name: tests.test_logs_spool -*-
"""
The Loki spool: push bodies kept on disk while Loki cannot take them, replayed in order.

Layout (agent-owned state: the directory is 0700, the files 0600, nothing is followed through a
symbolic link: every file is opened relative to a directory descriptor with C{O_NOFOLLOW}):

 - C{<dir>/<20-digit number>.seg}: append-only segments of records. A record is a 20-byte
   header (C{b"LKS1"}, payload length, line count, CRC-32 of the payload, CRC-32 of the first
   16 header bytes) and the payload: the push body exactly as it is POSTed (gzip JSON);
 - C{<dir>/ack}: C{"<segment> <offset>"}, the end of the last record Loki accepted (replaced
   atomically). Segments wholly before it are deleted.

Appends are written with C{O_APPEND} and fsynced (a new segment also fsyncs the directory)
before the records count as spooled. At open the segments are read back in order; a torn record
at the end of the last segment (a crash during a write) is cut off, a damaged record elsewhere
ends that segment (the rest of it is counted as lost, C{corrupt_records}).

The spool is bounded by C{max_bytes} (the segment files' total size): an append that does not
fit is refused, and the caller keeps the batch (and with it, back-pressure on the readers).
A full disk (C{ENOSPC}) or an I/O error is treated like a full spool, logged once, and tried
again later.

L{Spool} is the reactor-side object: every file operation runs through the injected runner
(a thread pool), one at a time.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import struct
import zlib
from collections import deque
from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import Deferred, DeferredLock
from twisted.logger import Logger

from llmport_agent.core.storage import append_all_or_nothing
from llmport_agent.core.threads import BlockingRunner
from llmport_agent.core.values import frozen

__all__ = ["Spool", "SpoolCorrupt", "SpoolError", "SpoolRecord", "SPOOL_DIR"]

SPOOL_DIR = "loki-spool"

_MAGIC = b"LKS1"
_HEADER = struct.Struct(">4sIII")
_HEADER_CRC = struct.Struct(">I")
HEADER_BYTES = _HEADER.size + _HEADER_CRC.size  # 20
_SEGMENT = re.compile(r"^(\d{20})\.seg$")
_ACK = "ack"
_ACK_TMP = ".ack.tmp"
_MAX_ACK_BYTES = 256

#: The largest payload a record may claim (a damaged length field must not make us allocate GBs).
MAX_RECORD_BYTES = 256 * 1024 * 1024


class SpoolError(Exception):
    """The spool directory cannot be used (the message says why and what to do)."""


class SpoolCorrupt(Exception):
    """A record read back does not match what was written."""


@frozen
class SpoolRecord:
    """Where one push body lies: segment number, header offset, payload length, lines."""

    segment: int
    offset: int
    length: int
    lines: int

    @property
    def end(self) -> int:
        return self.offset + HEADER_BYTES + self.length


def _segment_name(number: int) -> str:
    return f"{number:020d}.seg"


def _pack(payload: bytes, lines: int) -> bytes:
    head = _HEADER.pack(_MAGIC, len(payload), lines, zlib.crc32(payload))
    return head + _HEADER_CRC.pack(zlib.crc32(head)) + payload


def _unpack_header(raw: bytes) -> tuple[int, int, int] | None:
    """C{(length, lines, payload crc)} of a well-formed header, else C{None}."""
    if len(raw) < HEADER_BYTES:
        return None
    magic, length, lines, crc = _HEADER.unpack_from(raw)
    (head_crc,) = _HEADER_CRC.unpack_from(raw, _HEADER.size)
    if magic != _MAGIC or zlib.crc32(raw[: _HEADER.size]) != head_crc or length > MAX_RECORD_BYTES:
        return None
    return length, lines, crc


@frozen
class _Opened:
    records: list[SpoolRecord]
    sizes: dict[int, int]  # live segment -> file size
    next_segment: int
    corrupt_records: int
    corrupt_lines: int
    truncated_bytes: int
    sealed: frozenset[int]  # segments not to append to (damaged)


class _Files:
    """The blocking half. Used only from worker threads, one call at a time."""

    def __init__(self, path: str, segment_bytes: int) -> None:
        self.path = path
        self.segment_bytes = segment_bytes
        self.fd: int | None = None

    # -- directory -----------------------------------------------------------------------

    def _open_dir(self) -> int:
        parent = os.path.dirname(self.path)
        os.makedirs(parent, mode=0o700, exist_ok=True)
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            pass
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise SpoolError(
                    f"the Loki spool {self.path} is not a directory (a symbolic link or a file); "
                    "move it away so the agent can create its own"
                ) from None
            raise
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            os.close(fd)
            raise SpoolError(
                f"the Loki spool {self.path} belongs to uid {st.st_uid}, not to the agent "
                f"(uid {os.geteuid()}); move it away so the agent can create its own"
            )
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
        return fd

    def _dir(self) -> int:
        if self.fd is None:
            raise SpoolError("the Loki spool is closed")
        return self.fd

    def _fsync_dir(self) -> None:
        os.fsync(self._dir())

    def _open_file(self, name: str, flags: int, mode: int = 0o600) -> int:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self._dir())

    def _regular_size(self, name: str) -> int | None:
        try:
            st = os.stat(name, dir_fd=self._dir(), follow_symlinks=False)
        except FileNotFoundError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    # -- open ------------------------------------------------------------------------------

    def _read_ack(self) -> tuple[int, int] | None:
        try:
            fd = self._open_file(_ACK, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError:
            return None
        try:
            raw = os.read(fd, _MAX_ACK_BYTES)
        finally:
            os.close(fd)
        parts = raw.decode("ascii", "replace").split()
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            return None
        return int(parts[0]), int(parts[1])

    def open(self) -> _Opened:
        if self.fd is None:
            self.fd = self._open_dir()
        ack = self._read_ack()
        segments: list[int] = []
        with os.scandir(self._dir()) as it:
            for entry in it:
                m = _SEGMENT.match(entry.name)
                if m and entry.is_file(follow_symlinks=False):
                    segments.append(int(m.group(1)))
                elif entry.name == _ACK_TMP:
                    os.unlink(entry.name, dir_fd=self._dir())
        segments.sort()
        records: list[SpoolRecord] = []
        sizes: dict[int, int] = {}
        sealed: set[int] = set()
        corrupt = corrupt_lines = truncated = 0
        top = max([*segments, ack[0] if ack else 0])
        deleted = False
        for number in segments:
            name = _segment_name(number)
            if ack is not None and number < ack[0]:
                os.unlink(name, dir_fd=self._dir())
                deleted = True
                continue
            start = ack[1] if ack is not None and number == ack[0] else 0
            found, size, bad, bad_lines, cut = self._scan(number, start, last=number == segments[-1])
            if not found:
                # Nothing left to send in it: accepted, empty, torn or damaged from the start.
                os.unlink(name, dir_fd=self._dir())
                deleted = True
                corrupt += bad
                corrupt_lines += bad_lines
                continue
            records.extend(found)
            sizes[number] = size - cut
            truncated += cut
            if bad:
                corrupt += bad
                corrupt_lines += bad_lines
                sealed.add(number)  # appends after a damaged part could not be found again
        if deleted:
            self._fsync_dir()
        return _Opened(records, sizes, top + 1, corrupt, corrupt_lines, truncated, frozenset(sealed))

    def _scan(self, number: int, start: int, last: bool) -> tuple[list[SpoolRecord], int, int, int, int]:
        """
        Records of one segment from C{start}: (records, size, damaged records, their lines,
        bytes cut). A record that runs past the end is a torn write: cut off in the last
        segment (a crash while appending). A record whose payload fails its checksum is
        skipped; a damaged header ends the segment (what follows cannot be found).
        """
        name = _segment_name(number)
        fd = self._open_file(name, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            out: list[SpoolRecord] = []
            bad = bad_lines = 0
            offset = 0
            while offset < size:
                head = os.pread(fd, HEADER_BYTES, offset)
                parsed = _unpack_header(head)
                torn = len(head) < HEADER_BYTES or (
                    parsed is not None and offset + HEADER_BYTES + parsed[0] > size
                )
                if torn:
                    if last:
                        os.ftruncate(fd, offset)
                        os.fsync(fd)
                        return out, size, bad, bad_lines, size - offset
                    return out, size, bad + 1, bad_lines, 0
                if parsed is None:
                    return out, size, bad + 1, bad_lines, 0
                length, lines, crc = parsed
                if offset >= start:
                    payload = os.pread(fd, length, offset + HEADER_BYTES)
                    if zlib.crc32(payload) == crc:
                        out.append(SpoolRecord(number, offset, length, lines))
                    else:
                        bad += 1
                        bad_lines += lines
                offset += HEADER_BYTES + length
            return out, size, bad, bad_lines, 0
        finally:
            os.close(fd)

    # -- append, read, acknowledge ------------------------------------------------------------

    def append(
        self, items: Sequence[tuple[bytes, int]], segment: int, segment_size: int
    ) -> list[tuple[SpoolRecord, int]]:
        """
        Append a prefix of C{items} (body, lines) to segment C{segment}, now C{segment_size}
        bytes long: at least one item, then as many as keep it under the segment size. One
        write and one fsync (and a directory fsync for a new segment). Returns each record with
        the segment's size after it. On failure the segment is cut back to where it was.
        """
        out: list[tuple[SpoolRecord, int]] = []
        chunks: list[bytes] = []
        offset = segment_size
        for body, lines in items:
            if out and offset + HEADER_BYTES + len(body) > self.segment_bytes:
                break
            record = SpoolRecord(segment, offset, len(body), lines)
            chunks.append(_pack(body, lines))
            offset = record.end
            out.append((record, offset))
        name = _segment_name(segment)
        created = self._regular_size(name) is None
        fd = self._open_file(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            append_all_or_nothing(fd, b"".join(chunks), segment_size, name)
        finally:
            os.close(fd)
        if created:
            self._fsync_dir()
        return out

    def read(self, record: SpoolRecord) -> bytes:
        fd = self._open_file(_segment_name(record.segment), os.O_RDONLY)
        try:
            raw = os.pread(fd, HEADER_BYTES + record.length, record.offset)
        finally:
            os.close(fd)
        parsed = _unpack_header(raw)
        if parsed is None or parsed[0] != record.length or len(raw) != HEADER_BYTES + record.length:
            raise SpoolCorrupt(f"record at {record.segment}:{record.offset} has a damaged header")
        payload = raw[HEADER_BYTES:]
        if zlib.crc32(payload) != parsed[2]:
            raise SpoolCorrupt(f"record at {record.segment}:{record.offset} fails its checksum")
        return payload

    def commit(self, segment: int, offset: int, delete: Sequence[int]) -> None:
        """Record the acknowledged position durably, then delete the finished segments."""
        fd = self._open_file(_ACK_TMP, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            os.write(fd, f"{segment} {offset}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(_ACK_TMP, _ACK, src_dir_fd=self._dir(), dst_dir_fd=self._dir())
        for number in delete:
            try:
                os.unlink(_segment_name(number), dir_fd=self._dir())
            except FileNotFoundError:
                pass
        self._fsync_dir()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Spool:
    """
    The reactor-side spool. See the module docstring.

    @param runner: runs the file operations (one at a time) off the reactor thread.
    @param path: the spool directory (created 0700).
    @param max_bytes: the bound on the segment files' total size.
    @param segment_bytes: the size at which a segment is closed and the next one started
        (default: an eighth of C{max_bytes}, between 1 MiB and 16 MiB).
    """

    log = Logger()

    def __init__(
        self, runner: BlockingRunner, path: str, max_bytes: int, segment_bytes: int | None = None
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, not {max_bytes!r}")
        if segment_bytes is None:
            segment_bytes = min(16 << 20, max(1 << 20, max_bytes // 8))
        self._runner = runner
        self.path = path
        self.max_bytes = int(max_bytes)
        self._files = _Files(path, int(segment_bytes))
        self._lock = DeferredLock()
        self.records: deque[SpoolRecord] = deque()
        self._sizes: dict[int, int] = {}
        self._sealed: set[int] = set()
        self._next_segment = 1
        self._acked: SpoolRecord | None = None
        self._committed: SpoolRecord | None = None
        self._committing = False
        self._commit_waiters: list[Deferred[None]] = []
        self.available = False
        self.error: str | None = None
        self.lines = 0

        # Counters.
        self.appended_records = 0
        self.appended_lines = 0
        self.appended_bytes = 0
        self.acked_records = 0
        self.write_errors = 0
        self.corrupt_records = 0
        self.corrupt_lines = 0
        self.replayed_records = 0
        self.replayed_lines = 0

    # -- state ---------------------------------------------------------------------------------

    @property
    def bytes_used(self) -> int:
        """Bytes the segment files take now."""
        return sum(self._sizes.values())

    def fits(self, size: int) -> bool:
        """Whether a body of C{size} bytes would fit now."""
        return self.bytes_used + HEADER_BYTES + size <= self.max_bytes

    def describe(self) -> dict[str, Any]:
        return {
            "enabled": True,
            "available": self.available,
            "error": self.error,
            "path": self.path,
            "bytes": self.bytes_used,
            "max_bytes": self.max_bytes,
            "records": len(self.records),
            "lines": self.lines,
            "segments": len(self._sizes),
            "appended_records": self.appended_records,
            "appended_lines": self.appended_lines,
            "appended_bytes": self.appended_bytes,
            "acked_records": self.acked_records,
            "replayed_records": self.replayed_records,
            "replayed_lines": self.replayed_lines,
            "write_errors": self.write_errors,
            "corrupt_records": self.corrupt_records,
            "corrupt_lines": self.corrupt_lines,
        }

    async def _locked(self, fn: Any, *args: Any) -> Any:
        await self._lock.acquire()
        try:
            return await self._runner.run(fn, *args)
        finally:
            self._lock.release()

    async def open(self) -> None:
        """Open (or create) the directory and read back what a previous run left."""
        try:
            opened: _Opened = await self._locked(self._files.open)
        except SpoolError as e:
            self.error = str(e)
            self.log.error("{error}; log lines are kept in memory only", error=self.error)
            return
        except OSError as e:
            self.error = f"the Loki spool {self.path} cannot be used: {e.strerror or e}"
            self.log.error("{error}; log lines are kept in memory only", error=self.error)
            return
        self.available = True
        self.error = None
        self.records = deque(opened.records)
        self._sizes = dict(opened.sizes)
        self._sealed = set(opened.sealed)
        self._next_segment = opened.next_segment
        self.lines = sum(r.lines for r in self.records)
        self.replayed_records = len(self.records)
        self.replayed_lines = self.lines
        self.corrupt_records += opened.corrupt_records
        self.corrupt_lines += opened.corrupt_lines
        if self.records:
            self.log.info(
                "The Loki spool holds {records} pushes ({lines} lines, {bytes} bytes) from before; "
                "they are sent first",
                records=len(self.records),
                lines=self.lines,
                bytes=self.bytes_used,
            )
        if opened.corrupt_records:
            self.log.warn(
                "{count} damaged records in the Loki spool {path} were skipped",
                count=opened.corrupt_records,
                path=self.path,
            )

    def _target(self, first: int) -> tuple[int, int]:
        """The segment the next record (of C{first} body bytes) goes to, and its size now."""
        if self._sizes:
            last = max(self._sizes)
            size = self._sizes[last]
            fits = size == 0 or size + HEADER_BYTES + first <= self._files.segment_bytes
            if last not in self._sealed and fits:
                return last, size
        return self._next_segment, 0

    async def append(self, items: Sequence[tuple[bytes, int]]) -> int:
        """
        Append the longest prefix of C{items} (body, lines) that fits; durable when this fires.
        Returns how many were appended (0 when full, unavailable or the write failed).
        """
        await self._lock.acquire()
        try:
            return await self._append(list(items))
        finally:
            self._lock.release()

    async def _append(self, items: list[tuple[bytes, int]]) -> int:
        done = 0
        while self.available and done < len(items):
            used = self.bytes_used
            fitting: list[tuple[bytes, int]] = []
            for body, lines in items[done:]:
                used += HEADER_BYTES + len(body)
                if used > self.max_bytes:
                    break
                fitting.append((body, lines))
            if not fitting:
                break
            segment, size = self._target(len(fitting[0][0]))
            try:
                written: list[tuple[SpoolRecord, int]] = await self._runner.run(
                    self._files.append, fitting, segment, size
                )
            except OSError as e:
                self.write_errors += 1
                if self.write_errors == 1 or self.write_errors % 100 == 0:
                    full = " (the disk is full)" if e.errno == errno.ENOSPC else ""
                    self.log.warn(
                        "Writing to the Loki spool {path} failed{full}: {error}; lines wait in "
                        "memory",
                        path=self.path,
                        full=full,
                        error=e.strerror or str(e),
                    )
                break
            for record, segment_size in written:
                self.records.append(record)
                self._sizes[record.segment] = segment_size
                self._next_segment = max(self._next_segment, record.segment + 1)
                self.lines += record.lines
                self.appended_records += 1
                self.appended_lines += record.lines
                self.appended_bytes += HEADER_BYTES + record.length
            done += len(written)
        return done

    async def read(self, record: SpoolRecord) -> bytes:
        """The body of C{record}. @raise SpoolCorrupt: it does not read back as written."""
        result: bytes = await self._locked(self._files.read, record)
        return result

    def drop_head(self) -> SpoolRecord:
        """Take the oldest record off (accepted by Loki, or dropped); made durable soon."""
        record = self.records.popleft()
        self.lines -= record.lines
        self.acked_records += 1
        self._acked = record
        if not self._committing:
            d = Deferred.fromCoroutine(self._commit_loop())
            d.addErrback(lambda f: self.log.failure("Recording Loki spool progress failed", failure=f))
        return record

    async def _commit_loop(self) -> None:
        self._committing = True
        try:
            while self._acked is not None and self._acked != self._committed:
                await self._lock.acquire()
                try:
                    # Planned under the lock: no append can pick a segment deleted here.
                    acked = self._acked
                    head = self.records[0].segment if self.records else None
                    delete = sorted(n for n in self._sizes if head is None or n < head)
                    await self._runner.run(self._files.commit, acked.segment, acked.end, delete)
                    self._committed = acked
                    for n in delete:
                        self._sizes.pop(n, None)
                        self._sealed.discard(n)
                except OSError as e:
                    self.write_errors += 1
                    self.log.warn(
                        "Recording Loki spool progress in {path} failed: {error}",
                        path=self.path,
                        error=e.strerror or str(e),
                    )
                    return
                finally:
                    self._lock.release()
        finally:
            self._committing = False
            waiters, self._commit_waiters = self._commit_waiters, []
            for w in waiters:
                w.callback(None)

    def settled(self) -> Deferred[None]:
        """Fires once the acknowledged position is on disk."""
        d: Deferred[None] = Deferred()
        if not self._committing:
            d.callback(None)
        else:
            self._commit_waiters.append(d)
        return d

    async def close(self) -> None:
        """Wait for the last acknowledgement to be written, then close the directory."""
        await self.settled()
        if self.available:
            self.available = False
            try:
                await self._locked(self._files.close)
            except OSError:
                pass
