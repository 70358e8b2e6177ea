# -*- test-case-name: tests.test_gpu -*-
"""
A faithful stand-in for the C{pynvml} module (nvidia-ml-py 12/13) for nodes without GPUs.

L{FakeNVML} instances behave like the module: the same function names and parameters,
the same return shapes (the real ctypes structures from C{pynvml} for memory, PCI and
utilisation figures, C{nvmlFriendlyObject}s for processes, C{str} for strings, lists for
mode pairs), the same C{NVMLError} subclasses and C{NVML_*} constants (taken from the
installed C{pynvml}, so C{except pynvml.NVMLError_NotSupported} catches the fake's errors),
and the same error rules (everything but C{nvmlInit} raises C{NVMLError_Uninitialized}
before init or after the last C{nvmlShutdown}; MIG-only calls refuse non-MIG handles; a
lost GPU answers C{NVMLError_GpuIsLost}).

Knobs: C{init_error} makes C{nvmlInit} fail with an NVML code (e.g.
C{NVML_ERROR_LIBRARY_NOT_FOUND}, C{NVML_ERROR_DRIVER_NOT_LOADED}); L{FakeNVML.fail} makes one
function raise a code for one device or for all; C{FakeGPU.lost} makes a device lost
(C{GPU_IS_LOST}) and C{FakeGPU.reset_required} makes it answer C{RESET_REQUIRED};
L{FakeNVML.hang} makes a function block (a hung ioctl) until released;
C{calls} records every call (name, thread name) for assertions.

Health and events, as the real library has them:

 - error counters: ECC (volatile counters are cleared by L{FakeNVML.reset_gpu}, aggregate
   ones are not), retired pages and their pending status (C{FakeGPU.retired_pages}, C{None}
   = not supported, as on A100/H100 which remap rows instead), remapped rows
   (C{FakeGPU.remapped_rows}), the driver's recovery action through
   C{nvmlDeviceGetFieldValues} (C{FakeGPU.recovery_action}, C{None} = not supported, as
   before R570), clock event (throttle) reasons, the PCIe link;
 - events: C{nvmlEventSetCreate}, C{nvmlDeviceRegisterEvents} (refusing types the device
   does not support with C{NOT_SUPPORTED}, and MIG handles), C{nvmlEventSetWait} (delivers
   the events injected after registration, for registered devices and types, oldest first;
   raises C{NVMLError_Timeout} when none comes within C{timeoutms}: really waiting, or at
   once with C{wait_mode="immediate"}), C{nvmlEventSetFree}. L{FakeNVML.inject_xid} and
   L{FakeNVML.inject_event} produce events; the event data object has the fields of
   C{c_nvmlEventData_t} (C{device}, C{eventType}, C{eventData}, C{gpuInstanceId},
   C{computeInstanceId}).

L{h100_node} builds a ready-made 8-GPU H100 node: GPUs 6 and 7 in MIG mode with instances,
ECC counters on GPU 3, a tensor-parallel vLLM process on GPUs 0-3, MIG processes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import pynvml as _real
from attrs import field

from llmport_agent.core.values import define

__all__ = [
    "FAKE_FUNCTIONS",
    "FakeEventData",
    "FakeEventSet",
    "FakeGPU",
    "FakeHandle",
    "FakeMigDevice",
    "FakeNVML",
    "FakeProcess",
    "h100_node",
]

MIB = 1024 * 1024
GIB = 1024 * MIB

NVMLError: type[Exception] = _real.NVMLError


@define
class FakeMigDevice:
    """One MIG device of a fake GPU, placed in MIG slot C{slot}."""

    slot: int
    gpu_instance_id: int
    compute_instance_id: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int = 0


@define
class FakeProcess:
    """
    A process on a fake GPU. C{used_gpu_memory=None} reproduces NVML's "not available"
    (the real bindings then report C{usedGpuMemory=None}). Instance ids default to NVML's
    "not available" value C{0xFFFFFFFF} (a process outside MIG).
    """

    pid: int
    used_gpu_memory: int | None
    gpu_instance_id: int = 0xFFFFFFFF
    compute_instance_id: int = 0xFFFFFFFF


@define
class FakeGPU:
    """
    One fake physical GPU.

    @ivar mig_mode: C{None} when the GPU does not support MIG, else C{(current, pending)}.
    @ivar ecc_mode: C{None} when the GPU has no ECC, else C{(current, pending)}.
    @ivar ecc_counts: C{{(error_type, counter_type): count}} with NVML's constants.
    """

    name: str
    uuid: str
    pci_bus_id: str
    memory_total: int
    memory_used: int = 0
    memory_reserved: int = 0
    utilization_gpu: int = 0
    utilization_memory: int = 0
    temperature: int = 30
    power_usage_mw: int = 70_000
    power_limit_mw: int = 700_000
    pci_device_id: int = 0x233010DE
    pci_subsystem_id: int = 0x16C110DE
    mig_mode: tuple[int, int] | None = None
    max_mig_devices: int = 7
    mig_devices: list[FakeMigDevice] = field(factory=list)
    ecc_mode: tuple[int, int] | None = (1, 1)
    ecc_counts: dict[tuple[int, int], int] = field(factory=dict)
    compute_processes: list[FakeProcess] = field(factory=list)
    graphics_processes: list[FakeProcess] = field(factory=list)
    lost: bool = False
    reset_required: bool = False
    supported_events: int = (
        _real.nvmlEventTypeSingleBitEccError
        | _real.nvmlEventTypeDoubleBitEccError
        | _real.nvmlEventTypePState
        | _real.nvmlEventTypeXidCriticalError
        | _real.nvmlEventTypeClock
    )
    #: C{{NVML_PAGE_RETIREMENT_CAUSE_*: [addresses]}}, or C{None}: not supported.
    retired_pages: dict[int, list[int]] | None = None
    retired_pending: bool = False
    #: C{(correctable, uncorrectable, pending, failure)}, or C{None}: not supported.
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)
    #: C{NVML_GPU_RECOVERY_ACTION_*}, or C{None}: the field is not supported.
    recovery_action: int | None = None
    throttle_reasons: int = 0
    #: C{(generation, max generation, width, max width)}
    pcie: tuple[int, int, int, int] = (5, 5, 16, 16)

    @property
    def mig_enabled(self) -> bool:
        return self.mig_mode is not None and self.mig_mode[0] == _real.NVML_DEVICE_MIG_ENABLE


class FakeHandle:
    """
    An opaque device handle, like C{pynvml.c_nvmlDevice_t}: handles of the same device
    compare equal (NVML hands out the same pointer for a device within a session).
    """

    __slots__ = ("gpu_index", "mig_slot")

    def __init__(self, gpu_index: int, mig_slot: int | None = None) -> None:
        self.gpu_index = gpu_index
        self.mig_slot = mig_slot

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FakeHandle):
            return NotImplemented
        return (self.gpu_index, self.mig_slot) == (other.gpu_index, other.mig_slot)

    def __hash__(self) -> int:
        return hash((FakeHandle, self.gpu_index, self.mig_slot))

    def __repr__(self) -> str:
        if self.mig_slot is None:
            return f"<FakeHandle gpu={self.gpu_index}>"
        return f"<FakeHandle gpu={self.gpu_index} mig={self.mig_slot}>"


@define
class FakeEventData:
    """The fields of C{pynvml.c_nvmlEventData_t}; C{device} is C{None} when not attributed."""

    device: FakeHandle | None
    eventType: int
    eventData: int
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


class FakeEventSet:
    """An event set (C{c_nvmlEventSet_t}): registrations and the events waiting in it."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # gpu index -> event type mask
        self.queue: deque[FakeEventData] = deque()
        self.freed = False


