"""
Enrollment (protocol 1): a token exchanged for the node's credential, with retries on
transient errors; re-enrollment when the backend refuses the stored credential and the
configured token was never used; the line that says the token can be removed.

L{Enrollment} owns whether an enrollment is running and whether the token line was said. Its
inputs are L{Enrollment.enroll}, L{Enrollment.reenroll} and L{Enrollment.say_token_removable};
its outputs the callbacks given at construction (C{enrolled}, C{reconnect}, C{fatal}).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger

from llmport_agent.core.backoff import Backoff
from llmport_agent.core.cleantext import BadNodeId
from llmport_agent.core.config import AgentConfig
from llmport_agent.core.state import StateStore, token_fingerprint
from llmport_agent.session.backend_http import BackendHTTP, Rejected, Transient
from llmport_agent.session.shared import EXIT_NEEDS_OPERATOR, TOKEN_HELP, SessionStats
from llmport_agent.session.stop import StopGate

__all__ = [ "Enrollment"]


class Enrollment:
    """
    @param enrolled: called with the node id once a credential is stored.
    @param reconnect: called after a successful re-enrollment (connect now, not after the delay).
    @param fatal: called with (exit status, message) when an operator must act.
    @param failed: called with what went wrong when an attempt failed for now (it is retried).
    """

    def __init__(
        self,
        *,
        config: AgentConfig,
        state: StateStore,
        backend: BackendHTTP,
        capabilities: Callable[[], Deferred[dict[str, Any]]],
        version: str,
        wallclock: Callable[[], float],
        gate: StopGate,
        backoff: Backoff,
        stats: SessionStats,
        log: Logger,
        fatal: Callable[[int, str], None],
        enrolled: Callable[[str], None],
        reconnect: Callable[[], None],
        failed: Callable[[str], None],
    ) -> None:
        self._config = config
        self._state = state
        self._backend = backend
        self._capabilities = capabilities
        self._version = version
        self._wallclock = wallclock
        self._gate = gate
        self._backoff = backoff
        self._stats = stats
        self._log = log
        self._fatal = fatal
        self._enrolled = enrolled
        self._reconnect = reconnect
        self._failed = failed
        self.enrolling = False
        self._token_line_said = False

    async def enroll(self, token: str, *, reenroll: bool = False) -> bool:
        """
        Enroll with retries on transient errors. False when rejected or stopping.

        @param reenroll: the stored credential was refused and this is a fresh token: a
            rejected token is then logged (the agent keeps retrying its credential) instead
            of stopping the agent.
        """
        self.enrolling = True
        attempt = 0
        gate, config, state, log = self._gate, self._config, self._state, self._log
        try:
            while not gate.stopping:
                try:
                    capabilities = await self._capabilities()
                    result = await gate.request(
                        self._backend.enroll(token, config.agent_id, config.host, capabilities, self._version)
                    )
                except CancelledError:
                    return False
                except BadNodeId as e:
                    # The backend took the token and named no usable node: an operator must look.
                    await self.remember_token(token)
                    self._fatal(EXIT_NEEDS_OPERATOR, f"Enrollment failed: {e}")
                    return False
                except Rejected as e:
                    if reenroll and e.status != 422:
                        await self.remember_token(token)
                        log.error(
                            "The backend refuses this node's credential and rejected the configured "
                            "enrollment token too ({detail}): it is invalid, expired or already used; "
                            "{help}, set LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN and restart the agent",
                            detail=e.detail,
                            help=TOKEN_HELP,
                        )
                        return False
                    if e.status == 422:
                        # A malformed request does not consume the token: do not remember it.
                        self._fatal(
                            EXIT_NEEDS_OPERATOR,
                            f"The backend rejected the enrollment request as malformed (HTTP 422: "
                            f"{e.detail[:300]}); check LLM_PORT_NODE_AGENT_AGENT_ID (<= 128 "
                            "characters) and that BACKEND_URL points at an llm-port backend",
                        )
                        return False
                    await self.remember_token(token)
                    self._fatal(
                        EXIT_NEEDS_OPERATOR,
                        f"The enrollment token was rejected ({e.detail}): it is invalid, expired or "
                        f"already used; {TOKEN_HELP} and set LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN",
                    )
                    return False
                except Transient as e:
                    if gate.stopping:
                        return False  # cancelled by the stop: no retry delay after it
                    attempt += 1
                    self._failed(f"enrollment failed: {e}")
                    delay = self._backoff.delay(attempt)
                    log.warn(
                        "Enrollment failed ({error}); retrying in {delay:.1f} s",
                        error=str(e),
                        delay=delay,
                    )
                    try:
                        await gate.sleep(delay)
                    except CancelledError:
                        return False
                    continue
                previous = state.credential
                used = list(state.get("used_tokens", []))[-19:] + [token_fingerprint(token)]
                await state.update(
                    credential=result.credential,
                    pending_credential=None,
                    previous_credential=previous,
                    node_id=result.node_id,
                    agent_id=config.agent_id,
                    # The backend that issued the credential: it goes to no other (join, start).
                    backend_url=config.backend_url,
                    backend_host=result.host,
                    enrolled_at=self._wallclock(),
                    last_rotation_at=self._wallclock(),
                    used_tokens=used,
                    refusals=None,
                )
                self._enrolled(result.node_id)
                self._stats.enrollments += 1
                log.info(
                    "Enrolled as node {node_id} (agent id {agent_id}); credential stored in {path}",
                    node_id=result.node_id,
                    agent_id=config.agent_id,
                    path=state.path,
                )
                return True
            return False
        finally:
            self.enrolling = False

    async def remember_token(self, token: str) -> None:
        used = list(self._state.get("used_tokens", []))[-19:] + [token_fingerprint(token)]
        await self._state.update(used_tokens=used)

    def reenroll(self, token: str) -> None:
        """Enroll again with C{token} in the background (a stop waits for it); connect at once if it works."""

        async def run() -> None:
            if await self.enroll(token, reenroll=True):
                self._reconnect()

        d = Deferred.fromCoroutine(run())
        d.addErrback(lambda f: self._log.failure("Re-enrollment failed", failure=f))
        self._gate.track_critical(d)

    def say_token_removable(self) -> None:
        """Once per run, after the backend accepted a stored credential: the token can go."""
        token = self._config.enrollment_token
        if not token or self._token_line_said:
            return
        self._token_line_said = True
        if token_fingerprint(token) in self._state.get("used_tokens", []):
            why = "it was used to enroll this node (tokens are single use)"
        else:
            why = "it was not needed (it is still unused)"
        self._log.info(
            "The backend accepted the credential stored in {path}; the enrollment token in "
            "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN can be removed from the configuration: {why}",
            path=self._state.path,
            why=why,
        )
