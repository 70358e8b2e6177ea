"""
Thread functions on the Docker engine for containers.

Each takes the docker-py client first and returns plain data (dicts, strings): they run on
the L{DockerEngine} pools, never on the reactor thread, and nothing lazy crosses back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from llmport_agent.core.lazyimport import LazyModule

from .labels import (
    LABEL_AGENT_ID,
    LABEL_CONTAINER_PORT,
    LABEL_HOST_PORT,
    LABEL_MANAGED,
    LABEL_NAME,
    LABEL_RUNTIME_ID,
    MANAGED_VALUE,
)

if TYPE_CHECKING:
    import docker
else:
    docker = LazyModule("docker")  # docker-py: imported at its first use

_EXITED_RE = re.compile(r"\((-?\d+)\)")

#: The raw log bytes C{fetch_container_logs} keeps from the engine (the newest; the answer is
#: cut further to C{LOGS_MAX_BYTES}).
RAW_LOGS_MAX = 8 * 1024 * 1024
#: At most this much of a log is read from the engine for one answer (a container can print
#: a single line of gigabytes: its C{tail} is that whole line).
LOG_READ_CAP = 64 * 1024 * 1024


def read_logs(client: docker.DockerClient, ident: str, max_bytes: int, **kwargs: Any) -> bytes:
    """
    A container's logs (C{docker logs} options in C{kwargs}), read as a stream: at most the
    last C{max_bytes} are held, and reading stops after L{LOG_READ_CAP} bytes. Raises
    C{docker.errors.NotFound} when the container is gone.
    """
    stream = client.api.logs(ident, stream=True, follow=False, **kwargs)
    if isinstance(stream, (bytes, bytearray)):  # a stand-in engine answering whole
        return bytes(stream[-max_bytes:])
    kept = bytearray()
    total = 0
    try:
        for chunk in stream:
            kept += chunk
            total += len(chunk)
            if len(kept) > 2 * max_bytes:
                del kept[: len(kept) - max_bytes]
            if total >= LOG_READ_CAP:
                break
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
    return bytes(kept[-max_bytes:])


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def snapshot(info: dict[str, Any]) -> dict[str, Any]:
    """The parts of C{docker inspect} the agent uses, as plain data."""
    state = info.get("State") or {}
    config = info.get("Config") or {}
    host_config = info.get("HostConfig") or {}
    labels = dict(config.get("Labels") or {})
    env = config.get("Env") or []
    ports: dict[int, int] = {}
    for key, bindings in ((info.get("NetworkSettings") or {}).get("Ports") or {}).items():
        if not bindings or not key.endswith("/tcp"):
            continue
        for binding in bindings:
            hp = _int(binding.get("HostPort"))
            if hp:
                ports[_int(key.split("/")[0])] = hp
                break
    # What it was created to publish (the engine shows no binding while it is stopped, or
    # without a bridge): the last resort for a container without labels (adopted).
    requested: dict[int, int] = {}
    for key, bindings in (host_config.get("PortBindings") or {}).items():
        if not bindings or not str(key).endswith("/tcp"):
            continue
        hp = _int((bindings[0] or {}).get("HostPort"))
        if hp:
            requested[_int(str(key).split("/")[0])] = hp
    health = state.get("Health") or {}
    env_runtime = ""
    for item in env:
        if isinstance(item, str) and item.startswith("LLM_PORT_RUNTIME_ID="):
            env_runtime = item.split("=", 1)[1]
    return {
        "id": str(info.get("Id", "")),
        "name": str(info.get("Name", "")).lstrip("/"),
        "status": str(state.get("Status", "")),
        "running": bool(state.get("Running")),
        "restarting": bool(state.get("Restarting")),
        "exit_code": _int(state.get("ExitCode")),
        "error": str(state.get("Error") or ""),
        "oom_killed": bool(state.get("OOMKilled")),
        "restart_count": _int(info.get("RestartCount")),
        "health": str(health.get("Status") or "") or None,
        "started_at": str(state.get("StartedAt") or ""),
        "finished_at": str(state.get("FinishedAt") or ""),
        "labels": labels,
        "managed": labels.get(LABEL_MANAGED) == MANAGED_VALUE,
        "runtime_id": labels.get(LABEL_RUNTIME_ID) or env_runtime,
        "image": str(config.get("Image", "")),
        "image_id": str(info.get("Image", "")),
        "network_mode": str(host_config.get("NetworkMode", "")),
        "ports": ports,
        "requested_ports": requested,
        "restart_policy": str((host_config.get("RestartPolicy") or {}).get("Name", "")),
        # Host paths of its bind mounts (the engine resolves each again at every start).
        "bind_sources": [str(m.get("Source") or "") for m in (info.get("Mounts") or [])[:64]
                         if isinstance(m, dict) and m.get("Type") == "bind"],
    }


def host_port_of(snap: dict[str, Any], container_port: int | None = None) -> int | None:
    """The host port a workload is reachable on: published binding, else the label."""
    labels = snap.get("labels") or {}
    cport = container_port or _int(labels.get(LABEL_CONTAINER_PORT)) or None
    ports: dict[int, int] = snap.get("ports") or {}
    if cport and cport in ports:
        return ports[cport]
    label = _int(labels.get(LABEL_HOST_PORT))
    if label:
        return label
    if ports:
        return next(iter(ports.values()))
    requested: dict[int, int] = snap.get("requested_ports") or {}
    if cport and cport in requested:
        return requested[cport]
    if requested:
        return next(iter(requested.values()))
    return None


def inspect(client: docker.DockerClient, ident: str) -> dict[str, Any] | None:
    """
    Snapshot of one container by its full id, or C{None} when it does not exist. (The engine
    also resolves names and id prefixes here: callers pass ids they got from a listing, or use
    L{by_exact_name}.)
    """
    try:
        return snapshot(client.api.inspect_container(ident))
    except docker.errors.NotFound:
        return None


def owned_filter(agent_id: str, runtime_id: str | None = None) -> dict[str, list[str]]:
    """The engine's label filter for containers this agent manages (of one runtime)."""
    labels = [f"{LABEL_MANAGED}={MANAGED_VALUE}", f"{LABEL_AGENT_ID}={agent_id}"]
    if runtime_id is not None:
        labels.append(f"{LABEL_RUNTIME_ID}={runtime_id}")
    return {"label": labels}


