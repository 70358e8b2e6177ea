"""
bench/bench_soak.py can't rot: its slope fit is right, and a 20 s run (agent process, stand-in
backend, Loki stand-in, the Docker engine where it can be had) takes samples, resolves every
command it issues, ships logs and prints a verdict per metric.
"""

from __future__ import annotations

import os
import re
import sys

from twisted.internet import reactor
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import SynchronousTestCase, TestCase

from bench.bench_soak import fit, verdict
from tests.support.docker_env import REQUIRE_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FitTests(SynchronousTestCase):
    def test_slope_of_a_line_with_noise(self) -> None:
        """A known slope comes back, with a small error for small noise and none for none."""
        points = [(t / 10, 80.0 + 3.0 * t / 10 + (0.01 if t % 2 else -0.01)) for t in range(50)]
        slope, err = fit(points)
        self.assertAlmostEqual(slope, 3.0, places=2)
        self.assertLess(err, 0.05)
        self.assertEqual(fit([(float(t), 7.0) for t in range(10)]), (0.0, 0.0))

    def test_too_few_points(self) -> None:
        self.assertEqual(fit([(0.0, 1.0)])[0], 0.0)

    def test_verdict(self) -> None:
        self.assertEqual(verdict(0.5, 1.0), "FLAT")
        self.assertEqual(verdict(-0.5, 1.0), "FLAT")
        self.assertEqual(verdict(1.5, 1.0), "GROWING")
        self.assertEqual(verdict(-1.5, 1.0), "FALLING")


class SmokeRunTests(TestCase):
    timeout = 90

    async def test_short_run(self) -> None:
        """
        --minutes 0.3, a command a second: samples taken, every command resolved (none failed
        but the host_op refusals), Loki got the agent's lines (and the workload's with the
        engine), no protocol anomaly, a verdict line per metric, the agent stopped cleanly.
        """
        docker = "yes" if os.environ.get(REQUIRE_ENV) == "1" else "auto"
        out, err, code = await getProcessOutputAndValue(
            sys.executable,
            [os.path.join(ROOT, "bench", "bench_soak.py"), "--minutes", "0.3", "--interval", "1",
             "--sample-sec", "1", "--docker-every", "2", "--docker", docker],
            env=dict(os.environ, PYTHONPATH=ROOT), path=ROOT, reactor=reactor,
        )
        text = out.decode("utf-8", "replace") + err.decode("utf-8", "replace")
        self.assertEqual(code, 0, text[-3000:])
        samples = re.search(r"^samples: (\d+) in [\d.]+ min; (\d+) fitted", text, re.M)
        assert samples is not None, text
        self.assertGreaterEqual(int(samples.group(1)), 10, text)
        self.assertGreaterEqual(int(samples.group(2)), 5, text)
        for metric in ("RSS", "open fds", "threads"):
            self.assertRegex(text, rf"verdict: {metric} (FLAT|GROWING|FALLING) \(threshold", text)
        cmds = re.search(r"^commands issued (\d+), resolved (\d+) .* (\d+) unexpected\)", text, re.M)
        assert cmds is not None, text
        self.assertGreaterEqual(int(cmds.group(1)), 5, text)
        self.assertEqual(cmds.group(1), cmds.group(2), text)
        self.assertEqual(cmds.group(3), "0", text)
        self.assertRegex(text, r"Loki lines received: \d+ \(.*node-agent [1-9]", text)
        self.assertIn("protocol anomalies at the backend: 0\n", text)
        self.assertIn("agent exit status after SIGTERM: 0", text)
        if "Docker engine: yes" in text:
            self.assertRegex(text, r"Loki lines received: .*node-container [1-9]", text)
            self.assertRegex(text, r"workload runtimes deployed [1-9]", text)
        else:
            self.assertNotEqual(docker, "yes", text)
