"""
The HuggingFace hub cache manifest of protocol section 4.3, validated.

A manifest arrives from the network (inline in C{model_sync}, or from
C{GET /api/node-files/models/{model_id}/manifest}). Every name in it becomes a path under
C{MODEL_STORE}, so every name is checked here, once, before anything touches the disk:
L{parse_manifest} either returns a L{Manifest} whose names are all safe single segments or
safe relative paths, or raises L{CommandFailed} with C{invalid_command} and a message that
names the offending field (e.g. C{model_sync.snapshots[0].links[3].path}).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from llmport_agent.commands.base import INVALID_COMMAND, CommandFailed
from llmport_agent.core.values import frozen

#: Sources of C{model_sync} (protocol 4.3).
SOURCE_SYNC_FROM_SERVER = "sync_from_server"
SOURCE_DOWNLOAD_FROM_HF = "download_from_hf"

# Bounds that keep a hostile manifest from costing much before it is refused.
MAX_BLOBS = 100_000
MAX_LINKS = 200_000
MAX_REFS = 1_000
MAX_SNAPSHOTS = 1_000
MAX_PATH_BYTES = 4_096
MAX_SEGMENT_BYTES = 255

_DIR_NAME = re.compile(r"^models--[A-Za-z0-9][A-Za-z0-9._-]*(?:--[A-Za-z0-9._-]+)*$")
# Blob names: HF uses 40 hex (git sha1) and 64 hex (sha256); ollama-style stores use
# "sha256-<hex>". No dots at all: no ".", "..", nor a collision with "<hash>.part".
_BLOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
_SHA256_HEX = re.compile(r"^(?:sha256-)?([0-9a-fA-F]{64})$")
_COMMIT = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")
_REF_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@frozen
class BlobSpec:
    """
    One blob of the manifest.

    @ivar hash: the blob's file name under C{blobs/} (validated).
    @ivar size: its exact size in bytes.
    """

    hash: str
    size: int

    @property
    def sha256(self) -> str | None:
        """The expected lower-case sha256 hex digest, or C{None} when the name is not one."""
        return sha256_of_name(self.hash)


@frozen
class LinkSpec:
    """One snapshot entry: C{snapshots/<commit>/<path>} -> C{../../blobs/<blob_hash>}."""

    path: str
    blob_hash: str

    @property
    def target(self) -> str:
        """The relative symlink target, one C{../} per directory level plus two."""
        return link_target(self.path, self.blob_hash)


@frozen
class SnapshotSpec:
    """One snapshot tree (a commit) and its links."""

    commit: str
    links: tuple[LinkSpec, ...]


@frozen
class RefSpec:
    """One ref file: C{refs/<name>} containing C{commit} (no trailing newline)."""

    name: str
    commit: str


@frozen
class Manifest:
    """
    A validated manifest. Equal manifests describe the same work (used to share one
    operation between concurrent syncs).
    """

    model_id: str
    hf_repo_id: str
    model_dir_name: str
    blobs: tuple[BlobSpec, ...]
    refs: tuple[RefSpec, ...]
    snapshots: tuple[SnapshotSpec, ...]

    @property
    def total_size(self) -> int:
        """Sum of the blob sizes."""
        return sum(b.size for b in self.blobs)


def sha256_of_name(name: str) -> str | None:
    """
    The sha256 digest a blob name promises: C{<64 hex>} or C{sha256-<64 hex>}.

    @return: the lower-case hex digest, or C{None} for other names (size check only).
    """
    m = _SHA256_HEX.match(name)
    return m.group(1).lower() if m else None


def link_target(path: str, blob_hash: str) -> str:
    """
    The relative target of the symlink at C{snapshots/<commit>/<path>}.

    C{config.json} -> C{../../blobs/<hash>}; C{a/b/c} -> C{../../../../blobs/<hash>}.
    """
    depth = path.count("/")
    return "../" * (depth + 2) + "blobs/" + blob_hash


def _invalid(field: str, why: str) -> CommandFailed:
    return CommandFailed(INVALID_COMMAND, f"Invalid model manifest: {field} {why}.")


def _require_str(value: object, field: str, max_len: int = 1024) -> str:
    if not isinstance(value, str):
        raise _invalid(field, f"must be a string, not {type(value).__name__}")
    if not value:
        raise _invalid(field, "must not be empty")
    if len(value) > max_len:
        raise _invalid(field, f"is longer than {max_len} characters")
    if _CONTROL.search(value):
        raise _invalid(field, "contains control characters")
    return value


def _require_list(value: object, field: str, max_items: int) -> list[Any]:
    if not isinstance(value, list):
        raise _invalid(field, f"must be a list, not {type(value).__name__}")
    if len(value) > max_items:
        raise _invalid(field, f"has more than {max_items} entries")
    return value


def _require_obj(value: object, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _invalid(field, f"must be an object, not {type(value).__name__}")
    return value


def _require_size(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(field, "must be an integer")
    if value < 0:
        raise _invalid(field, "must not be negative")
    return value


def validate_model_dir_name(value: object, field: str) -> str:
    """A single path segment shaped like C{models--org--name}."""
    name = _require_str(value, field, MAX_SEGMENT_BYTES)
    if "/" in name or "\\" in name or not _DIR_NAME.match(name):
        raise _invalid(
            field,
            "must be one directory name like 'models--org--name' (letters, digits, '.', '_', '-')",
        )
    return name


def validate_blob_hash(value: object, field: str) -> str:
    """A blob file name: letters, digits, C{_} and C{-} only (hex digests, C{sha256-<hex>})."""
    name = _require_str(value, field, 128)
    if not _BLOB_NAME.match(name):
        raise _invalid(field, "must be a hash: letters, digits, '_' and '-' only")
    return name


def validate_commit(value: object, field: str) -> str:
    """A commit id: 40 or 64 lower-case hex digits."""
    commit = _require_str(value, field, 64)
    if not _COMMIT.match(commit):
        raise _invalid(field, "must be a commit hash of 40 (or 64) lower-case hex digits")
    return commit


def validate_ref_name(value: object, field: str) -> str:
    """A ref name: C{main}, or a relative path such as C{refs/pr/1}; no C{.}/C{..} segments."""
    name = _require_str(value, field, 256)
    for segment in name.split("/"):
        if not segment:
            raise _invalid(field, "must not be absolute or contain empty path segments")
        if segment in (".", ".."):
            raise _invalid(field, "must not contain '.' or '..' segments")
        if not _REF_SEGMENT.match(segment):
            raise _invalid(field, "may contain only letters, digits, '.', '_', '-' and '/'")
    return name


def validate_link_path(value: object, field: str) -> str:
    """
    A file path inside a snapshot: relative, C{/}-separated, no empty, C{.} or C{..}
    segments, no backslashes or control characters, bounded length.
    """
    path = _require_str(value, field, MAX_PATH_BYTES)
    if path.startswith("/"):
        raise _invalid(field, "must be a relative path")
    if "\\" in path:
        raise _invalid(field, "must not contain backslashes")
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise _invalid(field, f"is longer than {MAX_PATH_BYTES} bytes")
    for segment in path.split("/"):
        if not segment:
            raise _invalid(field, "must not contain empty path segments")
        if segment in (".", ".."):
            raise _invalid(field, "must not contain '.' or '..' segments")
        if len(segment.encode("utf-8", "surrogatepass")) > MAX_SEGMENT_BYTES:
            raise _invalid(field, f"has a path segment longer than {MAX_SEGMENT_BYTES} bytes")
    return path


def _check_tree(paths: list[tuple[str, str]], kind: str) -> None:
    """Refuse duplicates and a name that is both a file and a directory of another."""
    seen: dict[str, str] = {}
    dirs: dict[str, str] = {}
    for path, field in paths:
        if path in seen:
            raise _invalid(field, f"repeats the {kind} {path!r}")
        if path in dirs:
            raise _invalid(field, f"names a file where {dirs[path]} needs a directory")
        seen[path] = field
        parts = path.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if prefix in seen:
                raise _invalid(
                    field, f"needs {prefix!r} to be a directory, but {seen[prefix]} makes it a file"
                )
            dirs.setdefault(prefix, field)


def parse_manifest(obj: object, field: str = "model_sync") -> Manifest:
    """
    Validate a manifest object (protocol 4.3) into a L{Manifest}.

    @param obj: the decoded JSON object.
    @param field: how the object is named in error messages.
    @raise CommandFailed: C{invalid_command}, naming the field, for anything malformed or unsafe.
    """
    m = _require_obj(obj, field)
    model_id = _require_str(m.get("model_id"), f"{field}.model_id", 256)
    hf_repo_id_raw = m.get("hf_repo_id")
    hf_repo_id = (
        "" if hf_repo_id_raw is None else _require_str(hf_repo_id_raw, f"{field}.hf_repo_id", 256)
    )
    model_dir_name = validate_model_dir_name(m.get("model_dir_name"), f"{field}.model_dir_name")

    blobs: dict[str, BlobSpec] = {}
    for i, raw in enumerate(_require_list(m.get("blobs"), f"{field}.blobs", MAX_BLOBS)):
        bf = f"{field}.blobs[{i}]"
        b = _require_obj(raw, bf)
        name = validate_blob_hash(b.get("hash"), f"{bf}.hash")
        size = _require_size(b.get("size"), f"{bf}.size")
        other = blobs.get(name)
        if other is not None and other.size != size:
            raise _invalid(f"{bf}.size", f"disagrees with an earlier entry for blob {name}")
        blobs[name] = BlobSpec(name, size)

    refs: list[RefSpec] = []
    ref_paths: list[tuple[str, str]] = []
    raw_refs = m.get("refs")
    for i, raw in enumerate(
        [] if raw_refs is None else _require_list(raw_refs, f"{field}.refs", MAX_REFS)
    ):
        rf = f"{field}.refs[{i}]"
        r = _require_obj(raw, rf)
        name = validate_ref_name(r.get("name"), f"{rf}.name")
        refs.append(RefSpec(name, validate_commit(r.get("commit"), f"{rf}.commit")))
        ref_paths.append((name, f"{rf}.name"))
    _check_tree(ref_paths, "ref")

    snapshots: list[SnapshotSpec] = []
    commits: set[str] = set()
    total_links = 0
    raw_snaps = m.get("snapshots")
    for i, raw in enumerate(
        [] if raw_snaps is None else _require_list(raw_snaps, f"{field}.snapshots", MAX_SNAPSHOTS)
    ):
        sf = f"{field}.snapshots[{i}]"
        s = _require_obj(raw, sf)
        commit = validate_commit(s.get("commit"), f"{sf}.commit")
        if commit in commits:
            raise _invalid(f"{sf}.commit", f"repeats the snapshot {commit}")
        commits.add(commit)
        links: list[LinkSpec] = []
        paths: list[tuple[str, str]] = []
        raw_links = _require_list(s.get("links"), f"{sf}.links", MAX_LINKS)
        total_links += len(raw_links)
        if total_links > MAX_LINKS:
            raise _invalid(f"{field}.snapshots", f"have more than {MAX_LINKS} links in all")
        for j, raw_link in enumerate(raw_links):
            lf = f"{sf}.links[{j}]"
            link = _require_obj(raw_link, lf)
            path = validate_link_path(link.get("path"), f"{lf}.path")
            blob_hash = validate_blob_hash(link.get("blob_hash"), f"{lf}.blob_hash")
            if blob_hash not in blobs:
                raise _invalid(
                    f"{lf}.blob_hash", f"names blob {blob_hash}, which is not in {field}.blobs"
                )
            links.append(LinkSpec(path, blob_hash))
            paths.append((path, f"{lf}.path"))
        _check_tree(paths, "path")
        snapshots.append(SnapshotSpec(commit, tuple(links)))

    total = m.get("total_size")
    if total is not None:
        _require_size(total, f"{field}.total_size")  # informational; the blob sizes rule

    return Manifest(
        model_id=model_id,
        hf_repo_id=hf_repo_id,
        model_dir_name=model_dir_name,
        blobs=tuple(blobs.values()),
        refs=tuple(refs),
        snapshots=tuple(snapshots),
    )


def manifest_digest(manifest: Manifest) -> str:
    """
    The C{manifest_sha256} llm-port stores for a model on a node: SHA-256 (hex) of the
    canonical JSON of the manifest's blobs (C{hash}, C{size}; sorted by hash), refs
    (C{commit}, C{name}; sorted by name) and snapshots (C{commit} and its links
    C{blob_hash}, C{path} sorted by path; sorted by commit), keys sorted, no spaces. The same
    manifest gives the backend's own digest of it. Linear in the manifest (plus the sorts):
    run it off the reactor for big ones.
    """
    blobs = sorted(((b.hash, b.size) for b in manifest.blobs), key=lambda x: x[0])
    refs = sorted(((r.name, r.commit) for r in manifest.refs), key=lambda x: x[0])
    snapshots = sorted(
        (
            (s.commit, sorted(((link.path, link.blob_hash) for link in s.links), key=lambda x: x[0]))
            for s in manifest.snapshots
        ),
        key=lambda x: x[0],
    )
    canonical = {
        "blobs": [{"hash": h, "size": n} for h, n in blobs],
        "refs": [{"commit": c, "name": n} for n, c in refs],
        "snapshots": [
            {"commit": c, "links": [{"blob_hash": b, "path": p} for p, b in links]}
            for c, links in snapshots
        ],
    }
    encoded = json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(encoded).hexdigest()


def choose_revision(manifest: Manifest, requested: str | None) -> str | None:
    """
    The snapshot commit a C{sync_model} reports (protocol 10.4): the requested revision when
    it names a ref or a snapshot commit, else the ref C{main}, C{master}, the first ref, the
    first snapshot; C{None} when the manifest has neither refs nor snapshots.
    """
    refs = {r.name: r.commit for r in manifest.refs}
    commits = {s.commit for s in manifest.snapshots}
    if requested:
        if requested in refs:
            return refs[requested]
        if requested in commits:
            return requested
    for name in ("main", "master"):
        if name in refs:
            return refs[name]
    if manifest.refs:
        return manifest.refs[0].commit
    if manifest.snapshots:
        return manifest.snapshots[0].commit
    return None
