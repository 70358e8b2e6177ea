"""
Deploy payload (protocol 4.1) -> container specification. Pure functions, no I/O.

L{build_spec} validates the payload and applies the per-provider defaults;
L{render} turns a spec plus the chosen host port into the arguments of the engine's
create call (the host port matters in host networking, where the server listens on it).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from typing import Any

from attrs import field

from llmport_agent.core.values import frozen

from ..commands.base import INVALID_COMMAND, CommandFailed

# The container labels (the engine is the source of truth for workloads) live in a light module
# of their own (read at start, without this parser); the names stay importable from here.
from .labels import (
    LABEL_AGENT_ID,
    LABEL_COMMAND_ID,
    LABEL_CONTAINER_PORT,
    LABEL_HEALTH_PATH,
    LABEL_HOST_PORT,
    LABEL_IMAGE,
    LABEL_MANAGED,
    LABEL_NAME,
    LABEL_NETWORK,
    LABEL_PROVIDER,
    LABEL_RUNTIME_ID,
    LABEL_RUNTIME_NAME,
    MANAGED_VALUE,
)
from .policy import (
    AllowEntry,
    ImageRef,
    PolicyError,
    check_container_name,
    check_image,
    check_refusals,
    check_runtime_id,
    is_blank,
    parse_bytes,
    parse_cpus,
    parse_port,
    resolve_ipc,
)
from .settings import WorkloadSettings

MODEL_MOUNT = "/data/hf-cache"
DEFAULT_CONTAINER_PORT = 8000
IMAGE_SOURCES = ("pull_from_registry", "transfer_from_server")


@frozen
class ProviderDefaults:
    """What a provider type implies when the payload says nothing."""

    image: str
    health_path: str
    gpu_default: str | None
    host_ipc_with_gpu: bool


PROVIDERS: dict[str, ProviderDefaults] = {
    "vllm": ProviderDefaults("vllm/vllm-openai:latest", "/health", "all", True),
    "llamacpp": ProviderDefaults("ghcr.io/ggerganov/llama.cpp:server", "/health", None, False),
    "tgi": ProviderDefaults(
        "ghcr.io/huggingface/text-generation-inference:latest", "/health", "all", True
    ),
    "ollama": ProviderDefaults("ollama/ollama:latest", "/", None, False),
}


@frozen
class GpuRequest:
    """GPUs for the container: all of them, a count, or device ids."""

    count: int  # -1 = all
    device_ids: tuple[str, ...] = ()

    def describe(self) -> str:
        """Human form (C{all}, C{2}, C{device=0,1})."""
        if self.device_ids:
            return "device=" + ",".join(self.device_ids)
        return "all" if self.count < 0 else str(self.count)

    def device_request(self) -> dict[str, Any]:
        """The engine's C{DeviceRequest} object (as C{docker --gpus} builds it)."""
        req: dict[str, Any] = {"Driver": "", "Capabilities": [["gpu"]], "Options": {}}
        if self.device_ids:
            req["Count"] = 0
            req["DeviceIDs"] = list(self.device_ids)
        else:
            req["Count"] = self.count
            req["DeviceIDs"] = None
        return req


@frozen
class WorkloadSpec:
    """A validated workload, before a host port is chosen."""

    runtime_id: str
    runtime_name: str
    container_name: str
    provider_type: str
    image: ImageRef
    image_source: str | None
    container_port: int
    requested_host_port: int | None
    health_path: str
    gpu: GpuRequest | None
    shm_size: int | None
    ipc_mode: str | None
    mem_limit: int | None
    nano_cpus: int | None
    network_mode: str
    model_store: str | None
    model_store_mode: str  # "ro" or "rw" (only download_from_hf writes into the store)
    model_source: str | None
    model_sync: dict[str, Any] | None = field(eq=False, repr=False)
    model_name: str | None
    command: tuple[str, ...] | None
    vllm_args: tuple[str, ...] | None  # vLLM's own flags after --host/--port
    environment: dict[str, str] = field(eq=False, repr=False)
    registry_auth: dict[str, str] | None = field(eq=False, repr=False)
    #: Sentences for the command's progress about settings changed by local policy.
    notes: tuple[str, ...] = ()
    #: AMD (ROCm): device nodes given to the container instead of a device request
    #: (set by L{llmport_agent.workloads.gpus.place_gpus}, never from the payload).
    gpu_devices: tuple[str, ...] = ()

    @property
    def uses_default_command(self) -> bool:
        """vLLM command line built by the agent (C{provider_config.command} absent)."""
        return self.vllm_args is not None


