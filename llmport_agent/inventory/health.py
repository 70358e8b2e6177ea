# -*- test-case-name: tests.test_gpu_health -*-
"""
GPU health: one verdict per device (C{healthy}, C{degraded}, C{unhealthy}) with reasons,
from driver events (Xid errors) and periodic readings (ECC counters, retired pages, remapped
rows, the driver's recovery action, throttle reasons, the PCIe link, query errors).

L{HealthTracker} is vendor-neutral and thread-safe: GPU sources feed it from worker threads
(L{HealthTracker.observe_reading}, L{HealthTracker.observe_xid}, ...) and the reactor side
reads verdicts (L{HealthTracker.health}) and drains transitions (L{HealthTracker.drain}).

The rules (docs/gpus.md, "GPU health", says the same):

 - B{Fail closed.} A query the driver answers with an error (anything but "not supported"
   and its kin) makes the GPU unhealthy until the same query answers again. A lost GPU
   (C{GPU_IS_LOST}), one that requires a reset (C{RESET_REQUIRED}), one whose call hangs
   (unresponsive) or one the driver no longer enumerates is unhealthy.
 - B{Not supported keeps the previous verdict.} A group of figures the device does not offer
   (now) leaves what that group said before unchanged.
 - B{Xid errors and fatal events stick.} Their verdict lasts until the GPU is seen reset:
   it answered C{GPU_IS_LOST}/C{RESET_REQUIRED} (or the driver called it unavailable) and now
   answers again, or its volatile ECC counters went down (a reset or driver reload zeroes
   them), or its recovery action went from something back to none. Application Xids (13, 31,
   43, 45, 68, 69, 109 and the operator's C{GPU_IGNORED_XIDS}) are counted, never a verdict.
 - B{Transitions only.} A transition is recorded when a device's verdict changes (and when a
   device is first seen not healthy), never on every reading.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar, cast

from attrs import field

from llmport_agent.core.values import frozen

__all__ = [
    "APPLICATION_XIDS",
    "DEGRADED",
    "HEALTHY",
    "UNHEALTHY",
    "XID_CATALOG",
    "DeviceHealth",
    "EccErrors",
    "HealthReading",
    "HealthTracker",
    "PcieLink",
    "RemappedRows",
    "RetiredPages",
    "Transition",
    "classify_xid",
]

HEALTHY = "healthy"
DEGRADED = "degraded"
UNHEALTHY = "unhealthy"
_RANK = {HEALTHY: 0, DEGRADED: 1, UNHEALTHY: 2}

#: Xid -> (verdict or None for "application error, counted only", short name), after
#: NVIDIA's Xid catalog. Unknown Xids make a GPU degraded.
XID_CATALOG: dict[int, tuple[str | None, str]] = {
    8: (DEGRADED, "GPU stopped processing (driver watchdog)"),
    13: (None, "graphics engine exception"),
    31: (None, "GPU memory page fault"),
    32: (DEGRADED, "invalid or corrupted push buffer stream"),
    38: (DEGRADED, "driver firmware error"),
    43: (None, "GPU stopped processing"),
    45: (None, "preemptive cleanup after previous errors"),
    48: (UNHEALTHY, "double-bit ECC error"),
    56: (DEGRADED, "display engine error"),
    57: (DEGRADED, "error programming video memory interface"),
    61: (DEGRADED, "internal micro-controller breakpoint/warning"),
    62: (UNHEALTHY, "internal micro-controller halt"),
    63: (DEGRADED, "ECC page retirement or row remapping recorded"),
    64: (UNHEALTHY, "ECC page retirement or row remapping failed"),
    68: (None, "video decoder exception"),
    69: (None, "graphics engine class error"),
    74: (UNHEALTHY, "NVLink error"),
    79: (UNHEALTHY, "GPU has fallen off the bus"),
    92: (DEGRADED, "high single-bit ECC error rate"),
    94: (DEGRADED, "contained ECC error"),
    95: (UNHEALTHY, "uncontained ECC error"),
    109: (None, "context switch timeout"),
    119: (UNHEALTHY, "GSP RPC timeout"),
    120: (UNHEALTHY, "GSP error"),
    121: (DEGRADED, "C2C link corrected error"),
    123: (UNHEALTHY, "SPI PMU RPC write failure"),
    140: (UNHEALTHY, "unrecovered ECC error"),
    143: (UNHEALTHY, "GPU initialization failure"),
    154: (UNHEALTHY, "GPU recovery action changed"),
}

#: Xids that are application errors: counted, never a verdict (as NVIDIA's device plugin).
APPLICATION_XIDS = frozenset(x for x, (verdict, _) in XID_CATALOG.items() if verdict is None)

#: NVML's C{nvmlGpuRecoveryAction_t} values -> (verdict, what the driver asks for).
RECOVERY_ACTIONS: dict[int, tuple[str, str]] = {
    0: (HEALTHY, "none"),
    1: (UNHEALTHY, "a GPU reset"),
    2: (UNHEALTHY, "a node reboot"),
    3: (DEGRADED, "draining peer-to-peer traffic"),
    4: (UNHEALTHY, "draining the GPU and a reset"),
    5: (DEGRADED, "recovering the IMEX domain"),
    6: (UNHEALTHY, "a PCIe bus reset"),
    7: (UNHEALTHY, "a system reboot"),
}

#: Throttle (clock event) reason bits that signal a hardware or thermal problem.
THROTTLE_BITS: dict[int, str] = {
    0x08: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
}

_MAX_DISTINCT_XIDS = 32
_RECENT_XIDS = 8
_MAX_REASON = 200


def classify_xid(xid: int, ignored: Iterable[int] = ()) -> tuple[str | None, str]:
    """(verdict or C{None} for counted-only, short name) of an Xid."""
    verdict, name = XID_CATALOG.get(xid, (DEGRADED, "unlisted Xid"))
    if xid in ignored:
        verdict = None
    return verdict, name


# ------------------------------------------------------------------------------ values


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
class RetiredPages:
    """Pages retired because of single-/double-bit ECC errors, and whether some are pending."""

    single_bit: int = 0
    double_bit: int = 0
    pending: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"single_bit": self.single_bit, "double_bit": self.double_bit, "pending": self.pending}


@frozen
class RemappedRows:
    """Memory rows remapped (Ampere and later), a remapping pending a reset, or failed."""

    correctable: int = 0
    uncorrectable: int = 0
    pending: bool = False
    failure: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "correctable": self.correctable,
            "uncorrectable": self.uncorrectable,
            "pending": self.pending,
            "failure": self.failure,
        }


@frozen
class PcieLink:
    """The PCIe link now and at most."""

    generation: int = 0
    max_generation: int = 0
    width: int = 0
    max_width: int = 0

    def to_dict(self) -> dict[str, int]:
        return {
            "generation": self.generation,
            "max_generation": self.max_generation,
            "width": self.width,
            "max_width": self.max_width,
        }


@frozen
class HealthReading:
    """
    One pass over one GPU.

    @ivar values: group -> what it read: C{ecc} (L{EccErrors}), C{retired_pages}
        (L{RetiredPages}), C{remapped_rows} (L{RemappedRows}), C{recovery_action} (int),
        C{throttle} (bit mask), C{pcie} (L{PcieLink}); other groups (figures such as
        C{memory}) map to C{True} when they answered.
    @ivar unsupported: groups the device does not offer (their previous verdict is kept).
    @ivar errors: group -> the driver's error, for queries that failed.
    @ivar gone: why the device answers nothing (lost, reset required, no handle), or C{""}.
    @ivar identity: C{uuid}, C{name}, C{pci_bus_id}, C{memory_total_bytes} when read.
    """

    values: Mapping[str, Any] = field(factory=dict)
    unsupported: frozenset[str] = frozenset()
    errors: Mapping[str, str] = field(factory=dict)
    gone: str = ""
    identity: Mapping[str, Any] = field(factory=dict)


@frozen
class DeviceHealth:
    """
    The verdict on one GPU.

    @ivar reasons: why it is not healthy (unhealthy causes first); empty when healthy.
    @ivar xid_counts: Xid code -> how often seen since the agent started.
    @ivar unresponsive: a call into the driver for this GPU hangs.
    @ivar since: clock time of the last verdict change.
    """

    index: int
    state: str = HEALTHY
    reasons: tuple[str, ...] = ()
    xid_total: int = 0
    last_xid: int = 0
    xid_counts: tuple[tuple[int, int], ...] = ()
    unresponsive: bool = False
    since: float = 0.0

    @property
    def schedulable(self) -> bool:
        """Whether work may be placed on it (everything but unhealthy)."""
        return self.state != UNHEALTHY

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "reasons": list(self.reasons),
            "xid_errors": self.xid_total,
            "last_xid": self.last_xid,
            "xid_counts": {str(k): v for k, v in self.xid_counts},
            "unresponsive": self.unresponsive,
        }


@frozen
class Transition:
    """A device's verdict changed (C{previous} is C{""} for a device seen for the first time)."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    previous: str
    state: str
    reasons: tuple[str, ...]
    xid_total: int
    last_xid: int

    @property
    def event_type(self) -> str:
        """C{gpu.health.degraded}, C{gpu.health.unhealthy} or C{gpu.health.recovered}."""
        return "gpu.health.recovered" if self.state == HEALTHY else f"gpu.health.{self.state}"

    @property
    def severity(self) -> str:
        return {HEALTHY: "info", DEGRADED: "warning"}.get(self.state, "error")

    def describe(self) -> str:
        who = f"GPU {self.index}"
        if self.uuid:
            who += f" ({self.uuid})"
        if self.state == HEALTHY:
            return f"{who} recovered"
        return f"{who} {self.state}: {'; '.join(self.reasons)}"

    def payload(self) -> dict[str, Any]:
        return {
            "gpu_index": self.index,
            "uuid": self.uuid,
            "name": self.name,
            "pci_bus_id": self.pci_bus_id,
            "health": self.state,
            "previous": self.previous or "unknown",
            "reasons": list(self.reasons),
            "xid_errors": self.xid_total,
            "last_xid": self.last_xid,
        }


