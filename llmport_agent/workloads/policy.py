"""
Local policy, owned by the operator: which images may run, which container settings are
refused, and the validation of every value a payload carries.

Image references are parsed the way the Docker engine parses them
(C{[registry[:port]/]path[:tag][@digest]}, C{docker.io} implied, C{library/} for official
images), and C{IMAGE_ALLOWLIST} entries match at the registry and path-segment boundary:
C{ghcr.io/org} admits C{ghcr.io/org/x} and refuses C{ghcr.io/org-evil/x}.

Everything here is pure: no I/O, no reactor.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from llmport_agent.core.values import frozen

from ..commands.base import INVALID_COMMAND, POLICY_VIOLATION, CommandFailed

_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN_RE = re.compile(
    rf"^(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?$"
)
_PATH_COMPONENT_RE = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG_RE = re.compile(r"^[\w][\w.-]{0,127}$")
_DIGEST_RE = re.compile(r"^[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}$")

DOCKER_HUB = "docker.io"
_HUB_ALIASES = {"docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com"}


class PolicyError(ValueError):
    """A value is malformed (the message says which and why)."""


@frozen
class ImageRef:
    """
    A parsed image reference.

    @ivar registry: lower-case registry host (with port), C{docker.io} when implied.
    @ivar path: the repository path components (C{library/x} for official images).
    @ivar tag: the tag, or C{None} (C{latest} is implied when there is no digest either).
    @ivar digest: C{algorithm:hex}, or C{None}.
    @ivar original: the text as given.
    """

    registry: str
    path: tuple[str, ...]
    tag: str | None
    digest: str | None
    original: str

    @property
    def repository(self) -> str:
        """C{registry/path} (fully qualified, without tag or digest)."""
        return f"{self.registry}/{'/'.join(self.path)}"

    @property
    def effective_tag(self) -> str:
        """The tag, C{latest} when none is given."""
        return self.tag or "latest"

    @property
    def familiar_name(self) -> str:
        """The short repository name Docker shows (C{vllm/vllm-openai}, C{busybox})."""
        path = "/".join(self.path)
        if self.registry == DOCKER_HUB:
            return path[len("library/") :] if path.startswith("library/") else path
        return f"{self.registry}/{path}"

    @property
    def pull_name(self) -> str:
        """What to hand to the engine's pull: the familiar name."""
        return self.familiar_name

    @property
    def canonical(self) -> str:
        """The reference the engine stores: name, C{:tag} and/or C{@digest}."""
        text = self.familiar_name
        if self.tag or not self.digest:
            text += f":{self.effective_tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text


def parse_image_ref(text: object, field_name: str = "image") -> ImageRef:
    """
    Parse an image reference.

    @raise PolicyError: the reference is not one the engine would accept.
    """
    if not isinstance(text, str) or not text.strip():
        raise PolicyError(f"{field_name} must be a non-empty image reference string")
    original = text.strip()
    if len(original) > 512 or any(c.isspace() for c in original):
        raise PolicyError(f"{field_name} {original[:80]!r} is not a valid image reference")
    rest = original
    digest: str | None = None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not _DIGEST_RE.match(digest):
            raise PolicyError(f"{field_name} {original!r} has a malformed digest {digest!r}")
    registry = DOCKER_HUB
    first, sep, remainder = rest.partition("/")
    if sep and _explicit_registry(first):
        if not _DOMAIN_RE.match(first):
            raise PolicyError(f"{field_name} {original!r} has a malformed registry {first!r}")
        registry = first.lower()
        rest = remainder
    tag: str | None = None
    last_slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > last_slash:
        rest, tag = rest[:colon], rest[colon + 1 :]
        if not _TAG_RE.match(tag):
            raise PolicyError(f"{field_name} {original!r} has a malformed tag {tag!r}")
    if not rest:
        raise PolicyError(f"{field_name} {original!r} has no repository name")
    parts = tuple(rest.split("/"))
    for part in parts:
        if not _PATH_COMPONENT_RE.match(part):
            raise PolicyError(
                f"{field_name} {original!r}: repository name component {part!r} must be "
                "lower case letters, digits and separators (. _ __ -)"
            )
    if registry in _HUB_ALIASES:
        registry = DOCKER_HUB
        if len(parts) == 1:
            parts = ("library", *parts)
    if len(registry) + 1 + len("/".join(parts)) > 255:
        raise PolicyError(f"{field_name} {original[:80]!r}...: repository name is too long")
    return ImageRef(registry, parts, tag, digest, original)


