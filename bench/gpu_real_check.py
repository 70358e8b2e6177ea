"""
On a machine with an NVIDIA GPU: run the NVML source and its event loop on the real driver
for a few seconds and print the inventory and health (the prepared device check of issue 13).

Usage: python3 bench/gpu_real_check.py [--seconds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmport_agent.inventory.nvml import NVMLGPUSource  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    source = NVMLGPUSource(call_timeout=10.0)
    start = time.perf_counter()
    snap = source.snapshot()
    took = (time.perf_counter() - start) * 1000
    d = snap.to_dict()
    print(f"snapshot in {took:.1f} ms: {d['device_count']} GPU(s), {d['count']} schedulable, gpu_error={d['gpu_error']!r}")
    for dev in d["devices"]:
        print(json.dumps({k: dev[k] for k in (
            "index", "uuid", "name", "pci_bus_id", "memory_total_mib", "memory_used_mib", "utilization_pct",
            "temperature_c", "power_draw_w", "ecc_mode", "ecc_errors", "retired_pages", "remapped_rows",
            "recovery_action", "throttle_reasons", "pcie", "health", "health_reasons", "error")}))
    start = time.perf_counter()
    source.check_health()
    print(f"health check in {(time.perf_counter() - start) * 1000:.1f} ms")
    deadline = time.monotonic() + args.seconds
    waits = events = 0
    while time.monotonic() < deadline:
        batch = source.wait_events(timeout_ms=1000)
        waits += 1
        events += batch.count
        if batch.state != "ok":
            print(f"events: {batch.state}")
            break
    print(f"event loop: {waits} waits, {events} events; events state {source.events_state}")
    for index, h in sorted(source.health().items()):
        print(f"GPU {index}: {h.state} {list(h.reasons)} xids={dict(h.xid_counts)}")
    source.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
