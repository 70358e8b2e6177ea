"""
Tests for air-gapped model delivery (L{llmport_agent.models}) and the stand-in backend's
model files (L{llmport_agent.devbackend.modelfiles}).

Unit tests are synchronous (C{Clock}, C{StubTreq}, a synchronous runner). The integration
tests serve L{model_files_resource} from a real twisted.web C{Site} on 127.0.0.1 and sync
through a real treq client and a real thread pool.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
from collections.abc import Callable
from typing import Any, cast

from treq.client import HTTPClient
from treq.testing import StubTreq
from twisted.internet import reactor as _global_reactor
from twisted.internet.defer import (
    CancelledError,
    Deferred,
    DeferredList,
    ensureDeferred,
    fail,
    gatherResults,
    succeed,
)
from twisted.internet.error import ConnectionAborted, ConnectionDone
from twisted.internet.task import Clock, LoopingCall
from twisted.internet.testing import StringTransport
from twisted.protocols.policies import WrappingFactory
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import Agent, HTTPConnectionPool, ResponseFailed
from twisted.web.iweb import IRequest
from twisted.web.resource import Resource
from twisted.web.server import Site

from llmport_agent.commands.base import CommandFailed, HandlerSpec
from llmport_agent.core.threads import PoolService
from llmport_agent.devbackend.modelfiles import (
    ModelRepository,
    ServedRequest,
    model_files_resource,
)
from llmport_agent.models import ModelSyncer, _fs, parse_manifest, sync_model_handler_spec
from llmport_agent.models._http import (
    BlobBodyReceiver,
    BodyTooLong,
    FlowBudget,
    TransferInterrupted,
    parse_content_range,
)
from llmport_agent.models.manifest import link_target
from llmport_agent.models.transfer import Ranges

reactor: Any = _global_reactor

SECRET = "0c7e7c1e-3a6b-4a57-9d43-1b1f5bd5e3c1.s3cr3t-n0de-credential-value-xxxxxxxxxxxxxx"
MODEL_ID = "5b1f0f5e-8d4c-4e35-9a0e-3e3f7c2b9b11"
REPO_ID = "acme/tiny-llm"
DIR_NAME = "models--acme--tiny-llm"


def _authorize(request: IRequest) -> bool:
    return request.getHeader(b"authorization") == b"Bearer " + SECRET.encode()


def _backend_root(repo: ModelRepository, base: tuple[bytes, ...] = ()) -> Resource:
    root = Resource()
    node = root
    for segment in (*base, b"api", b"node-files"):
        child = Resource()
        node.putChild(segment, child)
        node = child
    node.putChild(b"models", cast(Resource, model_files_resource(repo, _authorize)))
    return root


def _files(big_mb: int = 3, seed: int = 7) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {
        "config.json": json.dumps({"model_type": "llama", "hidden_size": 64}).encode(),
        "tokenizer.json": rng.randbytes(50_000),
        "model.safetensors": rng.randbytes(big_mb * 1024 * 1024),
        "nested/deeper/generation_config.json": b'{"temperature": 0.7}',
        "copy-of-config.json": json.dumps({"model_type": "llama", "hidden_size": 64}).encode(),
    }


class SyncRunner:
    """A BlockingRunner that runs calls at once, on the calling thread (unit tests only)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Deferred[Any]:
        self.calls.append(getattr(fn, "__name__", repr(fn)))
        try:
            return succeed(fn(*args, **kwargs))
        except BaseException:
            return fail()


class RecordingRunner:
    """Wraps a real runner; records which functions ran and on which thread."""

    def __init__(self, inner: PoolService) -> None:
        self._inner = inner
        self.calls: list[tuple[str, bool]] = []
        self._main = threading.get_ident()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Deferred[Any]:
        name = getattr(fn, "__name__", repr(fn))

        def traced(*a: Any, **kw: Any) -> Any:
            self.calls.append((name, threading.get_ident() == self._main))
            return fn(*a, **kw)

        return self._inner.run(traced, *args, **kwargs)

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]


def _progress_sink(into: list[tuple[str, str, dict[str, Any]]]) -> Callable[..., None]:
    def progress(phase: str, message: str, **extra: Any) -> None:
        into.append((phase, message, extra))

    return progress


# --- manifest validation --------------------------------------------------------------------


def _good_manifest() -> dict[str, Any]:
    repo = ModelRepository()
    return repo.add_model(MODEL_ID, REPO_ID, {"config.json": b"{}", "a/b/w.bin": b"x" * 10})


def _idle_host() -> Any:
    """CPU counters of a host with both CPUs idle (this process busy with nothing)."""
    from llmport_agent.models.transfer import CpuSample

    return CpuSample(0.0, 2 * reactor.seconds(), 2)


def _busy_host() -> Any:
    """CPU counters of a 2-CPU host where this process keeps 1.5 CPUs busy, none idle."""
    from llmport_agent.models.transfer import CpuSample

    return CpuSample(1.5 * reactor.seconds(), 0.0, 2)


class ManifestValidationTests(SynchronousTestCase):
    """Every name and path of a manifest is checked before anything touches the disk."""

    def assertInvalid(self, manifest: object, field: str) -> None:
        with self.assertRaises(CommandFailed) as cm:
            parse_manifest(manifest)
        self.assertEqual(cm.exception.error_code, "invalid_command")
        self.assertIn(field, cm.exception.error_message)

    def test_good_manifest(self) -> None:
        """A manifest from the stand-in backend parses, with sha256 names recognised."""
        m = parse_manifest(_good_manifest())
        self.assertEqual(m.model_dir_name, DIR_NAME)
        self.assertEqual(len(m.blobs), 2)
        self.assertTrue(all(b.sha256 == b.hash for b in m.blobs))
        self.assertEqual(m.refs[0].name, "main")

    def test_link_targets(self) -> None:
        """Symlink targets climb one level per directory of the path."""
        self.assertEqual(link_target("config.json", "h"), "../../blobs/h")
        self.assertEqual(link_target("a/b/c.json", "h"), "../../../../blobs/h")

    def test_traversal_everywhere(self) -> None:
        """Path traversal in each field is refused, naming that field."""
        cases: list[tuple[Callable[[dict[str, Any]], None], str]] = [
            (lambda m: m.update(model_dir_name="../etc"), "model_sync.model_dir_name"),
            (lambda m: m.update(model_dir_name="models--a/../../x"), "model_sync.model_dir_name"),
            (lambda m: m.update(model_dir_name="/abs"), "model_sync.model_dir_name"),
            (lambda m: m.update(model_dir_name="datasets--a--b"), "model_sync.model_dir_name"),
            (lambda m: m.update(model_dir_name=".."), "model_sync.model_dir_name"),
            (lambda m: m["blobs"][0].update(hash="../../x"), "model_sync.blobs[0].hash"),
            (lambda m: m["blobs"][0].update(hash="abc.part"), "model_sync.blobs[0].hash"),
            (lambda m: m["blobs"][0].update(hash=".."), "model_sync.blobs[0].hash"),
            (lambda m: m["blobs"][0].update(size=-1), "model_sync.blobs[0].size"),
            (lambda m: m["blobs"][0].update(size=True), "model_sync.blobs[0].size"),
            (lambda m: m["refs"][0].update(name="../../../etc/passwd"), "model_sync.refs[0].name"),
            (lambda m: m["refs"][0].update(name="/main"), "model_sync.refs[0].name"),
            (lambda m: m["refs"][0].update(name="a//b"), "model_sync.refs[0].name"),
            (lambda m: m["refs"][0].update(commit="../x"), "model_sync.refs[0].commit"),
            (
                lambda m: m["snapshots"][0].update(commit="../../x"),
                "model_sync.snapshots[0].commit",
            ),
            (
                lambda m: m["snapshots"][0]["links"][0].update(path="../../../escape"),
                "model_sync.snapshots[0].links[0].path",
            ),
            (
                lambda m: m["snapshots"][0]["links"][0].update(path="/etc/passwd"),
                "model_sync.snapshots[0].links[0].path",
            ),
            (
                lambda m: m["snapshots"][0]["links"][0].update(path="a//b"),
                "model_sync.snapshots[0].links[0].path",
            ),
            (
                lambda m: m["snapshots"][0]["links"][0].update(path="a/./b"),
                "model_sync.snapshots[0].links[0].path",
            ),
            (
                lambda m: m["snapshots"][0]["links"][0].update(path="a\\..\\b"),
                "model_sync.snapshots[0].links[0].path",
            ),
            (
                lambda m: m["snapshots"][0]["links"][0].update(path="a\x00b"),
                "model_sync.snapshots[0].links[0].path",
            ),
            (
                lambda m: m["snapshots"][0]["links"][0].update(blob_hash="0" * 64),
                "model_sync.snapshots[0].links[0].blob_hash",
            ),
            (
                lambda m: m["snapshots"][0]["links"][0].update(blob_hash="../../../x"),
                "model_sync.snapshots[0].links[0].blob_hash",
            ),
        ]
        for mutate, field in cases:
            manifest = _good_manifest()
            mutate(manifest)
            self.assertInvalid(manifest, field)

    def test_shapes(self) -> None:
        """Wrong types and file/directory conflicts get a clear message naming the field."""
        m = _good_manifest()
        m["blobs"] = "nope"
        self.assertInvalid(m, "model_sync.blobs")
        m = _good_manifest()
        m["snapshots"][0]["links"].append(
            {"path": "config.json/x", "blob_hash": m["blobs"][0]["hash"]}
        )
        self.assertInvalid(m, "model_sync.snapshots[0].links[2].path")
        m = _good_manifest()
        m["snapshots"][0]["links"].append(dict(m["snapshots"][0]["links"][0]))
        self.assertInvalid(m, "model_sync.snapshots[0].links[2].path")
        self.assertInvalid([], "model_sync")


class ContentRangeTests(SynchronousTestCase):
    """C{Content-Range} parsing."""

    def test_parse(self) -> None:
        """Well-formed values parse; malformed or inconsistent ones do not."""
        cr = parse_content_range("bytes 10-99/100")
        assert cr is not None
        self.assertEqual((cr.start, cr.end, cr.total), (10, 99, 100))
        star = parse_content_range(b"bytes 0-4/*")
        assert star is not None
        self.assertIsNone(star.total)
        for bad in (None, "bytes */100", "bytes 5-4/100", "bytes 0-100/100", "items 0-1/2", "x"):
            self.assertIsNone(parse_content_range(bad), bad)


# --- the body receiver ----------------------------------------------------------------------


