"""
Giving the start-up's freed heap back to the operating system (issue 27: RSS at idle).

Starting up (imports, the first connect, the first inventory) frees more memory than the idle
agent ever uses again; glibc keeps freed memory at the top of its heaps for reuse and returns
it only past a threshold. L{HeapTrim} calls glibc's C{malloc_trim(0)} once, after start-up has
settled (the composition root calls it after the first inventory report), on a thread pool:
the call walks every malloc arena and may take milliseconds, which the reactor never waits for.

Where there is no glibc C{malloc_trim} (musl, macOS, a binary linked without it) it does
nothing.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Any

from twisted.logger import Logger

__all__ = ["HeapTrim", "glibc_malloc_trim"]


def glibc_malloc_trim() -> Callable[[], Any] | None:
    """
    glibc's C{malloc_trim} as a function of no arguments (it trims with pad 0), or C{None}
    where the process has none: not Linux, or a C library that is not glibc (musl has no
    C{gnu_get_libc_version}).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl has a malloc_trim-less libc
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


class HeapTrim:
    """
    Runs the trim that C{find} returns (L{glibc_malloc_trim} by default) once, on
    C{run_in_pool} (a thread pool's C{run}); later calls of L{once} do nothing, as do all where
    C{find} found none.
    """

    log = Logger()

    def __init__(
        self,
        run_in_pool: Callable[..., Any],
        find: Callable[[], Callable[[], Any] | None] = glibc_malloc_trim,
    ) -> None:
        self._run = run_in_pool
        self._trim = find()
        #: How many times the trim was handed to the pool (0 or 1).
        self.runs = 0

    @property
    def available(self) -> bool:
        """Whether there is a C{malloc_trim} to call."""
        return self._trim is not None

    def once(self) -> None:
        """Hand the trim to the pool the first time (reactor thread); nothing after that."""
        if self.runs or self._trim is None:
            return
        self.runs = 1
        d = self._run(self._trim)
        d.addErrback(lambda f: self.log.debug("malloc_trim failed: {error}", error=f.getErrorMessage()))
