"""
Tests for the local stand-in backend (L{llmport_agent.devbackend}).

Pure protocol semantics are unit-tested on L{BackendState} with a L{Clock}; the network
behaviour is tested over real loopback (127.0.0.1) with treq and a minimal Autobahn client
that is not the agent. Every test closes both the client and the server side.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Callable
from typing import Any, cast

from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, wrapClientTLS
from twisted.internet.ssl import Certificate, optionsForClientTLS
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase
from twisted.web.client import (
    Agent,
    BrowserLikePolicyForHTTPS,
    HTTPConnectionPool,
    ResponseFailed,
    ResponseNeverReceived,
)

from llmport_agent.devbackend import OMIT, DevBackend, TLSFiles, make_test_tls
from llmport_agent.devbackend._state import (
    AuthError,
    BackendState,
    EnrollRejected,
    FrameRejected,
    StoreFailure,
    rewrite_endpoint,
)
from tests.agentharness import AnomalyGuard

CREDENTIAL_RE = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\.[A-Za-z0-9_-]{43}"
)
NODES = "/api/admin/system/nodes"


# -- unit tests of the tables ---------------------------------------------------------------


class BackendStateTests(SynchronousTestCase):
    """The protocol semantics without networking, on a Clock."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1_700_000_000)
        self.state = BackendState(self.clock, token_ttl=60)

    def enroll(self, agent_id: str = "node-a", host: str | None = "10.0.0.5") -> dict[str, Any]:
        token = self.state.mint_token()["token"]
        return self.state.enroll(token, agent_id, host, {}, "1.0", "127.0.0.1")

    def test_token_shape_and_expiry(self) -> None:
        """Tokens are 32 url-safe characters and expire after the TTL."""
        minted = self.state.mint_token("n")
        self.assertRegex(minted["token"], r"^[A-Za-z0-9_-]{32}$")
        self.assertEqual(minted["note"], "n")
        self.clock.advance(60)
        with self.assertRaises(EnrollRejected):
            self.state.enroll(minted["token"], "a", None, {}, None, "127.0.0.1")

    def test_token_single_use(self) -> None:
        """A token is spent by a successful enrollment."""
        token = self.state.mint_token()["token"]
        self.state.enroll(token, "a", None, {}, None, "127.0.0.1")
        with self.assertRaises(EnrollRejected):
            self.state.enroll(token, "b", None, {}, None, "127.0.0.1")

    def test_store_failure_keeps_token(self) -> None:
        """Over-long agent_id/version fail like the insert and leave the token unused."""
        token = self.state.mint_token()["token"]
        with self.assertRaises(StoreFailure):
            self.state.enroll(token, "x" * 129, None, {}, None, "127.0.0.1")
        with self.assertRaises(StoreFailure):
            self.state.enroll(token, "a", None, {}, "v" * 65, "127.0.0.1")
        reply = self.state.enroll(token, "a" * 128, None, {}, "v" * 64, "127.0.0.1")
        self.assertEqual(reply["status"], "healthy")

    def test_host_rule(self) -> None:
        """An IP literal host is kept; anything else is replaced by the caller's address."""
        self.assertEqual(self.enroll("a", "fd00::1")["host"], "fd00::1")
        self.assertEqual(self.enroll("b", "my-host")["host"], "127.0.0.1")
        self.assertEqual(self.enroll("c", None)["host"], "127.0.0.1")

    def test_reenroll_reuses_node_and_keeps_old_credentials(self) -> None:
        """The same agent_id gets the same node; older credentials stay valid."""
        first = self.enroll("same")
        second = self.enroll("same")
        self.assertEqual(first["node_id"], second["node_id"])
        self.assertNotEqual(first["credential"], second["credential"])
        self.state.authenticate("Bearer " + first["credential"])
        self.state.authenticate("Bearer " + second["credential"])

    def test_auth_details(self) -> None:
        """Every refusal carries the real backend's exact detail."""
        cred = self.enroll()["credential"]
        cred_id, secret = cred.split(".")
        cases = [
            (None, "Missing Authorization header."),
            ("", "Missing Authorization header."),
            ("bearer " + cred, "Invalid Authorization header."),
            ("Token " + cred, "Invalid Authorization header."),
            ("Bearer ", "Missing bearer token."),
            ("Bearer nodot", "Invalid credential format."),
            ("Bearer " + cred_id + ".", "Invalid credential format."),
            ("Bearer not-a-uuid." + secret, "Invalid credential id."),
            ("Bearer  " + cred, "Invalid credential id."),
            (f"Bearer {uuid.uuid4()}.{secret}", "Credential is invalid or revoked."),
            (f"Bearer {cred_id}.{'A' * 43}", "Credential secret mismatch."),
        ]
        for header, detail in cases:
            with self.assertRaises(AuthError) as caught:
                self.state.authenticate(header)
            self.assertEqual(caught.exception.detail, detail, header)
            self.assertNotIn(secret, str(caught.exception))
        node, _ = self.state.authenticate("Bearer " + cred)
        self.state.delete_node(node.id)
        with self.assertRaises(AuthError) as caught:
            self.state.authenticate("Bearer " + cred)
        self.assertEqual(caught.exception.detail, "Credential node no longer exists.")

    def test_rotate_revokes_at_once(self) -> None:
        """Rotation revokes the presented credential and issues a working new one."""
        cred = self.enroll()["credential"]
        _node, record = self.state.authenticate("Bearer " + cred)
        new = self.state.rotate(record)
        self.assertRegex(new["credential"], CREDENTIAL_RE)
        with self.assertRaises(AuthError) as caught:
            self.state.authenticate("Bearer " + cred)
        self.assertEqual(caught.exception.detail, "Credential is invalid or revoked.")
        self.state.authenticate("Bearer " + new["credential"])

    def test_secrets_are_hashed(self) -> None:
        """Neither the credential secret nor the token is kept in clear."""
        token = self.state.mint_token()["token"]
        reply = self.state.enroll(token, "a", None, {}, None, "127.0.0.1")
        secret = reply["credential"].split(".")[1]
        dump = repr(self.state.credentials) + repr(self.state.tokens)
        self.assertNotIn(secret, dump)
        self.assertNotIn(token, dump)

    def test_dispatch_order_limit_and_idempotency(self) -> None:
        """Pending commands go out oldest first, at most 50; a live idempotency key blocks."""
        node_id = self.enroll()["node_id"]
        ids = [self.state.issue_command(node_id, "t", {})["id"] for _ in range(60)]
        out = self.state.take_dispatch(node_id)
        self.assertEqual([c["id"] for c in out], ids[:50])
        self.assertEqual({c["status"] for c in out}, {"dispatched"})
        first = self.state.issue_command(node_id, "start_workload", {}, idempotency_key="k")
        again = self.state.issue_command(node_id, "start_workload", {}, idempotency_key="k")
        self.assertEqual(first["id"], again["id"])
        self.assertEqual(self.state.issue_command(node_id, "x", {})["timeout_sec"], 900)
        self.assertEqual(
            self.state.issue_command(node_id, "fetch_container_logs", {})["timeout_sec"], 30
        )

    def test_raw_override(self) -> None:
        """raw_override replaces or removes keys of the wire object only."""
        node_id = self.enroll()["node_id"]
        cmd = self.state.issue_command(
            node_id, "t", {}, raw_override={"signature": "ab", "payload": OMIT}
        )
        wire = self.state.take_dispatch(node_id)[0]
        self.assertEqual(wire["signature"], "ab")
        self.assertNotIn("payload", wire)
        self.assertNotIn("signature", self.state.commands[cmd["id"]].to_dict())

    def test_field_limits_reject_frames(self) -> None:
        """Over-long columns and non-UUID command ids reject the whole frame."""
        node_id = self.enroll()["node_id"]
        bad_frames = [
            {"type": "heartbeat", "status": "s" * 65},
            {"type": "heartbeat", "version": "v" * 65},
            {"type": "event_batch", "events": [{"event_type": "e" * 129}]},
            {"type": "event_batch", "events": [{"event_type": "a", "severity": "s" * 33}]},
            {"type": "event_batch", "events": [{"event_type": "a", "correlation_id": "c" * 129}]},
        ]
        for frame in bad_frames:
            self.assertRaises(FrameRejected, self.state.apply_frame, node_id, frame)
        # 2026-04: a command id that is not a UUID fails the handler too (the current
        # generation skips the frame: tests.test_devbackend_generations).
        april = BackendState(self.clock, generation="2026-04")
        token = april.mint_token()["token"]
        april_node = april.enroll(token, "node-a", "10.0.0.5", {}, "1.0", "127.0.0.1")["node_id"]
        for frame in (
            {"type": "command_result", "command_id": "nope"},
            {"type": "heartbeat", "status": 5},
            {"type": "event_batch", "events": "nope"},
            {"type": "event_batch", "events": [{"severity": "info"}]},
        ):
            self.assertRaises(FrameRejected, april.apply_frame, april_node, frame)
        cmd = self.state.issue_command(node_id, "t", {})
        self.assertRaises(
            FrameRejected,
            self.state.apply_frame,
            node_id,
            {"type": "command_result", "command_id": cmd["id"], "error_code": "e" * 129},
        )
        self.assertEqual(self.state.commands[cmd["id"]].status, "queued")
        self.state.apply_frame(node_id, {"type": "event_batch", "events": [{"event_type": "ok"}]})
        self.assertEqual(len(self.state.events[node_id]), 1)

    def test_event_batch_is_all_or_nothing(self) -> None:
        """One over-long event drops the batch: nothing of it is stored."""
        node_id = self.enroll()["node_id"]
        frame = {"type": "event_batch", "events": [{"event_type": "ok"}, {"event_type": "x" * 129}]}
        self.assertRaises(FrameRejected, self.state.apply_frame, node_id, frame)
        self.assertEqual(self.state.events.get(node_id, []), [])

    def test_unknown_command_ignored(self) -> None:
        """Acks for unknown commands are ignored and noted as anomalies."""
        node_id = self.enroll()["node_id"]
        self.state.apply_frame(node_id, {"type": "command_ack", "command_id": str(uuid.uuid4())})
        self.assertIn("unknown command", self.state.anomalies[node_id][0])

    def test_rewrite_endpoint(self) -> None:
        """The host part is replaced, scheme, port and path kept."""
        self.assertEqual(
            rewrite_endpoint("http://0.0.0.0:8123/v1", "10.1.1.1"), "http://10.1.1.1:8123/v1"
        )
        self.assertEqual(rewrite_endpoint("http://h:80", "fd00::2"), "http://[fd00::2]:80")
        self.assertEqual(rewrite_endpoint("not a url", "10.1.1.1"), "not a url")
        self.assertIsNone(rewrite_endpoint(None, "10.1.1.1"))

    def test_runtime_lifecycle(self) -> None:
        """Section 6/7 side effects move the runtime as the real backend does."""
        node_id = self.enroll(host="10.0.0.5")["node_id"]
        rid = str(uuid.uuid4())
        deploy = self.state.issue_command(node_id, "deploy_workload", {"runtime_id": rid})
        self.assertEqual(self.state.runtimes[rid].status, "creating")
        self.state.apply_frame(
            node_id,
            {
                "type": "command_result",
                "command_id": deploy["id"],
                "success": True,
                "result": {"endpoint_url": "http://127.0.0.1:9001"},
            },
        )
        runtime = self.state.runtimes[rid]
        self.assertEqual(
            (runtime.status, runtime.endpoint_url), ("running", "http://10.0.0.5:9001")
        )

        def health(kind: str, **payload: Any) -> None:
            self.state.apply_frame(
                node_id,
                {
                    "type": "event_batch",
                    "events": [
                        {
                            "event_type": f"workload.health.{kind}",
                            "payload": {"runtime_id": rid, **payload},
                        }
                    ],
                },
            )

        health("stopped", status="exited", exit_code=3)
        self.assertEqual(runtime.status, "error")
        self.assertEqual(runtime.error_message, "Container exited (exit code 3)")
        health("running", endpoint_url="http://1.2.3.4:9002")
        self.assertEqual(
            (runtime.status, runtime.endpoint_url), ("running", "http://10.0.0.5:9002")
        )
        health("unhealthy", health_status="unhealthy")
        self.assertEqual(runtime.status, "running")
        self.assertEqual(runtime.health_message, "Health check: unhealthy")
        health("missing")
        self.assertEqual((runtime.status, runtime.error_message), ("error", "Container not found on node"))
        health("missing")
        health("running", endpoint_url="http://x:1")
        stop = self.state.issue_command(node_id, "stop_workload", {"runtime_id": rid})
        self.state.apply_frame(
            node_id, {"type": "command_result", "command_id": stop["id"], "success": True}
        )
        self.assertEqual(runtime.status, "stopped")
        logs = self.state.issue_command(node_id, "fetch_container_logs", {"runtime_id": rid})
        self.state.apply_frame(
            node_id,
            {"type": "command_result", "command_id": logs["id"], "error_message": "boom"},
        )
        self.assertEqual((runtime.status, runtime.error_message), ("error", "boom"))
        self.assertEqual(
            runtime.history,
            ["creating", "running", "error", "running", "error", "running", "stopped", "error"],
        )


