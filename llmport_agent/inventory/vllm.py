# -*- test-case-name: tests.test_inventory_vllm -*-
"""
vLLM containers the node runs that llm-port did not start (protocol 10.5,
C{inventory.vllm_containers}); the backend offers to take them over.

A container is a candidate when its image or command mentions C{vllm} and it is not the
agent's own (its name does not start with C{llm-port-}, it carries no
C{io.llmport.managed} label). Candidates are inspected and described:

    {name, id (12), image, state, started_at, finished_at, exit_code, restart_policy,
     network_mode, host_port, gpus, managed_by, labels (<= 10), mounts (<= 10)
     [{source, destination}], args, model, served_model_names, port, host, task
     (chat|embeddings|scoring), task_from (flags|name), api_key_required,
     settings {tensor_parallel_size, pipeline_parallel_size, max_model_len, dtype,
               quantization, gpu_memory_utilization, kv_cache_dtype, max_num_seqs}}

B{Read-only and secret-free}: a list and an inspect per candidate, nothing else. The
container's environment is never read into the result (C{HF_TOKEN} and the like live
there). The value of every flag whose name holds C{key}, C{token}, C{secret} or
C{password} is C{***} in both forms (C{--api-key X} and C{--api-key=X}), and so is a label
with such a name. Unknown values are left out (the inventory carries no C{null}).

B{Bounded}: at most L{MAX_CONTAINERS} described, L{MAX_LISTED} list rows looked at, a time
budget for the inspects (L{discover_vllm}'s C{budget}), at most L{MAX_ARGS} arguments of at
most L{MAX_ARG_CHARS} characters each and L{MAX_ARGS_TOTAL} in all reported (the values read
are bounded too).

L{discover_vllm} runs on the engine's pool (C{DockerEngine.call}); the rest is pure.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from llmport_agent.workloads.labels import LABEL_MANAGED

__all__ = [
    "MAX_CONTAINERS",
    "describe",
    "discover_vllm",
    "looks_like_vllm",
    "parse_args",
    "redact",
]

MAX_CONTAINERS = 50
MAX_LISTED = 2000
MAX_ARGS = 128
MAX_ARG_CHARS = 512
#: Characters of all reported arguments of one container (50 of them make one inventory row).
MAX_ARGS_TOTAL = 8192
#: Arguments and characters of a command line looked at (before the bounds above).
_MAX_ARGV = 1024
_MAX_ARGV_CHARS = 8192
_MAX_SHELL_CHARS = 32768
_MAX_LABEL_CHARS = 120
_MAX_FIELD_CHARS = 512

_OURS = "llm-port-"
_SECRET = re.compile(r"key|token|secret|password", re.IGNORECASE)
REDACTED = "***"

#: vLLM flags that take no value (a flag not listed here that is followed by a token not
#: starting with C{-} takes it as its value).
_BOOLEAN_FLAGS = frozenset({
    "trust-remote-code", "enforce-eager", "enable-prefix-caching", "no-enable-prefix-caching",
    "enable-chunked-prefill", "no-enable-chunked-prefill", "disable-log-requests",
    "disable-log-stats", "enable-auto-tool-choice", "disable-frontend-multiprocessing",
    "enable-lora", "enable-reasoning", "disable-custom-all-reduce", "async-scheduling",
    "enable-expert-parallel", "enable-sleep-mode", "headless", "enable-log-requests",
    "disable-fastapi-docs", "enable-prompt-tokens-details", "enable-server-load-tracking",
})
_SHORT_FLAGS = {"-tp": "tensor-parallel-size", "-pp": "pipeline-parallel-size",
                "-dp": "data-parallel-size", "-q": "quantization"}
#: C{--task}/C{--runner}/C{--convert} values, in llm-port's words.
_TASKS = {
    "generate": "chat", "chat": "chat",
    "embed": "embeddings", "embedding": "embeddings", "pooling": "embeddings",
    "score": "scoring", "classify": "scoring", "reward": "scoring", "rerank": "scoring",
}
_NAME_TASKS = ((re.compile("rerank", re.IGNORECASE), "scoring"),
               (re.compile("embed", re.IGNORECASE), "embeddings"))
_SETTINGS = {
    "tensor-parallel-size": int, "pipeline-parallel-size": int, "max-model-len": int,
    "dtype": str, "quantization": str, "gpu-memory-utilization": float,
    "kv-cache-dtype": str, "max-num-seqs": int,
}
#: Label namespaces that come with images, not from whoever started the container.
_IMAGE_LABELS = ("com.nvidia.", "org.opencontainers.", "org.label-schema.", "io.buildah.",
                 "maintainer", "com.docker.compose.", "desktop.docker.", "io.llmport.")


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _text(value: Any, limit: int = _MAX_FIELD_CHARS) -> str:
    return value[:limit] if isinstance(value, str) else ""


def _name_of(row: Mapping[str, Any]) -> str:
    names = row.get("Names")
    if isinstance(names, list) and names:
        return _text(names[0]).lstrip("/")
    return _text(row.get("Name")).lstrip("/")


def _labels(obj: Mapping[str, Any]) -> dict[str, Any]:
    labels = obj.get("Labels")
    return labels if isinstance(labels, dict) else {}


def looks_like_vllm(row: Mapping[str, Any]) -> bool:
    """Whether a container list row is worth an inspect: vLLM, and not the agent's own."""
    if _name_of(row).startswith(_OURS) or LABEL_MANAGED in _labels(row):
        return False
    text = f"{_text(row.get('Image'), _MAX_ARGV_CHARS)} {_text(row.get('Command'), _MAX_ARGV_CHARS)}"
    return "vllm" in text.lower()


