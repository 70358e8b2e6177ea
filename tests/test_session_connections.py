"""
The session's connection rules, without injected randomness where production has none:

- one connection per node (protocol 3.2: two concurrent sessions each receive the pending
  commands): when a second connection opens, the older one is closed and its later frames and
  close do not touch the current one;
- production jitter: a service built without an injected random source uses a real one; its
  reconnect delays (the ClientService retry policy) differ from draw to draw and from node to
  node, and stay inside [RECONNECT_MIN_SEC, the doubling ceiling <= RECONNECT_MAX_SEC].
"""

from __future__ import annotations

import os
from typing import Any

from twisted.internet.defer import succeed
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.core.backoff import Backoff
from llmport_agent.core.config import load_config
from llmport_agent.core.state import StateStore
from llmport_agent.demo.testing import SynchronousRunner
from llmport_agent.session.service import SessionService

from .test_session import CRED, FakeBackend, FakeProto


class _Listener:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def session_opened(self) -> None:
        self.events.append("opened")

    def session_closed(self) -> None:
        self.events.append("closed")

    def frame_received(self, frame: dict[str, Any]) -> None:
        self.events.append(frame)


class _Base(SynchronousTestCase):
    def make(self, inject_rng: bool = True, **env: str) -> SessionService:
        reactor = MemoryReactorClock()
        environ = {"LLM_PORT_NODE_AGENT_BACKEND_URL": "http://127.0.0.1:8000"}
        environ.update({"LLM_PORT_NODE_AGENT_" + k: v for k, v in env.items()})
        config = load_config(environ, {})
        d = self.mktemp()
        os.makedirs(d)
        state = StateStore(SynchronousRunner(), os.path.join(d, "state.json"))
        self.successResultOf(state.load())
        self.successResultOf(state.update(credential=CRED, node_id="n1"))
        kw: dict[str, Any] = {"rng": lambda: 1.0} if inject_rng else {}
        svc = SessionService(
            reactor, config, state, FakeBackend(),  # type: ignore[arg-type]
            lambda: succeed({"gpu_count": 0}), lambda code, msg: None,
            version="0.1.0",
            endpoint_factory=lambda host, port, tls: TCP4ClientEndpoint(reactor, host, port),
            **kw,
        )
        self.reactor = reactor
        self.addCleanup(svc.stopService)
        return svc


class TwoConnectionsTests(_Base):
    def test_older_connection_closed(self) -> None:
        """A second connection opens: the older one gets a close, the newer one is the session."""
        svc = self.make()
        svc.startService()
        listener = _Listener()
        svc.subscribe(listener)  # type: ignore[arg-type]
        old, new = FakeProto(self.reactor.seconds()), FakeProto(self.reactor.seconds())
        svc.connection_opened(old)  # type: ignore[arg-type]
        svc.connection_opened(new)  # type: ignore[arg-type]
        self.assertEqual(getattr(old, "close", None), (1000, "superseded"))
        self.assertFalse(hasattr(new, "close"))
        self.assertIs(svc.proto, new)
        # Frames on the old connection are not handled as the session's...
        svc.frame_received(old, {"type": "commands", "items": []})  # type: ignore[arg-type]
        self.assertNotIn({"type": "commands", "items": []}, listener.events)
        # ...and its close does not end the session on the new one.
        svc.connection_closed(old, True, 1000, "superseded", None)  # type: ignore[arg-type]
        self.assertIs(svc.proto, new)
        self.assertTrue(svc.connected)
        self.assertEqual(listener.events.count("closed"), 0)
        # What the agent sends goes to the new connection only.
        self.assertTrue(svc.send({"type": "heartbeat"}))
        self.assertEqual([f["type"] for f in new.sent], ["heartbeat"])
        self.assertEqual([f["type"] for f in old.sent if f["type"] == "heartbeat"], [])

    def test_same_connection_twice_is_not_closed(self) -> None:
        svc = self.make()
        svc.startService()
        proto = FakeProto(self.reactor.seconds())
        svc.connection_opened(proto)  # type: ignore[arg-type]
        svc.connection_opened(proto)  # type: ignore[arg-type]
        self.assertFalse(hasattr(proto, "close"))


