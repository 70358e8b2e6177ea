"""
The stand-in backend's model files: C{/api/node-files/models/...} (protocol 4.3).

L{ModelRepository} holds HuggingFace-cache-shaped models (in memory, or files on disk for
big ones) and builds their manifests; L{model_files_resource} serves them the way the real
backend does:

    GET <model_id>/manifest            -> the manifest (JSON)
    GET <model_id>/blob/<blob_hash>    -> the blob; C{Range: bytes=<start>-} and the bounded
                                          C{bytes=<start>-<end>} -> 206 with
                                          C{Content-Range: bytes s-e/size} (an end past the
                                          blob is clamped to it, as typical servers do);
                                          suffix ranges and a start past the end: 416

Mount the resource at C{/api/node-files/models}. Fault knobs (L{ModelFaults}) let tests
and demos exercise the agent's resume, retry, fallback and verification paths.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Callable
from typing import Any, BinaryIO, cast

from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET, Request
from zope.interface import implementer

from llmport_agent.core.values import define, frozen

_RANGE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$", re.IGNORECASE)
_CHUNK = 1024 * 1024


@define
class ModelFaults:
    """
    Faults to inject (mutable; change them between requests).

    @ivar ignore_range: answer every blob request with 200 and the whole blob.
    @ivar ignore_range_end: answer a bounded C{bytes=s-e} as if it were C{bytes=s-} (206
        from C{s} to the end of the blob), as some servers do.
    @ivar cut_after_bytes: once, drop the connection after this many body bytes of a blob
        response (the client sees a truncated body); reset to C{None} when used.
    @ivar cut_range_start: with C{cut_after_bytes}, cut only the response that starts at
        this offset.
    @ivar hold_range_start: hold the response that starts at this offset (send nothing)
        until another response of the same blob has been sent completely (at once if one
        already was); reset when used.
    @ivar hold_range_length: the same for the next ranged response of exactly this many
        bytes (the one-byte request that confirms C{Range}); reset when used.
    @ivar corrupt_blob: serve this blob with one byte changed (its hash no longer matches).
    @ivar fail_5xx_times: answer the next N requests (manifest or blob) with 503.
    @ivar rate_limit: bytes per second per blob response (0 = unlimited): a link or a
        proxy that limits each connection (benchmarks of ranged downloads).
    @ivar refuse_range_times: answer the next N ranged blob requests with 416 (a proxy or
        a backend that lost the partial file's version).
    @ivar wrong_range_start: once, answer a ranged blob request with 206 from this offset
        instead of the one asked (Content-Range and body both start there).
    """

    ignore_range: bool = False
    ignore_range_end: bool = False
    cut_after_bytes: int | None = None
    cut_range_start: int | None = None
    hold_range_start: int | None = None
    hold_range_length: int | None = None
    corrupt_blob: str | None = None
    fail_5xx_times: int = 0
    rate_limit: int = 0
    refuse_range_times: int = 0
    wrong_range_start: int | None = None


@frozen
class ServedRequest:
    """One request as the resource answered it (for tests and the demo's log)."""

    kind: str  # "manifest", "blob" or "other"
    model_id: str
    blob_hash: str | None
    range_header: str | None
    status: int
    start: int = 0
    end: int = -1  # last byte served (inclusive)


@frozen
class _BlobSource:
    size: int
    data: bytes | None = None
    path: str | None = None

    def open(self) -> BinaryIO:
        if self.data is not None:
            return io.BytesIO(self.data)
        assert self.path is not None
        return open(self.path, "rb")


@define
class _Model:
    model_id: str
    hf_repo_id: str
    blobs: dict[str, _BlobSource]
    snapshots: dict[str, dict[str, str]]  # commit -> {path: blob_hash}
    refs: dict[str, str]


def manifest_sha256(manifest: dict[str, Any]) -> str:
    """
    The backend's digest of a manifest (current generation): SHA-256 of the JSON, keys
    sorted and no spaces, of its blobs C{{hash, size}} by hash, refs C{{commit, name}} by
    name and snapshots C{{commit, links: [{blob_hash, path}] by path}} by commit.
    """
    blobs = sorted((str(b["hash"]), int(b["size"])) for b in manifest["blobs"])
    refs = sorted((str(r["name"]), str(r["commit"])) for r in manifest["refs"])
    snaps = sorted(
        (str(snap["commit"]), sorted((str(x["path"]), str(x["blob_hash"])) for x in snap["links"]))
        for snap in manifest["snapshots"]
    )
    doc = {
        "blobs": [{"hash": h, "size": n} for h, n in blobs],
        "refs": [{"commit": c, "name": n} for n, c in refs],
        "snapshots": [
            {"commit": c, "links": [{"blob_hash": h, "path": p} for p, h in links]}
            for c, links in snaps
        ],
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def model_dir_name(hf_repo_id: str) -> str:
    """C{org/name} -> C{models--org--name} (the hub cache folder name)."""
    return "models--" + hf_repo_id.replace("/", "--")


class ModelRepository:
    """
    The backend's model store. L{add_model} and L{add_model_from_dir} return the manifest
    (protocol 4.3 shape, sha256 blob names); adding the same C{model_id} again with another
    commit adds a snapshot (and moves the ref).
    """

    def __init__(self, clock: Any = None) -> None:
        if clock is None:
            from twisted.internet import reactor as clock
        self.clock = clock
        self.faults = ModelFaults()
        self.requests: list[ServedRequest] = []
        #: blob responses in the order they were sent completely
        self.finished: list[ServedRequest] = []
        self._models: dict[str, _Model] = {}
        self._held: list[tuple[str, _BlobProducer]] = []

    def hold(self, blob_hash: str, producer: _BlobProducer) -> None:
        """Keep C{producer} paused until another response of C{blob_hash} has finished."""
        self._held.append((blob_hash, producer))

    def response_finished(self, served: ServedRequest) -> None:
        """Record a completely sent response and release what waited for its blob."""
        self.finished.append(served)
        still: list[tuple[str, _BlobProducer]] = []
        for blob_hash, producer in self._held:
            if blob_hash == served.blob_hash:
                producer.release()
            else:
                still.append((blob_hash, producer))
        self._held = still

    def add_model(
        self,
        model_id: str,
        hf_repo_id: str,
        files: dict[str, bytes],
        *,
        commit: str | None = None,
        ref: str = "main",
    ) -> dict[str, Any]:
        """Add a model from in-memory files C{{relative path: content}}."""
        entries = {
            path: (hashlib.sha256(data).hexdigest(), _BlobSource(len(data), data=data))
            for path, data in files.items()
        }
        return self._add(model_id, hf_repo_id, entries, commit, ref)

    def add_model_from_dir(
        self,
        model_id: str,
        hf_repo_id: str,
        directory: str,
        *,
        commit: str | None = None,
        ref: str = "main",
    ) -> dict[str, Any]:
        """
        Add a model from the regular files under C{directory} (served from disk, so they can
        be big). Blocking: hashes every file; call it before the reactor runs or in a thread.
        """
        entries: dict[str, tuple[str, _BlobSource]] = {}
        for root, _dirs, names in os.walk(directory):
            for name in names:
                full = os.path.join(root, name)
                rel = os.path.relpath(full, directory).replace(os.sep, "/")
                h = hashlib.sha256()
                with open(full, "rb") as f:
                    while block := f.read(4 * 1024 * 1024):
                        h.update(block)
                entries[rel] = (h.hexdigest(), _BlobSource(os.path.getsize(full), path=full))
        return self._add(model_id, hf_repo_id, entries, commit, ref)

    def _add(
        self,
        model_id: str,
        hf_repo_id: str,
        entries: dict[str, tuple[str, _BlobSource]],
        commit: str | None,
        ref: str,
    ) -> dict[str, Any]:
        links = {path: blob_hash for path, (blob_hash, _) in sorted(entries.items())}
        if commit is None:
            commit = hashlib.sha1(json.dumps(links, sort_keys=True).encode()).hexdigest()
        model = self._models.get(model_id)
        if model is None:
            model = _Model(model_id, hf_repo_id, {}, {}, {})
            self._models[model_id] = model
        for blob_hash, source in entries.values():
            model.blobs[blob_hash] = source
        model.snapshots[commit] = links
        model.refs[ref] = commit
        manifest = self.manifest(model_id)
        assert manifest is not None
        return manifest

    def manifest(self, model_id: str) -> dict[str, Any] | None:
        """The manifest of C{model_id} as the backend serves it, or C{None}."""
        model = self._models.get(model_id)
        if model is None:
            return None
        blobs = [{"hash": h, "size": s.size} for h, s in sorted(model.blobs.items())]
        manifest = {
            "model_id": model.model_id,
            "hf_repo_id": model.hf_repo_id,
            "source": "sync_from_server",
            "model_dir_name": model_dir_name(model.hf_repo_id),
            "blobs": blobs,
            "refs": [{"name": n, "commit": c} for n, c in sorted(model.refs.items())],
            "snapshots": [
                {
                    "commit": commit,
                    "links": [{"path": p, "blob_hash": h} for p, h in sorted(links.items())],
                }
                for commit, links in model.snapshots.items()
            ],
            "total_size": sum(s.size for s in model.blobs.values()),
        }
        manifest["manifest_sha256"] = manifest_sha256(manifest)
        return manifest

    def blob(self, model_id: str, blob_hash: str) -> _BlobSource | None:
        model = self._models.get(model_id)
        return None if model is None else model.blobs.get(blob_hash)

    def blob_requests(self, blob_hash: str | None = None) -> list[ServedRequest]:
        """The blob requests served so far (optionally of one blob)."""
        return [
            r
            for r in self.requests
            if r.kind == "blob" and (blob_hash is None or r.blob_hash == blob_hash)
        ]


@implementer(IPushProducer)
class _BlobProducer:
    """
    Writes C{length} bytes of a blob from C{start}, chunk after chunk until the transport
    pauses it (a push producer: no cooperator, so it also runs under iosim/StubTreq).
    """

    def __init__(
        self,
        request: Request,
        source: _BlobSource,
        start: int,
        length: int,
        cut_after: int | None,
        corrupt: bool,
        on_finish: Callable[[], None] = lambda: None,
        held: bool = False,
        rate_limit: int = 0,
        clock: Any = None,
    ) -> None:
        self._request = request
        self._file: BinaryIO | None = source.open()
        self._file.seek(start)
        self._left = length
        self._sent = 0
        self._cut_after = cut_after
        self._corrupt = corrupt
        self._on_finish = on_finish
        self._held = held
        self._rate = rate_limit
        self._clock = clock
        self._started: float | None = None
        self._wakeup: Any = None
        self._finished = False
        self._paused = False
        self._producing = False

    def release(self) -> None:
        """Start sending a held response."""
        self._held = False
        self.resumeProducing()

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        self._run()

    def _run(self) -> None:
        if self._producing or self._held or self._paused:
            return
        self._producing = True
        try:
            while not self._paused and not self._finished:
                if self._rate and self._throttled():
                    return
                self._step()
        finally:
            self._producing = False

    def _throttled(self) -> bool:
        """Ahead of C{rate_limit}: come back when the budget allows the next chunk."""
        now = self._clock.seconds()
        if self._started is None:
            self._started = now
        ahead = self._sent / self._rate - (now - self._started)
        if ahead <= 0:
            return False
        if self._wakeup is None or not self._wakeup.active():
            self._wakeup = self._clock.callLater(ahead, self._run)
        return True

    def stopProducing(self) -> None:
        self._close()

    def _step(self) -> None:
        assert self._file is not None
        n = min(_CHUNK, self._left)
        if self._cut_after is not None:
            n = min(n, self._cut_after - self._sent)
        data = self._file.read(n) if n > 0 else b""
        if self._corrupt and self._sent == 0 and data:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        self._sent += len(data)
        self._left -= len(data)
        if data:
            self._request.write(data)
        if self._cut_after is not None and self._sent >= self._cut_after and self._left > 0:
            self._close()
            self._request.unregisterProducer()
            channel: Any = self._request.channel
            if channel is not None:
                channel.loseConnection()  # flushes what was written, then closes
            return
        if self._left <= 0 or not data:
            self._close()
            self._request.unregisterProducer()
            self._request.finish()
            self._on_finish()

    def _close(self) -> None:
        self._finished = True
        if self._wakeup is not None and self._wakeup.active():
            self._wakeup.cancel()
        f, self._file = self._file, None
        if f is not None:
            f.close()


class _ModelFilesResource(Resource):
    isLeaf = True
    log = Logger()

    def __init__(self, repo: ModelRepository, authorize: Callable[[IRequest], bool]) -> None:
        super().__init__()
        self._repo = repo
        self._authorize = authorize

    def _json(self, request: Request, status: int, body: object) -> bytes:
        request.setResponseCode(status)
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(body).encode()

    def render_GET(self, request: Request) -> bytes | int:
        try:
            segments = [s.decode("utf-8") for s in request.postpath or []]
        except UnicodeDecodeError:
            segments = []
        range_header = request.getHeader(b"range")
        range_text = range_header.decode("latin-1") if range_header is not None else None
        kind = "other"
        model_id = segments[0] if segments else ""
        blob_hash: str | None = None
        if len(segments) == 2 and segments[1] == "manifest":
            kind = "manifest"
        elif len(segments) == 3 and segments[1] == "blob":
            kind, blob_hash = "blob", segments[2]

        def served(status: int, start: int = 0, end: int = -1) -> ServedRequest:
            entry = ServedRequest(kind, model_id, blob_hash, range_text, status, start, end)
            self._repo.requests.append(entry)
            return entry

        if not self._authorize(cast(IRequest, request)):
            served(401)
            return self._json(request, 401, {"detail": "Credential is invalid or revoked."})
        faults = self._repo.faults
        if kind != "other" and faults.fail_5xx_times > 0:
            faults.fail_5xx_times -= 1
            served(503)
            return self._json(request, 503, {"detail": "Injected failure."})
        if kind == "manifest":
            manifest = self._repo.manifest(model_id)
            if manifest is None:
                served(404)
                return self._json(request, 404, {"detail": "Model not found."})
            served(200)
            return self._json(request, 200, manifest)
        if kind != "blob" or blob_hash is None:
            served(404)
            return self._json(request, 404, {"detail": "Not Found"})
        source = self._repo.blob(model_id, blob_hash)
        if source is None:
            served(404)
            return self._json(request, 404, {"detail": "Blob not found."})

        size = source.size
        start, end, status = 0, size - 1, 200
        if range_text is not None and not faults.ignore_range:
            m = _RANGE.match(range_text)
            if m is not None and "," not in range_text:
                first, last = m.group(1), m.group(2)
                if not first:  # suffix range: not supported by the backend
                    served(416)
                    request.setHeader(b"content-range", f"bytes */{size}".encode())
                    return self._json(request, 416, {"detail": "Suffix ranges are not supported."})
                start = int(first)
                end = min(int(last), size - 1) if last and not faults.ignore_range_end else size - 1
                if start >= size or end < start or faults.refuse_range_times > 0:
                    if faults.refuse_range_times > 0:
                        faults.refuse_range_times -= 1
                    served(416)
                    request.setHeader(b"content-range", f"bytes */{size}".encode())
                    return self._json(request, 416, {"detail": "Range not satisfiable."})
                if faults.wrong_range_start is not None:
                    start, faults.wrong_range_start = faults.wrong_range_start, None
                status = 206
                request.setHeader(b"content-range", f"bytes {start}-{end}/{size}".encode())
        length = max(0, end - start + 1)
        entry = served(status, start, end)
        request.setResponseCode(status)
        request.setHeader(b"content-type", b"application/octet-stream")
        request.setHeader(b"accept-ranges", b"bytes")
        request.setHeader(b"content-length", str(length).encode())
        if length == 0:
            self._repo.response_finished(entry)
            return b""
        cut = faults.cut_after_bytes
        if cut is not None and faults.cut_range_start in (None, start):
            faults.cut_after_bytes = None
            faults.cut_range_start = None
        else:
            cut = None
        by_length = status == 206 and length == faults.hold_range_length
        held = by_length or (faults.hold_range_start == start and status == 206)
        if held:
            if by_length:
                faults.hold_range_length = None
            else:
                faults.hold_range_start = None
            # Already behind another finished response of this blob: nothing to wait for.
            held = not any(r.blob_hash == blob_hash for r in self._repo.finished)
        producer = _BlobProducer(
            request,
            source,
            start,
            length,
            cut,
            faults.corrupt_blob == blob_hash,
            on_finish=lambda: self._repo.response_finished(entry),
            held=held,
            rate_limit=faults.rate_limit,
            clock=self._repo.clock,
        )
        if held:
            self._repo.hold(blob_hash, producer)
        request.notifyFinish().addErrback(lambda _: producer.stopProducing())
        request.registerProducer(producer, True)
        producer.resumeProducing()
        return NOT_DONE_YET


def model_files_resource(repo: ModelRepository, authorize: Callable[[IRequest], bool]) -> IResource:
    """
    The resource to mount at C{/api/node-files/models}.

    @param authorize: C{authorize(request) -> bool}; C{False} answers 401 (checked first,
        as the backend does).
    """
    return cast(IResource, _ModelFilesResource(repo, authorize))