@frozen
class AllowEntry:
    """
    One C{IMAGE_ALLOWLIST} entry: a registry, a registry plus path prefix, or one exact
    repository with a tag or digest.
    """

    registry: str
    path: tuple[str, ...]
    tag: str | None
    digest: str | None
    hub_bare: bool
    text: str

    def admits(self, ref: ImageRef) -> bool:
        """Whether C{ref} is inside this entry (segment boundaries, never substrings)."""
        if ref.registry != self.registry:
            return False
        if self.tag is not None or self.digest is not None:
            paths = [self.path]
            if self.hub_bare:
                paths.append(("library", *self.path))
            if ref.path not in paths:
                return False
            if self.digest is not None:
                return ref.digest is not None and ref.digest.lower() == self.digest.lower()
            return ref.tag == self.tag or (ref.tag is None and ref.digest is None and self.tag == "latest")
        n = len(self.path)
        if ref.path[:n] == self.path:
            return True
        return self.hub_bare and ref.path[: n + 1] == ("library", *self.path)


def _explicit_registry(first: str) -> bool:
    return "." in first or ":" in first or first == "localhost" or first.lower() != first


def parse_allow_entry(text: str) -> AllowEntry:
    """
    Parse one allowlist entry.

    Forms: C{ghcr.io} or C{registry.local:5000} (a whole registry: a name with a dot or a
    port, or C{localhost}), C{ghcr.io/org} (a path prefix), C{vllm} (Docker Hub: the C{vllm/}
    namespace and the official C{vllm} image), C{ollama/ollama:0.5.1} (one tag),
    C{repo@sha256:...} (one digest). A trailing slash changes nothing (C{myorg/} is
    C{myorg}, C{ghcr.io/} is C{ghcr.io}) except after a port: C{name:5000/} is a registry,
    C{name:5000} an image with tag 5000.

    @raise PolicyError: the entry is malformed.
    """
    # A trailing slash changes nothing: operators coming from the original agent write
    # prefixes as C{myorg/} or C{ghcr.io/org/}, and each means what it means without one.
    # The one thing it tells apart is C{name:5000/} (a registry on a port) from
    # C{name:5000} (an image with tag 5000, as Docker reads it).
    raw = text.strip()
    port_registry = raw.endswith("/") and re.match(r"^[^/:@]+:[0-9]+/+$", raw) is not None
    raw = raw.rstrip("/")
    if not raw:
        raise PolicyError(f"IMAGE_ALLOWLIST entry {text!r} is empty")
    if "/" not in raw and "@" not in raw:
        host = raw.split(":", 1)[0]
        if port_registry or "." in host or host == "localhost":
            if not _DOMAIN_RE.match(raw):
                raise PolicyError(f"IMAGE_ALLOWLIST entry {text!r} is not a valid registry")
            reg = raw.lower()
            return AllowEntry(DOCKER_HUB if reg in _HUB_ALIASES else reg, (), None, None, False, text)
    ref = parse_image_ref(raw, f"IMAGE_ALLOWLIST entry {text!r}:")
    first, sep, rest = raw.partition("/")
    written = rest if sep and _explicit_registry(first) else raw
    written = written.split("@", 1)[0]
    if ":" in written.rsplit("/", 1)[-1]:
        written = written.rsplit(":", 1)[0]
    path = ref.path
    hub_bare = False
    if ref.registry == DOCKER_HUB and "/" not in written:
        path = (written,)
        hub_bare = True
    return AllowEntry(ref.registry, path, ref.tag, ref.digest, hub_bare, text)


