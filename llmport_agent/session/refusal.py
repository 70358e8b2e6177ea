"""
Refusals of the stream upgrade (HTTP 401/403): counted (persisted across restarts), the other
stored credential tried, whoami asked once (current generation), re-enrollment with an unused
token, and "revoked" after repeated refusals over time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import LogLevel

from llmport_agent.core.state import token_fingerprint
from llmport_agent.session.backend_http import Rejected, RouteMissing, Transient
from llmport_agent.session.enrollment import TOKEN_HELP
from llmport_agent.session.rotation import ROTATION_TIMEOUT
from llmport_agent.session.tls import describe_connection_error

if TYPE_CHECKING:
    from llmport_agent.session.service import SessionService

REVOKED_AFTER_REFUSALS = 5
REVOKED_AFTER_SECONDS = 180.0
REVOKED_RETRY_SECONDS = 300.0


def refused(session: SessionService, http_status: int | None, reason: str | None, lost: Any = None) -> None:
    if http_status not in (401, 403):
        described = (
            describe_connection_error(lost, session.config.tls_client_cert) if lost is not None else None
        )
        session._note_retry(
            LogLevel.warn,
            "Could not open the backend stream: {reason}",
            reason=described or reason or "connection failed",
        )
        return
    now = session._wallclock()
    session._refusals += 1
    if session._first_refusal_at is None or session._first_refusal_at > now:
        session._first_refusal_at = now
    session.state.note(refusals={"count": session._refusals, "first_at": session._first_refusal_at})
    token = session.config.enrollment_token
    if token and token_fingerprint(token) not in session.state.get("used_tokens", []):
        # A token this node never used: re-enrolling with it is harmless (same agent id:
        # the same node row, or a new one after a deletion) and fixes a deleted node or a
        # lost credential now rather than after minutes of refusals.
        if not session._enrolling:
            session.log.warn(
                "The backend refused this node's credential (HTTP {status}); enrolling again "
                "with the configured enrollment token (agent id {agent_id})",
                status=http_status,
                agent_id=session.config.agent_id,
            )
            session._reenroll(token)
        return
    previous = session.state.get("previous_credential")
    alternate = isinstance(previous, str) and bool(previous) and previous != session.state.credential
    if not alternate and not session._whoami_asked and session.state.credential:
        # The current generation can tell at once whether this credential is still a
        # member's (the April one has no whoami: its 404 is for the route itself).
        session._whoami_asked = True
        session._ask_whoami(http_status, session.state.credential)
    if alternate:
        # Two credentials are kept only while it is unknown which one the backend honours
        # (a rotation whose reply was lost, a re-enrollment): alternate between them.
        session.log.warn(
            "The backend refused the current credential (HTTP {status}); trying the other "
            "stored one",
            status=http_status,
        )
        session.state.note(credential=previous, previous_credential=session.state.credential)
    span = now - session._first_refusal_at
    if session.deleted_detail is not None:
        session._note_retry(
            LogLevel.warn,
            "The backend still refuses the stream (HTTP {status}): this node was deleted or its "
            "credential revoked (see above)",
            status=http_status,
        )
    elif session._refusals >= session.revoked_after_refusals and span >= session.revoked_after_seconds:
        session._credential_revoked()
        session._note_retry(None, "")
    else:
        session._note_retry(
            LogLevel.warn,
            "The backend refused the stream (HTTP {status})",
            status=http_status,
            n=session._refusals,
        )


def ask_whoami(session: SessionService, http_status: int, credential: str) -> None:
    async def ask() -> None:
        try:
            await session._request(session.backend.whoami(credential, ROTATION_TIMEOUT))
        except Rejected as e:
            if session._stopping or session.proto is not None or credential != session.state.credential:
                return
            session.deleted_detail = f"HTTP {e.status}: {e.detail}"[:200]
            session._revoked = True
            session.stats.last_error = "node deleted or credential revoked"
            session.log.error(
                "The backend refused the stream (HTTP {status}) and does not know this node's "
                "credential any more (whoami {detail}): the node was deleted in llm-port or its "
                "credential revoked. To bring it back: sudo llmport-agent join {url} (an "
                "administrator approves the code it shows), or {help} and set "
                "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN, then restart the agent; retrying every {every:.0f} s",
                status=http_status,
                detail=session.deleted_detail,
                url=session.config.backend_url,
                help=TOKEN_HELP,
                every=session.revoked_retry_seconds,
            )
        except (RouteMissing, Transient, CancelledError):
            pass  # an April backend, or no answer: the refusals are counted as before

    d = Deferred.fromCoroutine(ask())
    d.addErrback(lambda f: session.log.failure("Asking the backend whoami failed", failure=f))


def credential_revoked(session: SessionService) -> None:
    session._revoked = True
    session.log.error(
        "The backend refuses this node's credential (HTTP 403, {n} times): the node was probably "
        "deleted or its credential revoked. To re-enroll, {help} and set "
        "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN, then restart the agent. Retrying every {every:.0f} s.",
        n=session._refusals,
        help=TOKEN_HELP,
        every=session.revoked_retry_seconds,
    )
