# -*- test-case-name: tests.test_gpu_sources -*-
"""
Apple GPUs (macOS) from C{system_profiler SPDisplaysDataType -json}: name, GPU cores and
unified memory (the Mac's memory, shared with the CPU), vendor C{apple}. A discrete GPU of
an Intel Mac is listed with its own vendor and VRAM.

One run per snapshot, killed after the call timeout; a run that fails (no output, bad JSON,
timeout) fails closed for the GPUs seen before. There are no error counters to read.
"""

from __future__ import annotations

import json
import platform
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

from twisted.logger import Logger
from zope.interface import implementer

from llmport_agent.inventory.gpu import GPUDevice, GPUSnapshot, IGPUSource
from llmport_agent.inventory.health import DeviceHealth, HealthReading, HealthTracker
from llmport_agent.inventory.tools import ToolRunner, run_tool

__all__ = ["SYSTEM_PROFILER_ARGS", "AppleGPUSource", "parse_displays"]

SYSTEM_PROFILER_ARGS = ("system_profiler", "SPDisplaysDataType", "-json")
_UNITS = {"KB": 1024, "MB": 1024**2, "GB": 1024**3, "TB": 1024**4}


def _memory() -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)


def _size(text: Any) -> int:
    """C{"8 GB"}, C{"1536 MB"} -> bytes; 0 when not a size."""
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]B)\s*$", str(text or ""), re.IGNORECASE)
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()]) if m else 0


def _vendor(item: Mapping[str, Any], name: str) -> str:
    raw = str(item.get("spdisplays_vendor") or item.get("spdisplays_vendor-id") or "").lower()
    if "apple" in raw or name.startswith("Apple "):
        return "apple"
    for key, vendor in (("amd", "amd"), ("ati", "amd"), ("nvidia", "nvidia"), ("intel", "intel")):
        if key in raw or key in name.lower():
            return vendor
    return "unknown"


def _name(item: Mapping[str, Any]) -> str:
    name = str(item.get("sppci_model") or item.get("_name") or "").strip()
    # macOS 11 named the M1 "kHW_AppleM1Item" (a localisation key).
    m = re.match(r"^kHW_Apple(\w+?)Item$", name)
    if m:
        name = f"Apple {m.group(1)}"
    return name[:256]


def parse_displays(text: str) -> tuple[list[dict[str, Any]], str]:
    """(GPUs as plain dicts, error) from the C{-json} output; never raises."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        first = text.strip()[:120] or "nothing"
        return [], f"system_profiler printed malformed JSON ({e}; it began {first!r})"
    if not isinstance(doc, dict) or not isinstance(doc.get("SPDisplaysDataType"), list):
        return [], "system_profiler printed no SPDisplaysDataType list"
    out: list[dict[str, Any]] = []
    for item in doc["SPDisplaysDataType"]:
        if not isinstance(item, dict):
            continue
        kind = str(item.get("sppci_device_type") or "")
        if kind and kind != "spdisplays_gpu":
            continue
        name = _name(item)
        if not name:
            continue
        cores = str(item.get("sppci_cores") or "")
        vram = 0
        for key in ("spdisplays_vram", "_spdisplays_vram", "spdisplays_vram_shared"):
            vram = _size(item.get(key))
            if vram:
                break
        out.append(
            {
                "index": len(out),
                "name": name,
                "vendor": _vendor(item, name),
                "cores": int(cores) if cores.isdigit() else 0,
                "vram_bytes": vram,
                "metal": str(item.get("spdisplays_mtlgpufamilysupport") or item.get("spdisplays_metalfamily") or ""),
            }
        )
    if not out:
        return [], "system_profiler listed no GPU"
    return out, ""


@implementer(IGPUSource)
class AppleGPUSource:
    """
    @param run: runs C{system_profiler} (tests pass recorded outputs).
    @param memory: C{(total, available)} bytes of the Mac's memory (unified memory).
    """

    vendor = "apple"
    log = Logger()

    def __init__(
        self,
        *,
        run: ToolRunner = run_tool,
        memory: Callable[[], tuple[int, int]] = _memory,
        call_timeout: float = 10.0,
        os_version: Callable[[], str] = lambda: platform.mac_ver()[0],
        tracker: HealthTracker | None = None,
    ) -> None:
        self._run = run
        self._memory = memory
        self.call_timeout = call_timeout
        self._os_version = os_version
        self.tracker = tracker if tracker is not None else HealthTracker(vendor_label="system_profiler")
        self._lock = threading.Lock()
        self._seen = False
        self._last_error = ""

    def snapshot(self) -> GPUSnapshot:
        with self._lock:
            try:
                return self._snapshot()
            except Exception as e:
                self.log.failure("Apple GPU snapshot failed unexpectedly")
                return self._unavailable(f"Apple GPU snapshot failed: {type(e).__name__}: {e}")

    def check_health(self) -> None:
        return None  # nothing beyond what a snapshot reads

    def health(self) -> Mapping[int, DeviceHealth]:
        return self.tracker.health()

    def close(self) -> None:
        return None

    def _unavailable(self, error: str) -> GPUSnapshot:
        if error != self._last_error:
            self._last_error = error
            self.log.warn("No Apple GPU facts: {error}", error=error)
        devices = []
        for i in self.tracker.known_indexes():
            self.tracker.observe_unavailable(i, error)
            ident = self.tracker.identity(i)
            devices.append(GPUDevice(index=i, vendor="apple", name=str(ident.get("name", "")), error=error[:512]))
        return GPUSnapshot(
            vendor="apple" if self._seen else "none", devices=tuple(devices), gpu_error=error, source="system_profiler"
        ).with_health(self.tracker.health())

    def _snapshot(self) -> GPUSnapshot:
        result = self._run(SYSTEM_PROFILER_ARGS, self.call_timeout)
        if result.error:
            return self._unavailable(result.error)
        rows, error = parse_displays(result.stdout)
        if error:
            return self._unavailable(error)
        total, available = self._memory()
        try:
            os_version = self._os_version()
        except Exception:
            os_version = ""
        devices = []
        for row in rows:
            unified = row["vendor"] == "apple"
            mem_total = total if unified else row["vram_bytes"]
            mem_free = available if unified else 0
            device = GPUDevice(
                index=row["index"],
                vendor=row["vendor"],
                name=row["name"],
                driver_version=f"macOS {os_version}" if os_version else "",
                memory_total_bytes=mem_total,
                memory_used_bytes=max(0, mem_total - mem_free) if unified else 0,
                memory_free_bytes=mem_free,
                cores=row["cores"],
                unified_memory=unified,
            )
            self.tracker.observe_reading(
                device.index,
                HealthReading(values={"figures": True}, identity={"uuid": f"{row['name']}#{row['index']}", "name": row["name"]}),
            )
            devices.append(device)
        self._seen = True
        self._last_error = ""
        vendors = [d.vendor for d in devices]
        vendor = "apple" if "apple" in vendors else next((v for v in vendors if v in ("amd", "nvidia")), "none")
        return GPUSnapshot(vendor=vendor, devices=tuple(devices), source="system_profiler").with_health(
            self.tracker.health()
        )
