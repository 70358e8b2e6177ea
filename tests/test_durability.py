"""
Durability by fault injection: C{atomic_write} (state, credential) and the command journal's
append, with C{os.fsync}, C{os.replace} and C{os.write} recorded or made to fail.

Claims (README "Nothing acked is lost"): a replaced file is written to a new temporary file,
fsynced, renamed over the target, and the directory fsynced after the rename; a crash before
the rename leaves the old file whole; a journal record is fsynced before its append fires (so
before the command is acked).
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.journal import CommandJournal, JournalRecord
from llmport_agent.core import safefs, storage
from llmport_agent.demo.testing import SynchronousRunner


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"<fd {fd}>"


class Recorder:
    """Wraps os.fsync/os.replace/os.rename to log what happens, in order."""

    def __init__(self, case: SynchronousTestCase) -> None:
        self.ops: list[tuple[str, str, str]] = []  # (op, kind or "", path)
        self.fail_on: dict[str, BaseException] = {}
        real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

        def fsync(fd: int) -> None:
            kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
            path = _fd_path(fd)
            self.ops.append(("fsync", kind, path))
            exc = self.fail_on.get("fsync-" + kind)
            if exc is not None:
                raise exc
            real_fsync(fd)

        def replace(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
            self.ops.append(("rename", "", str(dst)))
            exc = self.fail_on.get("rename")
            if exc is not None:
                raise exc
            real_replace(src, dst, *a, **kw)

        def rename(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
            self.ops.append(("rename", "", str(dst)))
            exc = self.fail_on.get("rename")
            if exc is not None:
                raise exc
            real_rename(src, dst, *a, **kw)

        case.patch(os, "fsync", fsync)
        case.patch(os, "replace", replace)
        case.patch(os, "rename", rename)

    def index(self, op: str, kind: str = "") -> list[int]:
        return [i for i, (o, k, _p) in enumerate(self.ops) if o == op and (not kind or k == kind)]


class AtomicWriteTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.path = os.path.join(self.dir, "state.json")
        with open(self.path, "wb") as f:
            f.write(b'{"old": true}')

    def test_data_fsynced_before_rename_directory_after(self) -> None:
        """atomic_write: fsync of the new file, then the rename over the target, then fsync of the directory."""
        rec = Recorder(self)
        storage.atomic_write(self.path, b'{"new": true}')
        files, renames, dirs = rec.index("fsync", "file"), rec.index("rename"), rec.index("fsync", "dir")
        self.assertEqual(len(renames), 1, rec.ops)
        self.assertTrue(files and files[-1] < renames[0], f"data not fsynced before the rename: {rec.ops}")
        self.assertNotEqual(rec.ops[files[-1]][2], self.path, "fsynced the target, not the new file")
        self.assertTrue(dirs and dirs[0] > renames[0], f"directory not fsynced after the rename: {rec.ops}")
        self.assertEqual(rec.ops[dirs[0]][2], self.dir)
        with open(self.path, "rb") as f:
            self.assertEqual(f.read(), b'{"new": true}')

    def test_at_variant_ordering(self) -> None:
        """safefs.atomic_write_at (model store, images): same order."""
        rec = Recorder(self)
        fd = safefs.open_dir(self.dir)
        try:
            safefs.atomic_write_at(fd, "state.json", b"x" * 100_000)
        finally:
            os.close(fd)
        files, renames, dirs = rec.index("fsync", "file"), rec.index("rename"), rec.index("fsync", "dir")
        self.assertTrue(files and renames and dirs, rec.ops)
        self.assertLess(files[-1], renames[0])
        self.assertGreater(dirs[0], renames[0])

    def test_crash_before_rename_keeps_the_old_file(self) -> None:
        """The rename fails (power cut before it): the old content is intact and no temporary file is left."""
        rec = Recorder(self)
        rec.fail_on["rename"] = OSError(errno.EIO, "simulated crash")
        self.assertRaises(OSError, storage.atomic_write, self.path, b'{"new": true, "torn": ' + b"x" * 10000)
        with open(self.path, "rb") as f:
            self.assertEqual(f.read(), b'{"old": true}')
        self.assertEqual(sorted(os.listdir(self.dir)), ["state.json"])

    def test_failed_fsync_never_renames(self) -> None:
        """fsync of the data fails (EIO, disk full on flush): no rename, the old file stays."""
        rec = Recorder(self)
        rec.fail_on["fsync-file"] = OSError(errno.EIO, "simulated I/O error")
        self.assertRaises(OSError, storage.atomic_write, self.path, b'{"new": true}')
        self.assertEqual(rec.index("rename"), [])
        with open(self.path, "rb") as f:
            self.assertEqual(f.read(), b'{"old": true}')
        self.assertEqual(sorted(os.listdir(self.dir)), ["state.json"])

    def test_disk_full_mid_write_keeps_the_old_file(self) -> None:
        """ENOSPC from write(): the old file is intact, the temporary file removed."""
        real_write = os.write

        def write(fd: int, data: Any) -> int:
            if _fd_path(fd).startswith(self.dir + "/."):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(fd, data)

        self.patch(os, "write", write)
        self.assertRaises(OSError, storage.atomic_write, self.path, b'{"new": true}')
        with open(self.path, "rb") as f:
            self.assertEqual(f.read(), b'{"old": true}')
        self.assertEqual(sorted(os.listdir(self.dir)), ["state.json"])


class JournalAppendTests(SynchronousTestCase):
    def journal(self) -> CommandJournal:
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        j = CommandJournal(SynchronousRunner(), os.path.join(d, "commands.jsonl"), lambda: 1000.0)
        self.successResultOf(j.load())
        return j

    def test_record_fsynced_before_add_fires(self) -> None:
        """The journal line is on disk and fsynced when add() fires (the ack waits for it)."""
        j = self.journal()
        seen_at_fsync: list[bytes] = []
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            if _fd_path(fd) == j.path:
                with open(j.path, "rb") as f:
                    seen_at_fsync.append(f.read())
            real_fsync(fd)

        self.patch(os, "fsync", fsync)
        d = j.add(JournalRecord(id="cmd-1", command_type="noop", received_at=1000.0))
        self.successResultOf(d)
        self.assertTrue(any(b'"cmd-1"' in data for data in seen_at_fsync), "journal append not fsynced")

    def test_failed_fsync_fails_the_add(self) -> None:
        """fsync of the journal fails: add() fails, so the command is never acked, and is forgotten."""
        j = self.journal()
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            if _fd_path(fd) == j.path:
                raise OSError(errno.EIO, "simulated I/O error")
            real_fsync(fd)

        self.patch(os, "fsync", fsync)
        f = self.failureResultOf(j.add(JournalRecord(id="cmd-2", command_type="noop", received_at=1000.0)))
        f.trap(OSError)
        self.assertIsNone(j.get("cmd-2"))
        self.assertEqual(len(self.flushLoggedErrors(OSError)), 1)


class JournalFirstStartTests(SynchronousTestCase):
    """No journal yet: the load writes nothing (issue 27); the first record makes the file and
    its name durable."""

    def test_nothing_written_until_the_first_record(self) -> None:
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        path = os.path.join(d, "commands.jsonl")
        synced: list[str] = []
        real = storage.fsync_dir
        self.patch(storage, "fsync_dir", lambda directory: (synced.append(directory), real(directory)))
        j = CommandJournal(SynchronousRunner(), path, lambda: 1000.0)
        self.successResultOf(j.load())
        self.assertEqual((os.listdir(d), j.compactions, synced), ([], 0, []))
        self.successResultOf(j.add(JournalRecord(id="cmd-1", command_type="noop", received_at=1000.0)))
        self.assertEqual((os.listdir(d), synced), (["commands.jsonl"], [d]))
        again = CommandJournal(SynchronousRunner(), path, lambda: 1000.0)
        self.successResultOf(again.load())
        self.assertIsNotNone(again.get("cmd-1"))
        self.assertEqual(again.compactions, 1)  # a file with something in it is compacted


    def test_a_link_there_is_replaced_at_load(self) -> None:
        """A link at the journal's path (dangling, or to an empty file) is replaced by the
        load's rewrite, as before: commands are recorded after it."""
        for target in ("nowhere", "empty"):
            d = os.path.abspath(self.mktemp())
            os.makedirs(d)
            if target == "empty":
                open(os.path.join(d, "empty"), "wb").close()
            path = os.path.join(d, "commands.jsonl")
            os.symlink(os.path.join(d, target), path)
            j = CommandJournal(SynchronousRunner(), path, lambda: 1000.0)
            self.successResultOf(j.load())
            self.assertFalse(os.path.islink(path), target)
            self.successResultOf(j.add(JournalRecord(id="cmd-1", command_type="noop", received_at=1000.0)))

    def test_a_directory_that_cannot_be_synced_is_no_error(self) -> None:
        """A file system that cannot fsync a directory (EINVAL) does not fail the first record."""
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "Invalid argument")
            real_fsync(fd)

        self.patch(os, "fsync", fsync)
        j = CommandJournal(SynchronousRunner(), os.path.join(d, "commands.jsonl"), lambda: 1000.0)
        self.successResultOf(j.load())
        self.successResultOf(j.add(JournalRecord(id="cmd-1", command_type="noop", received_at=1000.0)))
        self.assertIsNotNone(j.get("cmd-1"))


