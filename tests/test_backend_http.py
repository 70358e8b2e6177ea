"""Enrollment and rotation HTTP calls against a faithful in-memory resource (StubTreq)."""

from __future__ import annotations

import json
from typing import Any

from treq.testing import StubTreq
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from llmport_agent.session.backend_http import BackendHTTP, Rejected, Transient

CRED = "11111111-2222-3333-4444-555555555555." + "s" * 43


class FakeBackend(Resource):
    isLeaf = True

    def __init__(self, code: int, body: Any) -> None:
        super().__init__()
        self.code = code
        self.body = body
        self.requests: list[tuple[bytes, dict[str, Any], bytes]] = []

    def render_POST(self, request: Any) -> bytes:
        headers = {k.decode().lower(): v[0].decode() for k, v in request.requestHeaders.getAllRawHeaders()}
        self.requests.append((request.path, headers, request.content.read()))
        request.setResponseCode(self.code)
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()


def call(case: SynchronousTestCase, backend: FakeBackend, coro_fn: Any) -> Any:
    client = BackendHTTP(Clock(), StubTreq(backend), "http://b.example/llm", 5)
    d = Deferred.fromCoroutine(coro_fn(client))
    return d


class EnrollTests(SynchronousTestCase):
    def enroll(self, backend: FakeBackend) -> Deferred[Any]:
        return call(self, backend, lambda c: c.enroll("tok", "agent-1", "node-a", {"gpu_count": 0}, "1.2.3"))

    def test_enroll_ok(self) -> None:
        """A 200 gives node id, credential and host; the body is exactly protocol 1."""
        b = FakeBackend(200, {"node_id": "n1", "agent_id": "agent-1", "credential": CRED, "status": "healthy", "host": "10.0.0.5"})
        result = self.successResultOf(self.enroll(b))
        self.assertEqual((result.node_id, result.credential, result.host), ("n1", CRED, "10.0.0.5"))
        path, headers, body = b.requests[0]
        self.assertEqual(path, b"/llm/api/admin/system/nodes/enroll")
        self.assertNotIn("authorization", headers)
        self.assertEqual(
            json.loads(body),
            {"enrollment_token": "tok", "agent_id": "agent-1", "host": "node-a",
             "capabilities": {"gpu_count": 0}, "version": "1.2.3"},
        )

    def test_rejected(self) -> None:
        """401 and 422 are final (Rejected) and never carry the token."""
        for code, body in [(401, {"detail": "Enrollment token is invalid or expired."}), (422, {"detail": [{"loc": ["body"]}]})]:
            f = self.failureResultOf(self.enroll(FakeBackend(code, body)), Rejected)
            self.assertEqual(f.value.status, code)
            self.assertNotIn("tok", str(f.value).replace("token", ""))

    def test_transient(self) -> None:
        """5xx and malformed replies are transient."""
        self.failureResultOf(self.enroll(FakeBackend(502, b"bad gateway")), Transient)
        self.failureResultOf(self.enroll(FakeBackend(200, {"node_id": "n"})), Transient)
        self.failureResultOf(self.enroll(FakeBackend(200, b"<html>")), Transient)


    def test_an_oversized_answer_is_transient_and_not_kept(self) -> None:
        """An answer above BODY_LIMIT is refused (one line), not buffered whole."""
        from llmport_agent.session.backend_http import BODY_LIMIT

        big = b'{"node_id": "' + b"n" * (BODY_LIMIT + 10) + b'"}'
        f = self.failureResultOf(self.enroll(FakeBackend(200, big)), Transient)
        self.assertIn(f"larger than {BODY_LIMIT} bytes", str(f.value))


class RotateTests(SynchronousTestCase):
    def rotate(self, backend: FakeBackend) -> Deferred[Any]:
        return call(self, backend, lambda c: c.rotate(CRED, 5))

    def test_rotate_ok(self) -> None:
        """The header is exactly 'Bearer <credential>' and the new credential is returned."""
        new = "99999999-2222-3333-4444-555555555555." + "n" * 43
        b = FakeBackend(200, {"node_id": "n1", "credential": new})
        self.assertEqual(self.successResultOf(self.rotate(b)), ("n1", new))
        path, headers, body = b.requests[0]
        self.assertEqual(headers["authorization"], "Bearer " + CRED)
        self.assertEqual(body, b"")

    def test_rotate_rejected(self) -> None:
        """401 details are kept (they are the backend's text, no secret)."""
        f = self.failureResultOf(self.rotate(FakeBackend(401, {"detail": "Credential is invalid or revoked."})), Rejected)
        self.assertEqual(f.value.detail, "Credential is invalid or revoked.")
        self.assertNotIn(CRED, str(f.value))

    def test_rotate_unknown_outcome(self) -> None:
        """A 5xx is an unknown outcome (Transient)."""
        self.failureResultOf(self.rotate(FakeBackend(500, b"oops")), Transient)
