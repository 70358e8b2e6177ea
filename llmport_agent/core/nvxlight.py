"""
Autobahn's NVX accelerators without parsing C at start (issue 27: start to connected).

Autobahn checks every incoming text message for valid UTF-8 and masks every frame the client
sends; with its NVX extensions built, both run in C. The C code is in two compiled modules,
C{_nvx_utf8validator} and C{_nvx_xormasker} (API-mode cffi, built at install), each with its
own C{ffi} and C{lib}. The Python wrappers that C{autobahn.websocket} imports,
C{autobahn.nvx._utf8validator} and C{autobahn.nvx._xormasker}, are also the build scripts of
those modules: at import each makes a new C{cffi.FFI()}, parses its C declarations
(C{ffi.cdef}, which imports pycparser) and reads its C source for C{set_source}. None of that
is used after the build: about 12 ms of every start of the agent, before the first connect.

L{install_light_nvx} registers two small modules under those two names instead, before
C{autobahn.websocket} is imported. They have the same public names and behave the same, over
the compiled modules' own C{ffi} and C{lib}. The trade-off: they stand in for two private
modules of Autobahn. C{tests/test_nvxlight.py} compares them with Autobahn's own (same
results on a fixed corpus, every public name of Autobahn's modules present here), so an
Autobahn that changes them turns the tests red. Where Autobahn would not use NVX (the compiled
modules missing, or C{AUTOBAHN_USE_NVX} switching it off) nothing is registered, and Autobahn
picks its pure-Python classes as it would anyway.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

__all__ = [
    "UTF8_MODULE",
    "XOR_MODULE",
    "Utf8Validator",
    "XorMaskerNvx",
    "XorMaskerShifted1",
    "XorMaskerSimple",
    "create_xor_masker",
    "install_light_nvx",
    "nvx_turned_off",
]

#: Autobahn's wrapper modules that L{install_light_nvx} stands in for.
UTF8_MODULE = "autobahn.nvx._utf8validator"
XOR_MODULE = "autobahn.nvx._xormasker"
#: The compiled modules (top level, built with Autobahn).
_COMPILED_UTF8 = "_nvx_utf8validator"
_COMPILED_XOR = "_nvx_xormasker"
#: Once one of these is imported, Autobahn has chosen its classes already.
_CHOSEN = (UTF8_MODULE, XOR_MODULE, "autobahn.websocket.utf8validator", "autobahn.websocket.xormasker")
#: C{nvx_xormask_set_impl}'s implementations (Autobahn's numbers).
_XOR_SCALAR = 1
_XOR_SIMD = 2
#: From this payload length on, Autobahn's factory picks the SIMD masker.
_SIMD_FROM = 128


def _compiled(name: str) -> Any:
    """A compiled NVX module (imported already where L{install_light_nvx} registered these)."""
    return importlib.import_module(name)


class Utf8Validator:
    """Incremental UTF-8 validation in C, as C{autobahn.nvx._utf8validator.Utf8Validator}."""

    def __init__(self) -> None:
        compiled = _compiled(_COMPILED_UTF8)
        self.ffi = compiled.ffi
        self.lib = compiled.lib
        self._vld = self.ffi.gc(self.lib.nvx_utf8vld_new(), self.lib.nvx_utf8vld_free)

    def reset(self) -> None:
        """Start a new message."""
        self.lib.nvx_utf8vld_reset(self._vld)

    def validate(self, ba: bytes) -> tuple[bool, bool, int, int]:
        """
        Feed the next bytes of the message: (still valid, ends on a whole code point, index
        reached in this chunk, index reached in the message), as Autobahn's validators answer.
        """
        lib, vld = self.lib, self._vld
        res = lib.nvx_utf8vld_validate(vld, ba, len(ba))
        return (res >= 0, res == 0, lib.nvx_utf8vld_get_current_index(vld),
                lib.nvx_utf8vld_get_total_index(vld))


class XorMaskerNvx:
    """WebSocket payload masking in C, as C{autobahn.nvx._xormasker.XorMaskerNvx}."""

    __slots__ = ("ffi", "lib", "_masker", "_mask_buffer")

    def __init__(self, mask: bytes, use_simd: bool = True) -> None:
        if len(mask) != 4:
            raise ValueError(f"a WebSocket mask is 4 bytes, not {len(mask)}")
        compiled = _compiled(_COMPILED_XOR)
        self.ffi = compiled.ffi
        self.lib = compiled.lib
        # Kept as Autobahn keeps it (the C masker copies the 4 bytes at nvx_xormask_new).
        self._mask_buffer = self.ffi.new("uint8_t[4]", mask)
        self._masker = self.ffi.gc(self.lib.nvx_xormask_new(self._mask_buffer), self.lib.nvx_xormask_free)
        self.lib.nvx_xormask_set_impl(self._masker, _XOR_SIMD if use_simd else _XOR_SCALAR)

    def pointer(self) -> int:
        """How many payload bytes were masked so far (the position in the mask cycle)."""
        return int(self.lib.nvx_xormask_pointer(self._masker))

    def reset(self) -> None:
        """Start again at the first byte of the mask."""
        self.lib.nvx_xormask_reset(self._masker)

    def process(self, data: bytes) -> bytes:
        """C{data} masked (or unmasked), continuing where the previous call stopped."""
        ffi, n = self.ffi, len(data)
        buf = ffi.new("uint8_t[]", n)
        ffi.memmove(buf, data, n)
        self.lib.nvx_xormask_process(self._masker, buf, n)
        return bytes(ffi.buffer(buf, n))


class XorMaskerSimple(XorMaskerNvx):
    """The scalar C masker (short payloads)."""

    __slots__ = ()

    def __init__(self, mask: bytes) -> None:
        super().__init__(mask, use_simd=False)


class XorMaskerShifted1(XorMaskerNvx):
    """The SIMD C masker (long payloads)."""

    __slots__ = ()

    def __init__(self, mask: bytes) -> None:
        super().__init__(mask, use_simd=True)


def create_xor_masker(mask: bytes, length: int | None = None) -> XorMaskerNvx:
    """The masker for a payload of C{length} bytes, chosen as Autobahn's factory does."""
    if length is None or length < _SIMD_FROM:
        return XorMaskerSimple(mask)
    return XorMaskerShifted1(mask)


