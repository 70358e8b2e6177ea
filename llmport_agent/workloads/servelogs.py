"""
Ray Serve replica logs for C{fetch_container_logs} (protocol 10.4).

A runtime deployed on Ray is a Serve application called C{llmport-<deployment id>}; its
replicas run inside the node's one Ray runtime container, C{llm-port-ray-runtime}, and write
their output to files under C{/tmp/ray/session_latest/logs/serve/}
(C{replica_<app>_<deployment>_<replica>.log}), not to the container's console. When the
runtime's name names such an app, the newest of those files (at most L{MAX_FILES}, each the
last C{tail} lines, headed C{===== <file> =====}) are the answer; the caller falls back to
container logs when there are none.

The container must be this agent's (the Ray runtime's labels): nothing is run in another one.
The files are read inside the container, through the engine (an exec of C{sh}): paths and
symlinks resolve in the container's own file system, never on the host. The app name and
replica id reach the shell as positional arguments (never spliced into the script), are
checked against a small alphabet first, and stay literal inside the glob. Output is bounded
inside the container (C{head -c} per file) and again here (L{read_serve_logs} stops reading
at C{max_bytes} and at its deadline, then closes the exec's socket).
"""

from __future__ import annotations

import re
import socket
import struct
import time
from typing import TYPE_CHECKING, Any

from llmport_agent.core.lazyimport import LazyModule

from ..ray.container import is_ours
from . import dockerapi
from .containers import by_exact_name

if TYPE_CHECKING:
    import docker
else:
    docker = LazyModule("docker")  # docker-py: imported at its first use

#: The Ray runtime container (protocol 10.6).
RAY_CONTAINER = "llm-port-ray-runtime"
#: Where Ray Serve writes replica logs inside it.
SERVE_LOG_DIR = "/tmp/ray/session_latest/logs/serve"
#: At most this many replica log files, newest first.
MAX_FILES = 8
#: At most this many bytes of any one file come out of the container.
FILE_BYTES = 128 * 1024
#: Exit status of the script when no file matches.
NO_FILES = 9

_APP_RE = re.compile(r"^llmport-[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
_REPLICA_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")

# $1 app, $2 replica ("" for any), $3 lines per file, $4 directory, $5 files, $6 bytes per file.
# Quoted parts of a glob are literal; only the script's own '*' expand.
_SCRIPT = r"""
cd "$4" 2>/dev/null || exit 9
files=$(ls -1t replica_"$1"_*"$2"*.log 2>/dev/null | head -n "$5")
[ -n "$files" ] || exit 9
printf '%s\n' "$files" | while IFS= read -r f; do
  [ -f "$f" ] || continue
  echo "===== $f ====="
  tail -n "$3" "$f" 2>/dev/null | head -c "$6"
  echo
done
exit 0
"""


def serve_app_name(runtime_name: object) -> str | None:
    """C{runtime_name} when it names an llm-port Serve app (C{llmport-<id>}), else C{None}."""
    if isinstance(runtime_name, str) and _APP_RE.match(runtime_name.strip()):
        return runtime_name.strip()
    return None


def parse_replica(value: object) -> str | None:
    """An optional C{replica_id}: a Serve replica id, or C{None} (absent or not one)."""
    if isinstance(value, str) and _REPLICA_RE.match(value.strip()):
        return value.strip()
    return None


def _raw_socket(sock: Any) -> socket.socket | None:
    for candidate in (sock, dockerapi.underlying_socket(sock)):
        if isinstance(candidate, socket.socket):
            return candidate
    return None


def _read_exact(sock: Any, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out)) if hasattr(sock, "recv") else sock.read(n - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def read_serve_logs(
    client: docker.DockerClient,
    app: str,
    replica: str | None,
    tail: int,
    max_bytes: int,
    agent_id: str,
    deadline_sec: float = 6.0,
) -> dict[str, Any] | None:
    """
    Thread function: the replica logs of C{app} inside L{RAY_CONTAINER}, or C{None} when that
    container is not running, is not this agent's (its Ray labels, L{is_ours}: nothing is run
    in a container the agent does not own) or holds no matching file. Returns C{{"logs",
    "files", "truncated", "container_name"}}.
    """
    snap = by_exact_name(client, RAY_CONTAINER)
    if snap is None or not snap["running"] or not is_ours(snap, agent_id):
        return None
    api = client.api
    created = api.exec_create(
        snap["id"],
        ["sh", "-c", _SCRIPT, "sh", app, replica or "", str(int(tail)), SERVE_LOG_DIR,
         str(MAX_FILES), str(FILE_BYTES)],
        stdout=True,
        stderr=False,
    )
    exec_id = created["Id"]
    sock = api.exec_start(exec_id, socket=True)
    raw = _raw_socket(sock)
    end = time.monotonic() + deadline_sec
    data = bytearray()
    truncated = False
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0:
                truncated = True
                break
            if raw is not None:
                raw.settimeout(left)
            try:
                header = _read_exact(sock, 8)
            except TimeoutError:
                truncated = True
                break
            if len(header) < 8:
                break
            stream, size = header[0], struct.unpack(">I", header[4:8])[0]
            try:
                payload = _read_exact(sock, size)
            except TimeoutError:
                truncated = True
                break
            if stream != 1:
                continue
            room = max_bytes - len(data)
            if len(payload) > room:
                data += payload[:room]
                truncated = True
                break
            data += payload
    finally:
        try:
            sock.close()
        except OSError:
            pass
        if raw is not None:
            try:
                raw.close()
            except OSError:
                pass
    exit_code = None
    if not truncated:
        try:
            exit_code = api.exec_inspect(exec_id).get("ExitCode")
        except docker.errors.APIError:
            exit_code = None
    text = bytes(data).decode("utf-8", "replace")
    if exit_code == NO_FILES or not text.strip():
        return None
    files = sum(1 for line in text.splitlines() if line.startswith("===== ") and line.endswith(" ====="))
    return {
        "logs": text.rstrip("\n"),
        "files": files,
        "truncated": truncated,
        "container_name": RAY_CONTAINER,
    }
