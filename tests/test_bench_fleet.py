"""
Smoke run of the fleet benchmark (bench/bench_fleet.py) at a tiny size, so that it cannot rot:
20 agents in 2 worker processes, a 3 s backend outage, every phase run once. Nothing about its
figures is asserted but that every node came back after the outage (the script's exit status).
"""

from __future__ import annotations

import os
import sys

from twisted.internet import reactor
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import TestCase

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = [
    "--agents", "20", "--workers", "2", "--window", "3", "--gaps", "0.5,1", "--rounds", "1",
    "--idle-interval", "3", "--idle-minutes", "0.1", "--idle-spread", "1", "--settle", "0.5",
    "--outage", "3", "--pickup-nodes", "3", "--reconnect-max", "3", "--model-samples", "5",
]


class FleetBenchSmokeTests(TestCase):
    timeout = 90

    async def test_smoke(self) -> None:
        """The fleet bench runs end to end at 20 agents and prints each figure."""
        out, err, code = await getProcessOutputAndValue(
            sys.executable, [os.path.join(ROOT, "bench", "bench_fleet.py"), *SMOKE],
            env=dict(os.environ, PYTHONPATH=ROOT), path=ROOT, reactor=reactor,
        )
        text = out.decode("utf-8", "replace")
        self.assertEqual(code, 0, text + err.decode("utf-8", "replace")[-3000:])
        for needle in ("idle cost per node", "before (idle interval", "after  (idle interval",
                       "after the previous command", "idle node", "virtual clock", "streams back", "(20/20)",
                       "connection attempts"):
            self.assertIn(needle, text)
