"""
What the node says about itself: the heartbeat's status fields (protocol 3.2) and the one
line systemd shows (C{STATUS=}).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmport_agent import VERSION

if TYPE_CHECKING:
    from llmport_agent.agent.service import AgentService


def heartbeat_fields(agent: AgentService) -> dict[str, Any]:
    # Degraded once the engine was found unreachable (before its first probe the engine is
    # unknown, not down: a false "degraded" halves the node's score) or a GPU is not healthy.
    engine_down = agent.engine is not None and agent.engine.checked and not agent.engine.available
    reasons = agent.gpu_monitor.status_reasons()
    status = "draining" if agent.stopping else agent.modes.status(degraded=engine_down or bool(reasons))
    fields = {
        "status": status,
        "version": VERSION,
        "capabilities": agent.collector.last_capabilities(),
        "advertise_host": agent.config.advertise_host,
    }
    if engine_down:
        reasons.insert(0, "the container engine is unreachable")
    if reasons and fields["status"] == "degraded":
        # Extra key (protocol 3.2 ignores it): why the node is degraded, for people.
        fields["status_reason"] = "; ".join(reasons)[:1000]
    return fields


def status_line(agent: AgentService) -> str:
    """The one line systemd shows (C{STATUS=}): session state, node, workloads, last error."""
    from llmport_agent.ops.metrics import session_state, workload_states

    state = session_state(agent.session)
    words = {"connected": "connected", "enrolling": "enrolling", "backing_off": "backing off",
             "refused": "credential refused", "connecting": "connecting", "stopped": "stopped"}
    parts = [words.get(state, state)]
    if agent.stopping:
        parts.insert(0, "draining")
    parts.append(f"node {agent.session.node_id or '-'}")
    if agent.health is not None:
        parts.append(f"{len(workload_states(agent))} workloads")
    running = len(agent.pipeline._running)
    if running:
        parts.append(f"{running} commands running")
    error = agent.session.stats.last_error if state != "connected" else ""
    if error:
        parts.append(f"last error: {error}")
    from llmport_agent.logs.redact import redact

    return redact(", ".join(parts), agent._secrets())
