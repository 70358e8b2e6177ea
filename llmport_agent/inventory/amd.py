# -*- test-case-name: tests.test_gpu_sources -*-
"""
AMD GPUs: through the AMD SMI Python library (C{amdsmi}, imported only when present, which
also needs C{libamd_smi}), else through C{rocm-smi --json}, in the inventory shape of
L{llmport_agent.inventory.gpu}.

 - B{amdsmi}: index, UUID, PCI bus id, market name, serial, VRAM, utilisation, temperature
   (edge, else hotspot), power, driver version, the render node, and health from the RAS
   error counts (C{amdsmi_get_gpu_total_ecc_count}): uncorrectable errors make a GPU
   unhealthy until the counts go back down (a reset or driver reload); a call the library
   fails with an error other than "not supported" fails closed. The whole pass runs on a
   watchdog thread with a deadline, so a hung library call marks the GPUs unresponsive.
 - B{rocm-smi}: one run of C{rocm-smi ... --json} per snapshot, killed after the call
   timeout; its JSON carries no RAS counts (C{rocm-smi --json --showrasinfo} answers "No JSON
   data to report", ROCm's own issue 4374), so the fallback gives figures, not error
   counters; a run that fails (no output, bad JSON, timeout) fails closed for the GPUs seen
   before. Render nodes come from sysfs (C{/sys/bus/pci/devices/<bus>/drm/renderD*}).
"""

from __future__ import annotations

import concurrent.futures
import importlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from twisted.logger import Logger
from zope.interface import implementer

from llmport_agent.inventory.gpu import GPUDevice, GPUSnapshot, IGPUSource, describe_error
from llmport_agent.inventory.health import DeviceHealth, EccErrors, HealthReading, HealthTracker
from llmport_agent.inventory.tools import ToolRunner, run_tool
from llmport_agent.inventory.watchdog import Job, PoolSaturated, WatchdogPool

__all__ = ["ROCM_SMI_ARGS", "AMDGPUSource", "parse_rocm_smi"]

MIB = 1024 * 1024

#: The rocm-smi command line (every flag exists since ROCm 5; unknown ones are ignored).
ROCM_SMI_ARGS = (
    "rocm-smi",
    "--showproductname",
    "--showuse",
    "--showmeminfo",
    "vram",
    "--showtemp",
    "--showpower",
    "--showuniqueid",
    "--showserial",
    "--showbus",
    "--showdriverversion",
    "--json",
)

# AMDSMI_STATUS_* codes meaning "this device does not offer this".
_BENIGN = frozenset({2, 3, 10, 31, 40})  # NOT_SUPPORTED, NOT_YET_IMPLEMENTED, NO_PERM, NOT_FOUND, NO_DATA


def _import_amdsmi() -> Any:
    return importlib.import_module("amdsmi")


def _num(value: Any) -> float:
    """A number from amdsmi/rocm-smi values (ints, floats, "12.0", "N/A"); 0 when unknown."""
    if isinstance(value, bool):
        return 0.0
    if isinstance(value, int | float):
        return float(value) if value == value and abs(value) != float("inf") else 0.0
    if isinstance(value, str):
        m = re.search(r"-?\d+(?:\.\d+)?", value)
        return float(m.group(0)) if m else 0.0
    return 0.0


def _text(value: Any) -> str:
    if not isinstance(value, str):
        return ""
    value = value.strip()
    return "" if value.upper() in ("N/A", "NA", "") else value[:256]


