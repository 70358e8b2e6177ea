"""
Enrollment (protocol 1): a token exchanged for the node's credential, with retries on
transient errors; re-enrollment when the backend refuses the stored credential and the
configured token was never used; the line that says the token can be removed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twisted.internet.defer import CancelledError, Deferred

from llmport_agent.core.cleantext import BadNodeId
from llmport_agent.core.state import token_fingerprint
from llmport_agent.session.backend_http import Rejected, Transient

if TYPE_CHECKING:
    from llmport_agent.session.service import SessionService

TOKEN_HELP = "mint a new one with POST /api/admin/system/nodes/enrollment-tokens"

#: Exit status reserved for "an operator must act" (EX_CONFIG); the systemd unit does not
#: restart on it.
EXIT_NEEDS_OPERATOR = 78


async def enroll(session: SessionService, token: str, *, reenroll: bool = False) -> bool:
    """
    Enroll with retries on transient errors. False when rejected or stopping.

    @param reenroll: the stored credential was refused and this is a fresh token: a
        rejected token is then logged (the agent keeps retrying its credential) instead
        of stopping the agent.
    """
    session._enrolling = True
    attempt = 0
    try:
        while not session._stopping:
            try:
                capabilities = await session._capabilities()
                result = await session._request(
                    session.backend.enroll(
                        token, session.config.agent_id, session.config.host, capabilities, session.version
                    )
                )
            except CancelledError:
                return False
            except BadNodeId as e:
                # The backend took the token and named no usable node: an operator must look.
                await session._remember_token(token)
                session._fatal(EXIT_NEEDS_OPERATOR, f"Enrollment failed: {e}")
                return False
            except Rejected as e:
                if reenroll and e.status != 422:
                    await session._remember_token(token)
                    session.log.error(
                        "The backend refuses this node's credential and rejected the configured "
                        "enrollment token too ({detail}): it is invalid, expired or already used; "
                        "{help}, set LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN and restart the agent",
                        detail=e.detail,
                        help=TOKEN_HELP,
                    )
                    return False
                if e.status == 422:
                    # A malformed request does not consume the token: do not remember it.
                    session._fatal(
                        EXIT_NEEDS_OPERATOR,
                        f"The backend rejected the enrollment request as malformed (HTTP 422: "
                        f"{e.detail[:300]}); check LLM_PORT_NODE_AGENT_AGENT_ID (<= 128 "
                        "characters) and that BACKEND_URL points at an llm-port backend",
                    )
                    return False
                await session._remember_token(token)
                session._fatal(
                    EXIT_NEEDS_OPERATOR,
                    f"The enrollment token was rejected ({e.detail}): it is invalid, expired or "
                    f"already used; {TOKEN_HELP} and set LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN",
                )
                return False
            except Transient as e:
                if session._stopping:
                    return False  # cancelled by the stop: no retry delay after it
                attempt += 1
                session.stats.last_error = f"enrollment failed: {e}"[:200]
                delay = session.backoff.delay(attempt)
                session.log.warn(
                    "Enrollment failed ({error}); retrying in {delay:.1f} s",
                    error=str(e),
                    delay=delay,
                )
                try:
                    await session._sleep(delay)
                except CancelledError:
                    return False
                continue
            previous = session.state.credential
            used = list(session.state.get("used_tokens", []))[-19:] + [token_fingerprint(token)]
            await session.state.update(
                credential=result.credential,
                pending_credential=None,
                previous_credential=previous,
                node_id=result.node_id,
                agent_id=session.config.agent_id,
                # The backend that issued the credential: it goes to no other (join, start).
                backend_url=session.config.backend_url,
                backend_host=result.host,
                enrolled_at=session._wallclock(),
                last_rotation_at=session._wallclock(),
                used_tokens=used,
                refusals=None,
            )
            session._refusals = 0
            session._first_refusal_at = None
            session.node_id = result.node_id
            session.stats.enrollments += 1
            session.log.info(
                "Enrolled as node {node_id} (agent id {agent_id}); credential stored in {path}",
                node_id=result.node_id,
                agent_id=session.config.agent_id,
                path=session.state.path,
            )
            return True
        return False
    finally:
        session._enrolling = False


async def remember_token(session: SessionService, token: str) -> None:
    used = list(session.state.get("used_tokens", []))[-19:] + [token_fingerprint(token)]
    await session.state.update(used_tokens=used)


def reenroll(session: SessionService, token: str) -> None:
    async def run() -> None:
        if await session._enroll(token, reenroll=True):
            session._reconnect_now()

    d = Deferred.fromCoroutine(run())
    d.addErrback(lambda f: session.log.failure("Re-enrollment failed", failure=f))
    session._track_critical(d)


def say_token_removable(session: SessionService) -> None:
    """Once per run, after the backend accepted a stored credential: the token can go."""
    token = session.config.enrollment_token
    if not token or session._token_line_said:
        return
    session._token_line_said = True
    if token_fingerprint(token) in session.state.get("used_tokens", []):
        why = "it was used to enroll this node (tokens are single use)"
    else:
        why = "it was not needed (it is still unused)"
    session.log.info(
        "The backend accepted the credential stored in {path}; the enrollment token in "
        "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN can be removed from the configuration: {why}",
        path=session.state.path,
        why=why,
    )
