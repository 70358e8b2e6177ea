# -*- test-case-name: tests.test_gpu_sources -*-
"""Running a vendor tool (C{rocm-smi}, C{system_profiler}) with a timeout and bounded output."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence

from attrs import frozen

__all__ = ["MAX_OUTPUT", "ToolResult", "ToolRunner", "run_tool"]

#: The most output read from a tool (bytes); more is cut (and the parse then fails clearly).
MAX_OUTPUT = 8 * 1024 * 1024


@frozen
class ToolResult:
    """
    @ivar error: C{""} when the tool ran (whatever its exit status); else why not
        (not installed, timed out, could not start).
    """

    returncode: int
    stdout: str
    stderr: str
    error: str = ""


ToolRunner = Callable[[Sequence[str], float], ToolResult]


def run_tool(argv: Sequence[str], timeout: float) -> ToolResult:
    """Run C{argv} (blocking; call it off the reactor), killing it after C{timeout} seconds."""
    exe = shutil.which(argv[0])
    if exe is None:
        return ToolResult(-1, "", "", f"{argv[0]} is not installed (not on PATH)")
    try:
        done = subprocess.run(
            [exe, *argv[1:]],
            capture_output=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return ToolResult(-1, "", "", f"{argv[0]} did not finish within {timeout:g} s")
    except OSError as e:
        return ToolResult(-1, "", "", f"{argv[0]} could not be started: {e.strerror or e}")
    out = done.stdout[:MAX_OUTPUT].decode("utf-8", "replace")
    err = done.stderr[-4096:].decode("utf-8", "replace")
    return ToolResult(done.returncode, out, err)
