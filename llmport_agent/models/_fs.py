"""
Blocking file-system work of model delivery.

Everything here blocks (disk I/O, hashing, fsync) and is called only through a
L{llmport_agent.threads.BlockingRunner}, never on the reactor thread. Paths are built only
from names that L{llmport_agent.models.manifest.parse_manifest} validated; L{_inside} is a
second guard that a built path stays under the model directory.

Layout of one model directory (a HuggingFace hub cache repo folder)::

    <store>/<model_dir_name>/blobs/<hash>            verified blobs
    <store>/<model_dir_name>/blobs/<hash>.part       a download in progress (resumable)
    <store>/<model_dir_name>/refs/<name>             commit id, no trailing newline
    <store>/<model_dir_name>/snapshots/<commit>/...  relative symlinks into ../../blobs
    <store>/<model_dir_name>/.llmport-verified.json  what was verified: {hash: size, mtime_ns}
    <store>/<model_dir_name>/.llmport-tmp/           snapshot trees and refs being built
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any, BinaryIO

from attrs import define, frozen

from llmport_agent.models.manifest import BlobSpec, LinkSpec
from llmport_agent.storage import atomic_write, fsync_dir

VERIFIED_FILE = ".llmport-verified.json"
TMP_DIR = ".llmport-tmp"
PART_SUFFIX = ".part"
_READ_SIZE = 4 * 1024 * 1024
_RECORD_VERSION = 1


class StoreEscape(Exception):
    """A built path would leave the model directory (a bug: names are validated earlier)."""


def _inside(base: str, path: str) -> str:
    real_base = os.path.normpath(base)
    norm = os.path.normpath(path)
    if os.path.commonpath([real_base, norm]) != real_base or norm == real_base:
        raise StoreEscape(path)
    return path


def blob_path(model_dir: str, blob_hash: str) -> str:
    """C{<model_dir>/blobs/<hash>}."""
    return _inside(model_dir, os.path.join(model_dir, "blobs", blob_hash))


def part_path(model_dir: str, blob_hash: str) -> str:
    """C{<model_dir>/blobs/<hash>.part}."""
    return _inside(model_dir, os.path.join(model_dir, "blobs", blob_hash + PART_SUFFIX))


def _fsync_dir(path: str) -> None:
    try:
        fsync_dir(path)
    except OSError:
        pass


def prepare_model_dir(store_dir: str, model_dir_name: str) -> str:
    """
    Create C{<store>/<model_dir_name>/{blobs,refs,snapshots,.llmport-tmp}} and empty the
    temporary folder (leftovers of an interrupted run). Operations on one model directory
    are serialised by the caller, so nothing else is using the temporary folder.

    @return: the model directory path.
    """
    model_dir = _inside(store_dir, os.path.join(store_dir, model_dir_name))
    for sub in ("blobs", "refs", "snapshots", TMP_DIR):
        os.makedirs(os.path.join(model_dir, sub), exist_ok=True)
    tmp = os.path.join(model_dir, TMP_DIR)
    for entry in os.listdir(tmp):
        full = os.path.join(tmp, entry)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            try:
                os.unlink(full)
            except FileNotFoundError:
                pass
    return model_dir


def free_bytes(path: str) -> int:
    """Free bytes for an unprivileged writer on the file system holding C{path}."""
    return shutil.disk_usage(path).free


# --- the verification record ---------------------------------------------------------------


def load_record(model_dir: str) -> dict[str, tuple[int, int]]:
    """
    Read C{.llmport-verified.json}: C{{hash: (size, mtime_ns)}} of blobs already verified.
    A missing or damaged file is an empty record (everything gets verified again).
    """
    try:
        with open(os.path.join(model_dir, VERIFIED_FILE), "rb") as f:
            data = json.loads(f.read(16 * 1024 * 1024))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _RECORD_VERSION:
        return {}
    blobs = data.get("blobs")
    if not isinstance(blobs, dict):
        return {}
    out: dict[str, tuple[int, int]] = {}
    for name, entry in blobs.items():
        if (
            isinstance(name, str)
            and isinstance(entry, dict)
            and type(entry.get("size")) is int
            and type(entry.get("mtime_ns")) is int
        ):
            out[name] = (entry["size"], entry["mtime_ns"])
    return out


def save_record(model_dir: str, record: Mapping[str, tuple[int, int]]) -> None:
    """Write the verification record atomically (temporary file, fsync, rename)."""
    payload = {
        "version": _RECORD_VERSION,
        "blobs": {k: {"size": s, "mtime_ns": m} for k, (s, m) in sorted(record.items())},
    }
    data = json.dumps(payload, separators=(",", ":")).encode()
    atomic_write(os.path.join(model_dir, VERIFIED_FILE), data, 0o644,
                 tmp_dir=os.path.join(model_dir, TMP_DIR), private_dir=False)


# --- surveying what is there ------------------------------------------------------------------


@frozen
class BlobSurvey:
    """
    What the disk holds for one blob.

    @ivar state: C{"reuse"} (present, size and mtime recorded as verified), C{"verify"}
        (present with the right size but not recorded) or C{"fetch"} (missing).
    @ivar part_size: bytes already in C{<hash>.part} (for C{"fetch"}).
    @ivar mtime_ns: the blob's mtime (for C{"reuse"}).
    """

    blob: BlobSpec
    state: str
    part_size: int = 0
    mtime_ns: int = 0


def survey_blobs(
    model_dir: str, blobs: Iterable[BlobSpec], record: Mapping[str, tuple[int, int]]
) -> list[BlobSurvey]:
    """
    Classify each blob by C{stat} alone (no hashing). A blob file of the wrong size, or
    anything that is not a regular file, is removed so it will be fetched again; a partial
    download larger than the blob is removed too.
    """
    out: list[BlobSurvey] = []
    for blob in blobs:
        path = blob_path(model_dir, blob.hash)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if stat.S_ISREG(st.st_mode) and st.st_size == blob.size:
                if record.get(blob.hash) == (st.st_size, st.st_mtime_ns):
                    out.append(BlobSurvey(blob, "reuse", mtime_ns=st.st_mtime_ns))
                else:
                    out.append(BlobSurvey(blob, "verify"))
                continue
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        ppath = part_path(model_dir, blob.hash)
        try:
            pst = os.lstat(ppath)
        except FileNotFoundError:
            pst = None
        part_size = 0
        if pst is not None:
            if stat.S_ISREG(pst.st_mode) and pst.st_size <= blob.size:
                part_size = pst.st_size
            elif stat.S_ISDIR(pst.st_mode):
                shutil.rmtree(ppath)
            else:
                os.unlink(ppath)
        out.append(BlobSurvey(blob, "fetch", part_size=part_size))
    return out


def hash_file(path: str) -> str:
    """The sha256 hex digest of a file, read in large blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(_READ_SIZE)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def verify_blob(model_dir: str, blob: BlobSpec) -> tuple[bool, int]:
    """
    Check a present blob that is not in the record: its size, and its sha256 where its name
    is one. A mismatching file is removed.

    @return: C{(ok, mtime_ns)}.
    """
    path = blob_path(model_dir, blob.hash)
    st = os.stat(path)
    ok = st.st_size == blob.size
    expected = blob.sha256
    if ok and expected is not None:
        ok = hash_file(path) == expected
    if not ok:
        os.unlink(path)
        return False, 0
    return True, os.stat(path).st_mtime_ns