# -- loopback helpers -----------------------------------------------------------------------


class _Client(WebSocketClientProtocol):  # type: ignore[misc]
    """A minimal stream client that records messages and how it ended."""

    factory: _ClientFactory

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[dict[str, Any]] = []
        self.lost: Deferred[None] = Deferred()
        self._waiters: list[tuple[Callable[[list[dict[str, Any]]], bool], Deferred[None]]] = []
        self._pong: Deferred[None] | None = None
        self.seq = 0

    def onOpen(self) -> None:
        self.factory.opened.callback(self)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        self.messages.append(json.loads(payload))
        for predicate, d in list(self._waiters):
            if predicate(self.messages):
                self._waiters.remove((predicate, d))
                d.callback(None)

    def onPong(self, payload: bytes) -> None:
        pong, self._pong = self._pong, None
        if pong is not None:
            pong.callback(None)

    def onClose(self, wasClean: bool, code: int | None, reason: str | None) -> None:
        if not self.factory.opened.called:
            self.factory.opened.errback(Failure(ConnectionError(reason)))
        self.factory.closed.callback((wasClean, code, reason))

    def connectionLost(self, reason: Failure | None = None) -> None:
        super().connectionLost(cast(Failure, reason))
        self.lost.callback(None)

    def wait_messages(self, predicate: Callable[[list[dict[str, Any]]], bool]) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        if predicate(self.messages):
            d.callback(None)
        else:
            self._waiters.append((predicate, d))
        d.addTimeout(10, reactor)
        return d

    def send(self, frame: Any, *, seq: bool = True) -> None:
        """Send a JSON frame, numbering objects with the next seq unless told not to."""
        if seq and isinstance(frame, dict) and "seq" not in frame:
            self.seq += 1
            frame = {**frame, "seq": self.seq}
        self.sendMessage(json.dumps(frame).encode("utf-8"), isBinary=False)

    def barrier(self) -> Deferred[None]:
        """A ping round trip: everything the server sent before the pong has arrived."""
        self._pong = Deferred()
        self.sendPing()
        return self._pong


