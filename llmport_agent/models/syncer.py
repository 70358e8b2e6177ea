"""
Air-gapped model delivery: copy a HuggingFace hub cache from the backend into MODEL_STORE.

L{ModelSyncer.sync} takes a C{model_sync} object (protocol 4.3), validates its manifest
(inline, or fetched from the backend), and makes C{MODEL_STORE/<model_dir_name>/} a valid
hub cache:

 1. survey the blobs by C{stat} alone; blobs recorded as verified (same size, mtime, inode and ctime) in
    C{.llmport-verified.json} are reused without hashing;
 2. check the free disk against what is still missing;
 3. verify present-but-unrecorded blobs and download missing ones, several at once, each
    streamed into C{<hash>.part} (resumed with C{Range}), hashed while it is written, then
    renamed; network errors and 5xx are retried with backoff;
 4. build each snapshot tree aside and rename it into place, then write the refs.

All disk work and hashing runs on the injected runner; the reactor thread only moves bytes.
Two syncs of the same model directory share one operation (identical manifests) or run one
after the other (different manifests).
"""

from __future__ import annotations

import copy
import errno
import functools
import json
import os
import random as _random
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import quote

from attrs import field
from treq.client import HTTPClient
from twisted.internet import defer, error
from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import (
    RequestTransmissionFailed,
    ResponseFailed,
    ResponseNeverReceived,
)

from llmport_agent.commands.base import INTERNAL_ERROR, INVALID_COMMAND, CommandFailed
from llmport_agent.core.threads import BlockingRunner
from llmport_agent.core.values import define
from llmport_agent.models import _fs
from llmport_agent.models._http import (
    FlowBudget,
    ReactorTime,
    Retry,
    TransferInterrupted,
    describe_error,
    detail_of,
    read_limited,
    read_small,
)
from llmport_agent.models._jobs import FileJobs, run_together
from llmport_agent.models.errors import (
    CHECKSUM_MISMATCH,
    CREDENTIAL_REJECTED,
    DOWNLOAD_FAILED,
    INSUFFICIENT_DISK,
    SNAPSHOT_MISSING,
    STORAGE_ERROR,
)
from llmport_agent.models.manifest import (
    SOURCE_DOWNLOAD_FROM_HF,
    SOURCE_SYNC_FROM_SERVER,
    BlobSpec,
    Manifest,
    choose_revision,
    manifest_digest,
    parse_manifest,
)
from llmport_agent.models.transfer import (
    BlobSource,
    BlobTransfer,
    CpuSample,
    RangeSupport,
    TransferSettings,
    read_cpu,
)

PHASE = "sync_model"
#: The most connections per blob the adaptive setting (C{connections=0}) opens.
AUTO_MAX_CONNECTIONS = 4
MAX_MANIFEST_BYTES = 64 * 1024 * 1024

_NETWORK_ERRORS: tuple[type[BaseException], ...] = (
    error.ConnectError,
    error.ConnectionLost,
    error.ConnectionDone,
    error.DNSLookupError,
    error.TimeoutError,
    defer.TimeoutError,
    ResponseFailed,
    ResponseNeverReceived,
    RequestTransmissionFailed,
    TransferInterrupted,
)

ProgressCallback = Callable[..., None]


def _decode_manifest(body: bytes, what: str) -> Manifest:
    """Thread function: the backend's manifest, decoded and checked (L{parse_manifest})."""
    try:
        data = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CommandFailed(DOWNLOAD_FAILED, f"The backend sent {what} that is not valid JSON.") from None
    return parse_manifest(data, "manifest")


_Retry = Retry

_RETRYABLE: tuple[type[BaseException], ...] = (_Retry, *_NETWORK_ERRORS)


def _wraps_cancellation(exc: BaseException) -> bool:
    """Whether a twisted.web client error carries a C{CancelledError} as its reason."""
    for reason in getattr(exc, "reasons", None) or []:
        if isinstance(reason, Failure) and reason.check(CancelledError):
            return True
    return False


