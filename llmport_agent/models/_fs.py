"""
Blocking file-system work of model delivery, symlink-proof.

Everything here blocks (disk I/O, hashing, fsync) and is called only through a
L{llmport_agent.core.threads.BlockingRunner}, never on the reactor thread.

The model store is mounted into workload containers, so anything in it may have been
planted by one: every operation goes through L{llmport_agent.core.safefs} and resolves no path at
all below the store's own directory. A sync opens L{ModelDir} (descriptors of the model
directory and its four sub-directories, each entered with C{O_DIRECTORY|O_NOFOLLOW}) and
works relative to those descriptors. Whatever stands where the agent expects its own
directory or file (a symlink, a FIFO, a device node, a directory instead of a file) is
removed without being followed, logged once, and listed in the sync's result.

Layout of one model directory (a HuggingFace hub cache repo folder)::

    <store>/<model_dir_name>/blobs/<hash>            verified blobs
    <store>/<model_dir_name>/blobs/<hash>.part       a download in progress (resumable)
    <store>/<model_dir_name>/blobs/<hash>.progress   which byte ranges of the .part are written
    <store>/<model_dir_name>/refs/<name>             commit id, no trailing newline
    <store>/<model_dir_name>/snapshots/<commit>/...  relative symlinks into ../../blobs
    <store>/<model_dir_name>/.llmport-verified.json  what was verified: {hash: size, mtime, inode, ctime}
    <store>/<model_dir_name>/.llmport-tmp/           snapshot trees and refs being built
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import secrets
import stat
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from attrs import field
from twisted.logger import Logger

from llmport_agent.core import safefs
from llmport_agent.core.values import define, frozen
from llmport_agent.models.manifest import BlobSpec, LinkSpec

VERIFIED_FILE = ".llmport-verified.json"
TMP_DIR = ".llmport-tmp"
PART_SUFFIX = ".part"
PROGRESS_SUFFIX = ".progress"
SUBDIRS = ("blobs", "refs", "snapshots", TMP_DIR)
_READ_SIZE = 8 * 1024 * 1024
_RECORD_VERSION = 2  # 1 held size and mtime only: a rewrite in place restoring the mtime fooled it
_PROGRESS_VERSION = 1
_MAX_PROGRESS_BYTES = 256 * 1024
_MAX_PROGRESS_RANGES = 4096
_MAX_RECORD_BYTES = 16 * 1024 * 1024
_MAX_FOREIGN_LISTED = 20
#: Default of C{track_min}: sha256 blobs from this size on get a preallocated part file with
#: a progress record (ranged downloads, per-range resume); smaller ones are appended to and
#: resume by size (the syncer passes two segments).
TRACK_MIN_SIZE = 64 * 1024 * 1024

#: What the verification record keeps of a verified blob: size, mtime, inode and ctime (ns).
#: A rewrite in place changes the ctime (which no program can set back), a replacement the
#: inode: either makes the blob be verified (hashed) again.
Stamp = tuple[int, int, int, int]
_STAMP_FIELDS = ("size", "mtime_ns", "ino", "ctime_ns")


def stamp_of(st: os.stat_result) -> Stamp:
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)

log = Logger(namespace="llmport_agent.models.store")


# --- the open model directory -----------------------------------------------------------


@define(eq=False)
class ModelDir:
    """
    Open descriptors of C{<store>/<name>} and its sub-directories. Close it with L{close}.

    @ivar path: the directory's path (for messages and results only; never resolved).
    @ivar foreign: what was found in the agent's places and removed, C{"<path>: <what>"}
        (the first few), for the sync's result.
    """

    store_dir: str
    name: str
    fd: int
    blobs: int = -1
    refs: int = -1
    snapshots: int = -1
    tmp: int = -1
    foreign: list[str] = field(factory=list)
    foreign_count: int = 0

    @property
    def path(self) -> str:
        return os.path.join(self.store_dir, self.name)

    def full(self, rel: str) -> str:
        """The path of C{rel} (relative to the model directory) for messages."""
        return os.path.join(self.path, rel) if rel else self.path

    def report_foreign(self, rel: str, what: str) -> None:
        """Log (once per finding) what was removed from one of the agent's places."""
        path = self.full(rel)
        log.warn(
            "Removed {what} at {path} from the model store without following it: the agent "
            "keeps its own files there (a workload container may have planted it)",
            what=what,
            path=path,
        )
        self.foreign_count += 1
        if len(self.foreign) < _MAX_FOREIGN_LISTED:
            self.foreign.append(f"{path}: {what}")

    def close(self) -> None:
        for attr in ("tmp", "snapshots", "refs", "blobs", "fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                setattr(self, attr, -1)
                try:
                    os.close(fd)
                except OSError:
                    pass


def open_model_dir(store_dir: str, model_dir_name: str) -> ModelDir:
    """
    Open (creating what is missing) C{<store>/<model_dir_name>/{blobs,refs,snapshots,
    .llmport-tmp}} without following any link below the store, and empty the temporary
    folder (leftovers of an interrupted run). Operations on one model directory are
    serialised by the caller, so nothing else of ours is using the temporary folder.

    The store's own path (MODEL_STORE) is the operator's and may itself be a link.
    """
    os.makedirs(store_dir, exist_ok=True)
    root = safefs.open_dir(store_dir)
    model: ModelDir | None = None
    try:
        model = ModelDir(store_dir, model_dir_name, -1)
        model.fd = safefs.open_dir_at(
            root, model_dir_name, create=True, on_foreign=_at_store(model), where=""
        )
        for sub in SUBDIRS:
            fd = safefs.open_dir_at(
                model.fd, sub, create=True, on_foreign=model.report_foreign, where=sub
            )
            setattr(model, "tmp" if sub == TMP_DIR else sub, fd)
        with os.scandir(model.tmp) as entries:
            for entry in entries:
                safefs.remove_entry(model.tmp, entry.name, where=f"{TMP_DIR}/{entry.name}")
    except BaseException:
        if model is not None:
            model.close()
        raise
    finally:
        os.close(root)
    return model


def _at_store(model: ModelDir) -> safefs.ForeignCallback:
    return lambda _rel, what: model.report_foreign("", what)


def close_model_dir(model: ModelDir) -> None:
    """Close the model directory's descriptors."""
    model.close()


def snapshot_present(model: ModelDir, commit: str) -> bool:
    """Whether C{snapshots/<commit>} is a directory (a symlink there is not one)."""
    st = safefs.lstat_at(model.snapshots, commit)
    return st is not None and stat.S_ISDIR(st.st_mode)


def free_bytes(model: ModelDir) -> int:
    """Free bytes for an unprivileged writer on the file system of the model directory."""
    st = os.statvfs(model.fd)
    return st.f_bavail * st.f_frsize


# --- the verification record ---------------------------------------------------------------


def _read_own_file(model: ModelDir, dir_fd: int, name: str, rel: str, limit: int) -> bytes | None:
    """A small file of ours, or C{None} when missing; anything else in its place is removed."""
    try:
        return safefs.read_file_at(dir_fd, name, limit, where=rel)
    except FileNotFoundError:
        return None
    except safefs.NotRegularFile:
        st = safefs.lstat_at(dir_fd, name)
        safefs.remove_entry(dir_fd, name, where=rel)
        if st is not None:
            model.report_foreign(rel, safefs.describe_mode(st.st_mode))
        return None


def load_record(model: ModelDir) -> dict[str, Stamp]:
    """
    Read C{.llmport-verified.json}: C{{hash: stamp}} (L{Stamp}) of blobs already verified.
    A missing, damaged or older-version file is an empty record (everything gets verified
    again).
    """
    raw = _read_own_file(model, model.fd, VERIFIED_FILE, VERIFIED_FILE, _MAX_RECORD_BYTES)
    if raw is None:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(data, dict) or data.get("version") != _RECORD_VERSION:
        return {}
    blobs = data.get("blobs")
    if not isinstance(blobs, dict):
        return {}
    out: dict[str, Stamp] = {}
    for name, entry in blobs.items():
        if (
            isinstance(name, str)
            and isinstance(entry, dict)
            and all(type(entry.get(f)) is int for f in _STAMP_FIELDS)
        ):
            out[name] = (entry["size"], entry["mtime_ns"], entry["ino"], entry["ctime_ns"])
    return out


def save_record(model: ModelDir, record: Mapping[str, Stamp]) -> None:
    """Write the verification record atomically (temporary file, fsync, rename)."""
    payload = {
        "version": _RECORD_VERSION,
        "blobs": {k: dict(zip(_STAMP_FIELDS, v, strict=True)) for k, v in sorted(record.items())},
    }
    data = json.dumps(payload, separators=(",", ":")).encode()
    safefs.atomic_write_at(model.fd, VERIFIED_FILE, data, 0o644, tmp_dir_fd=model.tmp)


# --- surveying what is there ------------------------------------------------------------------


@frozen
class BlobSurvey:
    """
    What the disk holds for one blob.

    @ivar state: C{"reuse"} (present, its L{Stamp} recorded as verified), C{"verify"}
        (present with the right size but not recorded) or C{"fetch"} (missing).
    @ivar part_done: bytes of a partial download that are already written (for C{"fetch"}).
    @ivar part_allocated: disk space the partial download already holds.
    @ivar mtime_ns: the blob's mtime (for C{"reuse"}).
    """

    blob: BlobSpec
    state: str
    part_done: int = 0
    part_allocated: int = 0
    mtime_ns: int = 0


def _clear_foreign(model: ModelDir, dir_fd: int, name: str, rel: str,
                   st: os.stat_result) -> None:
    safefs.remove_entry(dir_fd, name, where=rel)
    model.report_foreign(rel, safefs.describe_mode(st.st_mode))


def survey_blobs(
    model: ModelDir,
    blobs: Iterable[BlobSpec],
    record: Mapping[str, Stamp],
    track_min: int = TRACK_MIN_SIZE,
) -> list[BlobSurvey]:
    """
    Classify each blob by C{lstat} alone (no hashing). A blob file of the wrong size is
    removed so it will be fetched again; anything that is not a regular file where a blob or
    a partial download belongs is removed without being followed (and reported); a partial
    download that is larger than its blob, or hard-linked elsewhere, is removed too.
    """
    out: list[BlobSurvey] = []
    for blob in blobs:
        rel = f"blobs/{blob.hash}"
        st = safefs.lstat_at(model.blobs, blob.hash)
        if st is not None:
            if stat.S_ISREG(st.st_mode) and st.st_size == blob.size:
                if record.get(blob.hash) == stamp_of(st):
                    out.append(BlobSurvey(blob, "reuse", mtime_ns=st.st_mtime_ns))
                else:
                    out.append(BlobSurvey(blob, "verify"))
                continue
            if stat.S_ISREG(st.st_mode):
                safefs.remove_entry(model.blobs, blob.hash, where=rel)
            else:
                _clear_foreign(model, model.blobs, blob.hash, rel, st)
        done, allocated = _survey_part(model, blob, track_min)
        out.append(BlobSurvey(blob, "fetch", part_done=done, part_allocated=allocated))
    return out


def is_tracked(blob: BlobSpec, track_min: int = TRACK_MIN_SIZE) -> bool:
    """Whether the blob's part file is preallocated and its ranges recorded."""
    return blob.sha256 is not None and blob.size >= track_min


def _survey_part(model: ModelDir, blob: BlobSpec, track_min: int) -> tuple[int, int]:
    name = blob.hash + PART_SUFFIX
    rel = f"blobs/{name}"
    st = safefs.lstat_at(model.blobs, name)
    if st is None:
        _drop_progress(model, blob)
        return 0, 0
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        what = safefs.describe_mode(st.st_mode)
        if stat.S_ISREG(st.st_mode):
            what = f"a regular file with {st.st_nlink} hard links"
        safefs.remove_entry(model.blobs, name, where=rel)
        model.report_foreign(rel, what)
        _drop_progress(model, blob)
        return 0, 0
    if st.st_size > blob.size:
        safefs.remove_entry(model.blobs, name, where=rel)
        _drop_progress(model, blob)
        return 0, 0
    allocated = min(blob.size, st.st_blocks * 512)
    if not is_tracked(blob, track_min):
        return st.st_size, allocated
    ranges = load_progress(model, blob, st.st_size)
    return sum(b - a for a, b in ranges), allocated


# --- hashing -----------------------------------------------------------------------------------


def hash_fd(fd: int, start: int, end: int, hasher: Any) -> int:
    """Feed bytes C{[start, end)} of C{fd} to C{hasher}, in large reads. @return: bytes read."""
    buf = bytearray(min(_READ_SIZE, max(end - start, 1)))
    view = memoryview(buf)
    pos = start
    while pos < end:
        n = os.preadv(fd, [view[: min(len(buf), end - pos)]], pos)
        if n <= 0:
            break
        hasher.update(view[:n])
        pos += n
    return pos - start


def verify_blob(model: ModelDir, blob: BlobSpec) -> tuple[bool, Stamp | None]:
    """
    Check a present blob that is not in the record: its size, and its sha256 where its name
    is one. A mismatching file is removed.

    @return: C{(ok, stamp)}: the stamp of the file that was hashed (its descriptor's).
    """
    rel = f"blobs/{blob.hash}"
    try:
        fd, st = safefs.open_file_at(model.blobs, blob.hash, where=rel)
    except FileNotFoundError:
        return False, None
    except safefs.NotRegularFile:
        lst = safefs.lstat_at(model.blobs, blob.hash)
        if lst is not None:
            _clear_foreign(model, model.blobs, blob.hash, rel, lst)
        return False, None
    try:
        ok = st.st_size == blob.size
        expected = blob.sha256
        if ok and expected is not None:
            h = hashlib.sha256()
            ok = hash_fd(fd, 0, blob.size, h) == blob.size and h.hexdigest() == expected
        stamp = stamp_of(os.fstat(fd))
    finally:
        os.close(fd)
    if not ok:
        safefs.remove_entry(model.blobs, blob.hash, where=rel)
        return False, None
    return True, stamp


# --- per-range progress of a partial download ---------------------------------------------------


def _progress_name(blob: BlobSpec) -> str:
    return blob.hash + PROGRESS_SUFFIX


def _drop_progress(model: ModelDir, blob: BlobSpec) -> None:
    name = _progress_name(blob)
    st = safefs.lstat_at(model.blobs, name)
    if st is not None:
        if stat.S_ISREG(st.st_mode):
            safefs.remove_entry(model.blobs, name, where=f"blobs/{name}")
        else:
            _clear_foreign(model, model.blobs, name, f"blobs/{name}", st)


def normalise_ranges(ranges: Iterable[Sequence[int]], size: int) -> list[tuple[int, int]]:
    """Sorted, merged half-open ranges inside C{[0, size)}; raises C{ValueError} on nonsense."""
    out: list[tuple[int, int]] = []
    for item in sorted((int(r[0]), int(r[1])) for r in ranges):
        a, b = item
        if not (0 <= a < b <= size):
            raise ValueError(f"range {a}-{b} outside 0-{size}")
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def load_progress(model: ModelDir, blob: BlobSpec, part_size: int) -> list[tuple[int, int]]:
    """
    Which byte ranges of C{<hash>.part} hold downloaded bytes: from C{<hash>.progress}, or,
    for a partial file without one (a single-stream download of an earlier version), its
    first C{part_size} bytes. A damaged record means nothing is kept.
    """
    name = _progress_name(blob)
    raw = _read_own_file(model, model.blobs, name, f"blobs/{name}", _MAX_PROGRESS_BYTES + 1)
    if raw is None:
        return [(0, part_size)] if 0 < part_size <= blob.size else []
    try:
        data = json.loads(raw)
        if (
            len(raw) > _MAX_PROGRESS_BYTES
            or not isinstance(data, dict)
            or data.get("version") != _PROGRESS_VERSION
            or data.get("size") != blob.size
            or not isinstance(data.get("done"), list)
            or len(data["done"]) > _MAX_PROGRESS_RANGES
        ):
            return []
        done = data["done"]
        if not all(
            isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) for r in done
        ):
            return []
        ranges = normalise_ranges(done, blob.size)
    except (ValueError, TypeError):
        return []
    # Never claim bytes beyond what the file holds.
    return [(a, min(b, part_size)) for a, b in ranges if a < part_size]