class _ClientFactory(WebSocketClientFactory):  # type: ignore[misc]
    protocol = _Client  # type: ignore[assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.opened: Deferred[_Client] = Deferred()
        self.closed: Deferred[tuple[bool, int | None, str | None]] = Deferred()


def _headers(values: dict[str, str]) -> Any:
    """treq headers from a plain mapping."""
    return {k: [v] for k, v in values.items()}


class LoopbackMixin(AnomalyGuard):
    """
    Starts a DevBackend on 127.0.0.1 and tears down every connection after the test; the
    shared teardown fails the test on protocol anomalies it did not allow.
    """

    backend: DevBackend
    http: HTTPClient
    clients: list[_Client]
    tls: TLSFiles | None = None
    base_path = ""
    addCleanup: Callable[..., None]

    async def start(self, clock: Clock | None = None, **kwargs: Any) -> None:
        self.clients = []
        self.backend = DevBackend(reactor, base_path=self.base_path, clock=clock, **kwargs)
        self.watch_backend(self.backend)
        self.addCleanup(self._stop_backend)
        await self.backend.listen(0, "127.0.0.1", tls=self.tls)
        pool = HTTPConnectionPool(reactor, persistent=False)
        if self.tls is not None:
            with open(self.tls.ca_pem, "rb") as f:
                ca = Certificate.loadPEM(f.read())
            agent = Agent(reactor, BrowserLikePolicyForHTTPS(trustRoot=ca), pool=pool)
        else:
            agent = Agent(reactor, pool=pool)
        self.http = HTTPClient(cast(Any, agent))

    async def _stop_backend(self) -> None:
        for client in self.clients:
            if client.state == client.STATE_OPEN:
                client.sendClose(1000)
        for client in self.clients:
            await client.lost
        await self.backend.stop()

    async def post(
        self,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
    ) -> tuple[int, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else b"")
        all_headers: Any = {"Content-Type": ["application/json"]}
        for k, v in (headers or {}).items():
            all_headers[k] = [v]
        response = await self.http.post(self.backend.url + path, data=data, headers=all_headers)
        text = await response.text()
        try:
            return response.code, json.loads(text)
        except ValueError:
            return response.code, text

    async def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        response = await self.http.get(
            self.backend.url + path, headers=_headers(headers or {})
        )
        text = await response.text()
        try:
            return response.code, json.loads(text)
        except ValueError:
            return response.code, text

    async def enroll(self, agent_id: str = "node-1", host: str = "127.0.0.1") -> dict[str, Any]:
        code, token = await self.post(NODES + "/enrollment-tokens", {"note": "test"})
        assert code == 200, token
        code, reply = await self.post(
            NODES + "/enroll",
            {
                "enrollment_token": token["token"],
                "agent_id": agent_id,
                "host": host,
                "capabilities": {"gpu_count": 0},
                "version": "1.2.3",
            },
        )
        assert code == 200, reply
        return reply

    async def connect(self, credential: str | None) -> _ClientFactory:
        """Open a stream; returns the factory (its C{opened} may fail, C{closed} fires)."""
        headers = {"Authorization": f"Bearer {credential}"} if credential is not None else {}
        factory = _ClientFactory(self.backend.stream_url, headers=headers, reactor=reactor)
        # No Autobahn timers (they would run on txaio's global loop and outlive the test).
        factory.setProtocolOptions(
            openHandshakeTimeout=0, closeHandshakeTimeout=0, serverConnectionDropTimeout=0
        )
        endpoint: Any = TCP4ClientEndpoint(reactor, "127.0.0.1", self.backend.port)
        if self.tls is not None:
            with open(self.tls.ca_pem, "rb") as f:
                ca = Certificate.loadPEM(f.read())
            endpoint = wrapClientTLS(optionsForClientTLS("127.0.0.1", trustRoot=ca), endpoint)
        client = await endpoint.connect(factory)
        self.clients.append(client)
        return factory

    async def open_stream(self, credential: str) -> _Client:
        factory = await self.connect(credential)
        client = await factory.opened
        await client.wait_messages(lambda m: len(m) >= 1)
        return client


# -- loopback tests -------------------------------------------------------------------------


