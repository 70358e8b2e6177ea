"""
The runtime bundle (protocol 10.6, C{payload.runtime_bundle}): parsed, validated and held to
this node's local policy before anything reaches the engine.

A bundle names a digest-pinned image and the container contract Ray needs (host network and
IPC, GPUs, RDMA devices, IPC_LOCK, shm, ulimits, mounts, env). The policy is the workloads'
(L{llmport_agent.workloads.policy}): the image must pass C{IMAGE_ALLOWLIST}; nothing
privileged; host paths only under the model store, the Ray session directory or what the
operator adds with C{RAY_ALLOWED_MOUNTS}; devices only GPU and RDMA nodes; capabilities only
those RDMA and NCCL need. Only what the bundle names (after this check) reaches the engine.

Pure: no I/O, no reactor.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Mapping

from llmport_agent.core.values import frozen

from ..commands.base import INVALID_COMMAND, POLICY_VIOLATION, CommandFailed
from ..workloads.policy import (
    AllowEntry,
    ImageRef,
    PolicyError,
    check_container_name,
    check_image,
    parse_bytes,
)

DEFAULT_CONTAINER_NAME = "llm-port-ray-runtime"

#: Keys of C{env} that reach C{ray start} (and of the bundle's env that reach the container).
ENV_PREFIXES = ("VLLM_", "HF_", "NCCL_", "CUDA_", "RAY_", "UCX_")
#: The agent decides these: a bundle or an environment must not turn auth off, point Ray at
#: another token or pick GPUs behind the engine's back. C{RAY_AUTH_TOKEN} is among them: Ray
#: reads it before C{RAY_AUTH_TOKEN_PATH}, so it would replace the cluster token.
RESERVED_ENV = frozenset({"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "CUDA_VISIBLE_DEVICES"})
#: Every name under this prefix is the agent's too (Ray's token authentication settings).
RESERVED_ENV_PREFIX = "RAY_AUTH_"

#: Devices a bundle may ask for: RDMA (InfiniBand/RoCE verbs), AMD GPUs, NVIDIA nodes.
_DEVICE_ROOTS = ("/dev/infiniband", "/dev/kfd", "/dev/dri")
_DEVICE_PREFIX = "/dev/nvidia"
#: Capabilities a bundle may add: pinned memory for RDMA, scheduling priority for NCCL.
ALLOWED_CAPABILITIES = frozenset({"IPC_LOCK", "SYS_NICE"})
_ULIMIT_NAMES = frozenset({"memlock", "nofile", "stack", "core", "nproc"})
_VENDORS = ("nvidia", "amd", "apple", "none")
_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_SHA_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_MAX_MOUNTS = 32
_MAX_DEVICES = 64
_MAX_ENV = 128
_MAX_VALUE = 4096


@frozen
class Mount:
    """
    One bind mount: an absolute, normalised host path, container path and mode, and the
    allowed root (model store, session directory, RAY_ALLOWED_MOUNTS entry) it is under.
    """

    host_path: str
    container_path: str
    read_only: bool
    root: str = ""


@frozen
class RuntimeBundle:
    """
    A validated runtime bundle. Everything here passed the local policy.

    @ivar digest: the pinned config id (C{sha256:<64 hex>}).
    @ivar rootfs_digest: sha256 of the RootFS diff ids joined by C{\\n}, or C{None}.
    @ivar repo_digest: C{sha256:...} or C{name@sha256:...}, or C{None}.
    @ivar gpus: C{None} for no GPU, else C{"all"}, a count or C{device=...}.
    """

    image: ImageRef
    digest: str
    rootfs_digest: str | None
    repo_digest: str | None
    name: str
    runtime_handler: str
    ipc_mode: str
    gpus: str | None
    accelerator_vendor: str
    devices: tuple[str, ...]
    capabilities: tuple[str, ...]
    shm_size: int | None
    ulimits: tuple[tuple[str, int, int], ...]
    mounts: tuple[Mount, ...]
    env: tuple[tuple[str, str], ...]
    #: Container paths of bundle mounts left out because the agent mounts them itself
    #: (C{/tmp/ray}: the host's C{RAY_SESSION_DIR}).
    ignored_mounts: tuple[str, ...] = ()


def _invalid(text: str) -> CommandFailed:
    return CommandFailed(INVALID_COMMAND, f"runtime_bundle: {text}")


def _refused(text: str, hint: str = "") -> CommandFailed:
    return CommandFailed(
        POLICY_VIOLATION,
        f"runtime_bundle: {text} is refused by this node's local policy" + (f"; {hint}" if hint else "") + ".",
    )


def _norm_abs(value: object, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _invalid(f"{field} must be an absolute path")
    text = value.strip()
    if not text.startswith("/") or "\x00" in text or len(text) > 1024:
        raise _invalid(f"{field} {text[:80]!r} must be an absolute path")
    if any(part == ".." for part in text.split("/")):
        raise _invalid(f"{field} {text[:80]!r} must not contain '..'")
    return posixpath.normpath(text)


def _under(path: str, root: str) -> bool:
    root = root.rstrip("/") or "/"
    return path == root or path.startswith(root + "/")


def filter_env(env: object, *, drop_reserved: bool = True) -> dict[str, str]:
    """
    The keys of C{env} that may pass (one of L{ENV_PREFIXES}, not L{RESERVED_ENV} nor under
    L{RESERVED_ENV_PREFIX}), values as
    strings; anything else is dropped. Bounded: 128 keys, 4096 characters a value.

    @raise CommandFailed: C{env} is not an object.
    """
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise CommandFailed(INVALID_COMMAND, "env must be an object of NAME: value")
    out: dict[str, str] = {}
    for key, value in env.items():
        if len(out) >= _MAX_ENV:
            break
        if not isinstance(key, str) or not _KEY_RE.match(key) or not key.startswith(ENV_PREFIXES):
            continue
        if drop_reserved and (key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIX)):
            continue
        if isinstance(value, bool):
            text = "1" if value else "0"
        elif isinstance(value, (str, int, float)):
            text = str(value)
        else:
            continue
        if len(text) > _MAX_VALUE or "\x00" in text:
            continue
        out[key] = text
    return out


def _ulimits(value: object) -> tuple[tuple[str, int, int], ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise _invalid("requirements.ulimits must be an object such as {\"memlock\": -1}")
    out: list[tuple[str, int, int]] = []
    for name, raw in value.items():
        key = str(name).strip().lower()
        if key not in _ULIMIT_NAMES:
            raise _refused(f"ulimit {str(name)[:40]!r}", f"allowed: {', '.join(sorted(_ULIMIT_NAMES))}")
        parts = raw.split(":", 1) if isinstance(raw, str) else [raw]
        nums: list[int] = []
        for part in parts:
            p = part.strip().lower() if isinstance(part, str) else part
            if p in ("unlimited", "-1", -1):
                nums.append(-1)
            elif isinstance(p, int) and not isinstance(p, bool) and p >= 0:
                nums.append(p)
            elif isinstance(p, str) and p.isdigit():
                nums.append(int(p))
            else:
                raise _invalid(f"ulimit {key} value {str(raw)[:40]!r} is not a number, -1 or 'unlimited'")
        soft, hard = nums[0], nums[-1]
        out.append((key, soft, hard))
    return tuple(out)


def _devices(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise _invalid("requirements.devices must be a list of device paths")
    if len(value) > _MAX_DEVICES:
        raise _invalid(f"requirements.devices lists more than {_MAX_DEVICES} devices")
    out: list[str] = []
    for item in value:
        path = _norm_abs(str(item).split(":", 1)[0] if isinstance(item, str) else item, "device")
        if not (any(_under(path, r) for r in _DEVICE_ROOTS) or path.startswith(_DEVICE_PREFIX)):
            raise _refused(
                f"device {path!r}",
                "only RDMA (/dev/infiniband), GPU (/dev/nvidia*, /dev/kfd, /dev/dri) devices are passed",
            )
        out.append(path)
    return tuple(out)


def _capabilities(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise _invalid("requirements.capabilities must be a list such as [\"IPC_LOCK\"]")
    out: list[str] = []
    for item in value:
        cap = str(item).strip().upper().removeprefix("CAP_")
        if cap not in ALLOWED_CAPABILITIES:
            raise _refused(f"capability {str(item)[:40]!r}", f"allowed: {', '.join(sorted(ALLOWED_CAPABILITIES))}")
        if cap not in out:
            out.append(cap)
    return tuple(out)


def _strictly_under(path: str, root: str) -> bool:
    return path != root and _under(path, root)


def _mounts(
    value: object, allowed_roots: Iterable[str], reserved: Iterable[str], agent_owned: Iterable[str] = (),
    container_written: Iterable[str] = (), workload_written: Iterable[str] = (),
    agent_sources: Iterable[str] = (),
) -> tuple[tuple[Mount, ...], tuple[str, ...]]:
    """
    (the admitted mounts, the container paths left out because the agent mounts them).

    The engine resolves a bind mount's source path again at every start of a container, so
    no source may lie where a container could swap a directory for a link to C{/}: below a
    directory some container writes. Refused: a host path at or under a C{container_written}
    directory (the runtime container's own session directory); a host path strictly below a
    C{workload_written} directory (the model store: workloads mount it, read-write for
    C{download_from_hf}; the store itself is fine, its name lives in the operator's parent) or
    strictly below another read-write mount of the same bundle; and a read-write mount that
    holds one of the C{agent_sources} (the bind sources of the agent's own mounts: model
    store, token and session directories) or another mount of the bundle below it.
    """
    if value is None:
        return (), ()
    if not isinstance(value, (list, tuple)):
        raise _invalid("mounts must be a list of {host_path, container_path, mode}")
    if len(value) > _MAX_MOUNTS:
        raise _invalid(f"mounts lists more than {_MAX_MOUNTS} mounts")
    roots = [posixpath.normpath(r) for r in allowed_roots if r]
    reserved_paths = [posixpath.normpath(r) for r in reserved if r]
    owned = {posixpath.normpath(r) for r in agent_owned if r}
    written = [posixpath.normpath(r) for r in container_written if r]
    out: list[Mount] = []
    ignored: list[str] = []
    targets: set[str] = set()
    for item in value:
        if not isinstance(item, Mapping):
            raise _invalid("each mount must be an object {host_path, container_path, mode}")
        host = _norm_abs(item.get("host_path"), "mounts[].host_path")
        target = _norm_abs(item.get("container_path"), "mounts[].container_path")
        mode = str(item.get("mode") or "ro").strip().lower()
        if mode not in ("ro", "rw"):
            raise _invalid(f"mount mode {mode[:10]!r} must be 'ro' or 'rw'")
        if target in owned:
            if target not in ignored:
                ignored.append(target)
            continue
        if any(_under(host, w) for w in written):
            raise _refused(
                f"mounting host path {host!r}",
                "the Ray runtime container writes that directory (RAY_SESSION_DIR), so nothing in it "
                "is a mount source; the agent mounts it at /tmp/ray itself",
            )
        root = next((r for r in roots if _under(host, r)), None)
        if root is None:
            raise _refused(
                f"mounting host path {host!r}",
                "only the model store, the Ray session directory and RAY_ALLOWED_MOUNTS "
                f"({', '.join(roots) or 'none'}) are mounted",
            )
        if target == "/" or any(_under(target, r) or _under(r, target) for r in reserved_paths):
            raise _refused(f"mounting over {target!r} in the container")
        if target in targets:
            raise _invalid(f"container path {target!r} is mounted twice")
        shared = next((w for w in workload_written if _strictly_under(host, posixpath.normpath(w))), None)
        if shared is not None:
            raise _refused(
                f"mounting host path {host!r}",
                f"it lies inside the model store {shared}, which workload containers write: the engine "
                "resolves a mount's source again at every start, so a directory there could be swapped for "
                "a link out of the store; mount the model store itself",
            )
        targets.add(target)
        out.append(Mount(host, target, mode == "ro", root))
    sources = [posixpath.normpath(a) for a in agent_sources if a]
    for rw in out:
        if rw.read_only:
            continue
        inner = next((m.host_path for m in out if _strictly_under(m.host_path, rw.host_path)), None)
        inner = inner or next((a for a in sources if _strictly_under(a, rw.host_path)), None)
        if inner is not None:
            raise _refused(
                f"mounting host path {rw.host_path!r} read-write",
                f"it holds {inner!r}, the source of another mount: the container could swap that directory "
                "for a link out of its root before the engine resolves the source again at the next start; "
                "mount it read-only or mount the directories apart",
            )
    return tuple(out), tuple(ignored)


def check_layout(model_store: str, session_dir: str, token_dir: str) -> None:
    """
    The agent's own bind sources lie where no container writes: the token and session
    directories not inside the model store (workloads write it), the model store not inside
    the session directory (the runtime container writes it). The engine resolves a bind source
    again at every start, so one of them below a container-written directory could be swapped
    for a link to C{/}.

    @raise CommandFailed: C{policy_violation} naming the setting to change.
    """
    store = posixpath.normpath(model_store) if model_store else ""
    session = posixpath.normpath(session_dir) if session_dir else ""
    for name, path in (("RAY_SESSION_DIR", session), ("RAY_TOKEN_DIR", posixpath.normpath(token_dir))):
        if store and path and _under(path, store):
            raise CommandFailed(
                POLICY_VIOLATION,
                f"{name} {path} lies inside the model store {store}, which workload containers write; "
                f"set {name} to a directory outside MODEL_STORE.",
            )
    if store and session and _under(store, session):
        raise CommandFailed(
            POLICY_VIOLATION,
            f"MODEL_STORE {store} lies inside RAY_SESSION_DIR {session}, which the Ray runtime container writes; "
            "set RAY_SESSION_DIR outside the model store's path.",
        )


def _digest(value: object, field: str, required: bool) -> str | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        if required:
            raise _invalid(f"{field} is required (the image's pinned sha256 config id); an unpinned bundle is refused")
        return None
    text = str(value).strip().lower()
    if not _SHA_RE.match(text):
        raise _invalid(f"{field} {str(value)[:80]!r} is not a sha256:<64 hex> digest")
    return text


def parse_bundle(
    raw: object,
    *,
    allowlist: tuple[AllowEntry, ...],
    allowed_roots: Iterable[str],
    token_dir: str,
    agent_mounts: Iterable[str] = (),
    container_written: Iterable[str] = (),
    workload_written: Iterable[str] = (),
    agent_sources: Iterable[str] = (),
) -> RuntimeBundle:
    """
    Parse and admit a runtime bundle.

    @param allowed_roots: host directories mounts may come from (the model store, the Ray
        session directory, C{RAY_ALLOWED_MOUNTS}).
    @param token_dir: the cluster token directory (mounted by the agent, never by a bundle).
    @param agent_mounts: container paths the agent mounts itself (C{/tmp/ray}): a bundle mount
        at exactly one of them is left out (L{RuntimeBundle.ignored_mounts}); one above or
        below it is refused.
    @param container_written: host directories the runtime container writes (C{RAY_SESSION_DIR}):
        no bundle mount comes from them.
    @param workload_written: host directories workload containers may write (the model store):
        a bundle mount may be one of them, never a path below one.
    @param agent_sources: the bind sources of the agent's own mounts (the model store, the token
        and session directories): no read-write bundle mount holds one.
    @raise CommandFailed: C{invalid_command} for a malformed bundle (no image, no digest...),
        C{policy_violation} for one the local policy refuses.
    """
    if not isinstance(raw, Mapping):
        raise _invalid("must be an object")
    if raw.get("image") is None or (isinstance(raw.get("image"), str) and not raw["image"].strip()):
        raise _invalid("image is required")
    ref = check_image(raw.get("image"), allowlist, "runtime_bundle.image")
    digest = _digest(raw.get("digest"), "digest", True)
    assert digest is not None
    rootfs = _digest(raw.get("rootfs_digest"), "rootfs_digest", False)
    repo_digest_raw = raw.get("repo_digest")
    repo_digest: str | None = None
    if isinstance(repo_digest_raw, str) and repo_digest_raw.strip():
        tail = repo_digest_raw.strip().rsplit("@", 1)[-1].lower()
        if not _SHA_RE.match(tail):
            raise _invalid(f"repo_digest {repo_digest_raw[:80]!r} does not end in a sha256 digest")
        repo_digest = tail
    try:
        name = check_container_name(raw.get("name") or DEFAULT_CONTAINER_NAME, "runtime_bundle.name")
    except PolicyError as exc:
        raise _invalid(str(exc)) from None
    handler = str(raw.get("runtime_handler") or "docker").strip().lower()
    if handler not in ("docker", "podman"):
        raise _invalid(f"runtime_handler {handler[:20]!r} must be docker or podman")
    req = raw.get("requirements") or {}
    if not isinstance(req, Mapping):
        raise _invalid("requirements must be an object")
    for key in ("privileged", "security_opt", "cgroup_parent", "sysctls", "userns_mode"):
        value = req.get(key, raw.get(key))
        if value not in (None, False, "", [], {}):
            raise _refused(f"requirements.{key}")
    network = str(req.get("network_mode") or "host").strip().lower()
    if network != "host":
        raise _refused(f"network mode {network[:20]!r}", "the Ray runtime runs with host networking")
    ipc = str(req.get("ipc_mode") or "host").strip().lower()
    if ipc not in ("host", "private", "shareable"):
        raise _refused(f"ipc mode {ipc[:30]!r}")
    pid = req.get("pid_mode")
    if pid not in (None, "", "private"):
        raise _refused(f"pid mode {str(pid)[:20]!r}", "the runtime container keeps its own PID namespace")
    vendor = str(
        (raw.get("target_architecture") or {}).get("accelerator_vendor")
        if isinstance(raw.get("target_architecture"), Mapping)
        else ""
    ).strip().lower() or str(req.get("accelerator_vendor") or "nvidia").strip().lower()
    if vendor not in _VENDORS:
        raise _invalid(f"accelerator_vendor {vendor[:20]!r} must be one of {', '.join(_VENDORS)}")
    gpus_raw = req.get("gpus", "all")
    gpus: str | None = None if gpus_raw in (None, "", "none", "0", 0, False) else str(gpus_raw).strip()
    if gpus is not None and not re.match(r"^(all|[1-9][0-9]{0,2}|device=[0-9A-Za-z,-]{1,256})$", gpus):
        raise _invalid(f"requirements.gpus {gpus[:40]!r} must be 'all', a count or 'device=0,1'")
    shm: int | None = None
    if req.get("shm_size") not in (None, ""):
        try:
            shm = parse_bytes(req.get("shm_size"), "requirements.shm_size", 1024 * 1024)
        except PolicyError as exc:
            raise _invalid(str(exc)) from None
    owned = tuple(agent_mounts)
    mounts, ignored = _mounts(
        raw.get("mounts"), allowed_roots, [token_dir, *owned], owned, container_written, workload_written,
        [token_dir, *agent_sources],
    )
    return RuntimeBundle(
        image=ref,
        digest=digest,
        rootfs_digest=rootfs,
        repo_digest=repo_digest,
        name=name,
        runtime_handler=handler,
        ipc_mode=ipc,
        gpus=gpus,
        accelerator_vendor=vendor,
        devices=_devices(req.get("devices")),
        capabilities=_capabilities(req.get("capabilities")),
        shm_size=shm,
        ulimits=_ulimits(req.get("ulimits")),
        mounts=mounts,
        env=tuple(sorted(filter_env(raw.get("env")).items())),
        ignored_mounts=ignored,
    )
