# -*- test-case-name: tests.test_gpu_sources -*-
"""
A stand-in for the C{amdsmi} Python module (AMD SMI 7.0) for nodes and tests without AMD
GPUs: the same function names and parameters as C{amdsmi/amdsmi_interface.py} of amdsmi
7.0.2 (checked in tests against a record of that file's signatures), the same return shapes
(dictionaries with the library's keys, C{"N/A"} where the library says so, VRAM in MB), the
same exceptions (C{AmdSmiException}, C{AmdSmiLibraryException} with C{err_code}) and enums.

Knobs: L{FakeAMDSMI.fail} makes a function raise C{AmdSmiLibraryException(code)} for one GPU
or all; C{init_error} makes C{amdsmi_init} fail; L{FakeAMDSMI.hang} blocks a function.
"""

from __future__ import annotations

import threading
from enum import IntEnum
from typing import Any

from attrs import field

from llmport_agent.core.values import define

__all__ = ["AMDSMI_STATUS", "FakeAMDGPU", "FakeAMDSMI", "AmdSmiException", "AmdSmiLibraryException"]

#: AMDSMI_STATUS_* values (amdsmi_wrapper.py of amdsmi 7.0.2).
AMDSMI_STATUS = {
    "NOT_SUPPORTED": 2,
    "NOT_YET_IMPLEMENTED": 3,
    "API_FAILED": 7,
    "TIMEOUT": 8,
    "NO_PERM": 10,
    "IO": 12,
    "NOT_FOUND": 31,
    "NOT_INIT": 32,
    "DRIVER_NOT_LOADED": 34,
    "NO_DATA": 40,
}


class AmdSmiException(Exception):
    """Base smi exception class (as in amdsmi_exception.py)."""


class AmdSmiLibraryException(AmdSmiException):
    """An error from the library: C{err_code} (absolute AMDSMI_STATUS value) and C{err_info}."""

    def __init__(self, err_code: int) -> None:
        err_code = abs(err_code)
        super().__init__(err_code)
        self.err_code = err_code
        names = {v: k for k, v in AMDSMI_STATUS.items()}
        self.err_info = f"AMDSMI_STATUS_{names.get(err_code, 'UNKNOWN_ERROR')}"

    def __str__(self) -> str:
        return f"Error code:\n\t{self.err_code} | {self.err_info}"

    def get_error_code(self) -> int:
        return self.err_code


class AmdSmiInitFlags(IntEnum):
    INIT_ALL_PROCESSORS = 0xFFFFFFFF
    INIT_AMD_CPUS = 1 << 0
    INIT_AMD_GPUS = 1 << 1
    INIT_AMD_APUS = (1 << 0) | (1 << 1)
    INIT_NON_AMD_CPUS = 1 << 2
    INIT_NON_AMD_GPUS = 1 << 3


class AmdSmiTemperatureType(IntEnum):
    EDGE = 0
    HOTSPOT = 1
    JUNCTION = 1
    VRAM = 2
    HBM_0 = 3
    HBM_1 = 4


class AmdSmiTemperatureMetric(IntEnum):
    CURRENT = 0
    MAX = 1
    MIN = 2
    MAX_HYST = 3
    MIN_HYST = 4
    CRITICAL = 5


