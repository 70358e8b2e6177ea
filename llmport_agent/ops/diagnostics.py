"""The C{collect_diagnostics} result: structured, secrets masked (L{Diagnostics})."""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

from llmport_agent import VERSION
from llmport_agent.core.values import frozen

START_TIME = time.time()


@frozen(eq=False, repr=False)  # a component: identity, not value
class Diagnostics:
    """
    What C{collect_diagnostics} answers, read from the parts that know it.

    @ivar config: the agent's settings (masked in the result).
    @ivar session: the backend session.
    @ivar modes: maintenance and draining modes, the profile.
    @ivar collector: the inventory collector (a fresh report is taken).
    @ivar gpu_monitor: GPU health (C{metrics()}).
    @ivar pipeline: the command pipeline (C{describe()}).
    @ivar outbox: the event outbox.
    @ivar heartbeat: the heartbeat reporter (C{sent}).
    @ivar inventory: the inventory reporter (C{sent}, C{last_error}).
    @ivar heartbeat_fields: the heartbeat's status fields (L{NodeStatus.heartbeat_fields}).
    @ivar log_shipping: the log shipping now (it may start later, at the backend's sink), or C{None}.
    @ivar log_sink: the backend log sink discovery, or C{None} with a configured LOKI_URL.
    @ivar recent_errors: the agent's recent errors (the last 20 are shown).
    @ivar engine: the Docker engine, or C{None} without the Docker executor.
    @ivar health: the workload health watcher, or C{None}.
    @ivar adoption: the adoption of the original agent's workloads, or C{None}.
    """

    config: Any
    session: Any
    modes: Any
    collector: Any
    gpu_monitor: Any
    pipeline: Any
    outbox: Any
    heartbeat: Any
    inventory: Any
    heartbeat_fields: Callable[[], dict[str, Any]]
    log_shipping: Callable[[], Any]
    log_sink: Any
    recent_errors: list[dict[str, Any]]
    engine: Any
    health: Any
    adoption: Any

    async def collect(self) -> dict[str, Any]:
        """The C{collect_diagnostics} result: structured, secrets masked."""
        import attrs
        import autobahn
        import treq

        import twisted

        shipping = self.log_shipping()
        gpu: dict[str, Any] = {}
        try:
            report = await self.collector.collect()
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
                "health": self.gpu_monitor.metrics(),
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
            "config": self.config.masked(),
            "node": {
                "node_id": self.session.node_id or "",
                "agent_id": self.config.agent_id,
                "maintenance": self.modes.maintenance,
                "draining": self.modes.draining,
                "profile": (self.modes.profile or {}).get("name", ""),
                "status": self.heartbeat_fields()["status"],
            },
            "session": {
                "connected": self.session.connected,
                "session_id": self.session.session_id or "",
                "consecutive_failures": self.session.failures.failures,
                **self.session.stats.as_dict(),
                "dispatch": self.session.dispatch.describe(),
            },
            "commands": self.pipeline.describe(),
            "events": {"outbox_depth": self.outbox.depth, "dropped": self.outbox.dropped, "sent": self.outbox.sent},
            "logs": (
                {**shipping.describe(),
                 "source": "LOKI_URL" if self.config.loki_url else "backend",
                 "host_journal": "off (not shipped to this sink; LOG_JOURNAL_UNITS names units to ship)"
                 if shipping.journald is None else "on"}
                if shipping is not None
                else {"shipping": "off"} if self.log_sink is None
                else {"shipping": "off (LOKI_URL unset; waiting for the backend's log sink)",
                      "log_sink": self.log_sink.describe()}
            ),
            "reports": {"heartbeats_sent": self.heartbeat.sent, "inventories_sent": self.inventory.sent,
                        "inventory_error": self.inventory.last_error},
            "gpu": gpu,
            "recent_errors": list(self.recent_errors[-20:]),
        }
        if self.engine is not None:
            try:
                from llmport_agent.workloads.diagnostics import engine_diagnostics

                out["engine"] = await engine_diagnostics(
                    self.engine, self.config.agent_id,
                    self.health.states() if hasattr(self.health, "states") else None,
                    self.adoption.snapshot() if self.adoption is not None else None,
                )
            except Exception as e:
                out["engine"] = {"error": f"{type(e).__name__}: {e}"}
        return out
