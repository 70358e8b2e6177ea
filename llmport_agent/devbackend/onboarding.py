"""
The stand-in backend's onboarding routes of the current generation (protocol 10.7):

  POST .../nodes/join-requests                 (no auth) ask to join; a code for a person
  POST .../nodes/join-requests/<id>/collect    (poll secret) pending | rejected | expired |
                                               claimed | approved (once, with the credential)
  GET  .../nodes/join-requests                 (admin) the pending requests
  POST .../nodes/join-requests/<id|code>/approve, /reject   (admin) decide
  GET  /api/node-files/whoami                  (bearer) {node_id, agent_id, host}

As the real backend: 15-minute requests, 50 pending in all and 3 per source address (429),
a repeat from a waiting C{agent_id} gets the same code and no poll secret, a wrong secret is
401, an unknown id 404, and the credential is handed out by the first collect after approval
only. With L{Onboarding.enabled} off the routes answer 404 C{Not Found} like a backend of the
April generation, which has none of them.
"""

from __future__ import annotations

import hmac
import secrets
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from attrs import field
from twisted.logger import Logger
from twisted.web.resource import Resource
from twisted.web.server import Request

from llmport_agent.core.values import define

from ._http import (
    JsonResource,
    _admin_allowed,
    _header,
    json_response,
    read_json_body,
    validate_model,
)
from ._state import AuthError, EnrollRejected, StoreFailure, hash_secret

if TYPE_CHECKING:
    from .backend import DevBackend

#: Unambiguous read off a screen (no O/0, I/1, S/5, U/V).
CODE_ALPHABET = "ACDEFGHJKLMNPQRTWXY34679"
JOIN_TTL = 15 * 60.0
MAX_PENDING = 50
MAX_PENDING_PER_SOURCE = 3

_NOT_FOUND = {"detail": "Not Found"}


@define
class JoinRequest:
    id: str
    code: str
    poll_secret_hash: str
    agent_id: str
    host: str | None
    capabilities: Any
    version: str | None
    source_ip: str
    expires_at: float
    status: str = "pending"  # pending, approved, rejected, claimed
    message: str | None = None
    node_id: str | None = None

    def public(self, now_iso: Callable[[float], str]) -> dict[str, Any]:
        return {
            "id": self.id,
            "code": self.code,
            "agent_id": self.agent_id,
            "host": self.host,
            "version": self.version,
            "source_ip": self.source_ip,
            "status": self.status,
            "expires_at": now_iso(self.expires_at),
        }


@define
class Onboarding:
    """The join-request table of one stand-in backend."""

    backend: DevBackend
    enabled: bool = True
    requests: dict[str, JoinRequest] = field(factory=dict)
    #: Called with each new request (the devbackend CLI prints its code).
    on_request: Callable[[JoinRequest], None] | None = None
    collects: int = 0
    log = Logger()

    def _now(self) -> float:
        return float(self.backend.clock.seconds())

    def _live(self, row: JoinRequest) -> bool:
        return row.status == "pending" and row.expires_at > self._now()

    def pending(self) -> list[JoinRequest]:
        return [r for r in self.requests.values() if self._live(r)]

    def _mint_code(self) -> str:
        live = {r.code for r in self.pending()}
        while True:
            raw = "".join(secrets.choice(CODE_ALPHABET) for _ in range(6))
            code = f"{raw[:3]}-{raw[3:]}"
            if code not in live:
                return code

    def request_join(self, agent_id: str, host: str | None, capabilities: Any, version: str | None,
                     source_ip: str) -> dict[str, Any]:
        """
        @raise PermissionError: too many pending requests (429).
        """
        for row in self.pending():
            if row.agent_id == agent_id:
                return {"id": row.id, "code": row.code, "poll_secret": None,
                        "expires_at": _iso(row.expires_at), "already_pending": True}
        waiting = self.pending()
        if len(waiting) >= MAX_PENDING:
            raise PermissionError("Too many machines are already waiting for approval.")
        if sum(1 for r in waiting if r.source_ip == source_ip) >= MAX_PENDING_PER_SOURCE:
            raise PermissionError("Too many pending requests from this address.")
        poll_secret = secrets.token_urlsafe(32)
        row = JoinRequest(
            id=str(uuid.uuid4()), code=self._mint_code(), poll_secret_hash=hash_secret(poll_secret),
            agent_id=agent_id, host=host, capabilities=capabilities, version=version,
            source_ip=source_ip, expires_at=self._now() + JOIN_TTL,
        )
        self.requests[row.id] = row
        self.log.info("devbackend: join request {code} from agent id {agent_id}", code=row.code, agent_id=agent_id)
        if self.on_request is not None:
            self.on_request(row)
        return {"id": row.id, "code": row.code, "poll_secret": poll_secret,
                "expires_at": _iso(row.expires_at), "already_pending": False}

    def find(self, ident: str) -> JoinRequest | None:
        """By id, or by the code a person reads (any case, dash optional)."""
        if ident in self.requests:
            return self.requests[ident]
        wanted = ident.upper().replace("-", "")
        matches = [r for r in self.requests.values() if r.code.replace("-", "") == wanted]
        live = [r for r in matches if self._live(r)]
        found = live or matches
        return found[-1] if found else None

    def decide(self, ident: str, approve: bool, message: str | None = None) -> JoinRequest:
        """
        @raise LookupError: no such request.
        @raise PermissionError: no longer waiting.
        """
        row = self.find(ident)
        if row is None:
            raise LookupError("Join request not found.")
        if not self._live(row):
            raise PermissionError("This request is no longer waiting for a decision.")
        row.status = "approved" if approve else "rejected"
        row.message = message
        return row

    def collect(self, request_id: str, poll_secret: str, caller: str) -> dict[str, Any]:
        """
        @raise LookupError: unknown id (404).  @raise PermissionError: wrong secret (401).
        """
        self.collects += 1
        row = self.requests.get(request_id)
        if row is None:
            raise LookupError("Join request not found.")
        if not hmac.compare_digest(row.poll_secret_hash, hash_secret(poll_secret)):
            raise PermissionError("Join request secret mismatch.")
        if row.status == "rejected":
            return {"status": "rejected", "message": row.message}
        if row.status == "claimed":
            return {"status": "claimed", "message": "This request was already used."}
        if row.status == "pending":
            if row.expires_at <= self._now():
                return {"status": "expired", "message": "The request timed out."}
            return {"status": "pending", "code": row.code, "expires_at": _iso(row.expires_at)}
        # Approved: provision the node now, through the ordinary enrollment (one-time token).
        token = self.backend.state.mint_token(f"join {row.code}")["token"]
        reply = self.backend.state.enroll(token, row.agent_id, row.host, row.capabilities, row.version, caller)
        row.status = "claimed"
        row.node_id = reply["node_id"]
        return {**reply, "status": "approved"}