# ----------------------------------------------------------------------------- tracker

F = TypeVar("F", bound=Callable[..., None])


def _notifying(method: F) -> F:
    """Run C{method}, then tell the tracker's C{notify} about new transitions."""

    @functools.wraps(method)
    def wrapper(self: HealthTracker, *args: Any, **kwargs: Any) -> None:
        try:
            method(self, *args, **kwargs)
        finally:
            self._fire()

    return cast(F, wrapper)


Cause = tuple[str, str]  # (verdict, text)


class _Device:
    def __init__(self, index: int) -> None:
        self.index = index
        self.uuid = ""
        self.name = ""
        self.pci_bus_id = ""
        self.memory_total_bytes = 0
        #: group -> causes now (recomputed when the group is read)
        self.groups: dict[str, tuple[Cause, ...]] = {}
        #: key -> cause, lasting until a reset is seen
        self.sticky: dict[str, Cause] = {}
        self.xid_counts: dict[int, int] = {}
        self.xid_total = 0
        self.last_xid = 0
        self.recent: deque[int] = deque(maxlen=_RECENT_XIDS)
        self.last_volatile: int | None = None
        self.last_recovery: int | None = None
        self.was_gone = False
        self.unresponsive = False
        self.state: str | None = None
        self.since = 0.0

    def verdict(self) -> tuple[str, tuple[str, ...]]:
        causes = [c for cs in self.groups.values() for c in cs] + list(self.sticky.values())
        if not causes:
            return HEALTHY, ()
        worst = max(_RANK[v] for v, _ in causes)
        state = UNHEALTHY if worst == 2 else DEGRADED if worst == 1 else HEALTHY
        ordered = sorted({(-_RANK[v], t) for v, t in causes})
        return state, tuple(t for _, t in ordered)


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."


