"""
The Loki spool on its own (append, read back, acknowledge, reopen, torn and damaged records, the
bound, permissions, symbolic links, full disk and failing fsync) and the shipper with a spool:
an outage spools and counts lines as done, Loki's return replays them in order, a restart in the
middle of an outage loses nothing, a full spool pauses the readers and loses nothing either.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

from treq.testing import StubTreq
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.demo.testing import SynchronousRunner
from llmport_agent.logs.encoding import label_key
from llmport_agent.logs.loki import LokiShipper
from llmport_agent.logs.spool import HEADER_BYTES, SPOOL_DIR, Spool, SpoolRecord
from llmport_agent.logs.testing import FakeLoki
from tests.support.logs import LABELS

KEY = label_key(LABELS)


def segments(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".seg"))


class SpoolTests(SynchronousTestCase):
    """L{Spool} with a synchronous runner on a real directory."""

    def open(self, max_bytes: int = 1 << 20, segment_bytes: int | None = None, path: str | None = None) -> Spool:
        self.path = path or os.path.join(os.path.abspath(self.mktemp()), SPOOL_DIR)
        spool = Spool(SynchronousRunner(), self.path, max_bytes, segment_bytes)
        self.successResultOf(spool.open())
        self.addCleanup(lambda: self.successResultOf(spool.close()))
        return spool

    def reopen(self, spool: Spool, **kw: Any) -> Spool:
        self.successResultOf(spool.settled())
        self.successResultOf(spool.close())
        return self.open(path=self.path, max_bytes=spool.max_bytes, **kw)

    def test_append_read_ack_reopen(self) -> None:
        """Records read back as written, in order; accepted ones are gone after a reopen."""
        spool = self.open()
        self.assertEqual(self.successResultOf(spool.append([(b"one", 1), (b"two", 2), (b"three", 3)])), 3)
        self.assertEqual([self.successResultOf(spool.read(r)) for r in spool.records],
                         [b"one", b"two", b"three"])
        self.assertEqual(spool.lines, 6)
        spool.drop_head()
        again = self.reopen(spool)
        self.assertEqual([self.successResultOf(again.read(r)) for r in again.records], [b"two", b"three"])
        self.assertEqual((again.replayed_records, again.replayed_lines), (2, 5))

    def test_private_files_in_a_private_directory(self) -> None:
        """The directory is 0700 (tightened if it was not), segments and the ack file 0600."""
        base = os.path.abspath(self.mktemp())
        os.makedirs(os.path.join(base, SPOOL_DIR), mode=0o755)
        os.chmod(os.path.join(base, SPOOL_DIR), 0o755)
        spool = self.open(path=os.path.join(base, SPOOL_DIR))
        self.successResultOf(spool.append([(b"x", 1), (b"y", 1)]))
        spool.drop_head()
        self.successResultOf(spool.settled())
        self.assertEqual(stat.S_IMODE(os.stat(self.path).st_mode), 0o700)
        for name in os.listdir(self.path):
            self.assertEqual(stat.S_IMODE(os.stat(os.path.join(self.path, name)).st_mode), 0o600, name)

    def test_a_symlinked_directory_is_refused(self) -> None:
        """A spool path that is a symbolic link is not followed: the spool is unavailable."""
        base = os.path.abspath(self.mktemp())
        target = os.path.join(base, "elsewhere")
        os.makedirs(target)
        os.symlink(target, os.path.join(base, SPOOL_DIR))
        spool = Spool(SynchronousRunner(), os.path.join(base, SPOOL_DIR), 1 << 20)
        self.successResultOf(spool.open())
        self.assertFalse(spool.available)
        self.assertIn("symbolic link", spool.error or "")
        self.assertEqual(self.successResultOf(spool.append([(b"x", 1)])), 0)
        self.assertEqual(os.listdir(target), [])
        self.flushLoggedErrors()

    def test_a_symlinked_segment_is_not_followed(self) -> None:
        """A segment name that is a symbolic link is neither read nor written through."""
        spool = self.open()
        outside = os.path.abspath(self.mktemp())
        with open(outside, "wb") as f:
            f.write(b"precious")
        os.symlink(outside, os.path.join(self.path, "00000000000000000001.seg"))
        with self.assertRaises(OSError):
            spool._files.append([(b"x", 1)], 1, 0)
        with open(outside, "rb") as f:
            self.assertEqual(f.read(), b"precious")
        again = self.reopen(spool)
        self.assertEqual(list(again.records), [])

    def test_bound_refuses_what_does_not_fit(self) -> None:
        """An append takes the prefix that fits the bound; the rest is refused, nothing cut."""
        spool = self.open(max_bytes=3 * (HEADER_BYTES + 100))
        body = b"b" * 100
        self.assertEqual(self.successResultOf(spool.append([(body, 1)] * 5)), 3)
        self.assertFalse(spool.fits(100))
        self.assertEqual(self.successResultOf(spool.append([(body, 1)])), 0)
        self.assertLessEqual(spool.bytes_used, spool.max_bytes)
        for _ in range(3):
            spool.drop_head()
        self.successResultOf(spool.settled())
        self.assertEqual((spool.bytes_used, segments(self.path)), (0, []))
        self.assertTrue(spool.fits(100))

    def test_segments_roll_over_and_are_deleted_once_accepted(self) -> None:
        """Appends go to a new segment past the segment size; a segment is deleted once read out."""
        spool = self.open(max_bytes=1 << 20, segment_bytes=2 * (HEADER_BYTES + 100))
        for i in range(5):
            self.successResultOf(spool.append([(bytes([65 + i]) * 100, 1)]))
        self.assertEqual(len(segments(self.path)), 3)
        for _ in range(2):
            spool.drop_head()
        self.successResultOf(spool.settled())
        self.assertEqual(len(segments(self.path)), 2)
        again = self.reopen(spool, segment_bytes=2 * (HEADER_BYTES + 100))
        self.assertEqual([self.successResultOf(again.read(r))[:1] for r in again.records], [b"C", b"D", b"E"])
        self.successResultOf(again.append([(b"F" * 100, 1)]))
        self.assertEqual([self.successResultOf(again.read(r))[:1] for r in again.records],
                         [b"C", b"D", b"E", b"F"])

    def test_a_torn_last_record_is_cut_off(self) -> None:
        """A crash in the middle of an append leaves a partial record: it is cut at the next open."""
        spool = self.open()
        self.successResultOf(spool.append([(b"whole", 1)]))
        name = os.path.join(self.path, segments(self.path)[-1])
        with open(name, "ab") as f:
            f.write(b"LKS1\x00\x00")
        again = self.reopen(spool)
        self.assertEqual([self.successResultOf(again.read(r)) for r in again.records], [b"whole"])
        self.assertEqual(os.path.getsize(name), HEADER_BYTES + 5)
        self.successResultOf(again.append([(b"next", 1)]))
        self.assertEqual([self.successResultOf(again.read(r)) for r in again.records], [b"whole", b"next"])

    def test_damaged_records_are_skipped_and_counted(self) -> None:
        """A record failing its checksum is skipped (counted); a damaged header ends its segment."""
        spool = self.open(segment_bytes=3 * (HEADER_BYTES + 10))
        for i in range(4):
            self.successResultOf(spool.append([(bytes([48 + i]) * 10, 1)]))
        first = os.path.join(self.path, segments(self.path)[0])
        with open(first, "r+b") as f:
            f.seek(HEADER_BYTES + 10 + HEADER_BYTES + 3)
            f.write(b"!")
        again = self.reopen(spool, segment_bytes=3 * (HEADER_BYTES + 10))
        self.assertEqual([self.successResultOf(again.read(r)) for r in again.records],
                         [b"0" * 10, b"2" * 10, b"3" * 10])
        self.assertEqual((again.corrupt_records, again.corrupt_lines), (1, 1))
        # A damaged header: what follows in that segment cannot be found.
        first = os.path.join(self.path, segments(self.path)[0])
        with open(first, "r+b") as f:
            f.seek(1)
            f.write(b"?")
        third = self.reopen(again, segment_bytes=3 * (HEADER_BYTES + 10))
        self.assertEqual([self.successResultOf(third.read(r)) for r in third.records], [b"3" * 10])
        self.flushLoggedErrors()

    def test_full_disk_and_failing_fsync_keep_records_out(self) -> None:
        """ENOSPC or a failing fsync: the append reports 0, nothing half-written stays."""
        spool = self.open()
        self.successResultOf(spool.append([(b"kept", 1)]))
        for target, err in (("llmport_agent.logs.spool.os.write", errno.ENOSPC),
                            ("llmport_agent.logs.spool.os.fsync", errno.EIO)):
            with mock.patch(target, side_effect=OSError(err, os.strerror(err))):
                self.assertEqual(self.successResultOf(spool.append([(b"lost", 1)])), 0)
        self.assertEqual(spool.write_errors, 2)
        self.assertEqual([self.successResultOf(spool.read(r)) for r in spool.records], [b"kept"])
        again = self.reopen(spool)
        self.assertEqual([self.successResultOf(again.read(r)) for r in again.records], [b"kept"])
        self.flushLoggedErrors()

    def test_appends_are_fsynced_before_they_count(self) -> None:
        """Every append fsyncs its segment (and the directory for a new one) before returning."""
        spool = self.open()
        calls: list[int] = []
        real = os.fsync

        def spy(fd: int) -> None:
            calls.append(fd)
            real(fd)

        with mock.patch("llmport_agent.logs.spool.os.fsync", side_effect=spy):
            self.successResultOf(spool.append([(b"a", 1), (b"b", 1)]))
        self.assertEqual(len(calls), 2)  # the new segment and the directory
        with mock.patch("llmport_agent.logs.spool.os.fsync", side_effect=spy):
            self.successResultOf(spool.append([(b"c", 1)]))
        self.assertEqual(len(calls), 3)

    def test_record_reads_are_checked(self) -> None:
        """A record that changed on disk after it was written fails its read."""
        from llmport_agent.logs.spool import SpoolCorrupt

        spool = self.open()
        self.successResultOf(spool.append([(b"payload", 1)]))
        record: SpoolRecord = spool.records[0]
        with open(os.path.join(self.path, segments(self.path)[0]), "r+b") as f:
            f.seek(HEADER_BYTES)
            f.write(b"X")
        self.failureResultOf(spool.read(record), SpoolCorrupt)


class ShipperWithSpoolTests(SynchronousTestCase):
    """L{LokiShipper} with a real L{Spool} (synchronous runner), StubTreq and a Clock."""

    def setUp(self) -> None:
        self.base = os.path.abspath(self.mktemp())
        os.makedirs(self.base)
        self.loki = FakeLoki(check_labels=True, reject_out_of_order=True)
        self.stub = StubTreq(self.loki)
        self.clock = Clock()

    @contextmanager
    def running(self, max_bytes: int = 1 << 20, **kw: Any) -> Iterator[LokiShipper]:
        runner = SynchronousRunner()
        spool = Spool(runner, os.path.join(self.base, SPOOL_DIR), max_bytes)
        kw.setdefault("batch_size", 10)
        kw.setdefault("batch_bytes", 4096)
        shipper = LokiShipper(self.clock, self.stub, "http://loki.test", flush_interval=5, spool=spool,
                              runner=runner, jitter=lambda: 1.0, stop_timeout=3, **kw)
        shipper.startService()
        try:
            yield shipper
        finally:
            d = shipper.stopService()
            self.stub.flush()
            self.clock.advance(5)
            self.successResultOf(d)

    def push(self, shipper: LokiShipper, start: int, count: int) -> None:
        shipper.push_many([(KEY, 1_000_000 + i, f"line {i:05d}") for i in range(start, start + count)])
        self.clock.advance(1)

    def expected(self, count: int) -> list[str]:
        return [f"line {i:05d}" for i in range(count)]

    def spool_files(self) -> list[str]:
        return segments(os.path.join(self.base, SPOOL_DIR))

    def test_an_outage_spools_and_loki_returning_replays_in_order(self) -> None:
        """While Loki fails, batches go to disk and count as done; afterwards all arrive in order."""
        with self.running() as shipper:
            self.push(shipper, 0, 20)
            self.loki.outage(503)
            self.push(shipper, 20, 200)
            stats = shipper.stats()
            self.assertEqual(stats["spool_lines"], 200)
            self.assertEqual(stats["memory_bytes"], 0)
            self.assertEqual(shipper.delivered_through(), 220)  # spooled = done for the readers
            self.assertTrue(self.spool_files())
            self.loki.recover()
            self.clock.pump([1] * 70)
            self.assertEqual(self.loki.lines(), self.expected(220))
            self.assertEqual(shipper.stats()["spool_lines"], 0)
        self.assertEqual(self.spool_files(), [])
        self.assertEqual((self.loki.violations, self.loki.duplicates), ([], 0))

    def test_a_restart_during_the_outage_loses_nothing(self) -> None:
        """Lines spooled before a restart go first after it, then the new run's, all once."""
        self.loki.outage(500)
        with self.running() as shipper:
            self.push(shipper, 0, 150)
            self.assertEqual(shipper.stats()["spool_lines"], 150)
        with self.running() as shipper:
            self.assertEqual(shipper.stats()["spool_lines"], 150)
            self.push(shipper, 150, 50)
            self.loki.recover()
            self.clock.pump([1] * 70)
            self.assertEqual(self.loki.lines(), self.expected(200))
        self.assertEqual((self.loki.violations, self.loki.duplicates), ([], 0))

    def test_a_stop_while_loki_hangs_spools_the_rest(self) -> None:
        """A stalled Loki at stop: after stop_timeout the pending lines are spooled, not lost."""
        self.loki.stall()
        with self.running() as shipper:
            self.push(shipper, 0, 30)
        self.assertTrue(self.spool_files())
        self.assertEqual(self.loki.lines(), [])
        self.loki.drop_held()
        self.loki.recover()
        self.stub.flush()
        with self.running() as shipper:
            self.clock.pump([1] * 10)
            lines = self.loki.lines()
        self.assertEqual(lines, self.expected(30))
        self.assertEqual(shipper.stats()["dropped"], 0)

    def test_a_full_spool_pauses_readers_and_loses_nothing(self) -> None:
        """With the spool full, memory fills, pressure pauses readers; Loki's return drains all."""
        with self.running(max_bytes=4 * 2048, batch_bytes=2048, memory_bytes=16 * 1024) as shipper:
            self.loki.outage(503)
            pushed = 0
            while shipper.pressure() < 0.8 and pushed < 5000:
                self.push(shipper, pushed, 10)  # a reader pushes only while there is room
                pushed += 10
            self.assertGreaterEqual(shipper.pressure(), 0.8)
            stats = shipper.stats()
            self.assertLessEqual(stats["spool_bytes"], 4 * 2048)
            self.assertGreater(stats["spool_lines"], 0)
            self.assertLess(shipper.delivered_through(), pushed)  # the readers' positions stand
            room = shipper.when_room()
            self.assertNoResult(room)
            self.clock.pump([1] * 30)
            self.assertNoResult(room)
            self.loki.recover()
            self.clock.pump([1] * 90)
            self.successResultOf(room)
            self.assertEqual(self.loki.lines(), self.expected(pushed))
            stats = shipper.stats()
            self.assertEqual((stats["dropped"], stats["spool_lines"], stats["sent"]), (0, 0, pushed))
            self.assertEqual(shipper.delivered_through(), pushed)

    def test_a_damaged_record_is_dropped_and_counted(self) -> None:
        """A spooled record damaged on disk is counted as spool_corrupt; the others go."""
        self.loki.outage(500)
        with self.running(batch_size=10) as shipper:
            for start in (0, 10, 20):
                self.push(shipper, start, 10)
        name = os.path.join(self.base, SPOOL_DIR, self.spool_files()[0])
        with open(name, "r+b") as f:
            f.seek(HEADER_BYTES + 12)
            f.write(b"\xff\xff\xff")
        self.loki.recover()
        with self.running() as shipper:
            self.clock.pump([1] * 10)
            stats = shipper.stats()
        self.assertEqual(self.loki.lines(), [f"line {i:05d}" for i in range(10, 30)])
        self.assertEqual(stats["dropped_by_reason"]["spool_corrupt"], 10)
        self.flushLoggedErrors()

    def test_memory_batches_spool_when_loki_is_slower_than_the_input(self) -> None:
        """With Loki answering but slowly, closed batches beyond spool_after go to disk."""
        with self.running(batch_size=10, batch_bytes=1024, spool_after=2048) as shipper:
            self.loki.hold_next(1)
            self.push(shipper, 0, 400)
            self.assertGreater(shipper.stats()["spool_lines"], 0)
            # While a spooled record is in flight, the rest goes to disk behind it.
            self.assertLessEqual(shipper.stats()["memory_bytes"], 2048)
            self.loki.release()
            self.stub.flush()
            self.clock.pump([1] * 20)
            self.assertEqual(self.loki.lines(), self.expected(400))
            self.assertEqual(shipper.stats()["spool_lines"], 0)
