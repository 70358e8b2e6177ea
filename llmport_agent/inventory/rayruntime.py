# -*- test-case-name: tests.test_inventory_vllm -*-
"""
The node's Ray runtime container as the inventory reports it (protocol 10.5,
C{inventory.ray_runtime}): C{{container, running, started_at, image, image_id}}, or nothing.

The container is the one named L{RAY_RUNTIME_CONTAINER} that carries the agent's label
(C{io.llmport.managed=llmport-agent}, how the agent marks every container it owns). A container
of that name without the label is not the agent's: it is not reported (the backend would
otherwise drive a cluster on a container the agent will not touch).

L{inspect_ray_runtime} runs on the engine's pool (C{DockerEngine.call}).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmport_agent.workloads.spec import LABEL_MANAGED, MANAGED_VALUE

__all__ = ["RAY_RUNTIME_CONTAINER", "describe_ray_runtime", "inspect_ray_runtime"]

RAY_RUNTIME_CONTAINER = "llm-port-ray-runtime"


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _text(value: Any, limit: int = 256) -> str:
    return value[:limit] if isinstance(value, str) else ""


def describe_ray_runtime(info: Mapping[str, Any]) -> dict[str, Any] | None:
    """The C{ray_runtime} object from an inspect answer, or C{None} when it is not the agent's."""
    config = _dict(info.get("Config"))
    labels = _dict(config.get("Labels"))
    if labels.get(LABEL_MANAGED) != MANAGED_VALUE:
        return None
    state = _dict(info.get("State"))
    out: dict[str, Any] = {
        "container": _text(info.get("Name")).lstrip("/") or RAY_RUNTIME_CONTAINER,
        "running": state.get("Running") is True,
        "state": _text(state.get("Status"), 32),
        "started_at": _text(state.get("StartedAt"), 64),
        "image": _text(config.get("Image")),
        "image_id": _text(info.get("Image"), 128),
    }
    return {k: v for k, v in out.items() if v != ""}


def inspect_ray_runtime(client: Any, name: str = RAY_RUNTIME_CONTAINER) -> dict[str, Any] | None:
    """Blocking: inspect the runtime container; C{None} when there is none (or not the agent's)."""
    from docker.errors import NotFound

    try:
        info = client.api.inspect_container(name)
    except NotFound:
        return None
    return describe_ray_runtime(info) if isinstance(info, dict) else None
