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

This module holds the connection (ClientService, the endpoint, the connection events, sending)
and composes the collaborators, each a class that owns its state and is told what happens
through its methods: L{Enrollment}, L{Refusals} (refused upgrades, whoami, revoked), L{Polling}
(polls and the dispatch mode), L{Rotation}, L{StopGate} (what a stop waits for or cancels),
L{KeepAlive} (dead-link detection, ticked by the heartbeat loop through L{keepalive_tick}),
and L{Link}, the connection lifecycle as an Automat machine (the C{phase} reported). They get
what they need from the session as callbacks at construction and never import this module;
the values they share live in L{llmport_agent.session.shared}.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from autobahn.exception import Disconnected
from twisted.application.internet import ClientService
from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.logger import Logger, LogLevel
from zope.interface import implementer

from llmport_agent.core.backoff import Backoff, FailureCounter, retry_policy
from llmport_agent.core.cleantext import node_id_problem
from llmport_agent.core.cleantext import shown as shown_text
from llmport_agent.core.config import AgentConfig, mask_url
from llmport_agent.core.state import StateStore, token_fingerprint
from llmport_agent.session.backend_http import BackendHTTP
from llmport_agent.session.enrollment import Enrollment
from llmport_agent.session.keepalive import KeepAlive
from llmport_agent.session.lifecycle import Link
from llmport_agent.session.polling import Polling
from llmport_agent.session.protocol import (
    HARD_MAX_FRAME,
    AgentClientFactory,
    AgentClientProtocol,
)
from llmport_agent.session.refusal import (
    Refusals,
)
from llmport_agent.session.rotation import (
    Rotation,
)
from llmport_agent.session.shared import (
    EXIT_NEEDS_OPERATOR,
    INBOUND_TYPES,
    TOKEN_HELP,
    SessionListener,
    SessionStats,
)
from llmport_agent.session.stop import StopGate
from llmport_agent.session.tls import client_tls_options, describe_connection_error

STREAM_PATH = "/api/admin/system/nodes/stream"

