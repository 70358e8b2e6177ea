"""
The stand-in backend's Ray environment driver (protocol 10.6), following the newest llm-port
backend's reconcile: one environment (a head and its workers) driven through the node agents
by commands, then looked at every minute and brought back when it is not whole.

A pass (L{RayEnvironment.reconcile_pass}) while the environment is wanted up and has not come
up at its current generation:

 1. the runtime image, in four stages (L{RayEnvironment.ensure_images}):
    a. every member is asked C{ensure_runtime_image {fetch: false}} (a probe): a success with
       C{verified: true} has it; a failure C{runtime_image_missing}/C{runtime_image_mismatch}
       needs it; anything else fails the environment;
    b. if no member has it, one member loads it from this backend (no C{source}:
       C{GET /api/node-files/images/save}), so the backend serves the image once;
    c. every other member that needs it is paired with a member holding the same build: the
       holder gets C{serve_runtime_image} and, at the same moment and without waiting for the
       serve, each receiver gets C{ensure_runtime_image {source: {peer_url, token}}};
    d. a receiver whose peer fetch did not end in C{verified: true} falls back to the server;
 2. C{ensure_ray_runtime} on every member (C{installed} must not be false);
 3. C{start_ray_head} on the head, then C{join_ray_cluster} on every worker;
 4. one C{get_ray_status} on the head (its result awaited up to 90 s): READY when at least as
    many live node records as members (counted, as the backend's
    C{map_cluster_to_environment_status}); otherwise the next pass runs the sequence again.

Each step is issued to its nodes before any result is awaited, and each result is awaited for
at most 150 s (L{WAIT_SEC}; commands live 300 s): no answer leaves the environment PREPARING and
the next pass, at once, resumes the same commands by their idempotency keys
(C{inference-env:<env>:<generation>:<step>[:<node>]}). A failure is remembered with what it
depended on (the generation and the pinned image): the same inputs are not asked again before
a backoff (60 s doubling to 30 min) or, for a failure that retrying cannot change
(L{PERMANENT_FAILURES}), an hour.

Once up, every pass is a health check (L{RayEnvironment.check}): C{get_ray_status
{runtime_bundle, include_metrics: true}} on the head, members matched to Ray's live node records
by C{node_ip}, C{node_manager_address} or C{node_name}. A problem is looked at again 20 s later
before anything is restarted; then a lost head is re-formed (workers leave, the head stops,
then a fresh start and joins) and lost workers are rejoined (leave, join), keys
C{...:recover<N>:<step>:<node>}, given 30 s to show every member, at most 3 attempts 30 s apart
(doubling), then one look every 15 minutes. A probe that fails or is not answered restarts
nothing.

Teardown: C{leave_ray_cluster} on the workers, then C{stop_ray {force: true}} on the head.
Serve apps: C{run_serve_app} on the head, C{get_ray_serve_status} until the app runs,
C{delete_serve_app}.

Time comes from the backend's clock (an C{IReactorTime}); nothing polls while it waits for a
command (L{DevBackend.when_terminal}).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from attrs import field
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmport_agent.core.values import define

if TYPE_CHECKING:
    from llmport_agent.devbackend.backend import DevBackend

TERMINAL = ("succeeded", "failed", "canceled", "timed_out")
#: Lifetime of every lifecycle command, and how long one pass waits for each result.
COMMAND_TIMEOUT_SEC = 300
WAIT_SEC = 150.0
#: How long a status probe's result is awaited (the membership probe after a start, the checks).
PROBE_BUDGET_SEC = 90.0
#: Where a holder serves the image to its peers (on its fabric IP), and for how long at most.
SEED_PORT = 8271
SEED_TIMEOUT_SEC = 3600
#: Probe failures that mean "not here yet", not "broken".
IMAGE_ABSENT = frozenset({"runtime_image_missing", "runtime_image_mismatch"})
#: Failures that retrying with the same inputs cannot change: re-checked hourly.
PERMANENT_FAILURES = frozenset({"runtime_image_mismatch", "server_image_mismatch", "no_certified_runtime"})
RETRY_BASE_SEC = 60
RETRY_CAP_SEC = 30 * 60
PERMANENT_RECHECK_SEC = 60 * 60
#: How often a cluster that is up is looked at.
CHECK_EVERY_SEC = 60.0
#: A problem is confirmed by a second look this much later before anything is restarted.
CONFIRM_AFTER_SEC = 20.0
MAX_RECOVERY_ATTEMPTS = 3
RECOVERY_BACKOFF_SEC = 30
GAVE_UP_RECHECK_SEC = 15 * 60
#: After a restart: how long the cluster has to show every member, and how often it is asked.
SETTLE_SEC = 30.0
SETTLE_POLL_SEC = 5.0
#: A member whose agent has been away longer than this is reported gone (the environment waits
#: for it instead of sending commands it cannot take); a shorter absence is an agent restart.
OFFLINE_GRACE_SEC = 30.0
#: Ray node records looked at per status answer (the answer comes from a node: bounded).
MAX_NODE_RECORDS = 4096
LIVE_STATES = frozenset({"ALIVE", "UP", "ACTIVE"})
#: Steps and status changes kept for the view (the oldest dropped).
MAX_KEPT = 1000

PENDING = "pending"
PREPARING = "preparing"
READY = "ready"
DEGRADED = "degraded"
FAILED = "failed"
STOPPED = "stopped"

_KEEP: Any = object()


class StepFailed(Exception):
    """
    A command ended in a failure (or a result the reconcile cannot accept).

    @ivar code: the agent's C{error_code}, if any; C{detail}: its message alone.
    """

    def __init__(self, message: str, *, code: str | None = None, detail: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.detail = detail or message

    @property
    def permanent(self) -> bool:
        return self.code in PERMANENT_FAILURES


#: The name the demo and older callers know.
EnvironmentFailed = StepFailed


class StepUnobserved(Exception):
    """A command had no terminal result within the pass's wait: outcome unknown."""


