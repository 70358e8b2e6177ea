"""
The Ray commands' table (lanes, deadlines, what blocks them), apart from their handlers
(L{llmport_agent.ray.handlers}, L{llmport_agent.ray.seeding}), so the agent lists them at start
and imports the handlers at the first Ray command (issue 27).
"""

from __future__ import annotations

from typing import Any

from ..commands.base import CommandContext, HandlerSpec

__all__ = ["MAX_TIMEOUT_SEC", "no_ray_status_spec", "ray_handler_specs", "seeding_handler_specs"]

#: The largest C{timeout_sec} a C{serve_runtime_image} may ask for (its deadline adds 30 minutes).
MAX_TIMEOUT_SEC = 6 * 3600.0


def ray_handler_specs(manager: Any) -> dict[str, HandlerSpec]:
    """
    The Ray command types, for the command pipeline's registry: C{manager} is a
    L{llmport_agent.ray.handlers.RayManager} or anything with its methods (the agent passes
    L{llmport_agent.core.later.Later.calls}: the manager is built at the first Ray command).
    """
    m = manager
    return {
        "ensure_runtime_image": HandlerSpec(m.ensure_runtime_image, "runtime", True, 1800.0, blocked_by_maintenance=True),
        "ensure_ray_runtime": HandlerSpec(m.ensure_ray_runtime, "runtime", True, 1800.0, blocked_by_maintenance=True),
        "start_ray_head": HandlerSpec(m.start_ray_head, "runtime", True, 600.0, blocked_by_maintenance=True, blocked_by_draining=True),
        "join_ray_cluster": HandlerSpec(m.join_ray_cluster, "runtime", True, 600.0, blocked_by_maintenance=True, blocked_by_draining=True),
        "leave_ray_cluster": HandlerSpec(m.leave_ray_cluster, "runtime", True, 300.0),
        "stop_ray": HandlerSpec(m.stop_ray, "runtime", True, 300.0),
        "get_ray_status": HandlerSpec(m.get_ray_status, "read", True, 120.0, keep_result=False),
        "get_ray_serve_status": HandlerSpec(m.get_ray_serve_status, "read", True, 120.0, keep_result=False),
        "run_serve_app": HandlerSpec(m.run_serve_app, "runtime", True, 600.0, blocked_by_maintenance=True, blocked_by_draining=True),
        "delete_serve_app": HandlerSpec(m.delete_serve_app, "runtime", True, 300.0),
        "describe_ray_cluster": HandlerSpec(m.describe_ray_cluster, "read", True, 120.0, keep_result=False),
    }


def no_ray_status_spec() -> HandlerSpec:
    """C{get_ray_status} on an agent without the Docker executor: no Ray, C{alive: false}."""

    async def status(ctx: CommandContext) -> dict[str, Any]:
        from . import helpercli

        return helpercli.dead_cluster(detail="this agent runs without the Docker executor: no Ray runtime here")

    return HandlerSpec(status, "read", True, 10.0, keep_result=False)


def seeding_handler_specs(seeding: Any) -> dict[str, HandlerSpec]:
    """C{serve_runtime_image} (L{llmport_agent.ray.seeding.ImageSeeding}, or L{llmport_agent.core.later.Later.calls})."""
    return {
        # Not idempotent: the token is scrubbed from the journal, so a restart cannot resume it.
        "serve_runtime_image": HandlerSpec(seeding.serve_runtime_image, "runtime", False, MAX_TIMEOUT_SEC + 1800.0),
    }