# --- partial downloads ----------------------------------------------------------------------


@define
class PartFile:
    """
    An open C{<hash>.part}. Only the jobs of one download touch it, one at a time (they are
    serialised by the caller), so it needs no lock.

    @ivar offset: bytes in the file (and fed to C{hasher}).
    @ivar hasher: a running sha256 of the content, or C{None} for non-sha256 names.
    @ivar resumed_bytes: bytes that were already on disk when the file was opened.
    """

    path: str
    final_path: str
    size: int
    expected_sha256: str | None
    fh: BinaryIO | None
    offset: int = 0
    hasher: Any = None
    resumed_bytes: int = 0


def open_part(model_dir: str, blob: BlobSpec) -> PartFile:
    """
    Open (or create) the blob's C{.part} file for appending. Existing content is kept for a
    resume and, for sha256 names, hashed now so the running digest covers the whole file.
    """
    path = part_path(model_dir, blob.hash)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    fh = os.fdopen(fd, "r+b")
    try:
        size = os.fstat(fd).st_size
        expected = blob.sha256
        hasher = hashlib.sha256() if expected is not None else None
        if size > blob.size:
            fh.truncate(0)
            size = 0
        if hasher is not None and size:
            fh.seek(0)
            remaining = size
            while remaining:
                block = fh.read(min(_READ_SIZE, remaining))
                if not block:
                    break
                hasher.update(block)
                remaining -= len(block)
        fh.seek(size)
    except BaseException:
        fh.close()
        raise
    return PartFile(
        path=path,
        final_path=blob_path(model_dir, blob.hash),
        size=blob.size,
        expected_sha256=expected,
        fh=fh,
        offset=size,
        hasher=hasher,
        resumed_bytes=size,
    )


