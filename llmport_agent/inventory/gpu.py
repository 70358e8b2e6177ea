# -*- test-case-name: tests.test_gpu -*-
"""
GPU facts through NVML (protocol section 5.2, the GPU snapshot).

An L{IGPUSource} produces a L{GPUSnapshot}: a frozen value that turns into the exact
dictionary the backend reads (C{count}, C{total_vram_bytes}, C{used_vram_bytes},
C{free_vram_bytes}, C{devices[]}) plus extras (MIG, ECC, processes, power, versions).

Rules kept here:

 - B{Never null.} Every field NVML refuses on a device (C{NVMLError_NotSupported} and
   friends) becomes C{0}, C{""} or C{[]}, and a failing field never fails the whole
   snapshot. A null in the snapshot is a 500 in the backend.
 - B{NVML may be missing.} Without the bindings, without C{libnvidia-ml}, or with a failing
   C{nvmlInit}, the snapshot is empty (count 0), names the reason in C{gpu_error}, and
   initialisation is retried with exponential backoff measured on the injected clock.
 - B{Quiet logs.} Something is logged only when a state changes (ok -> failing -> ok, a
   device starting or stopping to report errors, the GPU count changing).
 - B{Blocking.} L{IGPUSource.snapshot} and L{IGPUSource.close} block (NVML is a C library
   doing ioctls); call them in a worker thread (C{runner.run(source.snapshot)}).
"""

from __future__ import annotations

import importlib
import math
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from attrs import field, frozen
from twisted.logger import Logger
from zope.interface import Attribute, Interface, implementer

__all__ = [
    "EccErrors",
    "GPUDevice",
    "GPUProcess",
    "GPUSnapshot",
    "GPUSource",
    "IGPUSource",
    "MigInstance",
    "NVMLGPUSource",
    "NoGPUSource",
]

MIB = 1024 * 1024

# NVML return codes (stable C API values, identical in nvidia-ml-py 12 and 13).
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_NOT_FOUND = 6
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_RESET_REQUIRED = 16
_NO_DATA = 21

#: Codes that only mean "this device does not offer this figure": silently 0 / "" / [].
_BENIGN_CODES = frozenset(
    {_NOT_SUPPORTED, _NO_PERMISSION, _NOT_FOUND, _FUNCTION_NOT_FOUND, _NO_DATA}
)
#: Codes after which a device answers nothing more: stop asking it in this snapshot.
_DEVICE_GONE_CODES = frozenset({_GPU_IS_LOST, _RESET_REQUIRED})

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
class EccErrors:
    """ECC memory error counters (0 where ECC is off or unsupported)."""

    volatile_corrected: int = 0
    volatile_uncorrected: int = 0
    aggregate_corrected: int = 0
    aggregate_uncorrected: int = 0

    def to_dict(self) -> dict[str, int]:
        return {
            "volatile_corrected": self.volatile_corrected,
            "volatile_uncorrected": self.volatile_uncorrected,
            "aggregate_corrected": self.aggregate_corrected,
            "aggregate_uncorrected": self.aggregate_uncorrected,
        }


@frozen
class GPUDevice:
    """
    One physical GPU. Unknown figures are C{0} / C{""} / C{()}, never C{None}.

    @ivar mig_mode_current: C{"enabled"}, C{"disabled"} or C{""} (MIG not supported).
    @ivar ecc_mode: C{"enabled"}, C{"disabled"} or C{""} (unknown).
    @ivar error: C{""}, or what NVML failed to report for this device and why.
    """

    index: int
    vendor: str = "nvidia"
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = ""
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
    processes: tuple[GPUProcess, ...] = ()
    error: str = ""

    @property
    def memory_total_mib(self) -> int:
        return _mib(self.memory_total_bytes)

    @property
    def memory_used_mib(self) -> int:
        return _mib(self.memory_used_bytes)

    @property
    def memory_free_mib(self) -> int:
        return _mib(self.memory_free_bytes)

    def to_dict(self) -> dict[str, Any]:
        """The device object of protocol 5.2 (required keys first), plus extras."""
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
            "processes": [p.to_dict() for p in self.processes],
            "error": self.error,
        }


