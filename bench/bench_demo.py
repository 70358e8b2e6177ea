"""
Time from `llmport-agent demo` start (process launch) to the first inventory at the stand-in
backend, and the demo's total run time, over repeated runs. Target: first inventory <= 5 s.
Usage: python3 bench/bench_demo.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, summary  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    first, total = [], []
    for _ in range(args.repeat):
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "llmport_agent.cli", "demo"], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, PYTHONPATH=ROOT))
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("[backend] inventory:") and len(first) < len(total) + 1:
                first.append(time.monotonic() - start)
        rc = proc.wait()
        total.append(time.monotonic() - start)
        if rc != 0:
            print(f"demo exited {rc}")
    print(f"demo start -> first inventory at the backend: {summary(first, ' s')}")
    print(f"whole demo (exit 0, target < 30 s):          {summary(total, ' s')}")


if __name__ == "__main__":
    main()
