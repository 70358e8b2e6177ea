"""Heartbeat timing and inventory reports, with a Clock."""

from __future__ import annotations

from typing import Any

from attrs import frozen
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.demo.testing import FakeSession
from llmport_agent.session.reporting import HeartbeatReporter, InventoryReporter


@frozen
class Report:
    inventory: dict[str, Any]
    utilization: dict[str, Any]


class FakeCollector:
    def __init__(self) -> None:
        self.pending: list[Deferred[Report]] = []
        self.immediate = True

    async def collect(self) -> Report:
        if self.immediate:
            return Report({"gpu_count": 0}, {"cpu_percent": 1.0})
        d: Deferred[Report] = Deferred()
        self.pending.append(d)
        return await d


class HeartbeatTests(SynchronousTestCase):
    def test_right_after_connect_then_every_interval(self) -> None:
        """A heartbeat goes out at connect and every interval after; none while disconnected."""
        clock = Clock()
        session = FakeSession()
        hb = HeartbeatReporter(clock, session, 15, lambda: {"status": "healthy", "version": "1", "capabilities": {}, "advertise_host": "h"})
        hb.session_opened()
        self.assertEqual(len(session.of_type("heartbeat")), 1)
        self.assertEqual(session.of_type("heartbeat")[0]["status"], "healthy")
        clock.advance(14.9)
        self.assertEqual(len(session.of_type("heartbeat")), 1)
        clock.advance(0.1)
        self.assertEqual(len(session.of_type("heartbeat")), 2)
        clock.pump([15] * 4)
        self.assertEqual(len(session.of_type("heartbeat")), 6)
        hb.session_closed()
        clock.advance(60)
        self.assertEqual(len(session.of_type("heartbeat")), 6)
        hb.session_opened()
        self.assertEqual(len(session.of_type("heartbeat")), 7)
        hb.stopService()

    def test_build_failure_does_not_stop_loop(self) -> None:
        """A failure building one heartbeat is logged; the next one still goes out."""
        clock = Clock()
        session = FakeSession()
        calls = [0]

        def build() -> dict[str, Any]:
            calls[0] += 1
            if calls[0] == 2:
                raise ValueError("bad")
            return {"status": "healthy"}

        hb = HeartbeatReporter(clock, session, 15, build)
        hb.session_opened()
        clock.advance(15)
        clock.advance(15)
        self.assertEqual(len(session.of_type("heartbeat")), 2)
        self.assertEqual(len(self.flushLoggedErrors(ValueError)), 1)
        hb.stopService()


class HeartbeatOnChangeTests(SynchronousTestCase):
    """notify_changed(): a heartbeat as soon as a field changes, at most one per min_change_gap."""

    def setup(self) -> tuple[Clock, FakeSession, HeartbeatReporter, dict[str, Any]]:
        clock = Clock()
        session = FakeSession()
        fields: dict[str, Any] = {"status": "healthy", "version": "1", "capabilities": {}, "advertise_host": "h"}
        hb = HeartbeatReporter(clock, session, 15, lambda: dict(fields), min_change_gap=1.0)
        hb.startService()
        self.addCleanup(hb.stopService)
        return clock, session, hb, fields

    def statuses(self, session: FakeSession) -> list[str]:
        return [f["status"] for f in session.of_type("heartbeat")]

    def test_change_goes_out_at_once(self) -> None:
        """A changed status leaves at once (not 15 s later); an unchanged one sends nothing."""
        clock, session, hb, fields = self.setup()
        hb.session_opened()
        clock.advance(5)
        hb.notify_changed()
        self.assertEqual(self.statuses(session), ["healthy"])
        fields["status"] = "degraded"
        hb.notify_changed()
        self.assertEqual(self.statuses(session), ["healthy", "degraded"])
        self.assertEqual(hb.sent_on_change, 1)

    def test_burst_becomes_one_frame_with_the_last_state(self) -> None:
        """Changes within the gap are coalesced into one heartbeat at its end, with the newest fields."""
        clock, session, hb, fields = self.setup()
        hb.session_opened()  # a heartbeat now: the next change waits for the gap
        for status in ("degraded", "healthy", "maintenance"):
            fields["status"] = status
            hb.notify_changed()
            clock.advance(0.2)
        self.assertEqual(self.statuses(session), ["healthy"])
        clock.advance(0.4)
        self.assertEqual(self.statuses(session), ["healthy", "maintenance"])
        clock.advance(10)
        self.assertEqual(self.statuses(session), ["healthy", "maintenance"])

    def test_change_back_within_the_gap_sends_nothing(self) -> None:
        """A flap that is over before the gap ends changes nothing the backend saw: no frame."""
        clock, session, hb, fields = self.setup()
        hb.session_opened()
        fields["status"] = "degraded"
        hb.notify_changed()
        fields["status"] = "healthy"
        clock.advance(1.0)
        self.assertEqual(self.statuses(session), ["healthy"])

    def test_capabilities_change_counts(self) -> None:
        """Any heartbeat field counts, not only the status (e.g. docker_available)."""
        clock, session, hb, fields = self.setup()
        hb.session_opened()
        clock.advance(2)
        fields["capabilities"] = {"docker_available": True}
        hb.notify_changed()
        self.assertEqual(session.of_type("heartbeat")[-1]["capabilities"], {"docker_available": True})

    def test_not_connected(self) -> None:
        """Disconnected: nothing is sent or scheduled; the heartbeat at connect carries the state."""
        clock, session, hb, fields = self.setup()
        fields["status"] = "degraded"
        hb.notify_changed()
        self.assertEqual(clock.getDelayedCalls(), [])
        hb.session_opened()
        fields["status"] = "healthy"
        hb.notify_changed()  # within the gap: scheduled
        session.connected = False
        hb.session_closed()
        self.assertEqual(clock.getDelayedCalls(), [])
        self.assertEqual(self.statuses(session), ["degraded"])