class EnrollmentTests(LoopbackMixin, TestCase):
    """Enrollment and credential rotation over HTTP."""

    timeout = 20

    async def test_enroll_ok(self) -> None:
        """A minted token enrolls a node; the reply has the protocol's fields and shapes."""
        await self.start()
        reply = await self.enroll("agent-a", host="not-an-ip")
        self.assertEqual(set(reply), {"node_id", "agent_id", "credential", "status", "host"})
        self.assertEqual(reply["status"], "healthy")
        self.assertEqual(reply["host"], "127.0.0.1")
        self.assertRegex(reply["credential"], CREDENTIAL_RE)
        node = self.backend.node(reply["node_id"])
        assert node is not None
        self.assertEqual(node["agent_id"], "agent-a")
        self.assertEqual(node["version"], "1.2.3")

    async def test_forwarded_for(self) -> None:
        """Without an IP literal, the first X-Forwarded-For entry becomes the host."""
        await self.start()
        token = self.backend.mint_token()["token"]
        code, reply = await self.post(
            NODES + "/enroll",
            {"enrollment_token": token, "agent_id": "a", "host": "box"},
            headers={"X-Forwarded-For": "192.0.2.7, 10.0.0.1"},
        )
        self.assertEqual((code, reply["host"]), (200, "192.0.2.7"))

    async def test_enroll_401(self) -> None:
        """Unknown, used and expired tokens get the exact 401 detail."""
        await self.start(token_ttl=3600)
        detail = {"detail": "Enrollment token is invalid or expired."}
        body = {"enrollment_token": "x" * 32, "agent_id": "a"}
        self.assertEqual(await self.post(NODES + "/enroll", body), (401, detail))
        token = self.backend.mint_token()["token"]
        body = {"enrollment_token": token, "agent_id": "a"}
        self.assertEqual((await self.post(NODES + "/enroll", body))[0], 200)
        self.assertEqual(await self.post(NODES + "/enroll", body), (401, detail))
        self.backend.state.token_ttl = 0
        token = self.backend.mint_token()["token"]
        body = {"enrollment_token": token, "agent_id": "a"}
        self.assertEqual(await self.post(NODES + "/enroll", body), (401, detail))

    async def test_enroll_422(self) -> None:
        """Malformed bodies get pydantic-shaped 422 errors naming the field."""
        await self.start()
        code, reply = await self.post(NODES + "/enroll", {"enrollment_token": "t"})
        self.assertEqual(code, 422)
        self.assertEqual(reply["detail"][0]["loc"], ["body", "agent_id"])
        self.assertEqual(reply["detail"][0]["type"], "missing")
        self.assertNotIn('"t"', json.dumps(reply))
        code, reply = await self.post(NODES + "/enroll", raw=b"{not json")
        self.assertEqual((code, reply["detail"][0]["type"]), (422, "json_invalid"))
        code, reply = await self.post(NODES + "/enroll", [1, 2])
        self.assertEqual((code, reply["detail"][0]["type"]), (422, "model_attributes_type"))
        code, reply = await self.post(
            NODES + "/enroll", {"enrollment_token": "t", "agent_id": 5, "capabilities": []}
        )
        self.assertEqual(code, 422)
        self.assertEqual(
            [e["loc"] for e in reply["detail"]], [["body", "agent_id"], ["body", "capabilities"]]
        )
        code, reply = await self.post(NODES + "/enroll", raw=b"")
        self.assertEqual((code, reply["detail"][0]["loc"]), (422, ["body"]))

    async def test_enroll_500_on_long_fields(self) -> None:
        """Over-long agent_id or version fail like the insert (500), token still usable."""
        await self.start()
        token = self.backend.mint_token()["token"]
        code, text = await self.post(
            NODES + "/enroll", {"enrollment_token": token, "agent_id": "a" * 129}
        )
        self.assertEqual((code, text), (500, "Internal Server Error"))
        code, _ = await self.post(
            NODES + "/enroll", {"enrollment_token": token, "agent_id": "a", "version": "v" * 65}
        )
        self.assertEqual(code, 500)
        code, _ = await self.post(NODES + "/enroll", {"enrollment_token": token, "agent_id": "a"})
        self.assertEqual(code, 200)

    async def test_reenroll_same_node(self) -> None:
        """Re-enrolling an agent_id reuses its node row and does not revoke the old credential."""
        await self.start()
        first = await self.enroll("same")
        second = await self.enroll("same")
        self.assertEqual(first["node_id"], second["node_id"])
        self.assertEqual(len(self.backend.nodes()), 1)
        code, _ = await self.post(
            NODES + "/credentials/rotate",
            headers={"Authorization": "Bearer " + first["credential"]},
        )
        self.assertEqual(code, 200)

    async def test_rotate(self) -> None:
        """Rotation answers a new credential; the presented one is revoked at once."""
        await self.start()
        reply = await self.enroll()
        old = "Bearer " + reply["credential"]
        code, rotated = await self.post(
            NODES + "/credentials/rotate", headers={"Authorization": old}
        )
        self.assertEqual(code, 200)
        self.assertEqual(set(rotated), {"node_id", "credential"})
        self.assertEqual(rotated["node_id"], reply["node_id"])
        self.assertEqual(
            await self.post(NODES + "/credentials/rotate", headers={"Authorization": old}),
            (401, {"detail": "Credential is invalid or revoked."}),
        )
        code, _ = await self.post(
            NODES + "/credentials/rotate",
            headers={"Authorization": "Bearer " + rotated["credential"]},
        )
        self.assertEqual(code, 200)

    async def test_rotate_401_details(self) -> None:
        """The rotate endpoint answers the exact 401 details of the protocol."""
        await self.start()
        cred = (await self.enroll())["credential"]
        code, reply = await self.post(NODES + "/credentials/rotate")
        self.assertEqual((code, reply), (401, {"detail": "Missing Authorization header."}))
        code, reply = await self.post(
            NODES + "/credentials/rotate", headers={"Authorization": "bearer " + cred}
        )
        self.assertEqual((code, reply), (401, {"detail": "Invalid Authorization header."}))
        code, reply = await self.post(
            NODES + "/credentials/rotate", headers={"Authorization": "Bearer x.y"}
        )
        self.assertEqual((code, reply), (401, {"detail": "Invalid credential id."}))

    async def test_rotate_lost_reply(self) -> None:
        """With the fault on, the old credential is revoked and no reply arrives."""
        await self.start()
        reply = await self.enroll()
        self.backend.faults.lose_rotate_reply = True
        old = "Bearer " + reply["credential"]
        with self.assertRaises(ResponseNeverReceived):
            await self.post(NODES + "/credentials/rotate", headers={"Authorization": old})
        self.backend.faults.lose_rotate_reply = False
        self.assertEqual(
            await self.post(NODES + "/credentials/rotate", headers={"Authorization": old}),
            (401, {"detail": "Credential is invalid or revoked."}),
        )

    async def test_unknown_path_and_method(self) -> None:
        """Unknown paths and methods answer FastAPI-style JSON errors."""
        await self.start()
        self.assertEqual(await self.get("/api/nope"), (404, {"detail": "Not Found"}))
        self.assertEqual(await self.get(NODES + "/enroll"), (405, {"detail": "Method Not Allowed"}))


