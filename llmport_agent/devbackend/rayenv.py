"""
The stand-in backend's Ray driver (protocol 10.6): one inference environment, reconciled and
torn down through the node agents the way the real backend does it.

Reconcile, each step sent to all its nodes and then awaited (commands time out at 300 s;
idempotency key C{inference-env:<env>:<generation>:<step>[:<node>]}):

 1. C{ensure_runtime_image} (with C{ensure_container}) on every node: C{verified} must be true;
 2. C{ensure_ray_runtime} on every node: C{installed} must not be false;
 3. C{start_ray_head} on the head;
 4. C{join_ray_cluster} on each worker;
 5. C{get_ray_status} on the head, polled every second for up to 90 s, until every node is in.

Teardown: C{leave_ray_cluster} on the workers, then C{stop_ray {"force": true}} on the head.
Serve apps: C{run_serve_app} on the head, C{get_ray_serve_status} until the app runs,
C{delete_serve_app}.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from attrs import define, field
from twisted.internet.task import deferLater

if TYPE_CHECKING:
    from llmport_agent.devbackend.backend import DevBackend

TERMINAL = ("succeeded", "failed", "canceled", "timed_out")
COMMAND_TIMEOUT_SEC = 300
PROBE_BUDGET_SEC = 90.0


class EnvironmentFailed(Exception):
    """A reconcile step failed on a node: C{step}, C{node_id}, the command record."""

    def __init__(self, step: str, node_id: str, record: dict[str, Any], why: str) -> None:
        super().__init__(f"{step} on node {node_id}: {why}")
        self.step = step
        self.node_id = node_id
        self.record = record


@define
class RayNode:
    """A member of the environment: its node id and the IP Ray binds on it."""

    node_id: str
    node_ip: str
    #: Another runtime container name for this node (two nodes on one engine, as in the demo).
    container_name: str | None = None


@define
class RayEnvironment:
    """
    @ivar head: the head node; C{workers} the others.
    @ivar bundle: the C{runtime_bundle} every command carries.
    @ivar steps: C{(step, node_id, command id, status)} in the order they were issued.
    """

    backend: DevBackend
    env_id: str
    head: RayNode
    workers: Sequence[RayNode]
    bundle: dict[str, Any]
    port: int = 6379
    dashboard_port: int = 8265
    include_dashboard: bool = False
    generation: int = 1
    version: str = "2.58.0"
    num_cpus: int | None = None
    env: dict[str, str] = field(factory=dict)
    credential_ref: str = field(factory=lambda: "ray-" + uuid.uuid4().hex[:12])
    steps: list[tuple[str, str, str, str]] = field(factory=list)
    status: dict[str, Any] | None = None

    @property
    def nodes(self) -> list[RayNode]:
        return [self.head, *self.workers]

    @property
    def head_address(self) -> str:
        return f"{self.head.node_ip}:{self.port}"

    def bundle_for(self, node: RayNode) -> dict[str, Any]:
        if node.container_name is None:
            return self.bundle
        return {**self.bundle, "name": node.container_name}

    def key(self, step: str, node: RayNode | None = None) -> str:
        base = f"inference-env:{self.env_id}:{self.generation}:{step}"
        return f"{base}:{node.node_id}" if node is not None else base

    async def _wait(self, command_id: str, timeout: float) -> None:
        await self.backend.wait_for(lambda: self.backend.command(command_id)["status"] in TERMINAL, timeout)

    async def _await(self, step: str, pending: list[tuple[RayNode, dict[str, Any]]]) -> list[dict[str, Any]]:
        records = []
        for node, cmd in pending:
            await self._wait(str(cmd["id"]), COMMAND_TIMEOUT_SEC)
            rec = self.backend.command(cmd["id"])
            self.steps.append((step, node.node_id, rec["id"], rec["status"]))
            if rec["status"] != "succeeded":
                raise EnvironmentFailed(step, node.node_id, rec, f"{rec.get('error_code')}: {rec.get('error_message')}")
            records.append(rec)
        return records

    def _issue(self, node: RayNode, step: str, payload: dict[str, Any], per_node: bool = True) -> dict[str, Any]:
        return self.backend.issue_command(
            node.node_id, step, payload,
            idempotency_key=self.key(step, node if per_node else None),
            timeout_sec=COMMAND_TIMEOUT_SEC,
        )

    async def step(self, step: str, nodes: Sequence[RayNode], payload_for: Any, per_node: bool = True) -> list[dict[str, Any]]:
        pending = [(n, self._issue(n, step, payload_for(n), per_node)) for n in nodes]
        return await self._await(step, pending)

    async def reconcile(self) -> dict[str, Any]:
        """Bring the cluster up; returns the head's last C{get_ray_status} result."""
        self.backend.add_cluster_secret(self.credential_ref, [n.node_id for n in self.nodes])
        images = await self.step(
            "ensure_runtime_image", self.nodes, lambda n: {"runtime_bundle": self.bundle_for(n), "ensure_container": True}
        )
        for node, rec in zip(self.nodes, images, strict=True):
            if not (rec.get("result") or {}).get("verified"):
                raise EnvironmentFailed("ensure_runtime_image", node.node_id, rec, "the image is not verified")
        runtimes = await self.step(
            "ensure_ray_runtime", self.nodes, lambda n: {"version": self.version, "runtime_bundle": self.bundle_for(n)}
        )
        for node, rec in zip(self.nodes, runtimes, strict=True):
            if (rec.get("result") or {}).get("installed") is False:
                raise EnvironmentFailed("ensure_ray_runtime", node.node_id, rec, str((rec.get("result") or {}).get("error")))
        head_payload: dict[str, Any] = {
            "credential_ref": self.credential_ref, "version": self.version, "port": self.port,
            "dashboard_port": self.dashboard_port, "dashboard_host": "127.0.0.1",
            "include_dashboard": self.include_dashboard, "node_ip_address": self.head.node_ip,
            "runtime_bundle": self.bundle_for(self.head), "env": dict(self.env),
        }
        if self.num_cpus is not None:
            head_payload["num_cpus"] = self.num_cpus
        await self.step("start_ray_head", [self.head], lambda n: head_payload, per_node=False)

        def join(n: RayNode) -> dict[str, Any]:
            payload: dict[str, Any] = {
                "head_address": self.head_address, "credential_ref": self.credential_ref,
                "version": self.version, "node_ip_address": n.node_ip,
                "runtime_bundle": self.bundle_for(n), "env": dict(self.env),
            }
            if self.num_cpus is not None:
                payload["num_cpus"] = self.num_cpus
            return payload

        if self.workers:
            await self.step("join_ray_cluster", self.workers, join)
        return await self.probe(len(self.nodes))

    async def probe(self, expected: int, budget: float = PROBE_BUDGET_SEC) -> dict[str, Any]:
        """C{get_ray_status} on the head every second until C{expected} nodes are alive."""
        reactor = self.backend.reactor
        deadline = reactor.seconds() + budget
        last: dict[str, Any] = {}
        while True:
            cmd = self.backend.issue_command(
                self.head.node_id, "get_ray_status", {},
                idempotency_key=f"inference-env:probe:{self.head.node_id}:{uuid.uuid4().hex[:12]}",
                timeout_sec=COMMAND_TIMEOUT_SEC,
            )
            await self._wait(str(cmd["id"]), budget + 30)
            rec = self.backend.command(cmd["id"])
            last = rec.get("result") or {} if rec["status"] == "succeeded" else {"alive": False}
            self.status = last
            if last.get("alive") and int(last.get("num_nodes") or 0) >= expected:
                return last
            if reactor.seconds() > deadline:
                raise EnvironmentFailed("get_ray_status", self.head.node_id, rec,
                                        f"{last.get('num_nodes', 0)} of {expected} nodes after {budget:g} s")
            await deferLater(reactor, 1.0, lambda: None)

    async def run_app(self, app_name: str, llm_serving_args: dict[str, Any],
                      http_options: dict[str, Any] | None = None, budget: float = 120.0) -> dict[str, Any]:
        """C{run_serve_app} on the head, then its Serve status until the app is RUNNING."""
        payload = {"app_name": app_name, "llm_serving_args": llm_serving_args,
                   "http_options": http_options or {}, "runtime_bundle": self.bundle_for(self.head)}
        (rec,) = await self.step("run_serve_app", [self.head], lambda n: payload, per_node=False)
        reactor = self.backend.reactor
        deadline = reactor.seconds() + budget
        while True:
            (status,) = await self.step(
                "get_ray_serve_status", [self.head], lambda n: {"app_name": app_name, "runtime_bundle": self.bundle_for(self.head)},
                per_node=False,
            )
            app = ((status.get("result") or {}).get("apps") or {}).get(app_name) or {}
            if app.get("status") == "RUNNING":
                return dict(rec.get("result") or {})
            if reactor.seconds() > deadline:
                raise EnvironmentFailed("get_ray_serve_status", self.head.node_id, status,
                                        f"app {app_name} is {app.get('status') or 'absent'} after {budget:g} s")
            await deferLater(reactor, 1.0, lambda: None)

    async def delete_app(self, app_name: str) -> dict[str, Any]:
        (rec,) = await self.step("delete_serve_app", [self.head],
                                 lambda n: {"app_name": app_name, "runtime_bundle": self.bundle_for(self.head)}, per_node=False)
        return dict(rec.get("result") or {})

    async def teardown(self) -> None:
        """Workers leave, then the head stops (force)."""
        if self.workers:
            await self.step("leave_ray_cluster", self.workers,
                            lambda n: {"version": self.version, "runtime_bundle": self.bundle_for(n)})
        await self.step("stop_ray", [self.head],
                        lambda n: {"force": True, "version": self.version, "runtime_bundle": self.bundle_for(n)},
                        per_node=False)


