"""
What the ops endpoint's C{/readyz} answers: one check per subsystem (session, engine, NVML,
Loki), read from the running services. Plain functions of the agent; no web server here.
"""

from __future__ import annotations

from typing import Any

from llmport_agent import VERSION


def _engine_problem(error: str) -> str:
    """The engine's own error names it ("Docker engine at ... is unreachable: ..."): said once."""
    return error if error.startswith("Docker engine") else f"Docker engine unreachable: {error}"


def readiness(agent: Any) -> dict[str, Any]:
    """
    What C{/readyz} answers: one check per subsystem (session, engine, NVML, Loki), each with
    C{ok} and a C{detail} saying what is wrong; C{ready} when all are ok and no stop is under way.
    """
    from llmport_agent.ops.readers import gpu_snapshot, session_state, workload_states

    session = agent.session
    state = session_state(session)
    checks: dict[str, dict[str, Any]] = {
        "session": {
            "ok": bool(session.connected),
            "state": state,
            "detail": "connected to the backend" if session.connected
            else (session.stats.last_error or state.replace("_", " ")),
        }
    }
    dispatch = getattr(session, "dispatch", None)
    if dispatch is not None:
        checks["session"]["dispatch_mode"] = dispatch.mode
    engine = getattr(agent, "engine", None)
    if engine is None:
        checks["engine"] = {"ok": True, "detail": "Docker executor off"}
    else:
        checks["engine"] = {
            "ok": bool(engine.available),
            "detail": f"Docker engine {engine.version} at {engine.address}" if engine.available
            else _engine_problem(engine.last_error),
        }
    checks["nvml"] = gpu_readiness(gpu_snapshot(agent))
    checks["loki"] = loki_readiness(agent)
    stopping = bool(getattr(agent, "stopping", False))
    ready = all(c["ok"] for c in checks.values()) and not stopping
    heartbeat = getattr(agent, "heartbeat", None)
    return {
        "ready": ready,
        "status": "stopping" if stopping else ("ready" if ready else "not_ready"),
        "checks": checks,
        "agent": {
            "version": VERSION,
            "node_id": session.node_id or "",
            "agent_id": agent.config.agent_id,
            "last_heartbeat_at": getattr(heartbeat, "last_sent_at", None),
            "workloads": len(workload_states(agent)),
            "commands_running": agent.pipeline.running_count,
            "heartbeat_status": agent.status.heartbeat_fields()["status"],
        },
    }


def loki_readiness(agent: Any) -> dict[str, Any]:
    """
    The C{loki} check of C{/readyz}: where logs go and whether pushes succeed. C{source} is
    C{LOKI_URL} (the operator's sink), C{backend} (the sink the backend named, LOKI_URL unset) or
    C{off}; C{url} is the sink without its password. Not ok after 3 failed pushes in a row,
    to either sink.
    """
    from llmport_agent.core.config import mask_url
    from llmport_agent.ops.readers import loki_stats

    loki = loki_stats(agent)
    config = getattr(agent, "config", None)
    operator = bool(getattr(config, "loki_url", None))
    sink = getattr(agent, "log_sink", None)
    if loki is None:
        if sink is None or operator:
            return {"ok": True, "source": "off", "detail": "log shipping off"}
        last = str(getattr(sink, "last", "") or "not asked yet")
        return {"ok": True, "source": "off",
                "detail": f"log shipping off: LOKI_URL unset and the backend named no log sink ({last})"}
    source = "LOKI_URL" if operator else "backend"
    url = str(loki.get("url", "") or "")
    if not operator and sink is not None and getattr(sink, "url", None):
        url = mask_url(str(sink.url))
    where = f"{url} (LOKI_URL)" if operator else f"the backend's log sink {url} (LOKI_URL unset)"
    failures = int(loki.get("consecutive_failures", 0) or 0)
    return {
        "ok": failures < 3,
        "source": source,
        "url": url,
        "detail": f"{failures} failed pushes in a row to {where}: {loki.get('last_error', '')}" if failures
        else f"pushing to {where}",
        "queue_depth": loki.get("queue_depth", 0),
    }


def gpu_readiness(snap: Any) -> dict[str, Any]:
    """
    The C{nvml} check of C{/readyz}: whether the GPU driver answers, not whether the GPUs
    are good. Not ok when a GPU host's source fails (NVML broke) or when every GPU's driver
    calls hang (NVML is not answering at all). A GPU the driver I{reports} bad (an Xid 79,
    uncorrectable ECC, a reset required) is a hardware verdict, not an unready agent: the
    check stays ok and names it, while the heartbeat turns C{degraded} and the GPU leaves
    C{gpu_count} (restarting the agent would not mend the GPU). A host without GPUs (no
    driver) is not unready either.
    """
    if snap is None:
        return {"ok": True, "detail": "not read yet", "gpus": 0}
    error = str(snap.gpu_error or "")
    seen = snap.vendor != "none"
    devices = tuple(snap.devices)
    every_gpu_hangs = bool(devices) and all(d.health is not None and d.health.unresponsive for d in devices)
    if error:
        detail = error
    else:
        detail = f"{snap.device_count} GPU(s), {snap.count} schedulable"
        for d in [d for d in devices if d.state != "healthy"][:8]:
            detail += f"; {d.describe()} {d.state}: {'; '.join(d.health.reasons if d.health else ())[:200]}"
        if every_gpu_hangs:
            detail = "every GPU's driver calls hang (NVML is not answering): " + detail
    return {
        "ok": not (error and seen) and not every_gpu_hangs,
        "detail": detail[:2000],
        "gpus": snap.device_count,
        "schedulable": snap.count,
        "health": snap.by_state(),
    }