def is_owned(labels: dict[str, Any], agent_id: str, runtime_id: str | None = None) -> bool:
    """Whether labels say: managed by this agent (and of this runtime)."""
    return (
        labels.get(LABEL_MANAGED) == MANAGED_VALUE
        and labels.get(LABEL_AGENT_ID) == agent_id
        and (runtime_id is None or labels.get(LABEL_RUNTIME_ID) == runtime_id)
    )


def by_exact_name(client: docker.DockerClient, name: str) -> dict[str, Any] | None:
    """
    The container called exactly C{name}, or C{None}. The engine's lookup falls back to id
    prefixes when no container has the name; such a match is not this name's container.
    """
    snap = inspect(client, name)
    if snap is None or snap["name"] != name:
        return None
    return snap


def find_runtime(
    client: docker.DockerClient,
    runtime_id: str,
    container_name: str | None,
    agent_id: str,
    adopted: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """
    Every container of a runtime that this agent manages (labels C{io.llmport.managed},
    C{io.llmport.agent-id} = C{agent_id}, C{io.llmport.runtime-id}, or adopted from the
    original agent: C{adopted} maps full container ids to runtime ids), plus the one called
    exactly C{container_name} if it exists. Each snapshot gets C{foreign: True} unless this
    agent manages it for this runtime: a foreign container is never stopped, removed or
    read, only reported (its name is taken). Canonically named containers come first.
    """
    found: dict[str, dict[str, Any]] = {}
    rows = client.api.containers(all=True, filters=owned_filter(agent_id, runtime_id))
    for row in rows:
        snap = inspect(client, row["Id"])
        if snap is not None:
            found[snap["id"]] = snap
    mine = {cid for cid, rid in (adopted or {}).items() if rid == runtime_id}
    for cid in mine - set(found):
        snap = inspect(client, cid)
        if snap is not None and snap["id"] == cid:
            found[cid] = snap
    if container_name and not any(s["name"] == container_name for s in found.values()):
        snap = by_exact_name(client, container_name)
        if snap is not None:
            found[snap["id"]] = snap
    out = []
    for snap in found.values():
        snap["adopted"] = snap["id"] in mine and not snap["managed"]
        if snap["adopted"]:
            snap["managed"] = True
            snap["runtime_id"] = runtime_id
        snap["foreign"] = not (snap["adopted"] or is_owned(snap["labels"], agent_id, runtime_id))
        canonical = (snap["labels"].get(LABEL_NAME) or container_name or snap["name"]) == snap["name"]
        snap["canonical"] = canonical
        out.append(snap)
    out.sort(key=lambda s: (not s["canonical"], s["name"]))
    return out


def find_runtime_light(
    client: docker.DockerClient, runtime_id: str, agent_id: str, adopted: Mapping[str, str] | None = None
) -> dict[str, Any] | None:
    """
    One cheap lookup for reads (logs): the container this agent manages for the runtime
    (canonical name first). Returns C{{"id", "name"}} or C{None}: a container that merely has
    the expected name, or whose id starts like it, is not this runtime's.
    """
    rows = client.api.containers(all=True, filters=owned_filter(agent_id, runtime_id))
    best = None
    for row in rows:
        labels = row.get("Labels") or {}
        if not is_owned(labels, agent_id, runtime_id):
            continue
        name = (row.get("Names") or ["/"])[0].lstrip("/")
        entry = {"id": row["Id"], "name": name}
        if labels.get(LABEL_NAME, name) == name:
            return entry
        best = best or entry
    if best is None:
        for cid, rid in (adopted or {}).items():
            if rid == runtime_id:
                snap = inspect(client, cid)
                if snap is not None and snap["id"] == cid:
                    return {"id": cid, "name": snap["name"]}
    return best


def list_owned_rows(
    client: docker.DockerClient, agent_id: str, adopted: Mapping[str, str] | None = None
) -> list[dict[str, Any]]:
    """
    The engine's list rows of every container this agent owns: the engine filters on the
    managed label, then each row's labels go through L{is_owned} (another agent's containers,
    or ones forging the managed label, are left out); plus (one more call) the containers
    adopted from the original agent (C{adopted}: full id -> runtime id), which have no labels
    of their own: they are listed with their runtime id and name as labels and C{_adopted}.
    """
    rows = client.api.containers(all=True, filters={"label": f"{LABEL_MANAGED}={MANAGED_VALUE}"})
    rows = [row for row in rows if is_owned(dict(row.get("Labels") or {}), agent_id)]
    extra: list[dict[str, Any]] = []
    if adopted:
        seen = {row["Id"] for row in rows}
        wanted = [cid for cid in adopted if cid not in seen]
        if wanted:
            for row in client.api.containers(all=True, filters={"id": wanted}):
                if row.get("Id") in wanted:
                    row = dict(row)
                    name = (row.get("Names") or ["/"])[0].lstrip("/")
                    row["Labels"] = {LABEL_RUNTIME_ID: adopted[row["Id"]], LABEL_NAME: name}
                    row["_adopted"] = True
                    extra.append(row)
    return [*rows, *extra]


def list_managed(
    client: docker.DockerClient, agent_id: str, adopted: Mapping[str, str] | None = None
) -> list[dict[str, Any]]:
    """
    Summaries of every container this agent manages (L{list_owned_rows}): id, name, state,
    status text, labels, exit code parsed from the status, health from the status, and
    C{adopted: True} for an adopted one.
    """
    out = []
    for row in list_owned_rows(client, agent_id, adopted):
        status = str(row.get("Status", ""))
        m = _EXITED_RE.search(status)
        health = None
        if "(healthy)" in status:
            health = "healthy"
        elif "(unhealthy)" in status:
            health = "unhealthy"
        elif "(health: starting)" in status:
            health = "starting"
        out.append(
            {
                "id": row["Id"],
                "name": (row.get("Names") or ["/"])[0].lstrip("/"),
                "state": str(row.get("State", "")),
                "status_text": status,
                "labels": dict(row.get("Labels") or {}),
                "exit_code": _int(m.group(1)) if m and row.get("State") != "running" else None,
                "health": health,
                "image": str(row.get("Image", "")),
                "image_id": str(row.get("ImageID", "")),
                "ports": [
                    {"container_port": p.get("PrivatePort"), "host_port": p.get("PublicPort")}
                    for p in (row.get("Ports") or [])
                    if p.get("PublicPort")
                ],
                "adopted": bool(row.get("_adopted")),
            }
        )
    return out


def start_created(api: Any, cid: str) -> None:
    """
    Thread function: start the just created container C{cid}; when it fails to start it is
    removed again, and the engine's start error re-raised.
    """
    try:
        api.start(cid)
    except Exception:
        try:
            api.remove_container(cid, force=True)
        except Exception:  # noqa: BLE001 - the start error is the one to report
            pass
        raise


def create_and_start(client: docker.DockerClient, args: dict[str, Any]) -> dict[str, Any]:
    """
    Create the container from L{spec.render} output and start it. A container that was
    created but failed to start is removed again, and the engine's error re-raised.
    """
    api = client.api
    host_config = api.create_host_config(**args["host_config"])
    created = api.create_container(host_config=host_config, **args["create"])
    cid = created["Id"]
    start_created(api, cid)
    return {"id": cid, "warnings": created.get("Warnings") or []}


def start(client: docker.DockerClient, ident: str) -> None:
    """Start a stopped container."""
    client.api.start(ident)


def restart(client: docker.DockerClient, ident: str, grace: int) -> None:
    """Restart (SIGTERM, C{grace} seconds, SIGKILL, start)."""
    client.api.restart(ident, timeout=grace)


def stop(client: docker.DockerClient, ident: str, grace: int) -> bool:
    """
    Stop: SIGTERM (the container's stop signal), wait C{grace} seconds, then SIGKILL.
    Returns C{False} when the container does not exist.
    """
    try:
        client.api.stop(ident, timeout=grace)
    except docker.errors.NotFound:
        return False
    return True


#: A failed container is stopped, then looked at this many times, STOP_CHECK_SEC apart (on the
#: engine's pool thread), and stopped again each time it runs: see L{stop_for_good}.
STOP_TRIES = 5
STOP_CHECK_SEC = 0.4


def stop_for_good(client: docker.DockerClient, ident: str, grace: int, *, sleep: Any = None) -> bool:
    """
    Stop a container that failed and keep it stopped (its restart policy would restart it in a
    loop). Podman's restart policy starts a container again after a stop that found it already
    exited (that stop is no stop at all), up to a second or so later: for
    L{STOP_TRIES} x L{STOP_CHECK_SEC} seconds it is looked at and stopped again whenever it
    runs. A thread function (it sleeps). Returns C{False} when the container does not exist.
    """
    if sleep is None:
        import time

        sleep = time.sleep
    if not stop(client, ident, grace):
        return False
    for _ in range(STOP_TRIES):
        sleep(STOP_CHECK_SEC)
        try:
            state = client.api.inspect_container(ident).get("State") or {}
        except docker.errors.NotFound:
            return False
        if (state.get("Running") or state.get("Restarting")) and not stop(client, ident, grace):
            return False
    return True


#: A forced remove that met the container between states (Podman: its restart policy was
#: starting or stopping it again, "could not be stopped ... container state improper") is tried
#: again this many times, REMOVE_RETRY_SEC apart (on the engine's pool thread).
REMOVE_TRIES = 5
REMOVE_RETRY_SEC = 0.2


def _between_states(exc: Exception) -> bool:
    text = str(getattr(exc, "explanation", "") or exc)
    return "state improper" in text or "could not be stopped" in text


def remove(client: docker.DockerClient, ident: str, *, sleep: Any = None) -> bool:
    """
    Remove (forcefully). Returns C{False} when it did not exist. A thread function: a container
    caught between states (L{REMOVE_TRIES}) is tried again after a short sleep.
    """
    for attempt in range(REMOVE_TRIES):
        try:
            client.api.remove_container(ident, force=True)
        except docker.errors.NotFound:
            return False
        except docker.errors.APIError as exc:
            if exc.status_code == 409 and "already in progress" in str(exc.explanation or ""):
                return True
            if attempt + 1 < REMOVE_TRIES and _between_states(exc):
                if sleep is None:
                    import time

                    sleep = time.sleep
                sleep(REMOVE_RETRY_SEC)
                continue
            raise
        return True
    return True  # not reached: the last try returns or raises


def rename(client: docker.DockerClient, ident: str, name: str) -> None:
    """Rename a container."""
    client.api.rename(ident, name)


def logs(client: docker.DockerClient, ident: str, tail: int) -> bytes | None:
    """The last C{tail} lines (stdout and stderr, with timestamps), or C{None} if gone."""
    try:
        return read_logs(client, ident, RAW_LOGS_MAX, stdout=True, stderr=True, timestamps=True, tail=tail)
    except docker.errors.NotFound:
        return None


def log_tail(client: docker.DockerClient, ident: str, tail: int, max_bytes: int = 256 * 1024) -> str:
    """The last C{tail} lines (stdout and stderr, no timestamps) as text, at most C{max_bytes}."""
    try:
        raw = read_logs(client, ident, max_bytes, stdout=True, stderr=True, timestamps=False, tail=tail)
    except docker.errors.NotFound:
        return ""
    return raw.decode("utf-8", "replace")


def exit_info(client: docker.DockerClient, ident: str, tail: int = 20) -> dict[str, Any] | None:
    """
    C{None} while the container runs and has never restarted; otherwise its state and
    last log lines (for a container that stopped or restarted during startup).
    """
    snap = inspect(client, ident)
    if snap is None:
        return {"status": "missing", "exit_code": -1, "restart_count": 0, "logs": "", "error": "the container was removed"}
    if snap["running"] and not snap["restarting"] and snap["restart_count"] == 0:
        return None
    text = b""
    try:
        text = read_logs(client, ident, 16 * 1024, stdout=True, stderr=True, timestamps=False, tail=tail)
    except docker.errors.NotFound:
        pass
    return {
        "status": snap["status"],
        "exit_code": snap["exit_code"],
        "restart_count": snap["restart_count"],
        "logs": text.decode("utf-8", "replace")[-4000:],
        "error": snap["error"] or ("out of memory (OOM killed)" if snap["oom_killed"] else ""),
    }