@define
class EnvironmentRun:
    """An environment the dev admin API drives (C{/dev/ray-environments}): its task and outcome."""

    env: RayEnvironment
    state: str = "reconciling"  # reconciling | ready | failed | tearing_down | torn_down
    error: str | None = None
    task: Any = None

    def view(self) -> dict[str, Any]:
        e = self.env
        return {
            "id": e.env_id, "state": self.state, "error": self.error, "generation": e.generation,
            "head": {"node_id": e.head.node_id, "node_ip": e.head.node_ip},
            "workers": [{"node_id": w.node_id, "node_ip": w.node_ip} for w in e.workers],
            "head_address": e.head_address, "credential_ref": e.credential_ref,
            "steps": [{"step": s, "node_id": n, "command_id": c, "status": st} for s, n, c, st in e.steps],
            "status": e.status,
        }

    def run(self, coro: Any, done_state: str) -> None:
        from twisted.internet.defer import CancelledError, Deferred

        def ok(_: object) -> None:
            self.state = done_state

        def bad(f: Any) -> None:
            if f.check(CancelledError):
                self.state, self.error = "failed", "the stand-in backend stopped"
                return
            self.state = "failed"
            self.error = f.getErrorMessage()

        self.task = Deferred.fromCoroutine(coro)
        self.task.addCallbacks(ok, bad)


def parse_node(value: Any, what: str) -> RayNode:
    if not isinstance(value, dict) or not isinstance(value.get("node_id"), str) or not isinstance(value.get("node_ip"), str):
        raise ValueError(f"{what} must be {{node_id, node_ip[, container_name]}}")
    name = value.get("container_name")
    return RayNode(value["node_id"], value["node_ip"], name if isinstance(name, str) else None)
