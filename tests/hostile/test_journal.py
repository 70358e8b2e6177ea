"""
The command journal under load a backend can produce: 10 000 commands in one frame, hundreds of
commands with 300 KB payloads. Its cost per command is O(1) amortised (the reactor stays
responsive), the file is bounded in bytes as well as records, and pruning never drops a record
whose result has not been delivered (its command would be stuck in the backend for ever).
"""

from __future__ import annotations

import os
import time
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmport_agent.commands.base import HandlerSpec
from llmport_agent.commands.journal import (
    DELIVERED,
    FINISHED,
    RECEIVED,
    RUNNING,
    CommandJournal,
    JournalRecord,
)
from llmport_agent.commands.node import PersistentModes
from llmport_agent.commands.pipeline import CommandPipeline
from llmport_agent.core.state import StateStore
from llmport_agent.core.threads import PoolService
from llmport_agent.demo.testing import FakeSession, SynchronousRunner
from llmport_agent.events.outbox import EventOutbox
from tests.support.probe import LatenessProbe
from tests.test_pipeline import Harness, command


def sleep(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


class TenThousandCommandsTests(TestCase):
    timeout = 300

    async def test_ten_thousand_commands_in_one_frame(self) -> None:
        """
        One commands frame with 10 000 commands, on the real reactor with the real I/O pool:
        each gets exactly one ack and one result, and the reactor is never blocked for long
        (today's journal walked every record on every add: 11 s of one stall).
        """
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        pool = PoolService(reactor, "io", 2)
        pool.startService()
        self.addCleanup(pool.stopService)
        session = FakeSession()
        journal = CommandJournal(pool, os.path.join(d, "commands.jsonl"), time.time)
        await journal.load()
        outbox = EventOutbox(reactor, pool, os.path.join(d, "events.jsonl"), session)
        await outbox.load()
        state = StateStore(pool, os.path.join(d, "state.json"))
        await state.load()

        async def noop(ctx: Any) -> dict[str, Any]:
            return {"ok": True}

        pipeline = CommandPipeline(
            reactor, session, journal, {"noop": HandlerSpec(noop, lane="read", idempotent=True, deadline=600)},
            PersistentModes(state), outbox, credential=lambda: "c",
        )
        pipeline.startService()
        self.addCleanup(pipeline.stopService)
        cs = [command("noop") for _ in range(10_000)]
        probe = LatenessProbe()
        probe.start()
        self.addCleanup(probe.stop)
        await sleep(0.05)
        pipeline.frame_received({"type": "commands", "items": cs})
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if pipeline.stats["succeeded"] >= len(cs) and journal.idle():
                break
            await sleep(0.1)
        probe.stop()
        per_id: dict[str, list[str]] = {}
        for f in session.frames:
            per_id.setdefault(f.get("command_id", ""), []).append(f["type"])
        for c in cs:
            kinds = per_id.get(c["id"], [])
            self.assertEqual((kinds.count("command_ack"), kinds.count("command_result")), (1, 1), kinds)
        worst = probe.worst
        # Generous (the machine is shared); a walk of every record per add stalls for seconds.
        self.assertLess(worst, 1.5, f"the reactor stalled {worst:.2f} s")


def finished_harness(case: SynchronousTestCase, n: int, payload_bytes: int) -> Harness:
    h = Harness(case)
    for i in range(n):
        h.deliver(command("noop", {"blob": "x" * payload_bytes, "i": i}))
    return h


class JournalBoundTests(SynchronousTestCase):
    def test_size_after_500_commands_of_300_kb(self) -> None:
        """
        500 commands with 300 KB payloads, all finished and delivered: the journal file holds
        their records, not 150 MB of payloads (today: the file kept every payload until a
        line count was reached that this never reaches).
        """
        h = finished_harness(self, 500, 300 * 1024)
        path = os.path.join(h.dir, "commands.jsonl")
        self.assertTrue(all(h.journal.get(c).state == DELIVERED for c in h.journal.records))
        size = os.path.getsize(path)
        self.assertLess(size, 10 * 1024 * 1024, f"{size} bytes")
        again = CommandJournal(SynchronousRunner(), path, h.clock.seconds)
        self.successResultOf(again.load())
        self.assertEqual(len(again.records), 500)
        self.assertLess(os.path.getsize(path), 1024 * 1024)

    def test_unfinished_payloads_are_kept(self) -> None:
        """Payloads of commands still running stay in the journal (a restart re-runs them)."""
        h = Harness(self)
        big = [command("gated", {"blob": "y" * (300 * 1024), "i": i}) for i in range(40)]
        h.deliver(*big)
        again = CommandJournal(SynchronousRunner(), os.path.join(h.dir, "commands.jsonl"), h.clock.seconds)
        self.successResultOf(again.load())
        for c in big:
            rec = again.get(c["id"])
            assert rec is not None and rec.command is not None
            self.assertEqual(rec.command["payload"]["blob"], "y" * (300 * 1024))

    def journal(self, **kw: Any) -> CommandJournal:
        d = self.mktemp()
        os.makedirs(d)
        self.now = [1_000_000.0]
        j = CommandJournal(SynchronousRunner(), os.path.join(d, "commands.jsonl"), lambda: self.now[0], **kw)
        self.successResultOf(j.load())
        return j

    def fill(self, j: CommandJournal, prefix: str, n: int, state: str, result: Any = None) -> list[str]:
        ids = []
        for i in range(n):
            cid = f"{prefix}-{i}"
            rec = JournalRecord(id=cid, command_type="noop", received_at=self.now[0], state=RECEIVED)
            self.successResultOf(j.add(rec))
            if state in (RUNNING, FINISHED, DELIVERED):
                self.successResultOf(j.update(cid, state=RUNNING))
            if state in (FINISHED, DELIVERED):
                frame = {"type": "command_result", "command_id": cid, "success": True,
                         "result": result if result is not None else {"ok": True}}
                self.successResultOf(j.update(cid, state=FINISHED, result_frame=frame, finished_at=self.now[0]))
            if state == DELIVERED:
                self.successResultOf(j.mark_delivered(cid))
            ids.append(cid)
        return ids

    def test_pruning_never_drops_undelivered_records(self) -> None:
        """
        Far beyond the record bound, the byte bound and the age bound: every record without a
        delivered result survives (in memory and after a reload); only delivered ones go.
        """
        j = self.journal(max_records=10, max_bytes=2000, max_age=60.0)
        keep = self.fill(j, "received", 30, RECEIVED) + self.fill(j, "running", 30, RUNNING)
        keep += self.fill(j, "finished", 30, FINISHED, {"logs": "z" * 3000})
        self.now[0] += 3600  # all of them are old now
        gone = self.fill(j, "delivered", 100, DELIVERED)
        self.fill(j, "more", 50, RECEIVED)
        for cid in keep:
            self.assertIsNotNone(j.get(cid), cid)
        self.assertLess(sum(1 for c in gone if j.get(c) is not None), 10)
        again = CommandJournal(SynchronousRunner(), j.path, lambda: self.now[0], max_records=10,
                               max_bytes=2000, max_age=60.0)
        self.successResultOf(again.load())
        for cid in keep:
            rec = again.get(cid)
            self.assertIsNotNone(rec, cid)
        self.assertEqual(len(again.undelivered()), 30)
        self.assertEqual(len(again.unfinished()), 110)

    def test_reload_with_large_unconfirmed_results_keeps_delivered_within_the_bound(self) -> None:
        """
        After a reload, only delivered records count towards the byte bound: finished but
        unconfirmed results (here 5 x 30 KB, far over the bound) must not push the few small
        delivered records out (a planted bug indexed them at replay and lost that bookkeeping).
        """
        j = self.journal(max_records=5000, max_bytes=16 * 1024)
        delivered = self.fill(j, "delivered", 10, DELIVERED)
        self.now[0] += 1
        self.fill(j, "finished", 5, FINISHED, {"logs": "z" * 30_000})
        for cid in delivered:
            self.assertIsNotNone(j.get(cid), cid)
        again = CommandJournal(SynchronousRunner(), j.path, lambda: self.now[0], max_records=5000,
                               max_bytes=16 * 1024)
        self.successResultOf(again.load())
        for cid in delivered:
            self.assertIsNotNone(again.get(cid), f"{cid} pruned after the reload")
        self.assertEqual(again.delivered_bytes, j.delivered_bytes)
        self.assertEqual(len(again.undelivered()), 5)

    def test_reopened_record_is_not_pruned(self) -> None:
        """A delivered record the backend lists again is finished (undelivered) again: it stays."""
        j = self.journal(max_records=5)
        [cid] = self.fill(j, "a", 1, DELIVERED)
        self.successResultOf(j.update(cid, state=FINISHED))
        self.fill(j, "b", 20, DELIVERED)
        self.assertIsNotNone(j.get(cid))

    def test_byte_bound_on_delivered_records(self) -> None:
        """Delivered records with 3 KB results are kept up to max_bytes, not max_records."""
        j = self.journal(max_records=5000, max_bytes=64 * 1024)
        self.fill(j, "d", 200, DELIVERED, {"text": "r" * 3000})
        self.assertLessEqual(j.delivered_bytes, 64 * 1024)
        self.assertLess(len(j.records), 30)
        self.assertGreater(len(j.records), 5)

    def test_age_bound(self) -> None:
        j = self.journal(max_age=60.0)
        old = self.fill(j, "old", 5, DELIVERED)
        self.now[0] += 120
        self.fill(j, "new", 1, DELIVERED)
        self.assertTrue(all(j.get(c) is None for c in old))

    def test_compaction_by_bytes(self) -> None:
        """Appends of big records make the file compact itself, whatever the line count."""
        j = self.journal()
        ids = self.fill(j, "big", 30, DELIVERED, {"logs": "L" * (400 * 1024)})
        self.assertGreaterEqual(j.compactions, 2)
        self.assertLess(os.path.getsize(j.path), 4 * 1024 * 1024 + 2 * 1024 * 1024)
        self.assertEqual(len(j.records), len(ids))


class IntakeTests(SynchronousTestCase):
    """How a big frame is taken in: in slices, in order, with a bound on what is in the works."""

    def test_big_frame_taken_in_over_several_turns(self) -> None:
        from llmport_agent.commands.pipeline import INTAKE_BATCH

        h = Harness(self)
        cs = [command("noop") for _ in range(1000)]
        h.pipeline.frame_received({"type": "commands", "items": cs})
        self.assertEqual(len(h.calls), INTAKE_BATCH)
        h.drain()
        self.assertEqual([c for _, c in h.calls], [c["id"] for c in cs])

    def test_admission_bound(self) -> None:
        """Commands that cannot finish yet hold at most MAX_ADMITTED places; the rest wait unacked."""
        from llmport_agent.commands.pipeline import MAX_ADMITTED

        h = Harness(self)
        cs = [command("gated", {"runtime_id": f"r{i}"}) for i in range(MAX_ADMITTED + 100)]
        h.deliver(*cs)

        def acked() -> set[str]:
            return {f["command_id"] for f in h.session.frames if f["type"] == "command_ack"}

        self.assertEqual(len(acked()), MAX_ADMITTED)
        self.assertNotIn(cs[-1]["id"], acked())

        def finish(n: int) -> None:
            for _ in range(n):
                d = next(d for d in h.gates.values() if not d.called)
                d.callback({"ok": True})
                h.drain()

        finish(50)
        self.assertEqual(len(acked()), MAX_ADMITTED + 50)
        finish(len(cs) - 50)
        results = {f["command_id"] for f in h.session.frames if f["type"] == "command_result"}
        self.assertEqual(results, {c["id"] for c in cs})

    def test_one_pong_confirms_in_slices(self) -> None:
        """Thousands of deliveries confirmed by one pong are reported a slice per reactor turn."""
        from twisted.internet.task import Clock

        from llmport_agent.session.protocol import CONFIRM_SLICE, fire_in_slices

        clock = Clock()
        waiters: list[Deferred[None]] = [Deferred() for _ in range(3 * CONFIRM_SLICE + 5)]
        fire_in_slices(clock, waiters)
        self.assertEqual(sum(d.called for d in waiters), CONFIRM_SLICE)
        for _ in range(3):
            clock.advance(0)
        self.assertTrue(all(d.called for d in waiters))