class StreamTests(LoopbackMixin, TestCase):
    """The WebSocket stream over loopback."""

    timeout = 20

    async def test_403_before_upgrade(self) -> None:
        """Missing, bad, revoked credentials and deleted nodes fail the handshake with 403."""
        await self.start()
        reply = await self.enroll()
        cred = reply["credential"]
        cred_id = cred.split(".")[0]
        attempts = [None, "garbage", f"{cred_id}.{'B' * 43}"]
        for credential in attempts:
            factory = await self.connect(credential)
            with self.assertRaises(ConnectionError):
                await factory.opened
            _clean, _code, reason = await factory.closed
            self.assertIn("[403]", reason or "")
        self.backend.revoke_credentials(reply["node_id"])
        factory = await self.connect(cred)
        with self.assertRaises(ConnectionError):
            await factory.opened
        self.assertIn("[403]", (await factory.closed)[2] or "")
        cred2 = (await self.enroll())["credential"]
        self.backend.delete_node(reply["node_id"])
        factory = await self.connect(cred2)
        with self.assertRaises(ConnectionError):
            await factory.opened
        self.assertIn("[403]", (await factory.closed)[2] or "")

    async def test_hello_ack(self) -> None:
        """hello_ack carries session, node, pending commands (now dispatched) and profile."""
        await self.start()
        reply = await self.enroll()
        node_id = reply["node_id"]
        profile = {"id": "p1", "name": "default", "is_default": True}
        self.backend.set_profile(node_id, profile)
        cmd = self.backend.issue_command(node_id, "refresh_inventory", {})
        client = await self.open_stream(reply["credential"])
        hello = client.messages[0]
        self.assertEqual(hello["type"], "hello_ack")
        self.assertEqual(hello["node_id"], node_id)
        uuid.UUID(hello["session_id"])
        self.assertEqual(hello["profile"], profile)
        self.assertEqual([c["id"] for c in hello["commands"]], [cmd["id"]])
        wire = hello["commands"][0]
        self.assertEqual(wire["status"], "dispatched")
        self.assertEqual(
            set(wire),
            {
                "id",
                "node_id",
                "command_type",
                "status",
                "correlation_id",
                "idempotency_key",
                "payload",
                "result",
                "timeout_sec",
                "error_code",
                "error_message",
                "issued_at",
                "dispatched_at",
                "acked_at",
                "started_at",
                "completed_at",
            },
        )
        self.assertEqual(self.backend.command(cmd["id"])["status"], "dispatched")
        self.assertEqual(self.backend.connection_count(node_id), 1)
        # Still offline until the first heartbeat? Enrollment set it healthy; connect alone
        # changes nothing.
        self.assertEqual(self.backend.node(node_id)["status"], "healthy")  # type: ignore[index]

    async def test_commands_only_in_reply(self) -> None:
        """2026-04: a command issued while connected arrives only after the agent's next frame."""
        await self.start(generation="2026-04")
        reply = await self.enroll()
        client = await self.open_stream(reply["credential"])
        cmd = self.backend.issue_command(reply["node_id"], "collect_diagnostics", {})
        await client.barrier()
        self.assertEqual([m["type"] for m in client.messages], ["hello_ack"])
        client.send({"type": "heartbeat", "status": "healthy"})
        await client.wait_messages(lambda m: len(m) >= 2)
        self.assertEqual(client.messages[1]["type"], "commands")
        self.assertEqual([c["id"] for c in client.messages[1]["items"]], [cmd["id"]])
        # Re-sent on every frame until acked, then never again.
        client.send({"type": "unknown-type"})
        await client.wait_messages(lambda m: len(m) >= 3)
        self.assertEqual(client.messages[2]["items"][0]["id"], cmd["id"])
        client.send({"type": "command_ack", "command_id": cmd["id"]})
        client.send({"type": "heartbeat"})
        await self.backend.wait_for(lambda: len(self.backend.frames(reply["node_id"])) == 4)
        await client.barrier()
        self.assertEqual(len(client.messages), 3)
        self.assertEqual(self.backend.command(cmd["id"])["status"], "acked")

    async def test_seq_drop(self) -> None:
        """2026-04: frames whose seq does not increase (0 included) are dropped without dispatch."""
        await self.start(generation="2026-04")
        reply = await self.enroll()
        node_id = reply["node_id"]
        client = await self.open_stream(reply["credential"])
        self.backend.issue_command(node_id, "refresh_inventory", {})
        client.send({"type": "heartbeat", "status": "degraded", "seq": 0})
        client.send({"type": "heartbeat", "status": "draining", "seq": 5})
        client.send({"type": "heartbeat", "status": "maintenance", "seq": 5})
        client.send({"type": "heartbeat", "status": "error", "seq": 4})
        await self.backend.wait_for(lambda: len(self.backend.frames(node_id)) == 4)
        await client.barrier()
        self.assertEqual(
            [f["_accepted"] for f in self.backend.frames(node_id)], [False, True, False, False]
        )
        self.assertEqual(self.backend.node(node_id)["status"], "draining")  # type: ignore[index]
        self.assertEqual([m["type"] for m in client.messages], ["hello_ack", "commands"])
        # No seq: no check.
        client.send({"type": "heartbeat", "status": "healthy"}, seq=False)
        await client.wait_messages(lambda m: len(m) >= 3)
        self.assertEqual(self.backend.node(node_id)["status"], "healthy")  # type: ignore[index]

    async def test_bad_frames_drop_connection(self) -> None:
        """Non-object, invalid or too deep JSON, binary frames, a non-integer seq: dropped."""
        self.allow_anomalies(
            r"^connection dropped: (frame is not a JSON object|frame is not valid JSON|binary frame"
            r"|frame is nested too deeply|seq is not an integer)$",
            "the test sends each kind of bad frame on purpose",
        )
        await self.start()
        reply = await self.enroll()
        node_id = reply["node_id"]
        deep = b'{"a":' * 5000 + b"1" + b"}" * 5000
        for bad in (b"[1, 2]", b"{nope", None, deep, b'{"type": "heartbeat", "seq": "x"}'):
            client = await self.open_stream(reply["credential"])
            if bad is None:
                client.sendMessage(b"\x00\x01", isBinary=True)
            else:
                client.sendMessage(bad, isBinary=False)
            was_clean, code, _reason = await client.factory.closed
            self.assertFalse(was_clean)
            self.assertEqual(code, 1006)
            await client.lost
            self.assertEqual(self.backend.connection_count(node_id), 0)
        self.assertEqual(len(self.backend.anomalies(node_id)), 5)

    async def test_field_limit_drops_connection(self) -> None:
        """An over-long heartbeat status or event field drops the connection, nothing stored."""
        self.allow_anomalies(r"^connection dropped: .* is longer than \d+ characters$",
                             "the test sends over-long fields on purpose")
        await self.start()
        reply = await self.enroll()
        node_id = reply["node_id"]
        client = await self.open_stream(reply["credential"])
        client.send({"type": "heartbeat", "status": "x" * 65})
        self.assertFalse((await client.factory.closed)[0])
        client = await self.open_stream(reply["credential"])
        client.send({"type": "event_batch", "events": [{"event_type": "e" * 129, "payload": {}}]})
        self.assertFalse((await client.factory.closed)[0])
        self.assertEqual(self.backend.events(node_id), [])
        await client.lost
        self.assertEqual(self.backend.node(node_id)["status"], "offline")  # type: ignore[index]

    async def test_idle_close_4408(self) -> None:
        """Without a JSON frame for idle_timeout seconds, the stream closes with 4408."""
        clock = Clock()
        await self.start(clock=clock, idle_timeout=30)
        reply = await self.enroll()
        client = await self.open_stream(reply["credential"])
        clock.advance(29)
        client.send({"type": "heartbeat"})
        await client.wait_messages(lambda m: True)
        await self.backend.wait_for(lambda: len(self.backend.frames(reply["node_id"])) == 1)
        clock.advance(29)
        await client.barrier()  # pings do not count, but nothing has fired yet
        self.assertEqual(client.state, client.STATE_OPEN)
        clock.advance(1)
        was_clean, code, _ = await client.factory.closed
        self.assertEqual((was_clean, code), (True, 4408))

    async def test_ack_after_result_regresses(self) -> None:
        """No state machine guard: an ack after the result moves the command back, recorded."""
        self.allow_anomalies(r"^command_ack after the result of .* \(status regresses\)$",
                             "the test sends an ack after the result on purpose")
        await self.start()
        reply = await self.enroll()
        node_id = reply["node_id"]
        cmd = self.backend.issue_command(node_id, "refresh_inventory", {})
        client = await self.open_stream(reply["credential"])
        client.send({"type": "command_ack", "command_id": cmd["id"], "message": "got it"})
        client.send({"type": "command_progress", "command_id": cmd["id"], "phase": "x"})
        client.send(
            {
                "type": "command_result",
                "command_id": cmd["id"],
                "success": True,
                "result": {"a": 1},
                "error_code": None,
                "error_message": None,
            }
        )
        client.send({"type": "command_ack", "command_id": cmd["id"]})
        await self.backend.wait_for(lambda: len(self.backend.frames(node_id)) == 4)
        self.assertEqual(
            self.backend.status_history(cmd["id"]),
            ["queued", "dispatched", "acked", "running", "succeeded", "acked"],
        )
        self.assertEqual(self.backend.command(cmd["id"])["status"], "acked")
        self.assertEqual(self.backend.command(cmd["id"])["result"], {"a": 1})
        timeline = self.backend.timeline(cmd["id"])
        self.assertEqual(
            [e["event_type"] for e in timeline],
            ["issued", "dispatched", "acked", "progress", "result", "acked"],
        )
        self.assertEqual(timeline[3]["payload"]["phase"], "x")
        self.assertIn("regresses", self.backend.anomalies(node_id)[-1])

    async def test_offline_marking(self) -> None:
        """The node goes offline when its last stream drops; live runtimes turn to error."""
        await self.start()
        reply = await self.enroll()
        node_id = reply["node_id"]
        rid = str(uuid.uuid4())
        self.backend.add_runtime(rid, node_id, status="running", endpoint_url="http://1.1.1.1:1")
        idle = str(uuid.uuid4())
        self.backend.add_runtime(idle, node_id, status="stopped")
        first = await self.open_stream(reply["credential"])
        second = await self.open_stream(reply["credential"])
        self.assertEqual(self.backend.connection_count(node_id), 2)
        first.send({"type": "heartbeat", "status": "healthy"})
        await first.wait_messages(lambda m: True)
        await self.backend.wait_for(lambda: len(self.backend.frames(node_id)) == 1)
        self.backend.drop_connections(node_id)
        await first.lost
        await second.lost
        await self.backend.wait_for(lambda: self.backend.connection_count(node_id) == 0)
        self.assertEqual(self.backend.node(node_id)["status"], "offline")  # type: ignore[index]
        runtime = self.backend.runtime(rid)
        assert runtime is not None
        self.assertEqual((runtime["status"], runtime["error_message"]), ("error", "Node offline"))
        self.assertEqual(self.backend.runtime(idle)["status"], "stopped")  # type: ignore[index]

    async def test_one_of_two_connections_drops(self) -> None:
        """Two streams both get pending commands; losing one keeps the node online."""
        await self.start()
        reply = await self.enroll()
        node_id = reply["node_id"]
        cmd = self.backend.issue_command(node_id, "refresh_inventory", {})
        first = await self.open_stream(reply["credential"])
        second = await self.open_stream(reply["credential"])
        self.assertEqual(second.messages[0]["commands"][0]["id"], cmd["id"])
        first.sendClose(1000)
        await first.lost
        await self.backend.wait_for(lambda: self.backend.connection_count(node_id) == 1)
        self.assertEqual(self.backend.node(node_id)["status"], "healthy")  # type: ignore[index]

    async def test_health_events_move_runtimes(self) -> None:
        """Results and workload.health events reconcile runtimes; endpoints get the node host."""
        await self.start()
        reply = await self.enroll(host="10.20.30.40")
        node_id = reply["node_id"]
        rid = str(uuid.uuid4())
        cmd = self.backend.issue_command(
            node_id, "deploy_workload", {"runtime_id": rid, "runtime_name": "r"}
        )
        client = await self.open_stream(reply["credential"])
        client.send({"type": "command_ack", "command_id": cmd["id"]})
        client.send(
            {
                "type": "command_result",
                "command_id": cmd["id"],
                "success": True,
                "result": {"endpoint_url": "http://192.168.1.1:8011"},
            }
        )
        client.send(
            {
                "type": "event_batch",
                "events": [
                    {
                        "event_type": "workload.health.crash_loop",
                        "severity": "error",
                        "correlation_id": None,
                        "payload": {"runtime_id": rid, "restart_count": 5, "status": "restarting"},
                        "ts": "2024-01-01T00:00:00Z",
                    }
                ],
            }
        )
        await self.backend.wait_for(lambda: len(self.backend.frames(node_id)) == 3)
        runtime = self.backend.runtime(rid)
        assert runtime is not None
        self.assertEqual(runtime["history"], ["creating", "running", "error"])
        client.send(
            {
                "type": "event_batch",
                "events": [
                    {
                        "event_type": "workload.health.running",
                        "severity": "info",
                        "payload": {"runtime_id": rid, "endpoint_url": "http://0.0.0.0:8012"},
                    }
                ],
            }
        )
        await self.backend.wait_for(lambda: len(self.backend.frames(node_id)) == 4)
        runtime = self.backend.runtime(rid)
        assert runtime is not None
        self.assertEqual(
            (runtime["status"], runtime["endpoint_url"]), ("running", "http://10.20.30.40:8012")
        )
        self.assertEqual(len(self.backend.events(node_id)), 2)

    async def test_frame_hook_and_inbound_filter(self) -> None:
        """The hook sees processed frames; the filter can lose a frame on the wire."""
        await self.start()
        reply = await self.enroll()
        node_id = reply["node_id"]
        cmd = self.backend.issue_command(node_id, "refresh_inventory", {})
        seen: list[str] = []
        self.backend.frame_hook = lambda nid, frame: seen.append(frame["type"])
        self.backend.inbound_filter = lambda nid, frame: frame["type"] != "command_ack"
        client = await self.open_stream(reply["credential"])
        client.send({"type": "command_ack", "command_id": cmd["id"]})
        client.send({"type": "inventory", "inventory": {"gpu_count": 0}, "utilization": {}})
        await self.backend.wait_for(lambda: len(self.backend.frames(node_id)) == 2)
        self.assertEqual(seen, ["inventory"])
        self.assertEqual(self.backend.command(cmd["id"])["status"], "dispatched")
        latest = self.backend.latest_inventory(node_id)
        assert latest is not None
        self.assertEqual(latest["inventory"], {"gpu_count": 0})