def render_node_for(bus_id: str, sysfs_root: str = "/sys") -> str:
    """C{/dev/dri/renderD<n>} of the GPU at PCI bus id C{bus_id}, from sysfs, or C{""}."""
    bus = bus_id.strip().lower()
    if not re.match(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$", bus):
        return ""
    if len(bus.split(":")[0]) == 8:
        bus = bus[4:]  # NVML-style 8-digit domain
    try:
        names = os.listdir(os.path.join(sysfs_root, "bus", "pci", "devices", bus, "drm"))
    except OSError:
        return ""
    renders = sorted(n for n in names if re.match(r"^renderD\d{1,4}$", n))
    return f"/dev/dri/{renders[0]}" if renders else ""


# --------------------------------------------------------------------------- rocm-smi


def _field(card: Mapping[str, Any], *names: str) -> Any:
    lowered = {str(k).lower(): v for k, v in card.items()}
    for name in names:
        if name.lower() in lowered:
            return lowered[name.lower()]
    return None


def parse_rocm_smi(text: str) -> tuple[list[dict[str, Any]], str, str]:
    """
    (devices as plain dicts, driver version, error) from C{rocm-smi --json} output. Never
    raises: a malformed document gives no devices and an error that says what is wrong.
    """
    start = text.find("{")
    if start < 0:
        first = text.strip().splitlines()[0][:200] if text.strip() else "nothing"
        return [], "", f"rocm-smi printed no JSON ({first})"
    try:
        doc = json.loads(text[start:])
    except ValueError as e:
        return [], "", f"rocm-smi printed malformed JSON ({e})"
    if not isinstance(doc, dict):
        return [], "", f"rocm-smi printed JSON that is not an object ({type(doc).__name__})"
    driver = ""
    system = doc.get("system")
    if isinstance(system, dict):
        driver = _text(_field(system, "Driver version"))
    cards = []
    for key, card in doc.items():
        m = re.match(r"^card(\d{1,4})$", str(key))
        if m and isinstance(card, dict):
            cards.append((int(m.group(1)), card))
    if not cards and doc:
        return [], driver, "rocm-smi listed no GPU (no card entries in its JSON)"
    out = []
    for position, (number, card) in enumerate(sorted(cards)):
        total = int(_num(_field(card, "VRAM Total Memory (B)")))
        used = int(_num(_field(card, "VRAM Total Used Memory (B)")))
        temp = _field(
            card,
            "Temperature (Sensor edge) (C)",
            "Temperature (Sensor junction) (C)",
            "Temperature (Sensor hotspot) (C)",
        )
        power = _field(
            card,
            "Average Graphics Package Power (W)",
            "Current Socket Graphics Package Power (W)",
        )
        unique = _text(_field(card, "Unique ID"))
        out.append(
            {
                "index": position,
                "card": number,
                "name": _text(_field(card, "Card Series", "Device Name", "Card Model")),
                "uuid": unique,
                "serial": _text(_field(card, "Serial Number")),
                "pci_bus_id": _text(_field(card, "PCI Bus")),
                "memory_total_bytes": max(0, total),
                "memory_used_bytes": max(0, min(used, total) if total else used),
                "utilization_pct": max(0, min(100, int(_num(_field(card, "GPU use (%)"))))),
                "temperature_c": int(_num(temp)),
                "power_draw_w": round(_num(power), 3),
            }
        )
    return out, driver, ""


# ------------------------------------------------------------------------------ source


@implementer(IGPUSource)
class AMDGPUSource:
    """
    @param amdsmi: the C{amdsmi} module (or a faithful fake); imported on first use.
    @param run: runs C{rocm-smi} (tests pass recorded outputs).
    @param call_timeout: deadline of one amdsmi pass or one rocm-smi run.
    """

    vendor = "amd"
    log = Logger()

    def __init__(
        self,
        *,
        amdsmi: Any = None,
        importer: Callable[[], Any] = _import_amdsmi,
        run: ToolRunner = run_tool,
        call_timeout: float = 10.0,
        sysfs_root: str = "/sys",
        pool: WatchdogPool | None = None,
        tracker: HealthTracker | None = None,
    ) -> None:
        self._amdsmi = amdsmi
        self._importer = importer
        self._run = run
        self.call_timeout = call_timeout
        self._sysfs = sysfs_root
        self.pool = pool if pool is not None else WatchdogPool("amdsmi", max_threads=2)
        self.tracker = tracker if tracker is not None else HealthTracker(vendor_label="AMD SMI")
        self._lock = threading.Lock()
        self._backend = ""  # "" (not chosen) | "amdsmi" | "rocm-smi"
        self._why_not_amdsmi = ""
        self._job: Job[Any] | None = None
        self._seen = False
        self._last_error = ""

    # -- IGPUSource

    def snapshot(self) -> GPUSnapshot:
        with self._lock:
            try:
                return self._pass(full=True)
            except Exception as e:  # never fail the caller
                self.log.failure("AMD GPU snapshot failed unexpectedly")
                return self._unavailable(f"AMD GPU snapshot failed: {describe_error(e)}")

    def check_health(self) -> None:
        with self._lock:
            if self._backend == "rocm-smi":
                return  # no RAS counts there; snapshots keep the figures current
            try:
                self._pass(full=False)
            except Exception:
                self.log.failure("AMD GPU health check failed unexpectedly")

    def health(self) -> Mapping[int, DeviceHealth]:
        return self.tracker.health()

    def close(self) -> None:
        with self._lock:
            if self._backend == "amdsmi" and not self.pool.stuck_jobs():
                try:
                    self._amdsmi.amdsmi_shut_down()
                except Exception:
                    pass
            self._backend = ""

    @property
    def backend(self) -> str:
        return self._backend

    # -- backend choice

    def _choose(self) -> None:
        if self._backend:
            return
        try:
            if self._amdsmi is None:
                self._amdsmi = self._importer()
            flags = getattr(getattr(self._amdsmi, "AmdSmiInitFlags", None), "INIT_AMD_GPUS", None)
            if flags is None:
                self._amdsmi.amdsmi_init()
            else:
                self._amdsmi.amdsmi_init(flags)
        except Exception as e:  # ImportError, OSError (no libamd_smi), AmdSmiException
            self._amdsmi = None
            self._why_not_amdsmi = f"{type(e).__name__}: {describe_error(e)}"
            self._backend = "rocm-smi"
            self.log.info(
                "AMD SMI library not usable ({why}); using rocm-smi --json", why=self._why_not_amdsmi
            )
            return
        self._backend = "amdsmi"
        self.log.info("AMD SMI library initialised")

    # -- passes

    def _unavailable(self, error: str) -> GPUSnapshot:
        if error != self._last_error:
            self._last_error = error
            self.log.warn("No AMD GPU facts: {error}", error=error)
        devices = []
        for i in self.tracker.known_indexes():
            self.tracker.observe_unavailable(i, error)
            ident = self.tracker.identity(i)
            devices.append(
                GPUDevice(
                    index=i,
                    vendor="amd",
                    uuid=str(ident.get("uuid", "")),
                    name=str(ident.get("name", "")),
                    pci_bus_id=str(ident.get("pci_bus_id", "")),
                    memory_total_bytes=int(ident.get("memory_total_bytes", 0) or 0),
                    error=error[:512],
                )
            )
        return GPUSnapshot(
            vendor="amd" if self._seen else "none",
            devices=tuple(devices),
            gpu_error=error,
            source=self._backend,
        ).with_health(self.tracker.health())

    def _pass(self, full: bool) -> GPUSnapshot:
        self._choose()
        if self._backend == "rocm-smi":
            return self._rocm_smi()
        prev = self._job
        if prev is not None and not prev.done:
            for i in self.tracker.known_indexes():
                self.tracker.observe_unresponsive(i, f"AMD SMI call {prev.doing()} has not returned for {prev.age:.0f} s")
            return self._unavailable(
                f"AMD SMI is not answering: {prev.doing()} has not returned for {prev.age:.0f} s"
            )
        job: Job[Any] = Job("AMD SMI pass", self.call_timeout, time.monotonic)
        try:
            self.pool.submit(self._amdsmi_pass, job, deadline=self.call_timeout, job=job)
        except PoolSaturated as e:
            return self._unavailable(str(e))
        self._job = job
        try:
            rows, driver = job.future.result(timeout=self.call_timeout)
        except concurrent.futures.TimeoutError:
            self.pool.note_timeout()
            for i in self.tracker.known_indexes():
                self.tracker.observe_unresponsive(i, f"AMD SMI call {job.doing()} did not return within {self.call_timeout:g} s")
            return self._unavailable(f"AMD SMI did not answer within {self.call_timeout:g} s ({job.doing()})")
        except Exception as e:
            return self._unavailable(f"AMD SMI failed: {type(e).__name__}: {describe_error(e)}")
        for device, reading in rows:
            self.tracker.observe_reading(device.index, reading)
        return self._result([device for device, _ in rows], driver, "AMD SMI")

    def _result(self, devices: list[GPUDevice], driver: str, tool: str) -> GPUSnapshot:
        for i in self.tracker.indexes_beyond(len(devices)):
            self.tracker.observe_missing(i, f"GPU {i} is no longer listed by {tool}")
        if devices:
            self._seen = True
        self._last_error = ""
        return GPUSnapshot(
            vendor="amd" if devices else "none",
            devices=tuple(devices),
            driver_version=driver,
            source="amdsmi" if tool == "AMD SMI" else tool,
        ).with_health(self.tracker.health())

    def _amdsmi_pass(self, job: Job[Any]) -> tuple[list[tuple[GPUDevice, HealthReading]], str]:
        """One pass over every GPU (on a watchdog thread)."""
        smi = self._amdsmi
        lib_error = getattr(smi, "AmdSmiLibraryException", ())
        job.current = "amdsmi_get_processor_handles"
        handles = smi.amdsmi_get_processor_handles()
        out = []
        driver = ""
        for index, h in enumerate(handles):
            errors: dict[str, str] = {}
            unsupported: set[str] = set()
            answered: set[str] = set()

            def call(
                group: str,
                fname: str,
                *args: Any,
                h: Any = h,
                errors: dict[str, str] = errors,
                unsupported: set[str] = unsupported,
                answered: set[str] = answered,
            ) -> Any:
                fn = getattr(smi, fname, None)
                if fn is None:
                    unsupported.add(group)
                    return None
                job.current = fname
                try:
                    value = fn(h, *args)
                except Exception as e:
                    code = getattr(e, "err_code", None)
                    if isinstance(lib_error, type) and isinstance(e, lib_error) and code not in _BENIGN:
                        errors[group] = describe_error(e).replace("\n", " ").replace("\t", "")
                    else:
                        unsupported.add(group)
                    return None
                answered.add(group)
                return value

            uuid = _text(call("uuid", "amdsmi_get_gpu_device_uuid"))
            bdf = _text(call("pci", "amdsmi_get_gpu_device_bdf"))
            asic = call("asic", "amdsmi_get_gpu_asic_info") or {}
            board = call("board", "amdsmi_get_gpu_board_info") or {}
            vram = call("memory", "amdsmi_get_gpu_vram_usage") or {}
            activity = call("utilization", "amdsmi_get_gpu_activity") or {}
            ttype = getattr(smi, "AmdSmiTemperatureType", None)
            tmetric = getattr(smi, "AmdSmiTemperatureMetric", None)
            temp: Any = None
            if ttype is not None and tmetric is not None:
                temp = call("temperature", "amdsmi_get_temp_metric", ttype.EDGE, tmetric.CURRENT)
                if temp is None and "temperature" not in errors:
                    temp = call("temperature", "amdsmi_get_temp_metric", ttype.HOTSPOT, tmetric.CURRENT)
            power = call("power", "amdsmi_get_power_info") or {}
            drv = call("driver", "amdsmi_get_gpu_driver_info") or {}
            ecc = call("ecc", "amdsmi_get_gpu_total_ecc_count")
            enum = call("enumeration", "amdsmi_get_gpu_enumeration_info") or {}
            driver = driver or _text(drv.get("driver_version"))
            render = ""
            drm_render = enum.get("drm_render") if isinstance(enum, dict) else None
            if isinstance(drm_render, int) and 0 < drm_render < 10000:
                render = f"/dev/dri/renderD{drm_render}"
            elif bdf:
                render = render_node_for(bdf, self._sysfs)
            total = int(_num(vram.get("vram_total"))) * MIB if isinstance(vram, dict) else 0
            used = int(_num(vram.get("vram_used"))) * MIB if isinstance(vram, dict) else 0
            ecc_values = EccErrors()
            values: dict[str, Any] = {g: True for g in answered}
            if isinstance(ecc, dict):
                ecc_values = EccErrors(
                    volatile_corrected=int(_num(ecc.get("correctable_count"))),
                    volatile_uncorrected=int(_num(ecc.get("uncorrectable_count"))),
                )
                values["ecc"] = ecc_values
            name = _text(asic.get("market_name")) if isinstance(asic, dict) else ""
            serial = _text(board.get("product_serial")) if isinstance(board, dict) else ""
            if not serial and isinstance(asic, dict):
                serial = _text(asic.get("asic_serial"))
            watts = 0.0
            limit = 0.0
            if isinstance(power, dict):
                watts = _num(power.get("current_socket_power")) or _num(power.get("average_socket_power"))
                limit = _num(power.get("power_limit"))
            device = GPUDevice(
                index=index,
                vendor="amd",
                uuid=uuid,
                name=name,
                pci_bus_id=bdf,
                serial=serial,
                driver_version=_text(drv.get("driver_version")) if isinstance(drv, dict) else "",
                memory_total_bytes=total,
                memory_used_bytes=min(used, total) if total else used,
                memory_free_bytes=max(0, total - used),
                utilization_pct=max(0, min(100, int(_num(activity.get("gfx_activity")) if isinstance(activity, dict) else 0))),
                temperature_c=int(_num(temp)),
                power_draw_w=round(watts, 3),
                power_limit_w=round(limit, 3),
                ecc_errors=ecc_values,
                render_node=render,
                error="; ".join(f"{k}: {v}" for k, v in sorted(errors.items()))[:512],
            )
            reading = HealthReading(
                values=values,
                unsupported=frozenset(unsupported - answered),
                errors=errors,
                identity={"uuid": uuid or bdf, "name": name, "pci_bus_id": bdf, "memory_total_bytes": total},
            )
            out.append((device, reading))
        job.current = ""
        return out, driver

    def _rocm_smi(self) -> GPUSnapshot:
        result = self._run(ROCM_SMI_ARGS, self.call_timeout)
        if result.error:
            why = f"{result.error}; the AMD SMI library is not usable either ({self._why_not_amdsmi})"
            return self._unavailable(why)
        rows, driver, error = parse_rocm_smi(result.stdout)
        if error:
            detail = f" (exit status {result.returncode}: {result.stderr.strip()[:200]})" if result.returncode else ""
            return self._unavailable(error + detail)
        devices = []
        for row in rows:
            render = render_node_for(row["pci_bus_id"], self._sysfs) if row["pci_bus_id"] else ""
            total = row["memory_total_bytes"]
            device = GPUDevice(
                index=row["index"],
                vendor="amd",
                uuid=row["uuid"],
                name=row["name"],
                pci_bus_id=row["pci_bus_id"],
                serial=row["serial"],
                driver_version=driver,
                memory_total_bytes=total,
                memory_used_bytes=row["memory_used_bytes"],
                memory_free_bytes=max(0, total - row["memory_used_bytes"]),
                utilization_pct=row["utilization_pct"],
                temperature_c=row["temperature_c"],
                power_draw_w=row["power_draw_w"],
                render_node=render,
            )
            self.tracker.observe_reading(
                device.index,
                HealthReading(
                    values={"figures": True},
                    unsupported=frozenset({"ecc"}),
                    identity={
                        "uuid": device.uuid or device.pci_bus_id or f"card{row['card']}",
                        "name": device.name,
                        "pci_bus_id": device.pci_bus_id,
                        "memory_total_bytes": total,
                    },
                ),
            )
            devices.append(device)
        return self._result(devices, driver, "rocm-smi")