@define
class RayNode:
    """A member of the environment: its node id and the (fabric) IP Ray binds on it."""

    node_id: str
    node_ip: str
    #: Another runtime container name for this node (two nodes on one engine, as in the bench).
    container_name: str | None = None


@define
class Step:
    """One command the driver issued: its step name (the key's tail), node and command id."""

    step: str
    node_id: str
    command_id: str


def _record_live(record: dict[str, Any]) -> bool:
    """Is one of Ray's node records a live member (dead records stay in Ray's list forever)?"""
    if "alive" in record and not record["alive"]:
        return False
    return not ("state" in record and str(record["state"]).upper() not in LIVE_STATES)


def _tell(d: Deferred[str], status: str) -> None:
    if not d.called:  # not timed out meanwhile
        d.callback(status)


def _verified(record: dict[str, Any]) -> bool:
    """A command that succeeded with C{verified: true} (and nothing else) has the image."""
    result = record.get("result")
    return record["status"] == "succeeded" and isinstance(result, dict) and result.get("verified") is True


@define(eq=False)
class RayEnvironment:
    """
    One Ray environment the stand-in drives (see the module docstring).

    @ivar status: L{PENDING}, L{PREPARING}, L{READY}, L{DEGRADED}, L{FAILED} or L{STOPPED};
        C{reason} says why, in one line.
    @ivar cluster: the head's last C{get_ray_status} answer that counted.
    @ivar converged_generation: the generation the cluster last came up at; while it equals
        C{generation}, passes are health checks.
    @ivar retry: the last failure's memory (code, permanent, fingerprint, attempts,
        next_attempt_at), C{None} when the last pass got through.
    @ivar recovery: the health check's state while something is wrong (kind, detail,
        attempt, suspected_at, next_look_at, gave_up, last_error); C{last_recovery} the last
        one that worked.
    @ivar steps: the lifecycle commands issued, in order, the last L{MAX_KEPT} (status probes
        are counted in C{probes}).
    @ivar history: C{(time, status, reason)} at each change, the last L{MAX_KEPT}.
    """

    backend: DevBackend
    env_id: str
    head: RayNode
    workers: Sequence[RayNode]
    bundle: dict[str, Any]
    port: int = 6379
    dashboard_port: int = 8265
    #: Sent as C{include_dashboard}, which the real backend never sends (the agent then starts the
    #: dashboard on 127.0.0.1): the stand-in leaves it off by default to keep test clusters light.
    include_dashboard: bool = False
    generation: int = 1
    version: str = "2.58.0"
    num_cpus: int | None = None
    env: dict[str, str] = field(factory=dict)
    credential_ref: str = field(factory=lambda: "ray-" + uuid.uuid4().hex[:12])
    seed_port: int = SEED_PORT
    #: How often the cluster is looked at once up (tests shorten it).
    check_every: float = CHECK_EVERY_SEC
    #: The backend's key for deriving seeding tokens (the real one uses its master key).
    seed_key: bytes = field(factory=lambda: secrets.token_bytes(32), repr=False)
    desired: str = "running"
    status: str = PENDING
    reason: str | None = None
    cluster: dict[str, Any] | None = None
    converged_generation: int | None = None
    retry: dict[str, Any] | None = None
    recovery: dict[str, Any] | None = None
    last_recovery: dict[str, Any] | None = None
    steps: list[Step] = field(factory=list)
    probes: int = 0
    history: list[tuple[float, str, str | None]] = field(factory=list)
    _call: Any = field(default=None, init=False)
    _pass: Deferred[None] | None = field(default=None, init=False)
    _running: bool = field(default=False, init=False)
    _again: bool = field(default=False, init=False)
    _watchers: list[tuple[frozenset[str], Deferred[str]]] = field(factory=list, init=False)

    log = Logger()

    # -- who and what ------------------------------------------------------------------------

    @property
    def clock(self) -> Any:
        return self.backend.clock

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

    def key(self, step: str) -> str:
        return f"inference-env:{self.env_id}:{self.generation}:{step}"

    def seed_token(self, holder: RayNode) -> str:
        """The holder's seeding token: derived, so a resumed pass sends the same one."""
        message = f"image-seed:{self.env_id}:{self.generation}:{holder.node_id}".encode()
        return hmac.new(self.seed_key, message, hashlib.sha256).hexdigest()

    def _host(self, node: RayNode) -> str | None:
        record = self.backend.node(node.node_id) or {}
        host = str(record.get("host") or "").strip()
        if host.startswith("host="):
            host = host[len("host="):]
        return host or None

    def _name(self, node: RayNode) -> str:
        record = self.backend.node(node.node_id) or {}
        return str(record.get("agent_id") or node.node_id)

    # -- commands ----------------------------------------------------------------------------

    def _issue(self, node: RayNode, command_type: str, payload: dict[str, Any], step: str, listed: bool = True) -> str:
        record = self.backend.issue_command(
            node.node_id, command_type, payload, idempotency_key=self.key(step), timeout_sec=COMMAND_TIMEOUT_SEC,
        )
        command_id = str(record["id"])
        # A resumed pass gets the command still in flight under the same key: listed once.
        if listed and all(s.command_id != command_id for s in self.steps[-64:]):
            self.steps.append(Step(step, node.node_id, command_id))
            del self.steps[:-MAX_KEPT]
        return command_id

    async def _final(self, command_id: str, what: str, budget: float = WAIT_SEC) -> dict[str, Any]:
        """The command's terminal record; L{StepUnobserved} when none comes within C{budget}."""
        waiting = self.backend.when_terminal(command_id)
        waiting.addTimeout(budget, self.clock)
        try:
            return await waiting
        except TimeoutError:
            raise StepUnobserved(f"{what}: no result within {budget:.0f} s") from None

    async def _result(self, command_id: str, what: str) -> dict[str, Any]:
        """The command's result; L{StepFailed} (with the agent's error) when it did not succeed."""
        record = await self._final(command_id, what)
        if record["status"] != "succeeded":
            detail = record.get("error_message") or record.get("error_code") or record["status"]
            raise StepFailed(f"{what} failed: {detail}", code=record.get("error_code"), detail=str(detail))
        result = record.get("result")
        return dict(result) if isinstance(result, dict) else {}

    def _require_verified(self, result: dict[str, Any], node: RayNode) -> None:
        if result.get("verified") is not True:
            raise StepFailed(
                f"runtime image {self.bundle.get('image')} ({self.bundle.get('digest')}) not verified on node "
                f"{node.node_id}: {result.get('error') or 'digest mismatch'}"
            )

    def _image_payload(self, node: RayNode, **extra: Any) -> dict[str, Any]:
        return {"runtime_bundle": self.bundle_for(node), "ensure_container": True, **extra}

    def _from_server(self, node: RayNode) -> str:
        return self._issue(node, "ensure_runtime_image", self._image_payload(node), f"image-from-server:{node.node_id}")

    # -- the runtime image -------------------------------------------------------------------

    async def ensure_images(self) -> None:
        """The four stages (module docstring, 1a-1d)."""
        probes = [
            (n, self._issue(n, "ensure_runtime_image", self._image_payload(n, fetch=False), f"image-probe:{n.node_id}"))
            for n in self.nodes
        ]
        have: list[RayNode] = []
        need: list[RayNode] = []
        for node, command_id in probes:
            record = await self._final(command_id, f"image check on node {node.node_id}")
            if _verified(record):
                have.append(node)
            elif record["status"] == "failed" and record.get("error_code") in IMAGE_ABSENT:
                need.append(node)
            else:
                detail = record.get("error_message") or record.get("error_code") or record["status"]
                raise StepFailed(f"image check on node {node.node_id} failed: {detail}",
                                 code=record.get("error_code"), detail=str(detail))
        if not need:
            return
        if not have:
            first = need.pop(0)
            self._require_verified(await self._result(self._from_server(first), f"image from the server on node {first.node_id}"), first)
            have.append(first)
        if not need:
            return

        def build(node: RayNode) -> Any:
            return self.bundle_for(node).get("digest")

        plan: dict[str, tuple[RayNode, list[RayNode]]] = {}
        direct: list[RayNode] = []
        for node in need:
            holder = next((h for h in have if h.node_ip and build(h) == build(node)), None)
            if holder is None or not node.node_ip:
                direct.append(node)
            else:
                plan.setdefault(holder.node_id, (holder, []))[1].append(node)
        fetching: list[tuple[RayNode, str]] = []
        for holder, receivers in plan.values():
            token = self.seed_token(holder)
            # The serve is not awaited: the receivers are asked at the same moment and must wait
            # for the holder's export themselves.
            self._issue(holder, "serve_runtime_image", {
                "runtime_bundle": self.bundle_for(holder), "bind_ip": holder.node_ip, "port": self.seed_port,
                "token": token, "expected_peers": len(receivers), "timeout_sec": SEED_TIMEOUT_SEC,
            }, f"image-seed:{holder.node_id}")
            for node in receivers:
                source = {"peer_url": f"http://{holder.node_ip}:{self.seed_port}/image", "token": token}
                fetching.append((node, self._issue(node, "ensure_runtime_image", self._image_payload(node, source=source),
                                                   f"image-from-peer:{node.node_id}")))
        from_server = [(n, self._from_server(n)) for n in direct]
        for node, command_id in fetching:
            record = await self._final(command_id, f"image from a peer on node {node.node_id}")
            if _verified(record):
                continue
            self.log.warn(
                "stand-in Ray driver: node {node} could not get the runtime image from its peer ({why}); using the server",
                node=node.node_id, why=record.get("error_code") or record["status"],
            )
            from_server.append((node, self._from_server(node)))
        for node, command_id in from_server:
            self._require_verified(await self._result(command_id, f"image from the server on node {node.node_id}"), node)

    # -- start -------------------------------------------------------------------------------

    async def ensure_runtimes(self) -> None:
        await self.ensure_images()
        issued = [
            (n, self._issue(n, "ensure_ray_runtime", {"version": self.version, "runtime_bundle": self.bundle_for(n)},
                            f"ensure-runtime:{n.node_id}"))
            for n in self.nodes
        ]
        for node, command_id in issued:
            result = await self._result(command_id, f"ensure_ray_runtime on node {node.node_id}")
            if result.get("installed") is False:
                raise StepFailed(f"Ray {self.version} is not installed in the runtime container on node "
                                 f"{node.node_id}: {result.get('error') or 'not found'}")

    async def start_head(self, attempt: int | None = None) -> None:
        payload: dict[str, Any] = {
            "credential_ref": self.credential_ref, "version": self.version, "port": self.port,
            "dashboard_port": self.dashboard_port, "dashboard_host": "127.0.0.1",
            "include_dashboard": self.include_dashboard, "node_ip_address": self.head.node_ip,
            "runtime_bundle": self.bundle_for(self.head),
        }
        if self.env:  # the backend sends env only when there is one
            payload["env"] = dict(self.env)
        if self.num_cpus is not None:
            payload["num_cpus"] = self.num_cpus
        step = f"recover{attempt}:start-head:{self.head.node_id}" if attempt else "start-head"
        await self._result(self._issue(self.head, "start_ray_head", payload, step),
                           f"start_ray_head on node {self.head.node_id}")

    async def join_workers(self, workers: Sequence[RayNode], attempt: int | None = None) -> None:
        issued = []
        for node in workers:
            payload: dict[str, Any] = {
                "head_address": self.head_address, "credential_ref": self.credential_ref,
                "version": self.version, "node_ip_address": node.node_ip,
                "runtime_bundle": self.bundle_for(node),
            }
            if self.env:
                payload["env"] = dict(self.env)
            if self.num_cpus is not None:
                payload["num_cpus"] = self.num_cpus
            step = f"recover{attempt}:join:{node.node_id}" if attempt else f"join-worker:{node.node_id}"
            issued.append((node, self._issue(node, "join_ray_cluster", payload, step)))
        for node, command_id in issued:
            await self._result(command_id, f"join_ray_cluster on node {node.node_id}")

    def _stop_payload(self, node: RayNode, force: bool = False) -> dict[str, Any]:
        payload: dict[str, Any] = {"version": self.version, "runtime_bundle": self.bundle_for(node)}
        if force:
            payload["force"] = True
        return payload

    # -- looking at the cluster --------------------------------------------------------------

    async def probe(self) -> dict[str, Any] | None:
        """One C{get_ray_status} on the head: its result, or C{None} when not observed."""
        self.probes += 1
        record = self.backend.issue_command(
            self.head.node_id, "get_ray_status", {"runtime_bundle": self.bundle_for(self.head), "include_metrics": True},
            idempotency_key=f"inference-env:probe:{self.head.node_id}:{uuid.uuid4().hex[:12]}",
            timeout_sec=COMMAND_TIMEOUT_SEC,
        )
        try:
            final = await self._final(str(record["id"]), "get_ray_status", PROBE_BUDGET_SEC)
        except StepUnobserved:
            return None
        if final["status"] != "succeeded" or not isinstance(final.get("result"), dict):
            return None
        return dict(final["result"])

    def missing(self, status: dict[str, Any]) -> list[RayNode]:
        """
        Members without a live record in C{status["nodes"]}, matched by C{node_ip},
        C{node_manager_address} or C{node_name} against the member's Ray IP or its host. An
        answer without node records cannot say who is missing: nobody is.
        """
        records = status.get("nodes")
        if not isinstance(records, list) or not records:
            return []
        alive: set[str] = set()
        for record in records[:MAX_NODE_RECORDS]:
            if not isinstance(record, dict) or not _record_live(record):
                continue
            for k in ("node_ip", "node_manager_address", "node_name"):
                value = record.get(k)
                if isinstance(value, str) and value.strip():
                    alive.add(value.strip())
        return [n for n in self.nodes if not {a for a in (n.node_ip, self._host(n)) if a} & alive]

    def diagnose(self, status: dict[str, Any]) -> tuple[str, list[RayNode]] | None:
        """C{("head", [head])}, C{("members", [lost workers])} or C{None} when whole."""
        if status.get("alive") is not True:
            return "head", [self.head]
        lost = self.missing(status)
        if not lost:
            return None
        if any(n.node_id == self.head.node_id for n in lost):
            return "head", [self.head]
        return "members", lost

    @staticmethod
    def live_count(status: dict[str, Any]) -> int:
        """Live members by Ray's records (dead ones ignored); by C{num_nodes} when it lists none."""
        records = status.get("nodes")
        if isinstance(records, list) and records:
            return sum(1 for r in records[:MAX_NODE_RECORDS] if isinstance(r, dict) and _record_live(r))
        count = status.get("num_nodes")
        return count if isinstance(count, int) and not isinstance(count, bool) else 0

    def _status_of(self, status: dict[str, Any] | None) -> str:
        """
        The backend's reading of a status after a start (C{map_cluster_to_environment_status}):
        counted, not matched by name (the health check matches): not alive (or not answered)
        is FAILED, no live member PREPARING, at least as many live members as members READY.
        """
        if status is None or status.get("alive") is not True:
            return FAILED
        live = self.live_count(status)
        if live <= 0:
            return PREPARING
        return READY if live >= len(self.nodes) else DEGRADED

    async def verify_membership(self) -> dict[str, Any] | None:
        """
        ONE status probe after the start, its result awaited up to L{PROBE_BUDGET_SEC} (the
        backend's C{_verify_cluster}): a member that is not listed yet is not waited for; the
        environment is then not converged and the next pass runs the start sequence again.
        """
        return await self.probe()

    # -- one pass ----------------------------------------------------------------------------

    async def reconcile_pass(self) -> None:
        """One pass toward C{desired} (module docstring); sets C{status} and C{reason}."""
        self._again = False
        if self.desired == "stopped":
            await self._stop_pass()
            return
        if self.credential_ref not in self.backend.cluster_secrets:
            self.backend.add_cluster_secret(self.credential_ref, [n.node_id for n in self.nodes])
        if self._offline():
            return
        if self.converged_generation == self.generation:
            await self.check()
            return
        fingerprint = self.fingerprint()
        held = self._held_back(fingerprint)
        if held is not None:
            self.log.info("stand-in Ray driver: environment {env} held back: {why}", env=self.env_id, why=held)
            return
        try:
            await self.ensure_runtimes()
            await self.start_head()
            await self.join_workers(self.workers)
        except StepUnobserved as e:
            self._again = True
            self._observe(PREPARING, str(e))
            return
        except StepFailed as e:
            self._observe(FAILED, self._record_failure(e, fingerprint), cluster={"alive": False})
            return
        self.retry = None
        status = await self.verify_membership()
        state = self._status_of(status)
        if state == READY:
            self.converged_generation = self.generation
            self.recovery = None
            self._observe(READY, None, cluster=status)
            return
        lost = self.missing(status) if status is not None else []
        why = ("the head did not answer the status probe" if status is None else
               "Ray is not running on the head" if status.get("alive") is not True else
               f"{', '.join(self._name(n) for n in lost) or 'a member'} did not show up in the cluster")
        self._observe(state, f"{why} right after the start; the start is run again at the next pass",
                      cluster=status if status is not None else {"alive": False})

    async def _stop_pass(self) -> None:
        try:
            await self.teardown()
        except StepUnobserved as e:
            self._again = True
            self._observe(self.status, f"teardown not confirmed: {e}")
            return
        except StepFailed as e:
            self._observe(self.status, f"teardown not confirmed: {e}")
            return
        self.converged_generation = None
        self.recovery = None
        self._observe(STOPPED, "teardown confirmed", cluster={"alive": False, "version": None, "num_nodes": 0, "nodes": []})

    async def teardown(self) -> None:
        """Workers leave (together), then the head stops (force)."""
        leaving = [
            (n, self._issue(n, "leave_ray_cluster", self._stop_payload(n), f"teardown-leave:{n.node_id}"))
            for n in self.workers
        ]
        for node, command_id in leaving:
            await self._result(command_id, f"leave_ray_cluster on node {node.node_id}")
        await self._result(
            self._issue(self.head, "stop_ray", self._stop_payload(self.head, force=True), f"teardown-stop:{self.head.node_id}"),
            f"stop_ray on node {self.head.node_id}",
        )

    def _offline(self) -> bool:
        """
        True (and the status says so) when a member has no agent connected: nothing is sent
        this pass. Away for less than L{OFFLINE_GRACE_SEC} (an agent restarting) leaves the
        status as it is; longer reads failed (the head) or degraded (a worker).
        """
        gone: list[RayNode] = []
        away = False
        now = self.clock.seconds()
        for node in self.nodes:
            record = self.backend.node(node.node_id) or {}
            if record.get("status") != "offline":
                continue
            away = True
            try:
                seen = datetime.fromisoformat(str(record.get("last_seen"))).timestamp()
            except ValueError:
                seen = None
            if seen is None or now - seen > OFFLINE_GRACE_SEC:
                gone.append(node)
        if gone:
            names = ", ".join(sorted(self._name(n) for n in gone))
            head_gone = any(n.node_id == self.head.node_id for n in gone)
            self._observe(FAILED if head_gone else DEGRADED,
                          f"{names} {'is' if len(gone) == 1 else 'are'} offline: no agent connected; "
                          f"looked at again when it is back")
        return away

    # -- failure memory ----------------------------------------------------------------------

    def fingerprint(self) -> str:
        """What a retry depends on: the generation and each member's pinned image."""
        parts = [f"gen={self.generation}"]
        for node in sorted(self.nodes, key=lambda n: n.node_id):
            b = self.bundle_for(node)
            parts.append(f"{node.node_id}={b.get('digest')}/{b.get('rootfs_digest')}")
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]

    def _held_back(self, fingerprint: str) -> str | None:
        retry = self.retry
        if retry is None or retry.get("fingerprint") != fingerprint:
            return None
        if self.clock.seconds() >= float(retry["next_attempt_at"]):
            return None
        return f"retrying at {retry['next_attempt_at']:.0f} ({retry.get('code') or 'failure'}, attempt {retry['attempts']})"

    def _record_failure(self, exc: StepFailed, fingerprint: str) -> str:
        previous = self.retry or {}
        same = previous.get("fingerprint") == fingerprint and previous.get("code") == exc.code
        attempts = int(previous.get("attempts") or 0) + 1 if same else 1
        wait = PERMANENT_RECHECK_SEC if exc.permanent else min(RETRY_BASE_SEC * 2 ** (attempts - 1), RETRY_CAP_SEC)
        now = self.clock.seconds()
        self.retry = {"code": exc.code, "permanent": exc.permanent, "fingerprint": fingerprint, "attempts": attempts,
                      "last_failed_at": now, "next_attempt_at": now + wait}
        if exc.permanent:
            return (f"{exc}. Retrying cannot change this while the runtime image and the environment stay as they "
                    f"are: it is re-checked every hour; retry once it is fixed.")
        minutes = max(1, round(wait / 60))
        return f"{exc}. Trying again in about {minutes} minute{'' if minutes == 1 else 's'} (attempt {attempts})."

    # -- health check and recovery -----------------------------------------------------------

    async def check(self) -> None:
        """Look at a cluster that was up; confirm a problem 20 s later, then recover it."""
        now = self.clock.seconds()
        recovery = dict(self.recovery or {})
        due = recovery.get("next_look_at")
        if due is not None and now < due:
            return
        status = await self.probe()
        if status is None:
            self.log.info("stand-in Ray driver: environment {env}: the health check got no answer from the head",
                          env=self.env_id)
            return
        problem = self.diagnose(status)
        if problem is None:
            self._recovered(recovery)
            self._observe(READY, None, cluster=status)
            return
        kind, lost = problem
        what = self._describe(kind, lost)
        if not recovery:
            self.recovery = {"kind": kind, "detail": what, "attempt": 0, "suspected_at": now,
                             "next_look_at": now + CONFIRM_AFTER_SEC}
            # One look is not enough to call the cluster down: the snapshot stays.
            self._observe(DEGRADED, f"{what}; looking again in {CONFIRM_AFTER_SEC:.0f} s before restarting anything")
            return
        attempt = int(recovery.get("attempt") or 0) + 1
        recovery.update(kind=kind, detail=what, attempt=attempt)
        recovery.pop("next_look_at", None)
        self.recovery = recovery
        of = f"attempt {attempt} of {MAX_RECOVERY_ATTEMPTS}" if attempt <= MAX_RECOVERY_ATTEMPTS else f"attempt {attempt}"
        self._observe(DEGRADED, f"{what}; {'re-forming the cluster' if kind == 'head' else 'rejoining'} ({of})",
                      cluster=status)
        error: str | None = None
        try:
            if kind == "head":
                await self._reform(attempt)
            else:
                await self._rejoin(lost, attempt)
        except (StepFailed, StepUnobserved) as e:
            error = getattr(e, "detail", None) or str(e)
        if error is None:
            settled = await self._settle()
            if settled is not None and self.diagnose(settled) is None:
                self._recovered(recovery)
                self._observe(READY, None, cluster=settled)
                return
            status = settled if settled is not None else status
            error = "it was restarted but did not come back"
        recovery["last_error"] = error
        later = self.clock.seconds()
        if attempt >= MAX_RECOVERY_ATTEMPTS:
            recovery.update(gave_up=True, next_look_at=later + GAVE_UP_RECHECK_SEC)
            self.recovery = recovery
            self._observe(FAILED, f"{what}; restarted {attempt} times without coming back (last: {error}); "
                                  f"looked at again every {GAVE_UP_RECHECK_SEC // 60} minutes", cluster=status)
            return
        wait = RECOVERY_BACKOFF_SEC * 2 ** (attempt - 1)
        recovery["next_look_at"] = later + wait
        self.recovery = recovery
        self._observe(DEGRADED, f"{what}; restart {attempt} of {MAX_RECOVERY_ATTEMPTS} did not bring it back "
                                f"({error}); trying again in {wait} s", cluster=status)

    def _describe(self, kind: str, lost: Sequence[RayNode]) -> str:
        if kind == "head":
            return f"Ray on {self._name(self.head)}, the cluster's head, is not running"
        names = ", ".join(sorted(self._name(n) for n in lost))
        return f"{names} {'has' if len(lost) == 1 else 'have'} dropped out of the cluster"

    def _recovered(self, recovery: dict[str, Any]) -> None:
        if not recovery:
            return
        self.recovery = None
        if int(recovery.get("attempt") or 0) > 0:
            self.last_recovery = {"kind": recovery.get("kind"), "detail": recovery.get("detail"),
                                  "noticed_at": recovery.get("suspected_at"), "recovered_at": self.clock.seconds(),
                                  "attempts": recovery.get("attempt")}
            self.log.info("stand-in Ray driver: environment {env} recovered after {n} attempt(s): {what}",
                          env=self.env_id, n=recovery.get("attempt"), what=recovery.get("detail"))

    async def _reform(self, attempt: int) -> None:
        """Everything stops (removing the runtime containers), then a fresh start and joins."""
        stops = [
            (n, self._issue(n, "leave_ray_cluster", self._stop_payload(n), f"recover{attempt}:leave:{n.node_id}"))
            for n in self.workers
        ]
        stops.append((self.head, self._issue(self.head, "stop_ray", self._stop_payload(self.head, force=True),
                                             f"recover{attempt}:stop:{self.head.node_id}")))
        for node, command_id in stops:
            await self._result(command_id, f"stopping Ray on node {node.node_id}")
        await self.start_head(attempt)
        await self.join_workers(self.workers, attempt)

    async def _rejoin(self, lost: Sequence[RayNode], attempt: int) -> None:
        """Lost workers leave (their containers removed) and join again, from clean."""
        leaving = [
            (n, self._issue(n, "leave_ray_cluster", self._stop_payload(n), f"recover{attempt}:leave:{n.node_id}"))
            for n in lost
        ]
        for node, command_id in leaving:
            await self._result(command_id, f"stopping Ray on node {node.node_id}")
        await self.join_workers(lost, attempt)

    async def _settle(self) -> dict[str, Any] | None:
        """Look every L{SETTLE_POLL_SEC} until every member shows or L{SETTLE_SEC} runs out."""
        deadline = self.clock.seconds() + SETTLE_SEC
        while True:
            status = await self.probe()
            if (status is not None and self.diagnose(status) is None) or self.clock.seconds() >= deadline:
                return status
            await deferLater(self.clock, SETTLE_POLL_SEC, lambda: None)

    # -- status and waiting ------------------------------------------------------------------

    def _observe(self, status: str, reason: str | None, cluster: Any = _KEEP) -> None:
        if status != self.status or reason != self.reason:
            self.history.append((self.clock.seconds(), status, reason))
            del self.history[:-MAX_KEPT]
            self.log.info("stand-in Ray driver: environment {env} {status}{sep}{reason}", env=self.env_id,
                          status=status.upper(), sep=": " if reason else "", reason=reason or "")
        self.status, self.reason = status, reason
        if cluster is not _KEEP:
            self.cluster = cluster
        for entry in list(self._watchers):
            wanted, d = entry
            if status in wanted:
                self._watchers.remove(entry)
                # Told on the next turn, never inside the pass: a watcher may stop or redirect
                # the environment, which cancels the pass it would otherwise be running in.
                self.clock.callLater(0, _tell, d, status)

    def until(self, *statuses: str, timeout: float | None = None) -> Deferred[str]:
        """Fire with the status once it is one of C{statuses} (now or later)."""
        if self.status in statuses:
            d: Deferred[str] = Deferred()
            d.callback(self.status)
            return d
        entry: list[Any] = []

        def _cancel(d: Deferred[str]) -> None:
            if entry and entry[0] in self._watchers:
                self._watchers.remove(entry[0])

        d = Deferred(_cancel)
        entry.append((frozenset(statuses), d))
        self._watchers.append(entry[0])
        if timeout is not None:
            d.addTimeout(timeout, self.clock)
        return d

    def next_delay(self) -> float | None:
        """When the next pass is due (seconds from now), C{None} for none."""
        now = self.clock.seconds()
        if self._again:
            return 0.0
        if self.desired == "stopped":
            return None if self.status == STOPPED else self.check_every
        if self.converged_generation == self.generation:
            due = (self.recovery or {}).get("next_look_at")
            return max(0.0, due - now) if due is not None else self.check_every
        if self.retry is not None and self.retry.get("fingerprint") == self.fingerprint():
            return max(0.0, float(self.retry["next_attempt_at"]) - now)
        return self.check_every

    # -- the loop ----------------------------------------------------------------------------

    def start(self) -> None:
        """Reconcile now, then whenever L{next_delay} says (a pass at a time)."""
        self._running = True
        if self._pass is None:
            self._schedule(0.0)

    def stop(self) -> None:
        """Stop driving: no further pass; one in flight is cancelled (its commands stay issued)."""
        self._running = False
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None
        if self._pass is not None:
            self._pass.cancel()

    def kick(self) -> None:
        """A pass now (or right after the one in flight)."""
        if not self._running:
            return
        if self._pass is not None:
            self._again = True
            return
        self._schedule(0.0)

    def want(self, desired: str) -> None:
        """C{"running"} or C{"stopped"}: a pass in flight toward the other one is cancelled."""
        if desired not in ("running", "stopped"):
            raise ValueError(f"desired must be running or stopped, not {desired!r}")
        changed = desired != self.desired
        self.desired = desired
        if changed and self._pass is not None:
            self._pass.cancel()
        self._running = True
        self.kick()

    def retry_now(self) -> None:
        """The operator's "try again": forget the failure and the recovery, and pass now."""
        self.retry = None
        self.recovery = None
        self.kick()

    def _schedule(self, delay: float) -> None:
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = self.clock.callLater(delay, self._run)

    def _run(self) -> None:
        self._call = None
        d = Deferred.fromCoroutine(self.reconcile_pass())
        self._pass = d

        def _failed(f: Failure) -> None:
            if f.check(CancelledError):
                self._again = self._running
                return
            self.log.failure("stand-in Ray driver: a pass of environment {env} broke", failure=f, env=self.env_id)
            self._observe(FAILED, f"internal error in the stand-in's driver: {f.getErrorMessage()}")

        def _next(_: object) -> None:
            self._pass = None
            if not self._running:
                return
            delay = self.next_delay()
            if delay is not None:
                self._schedule(delay)

        d.addErrback(_failed)
        d.addBoth(_next)

    async def up(self, timeout: float = 1800.0) -> str:
        """Start driving and wait until READY or FAILED; returns which."""
        self.want("running")
        return await self.until(READY, FAILED, timeout=timeout)

    async def down(self, timeout: float = 900.0) -> str:
        """Tear down and wait until STOPPED."""
        self.want("stopped")
        return await self.until(STOPPED, timeout=timeout)

    # -- Serve apps (the deployment driver's part, as the demo needs it) ---------------------

    async def run_app(self, app_name: str, llm_serving_args: dict[str, Any],
                      http_options: dict[str, Any] | None = None, budget: float = 120.0) -> dict[str, Any]:
        """C{run_serve_app} on the head, then its Serve status until the app is RUNNING."""
        payload = {"app_name": app_name, "llm_serving_args": llm_serving_args, "proxy_location": "HeadOnly",
                   "http_options": http_options or {}, "runtime_bundle": self.bundle_for(self.head)}
        run = await self._result(self._issue(self.head, "run_serve_app", payload, f"serve-app:{app_name}"),
                                 f"run_serve_app {app_name}")
        deadline = self.clock.seconds() + budget
        while True:
            # As the backend's deployment driver asks: every app (no app_name), this one picked out.
            status = await self._result(
                self._issue(self.head, "get_ray_serve_status", {"runtime_bundle": self.bundle_for(self.head)},
                            f"serve-status:{app_name}:{uuid.uuid4().hex[:8]}", listed=False),
                f"get_ray_serve_status {app_name}")
            app = (status.get("apps") or {}).get(app_name) or {}
            if app.get("status") == "RUNNING":
                return run
            if self.clock.seconds() > deadline:
                raise StepFailed(f"app {app_name} is {app.get('status') or 'absent'} after {budget:g} s")
            await deferLater(self.clock, 1.0, lambda: None)

    async def delete_app(self, app_name: str) -> dict[str, Any]:
        return await self._result(
            self._issue(self.head, "delete_serve_app", {"app_name": app_name, "runtime_bundle": self.bundle_for(self.head)},
                        f"delete-serve-app:{app_name}"),
            f"delete_serve_app {app_name}")

    # -- the dev API's view ------------------------------------------------------------------

    def view(self) -> dict[str, Any]:
        return {
            "id": self.env_id, "desired": self.desired, "status": self.status, "reason": self.reason,
            "generation": self.generation, "converged_generation": self.converged_generation,
            "head": {"node_id": self.head.node_id, "node_ip": self.head.node_ip},
            "workers": [{"node_id": w.node_id, "node_ip": w.node_ip} for w in self.workers],
            "head_address": self.head_address, "credential_ref": self.credential_ref,
            "steps": [{"step": s.step, "node_id": s.node_id, "command_id": s.command_id,
                       "status": self.backend.command(s.command_id)["status"]} for s in self.steps],
            "cluster": self.cluster, "retry": self.retry, "recovery": self.recovery,
            "last_recovery": self.last_recovery, "probes": self.probes,
            "history": [{"at": t, "status": s, "reason": r} for t, s, r in self.history],
        }


def parse_node(value: Any, what: str) -> RayNode:
    if not isinstance(value, dict) or not isinstance(value.get("node_id"), str) or not isinstance(value.get("node_ip"), str):
        raise ValueError(f"{what} must be {{node_id, node_ip[, container_name]}}")
    name = value.get("container_name")
    return RayNode(value["node_id"], value["node_ip"], name if isinstance(name, str) else None)


__all__ = [
    "FAILED", "PENDING", "PREPARING", "READY", "DEGRADED", "STOPPED", "TERMINAL",
    "EnvironmentFailed", "RayEnvironment", "RayNode", "Step", "StepFailed", "StepUnobserved", "parse_node",
]
