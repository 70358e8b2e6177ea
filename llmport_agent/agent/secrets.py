"""The secret values this node holds, which no log line, event or status may show."""

from __future__ import annotations

from typing import Any

from llmport_agent.core.values import frozen


@frozen(eq=False, repr=False)  # a component: identity, not value
class NodeSecrets:
    """
    The enrollment token, the credentials in the state file and the Ray cluster tokens, read
    afresh at each call (credentials rotate).

    @ivar config: the agent's settings (C{enrollment_token}).
    @ivar state: the state store (the credential, pending and previous credentials).
    @ivar ray_tokens: the Ray cluster tokens (L{llmport_agent.ray.token.ClusterTokens}), or
        C{None} without the Docker executor.
    """

    config: Any
    state: Any
    ray_tokens: Any

    def values(self) -> list[str]:
        """Every secret value held now, non-empty strings only."""
        values = [
            self.config.enrollment_token,
            self.state.credential,
            self.state.get("pending_credential"),
            self.state.get("previous_credential"),
        ]
        if self.ray_tokens is not None:
            values += self.ray_tokens.secrets()
        return [v for v in values if isinstance(v, str) and v]