class PipelinePruningTests(SynchronousTestCase):
    """Journal pruning run by the real pipeline with small caps (the defaults never prune in tests)."""

    def test_unconfirmed_results_survive_pruning(self) -> None:
        from tests.test_pipeline import Harness, command

        h = Harness(self)
        j = h.journal
        j.max_records, j.max_bytes, j.max_age = 10, 4000, 60.0
        h.session.auto_confirm = False  # results sent, delivery not confirmed: they must stay
        pending = [command("noop") for _ in range(15)]
        h.deliver(*pending)
        h.clock.advance(3600)  # old, by the age bound too
        h.session.confirm_all()
        h.session.auto_confirm = True
        h.session.confirm_all()
        h.session.auto_confirm = False
        unconfirmed = [command("noop") for _ in range(12)]
        h.deliver(*unconfirmed)
        h.session.auto_confirm = True
        for _ in range(4):
            h.deliver(*[command("noop") for _ in range(10)])
            h.clock.advance(120)
        for c in unconfirmed:
            rec = j.get(c["id"])
            self.assertIsNotNone(rec, "an undelivered result was pruned")
            assert rec is not None
            self.assertEqual(rec.state, "finished")
            self.assertIsNotNone(rec.result_frame)
        # Delivered ones went: the journal holds the unconfirmed ones and few others.
        self.assertLessEqual(len(j.records), len(unconfirmed) + j.max_records)
        self.assertEqual(sum(1 for c in pending if j.get(c["id"]) is not None), 0)
        # Reloaded from the file (after compaction), the unconfirmed ones are still there.
        self.successResultOf(j._compact())
        again = CommandJournal(SynchronousRunner(), j.path, h.clock.seconds, max_records=10)
        self.successResultOf(again.load())
        self.assertEqual({r.id for r in again.undelivered()}, {c["id"] for c in unconfirmed})
        # Delivery confirmed at last: now they may go too.
        h.session.confirm_all()
        h.deliver(*[command("noop") for _ in range(10)])
        self.assertLessEqual(len(j.records), j.max_records)
