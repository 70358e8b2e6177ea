"""
Small, tolerant readers of the running agent's state (GPU snapshot, health view, Loki, workload
states, session phase), shared by the metrics collector, the ops endpoint's readiness and the
status line. Nothing heavy is imported here: the status line reads them at idle without
prometheus_client.
"""

from __future__ import annotations

from typing import Any


def gpu_snapshot(agent: Any) -> Any:
    """The last GPU snapshot the inventory collector took (no NVML call at scrape time)."""
    collector = getattr(agent, "collector", None)
    last = getattr(collector, "last_gpu", None)
    return last() if callable(last) else last


def gpu_health_view(agent: Any) -> dict[str, Any] | None:
    """The GPU health monitor's view (L{GPUHealthMonitor.metrics}), or C{None} without one."""
    monitor = getattr(agent, "gpu_monitor", None)
    if monitor is None:
        return None
    try:
        return dict(monitor.metrics())
    except Exception:
        return None


def loki_stats(agent: Any) -> dict[str, Any] | None:
    loki = getattr(agent, "loki", None)
    if loki is None:
        return None
    try:
        return dict(loki.describe())
    except Exception:
        return None


def workload_states(agent: Any) -> dict[str, dict[str, Any]]:
    health = getattr(agent, "health", None)
    states = getattr(health, "states", None)
    if not callable(states):
        return {}
    try:
        return dict(states())
    except Exception:
        return {}


def session_state(session: Any) -> str:
    phase = getattr(session, "phase", None)
    return phase if isinstance(phase, str) else ("connected" if session.connected else "connecting")