def _caller(request: Request) -> str:
    forwarded = _header(request, b"x-forwarded-for")
    if forwarded and forwarded.split(",")[0].strip():
        return forwarded.split(",")[0].strip()
    peer = request.getClientAddress()
    return str(getattr(peer, "host", "") or "")


class JoinRequestsResource(JsonResource):
    """C{.../nodes/join-requests[/<id>/<collect|approve|reject>]}."""

    isLeaf = True
    _FIELDS = {
        "agent_id": ("str", True),
        "host": ("str?", False),
        "capabilities": ("dict", False),
        "version": ("str?", False),
    }

    def __init__(self, onboarding: Onboarding) -> None:
        super().__init__()
        self._o = onboarding

    def _path(self, request: Request) -> list[str]:
        return [p.decode("utf-8", "replace") for p in request.postpath or [] if p]

    def render_GET(self, request: Request) -> bytes:
        o = self._o
        if not o.enabled or self._path(request):
            return json_response(request, 404 if not o.enabled else 405, _NOT_FOUND)
        if not _admin_allowed(o.backend, request):
            return json_response(request, 401, {"detail": "Not authenticated"})
        return json_response(request, 200, [r.public(_iso) for r in o.pending()])

    def render_POST(self, request: Request) -> bytes:
        o = self._o
        if not o.enabled:
            return json_response(request, 404, _NOT_FOUND)
        path = self._path(request)
        body, errors = read_json_body(request)
        if errors:
            return json_response(request, 422, {"detail": errors})
        if not path:
            values, errors = validate_model(body, self._FIELDS)
            if errors:
                return json_response(request, 422, {"detail": errors})
            try:
                reply = o.request_join(values["agent_id"], values.get("host"), values.get("capabilities", {}),
                                       values.get("version"), _caller(request))
            except PermissionError as e:
                return json_response(request, 429, {"detail": str(e)})
            return json_response(request, 200, reply)
        if len(path) != 2:
            return json_response(request, 404, _NOT_FOUND)
        ident, action = path
        if action == "collect":
            values, errors = validate_model(body, {"poll_secret": ("str", True)})
            if errors:
                return json_response(request, 422, {"detail": errors})
            try:
                return json_response(request, 200, o.collect(ident, values["poll_secret"], _caller(request)))
            except LookupError as e:
                return json_response(request, 404, {"detail": str(e)})
            except PermissionError as e:
                return json_response(request, 401, {"detail": str(e)})
            except (EnrollRejected, StoreFailure) as e:
                return json_response(request, 500, {"detail": str(e)})
        if action in ("approve", "reject"):
            if not _admin_allowed(o.backend, request):
                return json_response(request, 401, {"detail": "Not authenticated"})
            message = body.get("message") if isinstance(body, dict) else None
            try:
                row = o.decide(ident, action == "approve", message if isinstance(message, str) else None)
            except LookupError as e:
                return json_response(request, 404, {"detail": str(e)})
            except PermissionError as e:
                return json_response(request, 409, {"detail": str(e)})
            return json_response(request, 200, row.public(_iso))
        return json_response(request, 404, _NOT_FOUND)


class WhoamiResource(JsonResource):
    """C{GET /api/node-files/whoami} (bearer): which node this credential belongs to."""

    isLeaf = True

    def __init__(self, onboarding: Onboarding) -> None:
        super().__init__()
        self._o = onboarding

    def render_GET(self, request: Request) -> bytes:
        o = self._o
        if not o.enabled:
            return json_response(request, 404, _NOT_FOUND)
        try:
            node, _record = o.backend.state.authenticate(_header(request, b"authorization"))
        except AuthError:
            return json_response(request, 401, {"detail": "Invalid node credential."})
        return json_response(request, 200, {"node_id": node.id, "agent_id": node.agent_id, "host": node.host})


def install(onboarding: Onboarding, nodes: Resource, node_files: Resource) -> None:
    """Put the routes under C{.../system/nodes} and C{/api/node-files}."""
    nodes.putChild(b"join-requests", JoinRequestsResource(onboarding))  # type: ignore[arg-type]
    node_files.putChild(b"whoami", WhoamiResource(onboarding))  # type: ignore[arg-type]


def _iso(when: float) -> str:
    """A POSIX time as ISO 8601 in UTC."""
    import datetime

    return datetime.datetime.fromtimestamp(when, datetime.UTC).isoformat()
