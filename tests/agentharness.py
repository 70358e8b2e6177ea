"""Helpers for integration tests: a real agent (in-process) against the real stand-in backend."""

from __future__ import annotations

import os
import re
import uuid
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.trial.unittest import TestCase

from llmport_agent.agent.service import AgentService
from llmport_agent.core.config import load_config
from llmport_agent.devbackend import DevBackend
from llmport_agent.inventory.gpu import NoGPUSource


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


def spawn_agent_process(test: Any, backend: DevBackend, script: str, args: list[str], docker_sock: str,
                        **settings: str) -> tuple[Any, str, dict[str, str]]:
    """
    A real agent process (C{sys.executable -c script *args}, this tree first on the path, in a
    fresh state directory, C{DOCKER_HOST} at C{docker_sock}, a fresh enrollment token and
    C{settings}), killed at the test's end if it still runs. Returns the process, its state
    directory (its output is in C{agent.log} there; C{{dir}} in C{args} names it) and its
    environment.
    """
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    d = os.path.abspath(test.mktemp())
    os.makedirs(d)
    env = dict(os.environ, PYTHONPATH=root, DOCKER_HOST=docker_sock, HOME=d)
    env.update(agent_env(backend, d, ENROLLMENT_TOKEN=backend.mint_token()["token"], **settings))
    with open(os.path.join(d, "agent.log"), "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", script, *[a.replace("{dir}", d) for a in args]],
                                cwd=d, env=env, stdout=log, stderr=subprocess.STDOUT)

    def cleanup() -> None:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    test.addCleanup(cleanup)
    return proc, d, env


class AnomalyGuard:
    """
    The one shared teardown of every test that runs a stand-in backend: when the test ends
    (after its agents and the backend stopped), any protocol anomaly the backend recorded
    (ack or progress after a result, a second result, a dropped connection, an ack for an
    unknown command...) fails the test, unless the test allowed it with L{allow_anomalies}.
    """

    addCleanup: Any
    fail: Any

    def watch_backend(self, backend: DevBackend) -> DevBackend:
        """Check C{backend}'s anomalies when the test ends. Call before registering its stop."""
        if not hasattr(self, "_allowed_anomalies"):
            self._allowed_anomalies: list[tuple[re.Pattern[str], str]] = []
        self.addCleanup(self._check_anomalies, backend)
        return backend

    def allow_anomalies(self, pattern: str, reason: str) -> None:
        """This test provokes anomalies matching C{pattern} (a regex searched in each note)."""
        if not reason:
            raise ValueError("say why the anomaly is expected")
        if not hasattr(self, "_allowed_anomalies"):
            self._allowed_anomalies = []
        self._allowed_anomalies.append((re.compile(pattern), reason))

    def _check_anomalies(self, backend: DevBackend) -> None:
        allowed = getattr(self, "_allowed_anomalies", [])
        found = []
        for node_id, notes in sorted(backend.state.anomalies.items()):
            for note in notes:
                if not any(p.search(note) for p, _reason in allowed):
                    found.append(f"{node_id}: {note}")
        if found:
            self.fail("protocol anomalies at the stand-in backend:\n  " + "\n  ".join(found))

    async def start_watched_backend(self, tls: Any = None, **kw: Any) -> DevBackend:
        """A stand-in backend on 127.0.0.1, stopped and checked for anomalies at the end."""
        backend = DevBackend(reactor, **kw)
        self.watch_backend(backend)
        await backend.listen(0, "127.0.0.1", tls=tls)
        self.addCleanup(backend.stop)
        return backend


class AgentTestCase(AnomalyGuard, TestCase):
    """Starts a stand-in backend per test; C{start_agent} runs a real agent against it."""

    timeout = 60

    async def start_backend(self, tls: Any = None, **kw: Any) -> DevBackend:
        return await self.start_watched_backend(tls=tls, **kw)

    def start_agent(
        self,
        backend: DevBackend,
        state_dir: str | None = None,
        token: bool = True,
        fatal: list[tuple[int, str]] | None = None,
        docker_host: str | None = None,
        gpu_source: Any = None,
        prepare: Any = None,
        **extra: str,
    ) -> AgentService:
        """
        A real agent against C{backend}, started; stopped at the test's end. C{prepare} is
        called with the agent before its start (to record or patch what a test looks at).
        """
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
        if prepare is not None:
            prepare(agent)
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
