"""
Refusals of the stream upgrade (HTTP 401/403): counted (persisted across restarts), the other
stored credential tried, whoami asked once (current generation), re-enrollment with an unused
token, and "revoked" after repeated refusals over time.

L{Refusals} owns the count, when the streak began, whether the credential counts as revoked,
whether whoami was asked and what it said. Inputs: L{Refusals.restore}, L{Refusals.refused},
L{Refusals.opened}, L{Refusals.forget}; outputs: L{Refusals.revoked}, L{Refusals.retry_delay},
and the callbacks given at construction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger, LogLevel

from llmport_agent.core.config import AgentConfig
from llmport_agent.core.state import StateStore, token_fingerprint
from llmport_agent.session.backend_http import BackendHTTP, Rejected, RouteMissing, Transient
from llmport_agent.session.rotation import ROTATION_TIMEOUT
from llmport_agent.session.shared import TOKEN_HELP, NoteRetry
from llmport_agent.session.stop import StopGate
from llmport_agent.session.tls import describe_connection_error

REVOKED_AFTER_REFUSALS = 5
REVOKED_AFTER_SECONDS = 180.0
REVOKED_RETRY_SECONDS = 300.0


class Refusals:
    """
    @param note_retry: says what the failed attempt was, with the retry delay.
    @param failed: called with what went wrong (diagnostics' last error).
    @param enrolling: whether an enrollment is running now.
    @param reenroll: enroll again with the given (never used) token.
    @param connected: whether the stream is open now.
    @ivar revoked_after_refusals: with L{revoked_after_seconds}, when repeated refusals mean
        "revoked" (attributes so that tests can shorten them).
    @ivar revoked_retry_seconds: the retry delay once revoked.
    """

    def __init__(
        self,
        *,
        config: AgentConfig,
        state: StateStore,
        backend: BackendHTTP,
        wallclock: Callable[[], float],
        gate: StopGate,
        log: Logger,
        note_retry: NoteRetry,
        failed: Callable[[str], None],
        enrolling: Callable[[], bool],
        reenroll: Callable[[str], None],
        connected: Callable[[], bool],
    ) -> None:
        self._config = config
        self._state = state
        self._backend = backend
        self._wallclock = wallclock
        self._gate = gate
        self._failed = failed
        self._log = log
        self._note_retry = note_retry
        self._enrolling = enrolling
        self._reenroll = reenroll
        self._connected = connected
        self.revoked_after_refusals = REVOKED_AFTER_REFUSALS
        self.revoked_after_seconds = REVOKED_AFTER_SECONDS
        self.revoked_retry_seconds = REVOKED_RETRY_SECONDS
        # Refusals of the stream upgrade (401/403) since the last open, persisted so that a
        # restart does not start counting again (wall-clock time of the first one); read from
        # the state file by L{restore}, once it is loaded.
        self.count = 0
        self._first_at: float | None = None
        self.revoked = False
        #: whoami was asked in this streak of refusals (cleared when the stream opens).
        self._whoami_asked = False
        #: The backend (current generation) said the credential is not a member's.
        self.deleted_detail: str | None = None

    def retry_delay(self, otherwise: Callable[[], float]) -> float:
        """The delay before the next attempt: the slow retry once revoked, else C{otherwise()}."""
        return self.revoked_retry_seconds if self.revoked else otherwise()

    def restore(self, opens: int) -> None:
        """The refusals persisted by the last run (the state file is loaded by now)."""
        if opens or self.count:
            return  # this run already counted (or opened): its own count stands
        refusals = self._state.get("refusals")
        if isinstance(refusals, dict):
            count, first = refusals.get("count"), refusals.get("first_at")
            if (
                isinstance(count, int)
                and not isinstance(count, bool)
                and count > 0
                and isinstance(first, (int, float))
                and not isinstance(first, bool)
            ):
                self.count, self._first_at = count, float(first)

    def forget(self) -> None:
        """A new credential was stored: the streak is over."""
        self.count = 0
        self._first_at = None

    def opened(self) -> None:
        """The backend accepted the credential: the streak is over, and so is any alternation."""
        self.forget()
        if self._state.get("refusals") is not None:
            self._state.note(refusals=None)
        if self._state.get("previous_credential"):
            # The current credential works: stop alternating.
            self._state.note(previous_credential=None)
        self.revoked = False
        self._whoami_asked = False
        self.deleted_detail = None

    def refused(self, http_status: int | None, reason: str | None, lost: Any = None) -> None:
        """The stream upgrade failed before it opened (C{lost}: why the connection was lost)."""
        state, config, log, note_retry = self._state, self._config, self._log, self._note_retry
        if http_status not in (401, 403):
            described = describe_connection_error(lost, config.tls_client_cert) if lost is not None else None
            note_retry(
                LogLevel.warn,
                "Could not open the backend stream: {reason}",
                reason=described or reason or "connection failed",
            )
            return
        now = self._wallclock()
        self.count += 1
        if self._first_at is None or self._first_at > now:
            self._first_at = now
        state.note(refusals={"count": self.count, "first_at": self._first_at})
        token = config.enrollment_token
        if token and token_fingerprint(token) not in state.get("used_tokens", []):
            # A token this node never used: re-enrolling with it is harmless (same agent id:
            # the same node row, or a new one after a deletion) and fixes a deleted node or a
            # lost credential now rather than after minutes of refusals.
            if not self._enrolling():
                log.warn(
                    "The backend refused this node's credential (HTTP {status}); enrolling again "
                    "with the configured enrollment token (agent id {agent_id})",
                    status=http_status,
                    agent_id=config.agent_id,
                )
                self._reenroll(token)
            return
        previous = state.get("previous_credential")
        alternate = isinstance(previous, str) and bool(previous) and previous != state.credential
        if not alternate and not self._whoami_asked and state.credential:
            # The current generation can tell at once whether this credential is still a
            # member's (the April one has no whoami: its 404 is for the route itself).
            self._whoami_asked = True
            self._ask_whoami(http_status, state.credential)
        if alternate:
            # Two credentials are kept only while it is unknown which one the backend honours
            # (a rotation whose reply was lost, a re-enrollment): alternate between them.
            log.warn(
                "The backend refused the current credential (HTTP {status}); trying the other "
                "stored one",
                status=http_status,
            )
            state.note(credential=previous, previous_credential=state.credential)
        span = now - self._first_at
        if self.deleted_detail is not None:
            note_retry(
                LogLevel.warn,
                "The backend still refuses the stream (HTTP {status}): this node was deleted or its "
                "credential revoked (see above)",
                status=http_status,
            )
        elif self.count >= self.revoked_after_refusals and span >= self.revoked_after_seconds:
            self._credential_revoked()
            note_retry(None, "")
        else:
            note_retry(
                LogLevel.warn,
                "The backend refused the stream (HTTP {status})",
                status=http_status,
                n=self.count,
            )

    def _ask_whoami(self, http_status: int, credential: str) -> None:
        async def ask() -> None:
            try:
                await self._gate.request(self._backend.whoami(credential, ROTATION_TIMEOUT))
            except Rejected as e:
                if self._gate.stopping or self._connected() or credential != self._state.credential:
                    return
                self.deleted_detail = f"HTTP {e.status}: {e.detail}"[:200]
                self.revoked = True
                self._failed("node deleted or credential revoked")
                self._log.error(
                    "The backend refused the stream (HTTP {status}) and does not know this node's "
                    "credential any more (whoami {detail}): the node was deleted in llm-port or its "
                    "credential revoked. To bring it back: sudo llmport-agent join {url} (an "
                    "administrator approves the code it shows), or {help} and set "
                    "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN, then restart the agent; retrying every {every:.0f} s",
                    status=http_status,
                    detail=self.deleted_detail,
                    url=self._config.backend_url,
                    help=TOKEN_HELP,
                    every=self.revoked_retry_seconds,
                )
            except (RouteMissing, Transient, CancelledError):
                pass  # an April backend, or no answer: the refusals are counted as before

        d = Deferred.fromCoroutine(ask())
        d.addErrback(lambda f: self._log.failure("Asking the backend whoami failed", failure=f))

    def _credential_revoked(self) -> None:
        self.revoked = True
        self._log.error(
            "The backend refuses this node's credential (HTTP 403, {n} times): the node was probably "
            "deleted or its credential revoked. To re-enroll, {help} and set "
            "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN, then restart the agent. Retrying every {every:.0f} s.",
            n=self.count,
            help=TOKEN_HELP,
            every=self.revoked_retry_seconds,
        )
