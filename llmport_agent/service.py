"""
The root service: one MultiService holding everything the agent runs.

Start order (dependencies first): thread pools, durable state (state file, command journal,
event outbox), the Docker executor and health watcher, the command pipeline, heartbeat and
inventory, the ops endpoint, and last the backend session; then systemd hears C{READY=1}.

A stop (SIGTERM) drains first: systemd hears C{STOPPING=1}, no new command is taken, heartbeats
go on with status C{draining}, running commands get up to C{SHUTDOWN_GRACE_SEC} to reach their
result (a second SIGTERM cuts that short), queued events are flushed. Then the rest stops in
reverse order: the session closes cleanly (WebSocket close 1000), timers stop, commands still
running are cancelled (their journal entries stay, to be resolved at the next start), logs and
files are flushed, then the pools stop.
"""

from __future__ import annotations

import os
import platform
import signal
import stat
import sys
import time
from collections.abc import Callable, MutableMapping
from typing import Any

from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.logger import Logger

from llmport_agent import VERSION
from llmport_agent.backend_http import BackendHTTP
from llmport_agent.commands.base import HandlerSpec
from llmport_agent.commands.journal import CommandJournal
from llmport_agent.commands.node import PersistentModes, node_handler_specs
from llmport_agent.commands.pipeline import CommandPipeline
from llmport_agent.config import SETTINGS, AgentConfig, mask_url
from llmport_agent.events.outbox import EventOutbox
from llmport_agent.instance import AlreadyRunning, InstanceLock
from llmport_agent.reporting import HeartbeatReporter, InventoryReporter
from llmport_agent.session.service import SessionService
from llmport_agent.state import StateStore, resolve_state_path
from llmport_agent.threads import PoolService

START_TIME = time.time()

#: The env file `llmport-agent start` (and llm-port's own installer) writes for the unit.
ENV_FILE = "/etc/llmport-agent.env"
#: After the drain, how long a stop waits for queued events to reach the backend.
EVENT_FLUSH_SEC = 3.0


def env_file_path() -> str:
    """L{ENV_FILE}, under C{$LLMPORT_AGENT_SYSTEM_ROOT} when set (tests of the installer)."""
    root = os.environ.get("LLMPORT_AGENT_SYSTEM_ROOT", "")
    return os.path.join(root, ENV_FILE.lstrip("/")) if root else ENV_FILE