def _raise(code: int) -> None:
    raise _real.NVMLError(code)


class FakeNVML:
    """
    A configurable object that quacks like the C{pynvml} module.

    @ivar init_error: an NVML code for C{nvmlInit} to fail with, or C{None}.
    @ivar calls: C{[(function name, GPU index or None, thread name)]} of every call made.
    @ivar refcount: how many C{nvmlInit} calls are not yet matched by C{nvmlShutdown}.
    """

    def __init__(
        self,
        gpus: Iterable[FakeGPU] = (),
        *,
        driver_version: str = "550.54.15",
        cuda_driver_version: int = 12040,
        nvml_version: str = "12.550.54.15",
        init_error: int | None = None,
        wait_mode: str = "block",
    ) -> None:
        if wait_mode not in ("block", "immediate"):
            raise ValueError("wait_mode is 'block' or 'immediate'")
        self.gpus: list[FakeGPU] = list(gpus)
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.nvml_version = nvml_version
        self.init_error = init_error
        self.refcount = 0
        self.init_count = 0
        self.shutdown_count = 0
        self.calls: list[tuple[str, int | None, str]] = []
        self._failures: dict[tuple[str, int | None], int] = {}
        self._lock = threading.Lock()
        self.wait_mode = wait_mode
        self._events = threading.Condition()
        self._event_sets: list[FakeEventSet] = []
        self._hangs: dict[tuple[str, int | None], threading.Event] = {}
        #: Events injected that no registered set took (device or type not registered).
        self.undelivered = 0

    # -- knobs

    def fail(self, function: str, code: int, device: int | None = None) -> None:
        """
        Make C{function} raise C{NVMLError(code)} for the GPU at index C{device} (its MIG
        devices included), or for every call when C{device} is C{None}.
        """
        if not callable(getattr(self, function, None)):
            raise AttributeError(f"FakeNVML has no function {function!r}")
        self._failures[(function, device)] = code

    def clear_failures(self) -> None:
        """Forget every L{fail} knob."""
        self._failures.clear()

    def hang(self, function: str, device: int | None = None) -> threading.Event:
        """
        Make C{function} block (for the GPU at C{device}, or every call) until the returned
        event is set (or L{release_hangs}): a hung ioctl.
        """
        if not callable(getattr(self, function, None)):
            raise AttributeError(f"FakeNVML has no function {function!r}")
        ev = threading.Event()
        self._hangs[(function, device)] = ev
        return ev

    def release_hangs(self) -> None:
        """Unblock every hung call and forget the L{hang} knobs."""
        hangs, self._hangs = self._hangs, {}
        for ev in hangs.values():
            ev.set()

    def inject_event(
        self,
        device: int | None,
        event_type: int,
        data: int = 0,
        gpu_instance: int = 0xFFFFFFFF,
        compute_instance: int = 0xFFFFFFFF,
    ) -> int:
        """
        An event happens on the GPU at index C{device} (C{None}: not attributed to one).
        It is queued in every event set that registered that device for that type; returns
        how many sets took it.
        """
        taken = 0
        with self._events:
            for es in self._event_sets:
                if es.freed:
                    continue
                if device is None:
                    wanted = any(m & event_type for m in es.registered.values())
                else:
                    wanted = bool(es.registered.get(device, 0) & event_type)
                if wanted:
                    handle = FakeHandle(device) if device is not None else None
                    es.queue.append(
                        FakeEventData(handle, event_type, data, gpu_instance, compute_instance)
                    )
                    taken += 1
            if not taken:
                self.undelivered += 1
            self._events.notify_all()
        return taken

    def inject_xid(self, device: int | None, xid: int, gpu_instance: int = 0xFFFFFFFF) -> int:
        """An Xid critical error (C{eventData} = the Xid) on the GPU at C{device}."""
        return self.inject_event(
            device, _real.nvmlEventTypeXidCriticalError, xid, gpu_instance=gpu_instance
        )

    def reset_gpu(self, index: int) -> None:
        """
        What a GPU reset (or reboot) does to the GPU at C{index}: it answers again, its
        volatile ECC counters are cleared, pending page retirements and row remappings are
        applied, its recovery action goes back to none.
        """
        gpu = self.gpus[index]
        gpu.lost = False
        gpu.reset_required = False
        for key in list(gpu.ecc_counts):
            if key[1] == _real.NVML_VOLATILE_ECC:
                gpu.ecc_counts[key] = 0
        gpu.retired_pending = False
        if gpu.remapped_rows is not None:
            corr, unc, _pending, failure = gpu.remapped_rows
            gpu.remapped_rows = (corr, unc, 0, failure)
        if gpu.recovery_action is not None:
            gpu.recovery_action = _real.NVML_GPU_RECOVERY_ACTION_NONE

    def called(self, function: str, device: int | None = None) -> int:
        """How many times C{function} was called (for the GPU at C{device}, if given)."""
        return sum(
            1
            for name, index, _ in self.calls
            if name == function and (device is None or index == device)
        )

    # -- plumbing

    def _enter(self, name: str, handle: Any = None, *, needs_init: bool = True) -> None:
        gpu_index = handle.gpu_index if isinstance(handle, FakeHandle) else None
        with self._lock:
            self.calls.append((name, gpu_index, threading.current_thread().name))
        if self._hangs:
            ev = self._hangs.get((name, gpu_index)) or self._hangs.get((name, None))
            if ev is not None:
                ev.wait()
        if needs_init and self.refcount <= 0:
            _raise(_real.NVML_ERROR_UNINITIALIZED)
        if handle is not None:
            if not isinstance(handle, FakeHandle) or not (0 <= handle.gpu_index < len(self.gpus)):
                _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
            gpu = self.gpus[handle.gpu_index]
            code = self._failures.get((name, handle.gpu_index))
            if code is None:
                code = self._failures.get((name, None))
            if code is not None:
                _raise(code)
            if gpu.lost:
                _raise(_real.NVML_ERROR_GPU_IS_LOST)
            if gpu.reset_required:
                _raise(_real.NVML_ERROR_RESET_REQUIRED)
        else:
            code = self._failures.get((name, None))
            if code is not None:
                _raise(code)

    def _gpu(self, handle: FakeHandle) -> FakeGPU:
        return self.gpus[handle.gpu_index]

    def _mig(self, handle: FakeHandle) -> FakeMigDevice | None:
        if handle.mig_slot is None:
            return None
        for m in self._gpu(handle).mig_devices:
            if m.slot == handle.mig_slot:
                return m
        _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
        return None  # pragma: no cover

    def _parent_only(self, handle: FakeHandle) -> FakeGPU:
        if handle.mig_slot is not None:
            _raise(_real.NVML_ERROR_NOT_SUPPORTED)
        return self._gpu(handle)

    # -- init / shutdown

    def nvmlInitWithFlags(self, flags: int) -> None:
        self._enter("nvmlInitWithFlags", needs_init=False)
        self.init_count += 1
        if self.init_error is not None:
            _raise(self.init_error)
        self.refcount += 1
        return None

    def nvmlInit(self) -> None:
        self._enter("nvmlInit", needs_init=False)
        self.nvmlInitWithFlags(0)
        return None

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.shutdown_count += 1
        if self.refcount > 0:
            self.refcount -= 1
        return None

    def nvmlErrorString(self, result: int) -> str:
        self._enter("nvmlErrorString", needs_init=False)
        error = _real.NVMLError(result)  # a code pynvml knows maps to its own subclass
        if type(error) is _real.NVMLError:
            return "Unknown Error"
        return str(error)

    # -- system

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._enter("nvmlSystemGetNVMLVersion")
        return self.nvml_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.cuda_driver_version

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion_v2")
        return self.cuda_driver_version

    # -- device enumeration

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not isinstance(index, int) or not (0 <= index < len(self.gpus)):
            _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
        code = self._failures.get(("nvmlDeviceGetHandleByIndex", index))
        if code is not None:
            _raise(code)
        if self.gpus[index].lost:
            _raise(_real.NVML_ERROR_GPU_IS_LOST)
        return FakeHandle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByUUID")
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for i, gpu in enumerate(self.gpus):
            if gpu.uuid == text:
                return FakeHandle(i)
            for m in gpu.mig_devices:
                if m.uuid == text:
                    return FakeHandle(i, m.slot)
        _raise(_real.NVML_ERROR_NOT_FOUND)
        raise AssertionError("unreachable")  # pragma: no cover

    def nvmlDeviceGetIndex(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetIndex", handle)
        self._parent_only(handle)
        return handle.gpu_index

    # -- identity

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        self._enter("nvmlDeviceGetName", handle)
        mig = self._mig(handle)
        return mig.name if mig is not None else self._gpu(handle).name

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        self._enter("nvmlDeviceGetUUID", handle)
        mig = self._mig(handle)
        return mig.uuid if mig is not None else self._gpu(handle).uuid

    def nvmlDeviceGetPciInfo_v3(self, handle: FakeHandle) -> Any:
        self._enter("nvmlDeviceGetPciInfo_v3", handle)
        gpu = self._gpu(handle)
        domain_s, bus_s, devfn = gpu.pci_bus_id.split(":")
        dev_s = devfn.split(".")[0]
        info = _real.nvmlPciInfo_t()
        info.busId = gpu.pci_bus_id.encode()
        info.busIdLegacy = gpu.pci_bus_id[4:].encode()
        info.domain = int(domain_s, 16)
        info.bus = int(bus_s, 16)
        info.device = int(dev_s, 16)
        info.pciDeviceId = gpu.pci_device_id
        info.pciSubSystemId = gpu.pci_subsystem_id
        return info

    def nvmlDeviceGetPciInfo(self, handle: FakeHandle) -> Any:
        self._enter("nvmlDeviceGetPciInfo", handle)
        return self.nvmlDeviceGetPciInfo_v3(handle)

    # -- figures

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version: int | None = None) -> Any:
        self._enter("nvmlDeviceGetMemoryInfo", handle)
        mig = self._mig(handle)
        if mig is not None:
            total, used, reserved = mig.memory_total, mig.memory_used, 0
        else:
            gpu = self._gpu(handle)
            total, used, reserved = gpu.memory_total, gpu.memory_used, gpu.memory_reserved
        if not version:
            # v1: "used" includes the driver's reservation.
            return _real.c_nvmlMemory_t(total=total, free=total - used, used=used)
        if version != _real.nvmlMemory_v2:
            _raise(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return _real.c_nvmlMemory_v2_t(
            version=version,
            total=total,
            reserved=reserved,
            free=total - used,
            used=max(0, used - reserved),
        )

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> Any:
        self._enter("nvmlDeviceGetUtilizationRates", handle)
        gpu = self._parent_only(handle)
        if gpu.mig_enabled:  # NVML cannot split utilisation by instance
            _raise(_real.NVML_ERROR_NOT_SUPPORTED)
        return _real.c_nvmlUtilization_t(gpu=gpu.utilization_gpu, memory=gpu.utilization_memory)

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        self._enter("nvmlDeviceGetTemperature", handle)
        gpu = self._parent_only(handle)
        if sensor != _real.NVML_TEMPERATURE_GPU:
            _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.temperature

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetPowerUsage", handle)
        return self._parent_only(handle).power_usage_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetEnforcedPowerLimit", handle)
        return self._parent_only(handle).power_limit_mw

    def nvmlDeviceGetPowerManagementLimit(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetPowerManagementLimit", handle)
        return self._parent_only(handle).power_limit_mw

    # -- MIG

    def nvmlDeviceGetMigMode(self, device: FakeHandle) -> list[int]:
        self._enter("nvmlDeviceGetMigMode", device)
        gpu = self._parent_only(device)
        if gpu.mig_mode is None:
            _raise(_real.NVML_ERROR_NOT_SUPPORTED)
            raise AssertionError("unreachable")  # pragma: no cover
        return [gpu.mig_mode[0], gpu.mig_mode[1]]

    def nvmlDeviceGetMaxMigDeviceCount(self, device: FakeHandle) -> int:
        self._enter("nvmlDeviceGetMaxMigDeviceCount", device)
        gpu = self._parent_only(device)
        # "Returns zero if MIG is not supported or enabled."
        return gpu.max_mig_devices if gpu.mig_enabled else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: FakeHandle, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex", device)
        gpu = self._parent_only(device)
        if gpu.mig_mode is None:
            _raise(_real.NVML_ERROR_NOT_SUPPORTED)
        limit = gpu.max_mig_devices if gpu.mig_enabled else 0
        if not (0 <= index < limit):
            _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
        for m in gpu.mig_devices:
            if m.slot == index:
                return FakeHandle(device.gpu_index, index)
        _raise(_real.NVML_ERROR_NOT_FOUND)
        raise AssertionError("unreachable")  # pragma: no cover

    def nvmlDeviceIsMigDeviceHandle(self, device: FakeHandle) -> Any:
        self._enter("nvmlDeviceIsMigDeviceHandle", device)
        # The real binding returns the c_uint itself, not its value.
        return _real.c_uint(1 if device.mig_slot is not None else 0)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: FakeHandle) -> FakeHandle:
        self._enter("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", migDevice)
        if migDevice.mig_slot is None:
            _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
        return FakeHandle(migDevice.gpu_index)

    def nvmlDeviceGetGpuInstanceId(self, device: FakeHandle) -> int:
        self._enter("nvmlDeviceGetGpuInstanceId", device)
        mig = self._mig(device)
        if mig is None:
            _raise(_real.NVML_ERROR_NOT_SUPPORTED)
            raise AssertionError("unreachable")  # pragma: no cover
        return mig.gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, device: FakeHandle) -> int:
        self._enter("nvmlDeviceGetComputeInstanceId", device)
        mig = self._mig(device)
        if mig is None:
            _raise(_real.NVML_ERROR_NOT_SUPPORTED)
            raise AssertionError("unreachable")  # pragma: no cover
        return mig.compute_instance_id

    # -- ECC

    def nvmlDeviceGetEccMode(self, handle: FakeHandle) -> list[int]:
        self._enter("nvmlDeviceGetEccMode", handle)
        gpu = self._parent_only(handle)
        if gpu.ecc_mode is None:
            _raise(_real.NVML_ERROR_NOT_SUPPORTED)
            raise AssertionError("unreachable")  # pragma: no cover
        return [gpu.ecc_mode[0], gpu.ecc_mode[1]]

    def nvmlDeviceGetTotalEccErrors(
        self, handle: FakeHandle, errorType: int, counterType: int
    ) -> int:
        self._enter("nvmlDeviceGetTotalEccErrors", handle)
        gpu = self._parent_only(handle)
        if gpu.ecc_mode is None or gpu.ecc_mode[0] != _real.NVML_FEATURE_ENABLED:
            _raise(_real.NVML_ERROR_NOT_SUPPORTED)
        if errorType not in (
            _real.NVML_MEMORY_ERROR_TYPE_CORRECTED,
            _real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        ) or counterType not in (_real.NVML_VOLATILE_ECC, _real.NVML_AGGREGATE_ECC):
            _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.ecc_counts.get((errorType, counterType), 0)

    # -- processes

    def _procs(self, handle: FakeHandle, procs: list[FakeProcess]) -> list[Any]:
        mig = self._mig(handle)
        out = []
        for p in procs:
            if mig is not None and (
                p.gpu_instance_id != mig.gpu_instance_id
                or p.compute_instance_id != mig.compute_instance_id
            ):
                continue
            struct = _real.c_nvmlProcessInfo_v3_t(
                pid=p.pid,
                usedGpuMemory=(
                    _real.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
                    if p.used_gpu_memory is None
                    else p.used_gpu_memory
                ),
                gpuInstanceId=p.gpu_instance_id,
                computeInstanceId=p.compute_instance_id,
            )
            obj = _real.nvmlStructToFriendlyObject(struct)
            if obj.usedGpuMemory == _real.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None
            out.append(obj)
        return out

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: FakeHandle) -> list[Any]:
        self._enter("nvmlDeviceGetComputeRunningProcesses_v3", handle)
        return self._procs(handle, self._gpu(handle).compute_processes)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        self._enter("nvmlDeviceGetComputeRunningProcesses", handle)
        return self.nvmlDeviceGetComputeRunningProcesses_v3(handle)

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: FakeHandle) -> list[Any]:
        self._enter("nvmlDeviceGetGraphicsRunningProcesses_v3", handle)
        return self._procs(handle, self._gpu(handle).graphics_processes)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        self._enter("nvmlDeviceGetGraphicsRunningProcesses", handle)
        return self.nvmlDeviceGetGraphicsRunningProcesses_v3(handle)

    # -- health: retired pages, remapped rows, recovery action, throttle, PCIe

    def nvmlDeviceGetRetiredPages(self, device: FakeHandle, sourceFilter: int) -> list[int]:
        self._enter("nvmlDeviceGetRetiredPages", device)
        gpu = self._parent_only(device)
        if gpu.retired_pages is None:
            _raise(_real.NVML_ERROR_NOT_SUPPORTED)
            raise AssertionError("unreachable")  # pragma: no cover
        if sourceFilter not in (
            _real.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            _real.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        ):
            _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
        return list(gpu.retired_pages.get(sourceFilter, []))

    def nvmlDeviceGetRetiredPages_v2(self, device: FakeHandle, sourceFilter: int) -> list[dict[str, int]]:
        self._enter("nvmlDeviceGetRetiredPages_v2", device)
        pages = self.nvmlDeviceGetRetiredPages(device, sourceFilter)
        return [{"address": a, "timestamp": 1_700_000_000_000_000 + n} for n, a in enumerate(pages)]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: FakeHandle) -> int:
        self._enter("nvmlDeviceGetRetiredPagesPendingStatus", device)
        gpu = self._parent_only(device)
        if gpu.retired_pages is None:
            _raise(_real.NVML_ERROR_NOT_SUPPORTED)
        return _real.NVML_FEATURE_ENABLED if gpu.retired_pending else _real.NVML_FEATURE_DISABLED

    def nvmlDeviceGetRemappedRows(self, device: FakeHandle) -> tuple[int, int, int, int]:
        self._enter("nvmlDeviceGetRemappedRows", device)
        gpu = self._parent_only(device)
        if gpu.remapped_rows is None:
            _raise(_real.NVML_ERROR_NOT_SUPPORTED)
            raise AssertionError("unreachable")  # pragma: no cover
        corr, unc, pending, failure = gpu.remapped_rows
        return (corr, unc, pending, failure)

    def _field(self, gpu: FakeGPU, field_id: int) -> tuple[int, int, int] | None:
        """(value type, value, scope) of a field the fake knows, or None (not supported)."""
        uint = _real.NVML_VALUE_TYPE_UNSIGNED_INT
        if field_id == _real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and gpu.recovery_action is not None:
            return (uint, gpu.recovery_action, 0)
        if gpu.remapped_rows is not None:
            corr, unc, pending, failure = gpu.remapped_rows
            remap = {
                _real.NVML_FI_DEV_REMAPPED_COR: corr,
                _real.NVML_FI_DEV_REMAPPED_UNC: unc,
                _real.NVML_FI_DEV_REMAPPED_PENDING: pending,
                _real.NVML_FI_DEV_REMAPPED_FAILURE: failure,
            }
            if field_id in remap:
                return (uint, remap[field_id], 0)
        if gpu.retired_pages is not None:
            retired = {
                _real.NVML_FI_DEV_RETIRED_SBE: len(
                    gpu.retired_pages.get(_real.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS, [])
                ),
                _real.NVML_FI_DEV_RETIRED_DBE: len(
                    gpu.retired_pages.get(_real.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR, [])
                ),
                _real.NVML_FI_DEV_RETIRED_PENDING: int(gpu.retired_pending),
            }
            if field_id in retired:
                return (_real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, retired[field_id], 0)
        return None

    def nvmlDeviceGetFieldValues(self, handle: FakeHandle, fieldIds: list[Any]) -> Any:
        self._enter("nvmlDeviceGetFieldValues", handle)
        gpu = self._parent_only(handle)
        values = (_real.c_nvmlFieldValue_t * len(fieldIds))()
        now_us = int(time.time() * 1_000_000)
        for i, fid in enumerate(fieldIds):
            try:
                field_id, scope = fid
            except TypeError:
                field_id, scope = fid, 0
            values[i].fieldId = field_id
            values[i].scopeId = scope
            values[i].timestamp = now_us
            known = self._field(gpu, field_id)
            if known is None:
                values[i].nvmlReturn = _real.NVML_ERROR_NOT_SUPPORTED
                continue
            vtype, value, _ = known
            values[i].valueType = vtype
            values[i].nvmlReturn = _real.NVML_SUCCESS
            if vtype == _real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
                values[i].value.ullVal = value
            else:
                values[i].value.uiVal = value
        return values

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetCurrentClocksEventReasons", handle)
        return self._parent_only(handle).throttle_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        return self._parent_only(handle).throttle_reasons

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetCurrPcieLinkGeneration", handle)
        return self._parent_only(handle).pcie[0]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetMaxPcieLinkGeneration", handle)
        return self._parent_only(handle).pcie[1]

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetCurrPcieLinkWidth", handle)
        return self._parent_only(handle).pcie[2]

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetMaxPcieLinkWidth", handle)
        return self._parent_only(handle).pcie[3]

    # -- events

    def nvmlEventSetCreate(self) -> FakeEventSet:
        self._enter("nvmlEventSetCreate")
        es = FakeEventSet()
        with self._events:
            self._event_sets.append(es)
        return es

    def nvmlDeviceGetSupportedEventTypes(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetSupportedEventTypes", handle)
        return self._gpu(handle).supported_events

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, eventTypes: int, eventSet: FakeEventSet) -> None:
        self._enter("nvmlDeviceRegisterEvents", handle)
        if handle.mig_slot is not None:
            # "This API does not currently support per-instance event reporting using MIG
            # device handles."
            _raise(_real.NVML_ERROR_NOT_SUPPORTED)
        if not isinstance(eventSet, FakeEventSet) or eventSet.freed:
            _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._gpu(handle)
        if eventTypes & ~gpu.supported_events:
            # "NVML_ERROR_NOT_SUPPORTED if the platform does not support this feature or some
            # of requested event types"
            _raise(_real.NVML_ERROR_NOT_SUPPORTED)
        with self._events:
            eventSet.registered[handle.gpu_index] = eventSet.registered.get(handle.gpu_index, 0) | eventTypes
        return None

    def nvmlEventSetWait_v2(self, eventSet: FakeEventSet, timeoutms: int) -> FakeEventData:
        self._enter("nvmlEventSetWait_v2")
        if not isinstance(eventSet, FakeEventSet):
            _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
        deadline = time.monotonic() + max(0, timeoutms) / 1000.0
        with self._events:
            while True:
                if eventSet.freed:
                    _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
                if eventSet.queue:
                    return eventSet.queue.popleft()
                if self.refcount <= 0:
                    _raise(_real.NVML_ERROR_UNINITIALIZED)
                left = deadline - time.monotonic()
                if self.wait_mode == "immediate" or left <= 0:
                    _raise(_real.NVML_ERROR_TIMEOUT)
                self._events.wait(left)

    def nvmlEventSetWait(self, eventSet: FakeEventSet, timeoutms: int) -> FakeEventData:
        self._enter("nvmlEventSetWait")
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet: FakeEventSet) -> None:
        self._enter("nvmlEventSetFree")
        if not isinstance(eventSet, FakeEventSet) or eventSet.freed:
            _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
        with self._events:
            eventSet.freed = True
            if eventSet in self._event_sets:
                self._event_sets.remove(eventSet)
            self._events.notify_all()
        return None

    @property
    def event_sets(self) -> int:
        """How many event sets are allocated (not freed)."""
        with self._events:
            return len(self._event_sets)


