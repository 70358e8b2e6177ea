"""
The stand-in backend's runtime API: providers and runtimes, and the command payloads the real
backend builds from them for deploy, start, restart, update, stop, remove and logs
(protocol 4, 4.1), quirks included (protocol 9):

 - C{ipc_mode}: C{"host"} for C{vllm} and C{tgi} whenever C{gpu_request} is a non-empty
   string, C{"none"} and C{"0"} included (so a CPU-only vLLM runtime created in the UI arrives
   with C{gpu_request: "none"}, C{ipc_mode: "host"}); C{shm_size} C{"1g"} under the same
   condition;
 - C{image_source}: only C{deploy_workload} can carry C{null}; start, restart and update send
   the provider's C{image_source} or, when it has none, C{"pull_from_registry"}, even for an
   image that exists only on the node;
 - C{model_sync} on start may be C{{}}; C{placement_hints} on deploy and update.

Pure data: no networking (L{DevBackend} issues the commands).
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from attrs import field, fields

from llmport_agent.core.values import define

#: Runtime actions and the command type each issues.
ACTIONS: dict[str, str] = {
    "deploy": "deploy_workload",
    "start": "start_workload",
    "restart": "restart_workload",
    "update": "update_workload",
    "stop": "stop_workload",
    "remove": "remove_workload",
    "logs": "fetch_container_logs",
}

#: Providers the backend defaults to every GPU on (protocol 4.1).
_GPU_BY_DEFAULT = ("vllm", "tgi")
_HOST_IPC_TYPES = ("vllm", "tgi")
_STRING_KNOBS = ("gpu_request", "ipc_mode", "shm_size", "memory_limit", "cpu_limit", "container_port")


@define
class Provider:
    """
    A provider as the backend stores it (the parts that reach a payload).

    @ivar gpu_request: C{None} means "not set" (the backend's default: C{all} for vllm and
        tgi, C{""} otherwise); the UI's CPU-only choice is C{"none"}.
    @ivar image_source: C{None} (use the local image), C{pull_from_registry} or
        C{transfer_from_server}.
    @ivar extra: further C{provider_config} keys, passed as they are.
    """

    type: str
    id: str = field(factory=lambda: str(uuid.uuid4()))
    image: str | None = None
    image_source: str | None = None
    gpu_request: str | None = None
    ipc_mode: str | None = None
    shm_size: str | None = None
    memory_limit: str | None = None
    cpu_limit: str | None = None
    container_port: str | None = None
    host_port: int | None = None
    engine_args: dict[str, Any] = field(factory=dict)
    command: Any = None
    extra_args: list[str] = field(factory=list)
    model: str | None = None
    tool_call_parser: str | None = None
    model_source: str | None = None
    extra: dict[str, Any] = field(factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Provider:
        """From a JSON object (unknown keys go to C{extra})."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known and k != "extra"}
        extra = dict(data.get("extra") or {})
        extra.update({k: v for k, v in data.items() if k not in known})
        if "type" not in values and "provider_type" in extra:
            values["type"] = extra.pop("provider_type")
        return cls(**values, extra=extra)

    def changed(self, changes: dict[str, Any]) -> None:
        """Apply an edit (the runtime edit form)."""
        known = {f.name for f in fields(type(self))}
        for key, value in changes.items():
            if key in known and key not in ("id", "extra"):
                setattr(self, key, value)
            else:
                self.extra[key] = value


@define
class Runtime:
    """A runtime as the backend stores it."""

    id: str
    name: str
    node_id: str
    provider: Provider
    model_id: str = "model"
    generic_config: dict[str, Any] = field(factory=dict)
    model_sync: dict[str, Any] | None = None
    container_name: str | None = None
    openai_compat: bool = True
    placement_hints: dict[str, Any] = field(factory=dict)


def _knobs(provider: Provider) -> dict[str, str]:
    """The top-level string knobs, defaults and the ipc/shm quirk applied (protocol 4.1, 9)."""
    gpu = provider.gpu_request
    if gpu is None:
        gpu = "all" if provider.type in _GPU_BY_DEFAULT else ""
    values = {
        "gpu_request": gpu,
        "ipc_mode": provider.ipc_mode or "",
        "shm_size": provider.shm_size or "",
        "memory_limit": provider.memory_limit or "",
        "cpu_limit": provider.cpu_limit or "",
        "container_port": provider.container_port or "",
    }
    if gpu:  # any non-empty string: "none" and "0" count as "with a GPU" here
        values["shm_size"] = values["shm_size"] or "1g"
        if provider.type in _HOST_IPC_TYPES:
            values["ipc_mode"] = values["ipc_mode"] or "host"
    return values


def image_source_for(command_type: str, provider: Provider) -> str | None:
    """Only deploy may carry C{None}; the others fall back to C{pull_from_registry}."""
    if command_type == "deploy_workload":
        return provider.image_source
    return provider.image_source or "pull_from_registry"


def build_payload(command_type: str, runtime: Runtime, *, tail: int = 300) -> dict[str, Any]:
    """The payload the real backend builds for C{command_type} on C{runtime}."""
    if command_type in ("stop_workload", "remove_workload"):
        return {
            "runtime_id": runtime.id,
            "runtime_name": runtime.name,
            "container_name": runtime.container_name or "",
        }
    if command_type == "fetch_container_logs":
        return {"runtime_id": runtime.id, "runtime_name": runtime.name, "tail": tail}
    p = runtime.provider
    knobs = _knobs(p)
    source = image_source_for(command_type, p)
    provider_config: dict[str, Any] = {
        "image": p.image or "",
        "engine_args": copy.deepcopy(p.engine_args),
        **knobs,
        "host_port": p.host_port,
        "command": copy.deepcopy(p.command),
        "extra_args": list(p.extra_args),
        "model": p.model,
        "tool_call_parser": p.tool_call_parser,
        "model_source": p.model_source,
        "image_source": p.image_source,
        **copy.deepcopy(p.extra),
    }
    model_sync = copy.deepcopy(runtime.model_sync)
    if command_type == "start_workload" and model_sync is None:
        model_sync = {}
    payload: dict[str, Any] = {
        "runtime_id": runtime.id,
        "runtime_name": runtime.name,
        "container_name": runtime.container_name or "",
        "provider_id": p.id,
        "provider_type": p.type,
        "model_id": runtime.model_id,
        "generic_config": copy.deepcopy(runtime.generic_config),
        "provider_config": provider_config,
        "openai_compat": runtime.openai_compat,
        "model_sync": model_sync,
        "image_source": source,
        **knobs,
    }
    if command_type in ("deploy_workload", "update_workload"):
        payload["placement_hints"] = copy.deepcopy(runtime.placement_hints) or {
            "node_id": runtime.node_id
        }
    return payload