class StreamLifecycleTests(LoopbackMixin, TestCase):
    """Server-side endings of streams: stop, deleted node, refused upgrades."""

    timeout = 20

    async def test_stop_closes_open_streams(self) -> None:
        """stop() closes open streams cleanly and idle HTTP connections, leaving nothing."""
        await self.start()
        reply = await self.enroll()
        pool = HTTPConnectionPool(reactor, persistent=True)
        keepalive = HTTPClient(cast(Any, Agent(reactor, pool=pool)))
        response = await keepalive.get(self.backend.url + "/dev/nodes")
        await response.content()
        client = await self.open_stream(reply["credential"])
        await self.backend.stop()
        was_clean, code, _ = await client.factory.closed
        self.assertEqual((was_clean, code), (True, 1000))
        await client.lost
        await pool.closeCachedConnections()
        self.assertEqual(self.backend.node(reply["node_id"])["status"], "offline")  # type: ignore[index]

    async def test_deleted_node_fails_on_next_frame(self) -> None:
        """An open stream of a deleted node is dropped at its next frame."""
        self.allow_anomalies(r"^connection dropped: node no longer exists$",
                             "the test deletes the node while its stream is open")
        await self.start()
        reply = await self.enroll()
        client = await self.open_stream(reply["credential"])
        self.backend.delete_node(reply["node_id"])
        client.send({"type": "heartbeat"})
        was_clean, _code, _ = await client.factory.closed
        self.assertFalse(was_clean)

    async def test_deny_fault(self) -> None:
        """The stream_deny_status knob refuses upgrades with that HTTP status."""
        await self.start()
        reply = await self.enroll()
        self.backend.faults.stream_deny_status = 503
        factory = await self.connect(reply["credential"])
        with self.assertRaises(ConnectionError):
            await factory.opened
        self.assertIn("[503]", (await factory.closed)[2] or "")

    async def test_hold_commands(self) -> None:
        """With hold_commands on, nothing is dispatched until it is turned off."""
        await self.start()
        reply = await self.enroll()
        cmd = self.backend.issue_command(reply["node_id"], "refresh_inventory", {})
        self.backend.faults.hold_commands = True
        client = await self.open_stream(reply["credential"])
        self.assertEqual(client.messages[0]["commands"], [])
        client.send({"type": "heartbeat"})
        await self.backend.wait_for(lambda: len(self.backend.frames(reply["node_id"])) == 1)
        await client.barrier()
        self.assertEqual(len(client.messages), 1)
        self.backend.faults.hold_commands = False
        client.send({"type": "heartbeat"})
        await client.wait_messages(lambda m: len(m) == 2)
        self.assertEqual(client.messages[1]["items"][0]["id"], cmd["id"])


