# -*- test-case-name: tests.test_gpu_sources -*-
"""Running a vendor tool (C{rocm-smi}, C{system_profiler}) with a timeout and bounded output."""

from __future__ import annotations

import os
import selectors
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

from llmport_agent.core.values import frozen

__all__ = ["MAX_OUTPUT", "ToolResult", "ToolRunner", "run_tool"]

#: The most output read from a tool (bytes); a tool printing more is stopped (one clear error).
MAX_OUTPUT = 8 * 1024 * 1024
#: The end of a tool's stderr kept (bytes).
STDERR_TAIL = 4096
_READ = 64 * 1024


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


def run_tool(
    argv: Sequence[str], timeout: float, max_output: int = MAX_OUTPUT, env: Mapping[str, str] | None = None
) -> ToolResult:
    """
    Run C{argv} (blocking; call it off the reactor), killing it after C{timeout} seconds.

    Its output is read as it comes, never more than C{max_output} bytes of stdout and the last
    L{STDERR_TAIL} bytes of stderr held: a tool printing more than C{max_output} is killed at
    that point and answered as an error (a tool printing gigabytes costs bounded memory).
    """
    exe = shutil.which(argv[0])
    if exe is None:
        return ToolResult(-1, "", "", f"{argv[0]} is not installed (not on PATH)")
    try:
        proc = subprocess.Popen(
            [exe, *argv[1:]],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=None if env is None else dict(env),
        )
    except OSError as e:
        return ToolResult(-1, "", "", f"{argv[0]} could not be started: {e.strerror or e}")
    out, err = bytearray(), bytearray()
    problem = ""
    deadline = time.monotonic() + timeout
    try:
        with selectors.DefaultSelector() as sel:
            assert proc.stdout is not None and proc.stderr is not None
            sel.register(proc.stdout, selectors.EVENT_READ, out)
            sel.register(proc.stderr, selectors.EVENT_READ, err)
            while sel.get_map() and not problem:
                left = deadline - time.monotonic()
                if left <= 0:
                    problem = f"{argv[0]} did not finish within {timeout:g} s"
                    break
                for key, _ in sel.select(left):
                    data = os.read(key.fd, _READ)
                    if not data:
                        sel.unregister(key.fileobj)
                    elif key.data is out:
                        out += data
                        if len(out) > max_output:
                            problem = (f"{argv[0]} printed more than {max_output} bytes; it was "
                                       "stopped and its output ignored")
                            break
                    else:
                        err += data
                        del err[:-STDERR_TAIL]
        if problem:
            proc.kill()
        try:
            returncode = proc.wait(max(0.0, deadline - time.monotonic()) if not problem else 5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            problem = problem or f"{argv[0]} did not finish within {timeout:g} s"
            returncode = -1
    finally:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        if proc.returncode is None:
            proc.kill()
            proc.wait()
    if problem:
        return ToolResult(-1, "", "", problem)
    return ToolResult(returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))
