"""The shared teardown of integration tests: protocol anomalies at the stand-in backend fail the test."""

from __future__ import annotations

from twisted.internet import reactor
from twisted.trial.reporter import TestResult
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.devbackend import DevBackend
from tests.agentharness import AnomalyGuard


class _Inner(AnomalyGuard, SynchronousTestCase):
    allow: tuple[str, str] | None = None
    note = "second command_result for 1234"

    def scenario(self) -> None:
        backend = self.watch_backend(DevBackend(reactor))
        if self.allow:
            self.allow_anomalies(*self.allow)
        backend.state.note("node-1", self.note)


class AnomalyGuardTests(SynchronousTestCase):
    def run_inner(self, **attrs: object) -> TestResult:
        case = type("Inner", (_Inner,), attrs)("scenario")
        result = TestResult()
        case.run(result)
        return result

    def test_anomaly_fails_the_test(self) -> None:
        result = self.run_inner()
        self.assertEqual(len(result.errors) + len(result.failures), 1)
        problem = (result.errors + result.failures)[0][1]
        self.assertIn("second command_result for 1234", str(problem.value))

    def test_allowed_anomaly_passes(self) -> None:
        result = self.run_inner(allow=(r"^second command_result ", "expected by this test"))
        self.assertTrue(result.wasSuccessful(), result.errors + result.failures)

    def test_allowance_is_specific(self) -> None:
        result = self.run_inner(allow=(r"^command_ack after", "another anomaly"))
        self.assertFalse(result.wasSuccessful())

    def test_allowance_needs_a_reason(self) -> None:
        guard = _Inner("scenario")
        self.assertRaises(ValueError, guard.allow_anomalies, ".*", "")
