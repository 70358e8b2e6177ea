"""
The engine part of C{collect_diagnostics}: engine version and runtimes (is the NVIDIA
runtime there?), managed containers with state, ports, restart counts and health, and the
images they use. Objects, not JSON strings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmport_agent.core.lazyimport import LazyModule

from . import containers as ops
from .engine import DockerEngine, EngineError
from .spec import (
    LABEL_CONTAINER_PORT,
    LABEL_HOST_PORT,
    LABEL_PROVIDER,
    LABEL_RUNTIME_ID,
)

if TYPE_CHECKING:
    import docker
else:
    docker = LazyModule("docker")  # docker-py: imported at its first use


def _collect(client: docker.DockerClient, agent_id: str, adopted: dict[str, str] | None = None) -> dict[str, Any]:
    api = client.api
    version = api.version()
    info = api.info()
    rows = ops.list_owned_rows(client, agent_id, adopted)
    containers = []
    image_ids: dict[str, list[str]] = {}
    for row in rows:
        snap = ops.inspect(client, row["Id"])
        if snap is None:
            continue
        # An adopted container (the original agent's) has no labels: its row names its runtime.
        labels = {**snap["labels"], **dict(row.get("Labels") or {})} if row.get("_adopted") else snap["labels"]
        containers.append(
            {
                "name": snap["name"],
                "id": snap["id"][:12],
                "runtime_id": labels.get(LABEL_RUNTIME_ID, ""),
                "provider_type": labels.get(LABEL_PROVIDER, ""),
                "state": snap["status"],
                "running": snap["running"],
                "exit_code": snap["exit_code"],
                "restart_count": snap["restart_count"],
                "health": snap["health"] or "none",
                "oom_killed": snap["oom_killed"],
                "image": snap["image"],
                "network_mode": snap["network_mode"],
                "container_port": labels.get(LABEL_CONTAINER_PORT, ""),
                "host_port": ops.host_port_of(snap) or 0,
                "label_host_port": labels.get(LABEL_HOST_PORT, ""),
                "started_at": snap["started_at"],
                "finished_at": snap["finished_at"],
                "error": snap["error"],
                "adopted": bool(row.get("_adopted")),
            }
        )
        image_ids.setdefault(snap["image_id"], []).append(snap["name"])
    images = []
    for image_id, users in image_ids.items():
        try:
            img = api.inspect_image(image_id)
        except docker.errors.NotFound:
            images.append({"id": image_id[:19], "tags": [], "size_bytes": 0, "used_by": users})
            continue
        images.append(
            {
                "id": image_id[:19],
                "tags": list(img.get("RepoTags") or []),
                "digests": list(img.get("RepoDigests") or []),
                "size_bytes": int(img.get("Size") or 0),
                "created": str(img.get("Created") or ""),
                "used_by": users,
            }
        )
    runtimes = sorted((info.get("Runtimes") or {}).keys())
    return {
        "version": str(version.get("Version", "")),
        "api_version": str(version.get("ApiVersion", "")),
        "os": str(info.get("OperatingSystem", "")),
        "kernel": str(info.get("KernelVersion", "")),
        "storage_driver": str(info.get("Driver", "")),
        "cgroup_driver": str(info.get("CgroupDriver", "")),
        "cgroup_version": str(info.get("CgroupVersion", "")),
        "runtimes": runtimes,
        "default_runtime": str(info.get("DefaultRuntime", "")),
        "nvidia_runtime": any("nvidia" in r for r in runtimes),
        "containers_total": int(info.get("Containers") or 0),
        "containers_running": int(info.get("ContainersRunning") or 0),
        "images_total": int(info.get("Images") or 0),
        "managed_containers": containers,
        "images_in_use": images,
    }


async def engine_diagnostics(
    engine: DockerEngine, agent_id: str, health_states: dict[str, dict[str, Any]] | None = None,
    adopted: dict[str, str] | None = None,
) -> dict[str, Any]:
    """
    The engine section of C{collect_diagnostics}. Never raises for an engine problem:
    an unreachable engine is reported as such (that is the diagnosis).
    """
    out: dict[str, Any] = {
        "address": engine.address,
        "available": engine.available,
        "last_error": engine.last_error,
        "engine_calls": engine.calls,
    }
    try:
        out.update(await engine.call(_collect, agent_id, adopted, what="collecting engine diagnostics"))
        out["available"] = True
    except EngineError as exc:
        out["available"] = engine.available
        out["error"] = exc.error_message
    if health_states is not None:
        out["health"] = health_states
    return out