def save_progress(part: PartFile, ranges: Sequence[tuple[int, int]]) -> None:
    """
    Record which ranges of the part file are written. Not fsynced: the record is a hint for
    a resume after the agent stops; after a power loss the blob's sha256 catches bytes the
    disk lost, and the download starts over.
    """
    if not part.tracked or part.fd is None:
        return
    payload = {
        "version": _PROGRESS_VERSION,
        "size": part.blob.size,
        "done": [[a, b] for a, b in ranges[:_MAX_PROGRESS_RANGES]],
    }
    model = part.model
    safefs.atomic_write_at(
        model.blobs,
        _progress_name(part.blob),
        json.dumps(payload, separators=(",", ":")).encode(),
        0o644,
        tmp_dir_fd=model.tmp,
        durable=False,
    )


# --- partial downloads ----------------------------------------------------------------------


@define(eq=False)
class PartFile:
    """
    An open C{<hash>.part}. Writes (C{pwritev} at their offsets) and hash updates run as jobs
    of their own serial runners; the two never touch the same state.

    @ivar tracked: large sha256 blobs (L{TRACK_MIN_SIZE}): the file is preallocated to the
        blob's size and its written ranges are kept in C{<hash>.progress} (downloads may be
        ranged). Other blobs are appended to in order and resumed from the file's size.
    @ivar done: ranges already written when the file was opened (resumed bytes).
    @ivar hasher: a running sha256 (fed in offset order), or C{None} for non-sha256 names.
    @ivar fd: the writer's descriptor (writer jobs only; closed by one of them).
    @ivar read_fd: the hasher's own descriptor of the same file (hasher jobs only: each
        serial closes its own, so neither can close one the other is using).
    """

    model: ModelDir
    blob: BlobSpec
    fd: int | None
    tracked: bool
    done: list[tuple[int, int]]
    hasher: Any = None
    read_fd: int | None = None
    #: Written ranges whose pages may still be in the page cache, oldest first, and their
    #: bytes (writer jobs only: L{drop_behind}).
    behind: deque[tuple[int, int]] = field(factory=deque)
    behind_bytes: int = 0

    @property
    def resumed_bytes(self) -> int:
        return sum(b - a for a, b in self.done)


