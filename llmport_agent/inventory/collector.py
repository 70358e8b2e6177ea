# -*- test-case-name: tests.test_inventory -*-
"""
The node's inventory and utilisation reports (protocol 5.2) and static capabilities (5.1).

L{InventoryCollector} runs every blocking reading (psutil, NVML, C{platform}) through the
injected L{BlockingRunner}; everything else happens on the reactor thread. The dictionaries
it returns are JSON-ready and never contain a C{null} or a non-finite number (the backend
answers 500 on a null, PostgreSQL refuses C{NaN}).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmport_agent import VERSION
from llmport_agent.core.threads import BlockingRunner
from llmport_agent.core.values import frozen
from llmport_agent.inventory.capabilities import (
    build_capabilities,
    quick_host_facts,
    static_host_facts,
)
from llmport_agent.inventory.gpu import GPUSnapshot, GPUSource, describe_error
from llmport_agent.inventory.host import HostFacts, collect_host_facts

__all__ = [
    "InventoryCollector",
    "InventoryReport",
    "assert_no_nulls",
    "find_nulls",
    "scrub_nulls",
]


# ------------------------------------------------------------------------ null guards


def find_nulls(obj: object, path: str = "$") -> list[str]:
    """
    The JSON paths (C{$.inventory.gpu.devices[0].name}) of every C{None}, C{NaN} or
    infinity inside C{obj}, walking dicts, lists and tuples.
    """
    found: list[str] = []
    if obj is None:
        found.append(path)
    elif isinstance(obj, float):
        if not math.isfinite(obj):
            found.append(path)
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            if not isinstance(key, str):
                found.append(f"{path}[{key!r}] (non-string key)")
            found.extend(find_nulls(value, f"{path}.{key}"))
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            found.extend(find_nulls(value, f"{path}[{i}]"))
    return found


def assert_no_nulls(obj: object) -> None:
    """
    Raise C{AssertionError} naming every path of C{obj} that holds a C{None} (or a
    non-finite float, or a non-string key). For tests.
    """
    found = find_nulls(obj)
    if found:
        raise AssertionError(f"null or non-finite values at: {', '.join(found)}")


def scrub_nulls(obj: Any) -> Any:
    """
    A JSON-safe copy of C{obj}: C{None} entries dropped from dicts and lists, non-finite
    floats turned into C{0.0}, tuples into lists, keys into strings.
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else 0.0
    if isinstance(obj, Mapping):
        return {str(k): scrub_nulls(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list | tuple):
        return [scrub_nulls(v) for v in obj if v is not None]
    return obj


# ---------------------------------------------------------------------------- report


@frozen
class InventoryReport:
    """One C{inventory} frame's payload: C{inventory} and C{utilization} (protocol 5.2)."""

    inventory: dict[str, Any]
    utilization: dict[str, Any]


async def _awaited(read: Callable[[], Awaitable[Any]]) -> Any:
    return await read()


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


class InventoryCollector:
    """
    Collects what the agent reports about the node.

    @param reactor: the reactor (an C{IReactorTime}, for timestamps).
    @param runner: runs blocking calls off the reactor thread.
    @param gpu: the GPU source (an L{IGPUSource} provider); its C{snapshot} and C{close}
        run through C{runner}.
    @param state_dir: the agent's state directory (its disk is reported).
    @param model_store: the model store, or C{None}; its disk gives the top-level disk
        figures when set.
    @param engine_facts: a cheap reactor-thread callable returning the container engine's
        facts (C{docker_available}, C{container_runtime}, extras), or C{None}.
    @param sections: more inventory keys (protocol 10.5: C{network}, C{vllm_containers},
        C{ray_runtime}), each read by an async callable that runs its blocking work off the
        reactor and bounds it in time; they run side by side, each cut off after
        C{section_timeout} seconds. A section that fails or answers C{None} is left out of
        that report (one log line when it starts failing).
    @param paths: the host paths of C{static_capabilities.paths} (C{model_store},
        C{ray_session}).
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        runner: BlockingRunner,
        gpu: GPUSource,
        *,
        state_dir: str,
        model_store: str | None,
        engine_facts: Callable[[], Mapping[str, Any]] | None = None,
        sections: Mapping[str, Callable[[], Awaitable[Any]]] | None = None,
        section_timeout: float = 30.0,
        paths: Mapping[str, str] | None = None,
    ) -> None:
        self._reactor = reactor
        self._runner = runner
        self._gpu = gpu
        self._state_dir = state_dir
        self._model_store = model_store or None
        self._engine_facts = engine_facts
        self._static: dict[str, str] | None = None
        self._quick: dict[str, str] | None = None
        self._last_gpu = GPUSnapshot()
        self._last_report: InventoryReport | None = None
        self.gpu_source_errors = 0
        self.gpu_device_errors = 0
        self._inflight: Deferred[InventoryReport] | None = None
        self._waiters: list[Deferred[InventoryReport]] = []
        self._engine_failing = False
        self._gpu_failing = False
        self._sections = dict(sections or {})
        self._section_timeout = section_timeout
        self._section_failing: set[str] = set()
        self._paths = {k: v for k, v in (paths or {}).items() if v}

    # -- public API

    async def collect(self) -> InventoryReport:
        """
        Read the node and build the inventory and utilisation objects. Calls made while a
        collection is running share its result. Fails only when the runner fails.
        """
        waiter: Deferred[InventoryReport] = Deferred()
        self._waiters.append(waiter)
        if self._inflight is None:
            shared = Deferred.fromCoroutine(self._collect())
            self._inflight = shared
            shared.addBoth(self._cbFanOut)
        return await waiter

    async def capabilities(self) -> dict[str, Any]:
        """
        The static capabilities with a fresh GPU reading (host part computed once and
        cached). For enrollment.
        """
        static = await self._static_facts()
        gpu = await self._gpu_snapshot()
        return scrub_nulls(self._with_paths(build_capabilities(static, gpu, self._engine())))

    def last_capabilities(self) -> dict[str, Any]:
        """
        The static capabilities from the last readings and the current engine facts;
        cheap, for every heartbeat. Valid (all keys present) even before any reading.
        """
        host = self._static if self._static is not None else self._quick_facts()
        return scrub_nulls(self._with_paths(build_capabilities(host, self.last_gpu, self._engine())))

    @property
    def last_report(self) -> InventoryReport | None:
        """The last report built, or C{None}."""
        return self._last_report

    @property
    def last_gpu(self) -> GPUSnapshot:
        """
        The last GPU snapshot taken (empty before the first), with the GPU verdicts as
        they are now (an Xid since the snapshot counts at once).
        """
        try:
            health = self._gpu.health()
        except Exception:
            return self._last_gpu
        return self._last_gpu.with_health(health)

    def close(self) -> Deferred[None]:
        """Release the GPU source (C{nvmlShutdown}) through the runner. Never fails."""
        d: Deferred[None] = self._runner.run(self._gpu.close)

        def _eb(f: Failure) -> None:
            self.log.failure("Closing the GPU source failed", failure=f)

        d.addErrback(_eb)
        return d

    # -- internals

    def _cbFanOut(self, result: InventoryReport | Failure) -> None:
        self._inflight = None
        waiters, self._waiters = self._waiters, []
        delivered = False
        for w in waiters:
            if w.called:  # cancelled by its caller
                continue
            delivered = True
            if isinstance(result, Failure):
                w.errback(result)
            else:
                w.callback(result)
        if isinstance(result, Failure) and not delivered:
            self.log.failure("Inventory collection failed", failure=result)

    def _with_paths(self, caps: dict[str, Any]) -> dict[str, Any]:
        if self._paths:
            caps["paths"] = dict(self._paths)
        return caps

    async def _section(self, name: str, d: Deferred[Any], late: set[str]) -> Any:
        """
        One extra section's value, or C{None} when it failed or ran out of time (the round's
        one section deadline cancelled it and put its name in C{late}).
        """
        try:
            value = await d
        except Exception as e:
            if name not in self._section_failing:
                self._section_failing.add(name)
                self.log.warn(
                    "Reading the inventory's {section} failed ({why}); it is left out of the "
                    "inventory until it works again",
                    section=name, why=f"no answer within {self._section_timeout:g} s"
                    if name in late and isinstance(e, CancelledError) else describe_error(e),
                )
            return None
        if name in self._section_failing:
            self._section_failing.discard(name)
            self.log.info("The inventory's {section} is read again", section=name)
        return value

    def _quick_facts(self) -> dict[str, str]:
        if self._quick is None:
            self._quick = quick_host_facts()
        return self._quick

    async def _static_facts(self) -> dict[str, str]:
        if self._static is None:
            try:
                self._static = await self._runner.run(static_host_facts)
            except Exception:
                self.log.failure("Reading static host facts failed; using the quick ones")
                return self._quick_facts()
        return self._static

    async def _gpu_snapshot(self) -> GPUSnapshot:
        try:
            gpu = await self._runner.run(self._gpu.snapshot)
        except Exception as e:
            if not self._gpu_failing:
                self._gpu_failing = True
                self.log.failure("Taking a GPU snapshot failed")
            gpu = GPUSnapshot(
                vendor=self._last_gpu.vendor,
                gpu_error=f"GPU snapshot failed: {describe_error(e)}",
            )
        else:
            self._gpu_failing = False
        # Counters for metrics: collections where the source failed / a device reported errors.
        if gpu.gpu_error:
            self.gpu_source_errors += 1
        if any(d.error for d in gpu.devices):
            self.gpu_device_errors += 1
        self._last_gpu = gpu
        return gpu

    def _engine(self) -> Mapping[str, Any] | None:
        if self._engine_facts is None:
            return None
        try:
            facts = self._engine_facts()
            if not isinstance(facts, Mapping):
                raise TypeError(f"engine_facts returned {type(facts).__name__}, not a mapping")
        except Exception:
            if not self._engine_failing:
                self._engine_failing = True
                self.log.failure("Reading the container engine facts failed")
            return None
        self._engine_failing = False
        return facts

    async def _collect(self) -> InventoryReport:
        static = await self._static_facts()
        gpu_d = Deferred.fromCoroutine(self._gpu_snapshot())  # never fails
        # One deadline for all sections of the round (they start together), not a timer each:
        # a timer cancelled early still wakes the reactor at its time (Twisted leaves it in its
        # heap), so each one the inventory scheduled cost a wake-up a minute at idle.
        reads: dict[str, Deferred[Any]] = {
            name: Deferred.fromCoroutine(_awaited(read)) for name, read in self._sections.items()
        }
        late: set[str] = set()

        def _cut_off() -> None:
            for name, rd in reads.items():
                if not rd.called:
                    late.add(name)
                    rd.cancel()

        deadline = self._reactor.callLater(self._section_timeout, _cut_off) if reads else None
        section_ds = {
            name: Deferred.fromCoroutine(self._section(name, rd, late))  # never fail
            for name, rd in reads.items()
        }
        try:
            return await self._assemble(static, gpu_d, section_ds)
        finally:
            if deadline is not None and deadline.active():
                deadline.cancel()
            for sd in section_ds.values():  # the whole round was cancelled: so are they
                if not sd.called:
                    sd.cancel()

    async def _assemble(
        self, static: dict[str, str], gpu_d: Deferred[GPUSnapshot], section_ds: dict[str, Deferred[Any]]
    ) -> InventoryReport:
        host: HostFacts = await self._runner.run(
            collect_host_facts, self._state_dir, self._model_store
        )
        gpu = await gpu_d
        caps = self._with_paths(build_capabilities(static, gpu, self._engine()))
        now = _iso(self._reactor.seconds())
        disk = host.primary_disk
        inventory: dict[str, Any] = {
            "cpu_count_logical": host.cpu_count_logical,
            "cpu_count_physical": host.cpu_count_physical,
            "memory_total_bytes": host.memory_total_bytes,
            "disk_total_bytes": disk.total_bytes,
            "network_interfaces": list(host.network_interfaces),
            "gpu_count": gpu.count,
            "gpu": gpu.to_dict(),
            "static_capabilities": caps,
            # extras
            "swap_total_bytes": host.swap_total_bytes,
            "disk_mountpoint": disk.mountpoint,
            "disks": [d.to_dict() for d in host.disks],
            "boot_time": host.boot_time,
            "agent_version": VERSION,
            "collected_at": now,
            "errors": list(host.errors),
        }
        for name, sd in section_ds.items():
            value = await sd
            if value is not None:
                inventory[name] = value
        utilization: dict[str, Any] = {
            "cpu_percent": host.cpu_percent,
            "memory_used_bytes": host.memory_used_bytes,
            "memory_available_bytes": host.memory_available_bytes,
            "memory_percent": host.memory_percent,
            "disk_used_bytes": disk.used_bytes,
            "disk_free_bytes": disk.free_bytes,
            "disk_percent": disk.percent,
            "network": {
                "bytes_sent": host.bytes_sent,
                "bytes_recv": host.bytes_recv,
                "packets_sent": host.packets_sent,
                "packets_recv": host.packets_recv,
                "errors": host.network_errors,
                "drops": host.network_drops,
            },
            "gpu_free_vram_bytes": gpu.free_vram_bytes,
            "gpu": gpu.to_dict(),
            # extras
            "gpu_used_vram_bytes": gpu.used_vram_bytes,
            "load_average": list(host.load_average),
            "swap_used_bytes": host.swap_used_bytes,
            "disks": [
                {
                    "mountpoint": d.mountpoint,
                    "used_bytes": d.used_bytes,
                    "free_bytes": d.free_bytes,
                    "percent": d.percent,
                }
                for d in host.disks
            ],
            "collected_at": now,
        }
        report = InventoryReport(scrub_nulls(inventory), scrub_nulls(utilization))
        self._last_report = report
        return report