class _FakeSink:
    """A sink that records batches; the test says when they are written and hashed."""

    def __init__(self, budget: FlowBudget, frontier: bool = True) -> None:
        self.budget = budget
        self.batches: list[tuple[BlobBodyReceiver, int, list[bytes], int]] = []
        self.frontier = frontier

    def accept(self, receiver: BlobBodyReceiver, offset: int, chunks: list[bytes], n: int) -> None:
        self.batches.append((receiver, offset, chunks, n))

    def at_frontier(self, offset: int) -> bool:
        return self.frontier

    def complete(self, i: int = 0) -> bytes:
        receiver, _offset, chunks, n = self.batches.pop(i)
        receiver.written(n)
        self.budget.give(n)
        receiver.released(n)
        return b"".join(chunks)


class BodyReceiverTests(SynchronousTestCase):
    """Batching, back-pressure and the end of a body."""

    def receiver(self, sink: _FakeSink, length: int, **kw: Any) -> tuple[BlobBodyReceiver, StringTransport, Clock]:
        clock = Clock()
        recv = BlobBodyReceiver(clock, sink, sink.budget, 100, length, **kw)
        transport = StringTransport()
        recv.makeConnection(transport)
        return recv, transport, clock

    def test_pause_until_disk_catches_up(self) -> None:
        """
        Bytes go to the sink in batches (the buffers themselves, in order, at their
        offsets); past the high-water mark the transport is paused, and it resumes when
        the sink has written and hashed enough.
        """
        sink = _FakeSink(FlowBudget(10**9))
        recv, transport, clock = self.receiver(sink, 10**6, batch_size=4, high_water=16)
        a, b = b"a" * 8, b"b" * 10
        recv.dataReceived(a)
        self.assertEqual([(o, c) for _, o, c, _ in sink.batches], [(100, [a])])
        self.assertIs(sink.batches[0][2][0], a)  # no copy
        recv.dataReceived(b)
        self.assertEqual(transport.producerState, "paused")
        self.assertEqual(sink.batches[1][1], 108)
        self.assertEqual(sink.complete(), a)
        self.assertEqual(transport.producerState, "producing")
        self.assertEqual(recv.next_offset, 118)
        recv.connectionLost(Failure(ResponseFailed([Failure(ConnectionDone())])))
        self.assertNoResult(recv.done)
        self.assertEqual(sink.complete(), b)
        self.assertEqual(sink.budget.used, 0)
        # a body that ends before the wanted length is a resumable interruption
        self.failureResultOf(recv.done, TransferInterrupted)
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_complete_and_overrun(self) -> None:
        """
        The body is done as soon as the wanted bytes are written; a server that sends more
        (it ignored the end of a bounded range) is cut off and the receiver says so.
        """
        sink = _FakeSink(FlowBudget(10**9))
        recv, transport, _ = self.receiver(sink, 10, at_eof=False, batch_size=4)
        recv.dataReceived(b"x" * 6)
        recv.dataReceived(b"y" * 9)
        self.assertEqual(transport.producerState, "stopped")
        self.assertTrue(recv.overrun)
        self.assertEqual(b"".join(sink.complete() for _ in range(2)), b"x" * 6 + b"y" * 4)
        self.assertEqual(self.successResultOf(recv.done), 10)

    def test_shortened_stream(self) -> None:
        """
        An open-ended stream cut where ranged requests take over: complete at the new end
        (even where a read ends exactly there) and its connection dropped, since the
        response goes on; never shorter than what arrived.
        """
        sink = _FakeSink(FlowBudget(10**9))
        recv, transport, _ = self.receiver(sink, 1000, batch_size=4)
        recv.dataReceived(b"x" * 6)
        self.assertEqual(recv.received, 6)
        self.assertFalse(recv.shorten(5))  # already arrived
        self.assertFalse(recv.shorten(1000))  # not shorter
        self.assertTrue(recv.shorten(10))
        recv.dataReceived(b"y" * 4)  # exactly up to the cut
        self.assertEqual(transport.producerState, "stopped")
        self.assertEqual(b"".join(sink.complete() for _ in range(2)), b"x" * 6 + b"y" * 4)
        self.assertEqual(self.successResultOf(recv.done), 10)
        self.assertFalse(recv.shorten(8))  # complete

    def test_too_long_at_the_end_of_the_blob(self) -> None:
        """More bytes than the blob can have are refused (not silently dropped)."""
        sink = _FakeSink(FlowBudget(10**9))
        recv, transport, _ = self.receiver(sink, 10, at_eof=True, batch_size=4)
        recv.dataReceived(b"x" * 11)
        recv.connectionLost(Failure(ConnectionDone()))
        self.failureResultOf(recv.done, BodyTooLong)
        self.assertEqual(sink.budget.used, 0)

    def test_budget_pauses_bodies_ahead_of_the_hash(self) -> None:
        """
        With the shared budget spent, a body ahead of the hash's frontier pauses at once; a
        body at the frontier may hold one batch, then pauses too until memory is freed.
        """
        budget = FlowBudget(8)
        ahead = _FakeSink(budget, frontier=False)
        recv_ahead, t_ahead, _ = self.receiver(ahead, 100, batch_size=4, high_water=1000)
        recv_ahead.dataReceived(b"a" * 8)  # fills the budget
        self.assertEqual(t_ahead.producerState, "paused")
        front = _FakeSink(budget, frontier=True)
        recv_front, t_front, _ = self.receiver(front, 100, batch_size=4, high_water=1000)
        recv_front.dataReceived(b"f" * 2)
        self.assertEqual(t_front.producerState, "producing")
        recv_front.dataReceived(b"f" * 2)  # one batch held: now it waits as well
        self.assertEqual(t_front.producerState, "paused")
        front.complete()
        self.assertEqual(t_front.producerState, "producing")
        self.assertEqual(t_ahead.producerState, "paused")
        ahead.complete()
        self.assertEqual(t_ahead.producerState, "producing")

    def test_stall_is_interrupted(self) -> None:
        """A body that stops flowing is aborted after the idle timeout (resumable error)."""
        sink = _FakeSink(FlowBudget(10**9))
        recv, transport, clock = self.receiver(sink, 100, idle_timeout=10, batch_size=4)
        recv.dataReceived(b"x" * 5)
        clock.advance(5)
        recv.dataReceived(b"x" * 5)
        clock.advance(9)
        self.assertNoResult(recv.done)
        clock.advance(2)
        self.assertEqual(transport.producerState, "stopped")
        recv.connectionLost(Failure(ConnectionAborted()))
        while sink.batches:
            sink.complete()
        f = self.failureResultOf(recv.done)
        self.assertIn("no data for 10 seconds", str(f.value))
        self.assertEqual(recv.next_offset, 110)  # a resume continues after what arrived
        self.assertEqual(clock.getDelayedCalls(), [])


class WritebackTests(SynchronousTestCase):
    """L{_fs.start_writeback}: a hint that never fails a write."""

    def test_refused_once_not_asked_again(self) -> None:
        """A file system that refuses C{sync_file_range} (EINVAL) is not asked again."""
        import ctypes
        import errno

        calls: list[tuple[int, int, int, int]] = []

        def refusing(fd: int, offset: int, length: int, flags: int) -> int:
            calls.append((fd, offset, length, flags))
            ctypes.set_errno(errno.EINVAL)
            return -1

        self.patch(_fs, "_sync_file_range", refusing)
        _fs.start_writeback(5, 0, 100)
        _fs.start_writeback(5, 100, 100)
        self.assertEqual(calls, [(5, 0, 100, 2)])
        self.assertIs(_fs._sync_file_range, False)

    def test_other_errors_keep_it(self) -> None:
        """A transient error (EIO: the fsync at the end reports it) leaves the hint on."""
        import ctypes
        import errno

        calls: list[int] = []

        def failing(fd: int, offset: int, length: int, flags: int) -> int:
            calls.append(offset)
            ctypes.set_errno(errno.EIO)
            return -1

        self.patch(_fs, "_sync_file_range", failing)
        _fs.start_writeback(5, 0, 100)
        _fs.start_writeback(5, 100, 100)
        self.assertEqual(calls, [0, 100])

    def test_real_call_on_a_file(self) -> None:
        """The real libc call on a regular file: the bytes stay as written."""
        path = self.mktemp()
        with open(path, "wb") as f:
            f.write(b"x" * 8192)
            f.flush()
            _fs.start_writeback(f.fileno(), 0, 8192)
            _fs.start_writeback(f.fileno(), 0, 0)
        with open(path, "rb") as f:
            self.assertEqual(f.read(), b"x" * 8192)


