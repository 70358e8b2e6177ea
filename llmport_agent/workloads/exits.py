"""
How a container really ended: its exit code and the log lines it wrote before it ended.

C{State.ExitCode} alone is not enough: with the restart policy C{unless-stopped} the engine
restarts a crashed workload at once, and once it runs again C{docker inspect} reports exit
code 0 (and the newest log lines are the new run's). The engine's own C{die} event for the
container keeps the real code and the time of the exit: this module reads it (a bounded
C{since}/C{until} query of the engine's event log, which returns at once) and the log lines
written before that time.

A thread function for the engine's short pool, like those in L{containers}.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

from llmport_agent.core.lazyimport import LazyModule

from .containers import read_logs, snapshot

if TYPE_CHECKING:
    import docker
else:
    docker = LazyModule("docker")  # docker-py: imported at its first use

#: Exit code reported when the engine no longer knows it (the container ran again and its
#: C{die} event has left the engine's event buffer).
UNKNOWN_EXIT = -1

_MAX_EVENTS = 1000


def _unix(stamp: str) -> float | None:
    """The engine's RFC 3339 time (nanoseconds, C{Z}) as Unix seconds."""
    if not stamp or stamp.startswith("0001-"):
        return None
    text = stamp.rstrip("Z")
    head, _, frac = text.partition(".")
    try:
        base = datetime.fromisoformat(head + "+00:00").timestamp()
    except ValueError:
        return None
    return base + (float("0." + frac[:9]) if frac.isdigit() else 0.0)


def last_die(client: docker.DockerClient, container_id: str, since: float | None) -> dict[str, Any] | None:
    """
    The newest C{die} event of the container since C{since}: C{{"exit_code", "time"}}
    (Unix seconds, nanosecond precision), or C{None} when the engine has none.
    """
    params_since = int(since) - 1 if since else int(time.time()) - 24 * 3600
    try:
        stream = client.api.events(
            since=params_since,
            until=int(time.time()) + 1,
            # Docker names the event "die", Podman's filter "died" (its events still say "die").
            filters={"type": "container", "container": container_id, "event": ["die", "died"]},
            decode=True,
        )
    except docker.errors.APIError:
        return None
    found: dict[str, Any] | None = None
    try:
        for i, event in enumerate(stream):
            if i >= _MAX_EVENTS:
                break
            if not isinstance(event, dict):
                continue
            attributes = (event.get("Actor") or {}).get("Attributes") or {}
            try:
                code = int(str(attributes.get("exitCode")))
            except (TypeError, ValueError):
                continue
            nano = event.get("timeNano")
            when = nano / 1e9 if isinstance(nano, int) else float(event.get("time") or 0)
            if found is None or when >= found["time"]:
                found = {"exit_code": code, "time": when}
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
    return found


def exit_info(client: docker.DockerClient, ident: str, tail: int = 20) -> dict[str, Any] | None:
    """
    C{None} while the container runs and has never restarted; otherwise how it last ended:
    C{status}, C{exit_code} (from its last C{die} event, else C{State.ExitCode} while it is
    still down, else L{UNKNOWN_EXIT}), C{restart_count}, the last C{tail} log lines written
    before that exit, and the engine's C{error} text (or the OOM kill).
    """
    try:
        info = client.api.inspect_container(ident)
    except docker.errors.NotFound:
        return {
            "status": "missing",
            "exit_code": UNKNOWN_EXIT,
            "restart_count": 0,
            "logs": "",
            "error": "the container was removed",
        }
    snap = snapshot(info)
    if snap["running"] and not snap["restarting"] and snap["restart_count"] == 0:
        return None
    down = not snap["running"] or snap["restarting"]
    die = last_die(client, snap["id"], _unix(str(info.get("Created") or "")))
    exit_code = snap["exit_code"] if down else UNKNOWN_EXIT
    until: float | None = None
    if die is not None:
        exit_code = die["exit_code"]
        if not down:
            # Lines written before the exit, not the next run's: a little slack for the clock,
            # but never past the next run's start (a quick restart policy, Podman's, starts it
            # within that slack, and it may write its first lines there).
            until = die["time"] + 0.05
            started = _unix(str((info.get("State") or {}).get("StartedAt") or ""))
            if started is not None and die["time"] < started < until:
                until = started
    text = b""
    try:
        kwargs: dict[str, Any] = {"stdout": True, "stderr": True, "timestamps": False, "tail": tail}
        if until is not None:
            # The engine takes the last `tail` lines first and drops those after `until` next:
            # a restarted container that already wrote that many lines would give none. Read
            # up to the exit instead (bounded by read_logs) and keep the last lines here.
            del kwargs["tail"]
            kwargs["until"] = until
        text = read_logs(client, snap["id"], 16 * 1024, **kwargs)
        if until is not None:
            text = b"\n".join(text.splitlines()[-tail:]) if tail > 0 else b""
    except docker.errors.NotFound:
        pass
    except (docker.errors.APIError, docker.errors.InvalidVersion):
        # An engine older than API 1.35 has no `until`: the newest lines, then.
        try:
            text = read_logs(client, snap["id"], 16 * 1024, stdout=True, stderr=True, timestamps=False,
                             tail=tail)
        except docker.errors.NotFound:
            pass
    return {
        "status": snap["status"],
        "exit_code": exit_code,
        "restart_count": snap["restart_count"],
        "logs": text.decode("utf-8", "replace")[-4000:],
        "error": snap["error"] or ("out of memory (OOM killed)" if snap["oom_killed"] else ""),
    }
