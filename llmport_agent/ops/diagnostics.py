"""The C{collect_diagnostics} result: structured, secrets masked."""

from __future__ import annotations

import os
import platform
import sys
import time
from typing import TYPE_CHECKING, Any

from llmport_agent import VERSION

if TYPE_CHECKING:
    from llmport_agent.agent.service import AgentService

START_TIME = time.time()


async def diagnostics(agent: AgentService) -> dict[str, Any]:
    """The C{collect_diagnostics} result: structured, secrets masked."""
    import attrs
    import autobahn
    import treq

    import twisted

    gpu: dict[str, Any] = {}
    try:
        report = await agent.collector.collect()
        g = report.inventory.get("gpu", {})
        gpu = {
            "count": g.get("count", 0),
            "vendor": report.inventory.get("static_capabilities", {}).get("gpu_vendor", "none"),
            "total_vram_bytes": g.get("total_vram_bytes", 0),
            "free_vram_bytes": g.get("free_vram_bytes", 0),
            "gpu_error": g.get("gpu_error", ""),
            "devices": [
                {k: d.get(k) for k in ("index", "uuid", "name", "memory_total_mib", "utilization_pct",
                                       "temperature_c", "health", "health_reasons")}
                for d in g.get("devices", [])
            ],
            "health": agent.gpu_monitor.metrics(),
        }
    except Exception as e:
        gpu = {"error": f"{type(e).__name__}: {e}"}
    out: dict[str, Any] = {
        "agent": {
            "version": VERSION,
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "pid": os.getpid(),
            "uptime_sec": round(time.time() - START_TIME, 1),
            "libraries": {
                "twisted": twisted.__version__,
                "autobahn": autobahn.__version__,
                "treq": getattr(treq, "__version__", ""),
                "attrs": attrs.__version__,
            },
        },
        "config": agent.config.masked(),
        "node": {
            "node_id": agent.session.node_id or "",
            "agent_id": agent.config.agent_id,
            "maintenance": agent.modes.maintenance,
            "draining": agent.modes.draining,
            "profile": (agent.modes.profile or {}).get("name", ""),
            "status": agent._heartbeat_fields()["status"],
        },
        "session": {
            "connected": agent.session.connected,
            "session_id": agent.session.session_id or "",
            "consecutive_failures": agent.session.failures.failures,
            **agent.session.stats.as_dict(),
            "dispatch": agent.session.dispatch.describe(),
        },
        "commands": agent.pipeline.describe(),
        "events": {"outbox_depth": agent.outbox.depth, "dropped": agent.outbox.dropped, "sent": agent.outbox.sent},
        "logs": (
            {**agent.log_shipping.describe(),
             "source": "LOKI_URL" if agent.config.loki_url else "backend",
             "host_journal": "off (not shipped to this sink; LOG_JOURNAL_UNITS names units to ship)"
             if agent.log_shipping.journald is None else "on"}
            if agent.log_shipping is not None
            else {"shipping": "off"} if agent.log_sink is None
            else {"shipping": "off (LOKI_URL unset; waiting for the backend's log sink)",
                  "log_sink": agent.log_sink.describe()}
        ),
        "reports": {"heartbeats_sent": agent.heartbeat.sent, "inventories_sent": agent.inventory.sent,
                    "inventory_error": agent.inventory.last_error},
        "gpu": gpu,
        "recent_errors": list(agent.recent_errors[-20:]),
    }
    if agent.engine is not None:
        try:
            from llmport_agent.workloads.diagnostics import engine_diagnostics

            out["engine"] = await engine_diagnostics(
                agent.engine, agent.config.agent_id,
                agent.health.states() if hasattr(agent.health, "states") else None,
                agent.adoption.snapshot() if getattr(agent, "adoption", None) is not None else None,
            )
        except Exception as e:
            out["engine"] = {"error": f"{type(e).__name__}: {e}"}
    return out
