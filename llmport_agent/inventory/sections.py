# -*- test-case-name: tests.test_inventory_vllm -*-
"""
The inventory sections of protocol 10.5 as the root service wires them into the
L{InventoryCollector}: C{network} (sysfs and psutil, on the host pool), C{vllm_containers}
and C{ray_runtime} (on the Docker engine's pool, through C{DockerEngine.call}, whose client
has a socket timeout; the collector cuts each section off after its own deadline too).

While the engine is not available the engine sections are left out of the report without a
call (the heartbeat already says the engine is down). Each reader's module is imported at
its first read (the first inventory, after the connect), not when the agent is built.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from llmport_agent.core.threads import BlockingRunner

__all__ = ["inventory_sections"]


def inventory_sections(
    runner: BlockingRunner, engine: Any = None, *, agent_id: str = "", sysfs_root: str = "/"
) -> dict[str, Callable[[], Awaitable[Any]]]:
    """C{{inventory key: async reader}} for L{InventoryCollector}'s C{sections}."""

    async def network() -> Any:
        from llmport_agent.inventory.network import read_network

        return await runner.run(read_network, sysfs_root)

    sections: dict[str, Callable[[], Awaitable[Any]]] = {"network": network}
    if engine is None:
        return sections

    async def vllm_containers() -> Any:
        if not engine.available:
            return None
        from llmport_agent.inventory.vllm import discover_vllm

        return await engine.call(discover_vllm, what="listing vLLM containers")

    async def ray_runtime() -> Any:
        if not engine.available:
            return None
        from llmport_agent.inventory.rayruntime import inspect_ray_runtime

        return await engine.call(inspect_ray_runtime, agent_id, what="inspecting the Ray runtime container")

    sections["vllm_containers"] = vllm_containers
    sections["ray_runtime"] = ray_runtime
    return sections
