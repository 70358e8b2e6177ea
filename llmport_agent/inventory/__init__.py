"""
What the agent reports about the node (protocol section 5): static capabilities, the
inventory and utilisation objects, and GPUs through NVML.

 - L{gpu}: L{IGPUSource}, L{NoGPUSource} and the snapshot values;
 - L{nvml}: L{NVMLGPUSource}, GPUs through the driver's library;
 - L{host}: psutil readings (blocking);
 - L{capabilities}: the static capabilities object;
 - L{collector}: L{InventoryCollector}, which puts them together off the reactor thread;
 - L{fakes}: a faithful fake C{pynvml} for nodes (and tests) without GPUs.
"""

from __future__ import annotations

from llmport_agent.inventory.collector import (
    InventoryCollector,
    InventoryReport,
    assert_no_nulls,
    find_nulls,
    scrub_nulls,
)
from llmport_agent.inventory.gpu import (
    GPUDevice,
    GPUSnapshot,
    IGPUSource,
    NoGPUSource,
)

__all__ = [
    "GPUDevice",
    "GPUSnapshot",
    "IGPUSource",
    "InventoryCollector",
    "InventoryReport",
    "NoGPUSource",
    "assert_no_nulls",
    "find_nulls",
    "scrub_nulls",
]
