"""
A per-test rig around the real test engine: a L{DockerEngine}, a L{WorkloadManager}, an
optional L{HealthWatcher}, a treq client for probes, and payload builders for the
busybox httpd workload.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from attrs import evolve
from treq.client import HTTPClient
from twisted.internet import reactor as _global_reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, HTTPConnectionPool

from llmport_agent.commands.base import CommandFailed
from llmport_agent.workloads.engine import DockerEngine
from llmport_agent.workloads.handlers import WorkloadManager
from llmport_agent.workloads.health import HealthWatcher
from llmport_agent.workloads.settings import WorkloadSettings

from .context import RecordingContext, make_command
from .docker_env import BUSYBOX, DockerEnv, free_port, require_docker

reactor: Any = _global_reactor

SERVE = "mkdir -p /www && echo ok > /www/health && exec httpd -f -p $LLAMA_ARG_PORT -h /www"

TEST_SETTINGS = WorkloadSettings(
    agent_id="test-node",
    advertise_scheme="http",
    advertise_host="192.0.2.10",
    network_mode="host",
    stop_grace_sec=1.0,
    readiness_timeout_sec=20.0,
    readiness_interval_sec=0.1,
    readiness_progress_sec=1.0,
    pull_stall_sec=3.0,
    settle_announce_sec=0.2,
)


def httpd_payload(
    *,
    runtime_id: str | None = None,
    name: str | None = None,
    port: int | None = None,
    script: str | None = None,
    image: str = BUSYBOX,
    image_source: str | None = None,
    provider_config: dict[str, Any] | None = None,
    **top: Any,
) -> dict[str, Any]:
    """A deploy payload (backend-shaped) for a busybox httpd answering /health."""
    rid = runtime_id or str(uuid.uuid4())
    pc: dict[str, Any] = {
        "image": image,
        "command": ["sh", "-c", script or SERVE],
        "container_port": str(port or free_port()),
    }
    pc.update(provider_config or {})
    payload: dict[str, Any] = {
        "runtime_id": rid,
        "runtime_name": name or f"lpt {rid[:8]}",
        "container_name": "",
        "provider_id": "prov-1",
        "provider_type": "llamacpp",
        "model_id": "model-1",
        "generic_config": {},
        "provider_config": pc,
        "openai_compat": True,
        "model_sync": None,
        "image_source": image_source,
        "gpu_request": "",
        "ipc_mode": "",
        "shm_size": "",
        "memory_limit": "",
        "cpu_limit": "",
        "container_port": "",
        "placement_hints": {},
    }
    payload.update(top)
    return payload


class Rig:
    """Engine + manager (+ watcher) against the shared test engine."""

    def __init__(
        self,
        reactor: Any,
        env: DockerEnv,
        *,
        health: bool = False,
        settings: WorkloadSettings | None = None,
        backend_url: str = "",
        credential: Callable[[], str] | None = None,
        sync_model: Any = None,
        **overrides: Any,
    ) -> None:
        self.reactor = reactor
        self.env = env
        self.settings = evolve(settings or TEST_SETTINGS, **overrides)
        self.engine = DockerEngine(reactor, environ={"DOCKER_HOST": env.host}, call_timeout=30)
        self.pool = HTTPConnectionPool(reactor, persistent=True)
        agent: Any = Agent(reactor, pool=self.pool)
        self.http = HTTPClient(agent)
        self.health_events: list[dict[str, Any]] = []
        self._waiters: list[tuple[Callable[[dict[str, Any]], bool], Deferred[dict[str, Any]]]] = []
        self.watcher: HealthWatcher | None = None
        if health:
            self.watcher = HealthWatcher(
                reactor,
                self.engine,
                self.settings,
                self._emit,
                reconcile_interval=60.0,
                crash_loop_restarts=3,
                crash_loop_window=60.0,
            )
        self.manager = WorkloadManager(
            reactor,
            self.engine,
            self.settings,
            http=self.http,
            backend_url=backend_url,
            credential=credential,
            sync_model=sync_model,
            health=self.watcher,
        )

    def _emit(self, event_type: str, payload: dict[str, Any], severity: str) -> None:
        event = {"event_type": event_type, "payload": payload, "severity": severity}
        self.health_events.append(event)
        for match, d in list(self._waiters):
            if match(event):
                self._waiters.remove((match, d))
                d.callback(event)

    def wait_event(self, event_type: str, runtime_id: str, timeout: float = 30.0) -> Deferred[dict[str, Any]]:
        """Fires with the first (or next) health event of that type for that runtime."""

        def match(e: dict[str, Any]) -> bool:
            return e["event_type"] == event_type and e["payload"].get("runtime_id") == runtime_id

        for event in self.health_events:
            if match(event):
                d0: Deferred[dict[str, Any]] = Deferred()
                d0.callback(event)
                return d0
        d: Deferred[dict[str, Any]] = Deferred()
        self._waiters.append((match, d))
        d.addTimeout(timeout, self.reactor)
        return d

    async def start(self) -> None:
        self.engine.startService()
        if self.watcher is not None:
            self.watcher.startService()
        waiting = self.engine.whenAvailable()
        waiting.addTimeout(30, self.reactor)
        await waiting

    async def stop(self) -> None:
        for _, d in self._waiters:
            if not d.called:
                d.cancel()
        self._waiters.clear()
        if self.watcher is not None and self.watcher.running:
            await self.watcher.stopService()
        if self.engine.running:
            await self.engine.stopService()
        await self.pool.closeCachedConnections()

    def ctx(self, command_type: str, payload: dict[str, Any]) -> RecordingContext:
        return RecordingContext(make_command(command_type, payload), self.reactor)

    async def run(self, command_type: str, payload: dict[str, Any]) -> tuple[RecordingContext, dict[str, Any]]:
        """Run one handler to completion; return (context, result)."""
        ctx = self.ctx(command_type, payload)
        handler = {
            "deploy_workload": self.manager.deploy,
            "start_workload": self.manager.start,
            "restart_workload": self.manager.restart,
            "update_workload": self.manager.update,
            "stop_workload": self.manager.stop,
            "remove_workload": self.manager.remove,
            "fetch_container_logs": self.manager.logs,
        }[command_type]
        result = await handler(ctx)
        ctx.delivered()  # as the pipeline does once the backend confirmed the result
        return ctx, result

    async def get(self, url: str) -> tuple[int, bytes]:
        response = await self.http.get(url, timeout=5)
        return response.code, await response.content()


def ids_of(payload: dict[str, Any]) -> dict[str, Any]:
    """The stop/remove/logs payload of a deploy payload."""
    return {
        "runtime_id": payload["runtime_id"],
        "runtime_name": payload["runtime_name"],
        "container_name": payload.get("container_name", ""),
    }



class _Hold(Protocol):
    pass


class WorkloadTestBase(TestCase):
    """Starts a rig on the shared engine; removes every container afterwards."""

    timeout = 120
    health = False
    overrides: dict[str, Any] = {}
    #: The engine the tests run against (tests.test_workloads_podman swaps in Podman).
    engine_env: Callable[[], Any] = staticmethod(require_docker)

    async def setUp(self) -> None:  # type: ignore[override]
        self.env = type(self).engine_env()
        self.rig = Rig(reactor, self.env, health=self.health, **self.overrides)
        self.addCleanup(self.env.remove_all_containers)
        self.addCleanup(lambda: ensureDeferred(self.rig.stop()))
        await self.rig.start()

    async def hold_port(self, port: int = 0) -> int:
        """Listen on 127.0.0.1:<port> for the rest of the test; return the port."""
        listening = await TCP4ServerEndpoint(reactor, port, interface="127.0.0.1").listen(
            Factory.forProtocol(_Hold)
        )
        self.addCleanup(listening.stopListening)
        return int(listening.getHost().port)

    async def failure(self, command_type: str, payload: dict[str, Any]) -> tuple[Any, CommandFailed]:
        ctx = self.rig.ctx(command_type, payload)
        handler = {
            "deploy_workload": self.rig.manager.deploy,
            "start_workload": self.rig.manager.start,
            "restart_workload": self.rig.manager.restart,
            "update_workload": self.rig.manager.update,
            "stop_workload": self.rig.manager.stop,
            "remove_workload": self.rig.manager.remove,
            "fetch_container_logs": self.rig.manager.logs,
        }[command_type]
        try:
            await handler(ctx)
        except CommandFailed as exc:
            return ctx, exc
        self.fail(f"{command_type} succeeded; expected a failure")


