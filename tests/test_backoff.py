"""Reconnect backoff: bounds, jitter after the cap, reset after a stable session, refusals counted."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.core.backoff import Backoff, FailureCounter, retry_policy


class BackoffTests(SynchronousTestCase):
    def test_bounds(self) -> None:
        """Every delay lies within [min, max], for any failure count and jitter."""
        for r in (0.0, 0.5, 0.999999):
            b = Backoff(2, 30, lambda r=r: r)
            for n in range(0, 100):
                self.assertTrue(2 <= b.delay(n) <= 30)

    def test_exponential_ceiling(self) -> None:
        """The ceiling doubles per failure and stops at the maximum."""
        b = Backoff(2, 30, lambda: 1.0)
        self.assertEqual([b.delay(n) for n in range(6)], [2, 4, 8, 16, 30, 30])

    def test_full_jitter_after_cap(self) -> None:
        """At the cap the jitter still spans the whole range down to the minimum."""
        b = Backoff(2, 30, lambda: 0.0)
        self.assertEqual(b.delay(50), 2)
        b = Backoff(2, 30, lambda: 0.5)
        self.assertEqual(b.delay(50), 16)

    def test_refused_upgrades_escalate(self) -> None:
        """Refused upgrades count as failures although TCP connected (ClientService says attempt 1)."""
        counter = FailureCounter(stable_after=30)
        policy = retry_policy(Backoff(2, 30, lambda: 1.0), counter)
        delays = []
        for _ in range(5):
            counter.opened_for(None)
            delays.append(policy(1))
        self.assertEqual(delays, [4, 8, 16, 30, 30])

    def test_reset_after_stable_session(self) -> None:
        """A session that stayed open resets the count; a short one does not."""
        counter = FailureCounter(stable_after=30)
        for _ in range(4):
            counter.opened_for(None)
        counter.opened_for(5)
        self.assertEqual(counter.failures, 5)
        counter.opened_for(31)
        self.assertEqual(counter.failures, 0)


class DefaultJitterTests(SynchronousTestCase):
    """
    The log readers build their backoff without a random source: the class default must be a
    real one (a planted constant survived: every backoff test injects its own), or a fleet of
    agents whose journald or engine restarted would retry in lockstep.
    """

    def assertSpread(self, backoff: Backoff) -> None:  # noqa: N802
        delays = {backoff.delay(20) for _ in range(50)}
        self.assertGreater(len(delays), 25, sorted(delays)[:5])
        self.assertTrue(all(backoff.low <= d <= backoff.high for d in delays))

    def test_the_class_default_draws_at_random(self) -> None:
        self.assertSpread(Backoff(1.0, 60.0))

    def test_the_log_readers_defaults(self) -> None:
        from twisted.internet.task import Clock

        from llmport_agent.demo.testing import SynchronousRunner
        from llmport_agent.logs.containers import ContainerLogSource
        from llmport_agent.logs.journald import JournaldSource
        from tests.support.logs import RecordingSink

        journald = JournaldSource(Clock(), RecordingSink(), lambda: {}, SynchronousRunner(),
                                  state_dir=self.mktemp())
        self.assertSpread(journald._backoff)
        containers = ContainerLogSource(Clock(), object(), RecordingSink(), lambda: "h",  # type: ignore[arg-type]
                                        agent_id="a", runner=SynchronousRunner(), stream_pool=object(),
                                        client_factory=lambda: None)
        self.assertSpread(containers._backoff)