class _Handle:
    """An opaque processor handle (C{amdsmi_processor_handle})."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<amdsmi_processor_handle {self.index}>"


@define
class FakeAMDGPU:
    """One fake AMD GPU; C{None} for a figure makes its call raise NOT_SUPPORTED."""

    market_name: str
    bdf: str
    uuid: str
    asic_serial: str = "N/A"
    product_serial: str = "N/A"
    vram_total_mb: int = 0
    vram_used_mb: int = 0
    gfx_activity: int | str = 0
    edge_temp: int | None = 40
    hotspot_temp: int | None = 45
    current_socket_power: int | str = "N/A"
    average_socket_power: int | str = 100
    power_limit: int = 750
    driver_version: str = "6.18.3"
    ecc: dict[str, int] | None = field(factory=lambda: {"correctable_count": 0, "uncorrectable_count": 0, "deferred_count": 0})
    drm_render: int | str = 128


class FakeAMDSMI:
    """Quacks like the C{amdsmi} module."""

    AmdSmiException = AmdSmiException
    AmdSmiLibraryException = AmdSmiLibraryException
    AmdSmiInitFlags = AmdSmiInitFlags
    AmdSmiTemperatureType = AmdSmiTemperatureType
    AmdSmiTemperatureMetric = AmdSmiTemperatureMetric

    def __init__(self, gpus: list[FakeAMDGPU], *, init_error: int | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.initialized = False
        self.calls: list[tuple[str, int | None]] = []
        self._failures: dict[tuple[str, int | None], int] = {}
        self._hangs: dict[str, threading.Event] = {}

    def fail(self, function: str, code: int, device: int | None = None) -> None:
        if not callable(getattr(self, function, None)):
            raise AttributeError(function)
        self._failures[(function, device)] = code

    def clear_failures(self) -> None:
        self._failures.clear()

    def hang(self, function: str) -> threading.Event:
        ev = threading.Event()
        self._hangs[function] = ev
        return ev

    def _enter(self, name: str, handle: Any = None) -> FakeAMDGPU | None:
        index = handle.index if isinstance(handle, _Handle) else None
        self.calls.append((name, index))
        ev = self._hangs.get(name)
        if ev is not None:
            ev.wait()
        if not self.initialized and name != "amdsmi_init":
            raise AmdSmiLibraryException(AMDSMI_STATUS["NOT_INIT"])
        if handle is not None and not isinstance(handle, _Handle):
            raise AmdSmiException(f"{handle!r} is not an amdsmi_processor_handle")  # AmdSmiParameterException
        code = self._failures.get((name, index), self._failures.get((name, None)))
        if code is not None:
            raise AmdSmiLibraryException(code)
        return self.gpus[index] if index is not None else None

    # -- the API

    def amdsmi_init(self, flag: int = AmdSmiInitFlags.INIT_AMD_GPUS) -> None:
        self._enter("amdsmi_init")
        if self.init_error is not None:
            raise AmdSmiLibraryException(self.init_error)
        self.initialized = True

    def amdsmi_shut_down(self) -> None:
        self._enter("amdsmi_shut_down")
        self.initialized = False

    def amdsmi_get_processor_handles(self) -> list[_Handle]:
        self._enter("amdsmi_get_processor_handles")
        return [_Handle(i) for i in range(len(self.gpus))]

    def amdsmi_get_gpu_device_uuid(self, processor_handle: _Handle) -> str:
        g = self._enter("amdsmi_get_gpu_device_uuid", processor_handle)
        assert g is not None
        return g.uuid

    def amdsmi_get_gpu_device_bdf(self, processor_handle: _Handle) -> str:
        g = self._enter("amdsmi_get_gpu_device_bdf", processor_handle)
        assert g is not None
        return g.bdf

    def amdsmi_get_gpu_asic_info(self, processor_handle: _Handle) -> dict[str, Any]:
        g = self._enter("amdsmi_get_gpu_asic_info", processor_handle)
        assert g is not None
        return {
            "market_name": g.market_name,
            "vendor_id": "0x1002",
            "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
            "subvendor_id": "0x1002",
            "device_id": "0x75a0",
            "rev_id": "0x00",
            "asic_serial": g.asic_serial,
            "oam_id": 0,
            "num_compute_units": 128,
            "target_graphics_version": "gfx950",
            "subsystem_id": "0x75a0",
        }

    def amdsmi_get_gpu_board_info(self, processor_handle: _Handle) -> dict[str, Any]:
        g = self._enter("amdsmi_get_gpu_board_info", processor_handle)
        assert g is not None
        return {
            "model_number": "N/A",
            "product_serial": g.product_serial,
            "fru_id": "N/A",
            "product_name": g.market_name,
            "manufacturer_name": "AMD",
        }

    def amdsmi_get_gpu_vram_usage(self, processor_handle: _Handle) -> dict[str, Any]:
        g = self._enter("amdsmi_get_gpu_vram_usage", processor_handle)
        assert g is not None
        return {"vram_total": g.vram_total_mb, "vram_used": g.vram_used_mb}

    def amdsmi_get_gpu_activity(self, processor_handle: _Handle) -> dict[str, Any]:
        g = self._enter("amdsmi_get_gpu_activity", processor_handle)
        assert g is not None
        return {"gfx_activity": g.gfx_activity, "umc_activity": "N/A", "mm_activity": "N/A"}

    def amdsmi_get_temp_metric(
        self, processor_handle: _Handle, sensor_type: int, metric: int
    ) -> int:
        g = self._enter("amdsmi_get_temp_metric", processor_handle)
        assert g is not None
        value = g.edge_temp if sensor_type == AmdSmiTemperatureType.EDGE else g.hotspot_temp
        if value is None:
            raise AmdSmiLibraryException(AMDSMI_STATUS["NOT_SUPPORTED"])
        return value

    def amdsmi_get_power_info(self, processor_handle: _Handle) -> dict[str, Any]:
        g = self._enter("amdsmi_get_power_info", processor_handle)
        assert g is not None
        return {
            "socket_power": g.average_socket_power,
            "current_socket_power": g.current_socket_power,
            "average_socket_power": g.average_socket_power,
            "gfx_voltage": "N/A",
            "soc_voltage": "N/A",
            "mem_voltage": "N/A",
            "power_limit": g.power_limit,
        }

    def amdsmi_get_gpu_driver_info(self, processor_handle: _Handle) -> dict[str, Any]:
        g = self._enter("amdsmi_get_gpu_driver_info", processor_handle)
        assert g is not None
        return {"driver_name": "amdgpu", "driver_version": g.driver_version, "driver_date": "N/A"}

    def amdsmi_get_gpu_total_ecc_count(self, processor_handle: _Handle) -> dict[str, Any]:
        g = self._enter("amdsmi_get_gpu_total_ecc_count", processor_handle)
        assert g is not None
        if g.ecc is None:
            raise AmdSmiLibraryException(AMDSMI_STATUS["NOT_SUPPORTED"])
        return dict(g.ecc)

    def amdsmi_get_gpu_enumeration_info(self, processor_handle: _Handle) -> dict[str, Any]:
        g = self._enter("amdsmi_get_gpu_enumeration_info", processor_handle)
        assert g is not None
        return {"drm_render": g.drm_render, "drm_card": "N/A", "hsa_id": "N/A", "hip_id": "N/A", "hip_uuid": ""}


#: The public functions FakeAMDSMI implements.
FAKE_FUNCTIONS = tuple(sorted(n for n in vars(FakeAMDSMI) if n.startswith("amdsmi_")))
