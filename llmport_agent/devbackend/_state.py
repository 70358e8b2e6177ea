"""
The stand-in backend's tables and the node protocol's semantics, without any networking.

Everything here runs on the reactor thread and never blocks. The behaviour follows
C{protocol.md} (sections 1-7) including its quirks: no guard on the command state machine,
field length limits that turn into a dropped connection, a node that stays C{offline} until
its first heartbeat, runtimes that go to C{error} when their node goes offline.

Two generations of the backend (protocol 10): C{"2026-04"} (sections 1-9) and C{"current"},
which adds re-dispatch of overdue in-flight commands at C{hello_ack}, the failure of every
in-flight command when the node's last stream closes, the silence and offline reapers, the
stale-session sweep, the C{canceled}/C{timed_out} statuses and retired idempotency keys.
Push dispatch (10.1) lives in the stream (L{_stream}); this module only calls C{wake}.

Secrets: enrollment tokens and credential secrets are kept only as SHA-256 hashes.
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import ipaddress
import secrets
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from attrs import field
from twisted.logger import Logger

from llmport_agent.core.values import define


class Clock(Protocol):
    """The time source the tables need (the reactor or a C{task.Clock})."""

    def seconds(self) -> float: ...


#: Marks a key of C{issue_command(raw_override=...)} to remove from the wire object.
OMIT: Any = object()

#: The backend generations the stand-in speaks (protocol sections 1-9, and section 10).
GENERATION_APRIL = "2026-04"
GENERATION_CURRENT = "current"
GENERATIONS = (GENERATION_APRIL, GENERATION_CURRENT)

# Command statuses that still get dispatched.
_PENDING = ("queued", "dispatched")
# Commands the agent holds (protocol 10.2, 10.3): re-dispatched when overdue, failed when the
# stream is lost, reaped when silent.
_IN_FLIGHT = ("dispatched", "acked", "running")
#: Terminal statuses (protocol 10.3); an idempotency key blocks only while not terminal.
TERMINAL = ("succeeded", "failed", "canceled", "timed_out")
# The backend's default command budget (timeout_sec null or 0).
DEFAULT_TIMEOUT_SEC = 900
# Reaper constants of the current generation (protocol 10.3), in seconds before scaling.
REAPER_MIN_SILENCE_SEC = 300.0
REAPER_OFFLINE_GRACE_SEC = 600.0
SESSION_STALE_SEC = 300.0
#: How often the current generation's reapers sweep, before scaling.
REAPER_INTERVAL_SEC = 60.0

STREAM_LOST_MESSAGE = (
    "The node's connection closed while this command was in flight, so the backend marked it "
    "failed; a result sent later replaces this."
)
# Runtime statuses that a node going offline turns into "error".
_LIVE_RUNTIME = ("running", "starting", "creating")
# Command types whose success sets the runtime running with the result's endpoint.
_ENDPOINT_TYPES = ("deploy_workload", "start_workload", "restart_workload")
_DEPLOY_PAYLOAD_TYPES = (
    "deploy_workload",
    "start_workload",
    "restart_workload",
    "update_workload",
)
_DEFAULT_TIMEOUTS = {"fetch_container_logs": 30}
_MAX_DISPATCH = 50

# Column sizes of the real database (protocol 1, 3.2, 6).
AGENT_ID_MAX = 128
VERSION_MAX = 64
STATUS_MAX = 64
ERROR_CODE_MAX = 128
EVENT_TYPE_MAX = 128
SEVERITY_MAX = 32
CORRELATION_ID_MAX = 128


class AuthError(Exception):
    """A bearer credential was refused; C{detail} is the real backend's exact text."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class EnrollRejected(Exception):
    """The enrollment token is unknown, expired or used (HTTP 401)."""

    detail = "Enrollment token is invalid or expired."

    def __init__(self) -> None:
        super().__init__(self.detail)


class StoreFailure(Exception):
    """What would be a database error in the real backend (HTTP 500 / dropped stream)."""


class FrameRejected(Exception):
    """The real backend's stream handler would fail on this frame and drop the connection."""


class _SkipFrame(Exception):
    """The current backend's handler skips the rest of this frame, its dispatch pass included."""


