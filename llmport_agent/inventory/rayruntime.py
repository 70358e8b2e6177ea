# -*- test-case-name: tests.test_inventory_vllm -*-
"""
The node's Ray runtime container as the inventory reports it (protocol 10.5,
C{inventory.ray_runtime}): C{{container, running, state, started_at, image, image_id}}, or
nothing.

The container is the one named L{RAY_RUNTIME_CONTAINER} that carries this agent's Ray labels
(L{llmport_agent.ray.container.is_ours}: C{io.llmport.ray-runtime} and the agent id), the
way the agent marks the runtime container it creates. A container of that name without them
is someone else's and is not reported (the backend would otherwise drive a cluster on a
container the agent will not touch).

L{inspect_ray_runtime} runs on the engine's pool (C{DockerEngine.call}). The Ray container
module is imported at the first container to describe (not by an idle node without one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["RAY_RUNTIME_CONTAINER", "describe_ray_runtime", "inspect_ray_runtime"]

RAY_RUNTIME_CONTAINER = "llm-port-ray-runtime"


def _text(value: Any, limit: int = 256) -> str:
    return value[:limit] if isinstance(value, str) else ""


def describe_ray_runtime(snap: Mapping[str, Any], agent_id: str) -> dict[str, Any] | None:
    """
    The C{ray_runtime} object from the container's snapshot
    (L{llmport_agent.ray.container.snapshot}), or C{None} when it is not this agent's.
    """
    from llmport_agent.ray.container import is_ours

    if not is_ours(dict(snap), agent_id):
        return None
    out: dict[str, Any] = {
        "container": _text(snap.get("name")) or RAY_RUNTIME_CONTAINER,
        "running": snap.get("running") is True,
        "state": _text(snap.get("status"), 32),
        "started_at": _text(snap.get("started_at"), 64),
        "image": _text(snap.get("image")),
        "image_id": _text(snap.get("image_id"), 128),
    }
    return {k: v for k, v in out.items() if v != ""}


def inspect_ray_runtime(client: Any, agent_id: str, name: str = RAY_RUNTIME_CONTAINER) -> dict[str, Any] | None:
    """Blocking: the runtime container's object; C{None} when there is none (or not this agent's)."""
    from llmport_agent.ray.container import find

    snap = find(client, name)
    return None if snap is None else describe_ray_runtime(snap, agent_id)