def nvx_turned_off(environ: Mapping[str, str] = os.environ) -> bool:
    """
    Whether C{AUTOBAHN_USE_NVX} turns NVX off, as C{autobahn.websocket} reads it (C{0}, C{no}
    or C{false}, any case, blanks around), without importing it. Otherwise Autobahn uses NVX
    where the compiled modules import.
    """
    return environ.get("AUTOBAHN_USE_NVX", "").strip().lower() in ("0", "no", "false")


def _light_module(name: str, values: Mapping[str, Any]) -> ModuleType:
    module = ModuleType(name, f"Stands for Autobahn's {name} (llmport_agent.core.nvxlight).")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, origin=__file__)
    module.__file__ = __file__
    module.__dict__.update(values)
    return module


def install_light_nvx(environ: Mapping[str, str] = os.environ) -> bool:
    """
    Register the light C{autobahn.nvx._utf8validator} and C{autobahn.nvx._xormasker}, for
    C{autobahn.websocket} to import. Call it before anything imports C{autobahn.websocket}'s
    validator or masker. Nothing is done (and C{False} returned) when one of those modules is
    imported already, when C{AUTOBAHN_USE_NVX} turns NVX off, or when the compiled modules do
    not import (Autobahn then uses, or refuses, as it would on its own). Returns whether the
    light modules were registered.
    """
    if any(name in sys.modules for name in _CHOSEN):
        return False
    if nvx_turned_off(environ):
        return False
    try:
        importlib.import_module(_COMPILED_UTF8)
        importlib.import_module(_COMPILED_XOR)
    except ImportError:
        return False
    sys.modules[UTF8_MODULE] = utf8 = _light_module(UTF8_MODULE, {"Utf8Validator": Utf8Validator})
    sys.modules[XOR_MODULE] = xor = _light_module(XOR_MODULE, {
        "XorMaskerNvx": XorMaskerNvx,
        "XorMaskerSimple": XorMaskerSimple,
        "XorMaskerShifted1": XorMaskerShifted1,
        "create_xor_masker": create_xor_masker,
    })
    # The package as an import of its submodules would leave it: its __init__ (which imports
    # Utf8Validator from the first) finds the light module, and both are its attributes.
    try:
        package = importlib.import_module("autobahn.nvx")
    except ImportError:
        return True
    setattr(package, "_utf8validator", utf8)  # noqa: B010 - a submodule, as the import system binds it
    setattr(package, "_xormasker", xor)  # noqa: B010
    return True
