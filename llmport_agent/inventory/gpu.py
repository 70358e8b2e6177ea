# -*- test-case-name: tests.test_gpu -*-
"""
GPU facts (protocol section 5.2, the GPU snapshot): the values, the L{IGPUSource} interface
the sources implement (NVML in L{llmport_agent.inventory.nvml}, AMD in
L{llmport_agent.inventory.amd}, Apple in L{llmport_agent.inventory.apple}), and helpers.

An L{IGPUSource} produces a L{GPUSnapshot}: a frozen value that turns into the exact
dictionary the backend reads (C{count}, C{total_vram_bytes}, C{used_vram_bytes},
C{free_vram_bytes}, C{devices[]}) plus extras (health, MIG, ECC, processes, power, versions).

Rules kept here:

 - B{Never null.} Every field a device refuses becomes C{0}, C{""} or C{[]}, and a failing
   field never fails the whole snapshot. A null in the snapshot is a 500 in the backend.
 - B{Unhealthy GPUs are not offered.} C{count} and the VRAM totals the scheduler reads
   cover the GPUs that are not unhealthy (L{llmport_agent.inventory.health}); every GPU,
   unhealthy ones included, stays in C{devices} with its C{health} and reasons.
 - B{Blocking.} L{IGPUSource.snapshot}, L{IGPUSource.check_health} and L{IGPUSource.close}
   block (C libraries doing ioctls, command-line tools); call them in a worker thread.
   L{IGPUSource.health} is cheap and safe on the reactor thread.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

from attrs import evolve, field
from zope.interface import Attribute, Interface, implementer

from llmport_agent.core.values import frozen
from llmport_agent.inventory.health import (
    HEALTHY,
    UNHEALTHY,
    DeviceHealth,
    EccErrors,
    HealthTracker,
    PcieLink,
    RemappedRows,
    RetiredPages,
)

__all__ = [
    "GPUDevice",
    "GPUProcess",
    "GPUSnapshot",
    "GPUSource",
    "IGPUSource",
    "MigInstance",
    "NoGPUSource",
]

MIB = 1024 * 1024

#: NVML's "value not available" for unsigned ints (C{gpuInstanceId} outside MIG).
_UINT_NOT_AVAILABLE = 0xFFFFFFFF
_ULL_NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF

_MAX_ERROR_TEXT = 512


def _mib(n: int) -> int:
    return n // MIB


# --------------------------------------------------------------------------- values


@frozen
class MigInstance:
    """One MIG device (a GPU instance / compute instance pair) of a MIG-enabled GPU."""

    gpu_instance_id: int
    compute_instance_id: int
    uuid: str = ""
    name: str = ""
    memory_total_bytes: int = 0
    memory_used_bytes: int = 0
    memory_free_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu_instance_id": self.gpu_instance_id,
            "compute_instance_id": self.compute_instance_id,
            "uuid": self.uuid,
            "name": self.name,
            "memory_total_mib": _mib(self.memory_total_bytes),
            "memory_used_mib": _mib(self.memory_used_bytes),
            "memory_free_mib": _mib(self.memory_free_bytes),
            "memory_total_bytes": self.memory_total_bytes,
            "memory_used_bytes": self.memory_used_bytes,
            "memory_free_bytes": self.memory_free_bytes,
        }


@frozen
class GPUProcess:
    """
    A process using a GPU.

    @ivar kind: C{"compute"}, C{"graphics"} or C{"compute,graphics"}.
    @ivar gpu_instance_id: the MIG GPU instance, C{-1} outside MIG.
    @ivar compute_instance_id: the MIG compute instance, C{-1} outside MIG.
    """

    pid: int
    used_memory_bytes: int = 0
    kind: str = "compute"
    gpu_instance_id: int = -1
    compute_instance_id: int = -1

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "used_memory_bytes": self.used_memory_bytes,
            "used_memory_mib": _mib(self.used_memory_bytes),
            "type": self.kind,
            "gpu_instance_id": self.gpu_instance_id,
            "compute_instance_id": self.compute_instance_id,
        }


@frozen
class GPUDevice:
    """
    One physical GPU. Unknown figures are C{0} / C{""} / C{()}, never C{None}.

    @ivar vendor: C{nvidia}, C{amd} or C{apple}.
    @ivar mig_mode_current: C{"enabled"}, C{"disabled"} or C{""} (MIG not supported).
    @ivar ecc_mode: C{"enabled"}, C{"disabled"} or C{""} (unknown).
    @ivar error: C{""}, or what the driver failed to report for this device and why.
    @ivar health: the verdict (C{healthy}, C{degraded}, C{unhealthy}), see L{DeviceHealth}.
    @ivar render_node: AMD: the C{/dev/dri/renderD*} node of this GPU (container devices).
    @ivar cores: Apple: GPU cores.
    """

    index: int
    vendor: str = "nvidia"
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = ""
    serial: str = ""
    driver_version: str = ""
    cuda_driver_version: str = ""
    memory_total_bytes: int = 0
    memory_used_bytes: int = 0
    memory_free_bytes: int = 0
    utilization_pct: int = 0
    memory_utilization_pct: int = 0
    temperature_c: int = 0
    power_draw_w: float = 0.0
    power_limit_w: float = 0.0
    mig_mode_current: str = ""
    mig_mode_pending: str = ""
    mig_instances: tuple[MigInstance, ...] = ()
    ecc_mode: str = ""
    ecc_errors: EccErrors = field(factory=EccErrors)
    retired_pages: RetiredPages = field(factory=RetiredPages)
    remapped_rows: RemappedRows = field(factory=RemappedRows)
    recovery_action: int = 0
    throttle_reasons: int = 0
    pcie: PcieLink = field(factory=PcieLink)
    processes: tuple[GPUProcess, ...] = ()
    render_node: str = ""
    cores: int = 0
    unified_memory: bool = False
    error: str = ""
    health: DeviceHealth | None = None

    @property
    def memory_total_mib(self) -> int:
        return _mib(self.memory_total_bytes)

    @property
    def memory_used_mib(self) -> int:
        return _mib(self.memory_used_bytes)

    @property
    def memory_free_mib(self) -> int:
        return _mib(self.memory_free_bytes)

    @property
    def state(self) -> str:
        """C{healthy}, C{degraded} or C{unhealthy}."""
        return self.health.state if self.health is not None else HEALTHY

    @property
    def schedulable(self) -> bool:
        """Whether the scheduler may place work on it (everything but unhealthy)."""
        return self.state != UNHEALTHY

    def describe(self) -> str:
        """C{GPU 3 (GPU-..., NVIDIA H100 80GB HBM3, 00000000:5D:00.0)} for messages."""
        parts = [p for p in (self.uuid, self.name, self.pci_bus_id) if p]
        return f"GPU {self.index}" + (f" ({', '.join(parts)})" if parts else "")

    def to_dict(self) -> dict[str, Any]:
        """The device object of protocol 5.2 (required keys first), plus extras."""
        health = self.health if self.health is not None else DeviceHealth(index=self.index)
        return {
            "index": self.index,
            "vendor": self.vendor,
            "name": self.name,
            "memory_total_mib": self.memory_total_mib,
            "memory_used_mib": self.memory_used_mib,
            "utilization_pct": self.utilization_pct,
            "temperature_c": self.temperature_c,
            "driver_version": self.driver_version,
            # extras
            "uuid": self.uuid,
            "pci_bus_id": self.pci_bus_id,
            "serial": self.serial,
            "cuda_driver_version": self.cuda_driver_version,
            "memory_free_mib": self.memory_free_mib,
            "memory_total_bytes": self.memory_total_bytes,
            "memory_used_bytes": self.memory_used_bytes,
            "memory_free_bytes": self.memory_free_bytes,
            "memory_utilization_pct": self.memory_utilization_pct,
            "power_draw_w": self.power_draw_w,
            "power_limit_w": self.power_limit_w,
            "mig_enabled": self.mig_mode_current == "enabled",
            "mig_mode": {"current": self.mig_mode_current, "pending": self.mig_mode_pending},
            "mig_instances": [m.to_dict() for m in self.mig_instances],
            "ecc_mode": self.ecc_mode,
            "ecc_errors": self.ecc_errors.to_dict(),
            "retired_pages": self.retired_pages.to_dict(),
            "remapped_rows": self.remapped_rows.to_dict(),
            "recovery_action": self.recovery_action,
            "throttle_reasons": self.throttle_reasons,
            "pcie": self.pcie.to_dict(),
            "processes": [p.to_dict() for p in self.processes],
            "render_node": self.render_node,
            "cores": self.cores,
            "unified_memory": self.unified_memory,
            "error": self.error,
            "health": health.state,
            "health_reasons": list(health.reasons),
            "schedulable": health.schedulable,
            "xid_errors": health.xid_total,
            "last_xid": health.last_xid,
            "xid_counts": {str(k): v for k, v in health.xid_counts},
            "unresponsive": health.unresponsive,
        }


@frozen
class GPUSnapshot:
    """
    What the node's GPUs look like now.

    C{count} and the VRAM totals cover the I{schedulable} devices (not unhealthy): that is
    what the backend's scheduler reads. C{devices} lists every device.

    @ivar vendor: the vendor of the devices found; when the source fails, the last vendor
        seen (or C{"none"}); C{"none"} without GPUs.
    @ivar gpu_error: C{""} when the source works; otherwise why GPU facts are missing.
    """

    vendor: str = "none"
    devices: tuple[GPUDevice, ...] = ()
    driver_version: str = ""
    cuda_driver_version: str = ""
    nvml_version: str = ""
    gpu_error: str = ""
    source: str = ""

    @property
    def schedulable(self) -> tuple[GPUDevice, ...]:
        return tuple(d for d in self.devices if d.schedulable)

    @property
    def count(self) -> int:
        """GPUs the scheduler may use (unhealthy ones left out)."""
        return len(self.schedulable)

    @property
    def device_count(self) -> int:
        """Every GPU found, unhealthy ones included."""
        return len(self.devices)

    @property
    def total_vram_bytes(self) -> int:
        return sum(d.memory_total_bytes for d in self.schedulable)

    @property
    def used_vram_bytes(self) -> int:
        return sum(d.memory_used_bytes for d in self.schedulable)

    @property
    def free_vram_bytes(self) -> int:
        return sum(d.memory_free_bytes for d in self.schedulable)

    def by_state(self) -> dict[str, int]:
        out = {"healthy": 0, "degraded": 0, "unhealthy": 0}
        for d in self.devices:
            out[d.state] = out.get(d.state, 0) + 1
        return out

    def with_health(self, health: Mapping[int, DeviceHealth]) -> GPUSnapshot:
        """This snapshot with the given verdicts applied (devices not named keep theirs)."""
        if not health or not self.devices:
            return self
        devices = tuple(
            evolve(d, health=health[d.index]) if d.index in health else d for d in self.devices
        )
        return evolve(self, devices=devices)

    def to_dict(self) -> dict[str, Any]:
        """The GPU snapshot object of protocol 5.2 plus top-level extras; never a null."""
        return {
            "count": self.count,
            "total_vram_bytes": self.total_vram_bytes,
            "used_vram_bytes": self.used_vram_bytes,
            "free_vram_bytes": self.free_vram_bytes,
            "devices": [d.to_dict() for d in self.devices],
            # extras
            "vendor": self.vendor,
            "source": self.source,
            "driver_version": self.driver_version,
            "cuda_driver_version": self.cuda_driver_version,
            "nvml_version": self.nvml_version,
            "mig_enabled_count": sum(1 for d in self.devices if d.mig_mode_current == "enabled"),
            "device_count": self.device_count,
            "unhealthy_count": sum(1 for d in self.devices if not d.schedulable),
            "health": self.by_state(),
            "all_total_vram_bytes": sum(d.memory_total_bytes for d in self.devices),
            "gpu_error": self.gpu_error,
        }


# ------------------------------------------------------------------------- interface


class IGPUSource(Interface):
    """
    A source of GPU facts. C{snapshot}, C{check_health} and C{close} block: call them in a
    worker thread. C{health} is cheap.
    """

    vendor = Attribute("The vendor this source reports on: nvidia, amd, apple or none.")
    tracker = Attribute("The HealthTracker holding this source's verdicts and transitions.")

    def snapshot() -> GPUSnapshot:  # type: ignore[misc, empty-body]
        """
        Take a snapshot of the GPUs, health included. Never raises: a failure gives a
        snapshot whose C{gpu_error} says why.
        """

    def check_health() -> None:  # type: ignore[misc, empty-body]
        """Read only what health needs (cheaper than a snapshot). Never raises."""

    def health() -> Mapping[int, DeviceHealth]:  # type: ignore[misc, empty-body]
        """The current verdict per device index (no call into the driver)."""

    def close() -> None:  # type: ignore[misc, empty-body]
        """Release the underlying library (e.g. C{nvmlShutdown}). Never raises."""


class GPUSource(Protocol):
    """The static-typing twin of L{IGPUSource} (mypy does not read zope interfaces)."""

    vendor: str
    tracker: HealthTracker

    def snapshot(self) -> GPUSnapshot: ...

    def check_health(self) -> None: ...

    def health(self) -> Mapping[int, DeviceHealth]: ...

    def close(self) -> None: ...


@implementer(IGPUSource)
class NoGPUSource:
    """A node without GPUs (or with GPU reporting turned off)."""

    vendor = "none"

    def __init__(self, reason: str = "") -> None:
        self._reason = reason
        self.tracker = HealthTracker()

    def snapshot(self) -> GPUSnapshot:
        return GPUSnapshot(vendor="none", gpu_error=self._reason)

    def check_health(self) -> None:
        return None

    def health(self) -> Mapping[int, DeviceHealth]:
        return {}

    def close(self) -> None:
        return None


# ----------------------------------------------------------------------- coercions


def _text(value: object) -> str:
    """NVML strings arrive as C{str} (nvidia-ml-py >= 11.5) or C{bytes} (char arrays)."""
    if isinstance(value, bytes):
        return value.split(b"\0", 1)[0].decode("utf-8", "replace").strip()
    if isinstance(value, str):
        return value.strip()
    return ""


def _int(value: object) -> int:
    """An int from an NVML value (plain int or ctypes scalar); 0 when unknown."""
    raw = getattr(value, "value", value)
    if isinstance(raw, bool):
        return int(raw)
    if isinstance(raw, int):
        return raw
    if isinstance(raw, float) and math.isfinite(raw):
        return int(raw)
    return 0


def _pct(value: object) -> int:
    return max(0, min(100, _int(value)))


def _instance_id(value: object) -> int:
    if value is None:
        return -1
    n = _int(value)
    return -1 if n in (_UINT_NOT_AVAILABLE, _ULL_NOT_AVAILABLE) else n


def _mode(value: object) -> str:
    if value is None:
        return ""
    return "enabled" if _int(value) == 1 else "disabled"


def _cuda_version(value: object) -> str:
    """C{12040} -> C{"12.4"} (NVML's C{CUDA_VERSION} encoding); C{""} when unknown."""
    n = _int(value)
    if n <= 0:
        return ""
    return f"{n // 1000}.{(n % 1000) // 10}"


def describe_error(exc: BaseException) -> str:
    """A short human text for an NVML (or other) exception. Never raises."""
    try:
        text = str(exc)
    except Exception:
        code = getattr(exc, "value", None)
        text = f"NVML error code {code}" if code is not None else ""
    if not text:
        text = type(exc).__name__
    return text[:_MAX_ERROR_TEXT]


