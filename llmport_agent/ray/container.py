"""
The runtime container C{llm-port-ray-runtime} (protocol 10.6): one per node, long-lived,
C{sleep infinity} under the engine's init (which reaps what C{ray stop} ends), host network and IPC, the bundle's GPUs, devices, capabilities, shm,
ulimits and mounts, plus the cluster token directory read-only.

Restart policy C{no}, and a stopped one is never started again: it is removed and created
afresh from the bundle checked again. The engine resolves a bind mount's source path again at
every start of a container; a start the agent did not check (the engine's restart policy after
a reboot or a daemon restart, or C{start} on a stopped container) would follow whatever link
had been swapped in since. The sources themselves are the model store (never a path inside
it), C{RAY_ALLOWED_MOUNTS} entries and the agent's directories (L{llmport_agent.ray.bundle}).

It carries the agent's labels (L{LABEL_RAY}, the agent id) but not the workloads' managed
label: it is no workload and the workload watcher leaves it alone. A container of that name
without them belongs to someone else and is never touched.

The functions taking a C{client} are thread functions for L{DockerEngine.call}.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from llmport_agent.core import safefs
from llmport_agent.core.lazyimport import LazyModule

from ..commands.base import POLICY_VIOLATION, RUNTIME_ERROR, CommandFailed
from ..workloads.containers import start_created
from ..workloads.spec import LABEL_AGENT_ID, LABEL_IMAGE
from .bundle import RuntimeBundle

if TYPE_CHECKING:
    import docker
else:
    docker = LazyModule("docker")  # docker-py: imported at its first use

LABEL_RAY = "io.llmport.ray-runtime"
RAY_VALUE = "llmport-agent"
LABEL_TOKEN_DIR = "io.llmport.ray-token-dir"
IDLE_COMMAND = ("sleep", "infinity")
#: The engine never starts the runtime container on its own (see the module's docstring).
RESTART_POLICY = "no"
#: Ray's session directory inside the container; the host's C{RAY_SESSION_DIR} is mounted
#: here read-write so the Serve replica logs reach the host side (L{llmport_agent.logs.rayserve}).
SESSION_TARGET = "/tmp/ray"


def token_file(token_dir: str) -> str:
    return os.path.join(token_dir, "cluster.token")


def container_env(bundle: RuntimeBundle, token_dir: str) -> dict[str, str]:
    """The container's environment: the bundle's (filtered) env plus token auth."""
    env = dict(bundle.env)
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN_PATH"] = token_file(token_dir)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


def wanted_mounts(
    bundle: RuntimeBundle, token_dir: str, session_dir: str | None = None
) -> set[tuple[str, str, bool]]:
    """(host, container, read-only) of every bind mount the container must have."""
    out = {(m.host_path, m.container_path, m.read_only) for m in bundle.mounts}
    out.add((token_dir, token_dir, True))
    if session_dir:
        out.add((session_dir, SESSION_TARGET, False))
    return out


def ensure_session_dir(session_dir: str) -> None:
    """
    Thread function: the host's Ray session directory exists (created 0700, root's), so the
    engine never makes it. Its parent is the operator's path (links followed); the directory
    itself is opened without following a link, and anything but a directory there is refused.
    """
    parent, name = os.path.split(session_dir.rstrip("/"))
    os.makedirs(parent or "/", mode=0o755, exist_ok=True)
    pfd = safefs.open_dir(parent or "/")
    try:
        try:
            fd = safefs.open_dir_at(pfd, name)
        except FileNotFoundError:
            try:
                os.mkdir(name, 0o700, dir_fd=pfd)
            except FileExistsError:
                pass
            fd = safefs.open_dir_at(pfd, name)
            os.fchmod(fd, 0o700)
            if os.geteuid() == 0:
                os.fchown(fd, 0, 0)
        except NotADirectoryError:
            raise CommandFailed(
                POLICY_VIOLATION,
                f"The Ray session directory {session_dir!r} (RAY_SESSION_DIR) is not a directory "
                "(a symbolic link or a file); make it a real directory or point RAY_SESSION_DIR elsewhere.",
            ) from None
        os.close(fd)
    finally:
        os.close(pfd)


def snapshot(info: dict[str, Any]) -> dict[str, Any]:
    """The facts of an inspected container that the Ray commands use."""
    state = info.get("State") or {}
    config = info.get("Config") or {}
    mounts = set()
    for m in info.get("Mounts") or []:
        if isinstance(m, dict) and m.get("Type", "bind") == "bind":
            mounts.add((str(m.get("Source", "")), str(m.get("Destination", "")), not bool(m.get("RW", True))))
    return {
        "id": str(info.get("Id") or ""),
        "name": str(info.get("Name") or "").lstrip("/"),
        "labels": dict(config.get("Labels") or {}),
        "running": bool(state.get("Running")),
        "status": str(state.get("Status") or ""),
        "started_at": state.get("StartedAt"),
        "image": config.get("Image"),
        "image_id": str(info.get("Image") or ""),
        "mounts": mounts,
        "restart_policy": str(((info.get("HostConfig") or {}).get("RestartPolicy") or {}).get("Name") or "no"),
    }


def find(client: docker.DockerClient, name: str) -> dict[str, Any] | None:
    """Thread function: the container named exactly C{name}, or C{None}."""
    try:
        info = client.api.inspect_container(name)
    except docker.errors.NotFound:
        return None
    snap = snapshot(info)
    if snap["name"] != name:  # inspect also matches ids and id prefixes
        return None
    return snap


def is_ours(snap: dict[str, Any], agent_id: str) -> bool:
    labels = snap["labels"]
    return labels.get(LABEL_RAY) == RAY_VALUE and labels.get(LABEL_AGENT_ID) == agent_id


def drift(
    snap: dict[str, Any], bundle: RuntimeBundle, image_id: str, token_dir: str, session_dir: str | None = None
) -> str | None:
    """Why an existing container no longer fits (image, mounts, token path), or C{None}."""
    if snap["image_id"] != image_id:
        return f"it runs image {snap['image_id'][:19]}, the pinned image is {image_id[:19]}"
    if snap["labels"].get(LABEL_TOKEN_DIR) != token_dir:
        return "the cluster token directory changed"
    want = wanted_mounts(bundle, token_dir, session_dir)
    if session_dir and (session_dir, SESSION_TARGET, False) not in snap["mounts"]:
        return f"it does not mount the Ray session directory {session_dir} at {SESSION_TARGET}"
    if snap["mounts"] != want:
        return "its mounts differ from the bundle's"
    return None


def _check_host_paths(paths: list[tuple[str, str]]) -> None:
    """
    Each C{(path, root)}: nothing below the allowed C{root} may be a symbolic link (the engine
    would follow it out of the root). The root itself is the operator's path and may be one
    (a model store on another disk, C{/var/run} -> C{/run}).
    """
    for path, root in paths:
        rel = os.path.relpath(path, root)
        real_root = os.path.realpath(root)
        expected = real_root if rel == "." else os.path.join(real_root, rel)
        real = os.path.realpath(path)
        if real != expected:
            raise CommandFailed(
                POLICY_VIOLATION,
                f"runtime_bundle: host path {path!r} leads through a symbolic link (to {real!r}); "
                "mount the real directory instead.",
            )


def _gpu_args(bundle: RuntimeBundle) -> tuple[list[Any], list[str]]:
    """(device requests, extra devices) for the bundle's GPUs and vendor."""
    if bundle.gpus is None or bundle.accelerator_vendor in ("none", "apple"):
        return [], []
    if bundle.accelerator_vendor == "amd":
        return [], ["/dev/kfd", "/dev/dri"]
    if bundle.gpus == "all":
        return [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])], []
    if bundle.gpus.startswith("device="):
        ids = [d for d in bundle.gpus[len("device=") :].split(",") if d]
        return [docker.types.DeviceRequest(device_ids=ids, capabilities=[["gpu"]])], []
    return [docker.types.DeviceRequest(count=int(bundle.gpus), capabilities=[["gpu"]])], []