class HealthTracker:
    """
    Verdicts per GPU index, fed from any thread.

    @param notify: called (from the thread that recorded it, outside any lock) whenever a
        transition is waiting in L{drain}.
    @param ignored_xids: Xids the operator counts as application errors (never a verdict).
    @param vendor_label: how query errors are named in reasons (C{NVML}, C{amdsmi}...).
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        notify: Callable[[], None] | None = None,
        ignored_xids: Iterable[int] = (),
        vendor_label: str = "NVML",
    ) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._devices: dict[int, _Device] = {}
        self._pending: list[Transition] = []
        self.notify = notify
        self.ignored_xids = frozenset(APPLICATION_XIDS | set(ignored_xids))
        self._label = vendor_label
        self._dirty = False
        self.resets_seen = 0

    # -- reading

    def health(self) -> dict[int, DeviceHealth]:
        """The verdict on every device seen (cheap; safe on the reactor thread)."""
        with self._lock:
            return {i: self._health(d) for i, d in self._devices.items()}

    def identity(self, index: int) -> dict[str, Any]:
        """The last good identity of device C{index} (C{{}} when never read)."""
        with self._lock:
            d = self._devices.get(index)
            if d is None or not (d.uuid or d.name):
                return {}
            return {
                "uuid": d.uuid,
                "name": d.name,
                "pci_bus_id": d.pci_bus_id,
                "memory_total_bytes": d.memory_total_bytes,
            }

    def known_indexes(self) -> list[int]:
        with self._lock:
            return sorted(self._devices)

    def drain(self) -> list[Transition]:
        """The transitions recorded since the last call, oldest first."""
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def _health(self, d: _Device) -> DeviceHealth:
        state, reasons = d.verdict()
        return DeviceHealth(
            index=d.index,
            state=state,
            reasons=reasons,
            xid_total=d.xid_total,
            last_xid=d.last_xid,
            xid_counts=tuple(sorted(d.xid_counts.items())),
            unresponsive=d.unresponsive,
            since=d.since,
        )

    # -- feeding

    @_notifying
    def observe_reading(self, index: int, reading: HealthReading) -> None:
        """A pass over device C{index} finished (with whatever it could read)."""
        with self._lock:
            d = self._device(index, reading.identity)
            d.unresponsive = False
            d.groups.pop("missing", None)
            d.groups.pop("unresponsive", None)
            if reading.gone:
                d.was_gone = True
                d.groups["reachable"] = ((UNHEALTHY, _short(reading.gone)),)
                self._update(d)
                return
            evidence = self._reset_evidence(d, reading)
            if evidence:
                self.resets_seen += 1
                d.sticky.clear()
            d.was_gone = False
            d.groups.pop("reachable", None)
            attempted = set(reading.values) | set(reading.unsupported) | set(reading.errors)
            for group in attempted:
                key = f"query:{group}"
                if group in reading.errors:
                    d.groups[key] = (
                        (UNHEALTHY, _short(f"{self._label} query {group} failed: {reading.errors[group]}")),
                    )
                elif group in reading.values:
                    d.groups.pop(key, None)
            for group, value in reading.values.items():
                causes = _causes(group, value)
                if causes is not None:
                    d.groups[group] = causes
            ecc = reading.values.get("ecc")
            if isinstance(ecc, EccErrors):
                d.last_volatile = ecc.volatile_corrected + ecc.volatile_uncorrected
            action = reading.values.get("recovery_action")
            if isinstance(action, int):
                d.last_recovery = action
            self._update(d)

    @_notifying
    def observe_query_error(self, index: int, group: str, text: str) -> None:
        """One query (group) of device C{index} failed outside a full pass (fail closed)."""
        with self._lock:
            d = self._device(index, {})
            d.groups[f"query:{group}"] = (
                (UNHEALTHY, _short(f"{self._label} query {group} failed: {text}")),
            )
            self._update(d)

    @_notifying
    def observe_query_ok(self, index: int, group: str) -> None:
        """A query (group) of device C{index} that failed before answered again."""
        with self._lock:
            d = self._devices.get(index)
            if d is None or d.groups.pop(f"query:{group}", None) is None:
                return
            self._update(d)

    @_notifying
    def observe_unresponsive(self, index: int, what: str) -> None:
        """A call into the driver for device C{index} hangs (C{what} says which)."""
        with self._lock:
            d = self._device(index, {})
            d.unresponsive = True
            d.groups["unresponsive"] = ((UNHEALTHY, _short(f"unresponsive: {what}")),)
            self._update(d)

    @_notifying
    def observe_missing(self, index: int, why: str) -> None:
        """Device C{index}, seen before, is no longer enumerated by the driver."""
        with self._lock:
            d = self._devices.get(index)
            if d is None:
                return
            d.was_gone = True
            d.groups["missing"] = ((UNHEALTHY, _short(why)),)
            self._update(d)

    @_notifying
    def observe_unavailable(self, index: int | None, why: str) -> None:
        """The driver says device C{index} (C{None}: some device) became unavailable."""
        with self._lock:
            for d in self._targets(index):
                d.was_gone = True
                d.groups["reachable"] = ((UNHEALTHY, _short(why)),)
                self._update(d)

    @_notifying
    def observe_xid(
        self, index: int | None, xid: int, gpu_instance: int = -1, compute_instance: int = -1
    ) -> None:
        """
        An Xid critical error on device C{index}, or on an unknown device (C{None}: every
        device takes the verdict, failing closed).
        """
        verdict, name = classify_xid(xid, self.ignored_xids)
        where = f" on MIG GPU instance {gpu_instance}" if gpu_instance >= 0 else ""
        with self._lock:
            targets = self._targets(index)
            for d in targets:
                key = xid if xid in d.xid_counts or len(d.xid_counts) < _MAX_DISTINCT_XIDS else -1
                d.xid_counts[key] = d.xid_counts.get(key, 0) + 1
                d.xid_total += 1
                d.last_xid = xid
                d.recent.append(xid)
                if verdict is not None:
                    text = f"Xid {xid} ({name}){where}"
                    if index is None:
                        text += " (not attributed to one GPU)"
                    key_s = f"xid:{xid}"
                    if key_s not in d.sticky and len(d.sticky) >= _MAX_DISTINCT_XIDS:
                        key_s = "xid:other"  # bounded, whatever a driver sends
                        text = f"Xid {xid} ({name}) and other Xids"
                    d.sticky[key_s] = (verdict, text)
                    self._update(d)

    @_notifying
    def observe_fatal(self, index: int | None, key: str, verdict: str, text: str) -> None:
        """A driver event with a lasting verdict (double-bit ECC, fatal poison...)."""
        with self._lock:
            for d in self._targets(index):
                d.sticky[key] = (verdict, _short(text))
                self._update(d)

    def indexes_beyond(self, count: int) -> list[int]:
        """The known devices with an index C{>= count} (no longer enumerated)."""
        with self._lock:
            return sorted(i for i in self._devices if i >= count)

    # -- internals (lock held)

    def _targets(self, index: int | None) -> list[_Device]:
        if index is None:
            return list(self._devices.values())
        d = self._devices.get(index)
        if d is None:
            d = self._devices[index] = _Device(index)
        return [d]

    def _device(self, index: int, identity: Mapping[str, Any]) -> _Device:
        d = self._devices.get(index)
        uuid = str(identity.get("uuid") or "")
        if d is not None and uuid and d.uuid and uuid != d.uuid:
            # Another GPU answers at this index now (hardware change, re-enumeration): its
            # health starts afresh.
            d = None
        if d is None:
            d = self._devices[index] = _Device(index)
        if identity.get("uuid") or identity.get("name"):
            d.uuid = uuid or d.uuid
            d.name = str(identity.get("name") or d.name)
            d.pci_bus_id = str(identity.get("pci_bus_id") or d.pci_bus_id)
            total = identity.get("memory_total_bytes")
            if isinstance(total, int) and total > 0:
                d.memory_total_bytes = total
        return d

    def _reset_evidence(self, d: _Device, reading: HealthReading) -> str:
        if not d.sticky:
            return ""
        if d.was_gone:
            return "the GPU answers again after it was lost or needed a reset"
        ecc = reading.values.get("ecc")
        if isinstance(ecc, EccErrors) and d.last_volatile is not None:
            if ecc.volatile_corrected + ecc.volatile_uncorrected < d.last_volatile:
                return "its volatile ECC counters were cleared"
        action = reading.values.get("recovery_action")
        if action == 0 and d.last_recovery not in (None, 0):
            return "its recovery action went back to none"
        return ""

    def _update(self, d: _Device) -> None:
        state, reasons = d.verdict()
        previous = d.state
        if state == previous:
            return
        d.state = state
        d.since = self._clock()
        if previous is None and state == HEALTHY:
            return
        self._pending.append(
            Transition(
                index=d.index,
                uuid=d.uuid,
                name=d.name,
                pci_bus_id=d.pci_bus_id,
                previous=previous or "",
                state=state,
                reasons=reasons,
                xid_total=d.xid_total,
                last_xid=d.last_xid,
            )
        )
        self._dirty = True

    def _fire(self) -> None:
        """Call C{notify} (outside the lock) when transitions were recorded."""
        with self._lock:
            fire, self._dirty = self._dirty, False
        if fire and self.notify is not None:
            self.notify()


def _causes(group: str, value: Any) -> tuple[Cause, ...] | None:
    """The causes a group's value implies, or C{None} for groups without a verdict."""
    if group == "ecc" and isinstance(value, EccErrors):
        if value.volatile_uncorrected > 0:
            return (
                (
                    UNHEALTHY,
                    f"{value.volatile_uncorrected} uncorrectable ECC error(s) since the last reset",
                ),
            )
        return ()
    if group == "retired_pages" and isinstance(value, RetiredPages):
        if value.pending:
            return ((DEGRADED, "retired pages pending: reset the GPU to retire them"),)
        return ()
    if group == "remapped_rows" and isinstance(value, RemappedRows):
        out: list[Cause] = []
        if value.failure:
            out.append((UNHEALTHY, "row remapping failed: the GPU needs service"))
        if value.pending:
            out.append((DEGRADED, "row remapping pending: reset the GPU to apply it"))
        return tuple(out)
    if group == "recovery_action" and isinstance(value, int):
        verdict, what = RECOVERY_ACTIONS.get(value, (UNHEALTHY, f"recovery action {value}"))
        if verdict == HEALTHY:
            return ()
        return ((verdict, f"the driver asks for {what}"),)
    if group == "throttle" and isinstance(value, int):
        names = [name for bit, name in THROTTLE_BITS.items() if value & bit]
        if names:
            return ((DEGRADED, "clocks throttled: " + ", ".join(names)),)
        return ()
    if group == "pcie" and isinstance(value, PcieLink):
        if value.max_width and 0 < value.width < value.max_width:
            return ((DEGRADED, f"PCIe link x{value.width} of x{value.max_width}"),)
        return ()
    return None