def _invalid(message: str) -> CommandFailed:
    return CommandFailed(INVALID_COMMAND, message)


def slug_container_name(runtime_name: object) -> str:
    """C{llm-port-} + a slug of the runtime name (protocol 4.1), or C{llm-port-runtime}."""
    text = runtime_name if isinstance(runtime_name, str) else ""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:48].strip("-")
    return f"llm-port-{slug}" if slug else "llm-port-runtime"


def _section(payload: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = payload.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _invalid(f"{key} must be an object, not {type(value).__name__}")
    return dict(value)


def _pick(payload: Mapping[str, Any], provider_config: Mapping[str, Any], key: str) -> Any:
    """Top-level wins over C{provider_config}; blank values count as absent."""
    value = payload.get(key)
    if not is_blank(value):
        return value
    value = provider_config.get(key)
    return None if is_blank(value) else value


def _explicitly_empty(payload: Mapping[str, Any], provider_config: Mapping[str, Any], key: str) -> bool:
    """C{key} was sent as an empty string (top level or C{provider_config}), not left out."""
    return any(
        isinstance(section.get(key), str) and not section[key].strip()
        for section in (payload, provider_config)
    )


def parse_gpu_request(value: object) -> GpuRequest | None:
    """
    C{all}, a count (C{2}), or device ids (C{device=0,1}); C{none}/C{0} for no GPU.

    @raise PolicyError: anything else.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        return GpuRequest(-1) if value else None
    if isinstance(value, int):
        if value < 0:
            return GpuRequest(-1)
        return GpuRequest(value) if value > 0 else None
    if not isinstance(value, str):
        raise PolicyError(f"gpu_request must be a string such as 'all', '2' or 'device=0,1', not {value!r}")
    text = value.strip().strip("'\"").strip()
    low = text.lower()
    if low in ("", "none", "0", "false", "no"):
        return None
    if low in ("all", "-1", "true"):
        return GpuRequest(-1)
    if low.isdigit():
        return GpuRequest(int(low))
    if low.startswith("count="):
        rest = low[len("count=") :]
        if rest == "all":
            return GpuRequest(-1)
        if rest.isdigit() and int(rest) > 0:
            return GpuRequest(int(rest))
    if low.startswith("device=") or low.startswith("devices="):
        ids = tuple(i.strip() for i in text.split("=", 1)[1].split(",") if i.strip())
        if ids and all(re.match(r"^[A-Za-z0-9][A-Za-z0-9:/._-]{0,127}$", i) for i in ids):
            return GpuRequest(0, ids)
    raise PolicyError(
        f"gpu_request {text[:60]!r} is not understood: use 'all', a count such as '2', "
        "or device ids such as 'device=0,1'"
    )


def _command_value(value: object, field_name: str) -> tuple[str, ...] | None:
    if is_blank(value):
        return None
    if isinstance(value, str):
        try:
            parts = shlex.split(value)
        except ValueError as exc:
            raise _invalid(f"{field_name} is not a valid shell-style command line: {exc}") from None
        return tuple(parts) or None
    if isinstance(value, (list, tuple)):
        out: list[str] = []
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                raise _invalid(f"{field_name}[{i}] must be a string, not {type(item).__name__}")
            out.append(str(item))
        return tuple(out) or None
    raise _invalid(f"{field_name} must be a list of strings or a command line string")


def _flag_key(key: str) -> str:
    return key.strip().lstrip("-").replace("_", "-").lower()


_FLAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def _flag_value(value: object) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _is_false(value: object) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("false", "0", "no", "off")
    return value is False


def build_vllm_args(
    generic: Mapping[str, Any],
    provider_config: Mapping[str, Any],
    engine_args: Mapping[str, Any],
    extra_args: tuple[str, ...],
) -> tuple[str, ...]:
    """
    vLLM's flags after C{serve --model M --host 0.0.0.0 --port P} (protocol 4.1): the
    C{generic_config} flags, tool calling, the chat template, the remaining
    C{engine_args}, then C{extra_args} verbatim.
    """
    args: list[str] = []
    for key, flag in (
        ("max_model_len", "--max-model-len"),
        ("dtype", "--dtype"),
        ("gpu_memory_utilization", "--gpu-memory-utilization"),
        ("tensor_parallel_size", "--tensor-parallel-size"),
        ("swap_space", "--swap-space"),
    ):
        value = generic.get(key)
        if is_blank(value) or isinstance(value, bool):
            continue
        if not isinstance(value, (str, int, float)):
            raise _invalid(f"generic_config.{key} must be a number or string")
        args += [flag, str(value).strip()]
    enforce = generic.get("enforce_eager")
    if enforce is True or (isinstance(enforce, str) and enforce.strip().lower() in ("true", "1", "yes")):
        args.append("--enforce-eager")

    by_key: dict[str, tuple[str, Any]] = {}
    for raw_key, value in engine_args.items():
        if not isinstance(raw_key, str) or not _FLAG_RE.match(raw_key.strip().lstrip("-")):
            raise _invalid(f"provider_config.engine_args has an invalid flag name {str(raw_key)[:60]!r}")
        by_key[_flag_key(raw_key)] = (raw_key.strip().lstrip("-"), value)

    tool_choice = by_key.pop("enable-auto-tool-choice", (None, None))[1]
    parser_entry = by_key.pop("tool-call-parser", (None, None))[1]
    if not _is_false(tool_choice):
        parser = next(
            (
                str(v).strip()
                for v in (
                    parser_entry,
                    generic.get("tool_call_parser"),
                    provider_config.get("tool_call_parser"),
                )
                if not is_blank(v) and not isinstance(v, bool)
            ),
            "openai",
        )
        args += ["--enable-auto-tool-choice", "--tool-call-parser", parser]
    template = by_key.pop("chat-template", (None, None))[1]
    if not is_blank(template) and template is not False:
        args += ["--chat-template", _flag_value(template)]
    # The agent owns these: the endpoint must be where the agent says it is, and the served
    # model name must be the model's hf_repo_id (the llm-port gateway routes by it).
    for owned in ("host", "port", "model", "served-model-name"):
        by_key.pop(owned, None)
    for name, value in by_key.values():
        if value is True:
            args.append(f"--{name}")
        elif value is None or value is False or (isinstance(value, str) and not value.strip()):
            continue
        elif isinstance(value, list):
            args.append(f"--{name}")
            args += [_flag_value(v) for v in value]
        else:
            args += [f"--{name}", _flag_value(value)]
    args += list(extra_args)
    return tuple(args)


def _registry_auth(*sources: Mapping[str, Any], registry: str) -> dict[str, str] | None:
    """Credentials for C{registry} from the payload or profile (never logged)."""
    for source in sources:
        for key in ("registry_auth", "registry_credentials", "registry_credential"):
            value = source.get(key)
            if not isinstance(value, Mapping) or not value:
                continue
            if "username" in value or "password" in value or "identitytoken" in value:
                entry: Mapping[str, Any] = value
                reg = str(value.get("registry") or value.get("serveraddress") or "").lower()
                if reg and reg.split("://")[-1].rstrip("/") not in (registry, f"{registry}/v1", f"{registry}/v2"):
                    if not (registry == "docker.io" and "docker.io" in reg):
                        continue
            else:
                match = None
                for reg_key, creds in value.items():
                    host = str(reg_key).lower().split("://")[-1].split("/")[0]
                    if host == registry or (registry == "docker.io" and "docker.io" in host):
                        match = creds
                        break
                if not isinstance(match, Mapping):
                    continue
                entry = match
            auth = {
                k: str(entry[k])
                for k in ("username", "password", "identitytoken", "registrytoken")
                if not is_blank(entry.get(k))
            }
            if auth:
                auth["serveraddress"] = registry
                return auth
    return None


def build_spec(
    payload: Mapping[str, Any],
    settings: WorkloadSettings,
    allowlist: tuple[AllowEntry, ...],
    profile: Mapping[str, Any] | None = None,
) -> WorkloadSpec:
    """
    Validate a deploy payload (protocol 4.1) and apply the defaults.

    @raise CommandFailed: C{invalid_command} naming the bad field, or C{policy_violation}
        for a setting or image the local policy refuses.
    """
    if not isinstance(payload, Mapping):
        raise _invalid("the payload must be an object")
    try:
        runtime_id = check_runtime_id(payload.get("runtime_id"))
    except PolicyError as exc:
        raise _invalid(str(exc)) from None
    runtime_name = payload.get("runtime_name")
    if runtime_name is not None and not isinstance(runtime_name, str):
        raise _invalid("runtime_name must be a string")
    runtime_name = (runtime_name or "").strip()[:256]
    provider_type = payload.get("provider_type")
    if not isinstance(provider_type, str) or provider_type.strip().lower() not in PROVIDERS:
        raise _invalid(
            f"provider_type {str(provider_type)[:40]!r} is not one of {', '.join(PROVIDERS)}"
        )
    provider_type = provider_type.strip().lower()
    defaults = PROVIDERS[provider_type]
    provider_config = _section(payload, "provider_config")
    generic = _section(payload, "generic_config")
    engine_args = _section(provider_config, "engine_args") if provider_config else {}

    raw_name = payload.get("container_name")
    try:
        container_name = (
            slug_container_name(runtime_name) if is_blank(raw_name) else check_container_name(raw_name)
        )
    except PolicyError as exc:
        raise _invalid(str(exc)) from None

    image_text = provider_config.get("image")
    if is_blank(image_text):
        image_text = payload.get("image") if not is_blank(payload.get("image")) else defaults.image
    image = check_image(image_text, allowlist, "provider_config.image")

    image_source = _pick(payload, provider_config, "image_source")
    if image_source is not None:
        if not isinstance(image_source, str) or image_source.strip() not in (*IMAGE_SOURCES, "local"):
            raise _invalid(
                f"image_source {str(image_source)[:40]!r} is not one of pull_from_registry, "
                "transfer_from_server (or null for the local image)"
            )
        image_source = None if image_source.strip() == "local" else image_source.strip()

    try:
        raw_port = _pick(payload, provider_config, "container_port")
        container_port = (
            DEFAULT_CONTAINER_PORT if raw_port is None else parse_port(raw_port, "container_port")
        )
        raw_host = provider_config.get("host_port")
        requested_host_port = None if is_blank(raw_host) else parse_port(raw_host, "provider_config.host_port")
        raw_gpu = _pick(payload, provider_config, "gpu_request")
        if raw_gpu is None and _explicitly_empty(payload, provider_config, "gpu_request"):
            # protocol 10.4: "none", "0" or "" means no GPU flags at all; only an absent
            # (or null) gpu_request takes the provider's default.
            raw_gpu = ""
        gpu = parse_gpu_request(defaults.gpu_default if raw_gpu is None else raw_gpu)
        raw_shm = _pick(payload, provider_config, "shm_size")
        shm = parse_bytes(raw_shm, "shm_size", 1024 * 1024) if raw_shm is not None else None
        raw_mem = _pick(payload, provider_config, "memory_limit")
        mem = parse_bytes(raw_mem, "memory_limit", 6 * 1024 * 1024) if raw_mem is not None else None
        raw_cpu = _pick(payload, provider_config, "cpu_limit")
        cpus = parse_cpus(raw_cpu) if raw_cpu is not None else None
    except PolicyError as exc:
        raise _invalid(str(exc)) from None
    if gpu is not None and shm is None:
        shm = 1024**3
    raw_ipc = _pick(payload, provider_config, "ipc_mode")
    if raw_ipc is not None and not isinstance(raw_ipc, str):
        raise _invalid("ipc_mode must be a string")
    ipc_mode = raw_ipc.strip().lower() if isinstance(raw_ipc, str) else None
    if ipc_mode is None and gpu is not None and defaults.host_ipc_with_gpu:
        ipc_mode = "host"

    check_refusals(
        {"payload": payload, "provider_config": provider_config},
        operator_network=settings.network_mode,
        model_store=settings.model_store,
        ipc_mode=ipc_mode,
    )
    ipc = resolve_ipc(
        ipc_mode, has_gpu=gpu is not None, allow_host=settings.allow_host_ipc, shm_size=shm
    )
    ipc_mode, shm = ipc.ipc_mode, ipc.shm_size

    raw_sync = payload.get("model_sync")
    if raw_sync is not None and not isinstance(raw_sync, Mapping):
        raise _invalid("model_sync must be an object or null")
    model_sync = dict(raw_sync) if raw_sync else None
    model_source: str | None = None
    if model_sync:
        src = model_sync.get("source")
        if src is not None and src not in ("sync_from_server", "download_from_hf"):
            raise _invalid(
                f"model_sync.source {str(src)[:40]!r} is not sync_from_server or download_from_hf"
            )
        model_source = src
        hf = model_sync.get("hf_repo_id")
        if hf is not None and not isinstance(hf, str):
            raise _invalid("model_sync.hf_repo_id must be a string")
    if model_source is None and not is_blank(provider_config.get("model_source")):
        ms = provider_config.get("model_source")
        if ms in ("sync_from_server", "download_from_hf"):
            model_source = str(ms)
    if model_source == "sync_from_server" and not settings.model_store:
        raise _invalid(
            "model_sync.source is sync_from_server but this node has no model store "
            "(MODEL_STORE is not set)"
        )

    model_name = next(
        (
            str(v).strip()
            for v in (
                (model_sync or {}).get("hf_repo_id"),
                generic.get("model"),
                provider_config.get("model"),
            )
            if isinstance(v, str) and v.strip()
        ),
        None,
    )

    command = _command_value(provider_config.get("command"), "provider_config.command")
    extra = _command_value(provider_config.get("extra_args"), "provider_config.extra_args") or ()
    vllm_args: tuple[str, ...] | None = None
    if provider_type == "vllm" and command is None:
        if model_name is None:
            raise _invalid(
                "no model to serve: this vLLM runtime names no model, and the image's own "
                "default command would start some other one; set the runtime's model "
                "(model_sync.hf_repo_id, generic_config.model or provider_config.model) or "
                "give provider_config.command"
            )
        vllm_args = build_vllm_args(generic, provider_config, engine_args, extra)

    env: dict[str, str] = {}
    raw_env = provider_config.get("env", provider_config.get("environment"))
    if raw_env is not None:
        if not isinstance(raw_env, Mapping):
            raise _invalid("provider_config.env must be an object of NAME: value")
        for key, value in raw_env.items():
            if not isinstance(key, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$", key):
                raise _invalid(f"provider_config.env has an invalid variable name {str(key)[:60]!r}")
            if isinstance(value, (dict, list)) or value is None:
                raise _invalid(f"provider_config.env.{key} must be a string")
            env[key] = str(value)
    env["LLM_PORT_RUNTIME_ID"] = runtime_id
    env["LLM_PORT_PROVIDER_TYPE"] = provider_type
    if settings.model_store:
        env["HF_HUB_CACHE"] = MODEL_MOUNT
        if model_source == "sync_from_server":
            env["HF_HUB_OFFLINE"] = "1"
            env["TRANSFORMERS_OFFLINE"] = "1"
    if gpu is not None and image.registry == "nvcr.io":
        env["NVIDIA_DISABLE_REQUIRE"] = "1"

    auth_sources: list[Mapping[str, Any]] = [provider_config, payload]
    if profile:
        for section in ("runtime_config", "security_config", "network_config"):
            value = profile.get(section)
            if isinstance(value, Mapping):
                auth_sources.append(value)
    registry_auth = _registry_auth(*auth_sources, registry=image.registry)

    return WorkloadSpec(
        runtime_id=runtime_id,
        runtime_name=runtime_name,
        container_name=container_name,
        provider_type=provider_type,
        image=image,
        image_source=image_source,
        container_port=container_port,
        requested_host_port=requested_host_port,
        health_path=defaults.health_path,
        gpu=gpu,
        shm_size=shm,
        ipc_mode=ipc_mode,
        mem_limit=mem,
        nano_cpus=cpus,
        network_mode=settings.network_mode,
        model_store=settings.model_store,
        model_store_mode=(
            "rw"
            if model_source == "download_from_hf" and not settings.model_store_read_only
            else "ro"
        ),
        model_source=model_source,
        model_sync=model_sync,
        model_name=model_name,
        command=command,
        vllm_args=vllm_args,
        environment=env,
        registry_auth=registry_auth,
        notes=(ipc.note,) if ipc.note else (),
    )


def listen_port(spec: WorkloadSpec, host_port: int) -> int:
    """The port the server inside the container listens on."""
    return host_port if spec.network_mode == "host" else spec.container_port


def render(
    spec: WorkloadSpec,
    *,
    host_port: int,
    command_id: str,
    agent_id: str,
    publish_host_ip: str = "",
) -> dict[str, Any]:
    """
    The engine create call for C{spec} published on C{host_port}: a plain dict with
    C{create} (arguments of C{APIClient.create_container} other than C{host_config}) and
    C{host_config} (arguments of C{APIClient.create_host_config}).
    """
    port = listen_port(spec, host_port)
    env = dict(spec.environment)
    env["LLM_PORT_LISTEN_PORT"] = str(port)
    if spec.provider_type == "tgi":
        env.setdefault("PORT", str(port))
        env.setdefault("HOSTNAME", "0.0.0.0")
    elif spec.provider_type == "llamacpp":
        env.setdefault("LLAMA_ARG_PORT", str(port))
        env.setdefault("LLAMA_ARG_HOST", "0.0.0.0")
    elif spec.provider_type == "ollama":
        env.setdefault("OLLAMA_HOST", f"0.0.0.0:{port}")

    entrypoint: list[str] | None = None
    command: list[str] | None = list(spec.command) if spec.command is not None else None
    if spec.vllm_args is not None:
        entrypoint = ["vllm"]
        command = [
            "serve",
            "--model",
            spec.model_name or "",
            "--host",
            "0.0.0.0",
            "--port",
            str(port),
            *spec.vllm_args,
        ]

    labels = {
        LABEL_MANAGED: MANAGED_VALUE,
        LABEL_RUNTIME_ID: spec.runtime_id,
        LABEL_RUNTIME_NAME: spec.runtime_name,
        LABEL_COMMAND_ID: command_id,
        LABEL_PROVIDER: spec.provider_type,
        LABEL_CONTAINER_PORT: str(spec.container_port),
        LABEL_HOST_PORT: str(host_port),
        LABEL_AGENT_ID: agent_id,
        LABEL_NETWORK: spec.network_mode,
        LABEL_HEALTH_PATH: spec.health_path,
        LABEL_NAME: spec.container_name,
        LABEL_IMAGE: spec.image.canonical,
    }
    host_config: dict[str, Any] = {
        "restart_policy": {"Name": "unless-stopped"},
        "network_mode": spec.network_mode,
    }
    create: dict[str, Any] = {
        "image": spec.image.canonical,
        "command": command,
        "entrypoint": entrypoint,
        "name": spec.container_name,
        "environment": env,
        "labels": labels,
        "stop_signal": "SIGTERM",
        "detach": True,
    }
    if spec.network_mode == "bridge":
        create["ports"] = [spec.container_port]
        binding: Any = (publish_host_ip, host_port) if publish_host_ip else host_port
        host_config["port_bindings"] = {spec.container_port: binding}
    if spec.gpu_devices:
        host_config["devices"] = [f"{path}:{path}:rwm" for path in spec.gpu_devices]
    elif spec.gpu is not None:
        host_config["device_requests"] = [spec.gpu.device_request()]
    if spec.shm_size is not None:
        host_config["shm_size"] = spec.shm_size
    if spec.ipc_mode is not None:
        host_config["ipc_mode"] = spec.ipc_mode
    if spec.mem_limit is not None:
        host_config["mem_limit"] = spec.mem_limit
    if spec.nano_cpus is not None:
        host_config["nano_cpus"] = spec.nano_cpus
    if spec.model_store:
        host_config["binds"] = {spec.model_store: {"bind": MODEL_MOUNT, "mode": spec.model_store_mode}}
    return {"create": create, "host_config": host_config}


def endpoint_url(settings: WorkloadSettings, host_port: int) -> str:
    """C{<ADVERTISE_SCHEME>://<ADVERTISE_HOST>:<host port>} (IPv6 literals bracketed)."""
    host = settings.advertise_host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{settings.advertise_scheme}://{host}:{host_port}"
