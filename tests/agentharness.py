"""Helpers for integration tests: a real agent (in-process) against the real stand-in backend."""

from __future__ import annotations

import os
import uuid
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.trial.unittest import TestCase

from llmport_agent.config import load_config
from llmport_agent.devbackend import DevBackend
from llmport_agent.inventory.gpu import NoGPUSource
from llmport_agent.service import AgentService


def agent_env(backend: DevBackend, state_dir: str, **extra: str) -> dict[str, str]:
    env = {
        "BACKEND_URL": backend.url,
        "AGENT_ID": "agent-" + uuid.uuid4().hex[:8],
        "HOST": "127.0.0.1",
        "STATE_PATH": os.path.join(state_dir, "state.json"),
        "MODEL_STORE": os.path.join(state_dir, "models"),
        "OPS_PORT": "0",
        "RECONNECT_MIN_SEC": "0.2",
        "RECONNECT_MAX_SEC": "1",
        "COMMAND_POLL_INTERVAL_SEC": "0.5",
    }
    env.update(extra)
    return {"LLM_PORT_NODE_AGENT_" + k: v for k, v in env.items()}


class AgentTestCase(TestCase):
    """Starts a stand-in backend per test; C{start_agent} runs a real agent against it."""

    timeout = 60

    async def start_backend(self, **kw: Any) -> DevBackend:
        backend = DevBackend(reactor, **kw)
        await backend.listen(0, "127.0.0.1")
        self.addCleanup(backend.stop)
        return backend

    def start_agent(
        self,
        backend: DevBackend,
        state_dir: str | None = None,
        token: bool = True,
        fatal: list[tuple[int, str]] | None = None,
        docker_host: str | None = None,
        gpu_source: Any = None,
        **extra: str,
    ) -> AgentService:
        state_dir = os.path.abspath(state_dir or self.mktemp())
        os.makedirs(state_dir, exist_ok=True)
        if token and "ENROLLMENT_TOKEN" not in extra:
            extra["ENROLLMENT_TOKEN"] = backend.mint_token("test")["token"]
        config = load_config(agent_env(backend, state_dir, **extra), {})
        sink = fatal if fatal is not None else []
        agent = AgentService(
            reactor, config, fatal=lambda code, msg: sink.append((code, msg)),
            gpu_source=gpu_source if gpu_source is not None else NoGPUSource(),
            docker_enabled=docker_host is not None,
            docker_environ={"DOCKER_HOST": docker_host} if docker_host else None,
        )
        agent.state_dir = state_dir  # type: ignore[attr-defined]
        agent.startService()
        self.addCleanup(self.stop_agent, agent)
        return agent

    def stop_agent(self, agent: AgentService) -> Deferred[None]:
        if not agent.running:
            from twisted.internet.defer import succeed

            return succeed(None)
        return agent.stopService()

    async def wait_connected(self, backend: DevBackend, agent: AgentService, timeout: float = 10) -> str:
        await backend.wait_for(lambda: agent.session.connected and agent.session.node_id is not None, timeout)
        node_id = agent.session.node_id
        assert node_id is not None
        await backend.wait_for(lambda: backend.connection_count(node_id) == 1, timeout)
        return node_id