def parse_allowlist(value: str | Iterable[str] | None) -> tuple[AllowEntry, ...]:
    """
    Parse C{IMAGE_ALLOWLIST}: entries separated by commas, semicolons or white space.
    C{*} alone (or nothing) admits everything (an empty tuple).

    @raise PolicyError: an entry is malformed (the operator's configuration is wrong).
    """
    if value is None:
        return ()
    items: list[str] = []
    texts = [value] if isinstance(value, str) else list(value)
    for text in texts:
        items.extend(t for t in re.split(r"[,;\s]+", text) if t)
    if items == ["*"]:
        return ()
    return tuple(parse_allow_entry(item) for item in items)


def image_allowed(ref: ImageRef, allowlist: tuple[AllowEntry, ...]) -> bool:
    """Empty allowlist admits every image; otherwise some entry must admit C{ref}."""
    return not allowlist or any(entry.admits(ref) for entry in allowlist)


def check_image(image: object, allowlist: tuple[AllowEntry, ...], field_name: str = "image") -> ImageRef:
    """
    Parse and admit an image.

    @raise CommandFailed: C{invalid_command} for a malformed reference, C{policy_violation}
        for one the allowlist refuses.
    """
    try:
        ref = parse_image_ref(image, field_name)
    except PolicyError as exc:
        raise CommandFailed(INVALID_COMMAND, str(exc)) from None
    if not image_allowed(ref, allowlist):
        allowed = ", ".join(e.text for e in allowlist)
        raise CommandFailed(
            POLICY_VIOLATION,
            f"Image {ref.original!r} is not allowed on this node: IMAGE_ALLOWLIST admits only "
            f"{allowed}. Ask the node's operator to extend IMAGE_ALLOWLIST or use an allowed image.",
        )
    return ref


# -- value validation -----------------------------------------------------------------

