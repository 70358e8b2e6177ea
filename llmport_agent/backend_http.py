"""
HTTP calls to the backend outside the stream: enrollment and credential rotation (protocol 1-2).

Errors are classified so callers can act: L{Rejected} is final for what was presented (a token
or a credential); L{Transient} is worth retrying with backoff. No exception text ever contains the
token or the credential.
"""

from __future__ import annotations

import json
from typing import Any

from attrs import frozen
from treq.client import HTTPClient
from twisted.internet.defer import CancelledError, TimeoutError
from twisted.logger import Logger

from llmport_agent.tls import describe_connection_error, innermost_error

ENROLL_PATH = "/api/admin/system/nodes/enroll"
ROTATE_PATH = "/api/admin/system/nodes/credentials/rotate"
TOKEN_PATH = "/api/admin/system/nodes/enrollment-tokens"


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


def _detail(body: bytes, secrets: tuple[str, ...] = ()) -> str:
    try:
        data = json.loads(body)
    except ValueError:
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
    return text


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
        self, path: str, body: dict[str, Any] | None, headers: dict[str, str], timeout: float
    ) -> tuple[int, bytes]:
        kwargs: dict[str, Any] = {"headers": headers}
        if body is not None:
            kwargs["data"] = json.dumps(body).encode()
            kwargs["headers"] = {**headers, "Content-Type": "application/json"}
        try:
            d = self._http.post(self.url(path), **kwargs)
            d.addTimeout(timeout, self._reactor)
            response = await d
            body_d = response.content()
            body_d.addTimeout(timeout, self._reactor)
            content = await body_d
        except (TimeoutError, CancelledError):
            raise Transient(f"POST {path}: no answer within {timeout:g} s") from None
        except Exception as e:  # network errors of every kind
            raise Transient(f"POST {path}: {describe_network_error(e, self.client_cert)}") from None
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
        except (ValueError, KeyError, TypeError) as e:
            raise Transient(f"POST {ENROLL_PATH}: malformed reply ({type(e).__name__})") from None
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
        except (ValueError, KeyError, TypeError):
            raise Transient(f"POST {ROTATE_PATH}: malformed reply") from None
        return str(data.get("node_id", "")), new


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
