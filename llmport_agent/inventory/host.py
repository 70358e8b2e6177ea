# -*- test-case-name: tests.test_inventory -*-
"""
Host facts from psutil: CPU, memory, network and disks.

Every function here B{blocks} (psutil reads C{/proc}, C{statvfs} can hang on a dead network
mount): call them in a worker thread, e.g. C{runner.run(collect_host_facts, state_dir,
model_store)}. They never raise for a missing figure: a section that fails reads as zeros
and its reason is listed in C{HostFacts.errors}.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from llmport_agent.core.lazyimport import LazyModule
from llmport_agent.core.values import frozen

if TYPE_CHECKING:
    import psutil
else:
    # Imported at the first collection (on the host pool, after the connect: the enrollment's
    # capabilities read no psutil figure): about 6 ms off the start (issue 27).
    psutil = LazyModule("psutil")

__all__ = [
    "DiskUsage",
    "HostFacts",
    "collect_host_facts",
    "measure_disks",
    "nearest_existing",
]

#: Roles of the measured paths, in the order they are listed.
ROLE_ROOT = "root"
ROLE_STATE = "state_dir"
ROLE_MODELS = "model_store"


def _num(value: object) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return 0.0


def _int(value: object) -> int:
    return int(_num(value))


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


@frozen
class DiskUsage:
    """
    One file system holding at least one of the measured paths.

    @ivar mountpoint: where the file system is mounted (the topmost directory of the
        measured path that is still on the same device).
    @ivar roles: which configured paths live here: C{root}, C{state_dir}, C{model_store}.
    @ivar paths: the configured paths measured here (as configured).
    @ivar error: C{""}, or why the figures are zeros.
    """

    mountpoint: str
    device: str = ""
    fstype: str = ""
    roles: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()
    total_bytes: int = 0
    used_bytes: int = 0
    free_bytes: int = 0
    percent: float = 0.0
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "mountpoint": self.mountpoint,
            "device": self.device,
            "fstype": self.fstype,
            "roles": list(self.roles),
            "paths": list(self.paths),
            "total_bytes": self.total_bytes,
            "used_bytes": self.used_bytes,
            "free_bytes": self.free_bytes,
            "percent": self.percent,
            "error": self.error,
        }


@frozen
class HostFacts:
    """
    One reading of the host. All figures are numbers (0 when unknown), never C{None}.

    @ivar primary_disk: the model store's file system when one is configured, else C{/}'s.
    @ivar errors: what could not be read, one text per failed section.
    """

    cpu_count_logical: int = 0
    cpu_count_physical: int = 0
    cpu_percent: float = 0.0
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)
    memory_total_bytes: int = 0
    memory_used_bytes: int = 0
    memory_available_bytes: int = 0
    memory_percent: float = 0.0
    swap_total_bytes: int = 0
    swap_used_bytes: int = 0
    network_interfaces: tuple[str, ...] = ()
    bytes_sent: int = 0
    bytes_recv: int = 0
    packets_sent: int = 0
    packets_recv: int = 0
    network_errors: int = 0
    network_drops: int = 0
    boot_time: float = 0.0
    disks: tuple[DiskUsage, ...] = ()
    primary_disk: DiskUsage = DiskUsage(mountpoint="/")
    errors: tuple[str, ...] = ()


def nearest_existing(path: str, stat: Callable[[str], Any] = os.stat) -> str:
    """
    C{path} when it exists, else its nearest existing parent (C{/} at worst). A path that
    does not exist yet (a model store not yet created) is measured where it will live.
    """
    current = os.path.abspath(path)
    while True:
        try:
            stat(current)
            return current
        except OSError:
            parent = os.path.dirname(current)
            if parent == current:
                return current
            current = parent


def _mountpoint(path: str, stat: Callable[[str], Any]) -> tuple[str, int]:
    """The topmost ancestor of an existing C{path} still on its device, and the device."""
    dev = stat(path).st_dev
    current = path
    while True:
        parent = os.path.dirname(current)
        if parent == current:
            return current, dev
        try:
            if stat(parent).st_dev != dev:
                return current, dev
        except OSError:
            return current, dev
        current = parent


def measure_disks(
    targets: Sequence[tuple[str, str]],
    *,
    ps: Any = None,
    stat: Callable[[str], Any] = os.stat,
    realpath: Callable[[str], str] = os.path.realpath,
) -> tuple[DiskUsage, ...]:
    """
    Measure the file systems holding each C{(role, path)} of C{targets}, one entry per
    device (paths on the same file system share an entry, their roles merged), in the
    order first met. Blocks.

    @param ps: the C{psutil} module (or a stand-in); the module's current one when C{None}.
    """
    ps = psutil if ps is None else ps
    groups: dict[Any, dict[str, Any]] = {}  # insertion order = order first met
    for role, path in targets:
        resolved = nearest_existing(realpath(path), stat)
        error = ""
        try:
            mountpoint, dev = _mountpoint(resolved, stat)
            key: Any = ("dev", dev)
        except OSError as e:
            mountpoint, key, error = resolved, ("path", resolved), _why(e)
        g = groups.get(key)
        if g is None:
            g = groups[key] = {
                "mountpoint": mountpoint,
                "probe": resolved,
                "roles": [],
                "paths": [],
                "error": error,
            }
        if role not in g["roles"]:
            g["roles"].append(role)
        if path not in g["paths"]:
            g["paths"].append(path)

    partitions: dict[str, tuple[str, str]] = {}
    try:
        for part in ps.disk_partitions(all=True):
            partitions[str(part.mountpoint)] = (str(part.device or ""), str(part.fstype or ""))
    except Exception:
        pass

    out: list[DiskUsage] = []
    for g in groups.values():
        device, fstype = partitions.get(g["mountpoint"], ("", ""))
        error = g["error"]
        total = used = free = 0
        percent = 0.0
        if not error:
            try:
                usage = ps.disk_usage(g["probe"])
                total, used, free = _int(usage.total), _int(usage.used), _int(usage.free)
                percent = _num(usage.percent)
            except Exception as e:
                error = _why(e)
        out.append(
            DiskUsage(
                mountpoint=g["mountpoint"],
                device=device,
                fstype=fstype,
                roles=tuple(g["roles"]),
                paths=tuple(g["paths"]),
                total_bytes=total,
                used_bytes=used,
                free_bytes=free,
                percent=percent,
                error=error,
            )
        )
    return tuple(out)


def collect_host_facts(
    state_dir: str,
    model_store: str | None,
    *,
    ps: Any = None,
    stat: Callable[[str], Any] = os.stat,
    realpath: Callable[[str], str] = os.path.realpath,
    loadavg: Callable[[], tuple[float, float, float]] | None = None,
) -> HostFacts:
    """
    Read everything the inventory and utilisation reports need from the host. Blocks.

    @param state_dir: the agent's state directory (measured as a disk).
    @param model_store: the model store, or C{None}; when given, its file system gives the
        top-level disk figures.
    @param ps: the C{psutil} module (or a stand-in); the module's current one when C{None}.
    """
    ps = psutil if ps is None else ps
    loadavg = os.getloadavg if loadavg is None else loadavg
    errors: list[str] = []
    facts: dict[str, Any] = {}

    def section(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:
            errors.append(f"{name}: {_why(e)}")

    def cpu() -> None:
        facts["cpu_count_logical"] = _int(ps.cpu_count(logical=True))
        facts["cpu_count_physical"] = _int(ps.cpu_count(logical=False))
        facts["cpu_percent"] = _num(ps.cpu_percent(interval=None))

    def load() -> None:
        one, five, fifteen = loadavg()
        facts["load_average"] = (_num(one), _num(five), _num(fifteen))

    def memory() -> None:
        vm = ps.virtual_memory()
        facts["memory_total_bytes"] = _int(vm.total)
        facts["memory_used_bytes"] = _int(vm.used)
        facts["memory_available_bytes"] = _int(vm.available)
        facts["memory_percent"] = _num(vm.percent)

    def swap() -> None:
        sw = ps.swap_memory()
        facts["swap_total_bytes"] = _int(sw.total)
        facts["swap_used_bytes"] = _int(sw.used)

    def interfaces() -> None:
        facts["network_interfaces"] = tuple(sorted(str(n) for n in ps.net_if_addrs()))

    def counters() -> None:
        io = ps.net_io_counters(pernic=False)
        if io is None:  # no interfaces at all
            return
        facts["bytes_sent"] = _int(io.bytes_sent)
        facts["bytes_recv"] = _int(io.bytes_recv)
        facts["packets_sent"] = _int(io.packets_sent)
        facts["packets_recv"] = _int(io.packets_recv)
        facts["network_errors"] = _int(getattr(io, "errin", 0)) + _int(getattr(io, "errout", 0))
        facts["network_drops"] = _int(getattr(io, "dropin", 0)) + _int(getattr(io, "dropout", 0))

    def boot() -> None:
        facts["boot_time"] = _num(ps.boot_time())

    for name, fn in (
        ("cpu", cpu),
        ("load", load),
        ("memory", memory),
        ("swap", swap),
        ("network_interfaces", interfaces),
        ("network_counters", counters),
        ("boot_time", boot),
    ):
        section(name, fn)

    targets: list[tuple[str, str]] = [(ROLE_ROOT, "/"), (ROLE_STATE, state_dir)]
    if model_store:
        targets.append((ROLE_MODELS, model_store))
    disks: tuple[DiskUsage, ...] = ()
    try:
        disks = measure_disks(targets, ps=ps, stat=stat, realpath=realpath)
    except Exception as e:
        errors.append(f"disks: {_why(e)}")
    primary_role = ROLE_MODELS if model_store else ROLE_ROOT
    primary = next((d for d in disks if primary_role in d.roles), None)
    if primary is None:
        primary = DiskUsage(mountpoint="/", error="not measured")
    for d in disks:
        if d.error:
            errors.append(f"disk {d.mountpoint}: {d.error}")
    return HostFacts(disks=disks, primary_disk=primary, errors=tuple(errors), **facts)
