"""
Integration: a real agent against the real stand-in backend over loopback sockets.

Enrollment, heartbeat and inventory through the admin API, backend restart, 403 with and without
a token, idle close, TLS with a private CA, bad inbound frames.
"""

from __future__ import annotations

import json
import os
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.task import deferLater

from llmport_agent.devbackend import make_test_tls
from llmport_agent.devbackend._state import GENERATION_APRIL, GENERATION_CURRENT
from llmport_agent.session.shared import EXIT_NEEDS_OPERATOR
from tests.agentharness import AgentTestCase


def sleep(seconds: float) -> object:
    return deferLater(reactor, seconds, lambda: None)


class EnrollConnectTests(AgentTestCase):
    async def test_enroll_heartbeat_inventory_via_admin_api(self) -> None:
        """The agent enrolls, connects, and its heartbeat and inventory show in the admin API."""
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        await backend.wait_for(lambda: backend.latest_inventory(node_id) is not None)
        response = await treq.get(f"{backend.url}/dev/nodes/{node_id}", persistent=False)
        node = json.loads(await response.content())
        self.assertEqual(node["status"], "healthy")
        self.assertEqual(node["version"], agent.session.version)
        response = await treq.get(f"{backend.url}/dev/nodes/{node_id}/inventory", persistent=False)
        inv = json.loads(await response.content())
        body = inv.get("inventory", inv)
        self.assertIn("gpu_count", json.dumps(body))
        with open(agent.state.path) as f:
            stored = json.load(f)
        self.assertEqual(stored["node_id"], node_id)
        self.assertEqual(os.stat(agent.state.path).st_mode & 0o777, 0o600)

    async def test_clean_stop_closes_1000(self) -> None:
        """Stopping the agent closes the stream cleanly; the backend marks the node offline."""
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        await agent.stopService()
        await backend.wait_for(lambda: backend.connection_count(node_id) == 0)
        self.assertEqual(backend.node(node_id)["status"], "offline")
        self.assertTrue(agent.session.stats.last_close["clean"])

    async def test_rejected_token_exits_needs_operator(self) -> None:
        """A used/invalid token stops the agent with the dedicated status and a clear message."""
        backend = await self.start_backend()
        fatal: list[tuple[int, str]] = []
        self.start_agent(backend, ENROLLMENT_TOKEN="x" * 32, fatal=fatal)
        await backend.wait_for(lambda: bool(fatal))
        self.assertEqual(fatal[0][0], EXIT_NEEDS_OPERATOR)
        self.assertIn("rejected", fatal[0][1])
        self.assertNotIn("x" * 32, fatal[0][1])


class StartOrderTests(AgentTestCase):
    """
    The session starts first, so that its enrollment (or its connect) is under way while the
    other services start (issue 27: start to connected); the stop still closes it first.
    """

    async def test_the_session_starts_first_and_stops_first_current(self) -> None:
        await self._starts_first_and_stops_first(GENERATION_CURRENT)

    async def test_the_session_starts_first_and_stops_first_april(self) -> None:
        await self._starts_first_and_stops_first(GENERATION_APRIL)

    async def _starts_first_and_stops_first(self, generation: str) -> None:
        backend = await self.start_backend(generation=generation)
        said: list[str] = []
        names = ("lateness", "outbox", "pipeline", "heartbeat", "inventory", "gpu_monitor", "session")

        def prepare(agent: Any) -> None:
            def recorded(what: str, call: Any) -> Any:
                def record(*args: Any, **kwargs: Any) -> Any:
                    said.append(what)
                    return call(*args, **kwargs)

                return record

            for name in names:
                svc = getattr(agent, name)
                self.patch(svc, "startService", recorded("start " + name, svc.startService))
                self.patch(svc, "stopService", recorded("stop " + name, svc.stopService))

        agent = self.start_agent(backend, prepare=prepare)
        await self.wait_connected(backend, agent)
        await agent.stopService()
        self.assertEqual(
            [w for w in said if w.startswith("start ")],
            ["start session"] + ["start " + n for n in names if n != "session"],
        )
        self.assertEqual([w for w in said if w.startswith("stop ")], ["stop " + n for n in reversed(names)])


