"""
What the node says about itself: the heartbeat's status fields (protocol 3.2) and the one
line systemd shows (C{STATUS=}), from L{NodeStatus}'s inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmport_agent import VERSION
from llmport_agent.core.values import frozen


@frozen(eq=False, repr=False)  # a component: identity, not value
class NodeStatus:
    """
    The node's status, read from the parts that know it.

    @ivar config: the agent's settings (C{advertise_host}).
    @ivar session: the backend session (C{phase}, C{node_id}, C{stats.last_error}).
    @ivar modes: maintenance and draining modes (C{status(degraded=...)}).
    @ivar collector: the inventory collector (C{last_capabilities()}).
    @ivar gpu_monitor: GPU health (C{status_reasons()}).
    @ivar pipeline: the command pipeline (C{running_count}).
    @ivar engine: the Docker engine, or C{None} without the Docker executor.
    @ivar health: the workload health watcher, or C{None}.
    @ivar stopping: whether the agent is stopping (heartbeats say C{draining}).
    @ivar secrets: the secret values the status line must never show.
    """

    config: Any
    session: Any
    modes: Any
    collector: Any
    gpu_monitor: Any
    pipeline: Any
    engine: Any
    health: Any
    stopping: Callable[[], bool]
    secrets: Callable[[], list[str]]

    def heartbeat_fields(self) -> dict[str, Any]:
        """The heartbeat's status fields (protocol 3.2), C{status_reason} when degraded."""
        # Degraded once the engine was found unreachable (before its first probe the engine is
        # unknown, not down: a false "degraded" halves the node's score) or a GPU is not healthy.
        engine_down = self.engine is not None and self.engine.checked and not self.engine.available
        reasons = self.gpu_monitor.status_reasons()
        status = "draining" if self.stopping() else self.modes.status(degraded=engine_down or bool(reasons))
        fields = {
            "status": status,
            "version": VERSION,
            "capabilities": self.collector.last_capabilities(),
            "advertise_host": self.config.advertise_host,
        }
        if engine_down:
            reasons.insert(0, "the container engine is unreachable")
        if reasons and fields["status"] == "degraded":
            # Extra key (protocol 3.2 ignores it): why the node is degraded, for people.
            fields["status_reason"] = "; ".join(reasons)[:1000]
        return fields

    def status_line(self) -> str:
        """The one line systemd shows (C{STATUS=}): session state, node, workloads, last error."""
        from llmport_agent.ops.readers import session_state, workload_states

        state = session_state(self.session)
        words = {"connected": "connected", "enrolling": "enrolling", "backing_off": "backing off",
                 "refused": "credential refused", "connecting": "connecting", "stopped": "stopped"}
        parts = [words.get(state, state)]
        if self.stopping():
            parts.insert(0, "draining")
        parts.append(f"node {self.session.node_id or '-'}")
        if self.health is not None:
            parts.append(f"{len(workload_states(self))} workloads")
        running = self.pipeline.running_count
        if running:
            parts.append(f"{running} commands running")
        error = self.session.stats.last_error if state != "connected" else ""
        if error:
            parts.append(f"last error: {error}")
        from llmport_agent.logs.redact import redact

        return redact(", ".join(parts), self.secrets())