def _bounded(values: Any) -> list[str]:
    if not isinstance(values, list):
        return [values[:_MAX_ARGV_CHARS]] if isinstance(values, str) else []
    return [str(v)[:_MAX_ARGV_CHARS] for v in values[:_MAX_ARGV]]


def _argv(config: Mapping[str, Any]) -> list[str]:
    """The command line (entrypoint + command), unwrapped from C{sh -c "..."} if vLLM is in it."""
    argv = (_bounded(config.get("Entrypoint")) + _bounded(config.get("Cmd")))[:_MAX_ARGV]
    for i, arg in enumerate(argv[:-1]):
        if arg == "-c" and "vllm" in argv[i + 1]:
            script = argv[i + 1][:_MAX_SHELL_CHARS]
            try:
                return shlex.split(script)[:_MAX_ARGV]
            except ValueError:
                return script.split()[:_MAX_ARGV]
    return argv


def _vllm_args(argv: Sequence[str], image: str) -> list[str] | None:
    """The arguments given to vLLM itself, or C{None} when the command is not vLLM."""
    for i, arg in enumerate(argv):
        if arg.endswith("vllm") and i + 1 < len(argv) and argv[i + 1] == "serve":
            return list(argv[i + 2:])
        if arg.endswith("vllm.entrypoints.openai.api_server"):
            return list(argv[i + 1:])
    # vllm/vllm-openai's entrypoint is the API server: a container that only sets the command
    # passes the flags themselves. Flags or nothing: "sleep infinity" serves no model.
    if "vllm" in image.lower() and any(a.startswith("--") for a in argv):
        return [a for a in argv if a not in ("python", "python3", "-m")]
    return None


def redact(args: Sequence[str]) -> list[str]:
    """C{args} with the value of every secret-looking flag replaced by C{***}."""
    out: list[str] = []
    hide_next = False
    for arg in args:
        if hide_next:
            hide_next = False
            if not arg.startswith("--"):
                out.append(REDACTED)
                continue
        if arg.startswith("-"):
            name, eq, _ = arg.partition("=")
            if _SECRET.search(name):
                if eq:
                    out.append(f"{name}={REDACTED}")
                else:
                    out.append(arg)
                    hide_next = True
                continue
        out.append(arg)
    return out


def _number(kind: type, raw: Any) -> Any:
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        return None
    if isinstance(value, float) and value != value:
        return None
    return value