#: The public functions L{FakeNVML} implements (each also exists in C{pynvml}).
FAKE_FUNCTIONS: tuple[str, ...] = tuple(
    sorted(n for n in vars(FakeNVML) if n.startswith("nvml") and callable(vars(FakeNVML)[n]))
)

# The module-level names of the real bindings: error classes, constants, helpers.
for _name in dir(_real):
    if _name.startswith(
        ("NVML_", "NVMLError", "nvmlEventType", "nvmlClocksThrottleReason", "nvmlClocksEventReason")
    ) or _name in (
        "nvmlExceptionClass",
        "nvmlMemory_v2",
        "nvmlTemperature_v1",
        "nvmlFriendlyObject",
        "nvmlStructToFriendlyObject",
        "c_nvmlMemory_t",
        "c_nvmlMemory_v2_t",
        "c_nvmlUtilization_t",
        "nvmlPciInfo_t",
        "c_nvmlProcessInfo_t",
        "c_nvmlProcessInfo_v2_t",
        "c_nvmlProcessInfo_v3_t",
        "c_nvmlFieldValue_t",
        "c_nvmlValue_t",
        "c_nvmlEventData_t",
    ):
        setattr(FakeNVML, _name, getattr(_real, _name))
del _name


# ---------------------------------------------------------------------------- fixtures