_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([bkmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_CONTAINER_NAME_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{1,127}$")
_RUNTIME_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def is_blank(value: object) -> bool:
    """C{None} and strings that are empty after stripping mean "not given"."""
    return value is None or (isinstance(value, str) and not value.strip())


def parse_bytes(value: object, field_name: str, minimum: int = 0) -> int:
    """
    A size such as C{16g}, C{512m}, C{1.5GiB} or an integer byte count (binary units, as
    Docker reads them).

    @raise PolicyError: malformed or too small.
    """
    if isinstance(value, bool):
        raise PolicyError(f"{field_name} must be a size such as '16g' or '512m', not {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        m = _BYTES_RE.match(value)
        if not m:
            raise PolicyError(
                f"{field_name} must be a size such as '16g', '512m' or a byte count, not {value[:40]!r}"
            )
        number = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise PolicyError(f"{field_name} must be a size such as '16g' or '512m', not {value!r}")
    if number < max(minimum, 1):
        raise PolicyError(f"{field_name} {value!r} is too small (at least {max(minimum, 1)} bytes)")
    if number > 1024**5:
        raise PolicyError(f"{field_name} {value!r} is too large")
    return number


def parse_cpus(value: object, field_name: str = "cpu_limit") -> int:
    """
    A CPU count such as C{4} or C{2.5}; returns nano-CPUs.

    @raise PolicyError: malformed or out of range (0.01..4096).
    """
    if isinstance(value, bool):
        raise PolicyError(f"{field_name} must be a number of CPUs such as '4' or '2.5'")
    try:
        cpus = float(value.strip()) if isinstance(value, str) else float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise PolicyError(
            f"{field_name} must be a number of CPUs such as '4' or '2.5', not {str(value)[:40]!r}"
        ) from None
    if not (0.01 <= cpus <= 4096):
        raise PolicyError(f"{field_name} {value!r} is out of range (0.01 to 4096 CPUs)")
    return int(round(cpus * 1e9))


def parse_port(value: object, field_name: str) -> int:
    """
    A TCP port 1..65535 (an integer or a string of digits).

    @raise PolicyError: anything else.
    """
    if isinstance(value, bool):
        raise PolicyError(f"{field_name} must be a port number from 1 to 65535, not {value!r}")
    if isinstance(value, int):
        port = value
    elif isinstance(value, str) and value.strip().isdigit():
        port = int(value.strip())
    elif isinstance(value, float) and value.is_integer():
        port = int(value)
    else:
        raise PolicyError(f"{field_name} must be a port number from 1 to 65535, not {str(value)[:40]!r}")
    if not 1 <= port <= 65535:
        raise PolicyError(f"{field_name} {port} is out of range (1 to 65535)")
    return port


def check_container_name(value: object, field_name: str = "container_name") -> str:
    """
    A Docker container name: C{[a-zA-Z0-9][a-zA-Z0-9_.-]+}, at most 128 characters.

    @raise PolicyError: anything else.
    """
    if not isinstance(value, str) or not _CONTAINER_NAME_RE.match(value.strip().lstrip("/")):
        raise PolicyError(
            f"{field_name} {str(value)[:80]!r} is not a valid container name (letters, digits, "
            "'_', '.', '-'; 2 to 128 characters; starting with a letter or digit)"
        )
    return value.strip().lstrip("/")


def check_runtime_id(value: object, field_name: str = "runtime_id") -> str:
    """
    A runtime id (a UUID from the backend; any short token of safe characters is accepted).

    @raise PolicyError: missing or malformed.
    """
    if not isinstance(value, str) or not value.strip():
        raise PolicyError(f"{field_name} is required (a runtime UUID)")
    if not _RUNTIME_ID_RE.match(value.strip()):
        raise PolicyError(f"{field_name} {value[:80]!r} is not a valid runtime id")
    return value.strip()


# -- refusals ---------------------------------------------------------------------------

#: Docker settings a payload may try to carry, and why they are refused.
_REFUSED_FLAGS: dict[str, str] = {
    "privileged": "privileged mode",
    "cap_add": "added capabilities (cap_add)",
    "capabilities": "added capabilities",
    "security_opt": "security options (security_opt)",
    "device_cgroup_rules": "device cgroup rules",
    "sysctls": "kernel parameters (sysctls)",
    "cgroup_parent": "a custom cgroup parent",
}
_DEVICE_KEYS = ("devices", "device")
_MOUNT_KEYS = ("volumes", "volume", "mounts", "binds", "bind_mounts")
_NAMESPACE_KEYS = {
    "pid_mode": "PID",
    "pid": "PID",
    "userns_mode": "user",
    "uts_mode": "UTS",
    "cgroupns": "cgroup",
    "cgroupns_mode": "cgroup",
}
_NETWORK_KEYS = ("network_mode", "network", "net")
_IPC_VALUES = ("private", "shareable", "none", "host")


def _truthy(value: object) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("", "0", "false", "no", "off", "none")
    return bool(value)


def _refuse(what: str, where: str, hint: str = "") -> CommandFailed:
    text = f"{what} ({where}) is refused by this node's local policy"
    if hint:
        text += f"; {hint}"
    return CommandFailed(POLICY_VIOLATION, text + ".")


def _mount_sources(value: object) -> list[str]:
    """Host sources named by a volumes/mounts/binds value in any common shape."""
    sources: list[str] = []
    items: Iterable[Any]
    if isinstance(value, Mapping):
        items = [{"source": k, **(v if isinstance(v, Mapping) else {})} for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        items = [value]
    for item in items:
        if isinstance(item, str):
            sources.append(item.split(":", 1)[0])
        elif isinstance(item, Mapping):
            src = item.get("source", item.get("Source", item.get("host_path", "")))
            sources.append(str(src))
        else:
            sources.append(str(item))
    return sources


def check_refusals(
    sections: Mapping[str, Mapping[str, Any]],
    *,
    operator_network: str,
    model_store: str | None,
    ipc_mode: str | None,
) -> None:
    """
    Refuse Docker settings the backend may not choose: privileged mode, added
    capabilities, devices other than GPUs, host PID (and other) namespaces, a network
    other than the operator's choice, bind mounts other than the model store, and another
    container's IPC namespace. (Host IPC is not refused but decided by L{resolve_ipc}.)

    @param sections: the payload parts to inspect, by name (e.g. C{payload},
        C{provider_config}).
    @raise CommandFailed: C{policy_violation} naming the setting and where it was found.
    """
    for where, section in sections.items():
        if not isinstance(section, Mapping):
            continue
        for key, what in _REFUSED_FLAGS.items():
            if key in section and _truthy(section[key]):
                raise _refuse(what, f"{where}.{key}")
        for key in _DEVICE_KEYS:
            if key in section and _truthy(section[key]):
                raise _refuse(
                    "devices other than GPUs",
                    f"{where}.{key}",
                    "request GPUs with gpu_request ('all', a count, or 'device=0,1')",
                )
        for key, ns in _NAMESPACE_KEYS.items():
            if key in section and _truthy(section[key]):
                value = str(section[key]).strip().lower()
                if value not in ("private", ""):
                    raise _refuse(f"sharing the {ns} namespace ({value!r})", f"{where}.{key}")
        for key in _NETWORK_KEYS:
            if key in section and not is_blank(section[key]):
                value = str(section[key]).strip().lower()
                if value != operator_network:
                    raise _refuse(
                        f"network mode {value!r}",
                        f"{where}.{key}",
                        f"this node's operator runs workloads with network mode {operator_network!r}",
                    )
        for key in _MOUNT_KEYS:
            if key in section and _truthy(section[key]):
                for source in _mount_sources(section[key]):
                    if not model_store or source.rstrip("/") != model_store.rstrip("/"):
                        raise _refuse(
                            f"mounting {source!r}",
                            f"{where}.{key}",
                            "only the node's model store is mounted (at /data/hf-cache)",
                        )
    if ipc_mode is not None:
        value = ipc_mode.strip().lower()
        if value.startswith("container:"):
            raise _refuse(f"sharing another container's IPC namespace ({ipc_mode!r})", "ipc_mode")
        if value not in _IPC_VALUES:
            raise CommandFailed(
                INVALID_COMMAND,
                f"ipc_mode {ipc_mode[:40]!r} is not one of {', '.join(_IPC_VALUES)}",
            )


#: /dev/shm given to a workload whose host IPC was replaced by private IPC (the size the
#: backend gives GPU workloads).
REPLACED_IPC_SHM = 1024**3


@frozen
class IpcDecision:
    """
    How a workload's IPC namespace is set up.

    @ivar ipc_mode: the engine's C{IpcMode} (C{None}: the engine's default, private).
    @ivar shm_size: C{/dev/shm} size in bytes (C{None}: the engine's default, 64 MiB).
    @ivar note: one sentence for the command's progress when the request was changed.
    """

    ipc_mode: str | None
    shm_size: int | None
    note: str | None = None


def _gib(n: int) -> str:
    return f"{n / 1024**3:g} GiB" if n >= 1024**3 else f"{n / 1024**2:g} MiB"


def resolve_ipc(
    ipc_mode: str | None, *, has_gpu: bool, allow_host: bool, shm_size: int | None
) -> IpcDecision:
    """
    Host IPC is given only to workloads that request GPUs, and only while the operator
    allows it (C{ALLOW_HOST_IPC}, on by default: the backend asks for it for every vLLM and
    TGI runtime, which use it for NCCL and PyTorch shared memory). Anything else that asks
    for host IPC (a CPU-only vLLM runtime arrives with C{gpu_request: "none"} and C{ipc_mode:
    "host"}, protocol 9) runs with private IPC and a C{/dev/shm} of C{shm_size} (1 GiB when
    not given) instead, and the returned note says so. Other modes pass unchanged
    (L{check_refusals} validated them).
    """
    value = ipc_mode.strip().lower() if isinstance(ipc_mode, str) and ipc_mode.strip() else None
    if value != "host" or (has_gpu and allow_host):
        return IpcDecision(value, shm_size)
    shm = shm_size if shm_size is not None else REPLACED_IPC_SHM
    why = (
        "this node's operator does not allow host IPC (LLM_PORT_NODE_AGENT_ALLOW_HOST_IPC=false)"
        if has_gpu
        else "the workload requests no GPU (the backend asks for host IPC for every vllm and tgi runtime)"
    )
    note = (
        f"Host IPC was requested but {why}; the container runs with private IPC and a "
        f"{_gib(shm)} /dev/shm instead (set shm_size on the runtime to change it)."
    )
    return IpcDecision("private", shm, note)