def create_args(
    bundle: RuntimeBundle, image_id: str, token_dir: str, agent_id: str, session_dir: str | None = None
) -> dict[str, Any]:
    """Everything the container is created with: the bundle's settings and nothing else."""
    requests, gpu_devices = _gpu_args(bundle)
    devices = []
    for d in (*bundle.devices, *gpu_devices):
        if d not in devices:
            devices.append(d)
    binds = [
        f"{host}:{target}:{'ro' if ro else 'rw'}"
        for host, target, ro in sorted(wanted_mounts(bundle, token_dir, session_dir))
    ]
    host_paths = {(m.host_path, m.root or m.host_path) for m in bundle.mounts} | {(token_dir, token_dir)}
    if session_dir:
        host_paths.add((session_dir, session_dir))
    return {
        "name": bundle.name,
        "image_id": image_id,
        "labels": {
            LABEL_RAY: RAY_VALUE,
            LABEL_AGENT_ID: agent_id,
            LABEL_IMAGE: bundle.image.canonical,
            LABEL_TOKEN_DIR: token_dir,
        },
        "env": container_env(bundle, token_dir),
        "binds": binds,
        "host_paths": sorted(host_paths),
        "devices": [f"{d}:{d}:rwm" for d in devices],
        "cap_add": list(bundle.capabilities),
        "ipc_mode": bundle.ipc_mode,
        "shm_size": bundle.shm_size,
        "ulimits": [(n, s, h) for n, s, h in bundle.ulimits],
        "device_requests": requests,
    }


