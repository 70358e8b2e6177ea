# -*- test-case-name: tests.test_gpu_sources -*-
"""
Which GPU source a node uses (C{GPU_SOURCE}): C{nvidia} (NVML), C{amd} (AMD SMI or
C{rocm-smi}), C{apple} (C{system_profiler} on macOS), C{none}, or C{auto}.

C{auto} picks, without blocking the caller for long: NVML when C{libnvidia-ml} loads
(or the platform is neither macOS nor has AMD tools), the AMD source when the C{amdsmi}
library or C{rocm-smi} is found (and no NVIDIA library is), the Apple source on macOS.
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import sys
from collections.abc import Callable, Iterable
from typing import Any

from llmport_agent.inventory.gpu import GPUSource, NoGPUSource

__all__ = ["choose_vendor", "make_gpu_source"]


def _has_nvml() -> bool:
    """
    Whether NVIDIA's driver library loads, the way the NVML bindings load it (C{dlopen} of
    C{libnvidia-ml.so.1}). Not C{ctypes.util.find_library}: that runs C{ldconfig}, C{gcc} and
    C{ld} with temporary files, which the unit's read-only sandbox refuses.
    """
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def _has_amd() -> bool:
    return importlib.util.find_spec("amdsmi") is not None or shutil.which("rocm-smi") is not None


def choose_vendor(
    setting: str,
    *,
    platform: str = sys.platform,
    has_nvml: Callable[[], bool] = _has_nvml,
    has_amd: Callable[[], bool] = _has_amd,
) -> str:
    """The source C{setting} (C{auto} or a vendor) means on this host."""
    if setting != "auto":
        return setting
    if platform == "darwin":
        return "apple"
    if has_nvml():
        return "nvidia"
    if has_amd():
        return "amd"
    # Neither found: NVML still, so a driver installed later is picked up (with backoff)
    # and the snapshot says clearly that no NVIDIA driver is there.
    return "nvidia"


def make_gpu_source(
    setting: str = "auto",
    *,
    call_timeout: float = 10.0,
    ignored_xids: Iterable[int] = (),
    **choose: Any,
) -> GPUSource:
    """The GPU source for C{setting} (see L{choose_vendor})."""
    vendor = choose_vendor(setting, **choose)
    if vendor == "nvidia":
        from llmport_agent.inventory.nvml import NVMLGPUSource

        return NVMLGPUSource(call_timeout=call_timeout, ignored_xids=ignored_xids)
    if vendor == "amd":
        from llmport_agent.inventory.amd import AMDGPUSource

        return AMDGPUSource(call_timeout=call_timeout)
    if vendor == "apple":
        from llmport_agent.inventory.apple import AppleGPUSource

        return AppleGPUSource(call_timeout=call_timeout)
    return NoGPUSource("GPU reporting is off (GPU_SOURCE=none)")
