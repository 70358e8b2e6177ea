"""
C{docker exec} inside the runtime container, bounded in time and memory.

L{exec_in} is a thread function for L{DockerEngine.call}: it creates the exec (argv as a
list, never a shell; C{env} on the exec only), writes C{stdin} when given, reads stdout and
stderr keeping at most C{limit} bytes of each (the rest is read and dropped so the process
never blocks on a full pipe), and gives up at C{timeout} seconds (the socket is closed; the
result says so). Returns an L{ExecResult}.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from llmport_agent.core.lazyimport import LazyModule
from llmport_agent.core.values import frozen

from ..workloads import dockerapi
from ..workloads.engine import StreamControl

if TYPE_CHECKING:
    import docker
else:
    docker = LazyModule("docker")  # docker-py: imported at its first use

#: Bytes of stdout (and of stderr) kept from one exec.
OUTPUT_LIMIT = 1024 * 1024


@frozen
class ExecResult:
    """The outcome of one exec: exit code (C{None} when it did not finish), output, flags."""

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    truncated: bool = False

    @property
    def out(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def err(self) -> str:
        return self.stderr.decode("utf-8", "replace")

    def detail(self, limit: int = 600) -> str:
        """The last C{limit} characters of stderr (else stdout), on one line."""
        text = (self.err.strip() or self.out.strip())[-limit:]
        return " ".join(text.split())


class _Reader:
    """Demultiplexes Docker's attach stream (8-byte frame headers), streaming and bounded."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.header = b""
        self.kind = 1
        self.remaining = 0
        self.out = bytearray()
        self.err = bytearray()
        self.truncated = False

    def _keep(self, chunk: bytes) -> None:
        target = self.err if self.kind == 2 else self.out
        room = self.limit - len(target)
        if room < len(chunk):
            self.truncated = True
        if room > 0:
            target += chunk[:room]

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        pos = 0
        while pos < len(view):
            if self.remaining:
                take = min(self.remaining, len(view) - pos)
                self._keep(bytes(view[pos : pos + take]))
                self.remaining -= take
                pos += take
                continue
            need = 8 - len(self.header)
            self.header += bytes(view[pos : pos + need])
            pos += need
            if len(self.header) == 8:
                self.kind = self.header[0]
                self.remaining = int.from_bytes(self.header[4:8], "big")
                self.header = b""


class _Closer:
    """Ends a read blocked in another thread: C{shutdown} wakes it (a bare C{close} does not)."""

    def __init__(self, raw: socket.socket) -> None:
        self._raw = raw

    def close(self) -> None:
        try:
            self._raw.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._raw.close()


def _raw_socket(sock: Any) -> socket.socket:
    raw = dockerapi.underlying_socket(sock)
    return raw  # type: ignore[no-any-return]


def exec_stream(
    client: docker.DockerClient,
    control: StreamControl,
    container: str,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    stdin: bytes | None = None,
    timeout: float = 120.0,
    limit: int = OUTPUT_LIMIT,
) -> ExecResult:
    """Thread function for L{DockerEngine.stream}: L{exec_in}, its socket closed by C{control}."""
    return exec_in(client, container, argv, env, stdin, timeout, limit, control=control)


def exec_in(
    client: docker.DockerClient,
    container: str,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    stdin: bytes | None = None,
    timeout: float = 120.0,
    limit: int = OUTPUT_LIMIT,
    *,
    control: StreamControl | None = None,
) -> ExecResult:
    """Thread function: run C{argv} in C{container}; see the module docstring."""
    api = client.api
    created = api.exec_create(
        container,
        list(argv),
        stdout=True,
        stderr=True,
        stdin=stdin is not None,
        tty=False,
        environment=[f"{k}={v}" for k, v in (env or {}).items()] or None,
    )
    exec_id = created["Id"]
    sock = api.exec_start(exec_id, socket=True)
    raw = _raw_socket(sock)
    if control is not None:
        control.attach(_Closer(raw))  # a cancelled command shuts the socket: the read ends at once
    reader = _Reader(limit)
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        if stdin is not None:
            raw.settimeout(max(1.0, timeout))
            raw.sendall(stdin)
            raw.shutdown(socket.SHUT_WR)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            raw.settimeout(min(left, 5.0))
            try:
                data = raw.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            reader.feed(data)
    finally:
        try:
            sock.close()
        except Exception:  # noqa: BLE001 - closing a dead socket
            pass
        if raw is not sock:
            try:
                raw.close()
            except Exception:  # noqa: BLE001
                pass
    if control is not None:
        control.check()  # closed from the reactor side (the command was cancelled)
    code: int | None = None
    if not timed_out:
        for _ in range(50):
            info = api.exec_inspect(exec_id)
            if not info.get("Running"):
                code = info.get("ExitCode")
                break
            time.sleep(0.1)
    return ExecResult(
        code if isinstance(code, int) else None,
        bytes(reader.out),
        bytes(reader.err),
        timed_out=timed_out,
        truncated=reader.truncated,
    )
