"""
JSON integers have no bound: C{1} followed by 400 zeros decodes to a Python int that C{float()}
refuses with C{OverflowError} (not a C{ValueError}). In a backend's payload it must be answered
as the invalid number it is (not an internal error with a traceback), and in a container's
output it is no number.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.base import INVALID_COMMAND, CommandFailed
from llmport_agent.ray import describe, fabric, helpercli, seeding
from llmport_agent.ray.handlers import _opt_int
from llmport_agent.workloads.policy import PolicyError, parse_cpus

HUGE = 10**400


class BackendPayloadTests(SynchronousTestCase):
    def test_fabric_probe_numbers(self) -> None:
        d = Deferred.fromCoroutine(fabric.connect(Clock(), {"target_ip": "127.0.0.1", "target_port": HUGE}))
        answer = self.successResultOf(d)
        self.assertFalse(answer["reachable"])
        self.assertIn("port number", answer["error"])
        self.assertRaises(fabric.ProbeInputError, fabric._seconds, {"timeout_sec": HUGE}, "timeout_sec", 5, 60, 1)

    def test_ray_and_seeding_numbers(self) -> None:
        e = self.assertRaises(CommandFailed, _opt_int, {"num_gpus": HUGE}, "num_gpus")
        self.assertEqual(e.error_code, INVALID_COMMAND)
        self.assertEqual(seeding._number({"timeout_sec": HUGE}, "timeout_sec", 1, 1, 60), 60.0)

    def test_workload_cpus(self) -> None:
        self.assertRaises(PolicyError, parse_cpus, HUGE)


class ContainerOutputTests(SynchronousTestCase):
    def test_helper_and_inspection_numbers(self) -> None:
        self.assertEqual(helpercli._float(HUGE), 0.0)
        self.assertEqual(describe._flt(HUGE), 0.0)