@frozen
class GPUSnapshot:
    """
    What the node's GPUs look like now.

    @ivar vendor: C{"nvidia"} when devices were found; when NVML fails, the last vendor
        seen (or C{"none"}); C{"none"} without GPUs.
    @ivar gpu_error: C{""} when the source works; otherwise why no GPU facts are reported.
    """

    vendor: str = "none"
    devices: tuple[GPUDevice, ...] = ()
    driver_version: str = ""
    cuda_driver_version: str = ""
    nvml_version: str = ""
    gpu_error: str = ""

    @property
    def count(self) -> int:
        return len(self.devices)

    @property
    def total_vram_bytes(self) -> int:
        return sum(d.memory_total_bytes for d in self.devices)

    @property
    def used_vram_bytes(self) -> int:
        return sum(d.memory_used_bytes for d in self.devices)

    @property
    def free_vram_bytes(self) -> int:
        return sum(d.memory_free_bytes for d in self.devices)

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
            "driver_version": self.driver_version,
            "cuda_driver_version": self.cuda_driver_version,
            "nvml_version": self.nvml_version,
            "mig_enabled_count": sum(1 for d in self.devices if d.mig_mode_current == "enabled"),
            "gpu_error": self.gpu_error,
        }


# ------------------------------------------------------------------------- interface


class IGPUSource(Interface):
    """
    A source of GPU facts. Both methods block: call them in a worker thread.
    """

    vendor = Attribute("The vendor this source reports on: nvidia, amd, apple or none.")

    def snapshot() -> GPUSnapshot:  # type: ignore[misc, empty-body]
        """
        Take a snapshot of the GPUs. Never raises: a failure gives an empty snapshot whose
        C{gpu_error} says why.
        """

    def close() -> None:  # type: ignore[misc, empty-body]
        """Release the underlying library (e.g. C{nvmlShutdown}). Never raises."""


class GPUSource(Protocol):
    """The static-typing twin of L{IGPUSource} (mypy does not read zope interfaces)."""

    vendor: str

    def snapshot(self) -> GPUSnapshot: ...

    def close(self) -> None: ...


@implementer(IGPUSource)
class NoGPUSource:
    """A node without GPUs (or with GPU reporting turned off)."""

    vendor = "none"

    def __init__(self, reason: str = "") -> None:
        self._reason = reason

    def snapshot(self) -> GPUSnapshot:
        return GPUSnapshot(vendor="none", gpu_error=self._reason)

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


def _import_pynvml() -> Any:
    return importlib.import_module("pynvml")


class _Probe:
    """
    Asks one device handle for one figure at a time, turning refusals into defaults.

    Errors other than the benign ones (not supported, not found, ...) are collected in
    C{errors} (field -> text); after C{GPU is lost} the device is not asked again.
    """

    def __init__(self, nvml: Any, handle: Any, errors: dict[str, str], prefix: str = "") -> None:
        self._nvml = nvml
        self._handle = handle
        self._errors = errors
        self._prefix = prefix
        self._nvml_error: type[BaseException] = getattr(nvml, "NVMLError", Exception)
        self.gone = False

    def call(self, what: str, fname: str, *args: Any, default: Any = None) -> Any:
        if self.gone:
            return default
        fn = getattr(self._nvml, fname, None)
        if fn is None:  # older bindings without this function
            return default
        try:
            return fn(self._handle, *args)
        except self._nvml_error as e:
            code = getattr(e, "value", None)
            if code in _BENIGN_CODES:
                return default
            if code in _DEVICE_GONE_CODES:
                self.gone = True
            self._errors[self._prefix + what] = describe_error(e)
            return default
        except Exception as e:  # a binding bug must not sink the snapshot
            self._errors[self._prefix + what] = f"{type(e).__name__}: {describe_error(e)}"
            return default


# ------------------------------------------------------------------------------ NVML


