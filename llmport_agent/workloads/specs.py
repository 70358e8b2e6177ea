"""
The workload commands' table (lanes, deadlines, what blocks them), apart from their handlers
(L{llmport_agent.workloads.handlers}), so the agent lists them at start and imports the
handlers at the first workload command (issue 27).
"""

from __future__ import annotations

from typing import Any

from ..commands.base import HandlerSpec
from .settings import WorkloadSettings

__all__ = ["STOP_EXTRA_SEC", "workload_handler_specs"]

#: The stop and remove deadlines: three stop grace periods and this much more.
STOP_EXTRA_SEC = 60.0


def workload_handler_specs(manager: Any, settings: WorkloadSettings | None = None) -> dict[str, HandlerSpec]:
    """
    The workload command types, for the command pipeline's registry: C{manager} is a
    L{llmport_agent.workloads.handlers.WorkloadManager}, or anything with its methods (the
    agent passes L{llmport_agent.core.later.Later.calls}, with C{settings}, so the
    manager is built at the first workload command).
    """
    if settings is None:
        settings = manager.settings
    deadline = settings.deploy_deadline_sec
    stop_deadline = settings.stop_grace_sec * 3 + STOP_EXTRA_SEC
    return {
        "deploy_workload": HandlerSpec(
            manager.deploy, "runtime", True, deadline, blocked_by_maintenance=True, blocked_by_draining=True
        ),
        "start_workload": HandlerSpec(
            manager.start, "runtime", True, deadline, blocked_by_maintenance=True, blocked_by_draining=True
        ),
        "restart_workload": HandlerSpec(
            manager.restart, "runtime", True, deadline, blocked_by_maintenance=True, blocked_by_draining=True
        ),
        "update_workload": HandlerSpec(
            manager.update, "runtime", False, deadline, blocked_by_maintenance=True, blocked_by_draining=False
        ),
        "stop_workload": HandlerSpec(manager.stop, "runtime", True, stop_deadline,
                                     on_arrival=manager.superseding),
        "remove_workload": HandlerSpec(manager.remove, "runtime", True, stop_deadline,
                                       on_arrival=manager.superseding),
        "fetch_container_logs": HandlerSpec(manager.logs, "read", True, 10.0, keep_result=False),
    }
