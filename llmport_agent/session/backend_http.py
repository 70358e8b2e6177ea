"""
HTTP calls to the backend outside the stream: enrollment and credential rotation (protocol 1-2),
the Ray cluster token (protocol 10.6).

Errors are classified so callers can act: L{Rejected} is final for what was presented (a token
or a credential); L{Transient} is worth retrying with backoff. No exception text ever contains the
token or the credential.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from treq.client import HTTPClient
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.logger import Logger

from llmport_agent.core.cleantext import MAX_SHOWN_CHARS, checked_node_id, has_unsafe, shown
from llmport_agent.core.httpbody import BodyTooLarge, read_body
from llmport_agent.core.plainurl import plain_url
from llmport_agent.core.values import frozen
from llmport_agent.session.tls import describe_connection_error, innermost_error

ENROLL_PATH = "/api/admin/system/nodes/enroll"
ROTATE_PATH = "/api/admin/system/nodes/credentials/rotate"
TOKEN_PATH = "/api/admin/system/nodes/enrollment-tokens"
SECRETS_PATH = "/api/admin/system/nodes/secrets/"
#: The most bytes read of a cluster token answer.
SECRET_BODY_LIMIT = 64 * 1024
#: The most bytes read of any other answer of the backend (enrollment, join, whoami).
BODY_LIMIT = 1024 * 1024
JOIN_PATH = "/api/admin/system/nodes/join-requests"
WHOAMI_PATH = "/api/node-files/whoami"
LOG_SINK_PATH = "/api/node-files/log-sink"
#: The most bytes read of a log-sink answer.
LOG_SINK_BODY_LIMIT = 64 * 1024


class BackendError(Exception):
    """A backend HTTP call failed. C{str()} is safe to log."""


class Transient(BackendError):
    """Network error, timeout or 5xx: try again later."""


class Rejected(BackendError):
    """The backend refused what was presented (401/403/422). Final for that token/credential."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


class RouteMissing(BackendError):
    """A 404 for the route itself (FastAPI's C{{"detail": "Not Found"}}): an older backend."""


def is_route_missing(code: int, body: bytes) -> bool:
    """
    FastAPI answers an unknown path with C{404 {"detail": "Not Found"}}; a route that exists and
    does not find its object says something else (C{"Join request not found."}).
    """
    if code != 404:
        return False
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("detail") == "Not Found"


@frozen
class Enrollment:
    node_id: str
    credential: str
    host: str | None


def _strip_inputs(obj: Any) -> Any:
    """FastAPI's 422 echoes the request body in C{input}: drop it (it holds the token)."""
    if isinstance(obj, dict):
        return {k: _strip_inputs(v) for k, v in obj.items() if k not in ("input", "body", "ctx")}
    if isinstance(obj, list):
        return [_strip_inputs(v) for v in obj]
    return obj


#: The longest backend error detail shown.
MAX_DETAIL_CHARS = MAX_SHOWN_CHARS


def _detail(body: bytes, secrets: tuple[str, ...] = ()) -> str:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # nested too deep is not JSON either
        text = body[:200].decode("utf-8", "replace")
    else:
        if isinstance(data, dict) and "detail" in data:
            detail = data["detail"]
            text = detail if isinstance(detail, str) else json.dumps(_strip_inputs(detail))[:300]
        else:
            text = json.dumps(_strip_inputs(data))[:200]
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    # The backend's words reach the operator's terminal and log: bounded, no control
    # characters (a terminal escape sequence, a forged second log line).
    return shown(text)