@implementer(IGPUSource)
class NVMLGPUSource:
    """
    NVIDIA GPUs through NVML (C{pynvml} from nvidia-ml-py 12 or 13).

    Thread-safe: calls are serialised by a lock, so several workers may call it.

    @param nvml: the C{pynvml} module (or a faithful fake); imported on first use when
        C{None}.
    @param clock: monotonic seconds, used for the initialisation backoff.
    @param importer: how to import C{pynvml} when C{nvml} is C{None} (tests).
    @param initial_backoff: seconds before the first retry of a failed initialisation;
        doubles after each failure up to C{max_backoff}.
    """

    vendor = "nvidia"
    log = Logger()

    def __init__(
        self,
        nvml: Any = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        importer: Callable[[], Any] = _import_pynvml,
        initial_backoff: float = 30.0,
        max_backoff: float = 1800.0,
    ) -> None:
        self._nvml = nvml
        self._importer = importer
        self._clock = clock
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._lock = threading.Lock()
        self._initialized = False
        #: "new" | "ok" | "failing"
        self._state = "new"
        self._error = ""
        self._next_attempt: float | None = None
        self._delay = initial_backoff
        self._seen_devices = False
        self._driver_version = ""
        self._cuda_driver_version = ""
        self._nvml_version = ""
        self._last_count: int | None = None
        self._device_problems: dict[int, frozenset[str]] = {}
        self._probe_errors: dict[int, frozenset[str]] = {}
        self._unexpected_logged = False

    # -- IGPUSource

    def snapshot(self) -> GPUSnapshot:
        with self._lock:
            try:
                return self._snapshot()
            except Exception as e:  # belt and braces: never fail the caller
                if not self._unexpected_logged:
                    self._unexpected_logged = True
                    self.log.failure("GPU snapshot failed unexpectedly")
                return self._empty(f"GPU snapshot failed: {describe_error(e)}")

    def close(self) -> None:
        """
        Call C{nvmlShutdown} when initialised. A later L{snapshot} initialises again.
        """
        with self._lock:
            if not self._initialized:
                return
            self._initialized = False
            self._state = "new"
            self._next_attempt = None
            self._delay = self._initial_backoff
            self._shutdown_quietly()

    # -- state

    @property
    def failing(self) -> bool:
        """True while NVML cannot be used."""
        return self._state == "failing"

    @property
    def next_attempt(self) -> float | None:
        """Clock time of the next initialisation attempt while failing, else C{None}."""
        return self._next_attempt if self._state == "failing" else None

    def _empty(self, error: str) -> GPUSnapshot:
        return GPUSnapshot(vendor="nvidia" if self._seen_devices else "none", gpu_error=error)

    def _snapshot(self) -> GPUSnapshot:
        if not self._initialized and not self._try_init():
            return self._empty(self._error)
        nvml = self._nvml
        try:
            count = _int(nvml.nvmlDeviceGetCount())
        except Exception as e:
            # The session itself broke (driver unloaded or upgraded under us): start over.
            self._initialized = False
            self._shutdown_quietly()
            self._enter_failing(f"NVML stopped answering: {describe_error(e)}")
            return self._empty(self._error)
        self._probe_errors = {}
        devices = tuple(self._probe_device(i) for i in range(count))
        self._note_changes(devices)
        self._unexpected_logged = False
        if count:
            self._seen_devices = True
        return GPUSnapshot(
            vendor="nvidia" if count else "none",
            devices=devices,
            driver_version=self._driver_version,
            cuda_driver_version=self._cuda_driver_version,
            nvml_version=self._nvml_version,
            gpu_error="",
        )

    def _try_init(self) -> bool:
        now = self._clock()
        if self._next_attempt is not None and now < self._next_attempt:
            return False
        try:
            if self._nvml is None:
                self._nvml = self._importer()
            self._nvml.nvmlInit()
        except ImportError:
            self._enter_failing("NVML Python bindings (pynvml, nvidia-ml-py) are not installed")
            return False
        except Exception as e:
            if getattr(e, "value", None) == _LIBRARY_NOT_FOUND:
                reason = (
                    "NVML library (libnvidia-ml.so.1) not found: "
                    "no NVIDIA driver is installed on this node"
                )
            else:
                reason = f"NVML initialisation failed: {describe_error(e)}"
            self._enter_failing(reason)
            return False
        self._initialized = True
        self._read_system_info()
        previous = self._state
        self._state = "ok"
        self._error = ""
        self._next_attempt = None
        self._delay = self._initial_backoff
        if previous == "failing":
            self.log.info(
                "NVML available again (driver {driver_version}, CUDA {cuda_version})",
                driver_version=self._driver_version,
                cuda_version=self._cuda_driver_version,
            )
        else:
            self.log.info(
                "NVML initialised (driver {driver_version}, CUDA {cuda_version})",
                driver_version=self._driver_version,
                cuda_version=self._cuda_driver_version,
            )
        return True

    def _enter_failing(self, reason: str) -> None:
        now = self._clock()
        delay = self._delay
        self._next_attempt = now + delay
        self._delay = min(delay * 2, self._max_backoff)
        self._error = reason
        self._last_count = None
        self._device_problems = {}
        if self._state != "failing":
            self._state = "failing"
            self.log.warn(
                "No GPU facts: {reason}. Retrying in {delay} s, backing off up to {max_delay} s.",
                reason=reason,
                delay=delay,
                max_delay=self._max_backoff,
            )

    def _shutdown_quietly(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass

    def _read_system_info(self) -> None:
        nvml = self._nvml
        self._driver_version = _text(self._system(nvml, "nvmlSystemGetDriverVersion"))
        self._nvml_version = _text(self._system(nvml, "nvmlSystemGetNVMLVersion"))
        cuda = self._system(nvml, "nvmlSystemGetCudaDriverVersion_v2")
        if cuda is None:
            cuda = self._system(nvml, "nvmlSystemGetCudaDriverVersion")
        self._cuda_driver_version = _cuda_version(cuda)

    @staticmethod
    def _system(nvml: Any, fname: str) -> Any:
        """A system-level figure, or C{None} when refused (versions are optional)."""
        fn = getattr(nvml, fname, None)
        if fn is None:
            return None
        try:
            return fn()
        except Exception:
            return None

    # -- devices

    def _probe_device(self, index: int) -> GPUDevice:
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as e:
            self._probe_errors[index] = frozenset({"handle"})
            return GPUDevice(
                index=index,
                driver_version=self._driver_version,
                cuda_driver_version=self._cuda_driver_version,
                error=f"handle: {describe_error(e)}",
            )
        errors: dict[str, str] = {}
        p = _Probe(nvml, handle, errors)
        name = _text(p.call("name", "nvmlDeviceGetName"))
        uuid = _text(p.call("uuid", "nvmlDeviceGetUUID"))
        pci = p.call("pci", "nvmlDeviceGetPciInfo")
        pci_bus_id = _text(getattr(pci, "busId", b"")) or _text(getattr(pci, "busIdLegacy", b""))
        mem = p.call("memory", "nvmlDeviceGetMemoryInfo")
        total = _int(getattr(mem, "total", 0))
        used = _int(getattr(mem, "used", 0))
        free = _int(getattr(mem, "free", 0))
        util = p.call("utilization", "nvmlDeviceGetUtilizationRates")
        temp = p.call(
            "temperature",
            "nvmlDeviceGetTemperature",
            getattr(nvml, "NVML_TEMPERATURE_GPU", 0),
            default=0,
        )
        power_mw = _int(p.call("power_draw", "nvmlDeviceGetPowerUsage", default=0))
        limit_mw = _int(p.call("power_limit", "nvmlDeviceGetEnforcedPowerLimit", default=0))
        mig = p.call("mig_mode", "nvmlDeviceGetMigMode")
        mig_current, mig_pending = ("", "")
        if isinstance(mig, list | tuple) and len(mig) == 2:
            mig_current, mig_pending = _mode(mig[0]), _mode(mig[1])
        instances: tuple[MigInstance, ...] = ()
        if mig_current == "enabled":
            instances = self._mig_instances(p, handle, errors)
        ecc_mode_raw = p.call("ecc_mode", "nvmlDeviceGetEccMode")
        ecc_mode = ""
        if isinstance(ecc_mode_raw, list | tuple) and ecc_mode_raw:
            ecc_mode = _mode(ecc_mode_raw[0])
        ecc = EccErrors()
        if ecc_mode != "disabled":
            ecc = self._ecc(p)
        processes = self._processes(p)
        self._probe_errors[index] = frozenset(errors)
        return GPUDevice(
            index=index,
            vendor="nvidia",
            uuid=uuid,
            name=name,
            pci_bus_id=pci_bus_id,
            driver_version=self._driver_version,
            cuda_driver_version=self._cuda_driver_version,
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_free_bytes=free,
            utilization_pct=_pct(getattr(util, "gpu", 0)),
            memory_utilization_pct=_pct(getattr(util, "memory", 0)),
            temperature_c=_int(temp),
            power_draw_w=power_mw / 1000.0,
            power_limit_w=limit_mw / 1000.0,
            mig_mode_current=mig_current,
            mig_mode_pending=mig_pending,
            mig_instances=instances,
            ecc_mode=ecc_mode,
            ecc_errors=ecc,
            processes=processes,
            error="; ".join(f"{k}: {v}" for k, v in sorted(errors.items()))[:_MAX_ERROR_TEXT],
        )

    def _mig_instances(
        self, parent: _Probe, handle: Any, errors: dict[str, str]
    ) -> tuple[MigInstance, ...]:
        nvml = self._nvml
        slots = _int(parent.call("mig_count", "nvmlDeviceGetMaxMigDeviceCount", default=0))
        out: list[MigInstance] = []
        for slot in range(slots):
            mig_handle = parent.call(f"mig[{slot}]", "nvmlDeviceGetMigDeviceHandleByIndex", slot)
            if mig_handle is None:  # empty slot (NotFound) or refused
                continue
            q = _Probe(nvml, mig_handle, errors, prefix=f"mig[{slot}].")
            mem = q.call("memory", "nvmlDeviceGetMemoryInfo")
            out.append(
                MigInstance(
                    gpu_instance_id=_instance_id(q.call("gi", "nvmlDeviceGetGpuInstanceId")),
                    compute_instance_id=_instance_id(
                        q.call("ci", "nvmlDeviceGetComputeInstanceId")
                    ),
                    uuid=_text(q.call("uuid", "nvmlDeviceGetUUID")),
                    name=_text(q.call("name", "nvmlDeviceGetName")),
                    memory_total_bytes=_int(getattr(mem, "total", 0)),
                    memory_used_bytes=_int(getattr(mem, "used", 0)),
                    memory_free_bytes=_int(getattr(mem, "free", 0)),
                )
            )
        return tuple(out)

    def _ecc(self, p: _Probe) -> EccErrors:
        nvml = self._nvml
        corrected = getattr(nvml, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
        uncorrected = getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
        volatile = getattr(nvml, "NVML_VOLATILE_ECC", 0)
        aggregate = getattr(nvml, "NVML_AGGREGATE_ECC", 1)

        def count(what: str, etype: int, ctype: int) -> int:
            return _int(p.call(what, "nvmlDeviceGetTotalEccErrors", etype, ctype, default=0))

        return EccErrors(
            volatile_corrected=count("ecc_volatile_corrected", corrected, volatile),
            volatile_uncorrected=count("ecc_volatile_uncorrected", uncorrected, volatile),
            aggregate_corrected=count("ecc_aggregate_corrected", corrected, aggregate),
            aggregate_uncorrected=count("ecc_aggregate_uncorrected", uncorrected, aggregate),
        )

    def _processes(self, p: _Probe) -> tuple[GPUProcess, ...]:
        merged: dict[tuple[int, int, int], GPUProcess] = {}
        for kind, fname in (
            ("compute", "nvmlDeviceGetComputeRunningProcesses"),
            ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
        ):
            found = p.call(f"{kind}_processes", fname, default=[])
            if not isinstance(found, list | tuple):
                continue
            for info in found:
                pid = _int(getattr(info, "pid", 0))
                if pid <= 0:
                    continue
                used = getattr(info, "usedGpuMemory", None)  # None: not available
                used_bytes = _int(used)
                if used_bytes == _ULL_NOT_AVAILABLE or used_bytes < 0:
                    used_bytes = 0
                gi = _instance_id(getattr(info, "gpuInstanceId", None))
                ci = _instance_id(getattr(info, "computeInstanceId", None))
                key = (pid, gi, ci)
                seen = merged.get(key)
                if seen is None:
                    merged[key] = GPUProcess(
                        pid=pid,
                        used_memory_bytes=used_bytes,
                        kind=kind,
                        gpu_instance_id=gi,
                        compute_instance_id=ci,
                    )
                elif kind not in seen.kind.split(","):
                    merged[key] = GPUProcess(
                        pid=pid,
                        used_memory_bytes=max(seen.used_memory_bytes, used_bytes),
                        kind=f"{seen.kind},{kind}",
                        gpu_instance_id=gi,
                        compute_instance_id=ci,
                    )
        return tuple(sorted(merged.values(), key=lambda g: (g.pid, g.gpu_instance_id)))

    def _note_changes(self, devices: tuple[GPUDevice, ...]) -> None:
        count = len(devices)
        if self._last_count is not None and count != self._last_count:
            self.log.warn(
                "GPU count changed from {old_count} to {gpu_count}",
                old_count=self._last_count,
                gpu_count=count,
            )
        self._last_count = count
        problems: dict[int, frozenset[str]] = {}
        for d in devices:
            fields = self._probe_errors.get(d.index, frozenset())
            problems[d.index] = fields
            before = self._device_problems.get(d.index, frozenset())
            if fields == before:
                continue
            if fields:
                self.log.warn(
                    "GPU {index} ({uuid}) reports NVML errors: {errors}",
                    index=d.index,
                    uuid=d.uuid,
                    errors=d.error,
                )
            else:
                self.log.info(
                    "GPU {index} ({uuid}) reports no NVML errors any more",
                    index=d.index,
                    uuid=d.uuid,
                )
        self._device_problems = problems