def tighten_env_file(path: str) -> tuple[str, str, int] | None:
    """
    Thread function: chmod 0600 the env file when group or others may read or write it. Not
    following a symlink (a link there is left alone). C{None} when nothing was to do, else
    (C{"tightened"} or why not, the path, the mode found).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if not stat.S_ISREG(st.st_mode) or not mode & (stat.S_IRWXG | stat.S_IRWXO):
            return None
        why = "it belongs to another user" if st.st_uid != os.geteuid() and os.geteuid() != 0 else ""
        if not why:
            try:
                os.fchmod(fd, 0o600)
                return ("tightened", path, mode)
            except OSError as e:
                why = e.strerror or "chmod failed"
        # Not ours to change: worth a warning only when it holds a secret.
        text = os.read(fd, 1 << 20).decode("utf-8", "replace")
        secret = {s.env for s in SETTINGS if s.secret}
        for line in text.splitlines():
            key, sep, value = line.strip().partition("=")
            if sep and key.strip().removeprefix("export ").strip() in secret and value.strip().strip("\"'"):
                return (why, path, mode)
        return None
    finally:
        os.close(fd)


def install_stop_signals(reactor: Any, agent: AgentService) -> None:
    """
    SIGTERM/SIGINT: the first begins a graceful stop (drain), a second ends the drain at once.
    Installed once the reactor runs (it installs its own handlers first).
    """

    def handler(signum: int, frame: Any) -> None:
        reactor.callFromThread(agent.stop_requested, signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def make_http_client(reactor: Any, config: AgentConfig) -> Any:
    """A treq client for the backend with its own connection pool and TLS policy."""
    from treq.client import HTTPClient
    from twisted.web.client import HTTPConnectionPool

    from llmport_agent.http_endpoints import backend_agent
    from llmport_agent.tls import https_policy

    pool = HTTPConnectionPool(reactor, persistent=True)
    pool._factory.noisy = False
    pool.maxPersistentPerHost = max(
        4, config.model_sync_concurrency * (config.model_sync_connections or 4) + 2
    )
    pool.cachedConnectionTimeout = 60
    agent = backend_agent(
        reactor,
        https_policy(config.verify_tls, config.ca_bundle, config.tls_client_cert, config.tls_client_key),
        pool,
        connect_timeout=config.request_timeout_sec,
    )
    return HTTPClient(agent), pool


class AgentService(MultiService):
    """The whole agent."""

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        config: AgentConfig,
        *,
        fatal: Callable[[int, str], None] | None = None,
        gpu_source: Any = None,
        docker_enabled: bool = True,
        docker_environ: dict[str, str] | None = None,
        endpoint_factory: Callable[[str, int, bool], Any] | None = None,
        notify_environ: MutableMapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.reactor = reactor
        self.config = config
        self._fatal_cb = fatal
        self.exit_status: int | None = None
        #: True from the first stop request (SIGTERM) on: heartbeats say "draining".
        self.stopping = False
        self._stop_signals = 0
        self._force_stop: Deferred[None] | None = None
        self.drain_report: dict[str, Any] = {}
        state_path, note = resolve_state_path(config.state_path)
        self.state_note = note
        state_dir = os.path.dirname(os.path.abspath(state_path))
        self.io_pool = PoolService(reactor, "io", 2)
        self.host_pool = PoolService(reactor, "host", 2)
        self.state = StateStore(self.io_pool, state_path)
        #: One agent per state file (issue 20): taken first at start, held until the stop ends.
        self.instance_lock = InstanceLock(state_path)
        self.journal = CommandJournal(self.io_pool, os.path.join(state_dir, "commands.jsonl"), time.time)
        self.http, self.http_pool = make_http_client(reactor, config)
        self.backend = BackendHTTP(
            reactor, self.http, config.backend_url, config.request_timeout_sec, client_cert=config.tls_client_cert
        )
        self.modes = PersistentModes(self.state, on_change=self._modes_changed)

        from llmport_agent.inventory.collector import InventoryCollector
        from llmport_agent.inventory.monitor import GPUHealthMonitor
        from llmport_agent.inventory.select import make_gpu_source
        from llmport_agent.models.syncer import ModelSyncer

        # Each blob being fetched writes and hashes at the same time.
        self.hash_pool = PoolService(reactor, "files", 2 * config.model_sync_concurrency + 1)
        self.models = ModelSyncer(
            reactor,
            self.http,
            self.hash_pool,
            store_dir=config.model_store,
            backend_url=config.backend_url,
            credential=lambda: self.session.credential(),
            concurrency=config.model_sync_concurrency,
            connections=config.model_sync_connections,
            segment_size=config.model_sync_segment_mb * 1024 * 1024,
            buffer_bytes=config.model_sync_buffer_mb * 1024 * 1024,
        )
        self._docker_environ = docker_environ
        if gpu_source is None:
            gpu_source = make_gpu_source(
                config.gpu_source,
                call_timeout=config.gpu_call_timeout_sec,
                ignored_xids=config.gpu_ignored_xids,
            )
        self.gpu_source = gpu_source
        self.engine: Any = None
        self.adoption: Any = None
        self.workloads: Any = None
        self.health: Any = None
        self.ray: Any = None
        self.seeding: Any = None
        if docker_enabled:
            self._build_workloads(state_dir)
            self._build_ray()
        from llmport_agent.inventory.sections import inventory_sections

        self.collector = InventoryCollector(
            reactor,
            self.host_pool,
            gpu_source,
            state_dir=state_dir,
            model_store=config.model_store,
            engine_facts=self._engine_facts,
            # Protocol 10.5: network (fabrics), vLLM not started by llm-port, the Ray runtime.
            sections=inventory_sections(self.host_pool, self.engine, agent_id=config.agent_id),
            paths={"model_store": config.model_store, "ray_session": config.ray_session_dir},
        )
        # GPU health (issue 13): driver events and periodic checks; transitions become
        # gpu.health.* events, a heartbeat on change (notify_changed) and a fresh inventory.
        self.gpu_monitor = GPUHealthMonitor(
            reactor,
            gpu_source,
            self.host_pool,
            interval=config.gpu_health_interval_sec,
            on_transition=self._gpu_transition,
        )
        self._gpu_inventory_call: Any = None
        self.session = SessionService(
            reactor,
            config,
            self.state,
            self.backend,
            lambda: Deferred.fromCoroutine(self.collector.capabilities()),
            self._fatal,
            version=VERSION,
            endpoint_factory=endpoint_factory,
            # Fast polls while a command runs or its result awaits confirmation.
            busy=lambda: self.pipeline.busy,
        )
        self.outbox = EventOutbox(reactor, self.io_pool, os.path.join(state_dir, "events.jsonl"), self.session)
        self.heartbeat = HeartbeatReporter(
            reactor, self.session, config.heartbeat_interval_sec, self._heartbeat_fields
        )
        # Heartbeat fields that change (engine, modes, capabilities; GPU health too) call
        # heartbeat.notify_changed(): the backend hears of it at once, not an interval later.
        self.inventory = InventoryReporter(
            reactor, self.session, config.inventory_interval_sec, self.collector,
            on_report=self.heartbeat.notify_changed,
        )
        if self.engine is not None:
            self.engine.onAvailability(lambda _available: self.heartbeat.notify_changed())
        registry: dict[str, HandlerSpec] = {}
        from llmport_agent.commands.system_updates import check_system_updates, process_runner

        run_process = process_runner(reactor)
        registry.update(
            node_handler_specs(
                self.modes,
                self._refresh_inventory,
                self.diagnostics,
                lambda: check_system_updates(run_process),
            )
        )
        from llmport_agent.models.handler import sync_model_handler_spec

        registry["sync_model"] = sync_model_handler_spec(self.models)
        from llmport_agent.ray.fabric import fabric_handler_specs

        # Fabric probes need no Docker: every node can certify its links.
        registry.update(fabric_handler_specs())
        if self.workloads is not None:
            registry.update(self._workload_specs())
        if self.ray is not None:
            from llmport_agent.ray.handlers import ray_handler_specs

            registry.update(ray_handler_specs(self.ray))
            from llmport_agent.ray.seeding import seeding_handler_specs

            registry.update(seeding_handler_specs(self.seeding))
        else:
            from llmport_agent.ray.handlers import no_ray_status_spec

            # Without the Docker executor there is no Ray here: the probe still gets its answer.
            registry["get_ray_status"] = no_ray_status_spec()
        self.pipeline = CommandPipeline(
            reactor,
            self.session,
            self.journal,
            registry,
            self.modes,
            self.outbox,
            credential=self.session.credential,
            max_concurrent=config.max_concurrent_commands,
            max_age=config.command_max_age_sec,
            deadlines=dict(config.command_deadlines),
            keepalive=config.command_keepalive_sec,
        )
        # Listener order matters on connect: heartbeat first (the node stays offline until
        # it), then results in doubt and acks, then inventory, events and workload states.
        self.session.subscribe(self.heartbeat)
        self.session.subscribe(self.pipeline)
        self.session.subscribe(self.inventory)
        self.session.subscribe(self.outbox)
        self.session.subscribe(_ProfileFromHello(self.modes))
        if self.health is not None:
            self.session.subscribe(_Announcer(self.health))
        self._ordered: list[Service] = [self.io_pool, self.host_pool, self.hash_pool]
        if self.engine is not None:
            self._ordered.append(self.engine)
        self._ordered += [self.outbox, self.pipeline, self.heartbeat, self.inventory, self.gpu_monitor]
        if self.health is not None:
            self._ordered.append(self.health)
        self._ordered.append(self.session)
        self.loki: Any = None
        self.journald: Any = None
        self.container_logs: Any = None
        self.log_observer: Any = None
        self.loki_pool: Any = None
        self.log_shipping: Any = None
        self.log_sink: Any = None
        self._state_dir = state_dir
        if config.loki_url:
            self._build_log_shipping(state_dir)
        else:
            self._build_log_sink_discovery()
        self.ops: Any = None
        if config.ops_port:
            from llmport_agent.ops import OpsService

            self.ops = OpsService(reactor, self, config.ops_port)
            self._ordered.insert(len(self._ordered) - 1, self.ops)
        from llmport_agent.metrics import ReactorLatenessProbe
        from llmport_agent.sdnotify import Notifier, NotifyService

        self.lateness = ReactorLatenessProbe(reactor)
        self._ordered.insert(3, self.lateness)
        # Not a child: it must outlive every other service (watchdog pings while draining).
        self.notify = NotifyService(reactor, Notifier(notify_environ), self.status_line)
        self.recent_errors: list[dict[str, Any]] = []
        self._started: Deferred[None] | None = None

    # -- logs to Loki (optional) -------------------------------------------------------------

    def _build_log_shipping(self, state_dir: str) -> None:
        from llmport_agent.logs.wiring import build_log_shipping

        # The host label must equal the host the backend stores for this node.
        shipping = build_log_shipping(
            self.reactor, self.config, state_dir=state_dir, host=self.backend_host,
            secrets=self._secrets, engine=self.engine, docker_environ=self._docker_environ,
        )
        self.log_shipping = shipping
        self.loki, self.loki_pool = shipping.shipper, shipping.http_pool
        self.log_observer, self.journald = shipping.observer, shipping.journald
        # After the state pools: stopped before them, the readers before the shipper.
        self._ordered[3:3] = shipping.readers
        if shipping.containers is not None:
            # Workload logs (protocol 8, job="node-container"): after the engine and the
            # shipper, so it stops before both.
            self.container_logs = shipping.containers
            self._ordered.insert(self._ordered.index(self.engine) + 1, self.container_logs)

    def _build_log_sink_discovery(self) -> None:
        """
        No LOKI_URL: ask the backend for its sink at connect (protocol 10.7); shipping is built
        when it names one, into slots that keep the stop order of a configured LOKI_URL.
        """
        from llmport_agent.logs.sink import LogSinkDiscovery, ServiceSlot

        self._logs_slot = ServiceSlot(self.reactor, "logs-slot")
        self._ordered.insert(3, self._logs_slot)
        self._containers_slot: ServiceSlot | None = None
        if self.engine is not None:
            self._containers_slot = ServiceSlot(self.reactor, "container-logs-slot")
            self._ordered.insert(self._ordered.index(self.engine) + 1, self._containers_slot)
        self.log_sink = LogSinkDiscovery(
            self.reactor, lambda: self.backend.log_sink(self.session.credential()), self._sink_found
        )
        self.session.subscribe(self.log_sink)
        self._ordered.insert(self._ordered.index(self.session), self.log_sink)

    def _sink_found(self, url: str) -> None:
        """Start shipping to the sink the backend named (reactor thread, once)."""
        import attrs
        from twisted.logger import globalLogPublisher

        from llmport_agent.logs.wiring import build_log_shipping

        if self.log_shipping is not None or not self.running:
            return
        shipping = build_log_shipping(
            self.reactor, attrs.evolve(self.config, loki_url=url), state_dir=self._state_dir,
            host=self.backend_host, secrets=self._secrets, engine=self.engine,
            docker_environ=self._docker_environ,
        )
        self.log_shipping = shipping
        self.loki, self.loki_pool = shipping.shipper, shipping.http_pool
        self.log_observer, self.journald = shipping.observer, shipping.journald
        for svc in shipping.readers:
            svc.setServiceParent(self._logs_slot)
        if shipping.containers is not None and self._containers_slot is not None:
            self.container_logs = shipping.containers
            shipping.containers.setServiceParent(self._containers_slot)
        globalLogPublisher.addObserver(self.log_observer)

    def backend_host(self) -> str:
        """
        The host the backend stores for this node (protocol 1, 3.2): the advertised host once a
        heartbeat carried it as an IP literal, else what enrollment recorded.
        """
        import ipaddress

        try:
            ipaddress.ip_address(self.config.advertise_host)
            return self.config.advertise_host
        except ValueError:
            stored = self.state.get("backend_host")
            return stored if isinstance(stored, str) and stored else self.config.advertise_host

    def _secrets(self) -> list[str]:
        values = [
            self.config.enrollment_token,
            self.state.credential,
            self.state.get("pending_credential"),
            self.state.get("previous_credential"),
        ]
        if self.ray is not None:
            values += self.ray.tokens.secrets()
        return [v for v in values if isinstance(v, str) and v]

    # -- workloads (optional: the Docker executor) ------------------------------------------

    def _build_workloads(self, state_dir: str) -> None:
        from llmport_agent.workloads.engine import DockerEngine
        from llmport_agent.workloads.handlers import WorkloadManager
        from llmport_agent.workloads.health import HealthWatcher
        from llmport_agent.workloads.settings import WorkloadSettings

        c = self.config
        settings = WorkloadSettings(
            agent_id=c.agent_id,
            advertise_scheme=c.advertise_scheme,
            advertise_host=c.advertise_host,
            model_store=c.model_store,
            model_store_read_only=c.model_store_read_only,
            image_allowlist=c.image_allowlist,  # type: ignore[arg-type]
            network_mode=c.workload_network,  # type: ignore[arg-type]
            stop_grace_sec=c.stop_grace_sec,
            readiness_timeout_sec=c.readiness_timeout_sec,
            pull_stall_sec=c.pull_stall_sec,
            allow_host_ipc=c.allow_host_ipc,
        )
        self.engine = DockerEngine(self.reactor, environ=self._docker_environ)
        from llmport_agent.workloads.adoption import Adoption

        # The original agent's runtimes (its `workloads` mapping in this state file), taken over.
        self.adoption = Adoption(self.reactor, self.engine, self.state, c.agent_id)
        self.health = HealthWatcher(
            self.reactor,
            self.engine,
            settings,
            self._emit_event,
            adoption=self.adoption,
        )
        self.workloads = WorkloadManager(
            self.reactor,
            self.engine,
            settings,
            http=self.http,
            backend_url=c.backend_url,
            credential=lambda: self.session.credential(),
            sync_model=lambda model_sync, progress: Deferred.fromCoroutine(
                self.models.sync(model_sync, progress)
            ),
            profile=lambda: self.modes.profile,
            health=self.health,
            gpus=lambda: self.collector.last_gpu if self.collector.last_report is not None else None,
            adoption=self.adoption,
        )

    def _build_ray(self) -> None:
        """Multi-node inference on Ray (protocol 10.6): the runtime container's commands."""
        from llmport_agent.ray.handlers import RayManager, RaySettings
        from llmport_agent.ray.token import ClusterTokens

        c = self.config
        roots = [c.model_store, *c.ray_allowed_mounts]
        session_dir = c.ray_session_dir
        if session_dir:
            roots.append(session_dir)
        tokens = ClusterTokens(
            self.reactor, self.backend, lambda: self.session.credential(), self.io_pool,
            c.ray_token_dir, timeout=c.request_timeout_sec,
        )
        self.ray = RayManager(
            self.reactor,
            self.engine,
            self.workloads.images,
            tokens,
            RaySettings(
                agent_id=c.agent_id,
                allowlist=self.workloads.allowlist,
                allowed_roots=tuple(os.path.abspath(r) for r in roots),
                token_dir=c.ray_token_dir,
                session_dir=os.path.abspath(session_dir) if session_dir else "",
            ),
            self.io_pool,
        )
        from llmport_agent.ray.seeding import ImageSeeding

        self.seeding = ImageSeeding(
            self.reactor, self.engine, self.io_pool,
            c.image_download_dir or os.path.join(c.state_dir, "images"), self.ray,
        )
        self.ray.peer_loader = self.seeding.load_from_peer

    def _emit_event(self, event_type: str, payload: dict[str, Any], severity: str = "info") -> None:
        self.outbox.emit(event_type, payload, severity)

    def _workload_specs(self) -> dict[str, HandlerSpec]:
        from llmport_agent.workloads.handlers import workload_handler_specs

        return workload_handler_specs(self.workloads)

    def _engine_facts(self) -> dict[str, Any]:
        if self.engine is None:
            return {"docker_available": False, "container_runtime": "none"}
        return dict(self.engine.facts())

    # -- lifecycle -------------------------------------------------------------------------

    def startService(self) -> None:
        # The children are started by _start, in order, once durable state is loaded.
        self.running = 1
        self.notify.startService()
        self._started = Deferred.fromCoroutine(self._start())
        self._started.addErrback(self._start_failed)

    def _start_failed(self, f: Any) -> None:
        from llmport_agent.session.service import EXIT_NEEDS_OPERATOR
        from llmport_agent.state import StateUnreadable

        if f.check(StateUnreadable):
            self._fatal(EXIT_NEEDS_OPERATOR, f.getErrorMessage())
            return
        if f.check(OSError) and not self.instance_lock.held:
            self._fatal(1, f"cannot create the lock file {self.instance_lock.path} ({f.getErrorMessage()}); "
                           "check that the state directory is writable by the agent")
            return
        self.log.failure("The agent could not start", failure=f)
        self._fatal(1, f"The agent could not start: {f.getErrorMessage()}")

    async def _start(self) -> None:
        if self.state_note:
            self.log.warn("{note}", note=self.state_note)
        for svc in self._ordered[:3]:
            svc.setServiceParent(self)
        self._check_env_file()
        try:
            await self.io_pool.run(self.instance_lock.acquire)
        except AlreadyRunning as e:
            # Nothing else starts: this process must not touch the state, the journal or the
            # engine that the other agent is using.
            self._fatal(1, str(e))
            return
        await self.state.load()
        await self.journal.load()
        await self.outbox.load()
        if self.log_observer is not None:
            from twisted.logger import globalLogPublisher

            globalLogPublisher.addObserver(self.log_observer)
        # Said before the services start, so that what they say (the session's "no credential
        # and no token", say) comes after it, not before.
        self.log.info(
            "llmport-agent {version} started (agent id {agent_id}, backend {url}, state {path})",
            version=VERSION,
            agent_id=self.config.agent_id,
            url=mask_url(self.config.backend_url),
            path=self.state.path,
        )
        for note in self.config.notes:
            self.log.warn("{note}", note=note)
        for svc in self._ordered[3:]:
            svc.setServiceParent(self)
        if self.adoption is not None:
            self.adoption.start()
        self.notify.ready()

    def _check_env_file(self) -> None:
        """
        The env file (llm-port's own installer writes it 0644, token included) readable or
        writable by other users is tightened to 0600 (issue 20), and said once; when it cannot
        be (another owner), the warning says what to run.
        """
        self.io_pool.run(tighten_env_file, env_file_path()).addCallbacks(
            self._env_file_checked, lambda f: self.log.failure("Checking the env file failed", f)
        )

    def _env_file_checked(self, result: tuple[str, str, int] | None) -> None:
        if result is None:
            return
        outcome, path, mode = result
        if outcome == "tightened":
            self.log.warn(
                "{path} was readable by other users (mode {mode:04o}) and holds this node's settings "
                "(an enrollment token, passwords): its mode is now 0600",
                path=path,
                mode=mode,
            )
        else:
            self.log.warn(
                "{path} is readable by other users (mode {mode:04o}) and could not be tightened ({why}): "
                "run `chmod 600 {path}` (llmport-agent start does this); once the node is enrolled the "
                "token line can be removed",
                path=path,
                mode=mode,
                why=outcome,
            )

    def whenStarted(self) -> Deferred[None]:
        if self._started is None:
            return succeed(None)
        d: Deferred[None] = Deferred()

        def done(result: object) -> object:
            d.callback(None)
            return result

        self._started.addBoth(done)
        return d

    def stopService(self) -> Deferred[None]:
        self.running = 0
        self.stopping = True
        # A stop signal from now on ends the drain at once.
        self._stop_signals = max(self._stop_signals, 1)
        started = self._started if self._started is not None else succeed(None)
        return started.addBoth(lambda _: Deferred.fromCoroutine(self._stop()))

    def stop_requested(self, signum: int = signal.SIGTERM) -> None:
        """A stop signal: the first stops the reactor (which drains), a second ends the drain."""
        self._stop_signals += 1
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = str(signum)
        if self._stop_signals == 1:
            self.log.info(
                "Received {signal}: stopping; running commands get up to {grace:g} s to finish "
                "(send it again to stop at once)",
                signal=name,
                grace=self.config.shutdown_grace_sec,
            )
            from twisted.internet.error import ReactorNotRunning

            try:
                self.reactor.stop()
            except ReactorNotRunning:
                pass
            return
        self.log.warn("Received {signal} again: stopping now; commands still running are "
                      "checkpointed in the journal", signal=name)
        self.force_stop()

    def force_stop(self) -> None:
        """End the drain now (a second SIGTERM)."""
        force, self._force_stop = self._force_stop, None
        if force is not None and not force.called:
            force.callback(None)

    async def _drain(self) -> None:
        """Let running commands reach their result, within SHUTDOWN_GRACE_SEC; keep heartbeating."""
        grace = self.config.shutdown_grace_sec
        started = self.reactor.seconds()
        pipeline = self.pipeline
        if not pipeline.running:
            return
        pipeline.begin_drain()
        busy = pipeline.busy
        self.notify.stopping(f"stopping: draining, {busy} command(s) running")
        self.heartbeat.send_now()
        if busy and grace > 0:
            self.log.info("Draining: waiting up to {grace:g} s for {n} running command(s)",
                          grace=grace, n=busy)
            idle = pipeline.wait_idle()
            self._force_stop = Deferred()
            from twisted.internet.defer import DeferredList

            first: Deferred[Any] = DeferredList([idle, self._force_stop], fireOnOneCallback=True,
                                                consumeErrors=True)
            first.addTimeout(grace, self.reactor)
            try:
                await first
            except Exception:
                pass
            finally:
                self._force_stop = None
                if not idle.called:
                    idle.cancel()
        left = pipeline.busy
        self.drain_report = {"waited_sec": round(self.reactor.seconds() - started, 3), "left": left}
        if left:
            self.log.warn(
                "Stopping with {n} command(s) still running after {sec:.1f} s: they stay in the "
                "journal and are resolved at the next start",
                n=left,
                sec=self.reactor.seconds() - started,
            )
        # Events of the commands that just finished (command.finished, health) reach the backend.
        if self.session.connected and self.outbox.depth:
            from twisted.internet.task import deferLater

            self.outbox.flush()
            deadline = self.reactor.seconds() + EVENT_FLUSH_SEC
            while self.outbox.depth and self.session.connected and self.reactor.seconds() < deadline:
                await deferLater(self.reactor, 0.05, lambda: None)

    async def _stop(self) -> None:
        try:
            await self._drain()
        except Exception:
            self.log.failure("Draining before the stop failed")
        if self._gpu_inventory_call is not None and self._gpu_inventory_call.active():
            self._gpu_inventory_call.cancel()
        if self.adoption is not None:
            self.adoption.stop()
        self.notify.stopping("stopping: closing the backend session")
        pools = (self.io_pool, self.host_pool, self.hash_pool)
        for svc in reversed(list(self)):
            if svc in pools or not getattr(svc, "running", False):
                continue
            await self._stop_one(svc)
        if self.log_observer is not None:
            from twisted.logger import globalLogPublisher

            globalLogPublisher.removeObserver(self.log_observer)
        if self.loki_pool is not None:
            try:
                await self.loki_pool.closeCachedConnections()
            except Exception:
                self.log.failure("Closing Loki connections failed")
        await self.state.flush()
        try:
            await self.collector.close()  # nvmlShutdown, on the host pool
        except Exception:
            self.log.failure("Closing the GPU source failed")
        try:
            await self.http_pool.closeCachedConnections()
        except Exception:
            self.log.failure("Closing HTTP connections failed")
        if self.instance_lock.held:
            try:
                await self.io_pool.run(self.instance_lock.release)
            except Exception:
                self.log.failure("Releasing {path} failed", path=self.instance_lock.path)
        for svc in reversed(pools):
            if getattr(svc, "running", False):
                await self._stop_one(svc)
        self.log.info("llmport-agent stopped")
        self.notify.stopService()

    async def _stop_one(self, svc: Any) -> None:
        try:
            result = svc.stopService()
            if isinstance(result, Deferred):
                result.addTimeout(15, self.reactor)
                await DeferredList([result], consumeErrors=True)
        except Exception:
            self.log.failure("Stopping {name} failed", name=svc.name)

    def _fatal(self, status: int, message: str) -> None:
        self.exit_status = status
        # Not a "message" field: legacy log observers replace a non-tuple "message" in place.
        self.log.critical("{reason}", reason=message)
        if self._fatal_cb is not None:
            self._fatal_cb(status, message)

    # -- glue ------------------------------------------------------------------------------

    def _heartbeat_fields(self) -> dict[str, Any]:
        # Degraded once the engine was found unreachable (before its first probe the engine is
        # unknown, not down: a false "degraded" halves the node's score) or a GPU is not healthy.
        engine_down = self.engine is not None and self.engine.checked and not self.engine.available
        reasons = self.gpu_monitor.status_reasons()
        status = "draining" if self.stopping else self.modes.status(degraded=engine_down or bool(reasons))
        fields = {
            "status": status,
            "version": VERSION,
            "capabilities": self.collector.last_capabilities(),
            "advertise_host": self.config.advertise_host,
        }
        if engine_down:
            reasons.insert(0, "the container engine is unreachable")
        if reasons and fields["status"] == "degraded":
            # Extra key (protocol 3.2 ignores it): why the node is degraded, for people.
            fields["status_reason"] = "; ".join(reasons)[:1000]
        return fields

    def _gpu_transition(self, t: Any) -> None:
        """
        A GPU's verdict changed: an event, a heartbeat as soon as its status/status_reason
        differ (heartbeat.notify_changed, rate-limited), a fresh inventory soon.
        """
        self.outbox.emit(t.event_type, t.payload(), t.severity)
        self.heartbeat.notify_changed()
        if self._gpu_inventory_call is None or not self._gpu_inventory_call.active():
            # Coalesced: one inventory (gpu_count, free VRAM) for a burst of transitions.
            self._gpu_inventory_call = self.reactor.callLater(1.0, self._gpu_inventory)

    def _gpu_inventory(self) -> None:
        self._gpu_inventory_call = None
        if self.session.connected and self.running:
            self.inventory.report_now()

    def _modes_changed(self) -> None:
        self.heartbeat.notify_changed()

    def status_line(self) -> str:
        """The one line systemd shows (C{STATUS=}): session state, node, workloads, last error."""
        from llmport_agent.metrics import session_state, workload_states

        state = session_state(self.session)
        words = {"connected": "connected", "enrolling": "enrolling", "backing_off": "backing off",
                 "refused": "credential refused", "connecting": "connecting", "stopped": "stopped"}
        parts = [words.get(state, state)]
        if self.stopping:
            parts.insert(0, "draining")
        parts.append(f"node {self.session.node_id or '-'}")
        if self.health is not None:
            parts.append(f"{len(workload_states(self))} workloads")
        running = len(self.pipeline._running)
        if running:
            parts.append(f"{running} commands running")
        error = self.session.stats.last_error if state != "connected" else ""
        if error:
            parts.append(f"last error: {error}")
        from llmport_agent.logs.redact import redact

        return redact(", ".join(parts), self._secrets())

    async def _refresh_inventory(self) -> bool:
        """Send a fresh inventory; if the link is down, send it once it is back (within ~50 s)."""
        from twisted.internet.task import deferLater

        for _ in range(100):
            if self.session.connected and await self.inventory.report_now():
                return True
            await deferLater(self.reactor, 0.5, lambda: None)
        return False

    async def diagnostics(self) -> dict[str, Any]:
        """The C{collect_diagnostics} result: structured, secrets masked."""
        import attrs
        import autobahn
        import treq

        import twisted

        gpu: dict[str, Any] = {}
        try:
            report = await self.collector.collect()
            g = report.inventory.get("gpu", {})
            gpu = {
                "count": g.get("count", 0),
                "vendor": report.inventory.get("static_capabilities", {}).get("gpu_vendor", "none"),
                "total_vram_bytes": g.get("total_vram_bytes", 0),
                "free_vram_bytes": g.get("free_vram_bytes", 0),
                "gpu_error": g.get("gpu_error", ""),
                "devices": [
                    {k: d.get(k) for k in ("index", "uuid", "name", "memory_total_mib", "utilization_pct",
                                           "temperature_c", "health", "health_reasons")}
                    for d in g.get("devices", [])
                ],
                "health": self.gpu_monitor.metrics(),
            }
        except Exception as e:
            gpu = {"error": f"{type(e).__name__}: {e}"}
        out: dict[str, Any] = {
            "agent": {
                "version": VERSION,
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "pid": os.getpid(),
                "uptime_sec": round(time.time() - START_TIME, 1),
                "libraries": {
                    "twisted": twisted.__version__,
                    "autobahn": autobahn.__version__,
                    "treq": getattr(treq, "__version__", ""),
                    "attrs": attrs.__version__,
                },
            },
            "config": self.config.masked(),
            "node": {
                "node_id": self.session.node_id or "",
                "agent_id": self.config.agent_id,
                "maintenance": self.modes.maintenance,
                "draining": self.modes.draining,
                "profile": (self.modes.profile or {}).get("name", ""),
                "status": self._heartbeat_fields()["status"],
            },
            "session": {
                "connected": self.session.connected,
                "session_id": self.session.session_id or "",
                "consecutive_failures": self.session.failures.failures,
                **self.session.stats.as_dict(),
                "dispatch": self.session.dispatch.describe(),
            },
            "commands": self.pipeline.describe(),
            "events": {"outbox_depth": self.outbox.depth, "dropped": self.outbox.dropped, "sent": self.outbox.sent},
            "logs": (
                self.log_shipping.describe() if self.log_shipping is not None
                else {"shipping": "off (no LOKI_URL)"} if self.log_sink is None
                else {"shipping": "off (no LOKI_URL; waiting for the backend's log sink)",
                      "log_sink": self.log_sink.describe()}
            ),
            "reports": {"heartbeats_sent": self.heartbeat.sent, "inventories_sent": self.inventory.sent,
                        "inventory_error": self.inventory.last_error},
            "gpu": gpu,
            "recent_errors": list(self.recent_errors[-20:]),
        }
        if self.engine is not None:
            try:
                from llmport_agent.workloads.diagnostics import engine_diagnostics

                out["engine"] = await engine_diagnostics(self.engine, self.config.agent_id, self.health.states()
                                                         if hasattr(self.health, "states") else None)
            except Exception as e:
                out["engine"] = {"error": f"{type(e).__name__}: {e}"}
        return out