class InventoryTests(SynchronousTestCase):
    def test_at_connect_and_interval(self) -> None:
        """An inventory frame goes out at connect and every interval."""
        clock = Clock()
        session = FakeSession()
        rep = InventoryReporter(clock, session, 60, FakeCollector())
        rep.session_opened()
        self.assertEqual(len(session.of_type("inventory")), 1)
        clock.advance(60)
        self.assertEqual(len(session.of_type("inventory")), 2)
        frame = session.of_type("inventory")[0]
        self.assertEqual(frame["inventory"], {"gpu_count": 0})
        rep.stopService()

    def test_report_now_waits_for_send(self) -> None:
        """report_now fires True only after the frame was sent."""
        clock = Clock()
        session = FakeSession()
        collector = FakeCollector()
        collector.immediate = False
        rep = InventoryReporter(clock, session, 60, collector)
        d = rep.report_now()
        self.assertNoResult(d)
        collector.pending[0].callback(Report({}, {}))
        self.assertTrue(self.successResultOf(d))
        self.assertEqual(len(session.of_type("inventory")), 1)

    def test_refresh_joining_a_hung_round_waits_the_timeout_at_most(self) -> None:
        """
        A refresh_inventory that joins a hung round waits INVENTORY_TIMEOUT from the round's
        start at most (not until the loop's next tick, up to the inventory interval later);
        one that comes after the timeout abandons it at once.
        """
        from llmport_agent.session.reporting import INVENTORY_TIMEOUT

        clock = Clock()
        session = FakeSession()
        collector = FakeCollector()
        collector.immediate = False
        rep = InventoryReporter(clock, session, 600, collector)
        rep.session_opened()  # the loop's round at 0, hung
        clock.advance(5)
        d = rep.report_now()  # joins it
        self.assertNoResult(d)
        clock.advance(INVENTORY_TIMEOUT - 5)  # the round's timeout: abandoned, collected again
        self.assertEqual(rep.abandoned, 1)
        self.assertEqual(len(collector.pending), 2)
        collector.pending[1].callback(Report({}, {}))
        self.assertTrue(self.successResultOf(d))
        self.assertEqual(len(session.of_type("inventory")), 1)
        self.assertEqual(clock.getDelayedCalls()[0].getTime(), 600)  # only the loop's timer left
        # A hung round again (a refresh's), and a refresh after its timeout: abandoned at once.
        d2 = rep.report_now()
        self.assertEqual(len(collector.pending), 3)
        clock.advance(INVENTORY_TIMEOUT + 1)
        self.assertEqual(rep.abandoned, 1)  # nobody waits on it: the loop's tick will judge it
        d3 = rep.report_now()
        self.assertEqual(rep.abandoned, 2)
        self.assertEqual(len(collector.pending), 4)
        collector.pending[3].callback(Report({}, {}))
        self.assertTrue(self.successResultOf(d3))
        self.assertFalse(self.successResultOf(d2))
        rep.stopService()

    def test_hung_collection_times_out(self) -> None:
        """A collection that never finishes is abandoned after its timeout; the loop goes on."""
        clock = Clock()
        session = FakeSession()
        collector = FakeCollector()
        collector.immediate = False
        rep = InventoryReporter(clock, session, 60, collector)
        rep.session_opened()
        clock.advance(59)
        self.assertEqual((rep.last_error, rep.abandoned), ("", 0))
        clock.advance(1)  # the next tick abandons it (no timer of its own) and collects again
        self.assertEqual(rep.last_error, "the collection did not finish in 60 s")
        self.assertEqual(rep.abandoned, 1)
        self.assertEqual(len(collector.pending), 2)
        collector.immediate = True
        clock.advance(60)
        self.assertEqual(len(session.of_type("inventory")), 1)
        self.assertEqual(rep.abandoned, 2)
        rep.stopService()
