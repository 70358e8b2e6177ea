"""
The backend session: enrollment when needed, one authenticated WebSocket connection kept up
through every network fault (ClientService + Autobahn), credential rotation, command polling.

Polling (protocol 3.2: the April 2026 backend sends commands only in reply to a frame, and each
frame costs it a query and a commit, plus an offset-row write when the frame carries C{seq}): a
poll frame carries no C{seq} and leaves when nothing else was sent for the poll interval. The
interval is C{COMMAND_POLL_INTERVAL_SEC} while the node is active (a connect, or a command
received, running, or answered within C{COMMAND_POLL_ACTIVE_WINDOW_SEC}) and
C{COMMAND_POLL_IDLE_INTERVAL_SEC} otherwise; the first command back makes it active again.
Once the backend has shown that it pushes commands (protocol 10.1, L{DispatchDetector}), no
polls go at all.

Listeners (the command pipeline, heartbeat, inventory, event outbox) subscribe with
L{SessionService.subscribe} and receive plain dicts; they send with L{SessionService.send}.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from attrs import define, field
from autobahn.exception import Disconnected
from twisted.application.internet import ClientService
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, ensureDeferred, succeed
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.task import LoopingCall
from twisted.logger import Logger, LogLevel
from zope.interface import implementer

from llmport_agent.backend_http import BackendHTTP, Rejected, RouteMissing, Transient
from llmport_agent.backoff import Backoff, FailureCounter, retry_policy
from llmport_agent.config import AgentConfig
from llmport_agent.session.dispatch import PUSH, DispatchDetector
from llmport_agent.session.protocol import (
    HARD_MAX_FRAME,
    AgentClientFactory,
    AgentClientProtocol,
)
from llmport_agent.state import StateStore, token_fingerprint
from llmport_agent.tls import client_tls_options, describe_connection_error

STREAM_PATH = "/api/admin/system/nodes/stream"
TOKEN_HELP = "mint a new one with POST /api/admin/system/nodes/enrollment-tokens"

#: Exit status reserved for "an operator must act" (EX_CONFIG); the systemd unit does not
#: restart on it.
EXIT_NEEDS_OPERATOR = 78

#: Outbound frame types that mean a command is being worked on (activity for the poll rate).
COMMAND_FRAMES = frozenset({"command_ack", "command_progress", "command_result"})

ROTATION_INTERVAL = 12 * 3600.0
ROTATION_CHECK = 600.0
ROTATION_TIMEOUT = 10.0
REVOKED_AFTER_REFUSALS = 5
REVOKED_AFTER_SECONDS = 180.0
REVOKED_RETRY_SECONDS = 300.0
#: On stop, an enrollment or rotation request in flight gets this long to bring back its
#: reply (the backend may already have consumed the token / revoked the old credential);
#: then it is cancelled, so a stop always completes within about two seconds.
CRITICAL_STOP_GRACE = 0.5


class SessionListener(Protocol):
    def session_opened(self) -> None: ...
    def session_closed(self) -> None: ...
    def frame_received(self, frame: dict[str, Any]) -> None: ...


def stream_url(backend_url: str) -> str:
    """C{ws[s]://host[:port]/<base>/api/admin/system/nodes/stream} from C{BACKEND_URL}."""
    parts = urlsplit(backend_url)
    scheme = "wss" if parts.scheme == "https" else "ws"
    path = parts.path.rstrip("/") + STREAM_PATH
    return urlunsplit((scheme, parts.netloc, path, "", ""))


@implementer(IStreamClientEndpoint)
class _NamedEndpoint:
    """An endpoint that logs as the backend address (ClientService logs its endpoint's repr)."""

    def __init__(
        self,
        endpoint: Any,
        label: str,
        on_attempt: Callable[[], None],
        on_failure: Callable[[Any], None] | None = None,
    ) -> None:
        self._endpoint = endpoint
        self._label = label
        self._on_attempt = on_attempt
        self._on_failure = on_failure

    def connect(self, protocolFactory: Any) -> Any:
        self._on_attempt()
        d = self._endpoint.connect(protocolFactory)
        if self._on_failure is not None:
            on_failure = self._on_failure

            def failed(f: Any) -> Any:
                on_failure(f)
                return f

            d.addErrback(failed)
        return d

    def __repr__(self) -> str:
        return self._label


#: Inbound frame types counted by name (anything else the backend sends counts as "other").
INBOUND_TYPES = frozenset({"hello_ack", "commands", "command", "error", "ping", "pong"})


@define
class SessionStats:
    connects: int = 0
    opens: int = 0
    refused: int = 0
    closes: int = 0
    frames_sent: int = 0
    frames_received: int = 0
    last_open_at: float | None = None
    last_close: dict[str, Any] = field(factory=dict)
    enrollments: int = 0
    rotations: int = 0
    rotation_errors: int = 0
    #: Frames by type (metrics); inbound types outside INBOUND_TYPES count as "other".
    frames_out: dict[str, int] = field(factory=dict)
    frames_in: dict[str, int] = field(factory=dict)
    last_error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "connects": self.connects,
            "opens": self.opens,
            "refused_upgrades": self.refused,
            "closes": self.closes,
            "frames_sent": self.frames_sent,
            "frames_received": self.frames_received,
            "last_open_at": self.last_open_at or 0,
            "last_close": dict(self.last_close),
            "enrollments": self.enrollments,
            "rotations": self.rotations,
            "rotation_errors": self.rotation_errors,
        }