class FaultTests(AgentTestCase):
    async def test_backend_restart_reconnects(self) -> None:
        """The backend stops and restarts on the same port; the agent reconnects within the backoff bounds."""
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        port = backend.port
        await backend.stop()
        await sleep(1.0)
        self.assertFalse(agent.session.connected)
        await backend.listen(port, "127.0.0.1")
        restarted = reactor.seconds()
        await backend.wait_for(lambda: backend.connection_count(node_id) == 1, 10)
        # RECONNECT_MAX_SEC is 1: one retry period plus connect time.
        self.assertLess(reactor.seconds() - restarted, 3.0)

    async def test_network_cut_reconnects(self) -> None:
        """A cut TCP connection is detected and the agent reconnects; heartbeat follows at once."""
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        opens = agent.session.stats.opens
        beats = agent.heartbeat.sent
        backend.drop_connections(node_id)
        await backend.wait_for(lambda: agent.session.stats.opens > opens, 10)
        await backend.wait_for(lambda: agent.heartbeat.sent > beats)

    async def test_403_without_token_keeps_retrying(self) -> None:
        """A revoked credential: retries, then one clear line per attempt; no exit, credential kept."""
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        agent.session.refusals.revoked_after_refusals = 3
        agent.session.refusals.revoked_after_seconds = 0.5
        agent.session.refusals.revoked_retry_seconds = 0.5
        cred = agent.state.credential
        backend.revoke_credentials(node_id)
        backend.drop_connections(node_id)
        # (The stand-in's whoami says at the first refusal that the credential is gone.)
        await backend.wait_for(lambda: agent.session.refusals.revoked and agent.session.stats.refused >= 3, 20)
        self.assertEqual(agent.state.credential, cred)
        self.assertIsNone(agent.exit_status)
        self.assertGreaterEqual(agent.session.stats.refused, 3)

    async def test_403_with_fresh_token_reenrolls(self) -> None:
        """A deleted node with an unused token configured re-enrolls and reconnects."""
        backend = await self.start_backend()
        state_dir = self.mktemp()
        agent = self.start_agent(backend, state_dir=state_dir)
        node_id = await self.wait_connected(backend, agent)
        await agent.stopService()
        backend.revoke_credentials(node_id)
        fresh = backend.mint_token("re-enroll")["token"]
        agent2 = self.start_agent(backend, state_dir=state_dir, ENROLLMENT_TOKEN=fresh,
                                  AGENT_ID=agent.config.agent_id)
        agent2.session.refusals.revoked_after_refusals = 2
        agent2.session.refusals.revoked_after_seconds = 0.3
        await backend.wait_for(lambda: agent2.session.stats.enrollments == 1, 20)
        node2 = await self.wait_connected(backend, agent2)
        self.assertEqual(node2, node_id)  # same agent id reuses the node row

    async def test_idle_close_4408_reconnects(self) -> None:
        """A backend idle timeout (4408) closes the stream; the agent reconnects."""
        backend = await self.start_backend(idle_timeout=1.0)
        agent = self.start_agent(backend, COMMAND_POLL_INTERVAL_SEC="30", HEARTBEAT_INTERVAL_SEC="30")
        node_id = await self.wait_connected(backend, agent)
        await backend.wait_for(lambda: agent.session.stats.last_close.get("code") == 4408, 10)
        await backend.wait_for(lambda: backend.connection_count(node_id) == 1, 10)

    async def test_bad_inbound_frames(self) -> None:
        """Non-JSON, a list, binary, unknown type, garbage commands: logged, nothing breaks."""
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        proto = next(iter(backend.streams(node_id)))
        for payload, binary in [
            (b"not json", False), (b"[1,2,3]", False), (b"\x00\xff", True),
            (b'{"type":"surprise"}', False), (b'{"type":"commands","items":"nope"}', False),
            (b'{"type":"commands","items":[1,"x",{"id":"not-uuid"},null]}', False),
            (b"x" * (9 * 1024 * 1024), False),
        ]:
            proto.sendMessage(payload, isBinary=binary)
        await sleep(1.0)
        self.assertTrue(agent.session.connected)
        self.assertEqual(backend.connection_count(node_id), 1)
        cmd = backend.issue_command(node_id, "refresh_inventory", {})
        await backend.wait_for(lambda: backend.command(cmd["id"])["status"] == "succeeded")


class TLSTests(AgentTestCase):
    async def _tls_backend(self) -> tuple[object, str]:
        from llmport_agent.devbackend import DevBackend

        tls = make_test_tls(self.mktemp())
        backend: DevBackend = await self.start_backend(tls=tls)
        return backend, tls.ca_pem

    async def test_tls_with_ca_bundle(self) -> None:
        """With CA_BUNDLE naming the private CA, enrollment and the wss stream work."""
        backend, ca = await self._tls_backend()
        self.assertTrue(backend.url.startswith("https://"))
        agent = self.start_agent(backend, CA_BUNDLE=ca)
        await self.wait_connected(backend, agent)

    async def test_tls_refused_without_ca(self) -> None:
        """Without the CA the certificate is refused: no enrollment happens."""
        backend, ca = await self._tls_backend()
        agent = self.start_agent(backend)
        await sleep(2.0)
        self.assertIsNone(agent.session.node_id)
        self.assertEqual(backend.nodes(), [])


class LokiTests(AgentTestCase):
    async def test_agent_logs_reach_loki_with_node_labels(self) -> None:
        """With LOKI_URL set, the agent's log lines reach Loki labelled as protocol 8 says; no secret."""
        from twisted.internet.endpoints import TCP4ServerEndpoint
        from twisted.web.server import Site

        from llmport_agent.logs.testing import FakeLoki

        loki = FakeLoki()
        site = Site(loki)
        port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(site)
        self.addCleanup(port.stopListening)
        backend = await self.start_backend()
        agent = self.start_agent(backend, LOKI_URL=f"http://127.0.0.1:{port.getHost().port}",
                                 LOG_FLUSH_INTERVAL_SEC="0.2")
        await self.wait_connected(backend, agent)
        agent_id = agent.config.agent_id
        await backend.wait_for(
            lambda: any("Connected to the backend stream" in line
                        for line in loki.lines(job="node-agent", container=f"node-{agent_id}")), 10)
        entries = loki.entries(job="node-agent")
        self.assertTrue(all(e.labels["host"] == "127.0.0.1" for e in entries))
        self.assertTrue(all("level" in e.labels for e in entries))
        text = "\n".join(loki.lines())
        self.assertNotIn(agent.state.credential.split(".")[1], text)
        await agent.stopService()


class DegradedTests(AgentTestCase):
    async def test_heartbeat_degraded_without_engine(self) -> None:
        """With the Docker executor on and no engine reachable, the heartbeat says degraded."""
        import uuid as _uuid

        backend = await self.start_backend()
        agent = self.start_agent(backend, docker_host=f"unix:///tmp/none-{_uuid.uuid4().hex[:8]}.sock")
        node_id = await self.wait_connected(backend, agent)
        await backend.wait_for(lambda: backend.node(node_id)["status"] == "degraded", 10)
        await backend.wait_for(lambda: backend.latest_inventory(node_id) is not None)
        caps = backend.latest_inventory(node_id)["inventory"]["static_capabilities"]
        self.assertFalse(caps["docker_available"])