_H100_NAME = "NVIDIA H100 80GB HBM3"
_H100_TOTAL = 81559 * MIB
_BUS_IDS = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")


def _uuid(n: int, prefix: str = "GPU") -> str:
    return f"{prefix}-{n:08x}-5a1e-4c3b-9d2f-{0xA0B0C0D00000 + n:012x}"


def h100_node() -> FakeNVML:
    """
    A ready-made 8 x H100 80GB node (driver 550.54.15, CUDA 12.4):

     - GPUs 0-3 run one tensor-parallel vLLM (pid 41234, 72 GiB each, 97 % busy);
     - GPU 4 runs a smaller compute process (pid 50211, 20 GiB) that also has a graphics
       context;
     - GPU 5 is idle;
     - GPU 6 has MIG enabled with two 3g.40gb instances (GI 1 and 2), each with a process;
     - GPU 7 has MIG enabled with three 2g.20gb instances (GI 3, 4, 5) and one 1g.10gb
       (GI 9), MIG pending disable;
     - GPU 3 has ECC errors (volatile corrected 12, aggregate corrected 340, aggregate
       uncorrected 1).
    """
    gpus: list[FakeGPU] = []
    for i in range(8):
        gpus.append(
            FakeGPU(
                name=_H100_NAME,
                uuid=_uuid(i),
                pci_bus_id=f"00000000:{_BUS_IDS[i]}:00.0",
                memory_total=_H100_TOTAL,
                memory_used=(1 * GIB) // 2,
                memory_reserved=(1 * GIB) // 2,
                temperature=32 + i,
                power_usage_mw=69_000 + i * 1000,
                power_limit_mw=700_000,
                mig_mode=(0, 0),
            )
        )
    for i in range(4):
        g = gpus[i]
        g.memory_used = 72 * GIB + GIB // 2
        g.utilization_gpu = 97
        g.utilization_memory = 45
        g.temperature = 58 + i
        g.power_usage_mw = 612_000 + i * 3_500
        g.compute_processes.append(FakeProcess(pid=41234, used_gpu_memory=72 * GIB))
    g4 = gpus[4]
    g4.memory_used = 20 * GIB + GIB // 2
    g4.utilization_gpu = 30
    g4.utilization_memory = 12
    g4.compute_processes.append(FakeProcess(pid=50211, used_gpu_memory=20 * GIB))
    g4.graphics_processes.append(FakeProcess(pid=50211, used_gpu_memory=20 * GIB))
    gpus[3].ecc_counts = {
        (_real.NVML_MEMORY_ERROR_TYPE_CORRECTED, _real.NVML_VOLATILE_ECC): 12,
        (_real.NVML_MEMORY_ERROR_TYPE_CORRECTED, _real.NVML_AGGREGATE_ECC): 340,
        (_real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, _real.NVML_AGGREGATE_ECC): 1,
    }

    g6 = gpus[6]
    g6.mig_mode = (1, 1)
    g6.memory_used = 30 * GIB
    for slot, gi in ((0, 1), (1, 2)):
        g6.mig_devices.append(
            FakeMigDevice(
                slot=slot,
                gpu_instance_id=gi,
                compute_instance_id=0,
                uuid=_uuid(600 + gi, "MIG"),
                name=f"{_H100_NAME} MIG 3g.40gb",
                memory_total=40448 * MIB,
                memory_used=15 * GIB,
            )
        )
        g6.compute_processes.append(
            FakeProcess(
                pid=60000 + gi,
                used_gpu_memory=14 * GIB,
                gpu_instance_id=gi,
                compute_instance_id=0,
            )
        )

    g7 = gpus[7]
    g7.mig_mode = (1, 0)
    g7.memory_used = 4 * GIB
    layout = (
        (0, 3, "2g.20gb", 20096),
        (1, 4, "2g.20gb", 20096),
        (2, 5, "2g.20gb", 20096),
        (5, 9, "1g.10gb", 9984),
    )
    for slot, gi, profile, mib in layout:
        g7.mig_devices.append(
            FakeMigDevice(
                slot=slot,
                gpu_instance_id=gi,
                compute_instance_id=0,
                uuid=_uuid(700 + gi, "MIG"),
                name=f"{_H100_NAME} MIG {profile}",
                memory_total=mib * MIB,
                memory_used=GIB if gi == 9 else 13 * MIB,
            )
        )
    g7.compute_processes.append(
        FakeProcess(
            pid=70009, used_gpu_memory=GIB - 64 * MIB, gpu_instance_id=9, compute_instance_id=0
        )
    )
    return FakeNVML(gpus)