def _obj(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def hash_secret(secret: str) -> str:
    """SHA-256 hex digest of a secret; the only form in which secrets are kept."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def is_ip_literal(value: object) -> bool:
    """True when C{value} is a string holding an IPv4 or IPv6 address."""
    if not isinstance(value, str):
        return False
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def rewrite_endpoint(url: object, host: str | None) -> object:
    """
    Replace the host part of C{url} with C{host}, keeping scheme, port and path, as the real
    backend does with endpoints reported by a node. Anything that is not a URL with a host
    is returned unchanged.
    """
    if not isinstance(url, str) or not host:
        return url
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return url
    if not parts.scheme or not parts.hostname:
        return url
    shown = f"[{host}]" if ":" in host else host
    netloc = shown if port is None else f"{shown}:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _db_str(frame_type: str, name: str, value: object, limit: int | None) -> str | None:
    """
    Check a value bound for a string column: C{None} passes, a string passes within
    C{limit}; anything else breaks the real insert.

    @raise FrameRejected: naming the field.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise FrameRejected(f"{frame_type}.{name} is not a string")
    if limit is not None and len(value) > limit:
        raise FrameRejected(f"{frame_type}.{name} is longer than {limit} characters")
    return value


def _command_uuid(frame_type: str, value: object) -> str | None:
    """
    The C{command_id} of a frame: C{None} when absent (the frame is ignored), the canonical
    UUID string otherwise.

    @raise FrameRejected: for a value that is not a UUID string (a database error in the
        real backend).
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise FrameRejected(f"{frame_type}.command_id is not a string")
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise FrameRejected(f"{frame_type}.command_id is not a UUID") from None


#: Backend CPU per accepted frame, measured against the real backend (protocol 3.2): a frame
#: with C{seq} also writes the session's offset row.
CPU_MS_WITH_SEQ = 4.4
CPU_MS_WITHOUT_SEQ = 2.9


@define
class FrameCost:
    """
    What a node's frames would cost the real backend (protocol 3.2).

    @ivar frames: frames received that are JSON objects (dropped ones included).
    @ivar offset_writes: frames whose C{seq} passed the check (one offset-row write each).
    @ivar dispatch_queries: accepted frames (one pending-commands query and commit each).
    @ivar connects: streams opened.
    @ivar wakeup_drains: dispatch passes run because a command was queued (current
        generation's push); caused by the operator, not by the node's frames, so not in
        C{cpu_ms}.
    """

    frames: int = 0
    offset_writes: int = 0
    dispatch_queries: int = 0
    connects: int = 0
    wakeup_drains: int = 0

    @property
    def cpu_ms(self) -> float:
        """Estimated backend CPU: 4.4 ms per frame with seq, 2.9 ms per frame without."""
        without = max(0, self.dispatch_queries - self.offset_writes)
        return self.offset_writes * CPU_MS_WITH_SEQ + without * CPU_MS_WITHOUT_SEQ

    def add(self, other: FrameCost) -> None:
        self.frames += other.frames
        self.offset_writes += other.offset_writes
        self.dispatch_queries += other.dispatch_queries
        self.connects += other.connects
        self.wakeup_drains += other.wakeup_drains

    def to_dict(self) -> dict[str, Any]:
        return {
            "frames": self.frames,
            "offset_writes": self.offset_writes,
            "dispatch_queries": self.dispatch_queries,
            "connects": self.connects,
            "wakeup_drains": self.wakeup_drains,
            "cpu_ms": round(self.cpu_ms, 3),
        }


@define
class TokenRecord:
    id: str
    token_hash: str
    note: str | None
    created_at: float
    expires_at: float
    used_at: float | None = None


@define
class CredentialRecord:
    id: str
    node_id: str
    secret_hash: str
    created_at: float
    revoked_at: float | None = None


@define
class NodeRecord:
    id: str
    agent_id: str
    host: str
    status: str
    capabilities: Any
    version: str | None
    created_at: str
    updated_at: str
    last_seen: str | None = None
    profile: dict[str, Any] | None = None
    status_history: list[str] = field(factory=list)

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(
            {
                "id": self.id,
                "agent_id": self.agent_id,
                "host": self.host,
                "status": self.status,
                "capabilities": self.capabilities,
                "version": self.version,
                "created_at": self.created_at,
                "updated_at": self.updated_at,
                "last_seen": self.last_seen,
                "profile": self.profile,
            }
        )


@define
class CommandRecord:
    id: str
    node_id: str
    command_type: str
    status: str
    correlation_id: str | None
    idempotency_key: str
    payload: Any
    timeout_sec: int | None
    issued_at: str
    order: int
    result: Any = None
    error_code: str | None = None
    error_message: str | None = None
    dispatched_at: str | None = None
    acked_at: str | None = None
    started_at: str | None = None
    completed_at: str | None = None
    raw_override: dict[str, Any] | None = None
    history: list[str] = field(factory=list)
    timeline: list[dict[str, Any]] = field(factory=list)
    # Clock readings (seconds) behind the timestamps, for the current generation's overdue
    # and silence rules; and whether the agent itself sent a result (anomaly notes).
    issued_ts: float = 0.0
    dispatched_ts: float | None = None
    acked_ts: float | None = None
    started_ts: float | None = None
    agent_seen_ts: float | None = None
    agent_result: bool = False

    def timeout(self) -> int:
        """The command's budget in seconds (null or 0 means the backend default)."""
        if isinstance(self.timeout_sec, int) and self.timeout_sec > 0:
            return self.timeout_sec
        return DEFAULT_TIMEOUT_SEC

    def to_dict(self) -> dict[str, Any]:
        """The command object as the backend's API shows it (every field present)."""
        return copy.deepcopy(
            {
                "id": self.id,
                "node_id": self.node_id,
                "command_type": self.command_type,
                "status": self.status,
                "correlation_id": self.correlation_id,
                "idempotency_key": self.idempotency_key,
                "payload": self.payload,
                "result": self.result,
                "timeout_sec": self.timeout_sec,
                "error_code": self.error_code,
                "error_message": self.error_message,
                "issued_at": self.issued_at,
                "dispatched_at": self.dispatched_at,
                "acked_at": self.acked_at,
                "started_at": self.started_at,
                "completed_at": self.completed_at,
            }
        )

    def wire(self) -> dict[str, Any]:
        """The command object as sent on the stream, with C{raw_override} applied."""
        out = self.to_dict()
        for key, value in (self.raw_override or {}).items():
            if value is OMIT:
                out.pop(key, None)
            else:
                out[key] = copy.deepcopy(value)
        return out


@define
class RuntimeRecord:
    id: str
    node_id: str | None
    name: str | None
    status: str
    updated_at: str
    endpoint_url: Any = None
    error_message: str | None = None
    health_message: str | None = None
    history: list[str] = field(factory=list)

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(
            {
                "id": self.id,
                "node_id": self.node_id,
                "name": self.name,
                "status": self.status,
                "endpoint_url": self.endpoint_url,
                "error_message": self.error_message,
                "health_message": self.health_message,
                "updated_at": self.updated_at,
                "history": self.history,
            }
        )


class BackendState:
    """
    The stand-in's tables and the semantics of every node-facing operation.

    @ivar anomalies: per node, notes about frames the real backend would accept silently
        but that hint at an agent bug (unknown command ids, acks for foreign commands,
        dropped connections and why). Tests read them through L{DevBackend.anomalies}.
    """

    log = Logger()

    def __init__(
        self,
        clock: Clock,
        token_ttl: float = 1800.0,
        keep_frames: bool = True,
        *,
        generation: str = GENERATION_CURRENT,
        reaper_scale: float = 1.0,
    ) -> None:
        if generation not in GENERATIONS:
            raise ValueError(
                f"unknown backend generation {generation!r} (expected one of "
                f"{', '.join(GENERATIONS)})"
            )
        if not reaper_scale > 0:
            raise ValueError(f"reaper_scale must be greater than 0, not {reaper_scale!r}")
        self._clock = clock
        #: C{"2026-04"} or C{"current"} (see the module docstring).
        self.generation = generation
        #: Multiplies the reapers' own constants (300 s silence floor, 600 s offline grace,
        #: 300 s stale session, the sweep interval); never a command's C{timeout_sec}.
        self.reaper_scale = reaper_scale
        #: Called with a node id when a command is queued for it (current generation: push).
        self.wake: Callable[[str], None] | None = None
        #: Called with a command id once the command is terminal (its result, error code and
        #: message set): the stand-in's Ray driver waits on it instead of polling.
        self.finished: Callable[[str], None] | None = None
        self.token_ttl = token_ttl
        #: Keep a copy of every inbound frame (L{frames}); off for fleet benchmarks.
        self.keep_frames = keep_frames
        #: Per node: what its frames would cost the real backend.
        self.costs: dict[str, FrameCost] = {}
        self.tokens: dict[str, TokenRecord] = {}  # by token hash
        self.credentials: dict[str, CredentialRecord] = {}
        self.nodes: dict[str, NodeRecord] = {}
        self.commands: dict[str, CommandRecord] = {}
        self.runtimes: dict[str, RuntimeRecord] = {}
        self.inventories: dict[str, list[dict[str, Any]]] = {}
        self.events: dict[str, list[dict[str, Any]]] = {}
        self.frames: dict[str, list[dict[str, Any]]] = {}
        self.anomalies: dict[str, list[str]] = {}
        self.sessions: dict[str, dict[str, Any]] = {}
        # Per node, the ids of its sessions whose row is still open (closed_at None).
        self._open_sessions: dict[str, set[str]] = {}
        #: Per node, per model id: the model's availability on the node, as the current
        #: backend keeps it from C{sync_model} progress and results (protocol 10.4); the
        #: April generation keeps none.
        self.model_availability: dict[str, dict[str, dict[str, Any]]] = {}
        self._order = 0

    # -- time -------------------------------------------------------------------------------

    def now(self) -> float:
        return self._clock.seconds()

    def now_iso(self) -> str:
        return datetime.fromtimestamp(self.now(), tz=UTC).isoformat()

    @property
    def current(self) -> bool:
        """True for the current generation (protocol 10), false for April 2026."""
        return self.generation == GENERATION_CURRENT

    def note(self, node_id: str, text: str) -> None:
        """Record an anomaly for C{node_id} (see the class docstring)."""
        self.anomalies.setdefault(node_id, []).append(text)
        self.log.info("devbackend anomaly on node {node_id}: {text}", node_id=node_id, text=text)

    # -- enrollment and credentials ---------------------------------------------------------

    def mint_token(self, note: str | None = None) -> dict[str, Any]:
        """Create a single-use enrollment token (32 url-safe characters)."""
        token = secrets.token_urlsafe(24)
        now = self.now()
        record = TokenRecord(
            id=str(uuid.uuid4()),
            token_hash=hash_secret(token),
            note=note,
            created_at=now,
            expires_at=now + self.token_ttl,
        )
        self.tokens[record.token_hash] = record
        expires = datetime.fromtimestamp(record.expires_at, tz=UTC).isoformat()
        return {"id": record.id, "token": token, "expires_at": expires, "note": note}

    def _new_credential(self, node_id: str) -> str:
        secret = secrets.token_urlsafe(32)
        record = CredentialRecord(
            id=str(uuid.uuid4()),
            node_id=node_id,
            secret_hash=hash_secret(secret),
            created_at=self.now(),
        )
        self.credentials[record.id] = record
        return f"{record.id}.{secret}"

    def enroll(
        self,
        token: str,
        agent_id: str,
        host: str | None,
        capabilities: Any,
        version: str | None,
        caller_host: str,
    ) -> dict[str, Any]:
        """
        Trade an enrollment token for a node credential (protocol 1).

        @param caller_host: the first X-Forwarded-For entry, else the socket peer.
        @raise EnrollRejected: unknown, expired or used token.
        @raise StoreFailure: a value too long for its column (the token stays unused, as the
            real transaction rolls back).
        """
        record = self.tokens.get(hash_secret(token))
        now = self.now()
        if record is None or record.used_at is not None or now >= record.expires_at:
            raise EnrollRejected()
        if len(agent_id) > AGENT_ID_MAX:
            raise StoreFailure(f"agent_id is longer than {AGENT_ID_MAX} characters")
        if version is not None and len(version) > VERSION_MAX:
            raise StoreFailure(f"version is longer than {VERSION_MAX} characters")
        node_host = host if is_ip_literal(host) else caller_host
        assert node_host is not None
        record.used_at = now
        stamp = self.now_iso()
        node = self.node_by_agent_id(agent_id)
        if node is None:
            node = NodeRecord(
                id=str(uuid.uuid4()),
                agent_id=agent_id,
                host=node_host,
                status="healthy",
                capabilities=capabilities,
                version=version,
                created_at=stamp,
                updated_at=stamp,
                last_seen=stamp,
            )
            self.nodes[node.id] = node
        else:
            node.host = node_host
            node.capabilities = capabilities
            node.version = version
            node.updated_at = stamp
            node.last_seen = stamp
        self._set_node_status(node, "healthy")
        credential = self._new_credential(node.id)
        self.log.info(
            "devbackend: node {node_id} enrolled (agent_id {agent_id}, host {host})",
            node_id=node.id,
            agent_id=agent_id,
            host=node_host,
        )
        return {
            "node_id": node.id,
            "agent_id": agent_id,
            "credential": credential,
            "status": "healthy",
            "host": node_host,
        }

    def authenticate(self, header: str | None) -> tuple[NodeRecord, CredentialRecord]:
        """
        Check an C{Authorization} header value exactly as the real backend does.

        @raise AuthError: with the real backend's detail text.
        """
        if not header:
            raise AuthError("Missing Authorization header.")
        if not header.startswith("Bearer "):
            raise AuthError("Invalid Authorization header.")
        token = header[len("Bearer ") :]
        if not token:
            raise AuthError("Missing bearer token.")
        cred_id, sep, secret = token.partition(".")
        if not sep or not cred_id or not secret:
            raise AuthError("Invalid credential format.")
        try:
            key = str(uuid.UUID(cred_id))
        except ValueError:
            raise AuthError("Invalid credential id.") from None
        record = self.credentials.get(key)
        if record is None or record.revoked_at is not None:
            raise AuthError("Credential is invalid or revoked.")
        if not hmac.compare_digest(hash_secret(secret), record.secret_hash):
            raise AuthError("Credential secret mismatch.")
        node = self.nodes.get(record.node_id)
        if node is None:
            raise AuthError("Credential node no longer exists.")
        return node, record

    def rotate(self, record: CredentialRecord) -> dict[str, Any]:
        """Revoke C{record} at once and issue a new credential for its node."""
        record.revoked_at = self.now()
        credential = self._new_credential(record.node_id)
        self.log.info("devbackend: credential rotated for node {node_id}", node_id=record.node_id)
        return {"node_id": record.node_id, "credential": credential}

    def revoke_credentials(self, node_id: str) -> None:
        now = self.now()
        for record in self.credentials.values():
            if record.node_id == node_id and record.revoked_at is None:
                record.revoked_at = now

    def delete_node(self, node_id: str) -> None:
        self.nodes.pop(node_id, None)

    def node_by_agent_id(self, agent_id: str) -> NodeRecord | None:
        for node in self.nodes.values():
            if node.agent_id == agent_id:
                return node
        return None

    def _set_node_status(self, node: NodeRecord, status: str) -> None:
        if node.status != status or not node.status_history:
            node.status_history.append(status)
        node.status = status

    def set_profile(self, node_id: str, profile: Mapping[str, Any] | None) -> None:
        node = self.require_node(node_id)
        node.profile = copy.deepcopy(dict(profile)) if profile is not None else None

    def require_node(self, node_id: str) -> NodeRecord:
        """The record of C{node_id}; C{KeyError} for an unknown node."""
        node = self.nodes.get(node_id)
        if node is None:
            raise KeyError(f"unknown node {node_id!r}")
        return node

    # -- commands ---------------------------------------------------------------------------

    def issue_command(
        self,
        node_id: str,
        command_type: str,
        payload: Any,
        *,
        idempotency_key: str | None = None,
        correlation_id: str | None = None,
        timeout_sec: int | None = None,
        raw_override: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """
        Queue a command as the backend's admin and runtime APIs do. A command with the
        same C{idempotency_key} that is still queued, dispatched, acked or running is
        returned instead of a new one (which is how a lost command blocks later ones). The
        current generation renames the key of a terminal one to C{<key>::retired::<id>}
        and wakes the node's stream (push).
        """
        self.require_node(node_id)
        if idempotency_key is not None:
            for existing in self.commands.values():
                if existing.node_id != node_id or existing.idempotency_key != idempotency_key:
                    continue
                if existing.status in ("queued", "dispatched", "acked", "running"):
                    return existing.to_dict()
                if self.current and existing.status in TERMINAL:
                    existing.idempotency_key = f"{idempotency_key}::retired::{existing.id}"
        stamp = self.now_iso()
        self._order += 1
        record = CommandRecord(
            id=str(uuid.uuid4()),
            node_id=node_id,
            command_type=command_type,
            status="queued",
            correlation_id=correlation_id,
            idempotency_key=idempotency_key or str(uuid.uuid4()),
            payload=copy.deepcopy(payload),
            timeout_sec=(
                timeout_sec
                if timeout_sec is not None
                else _DEFAULT_TIMEOUTS.get(command_type, 900)
            ),
            issued_at=stamp,
            order=self._order,
            raw_override=dict(raw_override) if raw_override else None,
            history=["queued"],
            issued_ts=self.now(),
        )
        record.timeline.append(
            {"event_type": "issued", "message": None, "payload": {}, "ts": stamp}
        )
        self.commands[record.id] = record
        self._runtime_on_issue(record)
        if self.current and self.wake is not None:
            self.wake(node_id)
        return record.to_dict()

    def _runtime_on_issue(self, record: CommandRecord) -> None:
        """What the runtime API does to the runtime row when it issues a workload command."""
        if record.command_type not in _DEPLOY_PAYLOAD_TYPES or not isinstance(
            record.payload, dict
        ):
            return
        rid = record.payload.get("runtime_id")
        if not isinstance(rid, str) or not rid:
            return
        status = "creating" if record.command_type == "deploy_workload" else "starting"
        runtime = self.runtimes.get(rid)
        if runtime is None:
            name = record.payload.get("runtime_name")
            self.add_runtime(
                rid, record.node_id, name=name if isinstance(name, str) else None, status=status
            )
        else:
            runtime.node_id = record.node_id
            self._set_runtime(runtime, status, error_message=None)

    def take_dispatch(self, node_id: str) -> list[dict[str, Any]]:
        """
        The node's queued/dispatched commands, oldest first, at most 50, now marked
        C{dispatched}, as wire objects.
        """
        pending = sorted(
            (c for c in self.commands.values() if c.node_id == node_id and c.status in _PENDING),
            key=lambda c: c.order,
        )[:_MAX_DISPATCH]
        stamp = self.now_iso()
        out = []
        for record in pending:
            if record.status != "dispatched":
                self._set_command_status(record, "dispatched")
                record.timeline.append(
                    {"event_type": "dispatched", "message": None, "payload": {}, "ts": stamp}
                )
            if record.dispatched_at is None:
                record.dispatched_at = stamp
                record.dispatched_ts = self.now()
            out.append(record.wire())
        return out

    def hello_commands(self, node_id: str) -> list[dict[str, Any]]:
        """
        The commands of a C{hello_ack}: those of L{take_dispatch}; the current generation
        adds every overdue in-flight command (oldest first, at most 50) with
        C{"redispatch": true} and a C{re-dispatched} timeline row. An overdue command still
        C{dispatched} therefore appears twice, as in the real backend.
        """
        items = self.take_dispatch(node_id)
        if not self.current:
            return items
        now = self.now()
        stamp = self.now_iso()
        for record in self._in_flight(node_id)[:_MAX_DISPATCH]:
            if not self.is_overdue(record, now):
                continue
            record.timeline.append(
                {
                    "event_type": "re-dispatched",
                    "message": "Command re-dispatched (still in flight past its timeout).",
                    "payload": {},
                    "ts": stamp,
                }
            )
            wire = record.wire()
            wire["redispatch"] = True
            items.append(wire)
        return items

    def _in_flight(self, node_id: str | None) -> list[CommandRecord]:
        """In-flight commands (of one node, or all), oldest first."""
        return sorted(
            (
                c
                for c in self.commands.values()
                if (node_id is None or c.node_id == node_id) and c.status in _IN_FLIGHT
            ),
            key=lambda c: c.order,
        )

    @staticmethod
    def _anchor(record: CommandRecord) -> float:
        """When the agent last took the command on (start, ack), else dispatch or issue."""
        for ts in (record.started_ts, record.acked_ts, record.dispatched_ts):
            if ts is not None:
                return ts
        return record.issued_ts

    def is_overdue(self, record: CommandRecord, now: float | None = None) -> bool:
        """
        Protocol 10.2: a running command past twice its budget since it started (or was
        acked); any other in-flight command past its budget since its ack, dispatch or issue.
        """
        if record.status not in _IN_FLIGHT:
            return False
        now = self.now() if now is None else now
        if record.status == "running":
            anchor = record.started_ts if record.started_ts is not None else record.acked_ts
            budget = 2 * record.timeout()
        else:
            anchor = next(
                (t for t in (record.acked_ts, record.dispatched_ts) if t is not None),
                record.issued_ts,
            )
            budget = record.timeout()
        if anchor is None:
            return False
        return now - anchor > budget

    def silence_budget(self, record: CommandRecord) -> float:
        """How long a command may say nothing: max(300 s x scale, its timeout_sec)."""
        return max(REAPER_MIN_SILENCE_SEC * self.reaper_scale, float(record.timeout()))

    def cancel_command(self, command_id: str) -> dict[str, Any]:
        """
        Cancel a command that is not terminal (the current generation's admin action; the
        node is not told). C{KeyError} for an unknown id; C{ValueError} for a terminal
        command or on the April generation, which has no such status.
        """
        record = self.commands[command_id]
        if not self.current:
            raise ValueError("the 2026-04 backend cannot cancel commands")
        if record.status in TERMINAL:
            raise ValueError(f"command {command_id} is already {record.status}")
        self._finish_by_backend(record, "canceled", None, "Canceled by an administrator.")
        return record.to_dict()

    def _finish_by_backend(
        self, record: CommandRecord, status: str, error_code: str | None, message: str
    ) -> None:
        """A terminal status the backend sets itself (stream lost, reaped, canceled)."""
        stamp = self.now_iso()
        self._set_command_status(record, status)
        record.error_code = error_code
        record.error_message = message
        record.completed_at = stamp
        record.timeline.append(
            {"event_type": status, "message": message, "payload": {}, "ts": stamp}
        )
        node = self.nodes.get(record.node_id)
        if status != "canceled" and node is not None:
            self._runtime_on_result(node, record, False, None, message)
            if record.command_type == "sync_model" and self._sync_model_id(record, None):
                # A model copy that died with the stream (or was reaped) reads failed, not syncing.
                self._model_sync_result(node, record, False, None, error_code, message)
        if self.finished is not None:
            self.finished(record.id)

    # -- the current generation's reapers ---------------------------------------------------

    def sweep(self) -> None:
        """
        One pass of the current generation's reapers (protocol 10.3), as the real backend
        runs them periodically: overdue in-flight commands that stayed silent for
        L{silence_budget} on a connected node, or past the offline grace, become
        C{timed_out}; sessions without an accepted C{seq} frame for 300 s (x scale) are
        closed, and a node left without one loses its stream (offline, in-flight commands
        failed). Nothing on the April generation.
        """
        if not self.current:
            return
        self._reap_commands()
        self._close_stale_sessions()

    def _reap_commands(self) -> None:
        now = self.now()
        grace = REAPER_OFFLINE_GRACE_SEC * self.reaper_scale
        for record in self._in_flight(None):
            node = self.nodes.get(record.node_id)
            if node is None or not self.is_overdue(record, now):
                continue
            anchor = self._anchor(record)
            offline = node.status == "offline"
            if offline:
                if now - anchor < grace:
                    continue
                message = (
                    f"Timed out: the node has been offline past this command's "
                    f"{record.timeout()} s budget and the grace period."
                )
            else:
                last = anchor
                if record.agent_seen_ts is not None and record.agent_seen_ts > last:
                    last = record.agent_seen_ts
                budget = self.silence_budget(record)
                if now - last < budget:
                    continue
                message = (
                    f"Timed out: no ack, progress or result for {budget:g} s past this "
                    f"command's {record.timeout()} s budget while the node is connected."
                )
                self.note(
                    node.id,
                    f"{record.command_type} {record.id} timed out by the silence reaper "
                    f"(nothing from the agent for {now - last:.0f} s on a connected node)",
                )
            self._finish_by_backend(record, "timed_out", "command_timed_out", message)

    def _close_stale_sessions(self) -> None:
        cutoff = self.now() - SESSION_STALE_SEC * self.reaper_scale
        affected = set()
        for node_id, open_ids in list(self._open_sessions.items()):
            for session_id in list(open_ids):
                session = self.sessions[session_id]
                if session["last_heartbeat"] < cutoff:
                    self._close_session_row(session)
                    affected.add(node_id)
        for node_id in sorted(affected):
            if not self._has_open_session(node_id):
                node = self.nodes.get(node_id)
                if node is not None:
                    self._lost_last_stream(node)

    def _set_command_status(self, record: CommandRecord, status: str) -> None:
        if record.status != status:
            record.history.append(status)
        record.status = status

    # -- runtimes ---------------------------------------------------------------------------

    def add_runtime(
        self,
        runtime_id: str,
        node_id: str | None,
        *,
        name: str | None = None,
        status: str = "creating",
        endpoint_url: str | None = None,
    ) -> dict[str, Any]:
        record = RuntimeRecord(
            id=runtime_id,
            node_id=node_id,
            name=name,
            status=status,
            endpoint_url=endpoint_url,
            updated_at=self.now_iso(),
            history=[status],
        )
        self.runtimes[runtime_id] = record
        return record.to_dict()

    def _set_runtime(
        self, runtime: RuntimeRecord, status: str, *, error_message: str | None = None
    ) -> None:
        if runtime.status != status:
            runtime.history.append(status)
        runtime.status = status
        runtime.error_message = error_message
        runtime.updated_at = self.now_iso()

    def _runtime_for(self, payload: Any) -> RuntimeRecord | None:
        if not isinstance(payload, dict):
            return None
        rid = payload.get("runtime_id")
        if not isinstance(rid, str):
            return None
        return self.runtimes.get(rid)

    # -- sessions ---------------------------------------------------------------------------

    def cost(self, node_id: str) -> FrameCost:
        """The node's L{FrameCost} counters (created on first use)."""
        found = self.costs.get(node_id)
        if found is None:
            found = self.costs[node_id] = FrameCost()
        return found

    def session_opened(self, node_id: str) -> str:
        self.cost(node_id).connects += 1
        session_id = str(uuid.uuid4())
        self.sessions[session_id] = {
            "id": session_id,
            "node_id": node_id,
            "opened_at": self.now_iso(),
            "closed_at": None,
            # The real session row's last_heartbeat_at: set at connect and by every frame
            # whose seq passes the check (not by frames without seq).
            "last_heartbeat": self.now(),
        }
        self._open_sessions.setdefault(node_id, set()).add(session_id)
        return session_id

    def session_offset_accepted(self, session_id: str | None) -> None:
        """A frame's C{seq} passed the check: the session row's heartbeat time moves."""
        session = self.sessions.get(session_id) if session_id is not None else None
        if session is not None:
            session["last_heartbeat"] = self.now()

    def _has_open_session(self, node_id: str) -> bool:
        return bool(self._open_sessions.get(node_id))

    def _close_session_row(self, session: dict[str, Any]) -> None:
        session["closed_at"] = self.now_iso()
        open_ids = self._open_sessions.get(session["node_id"])
        if open_ids is not None:
            open_ids.discard(session["id"])
            if not open_ids:
                del self._open_sessions[session["node_id"]]

    def session_closed(self, session_id: str, last: bool) -> None:
        """
        Close a session; when it was the node's C{last} one, mark the node offline and its
        running/starting/creating runtimes C{error} "Node offline". The current generation
        counts open session rows (a stale session closed by L{sweep} no longer counts) and
        also fails every in-flight command (C{node_stream_lost}).
        """
        session = self.sessions.get(session_id)
        if session is None:
            return
        self._close_session_row(session)
        if self.current:
            last = not self._has_open_session(session["node_id"])
        if not last:
            return
        node = self.nodes.get(session["node_id"])
        if node is None:
            return
        self._lost_last_stream(node)

    def _lost_last_stream(self, node: NodeRecord) -> None:
        self._set_node_status(node, "offline")
        node.updated_at = self.now_iso()
        for runtime in self.runtimes.values():
            if runtime.node_id == node.id and runtime.status in _LIVE_RUNTIME:
                self._set_runtime(runtime, "error", error_message="Node offline")
        if not self.current:
            return
        for record in self._in_flight(node.id):
            self._finish_by_backend(record, "failed", "node_stream_lost", STREAM_LOST_MESSAGE)

    def record_frame(self, node_id: str, frame: Mapping[str, Any], accepted: bool) -> None:
        if not self.keep_frames:
            return
        stored = copy.deepcopy(dict(frame))
        stored["_received_at"] = self.now_iso()
        stored["_accepted"] = accepted
        self.frames.setdefault(node_id, []).append(stored)

    # -- inbound frames ---------------------------------------------------------------------

    def apply_frame(self, node_id: str, frame: Mapping[str, Any]) -> bool:
        """
        Process one accepted frame (protocol 3.2 table). Unknown types are ignored.

        @return: whether the backend runs its dispatch pass after the frame: always, except
            on the current generation for a C{command_*} frame whose C{command_id} is missing
            or not a UUID (its handler skips the frame and the pass).
        @raise FrameRejected: where the real backend's handler would fail (a value too long
            for its column, a wrong type where a string column is written, on 2026-04 a
            command id that is not a UUID); nothing of the frame is applied then.
        """
        node = self.nodes.get(node_id)
        if node is None:
            # The row is gone: the real handler's writes would fail.
            raise FrameRejected("node no longer exists")
        kind = frame.get("type")
        handler = {
            "heartbeat": self._on_heartbeat,
            "inventory": self._on_inventory,
            "command_ack": self._on_ack,
            "command_progress": self._on_progress,
            "command_result": self._on_result,
            "event_batch": self._on_event_batch,
        }.get(kind) if isinstance(kind, str) else None
        if handler is not None:
            try:
                handler(node, frame)
            except _SkipFrame:
                return False
        return True

    def _on_heartbeat(self, node: NodeRecord, frame: Mapping[str, Any]) -> None:
        status = frame.get("status", "healthy")
        version = frame.get("version")
        advertise = frame.get("advertise_host")
        if self.current:
            # The current handler: str(status or "healthy"); a version that is not a string
            # is left out; advertise_host stripped before the IP check.
            status = str(status or "healthy")
            if not isinstance(version, str):
                version = None
            if isinstance(advertise, str):
                advertise = advertise.strip()
        if status is None:
            status = "healthy"
        status = _db_str("heartbeat", "status", status, STATUS_MAX)
        version = _db_str("heartbeat", "version", version, VERSION_MAX)
        assert status is not None
        capabilities = frame.get("capabilities")
        self._set_node_status(node, status)
        if isinstance(capabilities, dict):
            node.capabilities = copy.deepcopy(capabilities)
        if version is not None:
            node.version = version
        if is_ip_literal(advertise):
            assert isinstance(advertise, str)
            node.host = advertise
        stamp = self.now_iso()
        node.last_seen = stamp
        node.updated_at = stamp

    def _on_inventory(self, node: NodeRecord, frame: Mapping[str, Any]) -> None:
        inventory = frame.get("inventory")
        utilization = frame.get("utilization")
        if not isinstance(inventory, dict):
            self.note(node.id, "inventory frame without an inventory object")
        self.inventories.setdefault(node.id, []).append(
            {
                "inventory": copy.deepcopy(inventory) if inventory is not None else {},
                "utilization": copy.deepcopy(utilization) if utilization is not None else {},
                "received_at": self.now_iso(),
            }
        )

    def _command_of(self, node: NodeRecord, frame_type: str, frame: Mapping[str, Any]) -> (
        CommandRecord | None
    ):
        cid: str | None
        if self.current:
            raw = frame.get("command_id")
            try:
                cid = str(uuid.UUID(str(raw)))
            except ValueError:
                what = "without command_id" if raw is None else "with a command_id that is not a UUID"
                self.note(node.id, f"{frame_type} {what} ignored (no dispatch pass)")
                raise _SkipFrame() from None
        else:
            cid = _command_uuid(frame_type, frame.get("command_id"))
        if cid is None:
            self.note(node.id, f"{frame_type} without command_id ignored")
            return None
        record = self.commands.get(cid)
        if record is None or record.node_id != node.id:
            self.note(node.id, f"{frame_type} for unknown command {cid} ignored")
            return None
        return record

    def _on_ack(self, node: NodeRecord, frame: Mapping[str, Any]) -> None:
        record = self._command_of(node, "command_ack", frame)
        if record is None:
            return
        if record.agent_result:
            self.note(node.id, f"command_ack after the result of {record.id} (status regresses)")
        stamp = self.now_iso()
        self._set_command_status(record, "acked")
        record.agent_seen_ts = self.now()
        if self.current:
            # The current backend stamps acked_at once and clears the error fields.
            if record.acked_at is None:
                record.acked_at = stamp
                record.acked_ts = record.agent_seen_ts
            record.error_code = record.error_message = None
        else:
            record.acked_at = stamp
            record.acked_ts = record.agent_seen_ts
        message = frame.get("message")
        record.timeline.append(
            {
                "event_type": "acked",
                "message": message if isinstance(message, str) else None,
                "payload": copy.deepcopy(dict(frame)),
                "ts": stamp,
            }
        )

    def _on_progress(self, node: NodeRecord, frame: Mapping[str, Any]) -> None:
        record = self._command_of(node, "command_progress", frame)
        if record is None:
            return
        if record.agent_result:
            self.note(
                node.id, f"command_progress after the result of {record.id} (status regresses)"
            )
        stamp = self.now_iso()
        self._set_command_status(record, "running")
        record.agent_seen_ts = self.now()
        if self.current:
            record.error_code = record.error_message = None
        if record.started_at is None:
            record.started_at = stamp
            record.started_ts = record.agent_seen_ts
        message = frame.get("message")
        record.timeline.append(
            {
                "event_type": "progress",
                "message": message if isinstance(message, str) else None,
                "payload": copy.deepcopy(dict(frame)),
                "ts": stamp,
            }
        )
        if record.command_type == "sync_model" and self.current:
            self._model_sync_progress(node, record, frame)

    def _on_result(self, node: NodeRecord, frame: Mapping[str, Any]) -> None:
        record = self._command_of(node, "command_result", frame)
        if record is None:
            return
        error_code = _db_str("command_result", "error_code", frame.get("error_code"), ERROR_CODE_MAX)
        error_message = _db_str(
            "command_result", "error_message", frame.get("error_message"), None
        )
        raw_success = frame.get("success", False)
        if not isinstance(raw_success, bool):
            self.note(node.id, f"command_result.success of {record.id} is not a boolean")
        success = bool(raw_success)
        result = frame.get("result")
        stamp = self.now_iso()
        if (
            self.current
            and isinstance(result, dict)
            and result.get("replayed")
            and record.status in ("succeeded", "failed")
        ):
            # At-least-once delivery: the current backend keeps the first result and applies
            # no side effect twice.
            if not record.agent_result:
                self.note(
                    node.id,
                    f"replayed command_result for {record.id} ignored: the backend had set it "
                    f"{record.status} ({record.error_code}) itself and keeps that",
                )
            record.agent_seen_ts = self.now()
            record.timeline.append(
                {
                    "event_type": "duplicate",
                    "message": "Delivered twice; the agent replayed its result. The first "
                    "result stands.",
                    "payload": copy.deepcopy(dict(frame)),
                    "ts": stamp,
                }
            )
            return
        if record.agent_result:
            self.note(node.id, f"second command_result for {record.id}")
        record.agent_result = True
        record.agent_seen_ts = self.now()
        record.result = copy.deepcopy(result)
        record.error_code = error_code
        record.error_message = error_message
        record.completed_at = stamp
        self._set_command_status(record, "succeeded" if success else "failed")
        record.timeline.append(
            {
                "event_type": "result",
                "message": error_message,
                "payload": copy.deepcopy(dict(frame)),
                "ts": stamp,
            }
        )
        self._runtime_on_result(node, record, success, result, error_message)
        if record.command_type == "sync_model" and self.current:
            # Read by the current generation only (the April one reads nothing of sync_model).
            self._model_sync_result(node, record, success, result, error_code, error_message)
        if self.finished is not None:
            self.finished(record.id)

    # -- model availability (the current backend reads sync_model, protocol 10.4) ------------

    def _sync_model_id(self, record: CommandRecord, result: Any) -> str | None:
        payload = _obj(record.payload)
        model_sync = _obj(payload.get("model_sync"))
        found = _obj(result)
        for value in (payload.get("model_id"), model_sync.get("model_id"), found.get("model_id"),
                      payload.get("hf_repo_id"), model_sync.get("hf_repo_id"), found.get("hf_repo_id")):
            if isinstance(value, str) and value:
                return value
        return None

    def _availability(self, node: NodeRecord, model_id: str) -> dict[str, Any]:
        rows = self.model_availability.setdefault(node.id, {})
        return rows.setdefault(model_id, {"model_id": model_id, "node_id": node.id, "status": "unknown"})

    def _model_sync_progress(self, node: NodeRecord, record: CommandRecord, frame: Mapping[str, Any]) -> None:
        model_id = self._sync_model_id(record, None)
        if model_id is None:
            return
        raw = frame.get("progress_pct") if frame.get("progress_pct") is not None else frame.get("progress")
        try:
            progress = float(raw) if raw is not None else 0.0
        except (TypeError, ValueError):
            self.note(node.id, f"sync_model progress of {record.id} is not a number: {raw!r}")
            progress = 0.0
        if raw is None:
            self.note(node.id, f"sync_model progress of {record.id} without progress_pct or progress")
        row = self._availability(node, model_id)
        row.update(status="syncing", progress=progress)
        message = frame.get("message")
        if message:
            row["status_message"] = str(message)[:2000]

    def _model_sync_result(
        self,
        node: NodeRecord,
        record: CommandRecord,
        success: bool,
        result: Any,
        error_code: str | None,
        error_message: str | None,
    ) -> None:
        model_id = self._sync_model_id(record, result)
        if model_id is None:
            self.note(node.id, f"sync_model {record.id}: no model id in the payload or the result")
            return
        row = self._availability(node, model_id)
        if not success:
            row.update(
                status="failed",
                status_message=str(error_message or error_code or "Model sync failed on node")[:2000],
            )
            return
        found = _obj(result)
        payload = _obj(record.payload)
        model_sync = _obj(payload.get("model_sync"))
        for key in ("root_path", "revision", "manifest_sha256", "total_size"):
            if not found.get(key):
                self.note(node.id, f"sync_model {record.id} succeeded without result.{key}")
        digest = found.get("manifest_sha256") or payload.get("manifest_sha256") or model_sync.get("manifest_sha256")
        try:
            size = int(found.get("total_size") or 0)
        except (TypeError, ValueError):
            size = 0
        row.update(
            status="ready",
            root_path=str(found["root_path"]) if found.get("root_path") else None,
            revision=str(found["revision"]) if found.get("revision") else None,
            manifest_sha256=str(digest) if digest else None,
            size_bytes=size,
            progress=100.0,
            status_message=None,
            ready_at=self.now_iso(),
        )

    def _runtime_on_result(
        self,
        node: NodeRecord,
        record: CommandRecord,
        success: bool,
        result: Any,
        error_message: str | None,
    ) -> None:
        """Section 7 of the protocol."""
        runtime = self._runtime_for(record.payload)
        if runtime is None:
            return
        if not success:
            if self.current:
                # The current backend keeps the first 2000 characters, falling back to the
                # error code.
                error_message = str(error_message or record.error_code or "Command failed")[:2000]
            self._set_runtime(runtime, "error", error_message=error_message)
            return
        if record.command_type in _ENDPOINT_TYPES:
            endpoint = result.get("endpoint_url") if isinstance(result, dict) else None
            if endpoint is None:
                self.note(node.id, f"successful {record.command_type} without result.endpoint_url")
            if not self.current:
                runtime.endpoint_url = rewrite_endpoint(endpoint, node.host)
            elif isinstance(endpoint, str) and endpoint.strip():
                # The current backend keeps the endpoint it had when none is reported.
                runtime.endpoint_url = rewrite_endpoint(endpoint.strip(), node.host)
            self._set_runtime(runtime, "running")
        elif record.command_type == "stop_workload":
            self._set_runtime(runtime, "stopped")
        elif record.command_type == "remove_workload" and self.current:
            # protocol 10.4: the current backend sets a removed runtime stopped (and takes it
            # off the gateway); the April one changes nothing visible.
            self._set_runtime(runtime, "stopped")

    def _on_event_batch(self, node: NodeRecord, frame: Mapping[str, Any]) -> None:
        events = frame.get("events")
        if events is None:
            return
        if not isinstance(events, list):
            if self.current:
                # The current handler reads only a list; anything else stores nothing.
                self.note(node.id, "event_batch.events is not a list: nothing stored")
                return
            raise FrameRejected("event_batch.events is not a list")
        checked = []
        for index, event in enumerate(events):
            where = f"event_batch.events[{index}]"
            if not isinstance(event, dict):
                if self.current:
                    self.note(node.id, f"{where} is not an object: left out")
                    continue
                raise FrameRejected(f"{where} is not an object")
            if self.current:
                # str(event_type or type or "event"), str(severity or "info").
                raw_type = event.get("event_type") or event.get("type") or "event"
                event_type = _db_str(where, "event_type", str(raw_type), EVENT_TYPE_MAX)
                severity = _db_str(
                    where, "severity", str(event.get("severity") or "info"), SEVERITY_MAX
                )
            else:
                event_type = _db_str(where, "event_type", event.get("event_type"), EVENT_TYPE_MAX)
                severity = _db_str(
                    where, "severity", event.get("severity", "info"), SEVERITY_MAX
                )
            if event_type is None:
                raise FrameRejected(f"{where}.event_type is missing")
            correlation_id = _db_str(
                where, "correlation_id", event.get("correlation_id"), CORRELATION_ID_MAX
            )
            checked.append((event_type, severity or "info", correlation_id, event))
        stored = self.events.setdefault(node.id, [])
        for event_type, severity, correlation_id, event in checked:
            payload = event.get("payload")
            stored.append(
                {
                    "event_type": event_type,
                    "severity": severity,
                    "correlation_id": correlation_id,
                    "payload": copy.deepcopy(payload) if payload is not None else {},
                    "ts": event.get("ts"),
                    "received_at": self.now_iso(),
                }
            )
            if event_type.startswith("workload.health."):
                self._on_health(node, event_type, payload)

    def _runtime_command_in_flight(self, runtime: RuntimeRecord) -> bool:
        """An in-flight deploy/start/restart/update of the runtime's node for it (or for none)."""
        if runtime.node_id is None:
            return False
        for record in self._in_flight(runtime.node_id):
            if record.command_type not in _DEPLOY_PAYLOAD_TYPES:
                continue
            rid = record.payload.get("runtime_id") if isinstance(record.payload, dict) else None
            if rid is None or rid == runtime.id:
                return True
        return False

    def _on_health(self, node: NodeRecord, event_type: str, payload: Any) -> None:
        """Section 6: reconcile a runtime from a C{workload.health.*} event."""
        runtime = self._runtime_for(payload)
        if runtime is None:
            return
        assert isinstance(payload, dict)
        kind = event_type[len("workload.health.") :]
        if kind == "running":
            if (
                self.current
                and runtime.status in ("starting", "creating")
                and self._runtime_command_in_flight(runtime)
            ):
                # The current backend leaves a runtime being provisioned to its command's
                # result (a container can run before it is ready).
                return
            if runtime.status in ("error", "starting", "creating"):
                runtime.endpoint_url = rewrite_endpoint(payload.get("endpoint_url"), node.host)
                self._set_runtime(runtime, "running")
                runtime.health_message = None
        elif kind == "stopped":
            if runtime.status == "running":
                message = (
                    f"Container {payload.get('status')} (exit code {payload.get('exit_code')})"
                )
                self._set_runtime(runtime, "error", error_message=message)
        elif kind == "missing":
            if runtime.status == "running":
                self._set_runtime(runtime, "error", error_message="Container not found on node")
        elif kind == "crash_loop":
            message = (
                f"Container is crash-looping ({payload.get('status')}, "
                f"{payload.get('restart_count')} restarts)"
            )
            self._set_runtime(runtime, "error", error_message=message)
        elif kind == "unhealthy":
            runtime.health_message = f"Health check: {payload.get('health_status')}"
            runtime.updated_at = self.now_iso()