class BackendHTTP:
    """
    Enroll and rotate with treq.

    @param http: a treq L{HTTPClient} (with TLS policy and connection pool set up by the caller).
    @param base_url: C{BACKEND_URL}, base path kept.
    """

    log = Logger()

    def __init__(
        self, reactor: Any, http: HTTPClient, base_url: str, timeout: float, *, client_cert: str | None = None
    ) -> None:
        self._reactor = reactor
        #: C{TLS_CLIENT_CERT}, named when the backend refuses it.
        self.client_cert = client_cert
        self._http = http
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def url(self, path: str) -> str:
        return self.base_url + path

    async def _post(
        self, path: str, body: dict[str, Any] | None, headers: dict[str, str], timeout: float,
        method: str = "POST",
    ) -> tuple[int, bytes]:
        kwargs: dict[str, Any] = {"headers": headers}
        if body is not None:
            kwargs["data"] = json.dumps(body).encode()
            kwargs["headers"] = {**headers, "Content-Type": "application/json"}
        try:
            d = self._http.request(method, plain_url(self.url(path)), unbuffered=True, **kwargs)
            d.addTimeout(timeout, self._reactor)
            response = await d
            body_d = Deferred.fromCoroutine(read_body(response, BODY_LIMIT))
            body_d.addTimeout(timeout, self._reactor)
            content = await body_d
        except (TimeoutError, CancelledError):
            raise Transient(f"{method} {path}: no answer within {timeout:g} s") from None
        except BodyTooLarge as e:
            raise Transient(f"{method} {path}: {e}") from None
        except Exception as e:  # network errors of every kind
            raise Transient(f"{method} {path}: {describe_network_error(e, self.client_cert)}") from None
        return response.code, content

    async def enroll(
        self, token: str, agent_id: str, host: str, capabilities: dict[str, Any], version: str
    ) -> Enrollment:
        """Trade a one-time token for a credential. Raises L{Rejected} or L{Transient}."""
        body = {
            "enrollment_token": token,
            "agent_id": agent_id,
            "host": host,
            "capabilities": capabilities,
            "version": version[:64],
        }
        code, content = await self._post(ENROLL_PATH, body, {}, self.timeout)
        if code in (401, 403, 422):
            raise Rejected(code, _detail(content, (token,)))
        if code != 200:
            raise Transient(f"POST {ENROLL_PATH}: HTTP {code}: {_detail(content, (token,))}")
        try:
            data = json.loads(content)
            node_id = data["node_id"]
            credential = data["credential"]
            if not isinstance(node_id, str) or not isinstance(credential, str) or "." not in credential:
                raise ValueError("unexpected field types")
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise Transient(f"POST {ENROLL_PATH}: malformed reply ({type(e).__name__})") from None
        # Checked where it is received: a node id is stored, sent and named in lines (BadNodeId).
        checked_node_id(node_id, f"the enrollment reply (POST {ENROLL_PATH})")
        host_value = data.get("host")
        return Enrollment(node_id, credential, host_value if isinstance(host_value, str) else None)

    async def rotate(self, credential: str, timeout: float) -> tuple[str, str]:
        """
        Rotate the credential. Returns (node_id, new credential). Raises L{Rejected} (401: the
        presented credential is not valid) or L{Transient} (outcome unknown: the backend may
        already have revoked the old one).
        """
        headers = {"Authorization": f"Bearer {credential}"}
        code, content = await self._post(ROTATE_PATH, None, headers, timeout)
        if code in (401, 403):
            raise Rejected(code, _detail(content, (credential,)))
        if code != 200:
            raise Transient(f"POST {ROTATE_PATH}: HTTP {code}: {_detail(content, (credential,))}")
        try:
            data = json.loads(content)
            new = data["credential"]
            if not isinstance(new, str) or "." not in new:
                raise ValueError
        except (ValueError, KeyError, TypeError, RecursionError):
            raise Transient(f"POST {ROTATE_PATH}: malformed reply") from None
        return str(data.get("node_id", "")), new


    async def cluster_secret(self, credential_ref: str, credential: str, timeout: float) -> str:
        """
        C{GET .../nodes/secrets/{credential_ref}} with the node credential: the cluster token.
        Raises L{Rejected} (401/403: the credential; 404: not a member) or L{Transient}. The
        token never appears in an exception.
        """
        path = SECRETS_PATH + quote(credential_ref, safe="")
        # The messages name the route, not the member's credential_ref.
        code, content = await self._get_bounded(
            path, credential, timeout, SECRET_BODY_LIMIT, shown_path=f"{SECRETS_PATH}..."
        )
        if code in (401, 403, 404):
            raise Rejected(code, _detail(content, (credential,)))
        if code != 200:
            raise Transient(f"GET {SECRETS_PATH}...: HTTP {code}")
        try:
            token = json.loads(content)["token"]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise Transient(f"GET {SECRETS_PATH}...: malformed reply") from None
        if not isinstance(token, str) or not token.strip() or len(token) > 8192:
            raise Transient(f"GET {SECRETS_PATH}...: the reply carries no usable token")
        return token.strip()

    async def request_join(
        self, agent_id: str, host: str, capabilities: dict[str, Any], version: str
    ) -> dict[str, Any]:
        """
        Ask to join without a token (protocol 10.7): C{{id, code, poll_secret|null, expires_at,
        already_pending}}. Raises L{RouteMissing} (an April backend), L{Rejected} (429 too many
        pending, other 4xx) or L{Transient}.
        """
        body = {"agent_id": agent_id, "host": host, "capabilities": capabilities, "version": version[:64]}
        code, content = await self._post(JOIN_PATH, body, {}, self.timeout)
        if is_route_missing(code, content):
            raise RouteMissing(f"POST {JOIN_PATH}: HTTP 404 (no such route)")
        if 400 <= code < 500:
            raise Rejected(code, _detail(content))
        if code != 200:
            raise Transient(f"POST {JOIN_PATH}: HTTP {code}: {_detail(content)}")
        data = _object(content, JOIN_PATH)
        if not isinstance(data.get("id"), str) or not isinstance(data.get("code"), str):
            raise Transient(f"POST {JOIN_PATH}: malformed reply (no id or code)")
        if len(data["code"]) > 64 or has_unsafe(data["code"]) or len(data["id"]) > 200:
            # The code is printed for a person to compare: never a terminal escape sequence.
            raise Transient(f"POST {JOIN_PATH}: malformed reply (a code or id that cannot be shown)")
        secret = data.get("poll_secret")
        if secret is not None and not isinstance(secret, str):
            raise Transient(f"POST {JOIN_PATH}: malformed reply (poll_secret)")
        return data

    async def collect_join(self, request_id: str, poll_secret: str) -> dict[str, Any]:
        """
        Has an administrator decided? C{{status: pending|rejected|expired|claimed|approved, ...}}
        (approved carries the enroll reply). Raises L{Rejected} (404 unknown id, 401 wrong
        secret) or L{Transient}.
        """
        path = f"{JOIN_PATH}/{quote(request_id, safe='')}/collect"
        code, content = await self._post(path, {"poll_secret": poll_secret}, {}, self.timeout)
        if code in (401, 404, 422):
            raise Rejected(code, _detail(content, (poll_secret,)))
        if code != 200:
            raise Transient(f"POST {JOIN_PATH}/<id>/collect: HTTP {code}: {_detail(content, (poll_secret,))}")
        data = _object(content, f"{JOIN_PATH}/<id>/collect")
        if not isinstance(data.get("status"), str):
            raise Transient(f"POST {JOIN_PATH}/<id>/collect: malformed reply (no status)")
        return data

    async def whoami(self, credential: str, timeout: float | None = None) -> dict[str, Any]:
        """
        C{GET /api/node-files/whoami} with the node's credential: C{{node_id, agent_id, host}}.
        Raises L{RouteMissing} (an April backend has no such route), L{Rejected} (401/403, or a
        404 of the route itself: not a member, the node deleted or the credential revoked) or
        L{Transient}.
        """
        headers = {"Authorization": f"Bearer {credential}"}
        code, content = await self._post(
            WHOAMI_PATH, None, headers, self.timeout if timeout is None else timeout, method="GET"
        )
        if is_route_missing(code, content):
            raise RouteMissing(f"GET {WHOAMI_PATH}: HTTP 404 (no such route)")
        if code in (401, 403, 404):
            raise Rejected(code, _detail(content, (credential,)))
        if code != 200:
            raise Transient(f"GET {WHOAMI_PATH}: HTTP {code}: {_detail(content, (credential,))}")
        return _object(content, WHOAMI_PATH)


    async def _get_bounded(
        self, path: str, credential: str, timeout: float, limit: int, *, shown_path: str | None = None
    ) -> tuple[int, bytes]:
        """
        C{GET path} with the credential, reading at most C{limit} bytes of the answer. Errors
        name C{shown_path} (default: C{path}).
        """
        where = path if shown_path is None else shown_path
        headers: dict[bytes | str, bytes | str] = {"Authorization": f"Bearer {credential}"}
        try:
            d = self._http.get(plain_url(self.url(path)), headers=headers, unbuffered=True)
            d.addTimeout(timeout, self._reactor)
            response = await d
            body_d = Deferred.fromCoroutine(read_body(response, limit))
            body_d.addTimeout(timeout, self._reactor)
            content = await body_d
        except (TimeoutError, CancelledError):
            raise Transient(f"GET {where}: no answer within {timeout:g} s") from None
        except BodyTooLarge as e:
            raise Transient(f"GET {where}: {e}") from None
        except Exception as e:  # network errors of every kind
            raise Transient(f"GET {where}: {describe_network_error(e, self.client_cert)}") from None
        return response.code, content

    async def log_sink(self, credential: str, timeout: float | None = None) -> object:
        """
        C{GET /api/node-files/log-sink} with the node's credential (protocol 10.7): the
        backend's C{loki_url}, or C{None} when it has none (C{null}, or a 404: an April backend
        has no such route). Raises L{Rejected} (401/403) or L{Transient}. The value is not
        validated here, not even its type (see L{llmport_agent.logs.sink.validate_sink_url}).
        """
        code, content = await self._get_bounded(
            LOG_SINK_PATH, credential, self.timeout if timeout is None else timeout, LOG_SINK_BODY_LIMIT
        )
        if code == 404:
            return None
        if code in (401, 403):
            raise Rejected(code, _detail(content, (credential,)))
        if code != 200:
            raise Transient(f"GET {LOG_SINK_PATH}: HTTP {code}: {_detail(content, (credential,))}")
        data = _object(content, LOG_SINK_PATH)
        url = data.get("loki_url")
        return None if url is None or url == "" else url


def _object(content: bytes, path: str) -> dict[str, Any]:
    try:
        data = json.loads(content)
    except (ValueError, RecursionError):
        raise Transient(f"{path}: malformed reply (not JSON)") from None
    if not isinstance(data, dict):
        raise Transient(f"{path}: malformed reply (not an object)")
    return data


def describe_network_error(e: BaseException, client_cert: str | None = None) -> str:
    """
    What failed, in one line: a TLS failure with what to set (L{tls.describe_connection_error}),
    else the innermost error (treq wraps them in lists of Failures, whose repr helps nobody).
    """
    tls_text = describe_connection_error(e, client_cert)
    if tls_text:
        return tls_text
    inner = innermost_error(e) or e
    text = " ".join(_safe(inner).split()) if isinstance(inner, Exception) else ""
    if "[<twisted.python.failure.Failure" in text:
        text = ""
    return f"{type(inner).__name__}: {text}" if text else type(inner).__name__


def _safe(e: Exception) -> str:
    """Exception text without anything that could be a header value."""
    text = str(e)
    if "Bearer" in text or "enrollment_token" in text:
        return "(details withheld)"
    return text[:300]
