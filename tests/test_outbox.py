"""Event outbox: durable, bounded, batched by 100, re-sent after a lost batch, flushed within a second."""

from __future__ import annotations

import os

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.demo.testing import FakeSession, SynchronousRunner
from llmport_agent.events.outbox import EventOutbox, make_event


class OutboxTests(SynchronousTestCase):
    def make(self, directory: str | None = None, capacity: int = 10000, connected: bool = True) -> EventOutbox:
        self.dir = directory or self.mktemp()
        os.makedirs(self.dir, exist_ok=True)
        self.clock = Clock()
        self.session = FakeSession(connected=connected)
        box = EventOutbox(self.clock, SynchronousRunner(), os.path.join(self.dir, "events.jsonl"),
                          self.session, capacity=capacity)
        self.successResultOf(box.load())
        box.startService()
        self.addCleanup(box.stopService)
        return box

    def test_flushes_within_a_second(self) -> None:
        """An event emitted while connected is sent within about a second."""
        box = self.make()
        box.emit("workload.started", {"runtime_id": "r"})
        self.assertEqual(self.session.frames, [])
        self.clock.advance(1)
        batch = self.session.of_type("event_batch")[0]
        self.assertEqual(batch["events"][0]["event_type"], "workload.started")
        self.assertEqual(box.depth, 0)

    def test_batches_of_100(self) -> None:
        """At most 100 events per frame."""
        box = self.make(connected=False)
        for i in range(250):
            box.emit("e", {"i": i})
        self.session.connected = True
        box.session_opened()
        self.clock.advance(1)
        sizes = [len(f["events"]) for f in self.session.of_type("event_batch")]
        self.assertEqual(sizes, [100, 100, 50])

    def test_survives_restart(self) -> None:
        """Events not yet delivered are on disk and sent after a restart."""
        box = self.make(connected=False)
        box.emit("a", {"n": 1})
        box.emit("b", {"n": 2})
        box2 = self.make(directory=self.dir)
        self.assertEqual(box2.depth, 2)
        box2.flush()
        self.assertEqual([e["event_type"] for e in self.session.of_type("event_batch")[0]["events"]], ["a", "b"])
        box3 = self.make(directory=self.dir)
        self.assertEqual(box3.depth, 0)

    def test_a_first_start_writes_nothing_until_an_event(self) -> None:
        """No file and nothing to keep: the load writes nothing (issue 27); the first event
        makes the file, and a restart finds it."""
        box = self.make(connected=False)
        path = os.path.join(self.dir, "events.jsonl")
        self.assertFalse(os.path.exists(path))
        box.emit("a", {"n": 1})
        self.assertTrue(os.path.exists(path))
        self.assertEqual(self.make(directory=self.dir).depth, 1)

    def test_a_file_with_something_in_it_is_still_compacted_at_load(self) -> None:
        """The load rewrites a file that holds something (a new file replaces it)."""
        box = self.make(connected=False)
        box.emit("a", {"n": 1})
        path = os.path.join(self.dir, "events.jsonl")
        inode = os.stat(path).st_ino
        self.assertEqual(self.make(directory=self.dir).depth, 1)
        self.assertNotEqual(os.stat(path).st_ino, inode)

    def test_a_link_there_is_replaced_at_load(self) -> None:
        """A link at the outbox's path (dangling, or to an empty file) is not read as "nothing
        there": the load replaces it with the file, and the events are kept."""
        for target in ("nowhere", "empty"):
            d = os.path.abspath(self.mktemp())
            os.makedirs(d)
            if target == "empty":
                open(os.path.join(d, "empty"), "wb").close()
            os.symlink(os.path.join(d, target), os.path.join(d, "events.jsonl"))
            box = self.make(directory=d, connected=False)
            self.assertFalse(os.path.islink(os.path.join(d, "events.jsonl")))
            box.emit("a", {"n": 1})
            self.assertEqual(self.make(directory=d).depth, 1, target)

    def test_numbers_go_on_past_a_file_compacted_to_its_ack(self) -> None:
        """An outbox whose events were all acknowledged is compacted down to its ack line; new
        events after the next start are numbered past it, so a restart keeps them."""
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        with open(os.path.join(d, "events.jsonl"), "w") as f:
            f.write('{"ack":2,"dropped":0}\n')
        box = self.make(directory=d, connected=False)
        box.emit("c", {"n": 3})
        self.assertEqual(self.make(directory=d).depth, 1)

    def test_lost_batch_resent(self) -> None:
        """A batch whose delivery was not confirmed is sent again after reconnect."""
        box = self.make()
        self.session.auto_confirm = False
        box.emit("x", {})
        box.flush()
        self.session.disconnect()
        self.assertEqual(box.depth, 1)
        self.session.connected = True
        self.session.auto_confirm = True
        box.session_opened()
        self.assertEqual(len(self.session.of_type("event_batch")), 2)
        self.assertEqual(box.depth, 0)

    def test_bounded_drops_counted(self) -> None:
        """Beyond the cap the oldest are dropped and every drop is counted."""
        box = self.make(capacity=10, connected=False)
        for i in range(25):
            box.emit("e", {"i": i})
        self.assertEqual(box.depth, 10)
        self.assertEqual(box.dropped, 15)
        box2 = self.make(directory=self.dir, capacity=10)
        self.assertEqual(box2.dropped, 15)

    def test_field_limits(self) -> None:
        """event_type and correlation_id are cut to the backend's column sizes; severity is valid."""
        e = make_event("t" * 300, {}, "fatal", "c" * 300)
        self.assertEqual(len(e["event_type"]), 128)
        self.assertEqual(len(e["correlation_id"]), 128)
        self.assertEqual(e["severity"], "info")
        self.assertTrue(e["ts"].endswith("Z"))