def write_chunks(part: PartFile, chunks: list[bytes]) -> int:
    """Append C{chunks} to the part file, feeding the running hash. @return: the new offset."""
    fh = part.fh
    assert fh is not None, "part file is closed"
    hasher = part.hasher
    for chunk in chunks:
        fh.write(chunk)
        if hasher is not None:
            hasher.update(chunk)
        part.offset += len(chunk)
    return part.offset


def reset_part(part: PartFile) -> None:
    """Start the part file over from zero (the server sent the whole blob, or resume failed)."""
    fh = part.fh
    assert fh is not None, "part file is closed"
    fh.seek(0)
    fh.truncate(0)
    part.offset = 0
    part.resumed_bytes = 0
    if part.hasher is not None:
        part.hasher = hashlib.sha256()


def finish_part(part: PartFile) -> tuple[bool, str, int]:
    """
    Close the complete part file, check size and sha256, and rename it to its blob name.
    A mismatching file is removed.

    @return: C{(ok, what_was_found, mtime_ns)}; C{what_was_found} describes a mismatch.
    """
    fh = part.fh
    assert fh is not None, "part file is closed"
    fh.flush()
    os.fsync(fh.fileno())
    size = os.fstat(fh.fileno()).st_size
    fh.close()
    part.fh = None
    if size != part.size:
        os.unlink(part.path)
        return False, f"{size} bytes instead of {part.size}", 0
    if part.hasher is not None:
        digest = part.hasher.hexdigest()
        if digest != part.expected_sha256:
            os.unlink(part.path)
            return False, f"sha256 {digest}", 0
    os.replace(part.path, part.final_path)
    _fsync_dir(os.path.dirname(part.final_path))
    return True, "", os.stat(part.final_path).st_mtime_ns


def close_part(part: PartFile) -> None:
    """Close the part file if still open, keeping its content for a later resume."""
    fh, part.fh = part.fh, None
    if fh is not None:
        try:
            fh.flush()
        finally:
            fh.close()


# --- snapshots and refs -----------------------------------------------------------------------


def _snapshot_matches(root: str, links: Iterable[LinkSpec]) -> bool:
    for link in links:
        path = os.path.join(root, *link.path.split("/"))
        try:
            if os.readlink(path) != link.target:
                return False
        except OSError:
            return False
    return True


def install_snapshot(model_dir: str, commit: str, links: tuple[LinkSpec, ...]) -> str:
    """
    Make C{snapshots/<commit>} hold exactly the manifest's links. The tree is built aside (in
    C{.llmport-tmp}, at the same depth so the relative links are already right) and renamed
    into place, so a reader never sees half a snapshot.

    @return: C{"kept"} (already correct), C{"created"} or C{"replaced"}.
    """
    snapshots = os.path.join(model_dir, "snapshots")
    final = _inside(model_dir, os.path.join(snapshots, commit))
    if os.path.isdir(final) and not os.path.islink(final) and _snapshot_matches(final, links):
        return "kept"
    tmp_root = os.path.join(model_dir, TMP_DIR)
    build = tempfile.mkdtemp(prefix=f"snapshot-{commit[:12]}-", dir=tmp_root)
    try:
        os.chmod(build, 0o755)
        for link in links:
            dst = _inside(build, os.path.join(build, *link.path.split("/")))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.symlink(link.target, dst)
        if os.path.lexists(final):
            old = tempfile.mkdtemp(prefix="old-", dir=tmp_root)
            os.rename(final, os.path.join(old, "snapshot"))
            os.rename(build, final)
            shutil.rmtree(old, ignore_errors=True)
            outcome = "replaced"
        else:
            os.rename(build, final)
            outcome = "created"
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    _fsync_dir(snapshots)
    return outcome


def write_ref(model_dir: str, name: str, commit: str) -> bool:
    """
    Write C{refs/<name>} containing C{commit} with no trailing newline, atomically.

    @return: C{True} when the file changed.
    """
    refs = os.path.join(model_dir, "refs")
    path = _inside(refs, os.path.join(refs, *name.split("/")))
    try:
        with open(path, "rb") as f:
            if f.read(200) == commit.encode():
                return False
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        raise OSError(errno.EISDIR, "a directory is in the way of the ref", path) from None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write(path, commit.encode(), 0o644, tmp_dir=os.path.join(model_dir, TMP_DIR),
                 private_dir=False)
    return True