def create_and_start(client: docker.DockerClient, args: dict[str, Any]) -> dict[str, Any]:
    """Thread function: create and start the runtime container; its snapshot."""
    _check_host_paths(args["host_paths"])
    api = client.api
    host_config = api.create_host_config(
        network_mode="host",
        ipc_mode=args["ipc_mode"],
        binds=args["binds"],
        devices=args["devices"] or None,
        cap_add=args["cap_add"] or None,
        shm_size=args["shm_size"],
        ulimits=[docker.types.Ulimit(name=n, soft=s, hard=h) for n, s, h in args["ulimits"]] or None,
        restart_policy={"Name": RESTART_POLICY},
        device_requests=args["device_requests"] or None,
        # An init as PID 1 (the engine's docker-init/tini, Podman's catatonit): it reaps the Ray
        # processes that `ray start` leaves behind once `ray stop` ends them. Under a bare
        # `sleep infinity` they stay zombies, which `ray stop` counts as alive and waits for to
        # the end of its grace period: 16 to 24 s for every stop and leave, instead of 1 to 2 s.
        init=True,
    )
    created = api.create_container(
        image=args["image_id"],
        entrypoint=[IDLE_COMMAND[0]],
        command=list(IDLE_COMMAND[1:]),
        name=args["name"],
        labels=args["labels"],
        environment=args["env"],
        host_config=host_config,
        detach=True,
    )
    cid = created["Id"]
    start_created(api, cid)
    snap = snapshot(api.inspect_container(cid))
    return snap


def never_restart(client: docker.DockerClient, ident: str) -> None:
    """
    Thread function: set restart policy L{RESTART_POLICY} on a running runtime container
    created by an earlier version of the agent (C{unless-stopped}), without stopping it.
    """
    client.api.update_container(ident, restart_policy={"Name": RESTART_POLICY})


def remove(client: docker.DockerClient, ident: str) -> bool:
    """Thread function: force-remove; C{False} when it was already gone."""
    try:
        client.api.remove_container(ident, force=True)
    except docker.errors.NotFound:
        return False
    return True


def foreign(name: str) -> CommandFailed:
    return CommandFailed(
        RUNTIME_ERROR,
        f"A container named {name} exists on this node and was not created by this agent; "
        "remove or rename it (docker rm -f " + name + ") so the agent can create its Ray runtime.",
    )


def facts(snap: dict[str, Any] | None) -> dict[str, Any] | None:
    """C{inventory.ray_runtime} / C{describe_ray_cluster.container}: {container, running, ...}."""
    if snap is None:
        return None
    return {
        "container": snap["name"],
        "running": snap["running"],
        "started_at": snap["started_at"],
        "image": snap["image"] if snap["labels"].get(LABEL_IMAGE) is None else snap["labels"][LABEL_IMAGE],
        "image_id": snap["image_id"],
    }