_libc: Any = None


def _fallocate(fd: int, size: int) -> bool:
    """Reserve C{size} bytes (Linux fallocate, no zero-filling emulation). @return: done."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        fn = _libc.fallocate
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    if fn(fd, 0, 0, size) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
        raise OSError(err, os.strerror(err))
    return False


#: C{sync_file_range(2)} flags: wait for writeback already under way, start writing the
#: range's dirty pages back, wait for that writeback.
_SYNC_FILE_RANGE_WAIT_BEFORE = 1
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT_AFTER = 4
#: The libc function once looked up: C{None} until then, C{False} where there is none (or the
#: file system refused it once: no later file is asked again).
_sync_file_range: Any = None
#: Errors that say "this file system (or libc) has no sync_file_range": never ask again.
_UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP)


def _lookup_sync_file_range() -> Any:
    global _sync_file_range
    fn = _sync_file_range
    if fn is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = False
        _sync_file_range = fn
    return fn


def start_writeback(fd: int, offset: int, length: int) -> None:
    """
    Ask the kernel to start writing bytes C{[offset, offset + length)} of C{fd} to the disk
    now, without waiting for it (Linux C{sync_file_range(SYNC_FILE_RANGE_WRITE)}).

    A blob's bytes otherwise sit dirty in the page cache until the one C{fsync} at its end,
    which then writes the whole blob while the sync waits (about a quarter second per GiB on
    a fast disk, more on a slow one). Started behind each batch, the writeback overlaps the
    download, and that C{fsync} - still the only durability guarantee - finds little left to
    do. A hint only: where the call is missing or refused nothing changes (the C{fsync}
    catches any write error).
    """
    global _sync_file_range
    fn = _lookup_sync_file_range()
    if fn is False or length <= 0:
        return
    if fn(fd, offset, length, _SYNC_FILE_RANGE_WRITE) != 0 and ctypes.get_errno() in _UNSUPPORTED:
        _sync_file_range = False


#: Bytes of one part file that may stay in the page cache behind its writes (L{drop_behind}).
DROP_BEHIND = 32 * 1024 * 1024


def drop_behind(part: PartFile, offset: int, length: int) -> None:
    """
    Record that bytes C{[offset, offset + length)} were just written (their writeback
    started), and take the oldest written ranges beyond the last L{DROP_BEHIND} bytes out of
    the page cache: wait until their writeback is done (C{sync_file_range} with both waits),
    then drop their now clean pages (C{posix_fadvise(DONTNEED)}).

    The hash is fed from the received buffers, so nothing reads these pages again. Kept,
    they make the page cache grow by the whole blob; on a virtual machine whose free memory
    went back to its host, each new GiB of page cache cost 1.2-2.6 CPU-s in the kernel here,
    against 0.17 for writing the same GiB through a page cache kept this small (BENCHMARKS.md).
    It also bounds the dirty memory of a download, so a disk slower than the network makes
    the writer wait here instead of the kernel throttling every writer on the host.

    @raise OSError: the writeback of those bytes failed (the blob fails: the C{fsync} at its
        end would no longer report that error).
    """
    if length <= 0:
        return
    part.behind.append((offset, length))
    part.behind_bytes += length
    fd = part.fd
    assert fd is not None, "part file is closed"
    while part.behind_bytes > DROP_BEHIND:
        a, n = part.behind.popleft()
        part.behind_bytes -= n
        _settle(fd, a, n)
        _drop_cache(fd, a, n)


def _settle(fd: int, offset: int, length: int) -> None:
    """Wait until bytes C{[offset, offset + length)} of C{fd} are on the disk (where possible)."""
    global _sync_file_range
    fn = _lookup_sync_file_range()
    if fn is False:
        return
    flags = _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER
    if fn(fd, offset, length, flags) == 0:
        return
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        _sync_file_range = False
        return
    raise OSError(err, f"could not write a downloaded range to the disk: {os.strerror(err)}")


def _drop_cache(fd: int, offset: int, length: int) -> None:
    """Hint: drop the clean cached pages of C{[offset, offset + length)} (0: to the end)."""
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass


def preallocate(fd: int, size: int) -> None:
    """Give the part file its final size, reserving the disk where the file system can."""
    if size <= 0:
        return
    if not _fallocate(fd, size) and os.fstat(fd).st_size < size:
        os.ftruncate(fd, size)


def open_part(
    model: ModelDir, blob: BlobSpec, track_min: int = TRACK_MIN_SIZE, *, fresh: bool = False
) -> PartFile:
    """
    Open (or create) the blob's C{.part}. Existing content is kept for a resume unless
    C{fresh}; a part that is not a private regular file is removed first. sha256 blobs get
    their progress record written and the file preallocated to the blob's size.
    """
    name = blob.hash + PART_SUFFIX
    rel = f"blobs/{name}"
    tracked = is_tracked(blob, track_min)
    hashed = blob.sha256 is not None
    fd: int | None = None
    st = safefs.lstat_at(model.blobs, name)
    if st is not None and (not stat.S_ISREG(st.st_mode) or st.st_nlink != 1):
        what = safefs.describe_mode(st.st_mode)
        if stat.S_ISREG(st.st_mode):
            what = f"a regular file with {st.st_nlink} hard links"
        safefs.remove_entry(model.blobs, name, where=rel)
        model.report_foreign(rel, what)
        st = None
    if st is not None:
        try:
            fd, st = safefs.open_file_at(model.blobs, name, os.O_RDWR, where=rel)
        except (FileNotFoundError, safefs.NotRegularFile):
            safefs.remove_entry(model.blobs, name, where=rel)
            fd = None
        else:
            if st.st_nlink != 1:  # hard-linked since the lstat: start afresh
                os.close(fd)
                safefs.remove_entry(model.blobs, name, where=rel)
                fd = None
    if fd is None:
        _drop_progress(model, blob)
        fd = safefs.create_file_at(model.blobs, name, 0o644, os.O_RDWR)
        size = 0
    else:
        size = os.fstat(fd).st_size
    part: PartFile | None = None
    try:
        if fresh or size > blob.size:
            os.ftruncate(fd, 0)
            size = 0
            _drop_progress(model, blob)
        if tracked:
            done = load_progress(model, blob, size) if size else []
        else:
            done = [(0, size)] if size else []
        part = PartFile(model, blob, fd, tracked, done, hashlib.sha256() if hashed else None)
        if hashed and done:
            part.read_fd = os.dup(fd)  # the hasher reads the resumed bytes once
        if tracked:
            # The record first: a preallocated file without one would look complete.
            save_progress(part, done)
            preallocate(fd, blob.size)
    except BaseException:
        os.close(fd)
        if part is not None and part.read_fd is not None:
            os.close(part.read_fd)
        raise
    return part


def open_fresh_part(model: ModelDir, blob: BlobSpec, track_min: int = TRACK_MIN_SIZE) -> PartFile:
    """L{open_part} discarding whatever the part file held."""
    return open_part(model, blob, track_min, fresh=True)


def reset_part(part: PartFile) -> None:
    """Start the part file over from zero (the server sent the whole blob, or verification failed)."""
    fd = part.fd
    assert fd is not None, "part file is closed"
    os.ftruncate(fd, 0)
    part.done = []
    part.behind.clear()
    part.behind_bytes = 0
    if part.hasher is not None:
        part.hasher = hashlib.sha256()
    if part.tracked:
        save_progress(part, [])
        preallocate(fd, part.blob.size)


#: Bytes per write system call. A write of 1 MiB or more lets the page cache give the file
#: large folios, taken from whole free 2 MiB blocks - the blocks a virtual machine with free
#: page reporting has handed back to its host, so filling each costs host faults: 1 GiB
#: written 2 MiB at a time took a median 1.4 CPU-s here (1 MiB: 0.8, varying from run to
#: run), 512 or 256 KiB at a time 0.15, every time (BENCHMARKS.md).
WRITE_SIZE = 256 * 1024


def write_batch(part: PartFile, offset: int, chunks: list[bytes]) -> int:
    """
    Write C{chunks} at C{offset}, in C{pwritev} calls of at most L{WRITE_SIZE} bytes, and
    start their writeback to the disk (L{start_writeback}); older writes leave the page
    cache (L{drop_behind}).
    """
    fd = part.fd
    assert fd is not None, "part file is closed"
    pos = offset
    iov: list[memoryview] = []
    size = 0
    for chunk in chunks:
        view = memoryview(chunk)
        while view:
            take = min(len(view), WRITE_SIZE - size)
            iov.append(view[:take])
            size += take
            view = view[take:]
            if size == WRITE_SIZE:
                pos = _write_all(part, fd, iov, pos)
                iov, size = [], 0
    if iov:
        pos = _write_all(part, fd, iov, pos)
    total = pos - offset
    start_writeback(fd, offset, total)
    drop_behind(part, offset, total)
    return total


def _write_all(part: PartFile, fd: int, iov: list[memoryview], pos: int) -> int:
    """C{pwritev} of all of C{iov} at C{pos} (again after a short write); the next offset."""
    while iov:
        n = os.pwritev(fd, iov, pos)
        if n <= 0:
            raise OSError(errno.EIO, "short write", part.model.full(f"blobs/{part.blob.hash}.part"))
        pos += n
        while iov and n >= len(iov[0]):
            n -= len(iov[0])
            iov = iov[1:]
        if n:
            iov = [iov[0][n:], *iov[1:]]
    return pos


def hash_batch(part: PartFile, chunks: list[bytes]) -> None:
    """Feed C{chunks} (the next bytes in offset order) to the running hash."""
    hasher = part.hasher
    for chunk in chunks:
        hasher.update(chunk)


def hash_region(part: PartFile, start: int, end: int) -> None:
    """Feed bytes C{[start, end)} already on disk (a resumed range) to the running hash."""
    assert part.read_fd is not None, "part file is closed"
    got = hash_fd(part.read_fd, start, end, part.hasher)
    if got != end - start:
        raise OSError(errno.EIO, "partial download shorter than its progress record")


def digest_of(part: PartFile) -> str | None:
    """The running hash's hex digest (C{None} without one); closes the hasher's descriptor."""
    close_reader(part)
    return None if part.hasher is None else part.hasher.hexdigest()


def close_reader(part: PartFile) -> None:
    """Close the hasher's descriptor (a hasher job, after the hasher's other jobs)."""
    fd, part.read_fd = part.read_fd, None
    if fd is not None:
        os.close(fd)


def finish_part(part: PartFile, digest: str | None) -> tuple[bool, str, Stamp | None]:
    """
    Check the complete part file (size, and C{digest} against the sha256 name), fsync it
    (once), and rename it to its blob name. A mismatching file is removed.

    The rename is by name, and a workload can swap the C{.part} name for something else
    between the check (on the descriptor) and the rename: so the entry now at the blob's name
    must be the very file that was checked (same device and inode, a regular file). If it is
    not, it is removed (and reported) and the blob counts as failed.

    @return: C{(ok, what_was_found, stamp)}; C{what_was_found} describes a mismatch.
    """
    fd = part.fd
    assert fd is not None, "part file is closed"
    model = part.model
    blob = part.blob
    name = blob.hash + PART_SUFFIX
    size = os.fstat(fd).st_size
    problem = ""
    if size != blob.size:
        problem = f"{size} bytes instead of {blob.size}"
    elif blob.sha256 is not None and digest != blob.sha256:
        problem = f"sha256 {digest}"
    if problem:
        discard_part(part)
        return False, problem, None
    os.fsync(fd)
    _drop_cache(fd, 0, 0)  # the last L{DROP_BEHIND} bytes, clean now
    part.behind.clear()
    part.behind_bytes = 0
    for _ in range(3):
        try:
            os.replace(name, blob.hash, src_dir_fd=model.blobs, dst_dir_fd=model.blobs)
            break
        except OSError as e:
            if e.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                raise
            st = safefs.lstat_at(model.blobs, blob.hash)
            if st is not None:
                _clear_foreign(model, model.blobs, blob.hash, f"blobs/{blob.hash}", st)
    else:
        raise OSError(errno.EEXIST, "a directory keeps appearing", model.full(f"blobs/{blob.hash}"))
    safefs.fsync_fd(model.blobs)
    mine = os.fstat(fd)
    placed = safefs.lstat_at(model.blobs, blob.hash)
    _drop_progress(model, blob)
    part.fd = None
    os.close(fd)
    if placed is None or not stat.S_ISREG(placed.st_mode) or (
        (placed.st_dev, placed.st_ino) != (mine.st_dev, mine.st_ino)
    ):
        if placed is not None:
            _clear_foreign(model, model.blobs, blob.hash, f"blobs/{blob.hash}", placed)
        return False, "another file: the download's name was swapped while it was moved into place", None
    return True, "", stamp_of(placed)


def discard_part(part: PartFile) -> None:
    """Remove the part file and its progress record."""
    model = part.model
    name = part.blob.hash + PART_SUFFIX
    safefs.remove_entry(model.blobs, name, where=f"blobs/{name}")
    _drop_progress(model, part.blob)
    fd, part.fd = part.fd, None
    if fd is not None:
        os.close(fd)


def close_part(part: PartFile, ranges: Sequence[tuple[int, int]]) -> None:
    """Close the part file if still open, recording C{ranges} as written for a later resume."""
    fd = part.fd
    if fd is None:
        return
    try:
        if part.tracked:
            save_progress(part, ranges)
    finally:
        part.fd = None
        os.close(fd)


# --- snapshots and refs -----------------------------------------------------------------------


class _DirChain:
    """
    Descriptors of the directories on the way to the current path, below a root descriptor,
    so a sorted list of paths is walked opening each directory once and holding only one
    chain of descriptors at a time.
    """

    def __init__(self, root_fd: int, *, create: bool, model: ModelDir | None = None,
                 where: str = "") -> None:
        self._root = root_fd
        self._create = create
        self._model = model
        self._where = where
        self._names: list[str] = []
        self._fds: list[int] = []

    def dir_for(self, parts: Sequence[str]) -> int:
        """The descriptor of directory C{parts} (relative to the root)."""
        keep = 0
        while keep < min(len(parts), len(self._names)) and parts[keep] == self._names[keep]:
            keep += 1
        while len(self._names) > keep:
            self._names.pop()
            os.close(self._fds.pop())
        for part in parts[keep:]:
            parent = self._fds[-1] if self._fds else self._root
            rel = "/".join([self._where, *self._names, part])
            fd = safefs.open_dir_at(
                parent,
                part,
                create=self._create,
                on_foreign=self._model.report_foreign if self._model is not None else None,
                where=rel,
            )
            self._names.append(part)
            self._fds.append(fd)
        return self._fds[-1] if self._fds else self._root

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.pop())
        self._names.clear()


def _snapshot_matches(snapshots_fd: int, commit: str, links: Iterable[LinkSpec]) -> bool:
    try:
        top = safefs.open_dir_at(snapshots_fd, commit)
    except OSError:
        return False
    chain = _DirChain(top, create=False)
    try:
        for link in sorted(links, key=lambda x: x.path):
            *dirs, leaf = link.path.split("/")
            try:
                if os.readlink(leaf, dir_fd=chain.dir_for(dirs)) != link.target:
                    return False
            except OSError:
                return False
        return True
    finally:
        chain.close()
        os.close(top)


def install_snapshot(model: ModelDir, commit: str, links: tuple[LinkSpec, ...]) -> str:
    """
    Make C{snapshots/<commit>} hold exactly the manifest's links (relative symlinks). The
    tree is built aside (in C{.llmport-tmp}, at the same depth so the relative links are
    already right) and renamed into place, so a reader never sees half a snapshot.

    @return: C{"kept"} (already correct), C{"created"} or C{"replaced"}.
    """
    if _snapshot_matches(model.snapshots, commit, links):
        return "kept"
    build = safefs.make_temp_dir_at(model.tmp, f"snapshot-{commit[:12]}-")
    try:
        build_fd = safefs.open_dir_at(model.tmp, build)
        chain = _DirChain(build_fd, create=True)
        try:
            for link in sorted(links, key=lambda x: x.path):
                *dirs, leaf = link.path.split("/")
                os.symlink(link.target, leaf, dir_fd=chain.dir_for(dirs))
        finally:
            chain.close()
            os.close(build_fd)
        outcome = "created"
        for _ in range(3):
            st = safefs.lstat_at(model.snapshots, commit)
            if st is not None:
                # Straight into the temporary folder under a fresh name: no path component
                # on the way that could have been swapped for a link.
                old = f"old-{secrets.token_hex(6)}"
                os.rename(commit, old, src_dir_fd=model.snapshots, dst_dir_fd=model.tmp)
                safefs.remove_entry(model.tmp, old, where=f"{TMP_DIR}/{old}")
                if not stat.S_ISDIR(st.st_mode):
                    model.report_foreign(f"snapshots/{commit}", safefs.describe_mode(st.st_mode))
                outcome = "replaced"
            try:
                os.rename(build, commit, src_dir_fd=model.tmp, dst_dir_fd=model.snapshots)
                break
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                    raise
        else:
            raise OSError(errno.EEXIST, "something keeps taking its place",
                          model.full(f"snapshots/{commit}"))
    except BaseException:
        safefs.remove_entry(model.tmp, build, where=f"{TMP_DIR}/{build}")
        raise
    safefs.fsync_fd(model.snapshots)
    return outcome


def write_ref(model: ModelDir, name: str, commit: str) -> bool:
    """
    Write C{refs/<name>} containing C{commit} with no trailing newline, atomically.

    @return: C{True} when the file changed.
    """
    *dirs, leaf = name.split("/")
    rel = "refs/" + name
    dir_fd = safefs.open_path_at(model.refs, dirs, create=True,
                                 on_foreign=model.report_foreign, where="refs")
    try:
        # Anything but a regular file there (a link, a directory) is removed as foreign.
        if _read_own_file(model, dir_fd, leaf, rel, 200) == commit.encode():
            return False
        safefs.atomic_write_at(dir_fd, leaf, commit.encode(), 0o644, tmp_dir_fd=model.tmp)
        return True
    finally:
        os.close(dir_fd)