class WriteBatchTests(SynchronousTestCase):
    """L{_fs.write_batch}: small write calls (no large page-cache folios), every byte in place."""

    def test_calls_of_at_most_write_size(self) -> None:
        """
        A batch of 1 MiB buffers is written in C{pwritev} calls of at most WRITE_SIZE bytes
        (short writes continued where they stopped), and its writeback started once, whole.
        """
        path = self.mktemp()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.addCleanup(os.close, fd)
        part = _fs.PartFile(cast(Any, None), cast(Any, None), fd, False, [])
        chunks = [os.urandom(1024 * 1024), os.urandom(1000), os.urandom(700_000)]
        calls: list[int] = []
        real = os.pwritev
        short = [True]

        def recording(fd_: int, iov: Any, pos: int) -> int:
            size = sum(len(b) for b in iov)
            calls.append(size)
            if short[0] and size > 10:  # one short write: the rest must follow
                short[0] = False
                return real(fd_, [memoryview(b"".join(bytes(b) for b in iov))[: size // 3]], pos)
            return real(fd_, iov, pos)

        started: list[tuple[int, int]] = []
        self.patch(os, "pwritev", recording)
        self.patch(_fs, "_sync_file_range",
                   lambda fd_, off, n, flags: started.append((off, n)) or 0)
        total = _fs.write_batch(part, 4096, chunks)
        data = b"".join(chunks)
        self.assertEqual(total, len(data))
        # 1 MiB and 2 MiB writes cost 5-9x the CPU of 512 KiB ones here (BENCHMARKS.md).
        self.assertLessEqual(max(calls), 512 * 1024)
        self.assertEqual(started, [(4096, len(data))])
        with open(path, "rb") as f:
            f.seek(4096)
            self.assertEqual(f.read(), data)


class DropBehindTests(SynchronousTestCase):
    """
    L{_fs.drop_behind}: a part file's written bytes leave the page cache once they are more
    than C{DROP_BEHIND} behind its latest write, after their writeback is done.
    """

    def _part(self) -> Any:
        path = self.mktemp()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.addCleanup(os.close, fd)
        return _fs.PartFile(cast(Any, None), cast(Any, None), fd, False, [])

    def _record(self, result: int = 0, err: int = 0) -> list[tuple[str, int, int, int]]:
        import ctypes

        calls: list[tuple[str, int, int, int]] = []

        def sfr(fd: int, offset: int, length: int, flags: int) -> int:
            calls.append(("sync", offset, length, flags))
            if result:
                ctypes.set_errno(err)
            return result

        def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
            calls.append(("drop", offset, length, advice))

        self.patch(_fs, "_sync_file_range", sfr)
        self.patch(os, "posix_fadvise", fadvise)
        self.patch(_fs, "DROP_BEHIND", 1000)
        return calls

    def test_oldest_settled_then_dropped(self) -> None:
        """
        Beyond the lag, the oldest ranges (in write order, wherever they are in the file)
        are waited for and then dropped; the latest C{DROP_BEHIND} bytes stay.
        """
        calls = self._record()
        part = self._part()
        wait = 1 | 2 | 4
        for offset in (4000, 0, 400):
            _fs.write_batch(part, offset, [b"x" * 400])
        self.assertEqual(calls[-2:], [("sync", 4000, 400, wait),
                                      ("drop", 4000, 400, os.POSIX_FADV_DONTNEED)])
        del calls[:]
        _fs.write_batch(part, 800, [b"y" * 700])
        self.assertEqual(
            [c for c in calls if c[3] != 2],  # the writeback starts (flag 2) aside
            [("sync", 0, 400, wait), ("drop", 0, 400, os.POSIX_FADV_DONTNEED),
             ("sync", 400, 400, wait), ("drop", 400, 400, os.POSIX_FADV_DONTNEED)],
        )
        self.assertEqual((list(part.behind), part.behind_bytes), ([(800, 700)], 700))

    def test_write_error_fails_the_write(self) -> None:
        """
        A failed writeback (EIO) fails the batch: the waiting call consumed the error, so
        the fsync at the end would not report it.
        """
        import errno

        self._record(-1, errno.EIO)
        part = self._part()
        _fs.write_batch(part, 0, [b"x" * 800])
        e = self.assertRaises(OSError, _fs.write_batch, part, 800, [b"x" * 800])
        self.assertEqual(e.errno, errno.EIO)

    def test_unsupported_still_drops(self) -> None:
        """Where the file system refuses C{sync_file_range}, the pages are still dropped."""
        import errno

        calls = self._record(-1, errno.EINVAL)
        part = self._part()
        _fs.write_batch(part, 0, [b"x" * 800])
        _fs.write_batch(part, 800, [b"x" * 800])
        self.assertIs(_fs._sync_file_range, False)
        self.assertIn(("drop", 0, 800, os.POSIX_FADV_DONTNEED), calls)
        with open(os.readlink(f"/proc/self/fd/{part.fd}"), "rb") as f:
            self.assertEqual(f.read(), b"x" * 1600)


class RangesTests(SynchronousTestCase):
    """The byte-range set behind resume and segment hand-out."""

    def test_add_merge_pop(self) -> None:
        """Ranges merge when they touch or overlap; pop_first hands out bounded pieces."""
        r = Ranges()
        for a, b in [(10, 20), (30, 40), (20, 25), (0, 5), (24, 31), (50, 50)]:
            r.add(a, b)
        self.assertEqual(r.items(), [(0, 5), (10, 40)])
        self.assertEqual(r.total, 35)
        self.assertEqual(r.starting_at(10), (10, 40))
        self.assertIsNone(r.starting_at(11))
        self.assertEqual(r.pop_first(3), (0, 3))
        self.assertEqual(r.pop_first(None), (3, 5))
        self.assertEqual(r.pop_first(100), (10, 40))
        self.assertIsNone(r.pop_first(1))
        self.assertFalse(r)

    def test_progress_record_is_validated(self) -> None:
        """Progress records are merged and bounded; nonsense is refused."""
        self.assertEqual(_fs.normalise_ranges([[5, 9], [0, 5], [20, 30]], 30), [(0, 9), (20, 30)])
        for bad in ([[0, 31]], [[-1, 3]], [[4, 4]]):
            self.assertRaises(ValueError, _fs.normalise_ranges, bad, 30)


# --- the stand-in backend's model files ------------------------------------------------------


class ModelFilesResourceTests(SynchronousTestCase):
    """The stand-in backend serves manifests and blobs the way protocol 4.3 says."""

    def setUp(self) -> None:
        self.repo = ModelRepository()
        self.manifest = self.repo.add_model(MODEL_ID, REPO_ID, {"w.bin": bytes(range(256)) * 40})
        self.blob = self.manifest["blobs"][0]["hash"]
        self.stub: Any = StubTreq(_backend_root(self.repo))
        self.base = f"http://b.invalid/api/node-files/models/{MODEL_ID}"

    def get(self, path: str, **headers: str) -> tuple[int, dict[str, list[str]], bytes]:
        hdrs = {"Authorization": "Bearer " + SECRET, **headers}
        d = self.stub.get(self.base + path, headers=hdrs)
        self.stub.flush()
        response = self.successResultOf(d)
        body = self.stub.content(response)
        self.stub.flush()
        raw = {
            k.decode().lower(): [v.decode() for v in vs]
            for k, vs in response.headers.getAllRawHeaders()
        }
        raw["length"] = [str(response.length)]
        return response.code, raw, self.successResultOf(body)

    def test_manifest_and_blob(self) -> None:
        """The manifest round-trips; a blob is served whole with its length."""
        code, _, body = self.get("/manifest")
        self.assertEqual((code, json.loads(body)), (200, self.manifest))
        self.assertEqual(self.manifest["model_dir_name"], DIR_NAME)
        code, headers, body = self.get(f"/blob/{self.blob}")
        self.assertEqual(code, 200)
        self.assertEqual(hashlib.sha256(body).hexdigest(), self.blob)
        self.assertEqual(headers["length"], [str(len(body))])
        self.assertEqual(headers["accept-ranges"], ["bytes"])

    def test_ranges(self) -> None:
        """bytes=N- gives 206 with Content-Range; suffix and unsatisfiable ranges give 416."""
        code, headers, body = self.get(f"/blob/{self.blob}", Range="bytes=10000-")
        self.assertEqual(code, 206)
        self.assertEqual(headers["content-range"], ["bytes 10000-10239/10240"])
        self.assertEqual(body, (bytes(range(256)) * 40)[10000:])
        code, headers, _ = self.get(f"/blob/{self.blob}", Range="bytes=-100")
        self.assertEqual((code, headers["content-range"]), (416, ["bytes */10240"]))
        code, _, _ = self.get(f"/blob/{self.blob}", Range="bytes=99999-")
        self.assertEqual(code, 416)

    def test_bounded_ranges(self) -> None:
        """
        bytes=s-e is served as typical servers do (206, exactly those bytes; an end past
        the blob clamped); the ignore_range_end fault answers as if the end were absent.
        """
        data = bytes(range(256)) * 40
        code, headers, body = self.get(f"/blob/{self.blob}", Range="bytes=10-19")
        self.assertEqual((code, headers["content-range"], body), (206, ["bytes 10-19/10240"], data[10:20]))
        self.assertEqual(headers["length"], ["10"])
        code, headers, body = self.get(f"/blob/{self.blob}", Range="bytes=10000-99999")
        self.assertEqual((code, headers["content-range"], body), (206, ["bytes 10000-10239/10240"], data[10000:]))
        self.repo.faults.ignore_range_end = True
        code, headers, body = self.get(f"/blob/{self.blob}", Range="bytes=10-19")
        self.assertEqual((code, headers["content-range"], body), (206, ["bytes 10-10239/10240"], data[10:]))

    def test_refusals(self) -> None:
        """No credential is 401 (before anything else); unknown blobs and models are 404."""
        d = self.stub.get(self.base + "/manifest")
        self.stub.flush()
        self.assertEqual(self.successResultOf(d).code, 401)
        self.assertEqual(self.get("/blob/" + "0" * 64)[0], 404)
        self.assertEqual(self.get("/../other/manifest")[0], 404)
        self.assertEqual([r.status for r in self.repo.requests], [401, 404, 404])


# --- deterministic syncs through StubTreq -----------------------------------------------------


class _StubSync:
    """Retries, backoff, progress pacing and refusals, driven by a Clock."""

    connections = 1
    segment = 32 * 1024 * 1024

    def setUp(self) -> None:
        self.clock = Clock()
        self.repo = ModelRepository()
        self.manifest = self.repo.add_model(MODEL_ID, REPO_ID, _files(big_mb=1))
        self.stub = StubTreq(_backend_root(self.repo))
        self.store = self.mktemp()
        self.runner = SyncRunner()
        self.free = 10**12

    def syncer(self, credential: str = SECRET, **kw: Any) -> ModelSyncer:
        return ModelSyncer(
            self.clock,
            cast(HTTPClient, self.stub),
            self.runner,
            store_dir=self.store,
            backend_url="http://backend.invalid:8000/",
            credential=lambda: credential,
            free_space=lambda path: self.free,
            rng=random.Random(1),
            connections=self.connections,
            segment_size=self.segment,
            **kw,
        )

    def drive(self, d: Deferred[Any], rounds: int = 40, step: float = 1.0) -> None:
        for _ in range(rounds):
            self.stub.flush()
            if d.called:
                return
            self.clock.advance(step)

    def test_5xx_is_retried_with_backoff(self) -> None:
        """Two 503s, then success: the sync backs off on the clock and completes."""
        self.repo.faults.fail_5xx_times = 2
        events: list[tuple[str, str, dict[str, Any]]] = []
        d = Deferred.fromCoroutine(self.syncer().sync(self.manifest, _progress_sink(events)))
        self.stub.flush()
        self.assertNoResult(d)
        self.drive(d, step=30)
        result = self.successResultOf(d)
        self.assertEqual(result["retries"], 2)
        self.assertEqual(result["fetched"]["count"], len(self.manifest["blobs"]))
        statuses = [r.status for r in self.repo.requests]
        self.assertEqual(statuses.count(503), 2)
        self.assertTrue(all(e[0] == "sync_model" for e in events))
        self.assertEqual(events[-1][2]["progress_pct"], 100.0)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_cancelled_while_connecting_is_a_cancellation(self) -> None:
        """
        A sync cancelled while its requests are still connecting fails with CancelledError,
        not with the ConnectingCancelledError of a connection attempt (seen in a full run: a
        cancelled sync reported the connection error instead of its cancellation).
        """
        from twisted.internet.address import IPv4Address
        from twisted.internet.error import ConnectingCancelledError

        class Connecting:
            """A client whose every request is still connecting, as a cancel finds it."""

            def get(self, url: str, **kw: Any) -> Deferred[Any]:
                return Deferred(lambda d: d.errback(ConnectingCancelledError(IPv4Address("TCP", "127.0.0.1", 9))))

        syncer = ModelSyncer(
            self.clock, cast(HTTPClient, Connecting()), self.runner, store_dir=self.store,
            backend_url="http://backend.invalid:8000/", credential=lambda: SECRET,
            free_space=lambda path: self.free, rng=random.Random(1),
        )
        d = Deferred.fromCoroutine(syncer.sync(self.manifest, lambda *a, **k: None))
        self.assertNoResult(d)
        d.cancel()
        self.failureResultOf(d, CancelledError)

    def test_gives_up_after_retry_max(self) -> None:
        """A backend that keeps failing ends in download_failed after retry_max retries."""
        self.repo.faults.fail_5xx_times = 1000
        d = Deferred.fromCoroutine(
            self.syncer(retry_max=3, concurrency=1).sync(self.manifest, lambda *a, **k: None)
        )
        self.drive(d, rounds=200, step=120)
        f = self.failureResultOf(d, CommandFailed)
        self.assertEqual(f.value.error_code, "download_failed")
        self.assertIn("after 4 attempts", f.value.error_message)
        self.assertIn("HTTP 503", f.value.error_message)

    def test_401_stops_at_once(self) -> None:
        """A rejected credential fails the sync with a clear message, no retry, no secret."""
        d = Deferred.fromCoroutine(
            self.syncer(credential="wrong-secret-value").sync(self.manifest, lambda *a, **k: None)
        )
        self.drive(d)
        f = self.failureResultOf(d, CommandFailed)
        self.assertEqual(f.value.error_code, "credential_rejected")
        self.assertIn("HTTP 401", f.value.error_message)
        self.assertNotIn("wrong-secret-value", f.value.error_message)
        self.assertNotIn("wrong-secret-value", repr(f.value.result))
        # one per connection, none retried
        self.assertLessEqual(len(self.repo.requests), 4 + self.connections - 1)

    def test_progress_is_paced(self) -> None:
        """Progress reports come at most about once per second of the clock."""
        events: list[tuple[str, str, dict[str, Any]]] = []
        d = Deferred.fromCoroutine(self.syncer().sync(self.manifest, _progress_sink(events)))
        self.drive(d)
        self.successResultOf(d)
        # All bytes arrive within one clock instant: the first report, then the forced
        # final one; none of the per-chunk updates in between.
        self.assertLessEqual(len(events), 3)
        self.assertIn("ready", events[-1][1])
        self.assertEqual(events[-1][2]["bytes_total"], events[-1][2]["bytes_done"])

    def test_manifest_fetched_with_base_path(self) -> None:
        """With only model_id, the manifest is fetched from the backend (base path kept)."""
        self.stub = StubTreq(_backend_root(self.repo, base=(b"base",)))
        syncer = ModelSyncer(
            self.clock,
            cast(HTTPClient, self.stub),
            self.runner,
            store_dir=self.store,
            backend_url="http://backend.invalid:8000/base",
            credential=lambda: SECRET,
            free_space=lambda path: self.free,
        )
        d = Deferred.fromCoroutine(
            syncer.sync({"model_id": MODEL_ID, "source": "sync_from_server"}, lambda *a, **k: None)
        )
        self.drive(d)
        result = self.successResultOf(d)
        self.assertEqual(result["model_dir_name"], DIR_NAME)
        self.assertEqual(self.repo.requests[0].kind, "manifest")
        # Up to 64 MiB of the backend's JSON: decoded on the pool, not on the reactor thread.
        self.assertIn("_decode_manifest", self.runner.calls)

    def test_invalid_manifest_touches_nothing(self) -> None:
        """A traversal attempt is refused before the store is created or anything fetched."""
        bad = dict(self.manifest, model_dir_name="../../outside")
        d = Deferred.fromCoroutine(self.syncer().sync(bad, lambda *a, **k: None))
        f = self.failureResultOf(d, CommandFailed)
        self.assertEqual(f.value.error_code, "invalid_command")
        self.assertFalse(os.path.exists(self.store))
        self.assertEqual(self.repo.requests, [])

    def test_download_from_hf_is_skipped(self) -> None:
        """source download_from_hf needs nothing from the agent."""
        d = Deferred.fromCoroutine(
            self.syncer().sync({"source": "download_from_hf"}, lambda *a, **k: None)
        )
        self.assertTrue(self.successResultOf(d)["skipped"])

    def test_handler_spec(self) -> None:
        """The sync_model handler reads payload.model_sync and refuses other payloads."""
        spec = sync_model_handler_spec(self.syncer())
        self.assertIsInstance(spec, HandlerSpec)
        self.assertTrue(spec.idempotent)
        self.assertFalse(spec.blocked_by_maintenance)

        class Ctx:
            def __init__(self, payload: dict[str, Any]) -> None:
                from llmport_agent.commands.base import Command

                self.command = Command(id="c1", command_type="sync_model", payload=payload)
                self.reactor = None
                self.events: list[Any] = []

            def progress(self, phase: str, message: str, **extra: Any) -> None:
                self.events.append((phase, message, extra))

            def emit_event(self, *a: Any, **k: Any) -> None:
                pass

        bad: Deferred[dict[str, Any]] = ensureDeferred(
            cast(Any, spec.handler(cast(Any, Ctx({"model_sync": "x"}))))
        )
        self.assertEqual(
            self.failureResultOf(bad, CommandFailed).value.error_code, "invalid_command"
        )
        ctx = Ctx({"model_sync": self.manifest})
        d: Deferred[dict[str, Any]] = ensureDeferred(cast(Any, spec.handler(cast(Any, ctx))))
        self.drive(d)
        self.assertEqual(self.successResultOf(d)["blobs_total"], len(self.manifest["blobs"]))
        self.assertTrue(ctx.events)


class StubSyncTests(_StubSync, SynchronousTestCase):
    """The Clock-driven syncs with one stream per blob."""


class RangedStubSyncTests(_StubSync, SynchronousTestCase):
    """The Clock-driven syncs with three ranged connections per large blob."""

    connections = 3
    segment = 256 * 1024


# --- real loopback ----------------------------------------------------------------------------


class _TrackingFactory(WrappingFactory):
    """Wraps a Site; knows its open connections so teardown can close and wait for them."""

    def __init__(self, site: Site) -> None:
        super().__init__(site)
        self._waiters: list[Deferred[None]] = []

    def unregisterProtocol(self, p: Any) -> None:
        super().unregisterProtocol(p)
        if not self.protocols:
            waiters, self._waiters = self._waiters, []
            for w in waiters:
                w.callback(None)

    def close_all(self) -> Deferred[None]:
        if not self.protocols:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._waiters.append(d)
        for p in list(self.protocols):
            p.transport.loseConnection()
        return d


class _LoopbackSync:
    """
    Syncs against the stand-in backend on 127.0.0.1, with real threads and sockets. Run
    twice: one stream per blob (L{LoopbackSyncTests}) and several ranged connections per
    large blob (L{RangedLoopbackSyncTests}).
    """

    timeout = 120
    connections = 1
    # Blobs of two segments or more get a preallocated part file with a progress record.
    segment = 8 * 1024 * 1024

    @property
    def ranged(self) -> bool:
        return self.connections > 1

    def expected_requests(self, manifest: dict[str, Any]) -> int:
        """Blob requests of a clean sync: one per blob, or one per segment of large ones."""
        n = 0
        for blob in manifest["blobs"]:
            if self.ranged and blob["size"] >= 2 * self.segment:
                n += -(-blob["size"] // self.segment)
            else:
                n += 1
        return n

    def setUp(self) -> None:
        self.repo = ModelRepository()
        site = Site(_backend_root(self.repo))
        site.displayTracebacks = False
        self.factory = _TrackingFactory(site)
        self.port = reactor.listenTCP(0, self.factory, interface="127.0.0.1")
        self.pool = PoolService(reactor, "models-test", 6)
        self.pool.startService()
        self.http_pool = HTTPConnectionPool(reactor, persistent=True)
        self.http_pool.maxPersistentPerHost = 8
        self.http = HTTPClient(Agent(reactor, pool=self.http_pool))
        self.runner = RecordingRunner(self.pool)
        self.store = os.path.abspath(self.mktemp())
        self.free: int | None = None
        self.addCleanup(self._teardown)

    async def _teardown(self) -> None:
        await self.http_pool.closeCachedConnections()
        await self.pool.stopService()
        await self.port.stopListening()
        await self.factory.close_all()

    def syncer(self, **kw: Any) -> ModelSyncer:
        free = self.free
        kw.setdefault("retry_initial_delay", 0.01)
        kw.setdefault("retry_max_delay", 0.05)
        kw.setdefault("connections", self.connections)
        kw.setdefault("segment_size", self.segment)
        return ModelSyncer(
            reactor,
            self.http,
            self.runner,
            store_dir=self.store,
            backend_url=f"http://127.0.0.1:{self.port.getHost().port}",
            credential=lambda: SECRET,
            free_space=(lambda path: free) if free is not None else None,
            **kw,
        )

    def assertValidCache(self, manifest: dict[str, Any], files: dict[str, bytes]) -> str:
        """
        Check the HF cache layout: verified blobs, no leftovers, refs without newline, every
        snapshot link relative and resolving to the blob of its hash, and the ref's snapshot
        holding C{files}.
        """
        model_dir = os.path.join(self.store, manifest["model_dir_name"])
        blobs_dir = os.path.realpath(os.path.join(model_dir, "blobs"))
        for blob in manifest["blobs"]:
            path = os.path.join(model_dir, "blobs", blob["hash"])
            self.assertTrue(os.path.isfile(path) and not os.path.islink(path))
            self.assertEqual(os.path.getsize(path), blob["size"])
        leftovers = [n for n in os.listdir(os.path.join(model_dir, "blobs")) if n.endswith(".part")]
        self.assertEqual(leftovers, [])
        for ref in manifest["refs"]:
            with open(os.path.join(model_dir, "refs", ref["name"]), "rb") as f:
                self.assertEqual(f.read(), ref["commit"].encode())  # no trailing newline
        for snap in manifest["snapshots"]:
            root = os.path.join(model_dir, "snapshots", snap["commit"])
            for link in snap["links"]:
                path = os.path.join(root, *link["path"].split("/"))
                self.assertTrue(os.path.islink(path), link["path"])
                target = os.readlink(path)
                self.assertFalse(os.path.isabs(target))
                self.assertEqual(
                    target, "../" * (link["path"].count("/") + 2) + "blobs/" + link["blob_hash"]
                )
                real = os.path.realpath(path)
                self.assertEqual(os.path.dirname(real), blobs_dir)
                with open(path, "rb") as f:
                    self.assertEqual(hashlib.sha256(f.read()).hexdigest(), link["blob_hash"])
        main = os.path.join(model_dir, "snapshots", manifest["refs"][0]["commit"])
        for rel, data in files.items():
            with open(os.path.join(main, *rel.split("/")), "rb") as f:
                self.assertEqual(f.read(), data, rel)
        self.assertEqual(os.listdir(os.path.join(model_dir, ".llmport-tmp")), [])
        return model_dir

    async def test_fresh_sync(self) -> None:
        """A fresh sync builds a valid HF cache: blobs, refs without newline, relative links."""
        files = _files()
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        events: list[tuple[str, str, dict[str, Any]]] = []
        syncer = self.syncer()
        result = await syncer.sync(manifest, _progress_sink(events))
        self.assertValidCache(manifest, files)
        self.assertEqual(syncer.bytes_downloaded, manifest["total_size"])  # the metric
        self.assertEqual(result["fetched"]["count"], len(manifest["blobs"]))
        self.assertEqual(result["fetched"]["bytes"], manifest["total_size"])
        self.assertEqual(result["reused"]["count"], 0)
        self.assertEqual(result["refs"], {"main": manifest["refs"][0]["commit"]})
        self.assertTrue(events)
        self.assertEqual(events[-1][2]["progress_pct"], 100.0)
        names = self.runner.names()
        for job in ("open_model_dir", "write_batch", "hash_batch", "finish_part", "open_part"):
            self.assertIn(job, names)
        self.assertFalse(
            [c for c in self.runner.calls if c[1]], "file work ran on the reactor thread"
        )
        self.assertNotIn("hash_region", names)  # nothing read back: hashed as it arrived
        # Large writes: one pwritev per batch (2 MiB), plus at most one short one per response.
        batches = sum(-(-b["size"] // (2 * 1024 * 1024)) for b in manifest["blobs"])
        self.assertLessEqual(names.count("write_batch"), batches + len(self.repo.blob_requests()))
        big = hashlib.sha256(files["model.safetensors"]).hexdigest()
        if self.ranged:
            reqs = self.repo.blob_requests(big)
            self.assertEqual(len(reqs), -(-len(files["model.safetensors"]) // self.segment))
            for r in reqs:
                self.assertEqual((r.status, r.range_header), (206, f"bytes={r.start}-{r.end}"))
            others = [r for r in self.repo.blob_requests() if r.blob_hash != big]
            self.assertEqual(len(others), len(manifest["blobs"]) - 1)
        else:
            self.assertEqual(len(self.repo.blob_requests()), len(manifest["blobs"]))
        self.assertEqual(result["removed_foreign"], [])

    async def test_part_file_fsynced_once(self) -> None:
        """Each downloaded blob's part file is fsynced exactly once, at the end."""
        files = _files(big_mb=4)
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        synced: list[str] = []
        real_fsync = os.fsync

        def counting_fsync(fd: int) -> None:
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                target = "?"
            if target.endswith(".part"):
                synced.append(os.path.basename(target))
            real_fsync(fd)

        self.patch(os, "fsync", counting_fsync)
        await self.syncer().sync(manifest, lambda *a, **k: None)
        self.assertEqual(sorted(synced), sorted(b["hash"] + ".part" for b in manifest["blobs"]))
        self.assertValidCache(manifest, files)

    async def test_writeback_started_behind_every_batch(self) -> None:
        """
        Every byte written to a part file has its writeback started once, right behind its
        batch (C{sync_file_range(SYNC_FILE_RANGE_WRITE)} of exactly the written range), so the
        fsync at the end finds little left to write.
        """
        files = _files(big_mb=4)
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        started: dict[str, list[tuple[int, int]]] = {}

        def recording(fd: int, offset: int, length: int, flags: int) -> int:
            self.assertEqual(flags, 2)  # SYNC_FILE_RANGE_WRITE: start, do not wait
            target = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
            started.setdefault(target, []).append((offset, offset + length))
            return 0

        self.patch(_fs, "_sync_file_range", recording)
        await self.syncer().sync(manifest, lambda *a, **k: None)
        self.assertValidCache(manifest, files)
        self.assertEqual(sorted(started), sorted(b["hash"] + ".part" for b in manifest["blobs"]))
        for blob in manifest["blobs"]:
            ranges = sorted(started[blob["hash"] + ".part"])
            pos = 0
            for a, b in ranges:
                self.assertEqual(a, pos, f"writeback of {blob['hash']} has a gap or overlap")
                pos = b
            self.assertEqual(pos, blob["size"])

    async def test_resume_after_drop(self) -> None:
        """A connection dropped mid-blob is resumed with Range from where it stopped."""
        files = _files(big_mb=4)
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        big = hashlib.sha256(files["model.safetensors"]).hexdigest()
        # Ranged: the second segment's response breaks off mid-body.
        cut_at = self.segment if self.ranged else 0
        self.repo.faults.cut_after_bytes = 300_000 if self.ranged else 1_000_000
        self.repo.faults.cut_range_start = cut_at
        result = await self.syncer(concurrency=1).sync(manifest, lambda *a, **k: None)
        self.assertValidCache(manifest, files)
        reqs = self.repo.blob_requests(big)
        if self.ranged:
            resumed = [r for r in reqs if r.start == cut_at + 300_000]
            self.assertEqual(len(resumed), 1)
            self.assertEqual(
                resumed[0].range_header, f"bytes={cut_at + 300_000}-{2 * self.segment - 1}"
            )
            # only the rest of the broken range was asked again
            self.assertEqual(
                sum(r.end - r.start + 1 for r in reqs),
                len(files["model.safetensors"]) + self.segment - 300_000,
            )
        else:
            self.assertEqual([r.status for r in reqs], [200, 206])
            self.assertEqual(reqs[1].range_header, "bytes=1000000-")
            self.assertEqual(reqs[1].start, 1_000_000)
        self.assertEqual(result["retries"], 1)
        self.assertEqual(result["range_ignored"], 0)

    async def test_resume_partial_from_previous_run(self) -> None:
        """A .part left by an interrupted run is hashed once and resumed, not restarted."""
        files = _files(big_mb=2)
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        big = hashlib.sha256(files["model.safetensors"]).hexdigest()
        blobs = os.path.join(self.store, DIR_NAME, "blobs")
        os.makedirs(blobs)
        with open(os.path.join(blobs, big + ".part"), "wb") as f:
            f.write(files["model.safetensors"][:777_777])
        result = await self.syncer().sync(manifest, lambda *a, **k: None)
        self.assertValidCache(manifest, files)
        self.assertEqual(result["resumed"], 1)
        first = min(self.repo.blob_requests(big), key=lambda r: r.start)
        if self.ranged:
            self.assertEqual(first.range_header, f"bytes=777777-{777_777 + self.segment - 1}")
        else:
            self.assertEqual(first.range_header, "bytes=777777-")
        self.assertEqual(
            sum(r.end - r.start + 1 for r in self.repo.blob_requests(big)),
            len(files["model.safetensors"]) - 777_777,
        )
        self.assertIn("hash_region", self.runner.names())  # the resumed bytes, read once

    async def test_wrong_hash(self) -> None:
        """A blob whose content does not match its sha256 name fails the sync and is discarded."""
        files = _files()
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        bad = hashlib.sha256(files["tokenizer.json"]).hexdigest()
        self.repo.faults.corrupt_blob = bad
        with self.assertRaises(CommandFailed) as cm:
            await self.syncer().sync(manifest, lambda *a, **k: None)
        self.assertEqual(cm.exception.error_code, "checksum_mismatch")
        self.assertIn(bad, cm.exception.error_message)
        blobs = os.path.join(self.store, DIR_NAME, "blobs")
        self.assertFalse(os.path.exists(os.path.join(blobs, bad)))
        self.assertFalse(os.path.exists(os.path.join(blobs, bad + ".part")))
        self.assertFalse(
            os.path.exists(
                os.path.join(self.store, DIR_NAME, "snapshots", manifest["snapshots"][0]["commit"])
            )
        )

    async def test_server_ignores_range(self) -> None:
        """A server answering a ranged request with 200 makes the client start over cleanly."""
        files = _files(big_mb=4)
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        big = hashlib.sha256(files["model.safetensors"]).hexdigest()
        self.repo.faults.ignore_range = True
        self.repo.faults.cut_after_bytes = 1_500_000
        syncer = self.syncer(concurrency=1)
        result = await syncer.sync(manifest, lambda *a, **k: None)
        self.assertValidCache(manifest, files)
        reqs = self.repo.blob_requests(big)
        if self.ranged:
            self.assertIs(syncer.bounded_ranges, False)  # no ranged requests to it again
            self.assertIn(f"bytes=0-{self.segment - 1}", [r.range_header for r in reqs])
            self.assertTrue(all(r.status == 200 for r in reqs))
            self.assertGreaterEqual(result["range_ignored"], 1)
            self.assertIsNone(reqs[-1].range_header)  # started over as one stream
        else:
            self.assertEqual([r.status for r in reqs], [200, 200])
            self.assertEqual(reqs[1].range_header, "bytes=1500000-")
            self.assertEqual(result["range_ignored"], 1)

    async def test_insufficient_disk(self) -> None:
        """Too little free space fails before any download, with the numbers."""
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, _files())
        self.free = 1000
        with self.assertRaises(CommandFailed) as cm:
            await self.syncer().sync(manifest, lambda *a, **k: None)
        e = cm.exception
        self.assertEqual(e.error_code, "insufficient_disk")
        self.assertEqual(e.result["needed_bytes"], manifest["total_size"])
        self.assertEqual(e.result["free_bytes"], 1000)
        self.assertEqual(e.result["path"], os.path.join(self.store, DIR_NAME))
        self.assertIn(os.path.join(self.store, DIR_NAME), e.error_message)
        self.assertEqual(self.repo.blob_requests(), [])

    async def test_concurrent_syncs_share_one_download(self) -> None:
        """Two syncs of one model at once download each blob once and both succeed."""
        files = _files()
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        syncer = self.syncer()
        a: list[Any] = []
        b: list[Any] = []
        d1 = Deferred.fromCoroutine(syncer.sync(manifest, _progress_sink(a)))
        d2 = Deferred.fromCoroutine(
            syncer.sync(json.loads(json.dumps(manifest)), _progress_sink(b))
        )
        r1, r2 = await gatherResults([d1, d2])
        self.assertEqual(r1, r2)
        self.assertEqual(len(self.repo.blob_requests()), self.expected_requests(manifest))
        self.assertValidCache(manifest, files)

    async def test_different_revisions_run_one_after_another(self) -> None:
        """Two manifests for one model dir do not race: the second waits, then adds its snapshot."""
        files1 = _files(big_mb=1, seed=1)
        m1 = self.repo.add_model(MODEL_ID, REPO_ID, files1, commit="1" * 40)
        files2 = dict(files1, **{"extra.txt": b"second revision"})
        m2 = self.repo.add_model(MODEL_ID, REPO_ID, files2, commit="2" * 40)
        syncer = self.syncer()
        d1 = Deferred.fromCoroutine(syncer.sync(m1, lambda *a, **k: None))
        d2 = Deferred.fromCoroutine(syncer.sync(m2, lambda *a, **k: None))
        results = await DeferredList([d1, d2], consumeErrors=True)
        self.assertTrue(all(ok for ok, _ in results), results)
        self.assertValidCache(m2, files2)

    async def test_repeat_sync_reuses_without_hashing(self) -> None:
        """A second sync stats the blobs, trusts the record, hashes nothing, fetches nothing."""
        files = _files()
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        syncer = self.syncer()
        await syncer.sync(manifest, lambda *a, **k: None)
        requests_before = len(self.repo.requests)
        self.runner.calls.clear()
        result = await syncer.sync(manifest, lambda *a, **k: None)
        self.assertEqual(result["fetched"]["count"], 0)
        self.assertEqual(result["verified"]["count"], 0)
        self.assertEqual(result["reused"]["count"], len(manifest["blobs"]))
        self.assertEqual(len(self.repo.requests), requests_before)
        names = self.runner.names()
        for hashing in ("verify_blob", "hash_region", "hash_batch", "open_part", "write_batch"):
            self.assertNotIn(hashing, names)
        self.assertValidCache(manifest, files)

    async def test_unrecorded_blobs_are_verified_once(self) -> None:
        """Blobs present without a record are hashed once, then reused on the next sync."""
        files = _files()
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        syncer = self.syncer()
        await syncer.sync(manifest, lambda *a, **k: None)
        os.unlink(os.path.join(self.store, DIR_NAME, ".llmport-verified.json"))
        result = await syncer.sync(manifest, lambda *a, **k: None)
        self.assertEqual(result["verified"]["count"], len(manifest["blobs"]))
        self.assertEqual(result["fetched"]["count"], 0)
        result = await syncer.sync(manifest, lambda *a, **k: None)
        self.assertEqual(result["reused"]["count"], len(manifest["blobs"]))

    async def test_damaged_blob_is_fetched_again(self) -> None:
        """A cached blob changed on disk (new mtime) is re-verified, found bad, and re-fetched."""
        files = _files()
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        syncer = self.syncer()
        await syncer.sync(manifest, lambda *a, **k: None)
        tok = hashlib.sha256(files["tokenizer.json"]).hexdigest()
        path = os.path.join(self.store, DIR_NAME, "blobs", tok)
        with open(path, "r+b") as f:
            f.write(b"\0\0\0\0")
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        result = await syncer.sync(manifest, lambda *a, **k: None)
        self.assertEqual(result["fetched"]["count"], 1)
        self.assertEqual(result["reused"]["count"], len(manifest["blobs"]) - 1)
        self.assertValidCache(manifest, files)

    async def test_5xx_then_success(self) -> None:
        """Transient 503s are retried (real clock, short backoff)."""
        files = _files(big_mb=1)
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        self.repo.faults.fail_5xx_times = 3
        result = await self.syncer().sync(manifest, lambda *a, **k: None)
        self.assertEqual(result["retries"], 3)
        self.assertValidCache(manifest, files)

    async def test_reactor_stays_responsive(self) -> None:
        """
        While a 64 MB blob is streamed, written and hashed, a 50 ms LoopingCall keeps
        ticking (the bound on lateness is deliberately generous: this is not a timing test).
        """
        files = {"model.safetensors": random.Random(3).randbytes(64 * 1024 * 1024)}
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        lateness: list[float] = []
        expected = [reactor.seconds()]

        def tick() -> None:
            now = reactor.seconds()
            lateness.append(max(0.0, now - expected[0]))
            expected[0] = now + 0.05

        loop = LoopingCall(tick)
        loop.clock = reactor
        loop.start(0.05, now=True)
        try:
            await self.syncer().sync(manifest, lambda *a, **k: None)
        finally:
            loop.stop()
        self.assertGreater(len(lateness), 1)
        self.assertLess(max(lateness), 5.0)
        self.assertFalse([c for c in self.runner.calls if c[1]])
        self.assertValidCache(manifest, files)

    async def test_cancelled_sync_resumes_later(self) -> None:
        """
        A sync cancelled mid-blob (e.g. at its deadline) keeps the partial file; the next
        sync does not join the cancelled one, waits for it to wind down, then resumes with
        Range.
        """
        files = {"model.safetensors": random.Random(5).randbytes(48 * 1024 * 1024)}
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        big = manifest["blobs"][0]["hash"]
        syncer = self.syncer(progress_interval=0)
        holder: list[Deferred[dict[str, Any]]] = []

        def progress(phase: str, message: str, **extra: Any) -> None:
            if extra["bytes_done"] > 0 and len(holder) == 1:
                holder.append(holder[0])
                reactor.callLater(0, holder[0].cancel)

        d: Deferred[dict[str, Any]] = Deferred.fromCoroutine(syncer.sync(manifest, progress))
        holder.append(d)
        with self.assertRaises(CancelledError):
            await d
        # The partial file is preallocated to the blob's size; its written ranges are recorded.
        blobs = os.path.join(self.store, DIR_NAME, "blobs")
        op = syncer._ops.get(DIR_NAME)
        if op is not None:
            await op.when_done()  # the cancelled sync winds down (its part file closed)
        part = os.path.join(blobs, big + ".part")
        self.assertGreaterEqual(len(files["model.safetensors"]), 2 * self.segment)
        if os.path.exists(part):
            self.assertEqual(os.path.getsize(part), len(files["model.safetensors"]))
            with open(os.path.join(blobs, big + ".progress")) as f:
                record = json.load(f)
            self.assertEqual(record["size"], len(files["model.safetensors"]))
            self.assertTrue(record["done"])
        before = len(self.repo.blob_requests(big))
        result = await syncer.sync(manifest, lambda *a, **k: None)
        self.assertEqual(result["resumed"], 1)
        reqs = self.repo.blob_requests(big)
        if self.ranged:
            again = reqs[before:]
            self.assertTrue(again)
            for r in again:
                self.assertEqual(r.range_header, f"bytes={r.start}-{r.end}")
            self.assertLess(
                sum(r.end - r.start + 1 for r in again), len(files["model.safetensors"])
            )
        else:
            self.assertEqual(len(reqs), 2)
            self.assertEqual(reqs[1].range_header, f"bytes={reqs[1].start}-")
            self.assertGreater(reqs[1].start, 0)
        self.assertValidCache(manifest, files)

    async def test_one_caller_cancels_the_other_completes(self) -> None:
        """When one of two callers sharing a sync gives up, the other still gets the model."""
        files = _files()
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        syncer = self.syncer()
        d1: Deferred[dict[str, Any]] = Deferred.fromCoroutine(
            syncer.sync(manifest, lambda *a, **k: None)
        )
        d2: Deferred[dict[str, Any]] = Deferred.fromCoroutine(
            syncer.sync(manifest, lambda *a, **k: None)
        )
        d1.cancel()
        self.failureResultOf(d1, CancelledError)
        result = await d2
        self.assertEqual(result["fetched"]["count"], len(manifest["blobs"]))
        self.assertEqual(len(self.repo.blob_requests()), self.expected_requests(manifest))
        self.assertValidCache(manifest, files)


class LoopbackSyncTests(_LoopbackSync, TestCase):
    """The loopback syncs with one stream per blob."""


class RangedLoopbackSyncTests(_LoopbackSync, TestCase):
    """The loopback syncs with three ranged connections per large blob (512 KiB segments)."""

    connections = 3
    segment = 512 * 1024

    async def test_connections_used_reported(self) -> None:
        """A fixed count of connections is what the result reports as used."""
        files = _files(big_mb=4)
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        result = await self.syncer().sync(manifest, lambda *a, **k: None)
        self.assertValidCache(manifest, files)
        self.assertEqual(result["connections_used"], 3)

    async def test_server_ignores_the_end_of_a_bounded_range(self) -> None:
        """
        A server that answers C{bytes=s-e} from C{s} to the end of the blob: the agent reads
        what it asked for, drops that connection, fetches the rest of the blob as one
        open-ended stream, and remembers it (the next model uses one stream at once).
        """
        files = _files(big_mb=3)
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        big = hashlib.sha256(files["model.safetensors"]).hexdigest()
        self.repo.faults.ignore_range_end = True
        syncer = self.syncer(concurrency=1)
        result = await syncer.sync(manifest, lambda *a, **k: None)
        self.assertValidCache(manifest, files)
        self.assertGreaterEqual(result["range_end_ignored"], 1)
        reqs = self.repo.blob_requests(big)
        self.assertRegex(reqs[0].range_header or "", r"^bytes=\d+-\d+$")
        self.assertRegex(reqs[-1].range_header or "", r"^bytes=\d+-$")
        self.assertLessEqual(len(reqs), self.connections + 3)  # not one request per segment
        # The next model's large blob is fetched as one stream from the start.
        other = {"weights.bin": random.Random(11).randbytes(2 * 1024 * 1024)}
        m2 = self.repo.add_model("model-2", "acme/other", other)
        await syncer.sync(m2, lambda *a, **k: None)
        self.assertEqual([r.range_header for r in self.repo.blob_requests(m2["blobs"][0]["hash"])], [None])

    async def test_last_range_finishes_first(self) -> None:
        """
        The server holds the first range until the last one has been sent completely: the
        last range's bytes wait in memory for the hash (nothing is read back from the file)
        and the blob verifies.
        """
        data = random.Random(12).randbytes(2 * self.segment)
        files = {"model.safetensors": data}
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        big = manifest["blobs"][0]["hash"]
        self.repo.faults.hold_range_start = 0
        syncer = self.syncer(connections=2)
        await syncer.sync(manifest, lambda *a, **k: None)
        self.assertValidCache(manifest, files)
        order = [r.start for r in self.repo.finished if r.blob_hash == big]
        self.assertEqual(order, [self.segment, 0])
        self.assertNotIn("hash_region", self.runner.names())
        self.assertEqual(syncer._budget.used, 0)

    async def test_range_breaks_off_mid_body(self) -> None:
        """The last range breaks off mid-body: only its missing tail is asked again."""
        data = random.Random(13).randbytes(3 * self.segment)
        files = {"model.safetensors": data}
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        big = manifest["blobs"][0]["hash"]
        self.repo.faults.cut_after_bytes = 100_000
        self.repo.faults.cut_range_start = 2 * self.segment
        result = await self.syncer().sync(manifest, lambda *a, **k: None)
        self.assertValidCache(manifest, files)
        again = [r for r in self.repo.blob_requests(big) if r.start == 2 * self.segment + 100_000]
        self.assertEqual([r.range_header for r in again],
                         [f"bytes={2 * self.segment + 100_000}-{3 * self.segment - 1}"])
        self.assertEqual(result["retries"], 1)

    async def test_resume_per_range_from_disk(self) -> None:
        """
        A partial download whose progress record lists ranges that are not contiguous (left
        by an earlier run with several connections): only the gaps are fetched, and the
        ranges already on disk are hashed from the file once.
        """
        data = random.Random(14).randbytes(4 * self.segment)
        files = {"model.safetensors": data}
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        big = manifest["blobs"][0]["hash"]
        blobs = os.path.join(self.store, DIR_NAME, "blobs")
        os.makedirs(blobs)
        seg = self.segment
        with open(os.path.join(blobs, big + ".part"), "wb") as f:
            f.write(data[:seg] + bytes(2 * seg) + data[3 * seg:])
        with open(os.path.join(blobs, big + ".progress"), "w") as f:
            json.dump({"version": 1, "size": len(data), "done": [[0, seg], [3 * seg, 4 * seg]]}, f)
        result = await self.syncer().sync(manifest, lambda *a, **k: None)
        self.assertValidCache(manifest, files)
        self.assertEqual(result["resumed"], 1)
        self.assertEqual(
            {r.range_header for r in self.repo.blob_requests(big)},
            {f"bytes={seg}-{2 * seg - 1}", f"bytes={2 * seg}-{3 * seg - 1}"},
        )
        self.assertEqual(self.runner.names().count("hash_region"), 2)
        self.assertFalse(os.path.exists(os.path.join(blobs, big + ".progress")))

    async def test_adaptive_connections_where_each_connection_is_limited(self) -> None:
        """
        With the adaptive setting (connections=0) and a server that limits each connection
        (16 MB/s), the blob is fetched with more connections as each one pays off.
        """
        data = random.Random(16).randbytes(64 * 1024 * 1024)
        files = {"model.safetensors": data}
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        self.repo.faults.rate_limit = 16_000_000
        syncer = self.syncer(connections=0, segment_size=4 * 1024 * 1024, cpu=_idle_host)
        result = await syncer.sync(manifest, lambda *a, **k: None)
        self.assertValidCache(manifest, files)
        self.assertGreater(result["connections_used"], 1)
        # It began as one stream (no Range), which was cut where the ranges took over.
        headers = [r.range_header for r in self.repo.blob_requests(manifest["blobs"][0]["hash"])]
        self.assertIsNone(headers[0])
        self.assertTrue(all(h and not h.endswith("-") for h in headers[1:]), headers)
        self.assertGreater(len(headers), 2)
        # Range support was confirmed with one byte before the stream was cut; nothing was
        # fetched twice.
        first = self.repo.blob_requests(manifest["blobs"][0]["hash"])[1]
        self.assertEqual((first.status, first.end - first.start), (206, 0))
        self.assertEqual(first.range_header, f"bytes={first.start}-{first.start}")
        self.assertEqual(syncer.bytes_downloaded, len(data))
        self.assertIs(syncer.bounded_ranges, True)

    async def _adaptive_with_unusable_ranges(
        self, arm: Callable[[], None] | None = None
    ) -> tuple[ModelSyncer, dict[str, Any], list[ServedRequest]]:
        """
        An adaptive sync of one 32 MiB blob from a server that limits each connection (so
        the scaler adds one after two windows, about 18 MB in, with time to spare) where
        ranged requests fail as the faults say. C{arm} sets a fault once the stream runs.
        """
        data = random.Random(18).randbytes(32 * 1024 * 1024)
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, {"model.safetensors": data})
        self.repo.faults.rate_limit = 16_000_000
        armed: list[bool] = []

        def progress(phase: str, message: str, **extra: Any) -> None:
            if arm is not None and extra.get("bytes_done") and not armed:
                armed.append(True)
                arm()

        syncer = self.syncer(connections=0, segment_size=4 * 1024 * 1024, cpu=_idle_host,
                             progress_interval=0, concurrency=1)
        result = await syncer.sync(manifest, progress)
        self.assertValidCache(manifest, {"model.safetensors": data})
        # The stream lost nothing: no start over, every byte fetched once, one connection.
        self.assertNotIn("reset_part", self.runner.names())
        self.assertEqual(syncer.bytes_downloaded, len(data))
        self.assertEqual(result["fetched"]["bytes"], len(data))
        self.assertEqual(result["connections_used"], 1)
        # The scaler did want a second connection: the one request beside the stream.
        reqs = self.repo.blob_requests(manifest["blobs"][0]["hash"])
        self.assertEqual(reqs[0].range_header, None)
        self.assertEqual(len(reqs), 2, reqs)
        self.assertRegex(reqs[1].range_header or "", r"^bytes=(\d+)-\1$")
        self.assertEqual(self.repo.finished[-1].range_header, None)  # the stream, to its end
        return syncer, result, reqs

    async def test_adaptive_server_ignoring_range_keeps_the_stream(self) -> None:
        """
        Adaptive, with a server (or a proxy) that answers Range with 200: the one-byte
        request that confirms Range before the stream is cut gets 200 and is dropped; the
        stream goes on to the end, nothing starts over, and the syncer remembers it.
        """
        self.repo.faults.ignore_range = True
        syncer, result, reqs = await self._adaptive_with_unusable_ranges()
        self.assertEqual(reqs[1].status, 200)
        self.assertEqual(result["range_ignored"], 1)
        self.assertIs(syncer.bounded_ranges, False)

    async def test_adaptive_server_ignoring_the_range_end_keeps_the_stream(self) -> None:
        """
        Adaptive, a server that answers the one-byte range from there to the end of the blob:
        that response is dropped, the stream goes on to the end, and the syncer remembers it.
        """
        self.repo.faults.ignore_range_end = True
        syncer, result, reqs = await self._adaptive_with_unusable_ranges()
        self.assertEqual((reqs[1].status, reqs[1].end), (206, 32 * 1024 * 1024 - 1))
        self.assertEqual(result["range_end_ignored"], 1)
        self.assertIs(syncer.bounded_ranges, False)

    async def test_adaptive_blob_done_before_range_is_confirmed(self) -> None:
        """
        Adaptive, the one-byte request that confirms Range is held by the server until the
        stream's response has been sent completely: its answer comes late (what the stream
        has not received by then is cut off and fetched as ranges), or it is cancelled at the
        end; either way nothing is left running and nothing is fetched twice.
        """
        data = random.Random(19).randbytes(32 * 1024 * 1024)
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, {"model.safetensors": data})
        self.repo.faults.rate_limit = 16_000_000
        self.repo.faults.hold_range_length = 1
        syncer = self.syncer(connections=0, segment_size=4 * 1024 * 1024, cpu=_idle_host)
        result = await syncer.sync(manifest, lambda *a, **k: None)
        self.assertValidCache(manifest, {"model.safetensors": data})
        reqs = self.repo.blob_requests(manifest["blobs"][0]["hash"])
        self.assertIsNone(reqs[0].range_header)
        self.assertEqual(reqs[1].end - reqs[1].start, 0)
        self.assertIsNone(self.repo.faults.hold_range_length)  # the probe was held
        self.assertEqual(syncer.bytes_downloaded, len(data))
        self.assertEqual(result["fetched"]["bytes"], len(data))
        self.assertNotIn("reset_part", self.runner.names())

    async def test_adaptive_range_refused_keeps_the_stream(self) -> None:
        """Adaptive, a 416 to the ranged request beside the stream: one stream to the end."""
        self.repo.faults.refuse_range_times = 1
        syncer, result, reqs = await self._adaptive_with_unusable_ranges()
        self.assertEqual(reqs[1].status, 416)
        self.assertEqual(result["range_ignored"], 0)
        self.assertIsNone(syncer.bounded_ranges)  # nothing learnt: the next blob asks again

    async def test_adaptive_extra_request_failing_keeps_the_stream(self) -> None:
        """Adaptive, a 503 to the ranged request beside the stream: one stream to the end."""

        def arm() -> None:
            self.repo.faults.fail_5xx_times = 1

        _, _, reqs = await self._adaptive_with_unusable_ranges(arm)
        self.assertEqual(reqs[1].status, 503)

    async def test_adaptive_extra_connection_dropped_keeps_the_stream(self) -> None:
        """
        Adaptive, the connection of the ranged request beside the stream drops after its
        headers: one stream to the end.
        """

        def arm() -> None:
            self.repo.faults.cut_after_bytes = 0

        _, _, reqs = await self._adaptive_with_unusable_ranges(arm)
        self.assertEqual(reqs[1].status, 206)

    async def test_adaptive_stays_at_one_stream_where_the_cpu_is_the_limit(self) -> None:
        """
        The same link on a host without idle CPU: no second connection, and the blob comes
        as the one stream it started as (no bounded requests, each a round trip and a
        drained pipeline).
        """
        # The scaler decides after two windows of at least 0.5 s and two segments each
        # (about 20 MiB: the stand-in sends the first MiB of each response at once, the
        # rest at its limit), well before the end.
        data = random.Random(17).randbytes(40 * 1024 * 1024)
        files = {"model.safetensors": data}
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        big = manifest["blobs"][0]["hash"]
        self.repo.faults.rate_limit = 16_000_000
        result = await self.syncer(connections=0, segment_size=4 * 1024 * 1024,
                                   cpu=_busy_host).sync(manifest, lambda *a, **k: None)
        self.assertValidCache(manifest, files)
        self.assertEqual(result["connections_used"], 1)
        self.assertEqual([r.range_header for r in self.repo.blob_requests(big)], [None])

    async def test_many_blobs_bounded_by_bytes_in_flight(self) -> None:
        """
        Ten blobs with a small memory budget: at no time do the downloads hold more than
        the budget plus one batch and one socket read per connection.
        """
        rng = random.Random(15)
        files = {f"shard-{i}.bin": rng.randbytes(rng.randrange(1, 3) * self.segment + 1234)
                 for i in range(10)}
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        budget = 2 * 1024 * 1024
        batch = 256 * 1024
        syncer = self.syncer(concurrency=4, buffer_bytes=budget, batch_size=batch)
        await syncer.sync(manifest, lambda *a, **k: None)
        self.assertValidCache(manifest, files)
        connections = 4 * self.connections
        self.assertLessEqual(syncer._budget.peak, budget + connections * (batch + 1024 * 1024))
        self.assertGreater(syncer._budget.peak, 0)
        self.assertEqual(syncer._budget.used, 0)


class BackendEndpointTests(TestCase):
    """The backend client's endpoints read large blocks from the socket."""

    async def test_large_reads(self) -> None:
        """An http endpoint's connection reads READ_SIZE bytes at a time; https wraps TLS."""
        from twisted.internet.protocol import Factory, Protocol
        from twisted.web.client import URI
        from twisted.web.error import SchemeNotSupported

        from llmport_agent.session.endpoints import READ_SIZE, BackendEndpointFactory
        from llmport_agent.session.tls import https_policy

        server = Factory.forProtocol(Protocol)
        port = reactor.listenTCP(0, server, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        factory = BackendEndpointFactory(reactor, https_policy(True, None), 5)
        endpoint = factory.endpointForURI(URI.fromBytes(b"http://127.0.0.1:%d/" % port.getHost().port))
        proto = await endpoint.connect(Factory.forProtocol(Protocol))
        self.assertEqual(proto.transport.bufferSize, READ_SIZE)
        proto.transport.loseConnection()
        tls = factory.endpointForURI(URI.fromBytes(b"https://backend.invalid/"))
        self.assertNotIsInstance(tls, type(endpoint))
        with self.assertRaises(SchemeNotSupported):
            factory.endpointForURI(URI.fromBytes(b"ftp://backend.invalid/"))


class ConnectionScalerTests(SynchronousTestCase):
    """How many connections a blob uses is learnt from how fast it arrives."""

    def feed(self, scaler: Any, rates: dict[int, float], seconds: float = 10.0) -> list[int]:
        """Feed one-second windows at the rate each connection count gives; the steps taken."""
        steps = []
        now, total = 0.0, 0
        scaler.observe(now, total)
        while now < seconds and not scaler.settled:
            now += 1.0
            total += int(rates[scaler.allowed])
            change = scaler.observe(now, total)
            if change is not None:
                steps.append(change)
        return steps

    def test_more_connections_while_they_pay(self) -> None:
        """Each doubling that speeds the blob up by >= 20% is kept, up to the maximum."""
        from llmport_agent.models.transfer import ConnectionScaler

        scaler = ConnectionScaler(4, 1000)
        self.assertEqual(self.feed(scaler, {1: 1e6, 2: 2e6, 4: 4e6}), [2, 4])
        self.assertEqual((scaler.allowed, scaler.settled), (4, True))

    def test_back_to_one_when_a_second_does_not_pay(self) -> None:
        """On a link that one stream fills, the second connection is dropped again."""
        from llmport_agent.models.transfer import ConnectionScaler

        scaler = ConnectionScaler(4, 1000)
        self.assertEqual(self.feed(scaler, {1: 1e6, 2: 1.1e6, 4: 1.1e6}), [2, 1])
        self.assertEqual((scaler.allowed, scaler.settled), (1, True))

    def test_stops_at_the_best(self) -> None:
        """Two pay, four do not: two it is."""
        from llmport_agent.models.transfer import ConnectionScaler

        scaler = ConnectionScaler(8, 1000)
        self.assertEqual(self.feed(scaler, {1: 1e6, 2: 1.9e6, 4: 2e6}), [2, 4, 2])
        self.assertEqual(scaler.allowed, 2)

    def test_windows_need_bytes_and_time(self) -> None:
        """No decision on a window with too few bytes or too short a time."""
        from llmport_agent.models.transfer import ConnectionScaler

        scaler = ConnectionScaler(4, 10_000, min_seconds=0.5, warmup=False)
        scaler.observe(0.0, 0)
        self.assertIsNone(scaler.observe(0.4, 50_000))  # too short
        self.assertIsNone(scaler.observe(1.0, 9_000))  # too few bytes since the start
        self.assertEqual(scaler.observe(2.0, 20_000), 2)
        self.assertTrue(ConnectionScaler(1, 1).settled)

    def test_first_window_warms_up(self) -> None:
        """
        The first window (the first request, TCP's slow start, cold buffers) is not
        measured: a slow start does not make a second connection look like it pays.
        """
        from llmport_agent.models.transfer import ConnectionScaler

        scaler = ConnectionScaler(4, 1000)
        steps = []
        now, total = 0.0, 0
        scaler.observe(now, total)
        # Window 1 (warm-up) at half speed; then one connection gives 1 MB/s, two 1.1.
        for rate in [0.5e6, 1e6]:
            now, total = now + 1.0, total + int(rate)
            steps.append(scaler.observe(now, total))
        while not scaler.settled:
            now, total = now + 1.0, total + int({1: 1e6, 2: 1.1e6, 4: 1.1e6}[scaler.allowed])
            steps.append(scaler.observe(now, total))
        self.assertEqual([s for s in steps if s is not None], [2, 1])
        self.assertEqual(scaler.allowed, 1)


class _FakeCpu:
    """CPU counters that grow at set rates as the test's time moves (L{advance})."""

    def __init__(self, busy: float, idle: float | None, cpus: int = 2) -> None:
        self.busy, self.idle, self.cpus = busy, idle, cpus
        self.process = 0.0
        self.idle_total = 0.0
        self.reads = 0

    def advance(self, dt: float) -> None:
        self.process += self.busy * dt
        self.idle_total += (self.idle or 0.0) * dt

    def __call__(self) -> Any:
        from llmport_agent.models.transfer import CpuSample

        self.reads += 1
        return CpuSample(self.process, None if self.idle is None else self.idle_total, self.cpus)


class ConnectionScalerCpuTests(SynchronousTestCase):
    """
    The scaler adds a connection only while the host has idle CPU for it: where the CPU is
    the limit, more connections only add work.
    """

    def feed(self, scaler: Any, cpu: _FakeCpu, rates: dict[int, float],
             busy: dict[int, float] | None = None, idle: dict[int, float] | None = None,
             seconds: float = 10.0) -> list[int]:
        """One-second windows at the rates (and CPU use) of each connection count; the steps."""
        steps = []
        now, total = 0.0, 0
        scaler.observe(now, total)
        while now < seconds and not scaler.settled:
            if busy is not None:
                cpu.busy = busy[scaler.allowed]
            if idle is not None:
                cpu.idle = idle[scaler.allowed]
            now += 1.0
            cpu.advance(1.0)
            total += int(rates[scaler.allowed])
            change = scaler.observe(now, total)
            if change is not None:
                steps.append(change)
        return steps

    def scaler(self, cpu: _FakeCpu, maximum: int = 4) -> Any:
        from llmport_agent.models.transfer import ConnectionScaler

        return ConnectionScaler(maximum, 1000, cpu=cpu)

    def test_cpu_bound_host_keeps_one(self) -> None:
        """
        This process keeps 1.2 of 2 CPUs busy and the host has 0.3 idle: no second
        connection, even though the rates would have it pay.
        """
        cpu = _FakeCpu(busy=1.2, idle=0.3)
        scaler = self.scaler(cpu)
        self.assertEqual(self.feed(scaler, cpu, {1: 1e6, 2: 2e6, 4: 4e6}), [])
        self.assertEqual((scaler.allowed, scaler.settled), (1, True))
        self.assertEqual(scaler.reason, "the CPU is the limit")
        rate, busy, idle = scaler.last
        self.assertEqual((rate, round(busy, 2), round(idle, 2)), (1e6, 1.2, 0.3))

    def test_link_limited_host_adds(self) -> None:
        """Each connection held to a rate, the CPUs mostly idle: doubled while it pays."""
        cpu = _FakeCpu(busy=0.05, idle=1.9)
        scaler = self.scaler(cpu)
        self.assertEqual(self.feed(scaler, cpu, {1: 1e6, 2: 2e6, 4: 4e6}), [2, 4])
        self.assertEqual((scaler.allowed, scaler.reason), (4, "the maximum"))

    def test_stops_where_the_cpu_runs_out(self) -> None:
        """
        Two connections pay, and use what was idle (1.2 busy, 0.4 idle): no four, and the
        two are kept.
        """
        cpu = _FakeCpu(busy=0.6, idle=1.3)
        scaler = self.scaler(cpu)
        steps = self.feed(scaler, cpu, {1: 1e6, 2: 2e6, 4: 4e6},
                          busy={1: 0.6, 2: 1.2}, idle={1: 1.3, 2: 0.4})
        self.assertEqual(steps, [2])
        self.assertEqual((scaler.allowed, scaler.reason), (2, "the CPU is the limit"))

    def test_drops_back_when_a_step_does_not_pay_with_idle_cpu(self) -> None:
        """Idle CPU allows the try; the rate decides: two bring 5 % more, back to one."""
        cpu = _FakeCpu(busy=0.3, idle=1.5)
        scaler = self.scaler(cpu)
        self.assertEqual(self.feed(scaler, cpu, {1: 1e6, 2: 1.05e6, 4: 1.1e6}), [2, 1])
        self.assertEqual((scaler.allowed, scaler.reason), (1, "the last step did not pay"))

    def test_without_host_counters_assumes_alone(self) -> None:
        """
        No C{/proc/stat}: the host's idle CPU is what this process leaves of its CPUs
        (1.9 of 2 busy: none to spare; 0.1 of 2: plenty).
        """
        cpu = _FakeCpu(busy=1.9, idle=None)
        scaler = self.scaler(cpu)
        self.assertEqual(self.feed(scaler, cpu, {1: 1e6, 2: 2e6, 4: 4e6}), [])
        cpu = _FakeCpu(busy=0.1, idle=None)
        scaler = self.scaler(cpu)
        self.assertEqual(self.feed(scaler, cpu, {1: 1e6, 2: 2e6, 4: 4e6}), [2, 4])

    def test_counters_read_at_window_edges_only(self) -> None:
        """Batches inside a window do not read the counters (one read per window)."""
        from llmport_agent.models.transfer import ConnectionScaler

        cpu = _FakeCpu(busy=0.1, idle=1.8)
        scaler = ConnectionScaler(4, 10_000, min_seconds=0.5, cpu=cpu)
        scaler.observe(0.0, 0)
        for i in range(1, 10):  # nine batches of one window
            cpu.advance(0.1)
            scaler.observe(0.1 * i, 1000 * i)
        self.assertEqual(cpu.reads, 1)
        cpu.advance(0.1)
        scaler.observe(1.0, 10_000)
        self.assertEqual(cpu.reads, 2)