class FilesAndAdminTests(LoopbackMixin, TestCase):
    """Image transfer, the dev admin API, base path and TLS."""

    timeout = 20

    def _tar(self, size: int) -> str:
        path = self.mktemp()
        with open(path, "wb") as f:
            f.write(os.urandom(size))
        return path

    async def test_image_save(self) -> None:
        """A registered tar streams chunked with X-Image-Size; bad refs 400, unknown 404."""
        await self.start()
        cred = (await self.enroll())["credential"]
        path = self._tar(300_000)
        self.backend.add_image("busybox", "1.0", path, image_size=1234)
        auth = {"Authorization": "Bearer " + cred}
        response = await self.http.get(
            self.backend.url + "/api/node-files/images/save?image=busybox&tag=1.0",
            headers=_headers(auth),
        )
        body = await response.content()
        self.assertEqual(response.code, 200)
        with open(path, "rb") as f:
            self.assertEqual(body, f.read())
        headers = response.headers
        self.assertEqual(headers.getRawHeaders("content-type"), ["application/x-tar"])
        self.assertEqual(headers.getRawHeaders("x-image-size"), ["1234"])
        self.assertIsNone(headers.getRawHeaders("content-length"))
        code, _ = await self.get("/api/node-files/images/save?image=reg:5000/x&tag=1", auth)
        self.assertEqual(code, 400)
        code, _ = await self.get("/api/node-files/images/save?image=other&tag=1", auth)
        self.assertEqual(code, 404)
        code, reply = await self.get("/api/node-files/images/save?image=busybox&tag=1.0")
        self.assertEqual((code, reply), (401, {"detail": "Missing Authorization header."}))

    async def save(self, cred: str, query: str, range_: str | None = None) -> tuple[Any, bytes]:
        headers = {"Authorization": "Bearer " + cred}
        if range_:
            headers["Range"] = range_
        response = await self.http.get(
            self.backend.url + "/api/node-files/images/save?" + query, headers=_headers(headers)
        )
        return response, await response.content()

    async def test_image_save_current_export(self) -> None:
        """
        Current generation (protocol 10.4), an image with an id: Content-Length, X-Image-Id,
        Range (206 from the offset, 416 with bytes */size past the end); a pin that names
        another build gets 409 {detail}; the right pin (rootfs or id) gets the image.
        """
        await self.start()
        cred = (await self.enroll())["credential"]
        path = self._tar(300_000)
        with open(path, "rb") as f:
            data = f.read()
        iid, rootfs = "sha256:" + "a" * 64, "sha256:" + "b" * 64
        self.backend.add_image("busybox", "1.0", path, image_size=1234, image_id=iid, rootfs_digest=rootfs)
        response, body = await self.save(cred, "image=busybox&tag=1.0")
        self.assertEqual((response.code, body), (200, data))
        self.assertEqual(response.length, len(data))
        self.assertEqual(response.headers.getRawHeaders("x-image-id"), [iid])
        self.assertIsNone(response.headers.getRawHeaders("x-image-size"))
        response, body = await self.save(cred, "image=busybox&tag=1.0", "bytes=100000-")
        self.assertEqual((response.code, body), (206, data[100000:]))
        self.assertEqual(response.headers.getRawHeaders("content-range"), [f"bytes 100000-{len(data) - 1}/{len(data)}"])
        response, body = await self.save(cred, "image=busybox&tag=1.0", f"bytes={len(data)}-")
        self.assertEqual(response.code, 416)
        self.assertEqual(response.headers.getRawHeaders("content-range"), [f"bytes */{len(data)}"])
        response, body = await self.save(cred, "image=busybox&tag=1.0&expect_id=sha256:" + "9" * 64)
        self.assertEqual(response.code, 409)
        self.assertIn("different build", json.loads(body)["detail"])
        for pin in ("expect_id=" + iid, "expect_rootfs=" + rootfs, "expect_id=x&expect_rootfs=" + rootfs):
            response, body = await self.save(cred, "image=busybox&tag=1.0&" + pin)
            self.assertEqual((response.code, body), (200, data))
        # Every answer that sent the tar is recorded (which node, from where, how much, finished);
        # the 416 and the 409 sent none.
        node_id = self.backend.nodes()[0]["id"]
        fetches = [(f.node_id, f.reference, f.start, f.bytes_sent, f.complete) for f in self.backend.image_fetches]
        self.assertEqual(fetches, [(node_id, "busybox:1.0", 0, len(data), True),
                                   (node_id, "busybox:1.0", 100000, len(data) - 100000, True)]
                         + [(node_id, "busybox:1.0", 0, len(data), True)] * 3)

    async def test_image_save_april_and_no_export(self) -> None:
        """The April route ignores pins and streams; so does the current one for an image without an id."""
        await self.start(generation="2026-04")
        self.assertFalse(self.backend.image_route_current)
        cred = (await self.enroll())["credential"]
        path = self._tar(100_000)
        self.backend.add_image("x", "1", path, image_size=99, image_id="sha256:" + "a" * 64)
        self.backend.add_image("noid", "1", path, image_size=99)
        response, body = await self.save(cred, "image=x&tag=1&expect_id=sha256:" + "9" * 64, "bytes=10-")
        self.assertEqual((response.code, len(body)), (200, 100_000))
        self.assertEqual(response.headers.getRawHeaders("x-image-size"), ["99"])
        self.assertIsNone(response.headers.getRawHeaders("x-image-id"))
        self.backend.image_route_current = True  # the current route, an image it cannot export
        response, body = await self.save(cred, "image=noid&tag=1", "bytes=10-")
        self.assertEqual((response.code, len(body)), (200, 100_000))
        self.assertEqual(response.headers.getRawHeaders("x-image-size"), ["99"])

    async def test_image_abort_fault(self) -> None:
        """The abort knob cuts the download after the given number of bytes."""
        await self.start()
        cred = (await self.enroll())["credential"]
        self.backend.add_image("busybox", "latest", self._tar(200_000))
        self.backend.faults.image_abort_after = 70_000
        response = await self.http.get(
            self.backend.url + "/api/node-files/images/save?image=busybox",
            headers=_headers({"Authorization": "Bearer " + cred}),
        )
        self.assertIsNone(response.headers.getRawHeaders("x-image-size"))
        with self.assertRaises(ResponseFailed):
            await response.content()
        (fetch,) = self.backend.image_fetches
        self.assertEqual((fetch.bytes_sent, fetch.complete), (70_000, False))

    async def test_model_files_mounted(self) -> None:
        """The model files resource is served below api/node-files/models with node auth."""
        await self.start()
        if self.backend.models is None:
            raise SkipTest("llmport_agent.devbackend.modelfiles is not present")
        cred = (await self.enroll())["credential"]
        manifest = self.backend.models.add_model("m1", "org/name", {"config.json": b"{}"})
        code, served = await self.get(
            "/api/node-files/models/m1/manifest", {"Authorization": "Bearer " + cred}
        )
        self.assertEqual((code, served), (200, manifest))
        code, _ = await self.get("/api/node-files/models/m1/manifest")
        self.assertEqual(code, 401)

    async def test_dev_api(self) -> None:
        """The dev admin API lists nodes and issues/reads commands."""
        await self.start()
        reply = await self.enroll()
        node_id = reply["node_id"]
        code, nodes = await self.get("/dev/nodes")
        self.assertEqual((code, [n["id"] for n in nodes]), (200, [node_id]))
        code, cmd = await self.post(
            f"/dev/nodes/{node_id}/commands",
            {"command_type": "refresh_inventory", "payload": {}, "idempotency_key": "k1"},
        )
        self.assertEqual((code, cmd["status"], cmd["idempotency_key"]), (200, "queued", "k1"))
        self.assertEqual((await self.get(f"/dev/commands/{cmd['id']}"))[1]["id"], cmd["id"])
        code, timeline = await self.get(f"/dev/commands/{cmd['id']}/timeline")
        self.assertEqual((code, timeline[0]["event_type"]), (200, "issued"))
        self.assertEqual((await self.get(f"/dev/nodes/{node_id}/commands"))[1][0]["id"], cmd["id"])
        self.assertEqual(await self.get(f"/dev/nodes/{node_id}/inventory"), (200, None))
        self.assertEqual(await self.get(f"/dev/nodes/{node_id}/events"), (200, []))
        self.assertEqual(await self.get(f"/dev/nodes/{node_id}/models"), (200, []))
        self.backend.state.model_availability[node_id] = {"m": {"model_id": "m", "status": "ready"}}
        self.assertEqual(await self.get(f"/dev/nodes/{node_id}/models"), (200, [{"model_id": "m", "status": "ready"}]))
        self.assertEqual((await self.get("/dev/nodes/nope"))[0], 404)
        self.assertEqual((await self.get("/dev/runtimes/nope"))[0], 404)
        code, err = await self.post(f"/dev/nodes/{node_id}/commands", {"payload": {}})
        self.assertEqual((code, err["detail"][0]["loc"]), (422, ["body", "command_type"]))

    async def test_admin_token(self) -> None:
        """With an admin token configured, minting needs it."""
        await self.start(admin_token="s3cret")
        code, _ = await self.post(NODES + "/enrollment-tokens", {"note": None})
        self.assertEqual(code, 401)
        code, token = await self.post(
            NODES + "/enrollment-tokens", {"note": "x"}, headers={"Authorization": "Bearer s3cret"}
        )
        self.assertEqual((code, len(token["token"])), (200, 32))


