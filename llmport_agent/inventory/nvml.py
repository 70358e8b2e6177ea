# -*- test-case-name: tests.test_gpu,tests.test_gpu_health -*-
"""
NVIDIA GPUs through NVML (C{pynvml} from nvidia-ml-py 12 or 13): figures, health and events.

Rules kept here:

 - B{NVML may be missing.} Without the bindings, without C{libnvidia-ml}, or with a failing
   C{nvmlInit}, the snapshot has no devices (or only the ones seen before, marked
   unhealthy), names the reason in C{gpu_error}, and initialisation is retried with
   exponential backoff measured on the injected clock.
 - B{A hung call stops nothing.} Every call into NVML runs on a L{WatchdogPool} (daemon
   threads, its own, shared with nothing else): each device is probed by its own job with a
   deadline (C{call_timeout}). A device whose job does not return in time is I{unresponsive}
   (unhealthy, the hung call named) and is not asked again while that call hangs; the
   snapshot returns without it. How many calls may hang at once is bounded by the pool.
 - B{Identity outlives the device.} UUID, name, PCI bus id and memory total are cached from
   the last good read, so a lost GPU is still named.
 - B{Health.} Each pass reads ECC counters, retired pages, remapped rows, the recovery action
   (where the driver has the field), throttle reasons and the PCIe link into the
   L{HealthTracker}; L{NVMLGPUSource.wait_events} waits for Xid and other critical events.
 - B{Quiet logs.} Something is logged only when a state changes.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import importlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from attrs import evolve
from twisted.logger import Logger
from zope.interface import implementer

from llmport_agent.core.values import frozen
from llmport_agent.inventory.gpu import (
    _MAX_ERROR_TEXT,
    _ULL_NOT_AVAILABLE,
    GPUDevice,
    GPUProcess,
    GPUSnapshot,
    IGPUSource,
    MigInstance,
    _cuda_version,
    _instance_id,
    _int,
    _mode,
    _pct,
    _text,
    describe_error,
)
from llmport_agent.inventory.health import (
    DEGRADED,
    UNHEALTHY,
    DeviceHealth,
    EccErrors,
    HealthReading,
    HealthTracker,
    PcieLink,
    RemappedRows,
    RetiredPages,
)
from llmport_agent.inventory.watchdog import Job, PoolSaturated, WatchdogPool

__all__ = ["EventBatch", "NVMLGPUSource"]

# NVML return codes (stable C API values, identical in nvidia-ml-py 12 and 13).
_SUCCESS = 0
_UNINITIALIZED = 1
_INVALID_ARGUMENT = 2
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_NOT_FOUND = 6
_TIMEOUT = 10
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_RESET_REQUIRED = 16
_NO_DATA = 21

#: Codes that only mean "this device does not offer this": not supported, keep the verdict.
_BENIGN_CODES = frozenset(
    {_NOT_SUPPORTED, _NO_PERMISSION, _NOT_FOUND, _FUNCTION_NOT_FOUND, _NO_DATA}
)
#: Codes after which a device answers nothing more: stop asking it in this pass.
_DEVICE_GONE_CODES = frozenset({_GPU_IS_LOST, _RESET_REQUIRED})

# Event type bits (nvmlEventType*), stable C API values.
EV_SINGLE_BIT_ECC = 0x0001
EV_DOUBLE_BIT_ECC = 0x0002
EV_XID = 0x0008
EV_DRAM_RETIREMENT = 0x0400
EV_DRAM_RETIREMENT_FAILURE = 0x0800
EV_NON_FATAL_POISON = 0x1000
EV_FATAL_POISON = 0x2000
EV_GPU_UNAVAILABLE = 0x4000
EV_RECOVERY_ACTION = 0x8000

#: The events the agent registers for (where the device supports them). Single-bit ECC
#: events are left out on purpose: they are routine, and the counters carry them.
WANTED_EVENTS = (
    EV_XID
    | EV_DOUBLE_BIT_ECC
    | EV_DRAM_RETIREMENT
    | EV_DRAM_RETIREMENT_FAILURE
    | EV_NON_FATAL_POISON
    | EV_FATAL_POISON
    | EV_GPU_UNAVAILABLE
    | EV_RECOVERY_ACTION
)

_FI_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (R570+)
_CAUSE_SBE = 0  # NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
_CAUSE_DBE = 1  # NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR


class _NoLibrary(OSError):
    """C{libnvidia-ml.so.1} does not load (what pynvml calls NVML_ERROR_LIBRARY_NOT_FOUND)."""

    value = 12  # _LIBRARY_NOT_FOUND


def _import_pynvml() -> Any:
    """
    The bindings, imported only once the driver's library loads: a host without an NVIDIA
    driver never imports them (about 2 MiB), and says why at each (backed-off) retry.
    """
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as e:
        raise _NoLibrary(f"libnvidia-ml.so.1 does not load: {e}") from None
    return importlib.import_module("pynvml")


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


#: The base class of every ctypes pointer type, found through the public C{POINTER}.
_POINTER_BASE: Any = ctypes.POINTER(ctypes.c_char).__mro__[1]


def _handle_key(handle: Any) -> Any:
    """A hashable key naming the device behind a handle (the pointer for real handles)."""
    if handle is None:
        return None
    if isinstance(handle, _POINTER_BASE):
        address = ctypes.cast(handle, ctypes.c_void_p).value
        return ("nvml-device", address) if address else None
    try:
        hash(handle)
    except TypeError:
        return None
    return handle


class _Hung(Exception):
    """A global NVML call hangs (or too many calls hang)."""


@frozen
class EventBatch:
    """
    What one L{NVMLGPUSource.wait_events} call saw.

    @ivar state: C{ok}; C{not_ready} (NVML not initialised yet); C{unavailable} (NVML cannot
        be used: no library, no driver, initialisation failing; nothing to wait for until a
        health check initialises it); C{unsupported} (no device offers events: rely on the
        periodic checks).
    @ivar count: events handled.
    @ivar check: some event asks for an immediate health check.
    @ivar lost: the wait itself said a GPU is lost (back off, then check).
    """

    state: str = "ok"
    count: int = 0
    check: bool = False
    lost: bool = False


class _Probe:
    """
    Asks one device handle for one figure at a time, turning refusals into defaults.

    Benign refusals (not supported, not found, ...) land in C{unsupported}; other errors in
    C{errors} (group -> text); after C{GPU is lost} / C{reset required} the device is not
    asked again (C{gone}). C{answered} has the groups that answered. The NVML function in
    progress is written to the job (for the watchdog's message).
    """

    def __init__(
        self,
        nvml: Any,
        handle: Any,
        errors: dict[str, str],
        prefix: str = "",
        job: Job[Any] | None = None,
    ) -> None:
        self._nvml = nvml
        self._handle = handle
        self._errors = errors
        self._prefix = prefix
        self._job = job
        self._nvml_error: type[BaseException] = getattr(nvml, "NVMLError", Exception)
        self.gone = ""
        self.unsupported: set[str] = set()
        self.answered: set[str] = set()
        self.bugs: dict[str, str] = {}

    def note_error(self, key: str, text: str) -> None:
        """Record an error the caller found in an answer (C{key} as given, no prefix)."""
        self._errors[key] = text

    def has_error(self, key: str) -> bool:
        """Whether an error is recorded under C{key} (as given, no prefix)."""
        return key in self._errors

    def call(self, what: str, fname: str, *args: Any, default: Any = None) -> Any:
        if self.gone:
            return default
        fn = getattr(self._nvml, fname, None)
        if fn is None:  # older bindings without this function
            self.unsupported.add(what)
            return default
        if self._job is not None:
            self._job.current = fname
        try:
            value = fn(self._handle, *args)
        except self._nvml_error as e:
            code = _code(e)
            if code in _BENIGN_CODES:
                self.unsupported.add(what)
                return default
            if code in _DEVICE_GONE_CODES:
                self.gone = (
                    "the GPU is lost (fallen off the bus or otherwise inaccessible)"
                    if code == _GPU_IS_LOST
                    else "the GPU requires a reset"
                ) + f": NVML {fname} answered {describe_error(e)!r}"
            self._errors[self._prefix + what] = describe_error(e)
            return default
        except Exception as e:  # a binding bug must not sink the snapshot
            # Named in the device's error, but not a verdict: the driver did not refuse.
            self.bugs[self._prefix + what] = f"{type(e).__name__}: {describe_error(e)}"
            return default
        finally:
            if self._job is not None:
                self._job.current = ""
        self.answered.add(what)
        return value


@frozen
class _DeviceResult:
    device: GPUDevice | None
    reading: HealthReading
    problems: frozenset[str]


@frozen
class _Unresponsive:
    what: str


@implementer(IGPUSource)
class NVMLGPUSource:
    """
    NVIDIA GPUs through NVML (C{pynvml} from nvidia-ml-py 12 or 13).

    Thread-safe: snapshots and health checks are serialised by a lock (each bounded by the
    watchdog); L{wait_events} runs beside them on its own thread.

    @param nvml: the C{pynvml} module (or a faithful fake); imported on first use when
        C{None}.
    @param clock: monotonic seconds, used for the initialisation backoff.
    @param importer: how to import C{pynvml} when C{nvml} is C{None} (tests).
    @param initial_backoff: seconds before the first retry of a failed initialisation;
        doubles after each failure up to C{max_backoff}.
    @param call_timeout: seconds a device's pass (or a global call) may take before the
        device counts as unresponsive.
    @param pool: the watchdog pool NVML calls run on (its own by default).
    @param tracker: the health tracker (its own by default).
    @param ignored_xids: Xids counted as application errors, on top of the built-in ones.
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
        call_timeout: float = 10.0,
        pool: WatchdogPool | None = None,
        tracker: HealthTracker | None = None,
        ignored_xids: Iterable[int] = (),
    ) -> None:
        self._nvml = nvml
        self._importer = importer
        self._clock = clock
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self.call_timeout = call_timeout
        self.pool = pool if pool is not None else WatchdogPool("nvml", max_threads=16)
        self.tracker = (
            tracker
            if tracker is not None
            else HealthTracker(clock=clock, ignored_xids=ignored_xids, vendor_label="NVML")
        )
        self._lock = threading.Lock()
        self._initialized = False
        self._session = 0
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
        self._device_jobs: dict[int, Job[Any]] = {}
        self._global_job: Job[Any] | None = None
        self._unexpected_logged = False
        self._hung_logged = False
        # events
        self._events_lock = threading.Lock()
        self._event_set: Any = None
        self._event_session = -1
        self._events_state = "not_ready"
        self._handle_index: dict[Any, int] = {}
        self._registration_errors: dict[int, str] = {}

    # -- IGPUSource

    def snapshot(self) -> GPUSnapshot:
        with self._lock:
            try:
                snap = self._pass(full=True)
            except Exception as e:  # belt and braces: never fail the caller
                if not self._unexpected_logged:
                    self._unexpected_logged = True
                    self.log.failure("GPU snapshot failed unexpectedly")
                return self._unavailable(f"GPU snapshot failed: {describe_error(e)}")
            assert snap is not None
            return snap

    def check_health(self) -> None:
        """Read the health figures of every device (fewer calls than a snapshot)."""
        with self._lock:
            try:
                self._pass(full=False)
            except Exception:
                if not self._unexpected_logged:
                    self._unexpected_logged = True
                    self.log.failure("GPU health check failed unexpectedly")

    def health(self) -> Mapping[int, DeviceHealth]:
        return self.tracker.health()

    def close(self) -> None:
        """
        Free the event set and call C{nvmlShutdown} when initialised (not while NVML calls
        hang: that could only make things worse). A later L{snapshot} initialises again.
        """
        with self._lock:
            if not self._initialized:
                return
            self._free_event_set()
            stuck = self.pool.stuck_jobs()
            self._initialized = False
            self._state = "new"
            self._next_attempt = None
            self._delay = self._initial_backoff
            if stuck:
                self.log.warn(
                    "Not shutting NVML down: {count} NVML call(s) still hang ({calls})",
                    count=len(stuck),
                    calls=", ".join(j.doing() for j in stuck[:4]),
                )
                return
            try:
                self._global("nvmlShutdown", self._nvml.nvmlShutdown)
            except Exception:
                pass

    # -- state

    @property
    def failing(self) -> bool:
        """True while NVML cannot be used."""
        return self._state == "failing"

    @property
    def next_attempt(self) -> float | None:
        """Clock time of the next initialisation attempt while failing, else C{None}."""
        return self._next_attempt if self._state == "failing" else None

    @property
    def retry_in(self) -> float | None:
        """Seconds until the next initialisation attempt while failing, else C{None}."""
        if self._state != "failing" or self._next_attempt is None:
            return None
        return max(0.0, self._next_attempt - self._clock())

    @property
    def events_state(self) -> str:
        """C{ok}, C{not_ready}, C{unavailable} or C{unsupported} (see L{EventBatch})."""
        return self._events_state

    # -- watchdog

    def _global(self, label: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one global NVML call on the pool, bounded by C{call_timeout}."""
        prev = self._global_job
        if prev is not None and not prev.done:
            raise _Hung(f"NVML call {prev.doing()} has not returned for {prev.age:.0f} s")
        job: Job[Any] = Job(label, self.call_timeout, time.monotonic)
        job.current = label
        try:
            self.pool.submit(fn, *args, deadline=self.call_timeout, job=job)
        except PoolSaturated as e:
            raise _Hung(str(e)) from None
        self._global_job = job
        try:
            return job.future.result(timeout=self.call_timeout)
        except concurrent.futures.TimeoutError:
            self.pool.note_timeout()
            raise _Hung(f"NVML call {label} did not return within {self.call_timeout:g} s") from None

    def _run_devices(self, count: int, full: bool) -> dict[int, _DeviceResult | _Unresponsive]:
        out: dict[int, _DeviceResult | _Unresponsive] = {}
        jobs: dict[int, Job[_DeviceResult]] = {}
        for i in range(count):
            prev = self._device_jobs.get(i)
            if prev is not None and not prev.done:
                out[i] = _Unresponsive(
                    f"NVML call {prev.current or prev.label} on GPU {i} has not returned for "
                    f"{prev.age:.0f} s"
                )
                continue
            job: Job[_DeviceResult] = Job(f"GPU {i}", self.call_timeout, time.monotonic)
            try:
                self.pool.submit(self._probe_device, i, full, job, deadline=self.call_timeout, job=job)
            except PoolSaturated as e:
                out[i] = _Unresponsive(str(e))
                continue
            self._device_jobs[i] = job
            jobs[i] = job
        if jobs:
            concurrent.futures.wait([j.future for j in jobs.values()], timeout=self.call_timeout)
        for i, job in jobs.items():
            if job.done:
                exc = job.future.exception()
                if exc is None:
                    out[i] = job.future.result()
                else:
                    text = f"{type(exc).__name__}: {describe_error(exc)}"
                    out[i] = _DeviceResult(
                        None, HealthReading(errors={"probe": text}), frozenset({"probe"})
                    )
            else:
                self.pool.note_timeout()
                out[i] = _Unresponsive(
                    f"NVML call {job.current or job.label} on GPU {i} did not return within "
                    f"{self.call_timeout:g} s"
                )
        return out

    # -- passes

    def _unavailable(self, error: str) -> GPUSnapshot:
        """No live figures: the devices seen before (unhealthy), or none."""
        devices = tuple(self._cached(i, error) for i in self.tracker.known_indexes())
        return GPUSnapshot(
            vendor="nvidia" if self._seen_devices else "none",
            devices=devices,
            driver_version=self._driver_version,
            cuda_driver_version=self._cuda_driver_version,
            nvml_version=self._nvml_version,
            gpu_error=error,
            source="nvml",
        ).with_health(self.tracker.health())

    def _cached(self, index: int, error: str = "") -> GPUDevice:
        ident = self.tracker.identity(index)
        return GPUDevice(
            index=index,
            uuid=str(ident.get("uuid", "")),
            name=str(ident.get("name", "")),
            pci_bus_id=str(ident.get("pci_bus_id", "")),
            memory_total_bytes=int(ident.get("memory_total_bytes", 0) or 0),
            driver_version=self._driver_version,
            cuda_driver_version=self._cuda_driver_version,
            error=error[:_MAX_ERROR_TEXT],
        )

    def _mark_known(self, why: str, *, unresponsive: bool = False) -> None:
        for i in self.tracker.known_indexes():
            if unresponsive:
                self.tracker.observe_unresponsive(i, why)
            else:
                self.tracker.observe_unavailable(i, why)

    def _pass(self, full: bool) -> GPUSnapshot | None:
        if not self._initialized and not self._try_init():
            if self._seen_devices:
                self._mark_known(f"NVML is not available: {self._error}")
            return self._unavailable(self._error) if full else None
        nvml = self._nvml
        try:
            count = _int(self._global("nvmlDeviceGetCount", nvml.nvmlDeviceGetCount))
        except _Hung as e:
            error = f"NVML is not answering: {e}"
            self._mark_known(str(e), unresponsive=True)
            if not self._hung_logged:
                self._hung_logged = True
                self.log.warn("{error}; GPUs are reported unresponsive", error=error)
            return self._unavailable(error) if full else None
        except Exception as e:
            # The session itself broke (driver unloaded or upgraded under us): start over.
            self._initialized = False
            self._free_event_set()
            self._shutdown_quietly()
            self._enter_failing(f"NVML stopped answering: {describe_error(e)}")
            self._mark_known(self._error)
            return self._unavailable(self._error) if full else None
        self._hung_logged = False
        results = self._run_devices(count, full)
        devices: list[GPUDevice] = []
        problems: dict[int, frozenset[str]] = {}
        for i in range(count):
            r = results[i]
            if isinstance(r, _Unresponsive):
                self.tracker.observe_unresponsive(i, r.what)
                device = self._cached(i, r.what)
                problems[i] = frozenset({"unresponsive"})
            else:
                self.tracker.observe_reading(i, r.reading)
                device = r.device if r.device is not None else self._cached(i)
                if r.device is not None and not device.uuid:
                    # A lost GPU answers nothing: name it from its last good read.
                    cached = self._cached(i)
                    device = evolve(
                        device,
                        uuid=cached.uuid,
                        name=device.name or cached.name,
                        pci_bus_id=device.pci_bus_id or cached.pci_bus_id,
                        memory_total_bytes=device.memory_total_bytes or cached.memory_total_bytes,
                    )
                problems[i] = r.problems
            devices.append(device)
        for i in self.tracker.indexes_beyond(count):
            self.tracker.observe_missing(
                i, f"GPU {i} is no longer enumerated by NVML ({count} GPU(s) are)"
            )
            devices.append(self._cached(i, "not enumerated by NVML"))
        self._unexpected_logged = False
        if not full:
            return None
        self._note_changes(count, tuple(devices), problems)
        if count:
            self._seen_devices = True
        return GPUSnapshot(
            vendor="nvidia" if devices else "none",
            devices=tuple(devices),
            driver_version=self._driver_version,
            cuda_driver_version=self._cuda_driver_version,
            nvml_version=self._nvml_version,
            gpu_error="",
            source="nvml",
        ).with_health(self.tracker.health())

    # -- initialisation

    def _init_job(self) -> None:
        if self._nvml is None:
            self._nvml = self._importer()
        self._nvml.nvmlInit()

    def _try_init(self) -> bool:
        now = self._clock()
        if self._next_attempt is not None and now < self._next_attempt:
            return False
        try:
            self._global("nvmlInit", self._init_job)
        except ImportError:
            self._enter_failing("NVML Python bindings (pynvml, nvidia-ml-py) are not installed")
            return False
        except _Hung as e:
            self._enter_failing(f"NVML initialisation hangs: {e}")
            return False
        except Exception as e:
            if _code(e) == _LIBRARY_NOT_FOUND:
                reason = (
                    "NVML library (libnvidia-ml.so.1) not found: "
                    "no NVIDIA driver is installed on this node"
                )
            else:
                reason = f"NVML initialisation failed: {describe_error(e)}"
            self._enter_failing(reason)
            return False
        self._initialized = True
        self._session += 1
        try:
            self._global("system info", self._read_system_info)
        except Exception:
            pass
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
            self._global("nvmlShutdown", self._nvml.nvmlShutdown)
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

    # -- devices (these run on watchdog threads: no shared state is written)

    def _probe_device(self, index: int, full: bool, job: Job[Any] | None = None) -> _DeviceResult:
        nvml = self._nvml
        if job is not None:
            job.current = "nvmlDeviceGetHandleByIndex"
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as e:
            text = describe_error(e)
            gone = f"NVML gives no handle for the GPU: {text}"
            bare = GPUDevice(
                index=index,
                driver_version=self._driver_version,
                cuda_driver_version=self._cuda_driver_version,
                error=f"handle: {text}",
            )
            return _DeviceResult(bare if full else None, HealthReading(gone=gone), frozenset({"handle"}))
        errors: dict[str, str] = {}
        p = _Probe(nvml, handle, errors, job=job)
        identity: dict[str, Any] = {}
        device: GPUDevice | None = None
        values: dict[str, Any] = {}
        if full:
            device = self._figures(p, index, errors)
            if not p.gone and device.uuid:
                identity = {
                    "uuid": device.uuid,
                    "name": device.name,
                    "pci_bus_id": device.pci_bus_id,
                    "memory_total_bytes": device.memory_total_bytes,
                }
            ecc_mode = device.ecc_mode
        else:
            # The UUID tells a GPU swapped at this index; the rest only until first known.
            uuid = _text(p.call("uuid", "nvmlDeviceGetUUID"))
            if uuid:
                identity = {"uuid": uuid}
                if not self.tracker.identity(index):
                    pci = p.call("pci", "nvmlDeviceGetPciInfo")
                    mem = p.call("memory", "nvmlDeviceGetMemoryInfo")
                    identity.update(
                        name=_text(p.call("name", "nvmlDeviceGetName")),
                        pci_bus_id=_text(getattr(pci, "busId", b"")),
                        memory_total_bytes=_int(getattr(mem, "total", 0)),
                    )
            ecc_mode_raw = p.call("ecc_mode", "nvmlDeviceGetEccMode")
            ecc_mode = (
                _mode(ecc_mode_raw[0])
                if isinstance(ecc_mode_raw, list | tuple) and ecc_mode_raw
                else ""
            )
        values.update(self._health_values(p, ecc_mode))
        if device is not None:
            device = evolve(
                device,
                ecc_errors=values.get("ecc", EccErrors()),
                retired_pages=values.get("retired_pages", RetiredPages()),
                remapped_rows=values.get("remapped_rows", RemappedRows()),
                recovery_action=values.get("recovery_action", 0),
                throttle_reasons=values.get("throttle", 0),
                pcie=values.get("pcie", PcieLink()),
                error="; ".join(f"{k}: {v}" for k, v in sorted({**p.bugs, **errors}.items()))[
                    :_MAX_ERROR_TEXT
                ],
            )
        answered = {w: True for w in p.answered if w not in values}
        answered.update(values)
        reading = HealthReading(
            values=answered,
            unsupported=frozenset(p.unsupported - p.answered),
            errors=dict(errors),
            gone=p.gone,
            identity=identity,
        )
        return _DeviceResult(device, reading, frozenset(errors) | frozenset(p.bugs))

    def _figures(self, p: _Probe, index: int, errors: dict[str, str]) -> GPUDevice:
        nvml = self._nvml
        name = _text(p.call("name", "nvmlDeviceGetName"))
        uuid = _text(p.call("uuid", "nvmlDeviceGetUUID"))
        pci = p.call("pci", "nvmlDeviceGetPciInfo")
        pci_bus_id = _text(getattr(pci, "busId", b"")) or _text(getattr(pci, "busIdLegacy", b""))
        mem = p.call("memory", "nvmlDeviceGetMemoryInfo")
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
            instances = self._mig_instances(p, errors)
        ecc_mode_raw = p.call("ecc_mode", "nvmlDeviceGetEccMode")
        ecc_mode = ""
        if isinstance(ecc_mode_raw, list | tuple) and ecc_mode_raw:
            ecc_mode = _mode(ecc_mode_raw[0])
        processes = self._processes(p)
        return GPUDevice(
            index=index,
            vendor="nvidia",
            uuid=uuid,
            name=name,
            pci_bus_id=pci_bus_id,
            driver_version=self._driver_version,
            cuda_driver_version=self._cuda_driver_version,
            memory_total_bytes=_int(getattr(mem, "total", 0)),
            memory_used_bytes=_int(getattr(mem, "used", 0)),
            memory_free_bytes=_int(getattr(mem, "free", 0)),
            utilization_pct=_pct(getattr(util, "gpu", 0)),
            memory_utilization_pct=_pct(getattr(util, "memory", 0)),
            temperature_c=_int(temp),
            power_draw_w=power_mw / 1000.0,
            power_limit_w=limit_mw / 1000.0,
            mig_mode_current=mig_current,
            mig_mode_pending=mig_pending,
            mig_instances=instances,
            ecc_mode=ecc_mode,
            processes=processes,
        )

    def _health_values(self, p: _Probe, ecc_mode: str) -> dict[str, Any]:
        """The health groups this device answers (see L{HealthReading})."""
        nvml = self._nvml
        values: dict[str, Any] = {}
        if ecc_mode != "disabled":
            ecc = self._ecc(p)
            if ecc is not None:
                values["ecc"] = ecc
        sbe = p.call("retired_pages", "nvmlDeviceGetRetiredPages", _CAUSE_SBE)
        if sbe is not None:
            dbe = p.call("retired_pages", "nvmlDeviceGetRetiredPages", _CAUSE_DBE)
            pending = p.call("retired_pages", "nvmlDeviceGetRetiredPagesPendingStatus")
            values["retired_pages"] = RetiredPages(
                single_bit=len(sbe) if isinstance(sbe, list | tuple) else 0,
                double_bit=len(dbe) if isinstance(dbe, list | tuple) else 0,
                pending=_int(pending) == 1,
            )
        rows = p.call("remapped_rows", "nvmlDeviceGetRemappedRows")
        if isinstance(rows, list | tuple) and len(rows) == 4:
            values["remapped_rows"] = RemappedRows(
                correctable=_int(rows[0]),
                uncorrectable=_int(rows[1]),
                pending=bool(_int(rows[2])),
                failure=bool(_int(rows[3])),
            )
        fid = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", _FI_RECOVERY_ACTION)
        fields = p.call("recovery_action", "nvmlDeviceGetFieldValues", [fid])
        if fields is not None:
            try:
                fv = fields[0]
                ret = _int(fv.nvmlReturn)
                if ret == _SUCCESS:
                    values["recovery_action"] = _int(fv.value.uiVal)
                elif ret in _BENIGN_CODES:
                    p.answered.discard("recovery_action")
                    p.unsupported.add("recovery_action")
                else:
                    p.answered.discard("recovery_action")
                    p.note_error("recovery_action", _field_error(nvml, ret))
            except (IndexError, AttributeError, TypeError):
                p.answered.discard("recovery_action")
                p.unsupported.add("recovery_action")
        throttle = p.call("throttle", "nvmlDeviceGetCurrentClocksEventReasons")
        if throttle is None and not p.has_error("throttle"):
            throttle = p.call("throttle", "nvmlDeviceGetCurrentClocksThrottleReasons")
        if throttle is not None:
            values["throttle"] = _int(throttle)
        gen = p.call("pcie", "nvmlDeviceGetCurrPcieLinkGeneration")
        if gen is not None:
            values["pcie"] = PcieLink(
                generation=_int(gen),
                max_generation=_int(p.call("pcie", "nvmlDeviceGetMaxPcieLinkGeneration", default=0)),
                width=_int(p.call("pcie", "nvmlDeviceGetCurrPcieLinkWidth", default=0)),
                max_width=_int(p.call("pcie", "nvmlDeviceGetMaxPcieLinkWidth", default=0)),
            )
        return values

    def _mig_instances(self, parent: _Probe, errors: dict[str, str]) -> tuple[MigInstance, ...]:
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

    def _ecc(self, p: _Probe) -> EccErrors | None:
        """The four ECC counters, or C{None} when the uncorrected volatile one is refused."""
        nvml = self._nvml
        corrected = getattr(nvml, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
        uncorrected = getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
        volatile = getattr(nvml, "NVML_VOLATILE_ECC", 0)
        aggregate = getattr(nvml, "NVML_AGGREGATE_ECC", 1)

        def count(etype: int, ctype: int) -> int | None:
            value = p.call("ecc", "nvmlDeviceGetTotalEccErrors", etype, ctype)
            return None if value is None else _int(value)

        vol_unc = count(uncorrected, volatile)
        if vol_unc is None:
            return None
        return EccErrors(
            volatile_corrected=count(corrected, volatile) or 0,
            volatile_uncorrected=vol_unc,
            aggregate_corrected=count(corrected, aggregate) or 0,
            aggregate_uncorrected=count(uncorrected, aggregate) or 0,
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

    def _note_changes(
        self, count: int, devices: tuple[GPUDevice, ...], problems: dict[int, frozenset[str]]
    ) -> None:
        if self._last_count is not None and count != self._last_count:
            self.log.warn(
                "GPU count changed from {old_count} to {gpu_count}",
                old_count=self._last_count,
                gpu_count=count,
            )
        self._last_count = count
        for d in devices:
            fields = problems.get(d.index, frozenset())
            before = self._device_problems.get(d.index, frozenset())
            if fields == before:
                continue
            if fields:
                self.log.warn(
                    "{gpu} reports NVML errors: {errors}",
                    gpu=d.describe(),
                    index=d.index,
                    uuid=d.uuid,
                    errors=d.error,
                )
            else:
                self.log.info(
                    "{gpu} reports no NVML errors any more",
                    gpu=d.describe(),
                    index=d.index,
                    uuid=d.uuid,
                )
        self._device_problems = {d.index: problems.get(d.index, frozenset()) for d in devices}

    # -- events

    def wait_events(
        self,
        timeout_ms: int = 500,
        max_events: int = 100,
        rounds: int = 1,
        stop: threading.Event | None = None,
    ) -> EventBatch:
        """
        Wait up to C{timeout_ms} for driver events, then take what else is queued, up to
        C{max_events}, and feed them to the tracker. Blocks: run it on its own thread.
        Creates and registers the event set on first use (and after NVML re-initialises).

        @param rounds: short waits to make while none brings an event (the thread goes
            around instead of returning empty after each one).
        @param stop: set by the caller to end the rounds after the current short wait.
        """
        es = self._ensure_event_set()
        if es is None:
            return EventBatch(state=self._events_state)
        nvml = self._nvml
        nvml_error: type[BaseException] = getattr(nvml, "NVMLError", Exception)
        handled = 0
        check = False
        lost = False
        left = max(1, rounds)
        while handled < max_events:
            try:
                data = nvml.nvmlEventSetWait(es, timeout_ms if handled == 0 else 0)
            except nvml_error as e:
                code = _code(e)
                if code == _TIMEOUT:
                    left -= 1
                    if handled == 0 and left > 0 and not (stop is not None and stop.is_set()):
                        continue  # quiet: wait again here, not via the reactor
                    break
                if code == _GPU_IS_LOST:
                    lost = check = True
                    break
                if code in (_UNINITIALIZED, _INVALID_ARGUMENT):
                    # The set (or the session) went away under us: make a new one next time.
                    with self._events_lock:
                        if self._event_set is es:
                            self._event_set = None
                    break
                raise
            handled += 1
            check = self._handle_event(data) or check
        return EventBatch(state="ok", count=handled, check=check, lost=lost)

    def _handle_event(self, data: Any) -> bool:
        """Feed one event to the tracker; True when it asks for a health check."""
        etype = _int(getattr(data, "eventType", 0))
        index = self._handle_index.get(_handle_key(getattr(data, "device", None)))
        payload = _int(getattr(data, "eventData", 0))
        if etype & EV_XID:
            gi = _instance_id(getattr(data, "gpuInstanceId", None))
            ci = _instance_id(getattr(data, "computeInstanceId", None))
            self.tracker.observe_xid(index, payload, gi, ci)
            return False
        if etype & EV_DOUBLE_BIT_ECC:
            self.tracker.observe_fatal(index, "event:dbe", UNHEALTHY, "double-bit ECC error reported by the driver")
        elif etype & EV_DRAM_RETIREMENT_FAILURE:
            self.tracker.observe_fatal(index, "event:retirement", UNHEALTHY, "page retirement failed")
        elif etype & EV_FATAL_POISON:
            self.tracker.observe_fatal(
                index, "event:poison", UNHEALTHY, "fatal poison error (uncontained memory corruption)"
            )
        elif etype & EV_NON_FATAL_POISON:
            self.tracker.observe_fatal(index, "event:poison-contained", DEGRADED, "contained poison error")
        elif etype & EV_GPU_UNAVAILABLE:
            self.tracker.observe_unavailable(index, "the driver reported the GPU unavailable")
        return True

    def _ensure_event_set(self) -> Any:
        with self._events_lock:
            if not self._initialized:
                self._events_state = "unavailable" if self._state == "failing" else "not_ready"
                return None
            if self._event_set is not None and self._event_session == self._session:
                return self._event_set
            if self._events_state == "unsupported" and self._event_session == self._session:
                return None
            old, self._event_set = self._event_set, None
            if old is not None:
                try:
                    self._nvml.nvmlEventSetFree(old)
                except Exception:
                    pass
            es, registered = self._register_events()
            self._event_session = self._session
            if es is None or not registered:
                if es is not None:
                    try:
                        self._nvml.nvmlEventSetFree(es)
                    except Exception:
                        pass
                if self._events_state != "unsupported":
                    self.log.info(
                        "No GPU here offers NVML events; health relies on periodic checks"
                    )
                self._events_state = "unsupported"
                return None
            self._event_set = es
            self._events_state = "ok"
            return es

    def _register_events(self) -> tuple[Any, int]:
        nvml = self._nvml
        nvml_error: type[BaseException] = getattr(nvml, "NVMLError", Exception)
        try:
            es = nvml.nvmlEventSetCreate()
        except nvml_error as e:
            if _code(e) in _BENIGN_CODES:
                return None, 0
            raise
        registered = 0
        handles: dict[Any, int] = {}
        errors: dict[int, str] = {}
        for i in range(_int(nvml.nvmlDeviceGetCount())):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                supported = _int(nvml.nvmlDeviceGetSupportedEventTypes(handle))
                mask = WANTED_EVENTS & supported
                if not mask:
                    continue
                nvml.nvmlDeviceRegisterEvents(handle, mask, es)
            except nvml_error as e:
                if _code(e) in _BENIGN_CODES:
                    continue
                errors[i] = describe_error(e)
                continue
            key = _handle_key(handle)
            if key is not None:
                handles[key] = i
            registered += 1
        self._handle_index = handles
        for i, text in errors.items():
            self.tracker.observe_query_error(i, "events", f"registering for events failed: {text}")
        for i in set(self._registration_errors) - set(errors):
            self.tracker.observe_query_ok(i, "events")
        self._registration_errors = errors
        if errors:
            self.log.warn(
                "Registering NVML events failed for GPU(s) {gpus}: {errors}",
                gpus=", ".join(str(i) for i in sorted(errors)),
                errors="; ".join(f"GPU {i}: {t}" for i, t in sorted(errors.items())),
            )
        return es, registered + len(errors)

    def reregister_events(self) -> None:
        """Build the event set again at the next wait (e.g. after GPUs came back)."""
        with self._events_lock:
            self._event_session = -1
            if self._events_state == "unsupported":
                self._events_state = "not_ready"

    def _free_event_set(self) -> None:
        with self._events_lock:
            es, self._event_set = self._event_set, None
            self._event_session = -1
            self._events_state = "not_ready"
        if es is not None:
            try:
                self._global("nvmlEventSetFree", self._nvml.nvmlEventSetFree, es)
            except Exception:
                pass


def _field_error(nvml: Any, code: int) -> str:
    cls = getattr(nvml, "NVMLError", None)
    try:
        return describe_error(cls(code)) if cls is not None else f"NVML error code {code}"
    except Exception:
        return f"NVML error code {code}"