def _size(n: int | float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


class _Progress:
    """Byte counts of one operation, reported at most once per C{interval} seconds."""

    def __init__(
        self, clock: ReactorTime, emit: ProgressCallback, label: str, interval: float
    ) -> None:
        self._clock = clock
        self._emit = emit
        self._label = label
        self._interval = interval
        self._last: float | None = None
        self.total = 0
        self.done = 0
        self.files_total = 0
        self.files_done = 0

    def add(self, n: int) -> None:
        self.done += n
        self.report()

    def rewind(self, n: int) -> None:
        self.done = max(0, self.done - n)

    def pct(self) -> float:
        if self.total <= 0:
            return 0.0
        return round(min(100.0, self.done * 100.0 / self.total), 1)

    def report(
        self, message: str | None = None, *, force: bool = False, pct: float | None = None
    ) -> None:
        now = self._clock.seconds()
        if not force and self._last is not None and now - self._last < self._interval:
            return
        self._last = now
        if message is None:
            message = (
                f"Downloading {self._label}: {_size(self.done)} of {_size(self.total)} "
                f"({self.files_done} of {self.files_total} files)"
            )
        self._emit(
            PHASE,
            message,
            bytes_done=self.done,
            bytes_total=self.total,
            progress_pct=self.pct() if pct is None else pct,
            files_done=self.files_done,
            files_total=self.files_total,
        )


@define(eq=False)
class _Run:
    """The mutable state of one sync of one model directory."""

    manifest: Manifest
    model: _fs.ModelDir
    progress: _Progress
    record: dict[str, _fs.Stamp]
    jobs: FileJobs
    record_changed: bool = False
    fetched_count: int = 0
    fetched_bytes: int = 0
    reused_count: int = 0
    reused_bytes: int = 0
    verified_count: int = 0
    verified_bytes: int = 0
    resumed: int = 0
    retries: int = 0
    range_ignored: int = 0
    range_end_ignored: int = 0
    connections_used: int = 1
    # What the first large blob of this sync learnt (adaptive connections): later ones
    # start there and do not probe again.
    learned_connections: int | None = None

    @property
    def model_dir(self) -> str:
        return self.model.path

    @property
    def label(self) -> str:
        return self.manifest.hf_repo_id or self.manifest.model_id

    def remember(self, blob: BlobSpec, stamp: _fs.Stamp | None) -> None:
        if stamp is None:
            return
        self.record[blob.hash] = stamp
        self.record_changed = True

    def forget(self, blob: BlobSpec) -> None:
        if self.record.pop(blob.hash, None) is not None:
            self.record_changed = True


@define(eq=False)
class _Operation:
    """One sync of one model directory, shared by every caller that asked for it."""

    manifest: Manifest
    deferred: Deferred[dict[str, Any]] | None = None
    finished: bool = False
    cancelled: bool = False
    outcome: dict[str, Any] | Failure | None = None
    _listeners: list[tuple[Deferred[dict[str, Any]], ProgressCallback]] = field(factory=list)
    _waiters: list[Deferred[None]] = field(factory=list)

    log = Logger()

    def subscribe(self, progress: ProgressCallback) -> Deferred[dict[str, Any]]:
        """A Deferred of this operation's result; cancelling it detaches only this caller."""
        if self.finished:
            if isinstance(self.outcome, Failure):
                return fail(self.outcome)
            return succeed(copy.deepcopy(self.outcome or {}))
        d: Deferred[dict[str, Any]] = Deferred(self._unsubscribe)
        self._listeners.append((d, progress))
        return d

    def _unsubscribe(self, d: Deferred[dict[str, Any]]) -> None:
        self._listeners = [(x, p) for x, p in self._listeners if x is not d]
        if not self._listeners and not self.finished and self.deferred is not None:
            self.cancelled = True  # nobody may join it now; it is winding down
            self.deferred.cancel()

    def emit(self, *args: Any, **kwargs: Any) -> None:
        """Send one progress report to every caller."""
        for _, progress in list(self._listeners):
            try:
                progress(*args, **kwargs)
            except Exception:
                self.log.failure("model sync progress callback failed")

    def when_done(self) -> Deferred[None]:
        """Fires (with C{None}) when the operation has ended, whatever its outcome."""
        if self.finished:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._waiters.append(d)
        return d

    def settle(self, outcome: dict[str, Any] | Failure) -> None:
        self.finished = True
        self.outcome = outcome
        listeners, self._listeners = self._listeners, []
        waiters, self._waiters = self._waiters, []
        for d, _ in listeners:
            if isinstance(outcome, Failure):
                d.errback(outcome)
            else:
                d.callback(copy.deepcopy(outcome))
        for w in waiters:
            if not w.called:
                w.callback(None)


class ModelSyncer:
    """
    Copies models from the backend into the model store (protocol 4.3).

    @param reactor: provides L{ReactorTime} (timeouts, backoff, progress pacing).
    @param http: the treq client for the backend (its own connection pool).
    @param runner: runs blocking file work and hashing off the reactor thread; give it
        C{2 * concurrency + 1} threads (each blob writes and hashes at the same time).
    @param store_dir: MODEL_STORE.
    @param backend_url: LLM_PORT_NODE_AGENT_BACKEND_URL, base path kept.
    @param credential: returns the node credential (called per request; never logged).
    @param concurrency: blobs downloaded at once.
    @param connections: connections (bounded C{Range} requests) per large sha256 blob:
        C{0} = adaptive (start with one, add up to L{AUTO_MAX_CONNECTIONS} while the host
        has CPU to spare and each addition makes the blob arrive faster), C{1} = one stream
        per blob, C{N} = always N.
    @param segment_size: bytes per ranged request; blobs smaller than two segments use
        one stream.
    @param buffer_bytes: bytes all downloads together may hold in memory (received, not yet
        written and hashed).
    @param retry_max: consecutive failed attempts (without progress) per blob before giving up.
    @param free_space: C{free_space(path) -> bytes}; defaults to C{statvfs} of the model
        directory. Runs on the runner.
    @param cpu: CPU counters for the adaptive setting (L{read_cpu}: this process and the
        host's idle time); it adds connections only while the host has CPU to spare.
    """

    log = Logger()

    def __init__(
        self,
        reactor: IReactorTime,
        http: HTTPClient,
        runner: BlockingRunner,
        *,
        store_dir: str,
        backend_url: str,
        credential: Callable[[], str],
        concurrency: int = 4,
        connections: int = 0,
        segment_size: int = 32 * 1024 * 1024,
        buffer_bytes: int = 256 * 1024 * 1024,
        batch_size: int = 2 * 1024 * 1024,
        retry_max: int = 8,
        free_space: Callable[[str], int] | None = None,
        retry_initial_delay: float = 1.0,
        retry_max_delay: float = 60.0,
        request_timeout: float = 60.0,
        idle_timeout: float = 120.0,
        progress_interval: float = 1.0,
        rng: _random.Random | None = None,
        cpu: Callable[[], CpuSample | None] | None = None,
    ) -> None:
        if concurrency < 1 or connections < 0:
            raise ValueError("concurrency must be at least 1 and connections at least 0")
        if segment_size < 1 or batch_size < 1:
            raise ValueError("segment_size and batch_size must be at least 1")
        #: Bytes received from the backend's file endpoint, all syncs together (metrics).
        self.bytes_downloaded = 0
        self._reactor: Any = reactor
        self._http = http
        self._runner = runner
        self._store_dir = store_dir
        self._backend_url = backend_url.rstrip("/")
        self._credential = credential
        self._concurrency = concurrency
        self._segment_size = segment_size
        self._budget = FlowBudget(buffer_bytes)
        # What the server showed about bounded ranges, shared by every blob's transfer.
        self._ranges = RangeSupport()
        self._retry_max = max(0, retry_max)
        self._free_space = free_space
        self._retry_initial_delay = retry_initial_delay
        self._retry_max_delay = retry_max_delay
        self._request_timeout = request_timeout
        self._progress_interval = progress_interval
        self._rng = rng or _random.Random()
        self._ops: dict[str, _Operation] = {}
        self._source = BlobSource(
            reactor=reactor,
            settings=TransferSettings(
                connections=connections or AUTO_MAX_CONNECTIONS,
                adaptive=connections == 0,
                segment_size=segment_size,
                batch_size=batch_size,
                stream_high_water=max(4 * batch_size, 8 * 1024 * 1024),
                idle_timeout=idle_timeout,
                retry_max=self._retry_max,
            ),
            ranges=self._ranges,
            budget=self._budget,
            headers=self._headers,
            get=self._get,
            refuse=self._refuse,
            pause=self._pause,
            downloaded=self._count_downloaded,
            cpu=cpu or read_cpu,
        )

    # -- public --------------------------------------------------------------------------

    @property
    def bounded_ranges(self) -> bool | None:
        """Whether the backend honours the end of a bounded C{Range} (C{None}: not seen yet)."""
        return self._ranges.bounded

    async def sync(
        self,
        model_sync: Mapping[str, Any],
        progress: ProgressCallback,
        *,
        report: bool = False,
        revision: str | None = None,
    ) -> dict[str, Any]:
        """
        Make the model of C{model_sync} present and verified in the store.

        @param model_sync: the C{model_sync} object: a full manifest, or at least
            C{model_id} (the manifest is then fetched from the backend).
        @param progress: called as C{progress("sync_model", message, bytes_done=...,
            bytes_total=..., progress_pct=..., files_done=..., files_total=...)}, at most
            about once per second.
        @param report: add what the backend reads from a C{sync_model} result (protocol
            10.4, see L{_report}): the model's snapshot directory on this node, the revision,
            C{manifest_sha256}, C{total_size}; a missing snapshot directory then fails.
        @param revision: the requested revision (a ref name or a snapshot commit).
        @return: what was fetched, reused and verified (see L{_result}).
        @raise CommandFailed: C{invalid_command}, C{insufficient_disk},
            C{credential_rejected}, C{download_failed}, C{checksum_mismatch},
            C{storage_error}.
        """
        if not isinstance(model_sync, Mapping):
            raise CommandFailed(INVALID_COMMAND, "model_sync must be an object.")
        source = model_sync.get("source")
        if source == SOURCE_DOWNLOAD_FROM_HF and report:
            # The current backend marks a model READY on a successful sync_model: a model this
            # node did not copy must not be reported so (the original agent refuses it too).
            raise CommandFailed(
                INVALID_COMMAND,
                "sync_model copies a model from the backend (model_sync.source "
                f"'{SOURCE_SYNC_FROM_SERVER}' with its manifest); a '{SOURCE_DOWNLOAD_FROM_HF}' "
                "model is downloaded by the workload's container when it is deployed.",
            )
        if source == SOURCE_DOWNLOAD_FROM_HF:
            return {
                "source": source,
                "skipped": True,
                "reason": "The model is downloaded by the container itself (source download_from_hf).",
            }
        if source is not None and source != SOURCE_SYNC_FROM_SERVER:
            raise CommandFailed(
                INVALID_COMMAND,
                f"Invalid model manifest: model_sync.source must be "
                f"'{SOURCE_SYNC_FROM_SERVER}' or '{SOURCE_DOWNLOAD_FROM_HF}'.",
            )
        if "blobs" in model_sync:
            manifest = parse_manifest(model_sync, "model_sync")
        else:
            model_id = model_sync.get("model_id")
            if not isinstance(model_id, str) or not model_id or len(model_id) > 256:
                raise CommandFailed(
                    INVALID_COMMAND,
                    "Invalid model manifest: model_sync.model_id must be a non-empty string "
                    "when model_sync carries no blobs.",
                )
            manifest = await self._fetch_manifest(model_id)
        result = await self._join(manifest, progress)
        if not report:
            return result
        return await self._report(manifest, result, revision)

    async def _report(
        self, manifest: Manifest, result: dict[str, Any], revision: str | None
    ) -> dict[str, Any]:
        """
        The fields the current backend reads to mark the model READY on this node: C{synced},
        C{model_id}, C{hf_repo_id}, C{model_dir_name}, C{root_path} (the snapshot directory
        on this node), C{cache_root}, C{revision} (the commit used), C{manifest_sha256},
        C{total_size}, C{files_synced}.

        @raise CommandFailed: C{snapshot_missing} when there is no revision or no
            C{snapshots/<commit>} directory for it: a READY model must name a directory that
            exists.
        """
        label = manifest.hf_repo_id or manifest.model_id or manifest.model_dir_name
        commit = choose_revision(manifest, revision)
        if commit is None:
            raise CommandFailed(
                SNAPSHOT_MISSING,
                f"The manifest of {label} names no revision (no refs and no snapshots), so "
                "there is no model directory to report; sync the model again from a complete "
                "copy on the backend.",
            )
        jobs = FileJobs(self._runner)
        try:
            model = await jobs.run(_fs.open_model_dir, self._store_dir, manifest.model_dir_name)
        except OSError as e:
            raise self._storage_failed(e, manifest) from None
        try:
            present = await jobs.run(_fs.snapshot_present, model, commit)
            digest = await jobs.run(manifest_digest, manifest)
        finally:
            await jobs.quiesce()
            model.close()
        root_path = os.path.join(self._store_dir, manifest.model_dir_name, "snapshots", commit)
        if not present:
            raise CommandFailed(
                SNAPSHOT_MISSING,
                f"Model {label} was synced, but revision {commit} has no snapshot directory "
                f"({root_path}): the manifest lists no snapshot for that commit. Refusing to "
                "report a model directory that does not exist; fix the model's cache on the "
                "backend and sync again.",
                {"revision": commit, "root_path": root_path},
            )
        links = sum(len(snap.links) for snap in manifest.snapshots)
        return {
            **result,
            "synced": True,
            "model_id": manifest.model_id,
            "hf_repo_id": manifest.hf_repo_id,
            "model_dir_name": manifest.model_dir_name,
            "root_path": root_path,
            "cache_root": self._store_dir,
            "revision": commit,
            "requested_revision": revision or None,
            "manifest_sha256": digest,
            "total_size": manifest.total_size,
            "files_synced": links or len(manifest.blobs),
        }

    # -- sharing ---------------------------------------------------------------------------

    def _join(self, manifest: Manifest, progress: ProgressCallback) -> Deferred[dict[str, Any]]:
        key = manifest.model_dir_name
        op = self._ops.get(key)
        if op is not None and op.manifest == manifest and not op.cancelled:
            self.log.info("Model sync of {model_dir} already running; joining it", model_dir=key)
            return op.subscribe(progress)
        previous = op
        op = _Operation(manifest)
        self._ops[key] = op
        # Subscribe before starting, so the first progress report and a result produced
        # without waiting both reach the caller.
        result = op.subscribe(progress)
        op.deferred = Deferred.fromCoroutine(self._run(op, previous))
        op.deferred.addBoth(self._finished, key, op)
        return result

    def _finished(self, outcome: object, key: str, op: _Operation) -> None:
        if self._ops.get(key) is op:
            del self._ops[key]
        if isinstance(outcome, Failure) and not outcome.check(CommandFailed, CancelledError):
            self.log.failure(
                "Model sync of {model_dir} failed unexpectedly", outcome, model_dir=key
            )
        op.settle(outcome if isinstance(outcome, Failure | dict) else {})

    async def _run(self, op: _Operation, previous: _Operation | None) -> dict[str, Any]:
        if previous is not None:
            self.log.info(
                "Model sync of {model_dir} waits for the previous one",
                model_dir=op.manifest.model_dir_name,
            )
            await previous.when_done()
        try:
            return await self._sync_now(op)
        except OSError as e:
            raise self._storage_failed(e, op.manifest) from None

    def _storage_failed(self, e: OSError, manifest: Manifest) -> CommandFailed:
        where = e.filename or self._store_dir
        if not os.path.isabs(str(where)):  # relative to the model directory (the store layer)
            where = os.path.join(self._store_dir, manifest.model_dir_name, str(where))
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return CommandFailed(
                INSUFFICIENT_DISK,
                f"The model store ran out of disk space while syncing "
                f"{manifest.hf_repo_id or manifest.model_id} ({where}).",
                {"path": str(where)},
            )
        return CommandFailed(
            STORAGE_ERROR,
            f"Could not write the model store at {where}: {e.strerror or e}.",
            {"path": str(where)},
        )

    # -- one operation ---------------------------------------------------------------------

    async def _sync_now(self, op: _Operation) -> dict[str, Any]:
        manifest = op.manifest
        jobs = FileJobs(self._runner)
        model = await jobs.run(_fs.open_model_dir, self._store_dir, manifest.model_dir_name)
        try:
            return await self._sync_in(op, model, jobs)
        finally:
            # No thread may still use the directory's descriptors when they are closed.
            await jobs.quiesce()
            model.close()

    async def _sync_in(
        self, op: _Operation, model: _fs.ModelDir, jobs: FileJobs
    ) -> dict[str, Any]:
        manifest = op.manifest
        started = self._reactor.seconds()
        label = manifest.hf_repo_id or manifest.model_id
        progress = _Progress(self._reactor, op.emit, label, self._progress_interval)
        progress.report(f"Checking {label} in the model store", force=True)
        model_dir = model.path
        record = await jobs.run(_fs.load_record, model)
        survey = await jobs.run(
            _fs.survey_blobs, model, manifest.blobs, record, 2 * self._segment_size
        )
        run = _Run(manifest, model, progress, dict(record), jobs=jobs)

        to_verify: list[BlobSpec] = []
        to_fetch: list[_fs.BlobSurvey] = []
        for item in survey:
            if item.state == "reuse":
                run.reused_count += 1
                run.reused_bytes += item.blob.size
            elif item.state == "verify":
                to_verify.append(item.blob)
            else:
                run.forget(item.blob)
                to_fetch.append(item)

        needed = sum(max(0, item.blob.size - item.part_allocated) for item in to_fetch)
        if needed > 0:
            if self._free_space is not None:
                free = await jobs.run(self._free_space, model_dir)
            else:
                free = await jobs.run(_fs.free_bytes, model)
            if needed > free:
                raise CommandFailed(
                    INSUFFICIENT_DISK,
                    f"Not enough disk space for {label}: {_size(needed)} still to download, "
                    f"{_size(free)} free in {model_dir}.",
                    {"needed_bytes": needed, "free_bytes": free, "path": model_dir},
                )

        progress.total = sum(item.blob.size for item in to_fetch)
        progress.done = sum(item.part_done for item in to_fetch)
        progress.files_total = len(to_fetch)
        if to_verify:
            progress.report(f"Verifying {len(to_verify)} cached files of {label}", force=True)

        work: list[Callable[[], Awaitable[None]]] = [
            functools.partial(self._verify_or_fetch, run, blob) for blob in to_verify
        ]
        work += [
            functools.partial(self._fetch, run, item.blob)
            for item in sorted(to_fetch, key=lambda item: -item.blob.size)
        ]
        try:
            await self._run_jobs(work)
        finally:
            if run.record_changed:
                try:
                    await jobs.run(_fs.save_record, model, dict(run.record))
                except Exception:
                    self.log.failure(
                        "Could not save the verification record of {model_dir}",
                        model_dir=model_dir,
                    )

        snapshots_changed = 0
        for snap in manifest.snapshots:
            outcome = await jobs.run(_fs.install_snapshot, model, snap.commit, snap.links)
            snapshots_changed += outcome != "kept"
        refs_changed = 0
        for ref in manifest.refs:
            refs_changed += bool(await jobs.run(_fs.write_ref, model, ref.name, ref.commit))

        duration = self._reactor.seconds() - started
        result = self._result(run, duration, snapshots_changed, refs_changed)
        progress.report(
            f"Model {label} ready: {run.fetched_count} files downloaded "
            f"({_size(run.fetched_bytes)}), {run.reused_count} reused, "
            f"{run.verified_count} verified",
            force=True,
            pct=100.0,
        )
        self.log.info(
            "Model sync of {model_dir} done in {duration:.1f}s: {fetched} fetched "
            "({fetched_bytes} bytes), {reused} reused, {verified} verified, {retries} retries",
            model_dir=manifest.model_dir_name,
            duration=duration,
            fetched=run.fetched_count,
            fetched_bytes=run.fetched_bytes,
            reused=run.reused_count,
            verified=run.verified_count,
            retries=run.retries,
        )
        return result

    def _result(
        self, run: _Run, duration: float, snapshots_changed: int, refs_changed: int
    ) -> dict[str, Any]:
        m = run.manifest
        return {
            "model_id": m.model_id,
            "hf_repo_id": m.hf_repo_id,
            "model_dir_name": m.model_dir_name,
            "path": run.model_dir,
            "commits": [s.commit for s in m.snapshots],
            "refs": {r.name: r.commit for r in m.refs},
            "blobs_total": len(m.blobs),
            "bytes_total": m.total_size,
            "fetched": {"count": run.fetched_count, "bytes": run.fetched_bytes},
            "reused": {"count": run.reused_count, "bytes": run.reused_bytes},
            "verified": {"count": run.verified_count, "bytes": run.verified_bytes},
            "resumed": run.resumed,
            "retries": run.retries,
            "range_ignored": run.range_ignored,
            "range_end_ignored": run.range_end_ignored,
            "connections_used": run.connections_used,
            "removed_foreign": list(run.model.foreign),
            "snapshots_changed": snapshots_changed,
            "refs_changed": refs_changed,
            "duration_s": round(duration, 3),
        }

    async def _run_jobs(self, jobs: list[Callable[[], Awaitable[None]]]) -> None:
        """
        Run C{jobs} on at most C{concurrency} workers. The first failure cancels the other
        workers (their clean-up still runs) and is raised once all have stopped.
        """
        queue = deque(jobs)

        async def worker() -> None:
            while queue:
                await queue.popleft()()

        await run_together(worker() for _ in range(min(self._concurrency, len(queue))))

    async def _verify_or_fetch(self, run: _Run, blob: BlobSpec) -> None:
        ok, stamp = await run.jobs.run(_fs.verify_blob, run.model, blob)
        if ok:
            run.remember(blob, stamp)
            run.verified_count += 1
            run.verified_bytes += blob.size
            return
        self.log.warn(
            "Cached blob {blob} of {model_dir} failed verification; fetching it again",
            blob=blob.hash,
            model_dir=run.manifest.model_dir_name,
        )
        run.forget(blob)
        run.progress.total += blob.size
        run.progress.files_total += 1
        await self._fetch(run, blob)

    # -- downloading one blob ----------------------------------------------------------------

    def _url(self, model_id: str, *parts: str) -> str:
        tail = "/".join(quote(p, safe="") for p in parts)
        return f"{self._backend_url}/api/node-files/models/{quote(model_id, safe='')}/{tail}"

    def _count_downloaded(self, n: int) -> None:
        self.bytes_downloaded += n

    def _headers(self) -> dict[bytes | str, bytes | str]:
        try:
            credential = self._credential()
        except Exception:
            raise CommandFailed(INTERNAL_ERROR, "The node credential could not be read.") from None
        if not isinstance(credential, str) or not credential:
            raise CommandFailed(
                CREDENTIAL_REJECTED,
                "This node has no credential yet: enroll it before syncing models.",
            )
        return {"Authorization": "Bearer " + credential}

    def _backoff(self, failures: int) -> float:
        base = min(self._retry_initial_delay * 2 ** (failures - 1), self._retry_max_delay)
        return float(base * (0.5 + self._rng.random() / 2))

    async def _get(self, url: str, headers: dict[bytes | str, bytes | str]) -> Any:
        d = self._http.get(
            url,
            headers=headers,
            unbuffered=True,
            allow_redirects=False,
            reactor=self._reactor,
        )
        timeout = self._request_timeout

        def timed_out(_result: object, _timeout: float) -> Failure:
            return Failure(error.TimeoutError(f"no response within {timeout:g} seconds"))

        d.addTimeout(timeout, self._reactor, onTimeoutCancel=timed_out)
        try:
            return await d
        except error.ConnectingCancelledError:
            # Cancelled from outside (the sync was cancelled) while still connecting; a timeout
            # is a TimeoutError (timed_out), so this is the sync's cancellation, not a failure.
            raise CancelledError() from None
        except _NETWORK_ERRORS as e:
            # A request cancelled from outside (the sync was cancelled) fails with the
            # cancellation wrapped in ResponseNeverReceived: that is no reason to retry.
            if _wraps_cancellation(e):
                raise CancelledError() from None
            raise _Retry(describe_error(e)) from None

    async def _refuse(self, response: Any, what: str) -> None:
        """Turn a non-success status into L{_Retry} (transient) or L{CommandFailed}."""
        code = response.code
        body = await read_small(response).addTimeout(self._request_timeout, self._reactor)
        detail = detail_of(body)
        suffix = f": {detail}" if detail else ""
        if code in (401, 403):
            raise CommandFailed(
                CREDENTIAL_REJECTED,
                f"The backend rejected this node's credential (HTTP {code}{suffix}) while "
                f"fetching {what}. The node needs a new enrollment token.",
            )
        if code in (408, 425, 429) or code >= 500:
            raise _Retry(f"HTTP {code}{suffix}")
        if code == 404:
            raise CommandFailed(DOWNLOAD_FAILED, f"The backend has no {what} (HTTP 404{suffix}).")
        raise CommandFailed(
            DOWNLOAD_FAILED, f"The backend answered HTTP {code} for {what}{suffix}."
        )

    async def _pause(self, failures: int, what: str, reason: str) -> None:
        if failures > self._retry_max:
            raise CommandFailed(
                DOWNLOAD_FAILED,
                f"Could not fetch {what} after {failures} attempts; last error: {reason}.",
            )
        delay = self._backoff(failures)
        self.log.info(
            "Fetching {what} failed ({reason}); retry {attempt} in {delay:.1f}s",
            what=what,
            reason=reason,
            attempt=failures,
            delay=delay,
        )
        await deferLater(self._reactor, delay)

    async def _fetch_manifest(self, model_id: str) -> Manifest:
        url = self._url(model_id, "manifest")
        what = f"the manifest of model {model_id}"
        failures = 0
        while True:
            try:
                response = await self._get(url, self._headers())
                if response.code != 200:
                    await self._refuse(response, what)
                body = await read_limited(response, MAX_MANIFEST_BYTES + 1).addTimeout(
                    self._request_timeout, self._reactor
                )
                break
            except _RETRYABLE as e:
                failures += 1
                await self._pause(
                    failures, what, str(e) if isinstance(e, _Retry) else describe_error(e)
                )
        if len(body) > MAX_MANIFEST_BYTES:
            raise CommandFailed(DOWNLOAD_FAILED, f"The backend sent {what} larger than 64 MiB.")
        # Up to 64 MiB of JSON: decoded and checked on the pool, never on the reactor thread.
        manifest: Manifest = await self._runner.run(_decode_manifest, body, what)
        return manifest

    async def _fetch(self, run: _Run, blob: BlobSpec) -> None:
        """Download one blob into C{blobs/<hash>}, resuming, retrying and verifying."""
        writer = run.jobs.serial()
        hasher = run.jobs.serial()
        part = await writer.run(_fs.open_part, run.model, blob, 2 * self._segment_size)
        if part.resumed_bytes:
            run.resumed += 1
        restarted = False
        transfer: BlobTransfer | None = None
        try:
            while True:
                url = self._url(run.manifest.model_id, "blob", blob.hash)
                transfer = BlobTransfer(self._source, run, blob, url, part, writer, hasher)
                ok = await transfer.run()
                run.connections_used = max(run.connections_used, transfer.connections_used)
                if ok:
                    run.remember(blob, transfer.stamp)
                    run.fetched_count += 1
                    run.fetched_bytes += blob.size
                    run.progress.files_done += 1
                    run.progress.report()
                    return
                run.progress.rewind(blob.size)
                if transfer.spliced and not restarted:
                    # Content joined from several responses (a resume, ranges) may mix two
                    # versions: once more from the start before calling the blob bad.
                    self.log.warn(
                        "Download of {blob} assembled from several responses failed "
                        "verification; starting over",
                        blob=blob.hash,
                    )
                    restarted = True
                    part = await writer.run(
                        _fs.open_fresh_part, run.model, blob, 2 * self._segment_size
                    )
                    continue
                raise CommandFailed(
                    CHECKSUM_MISMATCH,
                    f"Blob {blob.hash} of {run.label} failed verification: expected "
                    f"{blob.size} bytes with that hash, got {transfer.found}. The download "
                    "was discarded.",
                    {"blob": blob.hash},
                )
        finally:
            # Each serial closes its own descriptor after its own jobs (even if this wait is
            # cancelled, the jobs still run in order); what finishing closed needs no job.
            if part.read_fd is not None:
                hasher.run(_fs.close_reader, part).addErrback(lambda _: None)
            if part.fd is not None:
                ranges = transfer.done.items() if transfer is not None else list(part.done)
                await writer.run(_fs.close_part, part, ranges)