class BasePathTests(LoopbackMixin, TestCase):
    """Serving below a base path."""

    timeout = 20
    base_path = "/llm/"

    async def test_base_path(self) -> None:
        """Everything lives below the base path; the bare paths are 404."""
        await self.start()
        self.assertTrue(self.backend.url.endswith("/llm"))
        reply = await self.enroll()
        client = await self.open_stream(reply["credential"])
        self.assertEqual(client.messages[0]["type"], "hello_ack")
        response = await self.http.post(
            self.backend.url.removesuffix("/llm") + NODES + "/enroll", data=b"{}"
        )
        await response.content()
        self.assertEqual(response.code, 404)


class TLSTests(LoopbackMixin, TestCase):
    """Serving HTTPS and WSS with a test CA."""

    timeout = 30

    def setUp(self) -> None:
        self.tls = make_test_tls(self.mktemp())

    async def test_tls_listen(self) -> None:
        """Enrollment over https and the stream over wss work with the test CA."""
        assert self.tls is not None
        self.assertEqual(os.stat(self.tls.key_pem).st_mode & 0o777, 0o600)
        await self.start()
        self.assertTrue(self.backend.url.startswith("https://127.0.0.1:"))
        self.assertTrue(self.backend.stream_url.startswith("wss://127.0.0.1:"))
        reply = await self.enroll()
        client = await self.open_stream(reply["credential"])
        self.assertEqual(client.messages[0]["node_id"], reply["node_id"])
        client.send({"type": "heartbeat", "status": "healthy"})
        await self.backend.wait_for(lambda: len(self.backend.frames(reply["node_id"])) == 1)


class CommandLineTests(SynchronousTestCase):
    """Argument handling of C{llmport-agent devbackend} (running it is manual/demo work)."""

    def test_bad_arguments(self) -> None:
        """Invalid values give the usage exit status without starting anything."""
        from llmport_agent.devbackend import cli

        for argv in (["--port", "x"], ["--port", "70000"], ["--idle-timeout", "0"],
                     ["--image", "busybox=/x"], ["--image", "/nonexistent:1=/nonexistent"]):
            self.assertEqual(cli.main(argv), cli.EX_USAGE, argv)

    def test_parser_defaults(self) -> None:
        """Defaults are loopback, port 8000, no base path, 120 s idle timeout."""
        from llmport_agent.devbackend import cli

        args = cli.build_parser().parse_args([])
        self.assertEqual(
            (args.port, args.interface, args.base_path, args.idle_timeout, args.tls_dir),
            (8000, "127.0.0.1", "", 120.0, None),
        )
        args = cli.build_parser().parse_args(["--image", "reg/x:1.0=/tmp/x.tar"])
        self.assertEqual(args.image, [("reg/x", "1.0", "/tmp/x.tar")])