class ProductionJitterTests(_Base):
    LOW, HIGH = 1.0, 60.0

    def delays(self, svc: SessionService, attempt: int, n: int = 40) -> list[float]:
        svc.startService()
        policy = svc.retry_policy  # the retry policy handed to ClientService
        return [policy(attempt) for _ in range(n)]

    def test_default_source_is_random_and_bounded(self) -> None:
        env = {"RECONNECT_MIN_SEC": str(self.LOW), "RECONNECT_MAX_SEC": str(self.HIGH)}
        a = self.delays(self.make(inject_rng=False, **env), 3)
        b = self.delays(self.make(inject_rng=False, **env), 3)
        ceiling = min(self.HIGH, self.LOW * 2**3)
        for d in a + b:
            self.assertGreaterEqual(d, self.LOW)
            self.assertLessEqual(d, ceiling)
        self.assertGreater(len(set(a)), 30, "the same delay again and again: no jitter")
        self.assertNotEqual(a, b, "two nodes draw the same delays")
        # spread over the range, not stuck at one end
        self.assertLess(min(a + b), self.LOW + 0.25 * (ceiling - self.LOW))
        self.assertGreater(max(a + b), self.LOW + 0.75 * (ceiling - self.LOW))

    def test_at_the_cap(self) -> None:
        env = {"RECONNECT_MIN_SEC": str(self.LOW), "RECONNECT_MAX_SEC": str(self.HIGH)}
        delays = self.delays(self.make(inject_rng=False, **env), 50, n=200)
        self.assertTrue(all(self.LOW <= d <= self.HIGH for d in delays))
        self.assertGreater(max(delays), self.HIGH / 2)
        self.assertGreater(len(set(delays)), 150)

    def test_backoff_default(self) -> None:
        """Backoff without a random source (the logs shippers use it so) is jittered too."""
        a, b = Backoff(1.0, 30.0), Backoff(1.0, 30.0)
        da = [a.delay(10) for _ in range(40)]
        db = [b.delay(10) for _ in range(40)]
        self.assertTrue(all(1.0 <= d <= 30.0 for d in da + db))
        self.assertGreater(len(set(da)), 30)
        self.assertNotEqual(da, db)


class AgentJitterTests(SynchronousTestCase):
    """The agent as production builds it (AgentService, nothing injected) jitters its reconnects."""

    def agent(self) -> Any:
        from twisted.internet import reactor

        from llmport_agent.agent.service import AgentService
        from llmport_agent.inventory.gpu import NoGPUSource

        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        config = load_config({
            "LLM_PORT_NODE_AGENT_BACKEND_URL": "http://127.0.0.1:9",
            "LLM_PORT_NODE_AGENT_STATE_PATH": os.path.join(d, "state.json"),
            "LLM_PORT_NODE_AGENT_MODEL_STORE": os.path.join(d, "models"),
            "LLM_PORT_NODE_AGENT_RECONNECT_MIN_SEC": "1",
            "LLM_PORT_NODE_AGENT_RECONNECT_MAX_SEC": "60",
        }, {})
        return AgentService(reactor, config, fatal=lambda code, msg: None, gpu_source=NoGPUSource(),
                            docker_enabled=False)

    def test_two_agents_draw_different_bounded_delays(self) -> None:
        a, b = self.agent(), self.agent()
        da = [a.session.backoff.delay(4) for _ in range(40)]
        db = [b.session.backoff.delay(4) for _ in range(40)]
        self.assertTrue(all(1.0 <= d <= 16.0 for d in da + db))
        self.assertGreater(len(set(da)), 30)
        self.assertNotEqual(da, db)