#: Importable from here as before the split (the agent, tests).
__all__ = ["STREAM_PATH", "SessionService", "stream_url"]


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
        self._starting: Deferred[None] | None = None
        self._factory: AgentClientFactory | None = None
        self._endpoint: Any = None
        self._tls_creator: Any = None
        #: What the failed attempt was, said with the retry delay (L{_say_retry}).
        self._retry_note: tuple[LogLevel | None, str, dict[str, Any]] | None = None
        #: The connection lifecycle (stopped, connecting, connected, backing off).
        self.link = Link()
        #: Dead-link detection, ticked by the heartbeat loop (L{keepalive_tick}).
        self.keepalive = KeepAlive(reactor)
        self._build_collaborators(capabilities, busy)

    def _build_collaborators(
        self, capabilities: Callable[[], Deferred[dict[str, Any]]], busy: Callable[[], int] | None
    ) -> None:
        """Each collaborator gets what it needs from the session as values and callbacks."""
        reactor, config, state, log = self._reactor, self.config, self.state, self.log
        self.gate = gate = StopGate(reactor)
        self.enrollment = Enrollment(
            config=config, state=state, backend=self.backend, capabilities=capabilities,
            version=self.version, wallclock=self._wallclock, gate=gate, backoff=self.backoff,
            stats=self.stats, log=log, fatal=self._fatal, enrolled=self._enrolled,
            reconnect=self._reconnect_now, failed=self._attempt_failed,
        )
        self.refusals = Refusals(
            config=config, state=state, backend=self.backend, wallclock=self._wallclock, gate=gate,
            log=log, note_retry=self._note_retry, failed=self._attempt_failed,
            enrolling=lambda: self.enrollment.enrolling, reenroll=self.enrollment.reenroll,
            connected=lambda: self.proto is not None,
        )
        self.rotation = Rotation(
            clock=reactor, state=state, backend=self.backend, wallclock=self._wallclock, gate=gate,
            stats=self.stats, log=log, opened_at=self._opened_at,
        )
        self.polling = Polling(
            clock=reactor, config=config, state=state, wallclock=self._wallclock, log=log, busy=busy,
            send_poll=lambda: self._send({"type": "poll"}, seq=False),
            connected=lambda: self.proto is not None, stopping=lambda: gate.stopping,
        )
        #: Push or polling (protocol 10.1), as decided by the L{Polling} collaborator.
        self.dispatch = self.polling.dispatch

    def _attempt_failed(self, error: str) -> None:
        """An attempt (connect, upgrade, enrollment) failed: said in diagnostics, backing off."""
        self.stats.last_error = error[:200]
        if self.proto is None:
            self.link.failed()

    def _enrolled(self, node_id: str) -> None:
        self.refusals.forget()
        self.node_id = node_id

    def _opened_at(self) -> float | None:
        proto = self.proto
        return None if proto is None else proto.opened_at

    @property
    def deleted_detail(self) -> str | None:
        """What the backend (current generation) said when it disowned the credential, or None."""
        return self.refusals.deleted_detail

    # -- wiring ----------------------------------------------------------------------------

    def subscribe(self, listener: SessionListener) -> None:
        self._listeners.append(listener)

    @property
    def connected(self) -> bool:
        return self.proto is not None

    @property
    def phase(self) -> str:
        """
        connected, enrolling, refused (credential revoked), backing_off, connecting or stopped:
        the lifecycle's state (L{Link}), with an enrollment running or a revoked credential
        said instead of connecting or backing off.
        """
        word = self.link.phase()
        if word in ("connected", "stopped"):
            return word
        if self.enrollment.enrolling:
            return "enrolling"
        if self.refusals.revoked:
            return "refused"
        return word

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
        self.link.start()
        self.gate.start()
        self.refusals.restore(self.stats.opens)
        self.polling.restore_mode(self.stats.opens)
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
        issuer = self.state.get("backend_url")
        if self.state.credential and isinstance(issuer, str) and issuer:
            from llmport_agent.host.join import same_backend

            if not same_backend(issuer, self.config.backend_url):
                # The credential goes only to the backend that issued it (join, start, here).
                self._fatal(
                    EXIT_NEEDS_OPERATOR,
                    f"The stored credential was issued by {mask_url(issuer)}, but BACKEND_URL is "
                    f"{mask_url(self.config.backend_url)}: it is not sent there. Set BACKEND_URL back, or "
                    f"join the new backend (llmport-agent join {mask_url(self.config.backend_url)})",
                )
                return
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
            ok = await self.enrollment.enroll(token)
            if not ok:
                return
        else:
            self._fatal(
                EXIT_NEEDS_OPERATOR,
                f"No credential in {self.state.path} and no enrollment token: {TOKEN_HELP} "
                "and set LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN",
            )
            return
        if self.gate.stopping:
            return
        self._connect()

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
        # No Autobahn auto-ping: its ping timer and pong timeout (left in the reactor's heap
        # when cancelled) woke the reactor 6 times a minute; the keep-alive rides the
        # heartbeat's tick instead (L{keepalive_tick}).
        factory.setProtocolOptions(
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
            delay = self.refusals.retry_delay(lambda: base_policy(attempt))
            self._say_retry(max(attempt, self.failures.failures), delay)
            return delay

        #: The retry policy handed to ClientService (seconds before attempt C{n}).
        self.retry_policy = policy
        self._start_client()
        self.rotation.start()

    def _note_retry(self, level: LogLevel | None, fmt: str, **fields: Any) -> None:
        """
        What went wrong with this attempt, said together with the retry delay in one line when
        ClientService asks for the delay (at once, in the same call chain as the close). C{None}
        as the level: already said (a line of its own); the retry is then only logged at debug.
        A C{reason} loses its closing full stop (Twisted's "... Connection refused."): the line
        goes on with "; retrying in".
        """
        if isinstance(fields.get("reason"), str):
            fields["reason"] = fields["reason"].rstrip(" .") or "no reason given"
        self._retry_note = (level, fmt, fields)

    def _connect_failed(self, f: Any) -> None:
        """TCP or TLS failed before any protocol existed (no close to report it)."""
        if self.gate.stopping:
            return
        reason = describe_connection_error(f, self.config.tls_client_cert) or f.getErrorMessage() or "connection failed"
        reason = reason.rstrip(" .") or "connection failed"  # the line goes on "; retrying in ..."
        self._attempt_failed(f"could not connect: {reason}")
        self._note_retry(LogLevel.warn, "Could not connect to the backend at {endpoint}: {reason}",
                         endpoint=repr(self._endpoint), reason=reason)

    def _say_retry(self, attempt: int, delay: float) -> None:
        """The agent's one line per failed attempt: what happened, the delay (rounded), the attempt."""
        note, self._retry_note = self._retry_note, None
        if self.gate.stopping:
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
            self._endpoint, self._factory, retryPolicy=self.retry_policy, clock=self._reactor
        )
        self._client.startService()

    def _reconnect_now(self) -> None:
        """
        Connect at once instead of after the pending retry delay (after a re-enrollment: the
        new credential is good, waiting for the backoff would only delay the node).
        """
        client = self._client
        if client is None or self.proto is not None or self.gate.stopping:
            return
        self._client = None

        def restart(_: object) -> None:
            if not self.gate.stopping and self._client is None and self._factory is not None:
                self._start_client()

        client.stopService().addBoth(restart)

    # -- connection events (called by the protocol) ---------------------------------------

    def connection_opened(self, proto: AgentClientProtocol) -> None:
        if self.proto is not None and self.proto is not proto:
            self.log.warn("A second connection opened; closing the older one")
            self.proto.sendClose(1000, "superseded")
        self.proto = proto
        self.keepalive.opened(proto)
        self.link.opened()
        self.stats.opens += 1
        self.stats.last_open_at = self._wallclock()
        self.stats.last_error = ""
        self.refusals.opened()
        self.polling.opened()
        self.log.info("Connected to the backend stream at {url}", url=stream_url(self.config.backend_url))
        self.polling.say_mode_once()
        if self._unverified_tls and self.stats.opens > 1:
            self.log.warn(
                "TLS verification is OFF (LLM_PORT_NODE_AGENT_VERIFY_TLS=false): this connection "
                "to the backend is open to interception"
            )
        self.enrollment.say_token_removable()
        for listener in list(self._listeners):
            try:
                listener.session_opened()
            except Exception:
                self.log.failure("A session listener failed on open")

    def frame_received(self, proto: AgentClientProtocol, frame: dict[str, Any]) -> None:
        if proto is not self.proto:
            return
        self.stats.frames_received += 1
        kind = frame.get("type")
        key = kind if isinstance(kind, str) and kind in INBOUND_TYPES else "other"
        self.stats.frames_in[key] = self.stats.frames_in.get(key, 0) + 1
        items = frame.get("items") if kind == "commands" else frame.get("commands") if kind == "hello_ack" else None
        self.polling.frame_received(kind, items)
        if frame.get("type") == "hello_ack":
            sid = frame.get("session_id")
            nid = frame.get("node_id")
            self.session_id = sid if isinstance(sid, str) else None
            if nid not in (None, "") and nid != self.node_id:
                problem = node_id_problem(nid)
                if problem is None:
                    self.node_id = nid
                    self.state.note(node_id=nid)
                else:
                    # Checked where it is received: never stored, sent or printed as given.
                    self.log.error("The backend's hello_ack names a node id that is not one ({problem}: "
                                   "{value}); it is ignored (the node keeps {node_id}): check that BACKEND_URL "
                                   "is your llm-port backend", problem=problem, value=shown_text(repr(nid), 80),
                                   node_id=self.node_id or "-")
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
        self.keepalive.closed(proto)
        if proto is self.proto:
            self.proto = None
            self.polling.closed()
            for listener in list(self._listeners):
                try:
                    listener.session_closed()
                except Exception:
                    self.log.failure("A session listener failed on close")
        if self.gate.stopping:
            return
        if opened_for is None:
            self.stats.refused += 1
            self._attempt_failed(
                f"stream refused (HTTP {http_status})" if http_status else f"could not connect: {reason or 'connection failed'}"
            )
            self.refusals.refused(http_status, reason, getattr(proto, "lost_reason", None))
        else:
            self._attempt_failed(f"stream closed (code {code}, {reason or 'no reason'})")
            self._note_retry(
                LogLevel.info,
                "Backend stream closed (code {code}, {reason}) after {seconds:.0f} s",
                code=code,
                reason=reason or "no reason",
                seconds=round(opened_for, 1),
            )

    def keepalive_tick(self) -> None:
        """
        A tick of the heartbeat loop: judge the last keep-alive ping and send the next one, in
        the same reactor turn as the heartbeat (L{llmport_agent.session.keepalive}).
        """
        self.keepalive.tick()

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
        kind = str(frame.get("type"))[:32]
        self.stats.frames_out[kind] = self.stats.frames_out.get(kind, 0) + 1
        self.polling.frame_sent(kind)
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

    # -- polling (L{Polling}) --------------------------------------------------------------

    def note_activity(self) -> None:
        """A command arrived or is being worked on: poll fast from now on (for the window)."""
        self.polling.note_activity()

    def poll_active(self, now: float | None = None) -> bool:
        """True while polls go every COMMAND_POLL_INTERVAL_SEC (see the module docstring)."""
        return self.polling.poll_active(now)

    def poll_interval(self) -> float:
        """Seconds from the last frame sent to the next poll, as things stand now."""
        return self.polling.poll_interval()

    # -- rotation (L{Rotation}) --------------------------------------------------------------

    def rotate(self) -> Deferred[bool]:
        """Rotate the credential now; a stop waits for it."""
        return self.rotation.rotate()

    # -- stop ------------------------------------------------------------------------------

    def stopService(self) -> Deferred[None]:
        super().stopService()
        self.link.stop()
        return self.gate.stop(self._starting, self._stop_connection)

    def _stop_connection(self) -> Deferred[None]:
        """Close the stream cleanly (WebSocket close 1000) and stop reconnecting."""
        self.polling.cancel()
        self.rotation.stop()
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