class SessionService(Service):
    """
    Keeps the backend session.

    @param fatal: called with (exit status, message) when the agent cannot go on without an
        operator (enrollment token rejected, no credential and no token).
    @param capabilities: fires with the static capabilities (sent at enrollment).
    @param endpoint_factory: for tests: C{(host, port, tls) -> IStreamClientEndpoint}.
    @param busy: how many commands are running or have a result not yet confirmed (the
        command pipeline's C{busy}); the node polls fast while it is above 0.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        config: AgentConfig,
        state: StateStore,
        backend: BackendHTTP,
        capabilities: Callable[[], Deferred[dict[str, Any]]],
        fatal: Callable[[int, str], None],
        *,
        version: str,
        endpoint_factory: Callable[[str, int, bool], Any] | None = None,
        rng: Callable[[], float] = random.random,
        wallclock: Callable[[], float] = time.time,
        busy: Callable[[], int] | None = None,
    ) -> None:
        self.setName("session")
        self._reactor = reactor
        self.config = config
        self.state = state
        self.backend = backend
        self._capabilities = capabilities
        self._fatal = fatal
        self.version = version
        self._endpoint_factory = endpoint_factory or self._default_endpoint
        self._wallclock = wallclock
        self.backoff = Backoff(config.reconnect_min_sec, config.reconnect_max_sec, rng)
        self.failures = FailureCounter(stable_after=max(10.0, config.reconnect_max_sec))
        self.stats = SessionStats()
        self.proto: AgentClientProtocol | None = None
        self.node_id: str | None = state.get("node_id")
        self.session_id: str | None = None
        self._listeners: list[SessionListener] = []
        self._client: ClientService | None = None
        self._poll: Any = None  # IDelayedCall: the next poll frame, pushed back by every frame sent
        self._rotation_loop: LoopingCall | None = None
        self._last_sent_at = 0.0
        self._busy = busy
        #: Reactor time of the last connect or command activity (None: never).
        self._last_activity: float | None = None
        # Refusals of the stream upgrade (401/403) since the last open, persisted so that a
        # restart does not start counting again (wall-clock time of the first one); read from
        # the state file in startService (L{_restore_refusals}), when it is loaded.
        self._refusals = 0
        self._first_refusal_at: float | None = None
        self._revoked = False
        self._sleeping: Deferred[None] | None = None
        self._critical: set[Deferred[Any]] = set()
        self._requests: set[Deferred[Any]] = set()  # enroll/rotate HTTP requests in flight
        self._token_line_said = False
        self._factory: AgentClientFactory | None = None
        self._endpoint: Any = None
        self._tls_creator: Any = None
        # When repeated refusals mean "revoked" (instance attributes so tests can shorten them).
        self.revoked_after_refusals = REVOKED_AFTER_REFUSALS
        self.revoked_after_seconds = REVOKED_AFTER_SECONDS
        self.revoked_retry_seconds = REVOKED_RETRY_SECONDS
        self._starting: Deferred[None] | None = None
        #: whoami was asked in this streak of refusals (cleared when the stream opens).
        self._whoami_asked = False
        #: The backend (current generation) said the credential is not a member's.
        self.deleted_detail: str | None = None
        self._stopping = False
        self._rotating = False
        self._enrolling = False
        self.dispatch = DispatchDetector(self._reactor.seconds, self._dispatch_changed)
        self._dispatch_said = False
        #: What the failed attempt was, said with the retry delay (L{_say_retry}).
        self._retry_note: tuple[LogLevel | None, str, dict[str, Any]] | None = None

    # -- wiring ----------------------------------------------------------------------------

    def subscribe(self, listener: SessionListener) -> None:
        self._listeners.append(listener)

    @property
    def connected(self) -> bool:
        return self.proto is not None

    @property
    def phase(self) -> str:
        """connected, enrolling, refused (credential revoked), backing_off, connecting or stopped."""
        if not self.running:
            return "stopped"
        if self.proto is not None:
            return "connected"
        if self._enrolling:
            return "enrolling"
        if self._revoked:
            return "refused"
        if self.stats.closes or self.stats.last_error:
            return "backing_off"
        return "connecting"

    def credential(self) -> str:
        return self.state.credential or ""

    def _count_attempt(self) -> None:
        """One connection attempt to the backend stream (TCP, TLS and upgrade), shown in diagnostics."""
        self.stats.connects += 1

    def _default_endpoint(self, host: str, port: int, tls: bool) -> Any:
        endpoint: Any = HostnameEndpoint(
            self._reactor, host, port, timeout=self.config.request_timeout_sec
        )
        if tls:
            if self._tls_creator is None:
                # Read once (CA bundle, client certificate): not a file read at every reconnect.
                c = self.config
                self._tls_creator = client_tls_options(
                    host, c.verify_tls, c.ca_bundle, c.tls_client_cert, c.tls_client_key
                )
            endpoint = wrapClientTLS(self._tls_creator, endpoint)
        return endpoint

    @property
    def _unverified_tls(self) -> bool:
        return self.config.backend_url.startswith("https:") and not self.config.verify_tls

    # -- start -----------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._stopping = False
        self._restore_refusals()
        self._restore_dispatch_mode()
        self._starting = Deferred.fromCoroutine(self._start())
        self._starting.addErrback(
            lambda f: self.log.failure("The backend session could not start", failure=f)
        )

    async def _start(self) -> None:
        token = self.config.enrollment_token
        if self._unverified_tls and (self.state.credential or token):
            # Before the first request leaves, not after.
            self.log.warn(
                "TLS verification is OFF (LLM_PORT_NODE_AGENT_VERIFY_TLS=false): enrollment and "
                "the stream to {url} are open to interception; set LLM_PORT_NODE_AGENT_CA_BUNDLE "
                "to the backend's CA certificate instead",
                url=self.config.backend_url,
            )
        # With a credential stored, the token is kept for a refusal (see _refused); whether it
        # can be removed is said once the backend accepted the credential (connection_opened).
        if self.state.credential:
            pass
        elif token:
            if token_fingerprint(token) in self.state.get("used_tokens", []):
                self._fatal(
                    EXIT_NEEDS_OPERATOR,
                    "No credential is stored and the configured enrollment token was already used "
                    f"by this node; {TOKEN_HELP} and set LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN",
                )
                return
            ok = await self._enroll(token)
            if not ok:
                return
        else:
            self._fatal(
                EXIT_NEEDS_OPERATOR,
                f"No credential in {self.state.path} and no enrollment token: {TOKEN_HELP} "
                "and set LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN",
            )
            return
        if self._stopping:
            return
        self._connect()

    async def _request(self, request: Any) -> Any:
        """Await an enroll/rotate request; L{stopService} can cancel it (see CRITICAL_STOP_GRACE)."""
        d: Deferred[Any] = ensureDeferred(request)
        self._requests.add(d)
        try:
            return await d
        finally:
            self._requests.discard(d)

    async def _enroll(self, token: str, *, reenroll: bool = False) -> bool:
        """
        Enroll with retries on transient errors. False when rejected or stopping.

        @param reenroll: the stored credential was refused and this is a fresh token: a
            rejected token is then logged (the agent keeps retrying its credential) instead
            of stopping the agent.
        """
        self._enrolling = True
        attempt = 0
        try:
            while not self._stopping:
                try:
                    capabilities = await self._capabilities()
                    result = await self._request(
                        self.backend.enroll(
                            token, self.config.agent_id, self.config.host, capabilities, self.version
                        )
                    )
                except CancelledError:
                    return False
                except Rejected as e:
                    if reenroll and e.status != 422:
                        await self._remember_token(token)
                        self.log.error(
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
                    await self._remember_token(token)
                    self._fatal(
                        EXIT_NEEDS_OPERATOR,
                        f"The enrollment token was rejected ({e.detail}): it is invalid, expired or "
                        f"already used; {TOKEN_HELP} and set LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN",
                    )
                    return False
                except Transient as e:
                    if self._stopping:
                        return False  # cancelled by the stop: no retry delay after it
                    attempt += 1
                    self.stats.last_error = f"enrollment failed: {e}"[:200]
                    delay = self.backoff.delay(attempt)
                    self.log.warn(
                        "Enrollment failed ({error}); retrying in {delay:.1f} s",
                        error=str(e),
                        delay=delay,
                    )
                    try:
                        await self._sleep(delay)
                    except CancelledError:
                        return False
                    continue
                previous = self.state.credential
                used = list(self.state.get("used_tokens", []))[-19:] + [token_fingerprint(token)]
                await self.state.update(
                    credential=result.credential,
                    pending_credential=None,
                    previous_credential=previous,
                    node_id=result.node_id,
                    agent_id=self.config.agent_id,
                    backend_host=result.host,
                    enrolled_at=self._wallclock(),
                    last_rotation_at=self._wallclock(),
                    used_tokens=used,
                    refusals=None,
                )
                self._refusals = 0
                self._first_refusal_at = None
                self.node_id = result.node_id
                self.stats.enrollments += 1
                self.log.info(
                    "Enrolled as node {node_id} (agent id {agent_id}); credential stored in {path}",
                    node_id=result.node_id,
                    agent_id=self.config.agent_id,
                    path=self.state.path,
                )
                return True
            return False
        finally:
            self._enrolling = False

    async def _remember_token(self, token: str) -> None:
        used = list(self.state.get("used_tokens", []))[-19:] + [token_fingerprint(token)]
        await self.state.update(used_tokens=used)

    def _sleep(self, seconds: float) -> Deferred[None]:
        """A cancellable pause; C{stopService} cancels it (and a stopping service never sleeps)."""
        from twisted.internet.defer import fail
        from twisted.internet.task import deferLater

        if self._stopping:
            return fail(CancelledError())
        d = deferLater(self._reactor, seconds, lambda: None)
        self._sleeping = d

        def done(result: Any) -> Any:
            self._sleeping = None
            return result

        return d.addBoth(done)

    def _connect(self) -> None:
        url = stream_url(self.config.backend_url)
        parts = urlsplit(self.config.backend_url)
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        self._factory = factory = AgentClientFactory(
            url,
            session=self,
            credential=self.credential,
            clock=self._reactor,
            useragent=f"llmport-agent/{self.version}",
        )
        factory.setProtocolOptions(
            autoPingInterval=20,
            autoPingTimeout=10,
            openHandshakeTimeout=max(5.0, self.config.request_timeout_sec),
            closeHandshakeTimeout=3,
            maxMessagePayloadSize=HARD_MAX_FRAME,
            maxFramePayloadSize=HARD_MAX_FRAME,
        )
        host = parts.hostname or ""
        shown = f"[{host}]" if ":" in host else host
        self._endpoint = _NamedEndpoint(
            self._endpoint_factory(host, port, tls), f"{'TLS ' if tls else ''}{shown}:{port}",
            self._count_attempt, self._connect_failed,
        )
        base_policy = retry_policy(self.backoff, self.failures)

        def policy(attempt: int) -> float:
            delay = self.revoked_retry_seconds if self._revoked else base_policy(attempt)
            self._say_retry(max(attempt, self.failures.failures), delay)
            return delay

        self._policy = policy
        self._start_client()
        self._rotation_loop = LoopingCall(self._rotation_tick)
        self._rotation_loop.clock = self._reactor
        self._rotation_loop.start(ROTATION_CHECK, now=False)

    def _note_retry(self, level: LogLevel | None, fmt: str, **fields: Any) -> None:
        """
        What went wrong with this attempt, said together with the retry delay in one line when
        ClientService asks for the delay (at once, in the same call chain as the close). C{None}
        as the level: already said (a line of its own); the retry is then only logged at debug.
        """
        self._retry_note = (level, fmt, fields)

    def _connect_failed(self, f: Any) -> None:
        """TCP or TLS failed before any protocol existed (no close to report it)."""
        if self._stopping:
            return
        reason = describe_connection_error(f, self.config.tls_client_cert) or f.getErrorMessage() or "connection failed"
        self.stats.last_error = f"could not connect: {reason}"[:200]
        self._note_retry(LogLevel.warn, "Could not connect to the backend at {endpoint}: {reason}",
                         endpoint=repr(self._endpoint), reason=reason)

    def _say_retry(self, attempt: int, delay: float) -> None:
        """The agent's one line per failed attempt: what happened, the delay (rounded), the attempt."""
        note, self._retry_note = self._retry_note, None
        if self._stopping:
            return
        level, fmt, fields = note or (LogLevel.warn, "Could not connect to the backend at {endpoint}",
                                      {"endpoint": repr(self._endpoint)})
        if level is None:
            level, fmt, fields = LogLevel.debug, "Connection attempt {attempt} to the backend failed", {}
        counted = " (attempt {attempt}, refusal {n})" if "n" in fields else " (attempt {attempt})"
        self.log.emit(level, fmt + "; retrying in {delay:.1f} s" + counted,
                      **fields, delay=round(delay, 1), attempt=attempt)

    def _start_client(self) -> None:
        assert self._factory is not None
        self._client = ClientService(
            self._endpoint, self._factory, retryPolicy=self._policy, clock=self._reactor
        )
        self._client.startService()

    def _reconnect_now(self) -> None:
        """
        Connect at once instead of after the pending retry delay (after a re-enrollment: the
        new credential is good, waiting for the backoff would only delay the node).
        """
        client = self._client
        if client is None or self.proto is not None or self._stopping:
            return
        self._client = None

        def restart(_: object) -> None:
            if not self._stopping and self._client is None and self._factory is not None:
                self._start_client()

        client.stopService().addBoth(restart)

    # -- connection events (called by the protocol) ---------------------------------------

    def connection_opened(self, proto: AgentClientProtocol) -> None:
        if self.proto is not None and self.proto is not proto:
            self.log.warn("A second connection opened; closing the older one")
            self.proto.sendClose(1000, "superseded")
        self.proto = proto
        self.stats.opens += 1
        self.stats.last_open_at = self._wallclock()
        self.stats.last_error = ""
        self._refusals = 0
        self._first_refusal_at = None
        if self.state.get("refusals") is not None:
            self.state.note(refusals=None)
        if self.state.get("previous_credential"):
            # The current credential works: stop alternating.
            self.state.note(previous_credential=None)
        if self._revoked:
            self._revoked = False
        self._whoami_asked = False
        self.deleted_detail = None
        self._last_sent_at = self._reactor.seconds()
        # A connect counts as activity: the first command after a node (re)connects is
        # picked up as fast as the next ones.
        self._last_activity = self._last_sent_at
        self.dispatch.connection_opened()
        self._schedule_poll()
        self.log.info("Connected to the backend stream at {url}", url=stream_url(self.config.backend_url))
        if not self._dispatch_said:
            self._dispatch_said = True
            self._say_dispatch_mode()
        if self._unverified_tls and self.stats.opens > 1:
            self.log.warn(
                "TLS verification is OFF (LLM_PORT_NODE_AGENT_VERIFY_TLS=false): this connection "
                "to the backend is open to interception"
            )
        self._say_token_removable()
        for listener in list(self._listeners):
            try:
                listener.session_opened()
            except Exception:
                self.log.failure("A session listener failed on open")

    def _say_token_removable(self) -> None:
        """Once per run, after the backend accepted a stored credential: the token can go."""
        token = self.config.enrollment_token
        if not token or self._token_line_said:
            return
        self._token_line_said = True
        if token_fingerprint(token) in self.state.get("used_tokens", []):
            why = "it was used to enroll this node (tokens are single use)"
        else:
            why = "it was not needed (it is still unused)"
        self.log.info(
            "The backend accepted the credential stored in {path}; the enrollment token in "
            "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN can be removed from the configuration: {why}",
            path=self.state.path,
            why=why,
        )

    def frame_received(self, proto: AgentClientProtocol, frame: dict[str, Any]) -> None:
        if proto is not self.proto:
            return
        self.stats.frames_received += 1
        kind = frame.get("type")
        key = kind if isinstance(kind, str) and kind in INBOUND_TYPES else "other"
        self.stats.frames_in[key] = self.stats.frames_in.get(key, 0) + 1
        items = frame.get("items") if kind == "commands" else frame.get("commands") if kind == "hello_ack" else None
        if isinstance(items, list):
            if kind == "hello_ack":
                self.dispatch.hello_received(items)
            else:
                self.dispatch.commands_received(items)
        if isinstance(items, list) and items:
            self.note_activity()
        if frame.get("type") == "hello_ack":
            sid = frame.get("session_id")
            nid = frame.get("node_id")
            self.session_id = sid if isinstance(sid, str) else None
            if isinstance(nid, str) and nid and nid != self.node_id:
                self.node_id = nid
                self.state.note(node_id=nid)
        for listener in list(self._listeners):
            try:
                listener.frame_received(frame)
            except Exception:
                self.log.failure("A session listener failed on an inbound frame")

    def connection_closed(
        self,
        proto: AgentClientProtocol,
        wasClean: bool,
        code: int | None,
        reason: str | None,
        http_status: int | None,
    ) -> None:
        now = self._reactor.seconds()
        opened_for = None if proto.opened_at is None else now - proto.opened_at
        self.failures.opened_for(opened_for)
        self.stats.frames_sent += proto.frames_sent
        self.stats.closes += 1
        self.stats.last_close = {
            "clean": bool(wasClean),
            "code": code or 0,
            "reason": (reason or "")[:200],
            "http_status": http_status or 0,
            "opened_for_sec": round(opened_for or 0.0, 1),
        }
        if proto is self.proto:
            self.proto = None
            self._cancel_poll()
            self.dispatch.connection_closed()
            for listener in list(self._listeners):
                try:
                    listener.session_closed()
                except Exception:
                    self.log.failure("A session listener failed on close")
        if self._stopping:
            return
        if opened_for is None:
            self.stats.refused += 1
            self.stats.last_error = (
                f"stream refused (HTTP {http_status})" if http_status else f"could not connect: {reason or 'connection failed'}"
            )[:200]
            self._refused(http_status, reason, getattr(proto, "lost_reason", None))
        else:
            self.stats.last_error = f"stream closed (code {code}, {reason or 'no reason'})"[:200]
            self._note_retry(
                LogLevel.info,
                "Backend stream closed (code {code}, {reason}) after {seconds:.0f} s; reconnecting",
                code=code,
                reason=reason or "no reason",
                seconds=round(opened_for, 1),
            )

    def _refused(self, http_status: int | None, reason: str | None, lost: Any = None) -> None:
        if http_status not in (401, 403):
            described = (
                describe_connection_error(lost, self.config.tls_client_cert) if lost is not None else None
            )
            self._note_retry(
                LogLevel.warn,
                "Could not open the backend stream: {reason}",
                reason=described or reason or "connection failed",
            )
            return
        now = self._wallclock()
        self._refusals += 1
        if self._first_refusal_at is None or self._first_refusal_at > now:
            self._first_refusal_at = now
        self.state.note(refusals={"count": self._refusals, "first_at": self._first_refusal_at})
        token = self.config.enrollment_token
        if token and token_fingerprint(token) not in self.state.get("used_tokens", []):
            # A token this node never used: re-enrolling with it is harmless (same agent id:
            # the same node row, or a new one after a deletion) and fixes a deleted node or a
            # lost credential now rather than after minutes of refusals.
            if not self._enrolling:
                self.log.warn(
                    "The backend refused this node's credential (HTTP {status}); enrolling again "
                    "with the configured enrollment token (agent id {agent_id})",
                    status=http_status,
                    agent_id=self.config.agent_id,
                )
                self._reenroll(token)
            return
        previous = self.state.get("previous_credential")
        alternate = isinstance(previous, str) and bool(previous) and previous != self.state.credential
        if not alternate and not self._whoami_asked and self.state.credential:
            # The current generation can tell at once whether this credential is still a
            # member's (the April one has no whoami: its 404 is for the route itself).
            self._whoami_asked = True
            self._ask_whoami(http_status, self.state.credential)
        if alternate:
            # Two credentials are kept only while it is unknown which one the backend honours
            # (a rotation whose reply was lost, a re-enrollment): alternate between them.
            self.log.warn(
                "The backend refused the current credential (HTTP {status}); trying the other "
                "stored one",
                status=http_status,
            )
            self.state.note(credential=previous, previous_credential=self.state.credential)
        span = now - self._first_refusal_at
        if self.deleted_detail is not None:
            self._note_retry(
                LogLevel.warn,
                "The backend still refuses the stream (HTTP {status}): this node was deleted or its "
                "credential revoked (see above)",
                status=http_status,
            )
        elif self._refusals >= self.revoked_after_refusals and span >= self.revoked_after_seconds:
            self._credential_revoked()
            self._note_retry(None, "")
        else:
            self._note_retry(
                LogLevel.warn,
                "The backend refused the stream (HTTP {status})",
                status=http_status,
                n=self._refusals,
            )

    def _ask_whoami(self, http_status: int, credential: str) -> None:
        async def ask() -> None:
            try:
                await self._request(self.backend.whoami(credential, ROTATION_TIMEOUT))
            except Rejected as e:
                if self._stopping or self.proto is not None or credential != self.state.credential:
                    return
                self.deleted_detail = f"HTTP {e.status}: {e.detail}"[:200]
                self._revoked = True
                self.stats.last_error = "node deleted or credential revoked"
                self.log.error(
                    "The backend refused the stream (HTTP {status}) and does not know this node's "
                    "credential any more (whoami {detail}): the node was deleted in llm-port or its "
                    "credential revoked. To bring it back: sudo llmport-agent join {url} (an "
                    "administrator approves the code it shows), or {help} and set "
                    "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN, then restart the agent; retrying every {every:.0f} s",
                    status=http_status,
                    detail=self.deleted_detail,
                    url=self.config.backend_url,
                    help=TOKEN_HELP,
                    every=self.revoked_retry_seconds,
                )
            except (RouteMissing, Transient, CancelledError):
                pass  # an April backend, or no answer: the refusals are counted as before

        d = Deferred.fromCoroutine(ask())
        d.addErrback(lambda f: self.log.failure("Asking the backend whoami failed", failure=f))

    def _reenroll(self, token: str) -> None:
        async def run() -> None:
            if await self._enroll(token, reenroll=True):
                self._reconnect_now()

        d = Deferred.fromCoroutine(run())
        d.addErrback(lambda f: self.log.failure("Re-enrollment failed", failure=f))
        self._track_critical(d)

    def _credential_revoked(self) -> None:
        self._revoked = True
        self.log.error(
            "The backend refuses this node's credential (HTTP 403, {n} times): the node was probably "
            "deleted or its credential revoked. To re-enroll, {help} and set "
            "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN, then restart the agent. Retrying every {every:.0f} s.",
            n=self._refusals,
            help=TOKEN_HELP,
            every=self.revoked_retry_seconds,
        )

    # -- sending ---------------------------------------------------------------------------

    def send(self, frame: dict[str, Any]) -> bool:
        """Send one frame now if connected (C{seq} is set here). False when not connected."""
        return self._send(frame, seq=True)

    def _send(self, frame: dict[str, Any], *, seq: bool) -> bool:
        proto = self.proto
        if proto is None or not proto.can_send:
            return False
        try:
            if seq:
                proto.send_frame(frame)
            else:
                proto.send_frame(frame, seq=False)
        except Disconnected:
            return False
        except Exception:
            self.log.failure("Could not send a {type} frame", type=frame.get("type"))
            return False
        self._last_sent_at = self._reactor.seconds()
        self.dispatch.frame_sent()
        kind = str(frame.get("type"))[:32]
        self.stats.frames_out[kind] = self.stats.frames_out.get(kind, 0) + 1
        if kind in COMMAND_FRAMES:
            self._last_activity = self._last_sent_at
        self._schedule_poll()
        return True

    def confirm(self) -> Deferred[None] | None:
        """Fires when all frames sent so far reached the backend; None when disconnected."""
        proto = self.proto
        if proto is None or not proto.can_send:
            return None
        try:
            return proto.confirm()
        except Disconnected:
            return None

    # -- polling -------------------------------------------------------------------------

    def note_activity(self) -> None:
        """A command arrived or is being worked on: poll fast from now on (for the window)."""
        now = self._reactor.seconds()
        was_active = self.poll_active(now)
        self._last_activity = now
        if not was_active and self.proto is not None:
            self._schedule_poll()

    def poll_active(self, now: float | None = None) -> bool:
        """True while polls go every COMMAND_POLL_INTERVAL_SEC (see the module docstring)."""
        if self._busy is not None:
            try:
                if self._busy() > 0:
                    return True
            except Exception:
                self.log.failure("Could not tell whether commands are running")
                return True
        last = self._last_activity
        if last is None:
            return False
        now = self._reactor.seconds() if now is None else now
        return now - last < self.config.command_poll_active_window_sec

    def poll_interval(self) -> float:
        """Seconds from the last frame sent to the next poll, as things stand now."""
        if self.poll_active():
            return self.config.command_poll_interval_sec
        return self.config.poll_idle_interval

    def _schedule_poll(self, since: float | None = None) -> None:
        """
        (Re)arm the poll: the next frame leaves at most one poll interval after the last one
        sent (or after C{since}).
        """
        if self.proto is None or self._stopping:
            return
        if self.dispatch.push:
            # The backend sends each command as it is queued: a poll would buy nothing.
            self._cancel_poll()
            return
        now = self._reactor.seconds()
        base = self._last_sent_at if since is None else since
        delay = max(0.0, base + self.poll_interval() - now)
        if self._poll is not None and self._poll.active():
            self._poll.reset(delay)
        else:
            self._poll = self._reactor.callLater(delay, self._poll_now)

    def _cancel_poll(self) -> None:
        poll, self._poll = self._poll, None
        if poll is not None and poll.active():
            poll.cancel()

    def _poll_now(self) -> None:
        self._poll = None
        # No seq: a poll has no side effects, and a frame without seq spares the backend its
        # session-offset write (protocol 3.2).
        if self.proto is not None and not self._send({"type": "poll"}, seq=False):
            self._schedule_poll(since=self._reactor.seconds())

    # -- dispatch mode (protocol 10.1) ---------------------------------------------------

    def _restore_refusals(self) -> None:
        """The refusals persisted by the last run (the state file is loaded by now)."""
        if self.stats.opens or self._refusals:
            return  # this run already counted (or opened): its own count stands
        refusals = self.state.get("refusals")
        if isinstance(refusals, dict):
            count, first = refusals.get("count"), refusals.get("first_at")
            if (
                isinstance(count, int)
                and not isinstance(count, bool)
                and count > 0
                and isinstance(first, (int, float))
                and not isinstance(first, bool)
            ):
                self._refusals, self._first_refusal_at = count, float(first)

    def _restore_dispatch_mode(self) -> None:
        """The mode remembered in the state file for this backend URL (loaded by now)."""
        remembered = self.state.get("dispatch")
        if (
            isinstance(remembered, dict)
            and remembered.get("backend") == token_fingerprint(self.config.backend_url)
            and remembered.get("mode") == PUSH
            and self.stats.opens == 0
        ):
            self.dispatch.restore(
                PUSH, "remembered: the backend at this URL pushed commands before (polling resumes "
                "at the first sign that it answers frames instead)",
            )

    def _say_dispatch_mode(self) -> None:
        if self.dispatch.push:
            self.log.info("Command dispatch: push, no polling ({reason})", reason=self.dispatch.reason)
        else:
            self.log.info(
                "Command dispatch: polling, every {fast:g} s while active and {idle:g} s when idle "
                "({reason}); it stops if the backend shows that it pushes commands",
                fast=self.config.command_poll_interval_sec,
                idle=self.config.poll_idle_interval,
                reason=self.dispatch.reason,
            )

    def _dispatch_changed(self, mode: str, reason: str) -> None:
        self._dispatch_said = True
        if mode == PUSH:
            self.log.info("Command dispatch: push, polling stopped ({reason})", reason=reason)
            self._cancel_poll()
        else:
            self.log.info("Command dispatch: back to polling ({reason})", reason=reason)
            self._schedule_poll()
        self.state.note(
            dispatch={
                # A fingerprint: the URL may carry user info.
                "backend": token_fingerprint(self.config.backend_url),
                "mode": mode,
                "since": self._wallclock(),
            }
        )

    # -- rotation --------------------------------------------------------------------------

    def _rotation_tick(self) -> Deferred[None] | None:
        last = self.state.get("last_rotation_at") or self.state.get("enrolled_at")
        now = self._wallclock()
        if last is None or float(last) > now + 3600:
            # Never rotated, or the wall clock was ahead when we did (NTP corrected it since):
            # count from now rather than postpone rotation for as long as the clock was wrong.
            self.state.note(last_rotation_at=now)
            return None
        if now - float(last) < ROTATION_INTERVAL or self._rotating:
            return None
        proto = self.proto
        if proto is None or proto.opened_at is None:
            return None
        if self._reactor.seconds() - proto.opened_at < 60:
            return None
        self.rotate().addErrback(lambda f: self.log.failure("Credential rotation failed", failure=f))
        return None

    def rotate(self) -> Deferred[bool]:
        """Rotate the credential now (see L{_rotate}); a stop waits for it."""
        d = Deferred.fromCoroutine(self._rotate())
        self._track_critical(d)
        return d

    async def _rotate(self) -> bool:
        """
        Rotate the credential (protocol 2). The backend revokes the old credential before it
        replies, so an unknown outcome keeps both: the new one if it arrived, else the old one.
        """
        old = self.state.credential
        if not old:
            return False
        self._rotating = True
        try:
            try:
                _, new = await self._request(self.backend.rotate(old, ROTATION_TIMEOUT))
            except CancelledError:
                self.log.warn(
                    "Credential rotation was cut short by the stop; its outcome is unknown. The "
                    "current credential stays in use; if the backend refuses it, this node needs a "
                    "new enrollment token."
                )
                return False
            except Rejected as e:
                self.stats.rotation_errors += 1
                self.log.warn(
                    "Credential rotation refused ({detail}); keeping the current credential",
                    detail=e.detail,
                )
                await self.state.update(last_rotation_at=self._wallclock())
                return False
            except Transient as e:
                self.stats.rotation_errors += 1
                self.log.warn(
                    "Credential rotation outcome unknown ({error}); the backend may have revoked the "
                    "current credential. It stays in use; if the backend refuses it, this node needs a "
                    "new enrollment token.",
                    error=str(e),
                )
                await self.state.update(last_rotation_at=self._wallclock())
                return False
            # The backend revoked the old credential before replying: it is useless now.
            await self.state.update(
                credential=new, previous_credential=None, last_rotation_at=self._wallclock()
            )
            self.stats.rotations += 1
            self.log.info("Credential rotated; the new one is stored in {path}", path=self.state.path)
            return True
        finally:
            self._rotating = False

    # -- stop ------------------------------------------------------------------------------

    def _track_critical(self, d: Deferred[Any]) -> None:
        """Enrollment and rotation: a stop waits for them, or a credential could be lost."""
        self._critical.add(d)

        def done(result: object) -> object:
            self._critical.discard(d)
            return result

        d.addBoth(done)

    def stopService(self) -> Deferred[None]:
        super().stopService()
        self._stopping = True
        if self._sleeping is not None:
            self._sleeping.cancel()  # retry delays end at once
        pending = [d for d in self._critical if not d.called]
        if self._starting is not None and not self._starting.called:
            pending.append(self._starting)
        if pending:
            # An enrollment or rotation whose request is in flight gets a moment to bring back
            # its reply and store the credential (the backend may already have consumed the
            # token / revoked the old one), then it is cancelled: a stop takes at most ~2 s,
            # whatever REQUEST_TIMEOUT_SEC is.
            from twisted.internet.defer import DeferredList

            cancel = self._reactor.callLater(CRITICAL_STOP_GRACE, self._cancel_requests)
            waiting: Deferred[Any] = DeferredList(pending, consumeErrors=True)
            waiting.addTimeout(CRITICAL_STOP_GRACE + 1.0, self._reactor)
            waiting.addErrback(lambda _: None)

            def done(_: object) -> Deferred[None]:
                if cancel.active():
                    cancel.cancel()
                self._cancel_requests()
                return self._stop_connection()

            return waiting.addCallback(done)
        return self._stop_connection()

    def _cancel_requests(self) -> None:
        for d in list(self._requests):
            d.cancel()

    def _stop_connection(self) -> Deferred[None]:
        self._cancel_poll()
        for loop_name in ("_rotation_loop",):
            loop = getattr(self, loop_name)
            if loop is not None and loop.running:
                loop.stop()
            setattr(self, loop_name, None)
        client, self._client = self._client, None
        proto = self.proto
        if client is None:
            return succeed(None)
        if proto is not None:
            proto.sendClose(code=1000, reason="agent stopping")
            closed: Deferred[Any] = Deferred()
            proto.is_closed.addBoth(lambda r: closed.callback(None) if not closed.called else None)
            closed.addTimeout(5, self._reactor, onTimeoutCancel=lambda *_: None)

            def stop_client(_: object) -> Deferred[None]:
                return client.stopService()

            return closed.addCallback(stop_client)
        return client.stopService()