class _Announcer:
    """After every connect, report every managed workload's state (protocol 3.2, node offline)."""

    log = Logger()

    def __init__(self, health: Any) -> None:
        self.health = health

    def session_opened(self) -> None:
        d = Deferred.fromCoroutine(self.health.announce_all())

        def failed(f: Any) -> None:
            from llmport_agent.commands.base import CommandFailed

            if f.check(CommandFailed):
                self.log.warn("Could not announce workloads after connecting: {error}",
                              error=f.value.error_message)
            else:
                self.log.failure("Announcing workloads failed", failure=f)

        d.addErrback(failed)

    def session_closed(self) -> None:
        pass

    def frame_received(self, frame: dict[str, Any]) -> None:
        pass


class _ProfileFromHello:
    """C{hello_ack.profile} is the node's current profile: keep it like C{sync_node_profile}."""

    log = Logger()

    def __init__(self, modes: PersistentModes) -> None:
        self.modes = modes

    def session_opened(self) -> None:
        pass

    def session_closed(self) -> None:
        pass

    def frame_received(self, frame: dict[str, Any]) -> None:
        if frame.get("type") != "hello_ack":
            return
        if "profile" not in frame:
            return
        profile = frame.get("profile")
        if profile is not None and not isinstance(profile, dict):
            self.log.warn("Ignored a hello_ack profile that is not an object")
            return
        changed = (self.modes.profile is not None) if profile is None else profile != self.modes._live_profile
        if changed:
            # None clears it: no profile is assigned to this node any more.
            d = Deferred.fromCoroutine(self.modes.set(profile=profile))
            d.addErrback(lambda f: self.log.failure("Storing the profile failed", failure=f))