def parse_args(args: Sequence[str]) -> dict[str, Any]:
    """What a vLLM command line says: model, served names, port, host, task, key settings."""
    flags: dict[str, Any] = {}
    positional: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        nxt = args[i + 1] if i + 1 < len(args) else None
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg[2:].partition("=")
            if eq:
                flags[name] = value
            elif name in _BOOLEAN_FLAGS or nxt is None or nxt.startswith("-"):
                flags[name] = True
            else:
                values = [nxt]
                i += 1
                # --served-model-name takes several names; the first is what clients use.
                while (name == "served-model-name" and i + 1 < len(args)
                       and not args[i + 1].startswith("-") and len(values) < 16):
                    values.append(args[i + 1])
                    i += 1
                flags[name] = values if len(values) > 1 else values[0]
        elif arg in _SHORT_FLAGS and nxt is not None:
            flags[_SHORT_FLAGS[arg]] = nxt
            i += 1
        elif not arg.startswith("-"):
            positional.append(arg)
        i += 1

    out: dict[str, Any] = {}
    model = flags.get("model")
    model = model if isinstance(model, str) and model else (positional[0] if positional else None)
    served = flags.get("served-model-name")
    names = served if isinstance(served, list) else [served] if isinstance(served, str) and served else []
    if model:
        out["model"] = model[:_MAX_FIELD_CHARS]
    out["served_model_names"] = [n[:_MAX_FIELD_CHARS] for n in names] or ([out["model"]] if model else [])
    port = flags.get("port")
    out["port"] = int(port) if isinstance(port, str) and port.isdigit() and 0 < int(port) < 65536 else 8000
    host = flags.get("host")
    if isinstance(host, str) and host:
        out["host"] = host[:_MAX_FIELD_CHARS]
    task_value = next(
        (str(flags[k]).lower() for k in ("task", "convert", "runner") if isinstance(flags.get(k), str)),
        "",
    )
    task = _TASKS.get(task_value)
    if task:
        out["task"], out["task_from"] = task, "flags"
    elif model:
        for pattern, guess in _NAME_TASKS:
            if pattern.search(model):
                out["task"], out["task_from"] = guess, "name"
                break
    # `--api-key ""` asks for none; a key set through the environment is not seen here.
    key = flags.get("api-key")
    out["api_key_required"] = bool(key) and key is not True
    settings: dict[str, Any] = {}
    for flag, kind in _SETTINGS.items():
        raw = flags.get(flag)
        if isinstance(raw, str):
            value = _number(kind, raw) if kind is not str else raw[:64]
            if value is not None:
                settings[flag.replace("-", "_")] = value
    out["settings"] = settings
    return out


def _bounded_args(args: Sequence[str]) -> list[str]:
    """At most L{MAX_ARGS} arguments of L{MAX_ARG_CHARS}, L{MAX_ARGS_TOTAL} characters in all."""
    out: list[str] = []
    total = 0
    for arg in args[:MAX_ARGS]:
        arg = arg[:MAX_ARG_CHARS]
        if total + len(arg) > MAX_ARGS_TOTAL:
            break
        out.append(arg)
        total += len(arg)
    return out


def _host_port(info: Mapping[str, Any], container_port: int) -> int | None:
    host_config = info.get("HostConfig") or {}
    if str(host_config.get("NetworkMode") or "") == "host":
        return container_port
    key = f"{container_port}/tcp"
    live = ((info.get("NetworkSettings") or {}).get("Ports") or {}).get(key) or []
    configured = (host_config.get("PortBindings") or {}).get(key) or []
    # Live bindings first; a stopped container has none: then the ones it was created with.
    for binding in [*live, *configured][:16]:
        value = str((binding or {}).get("HostPort") or "") if isinstance(binding, dict) else ""
        if value.isdigit() and 0 < int(value) < 65536:
            return int(value)
    return None


