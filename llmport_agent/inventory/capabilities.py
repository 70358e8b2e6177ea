# -*- test-case-name: tests.test_inventory -*-
"""
Static capabilities (protocol 5.1): sent at enrollment, in every heartbeat, and as the
inventory's C{static_capabilities}.

    {hostname, os, machine, processor, docker_available, gpu_count,
     gpu_vendor (nvidia|amd|apple|none), container_runtime} + extras

L{static_host_facts} blocks (the OS release is read from C{/etc/os-release}; off Linux,
C{platform.processor()} may run C{uname -p}): call it in a worker thread. L{quick_host_facts} is the cheap
stand-in usable on the reactor thread before the first real reading.
L{build_capabilities} is pure.
"""

from __future__ import annotations

import platform
import socket
import sys
from collections.abc import Mapping
from typing import Any

from llmport_agent import VERSION
from llmport_agent.inventory.gpu import GPUSnapshot

__all__ = [
    "GPU_VENDORS",
    "build_capabilities",
    "quick_host_facts",
    "static_host_facts",
]

#: The values the backend's UI understands for C{gpu_vendor}.
GPU_VENDORS = frozenset({"nvidia", "amd", "apple", "none"})


def _safe(fn: Any, default: str = "") -> str:
    try:
        value = fn()
    except Exception:
        return default
    return value.strip() if isinstance(value, str) else default


def quick_host_facts() -> dict[str, str]:
    """
    Host identity from cheap system calls only (C{uname}, C{gethostname}); safe on the
    reactor thread. C{processor} is the machine type here.
    """
    machine = _safe(platform.machine)
    return {
        "hostname": _safe(socket.gethostname),
        "os": _safe(platform.system),
        "machine": machine,
        "processor": machine or "unknown",
        "kernel": _safe(platform.release),
        "python": _safe(platform.python_version),
        "agent_version": VERSION,
    }


def static_host_facts(system: str = sys.platform) -> dict[str, str]:
    """
    Host identity that does not change while the agent runs. Blocks (reads
    C{/etc/os-release}; off Linux, may spawn C{uname -p}); call it in a worker thread.

    On Linux the processor is the machine type: C{platform.processor()} would start
    C{uname -p} at every start, which prints the machine type (Red Hat's coreutils) or
    "unknown" (Debian's, Ubuntu's) on most distributions; a few patch it to print the CPU's
    model name, which this fact then no longer carries.

    @param system: C{sys.platform} (another in tests).
    """
    facts = quick_host_facts()
    processor = "" if system.startswith("linux") else _safe(platform.processor)
    if processor.lower() == "unknown":
        processor = ""
    # Empty on Linux and where the platform does not know: the machine type instead.
    facts["processor"] = processor or facts["machine"] or "unknown"

    def pretty_name() -> str:
        release = platform.freedesktop_os_release()
        return str(release.get("PRETTY_NAME") or release.get("NAME") or "")

    facts["os_release"] = _safe(pretty_name)
    return facts


def _vendor(snapshot: GPUSnapshot) -> str:
    return snapshot.vendor if snapshot.vendor in GPU_VENDORS else "none"


def build_capabilities(
    host: Mapping[str, Any],
    gpu: GPUSnapshot,
    engine: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """
    The static capabilities object: host identity, GPU summary and container engine facts.

    @param host: from L{static_host_facts} (or L{quick_host_facts}).
    @param gpu: the latest GPU snapshot.
    @param engine: the container engine's facts (C{docker_available}, C{container_runtime},
        extras); C{None} when unknown. Keys with C{None} values are left out.
    """
    caps: dict[str, Any] = {}
    for key, value in host.items():
        if value is not None:
            caps[str(key)] = value
    for key in ("hostname", "os", "machine"):
        caps[key] = str(caps.get(key) or "")
    caps["processor"] = str(caps.get("processor") or caps["machine"] or "unknown")

    engine = engine or {}
    for key, value in engine.items():
        if value is not None and key not in ("gpu_count", "gpu_vendor"):
            caps[str(key)] = value
    caps["docker_available"] = bool(engine.get("docker_available", False))
    runtime = engine.get("container_runtime")
    caps["container_runtime"] = str(runtime) if runtime else "none"

    caps["gpu_count"] = gpu.count  # schedulable GPUs: unhealthy ones are left out
    caps["gpu_vendor"] = _vendor(gpu)
    caps["gpu_device_count"] = gpu.device_count
    caps["gpu_health"] = gpu.by_state()
    caps["gpu_models"] = sorted({d.name for d in gpu.devices if d.name})
    caps["gpu_total_vram_bytes"] = gpu.total_vram_bytes
    caps["gpu_driver_version"] = gpu.driver_version
    caps["cuda_driver_version"] = gpu.cuda_driver_version
    if gpu.gpu_error:
        caps["gpu_error"] = gpu.gpu_error
    return caps