def _gpus(host_config: Mapping[str, Any]) -> str | None:
    for request in (host_config.get("DeviceRequests") or [])[:8]:
        if not isinstance(request, dict):
            continue
        ids = request.get("DeviceIDs")
        if isinstance(ids, list) and ids:
            return ",".join(str(i)[:64] for i in ids[:16])
        count = request.get("Count")
        if count == -1:
            return "all"
        if isinstance(count, int) and count > 0:
            return str(count)
    return "all" if str(host_config.get("Runtime") or "") == "nvidia" else None


def _owner(labels: Mapping[str, Any]) -> tuple[str | None, dict[str, str]]:
    """Which tool started the container, as its labels say, and its own labels (redacted)."""
    own: dict[str, str] = {}
    for k in sorted(str(k) for k in labels)[:256]:
        if k.startswith(_IMAGE_LABELS):
            continue
        value = labels.get(k)
        own[k[:_MAX_LABEL_CHARS]] = REDACTED if _SECRET.search(k) else str(value)[:_MAX_LABEL_CHARS]
    project = labels.get("com.docker.compose.project")
    if isinstance(project, str) and project:
        return f"compose:{project[:_MAX_LABEL_CHARS]}", own
    if own:
        return next(iter(own)).split(".")[0], own
    return None, own


def describe(info: Mapping[str, Any]) -> dict[str, Any] | None:
    """One inspected container as the backend reads it, or C{None} when it is not vLLM."""
    config = info.get("Config") or {}
    if not isinstance(config, dict):
        return None
    name = _text(info.get("Name")).lstrip("/")
    labels = _labels(config)
    if not name or name.startswith(_OURS) or LABEL_MANAGED in labels:
        return None
    image = _text(config.get("Image")) or _text(info.get("Image"))
    args = _vllm_args(_argv(config), image)
    if args is None:
        return None
    parsed = parse_args(args)
    state = _dict(info.get("State"))
    host_config = _dict(info.get("HostConfig"))
    managed_by, own = _owner(labels)
    out: dict[str, Any] = {
        "name": name,
        "id": _text(info.get("Id"))[:12],
        "image": image,
        "state": _text(state.get("Status"), 32),
        "started_at": _text(state.get("StartedAt"), 64),
        "finished_at": _text(state.get("FinishedAt"), 64),
        "exit_code": state.get("ExitCode") if isinstance(state.get("ExitCode"), int) else None,
        "restart_policy": _text((host_config.get("RestartPolicy") or {}).get("Name"), 32) or None,
        "network_mode": _text(host_config.get("NetworkMode"), 64) or None,
        "host_port": _host_port(info, parsed["port"]),
        "gpus": _gpus(host_config),
        "managed_by": managed_by,
        "labels": dict(list(own.items())[:10]),
        "mounts": [
            {"source": _text(m.get("Source")), "destination": _text(m.get("Destination"))}
            for m in (info.get("Mounts") or [])[:64]
            if isinstance(m, dict) and m.get("Source") and m.get("Destination")
        ][:10],
        "args": _bounded_args(redact(args)),
        **parsed,
    }
    return {k: v for k, v in out.items() if v is not None and v != ""}


def discover_vllm(
    client: Any,
    *,
    limit: int = MAX_CONTAINERS,
    budget: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
) -> list[dict[str, Any]]:
    """
    Every vLLM container of the engine that llm-port did not start (blocking: on the engine
    pool). Stops inspecting after C{budget} seconds or C{limit} containers; a container that
    vanished between the list and its inspect is skipped.
    """
    from docker.errors import NotFound

    api = client.api
    rows = api.containers(all=True)
    deadline = clock() + budget
    found: list[dict[str, Any]] = []
    for row in rows[:MAX_LISTED] if isinstance(rows, list) else []:
        if not isinstance(row, dict) or not looks_like_vllm(row):
            continue
        if clock() > deadline:
            break
        try:
            info = api.inspect_container(str(row.get("Id") or ""))
        except NotFound:
            continue
        described = describe(info) if isinstance(info, dict) else None
        if described is not None:
            found.append(described)
            if len(found) >= limit:
                break
    return found
