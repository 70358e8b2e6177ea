"""
The composition root: one MultiService holding everything the agent runs, and only the wiring
of it. Each behaviour lives in a module named after it (docs: architecture):

- L{llmport_agent.agent.startup.Startup}: the start: thread pools, durable state (state file,
  command journal, event outbox), then the backend session first (its enrollment or connect is
  on its way while the rest starts), then the Docker executor and health watcher, the command
  pipeline, heartbeat and inventory, the ops endpoint; then systemd hears C{READY=1}.
- L{llmport_agent.agent.drain.Drain}: stop signals and the drain; L{llmport_agent.agent.drain.Teardown}:
  the stop in reverse dependency order (the session first, the pools last).
- L{llmport_agent.host.envfile.EnvFileCheck}: the env file of the unit, tightened at start.
- L{llmport_agent.ops.status.NodeStatus}: the heartbeat's status fields and systemd's C{STATUS=} line.
- L{llmport_agent.ops.diagnostics.Diagnostics}: the C{collect_diagnostics} result.
- L{llmport_agent.agent.secrets.NodeSecrets}: the secret values no line may show.
- L{llmport_agent.agent.refresh.InventoryRefresh}: inventory out of its interval (GPU verdicts,
  C{refresh_inventory}).
- L{llmport_agent.agent.listeners}: small session listeners (workload announcements, hello profile).

Each part gets its inputs here and never imports this module.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from llmport_agent import VERSION
from llmport_agent.agent.drain import Drain, Teardown
from llmport_agent.agent.listeners import _Announcer, _ProfileFromHello
from llmport_agent.agent.refresh import InventoryRefresh
from llmport_agent.agent.secrets import NodeSecrets
from llmport_agent.agent.startup import Startup
from llmport_agent.commands.base import HandlerSpec
from llmport_agent.commands.journal import CommandJournal
from llmport_agent.commands.node import PersistentModes, node_handler_specs
from llmport_agent.commands.pipeline import CommandPipeline
from llmport_agent.core.config import AgentConfig
from llmport_agent.core.heap import HeapTrim
from llmport_agent.core.later import Later
from llmport_agent.core.state import StateStore, resolve_state_path
from llmport_agent.core.threads import PoolService
from llmport_agent.events.outbox import EventOutbox
from llmport_agent.host.envfile import EnvFileCheck
from llmport_agent.host.instance import InstanceLock
from llmport_agent.ops.status import NodeStatus
from llmport_agent.session.backend_http import BackendHTTP
from llmport_agent.session.reporting import HeartbeatReporter, InventoryReporter
from llmport_agent.session.service import SessionService
from llmport_agent.session.shared import TOKEN_HELP

if TYPE_CHECKING:
    from llmport_agent.ops.diagnostics import Diagnostics

__all__ = ["AgentService", "make_http_client"]


def make_http_client(reactor: Any, config: AgentConfig) -> Any:
    """A treq client for the backend with its own connection pool and TLS policy."""
    from treq.client import HTTPClient
    from twisted.web.client import HTTPConnectionPool

    from llmport_agent.core.twistedapi import quiet_pool_factory
    from llmport_agent.session.endpoints import backend_agent
    from llmport_agent.session.tls import https_policy

    pool = HTTPConnectionPool(reactor, persistent=True)
    quiet_pool_factory(pool)
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
        state_path, note = resolve_state_path(config.state_path)
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
        self.modes = PersistentModes(self.state, on_change=lambda: self.heartbeat.notify_changed())

        from llmport_agent.inventory.collector import InventoryCollector
        from llmport_agent.inventory.monitor import GPUHealthMonitor
        from llmport_agent.inventory.select import make_gpu_source

        # Each blob being fetched writes and hashes at the same time.
        self.hash_pool = PoolService(reactor, "files", 2 * config.model_sync_concurrency + 1)
        #: glibc's malloc_trim, once, on the host pool, after the first inventory report.
        self.heap_trim = HeapTrim(self.host_pool.run)
        # Built (and imported) at the first model sync, as are the workload and Ray handlers
        # at their first command (issue 27: an idle node never imports them).
        self._models: Later[Any] = Later(self._build_models)
        self._workloads: Later[Any] = Later(self._build_workload_manager)
        self._ray: Later[Any] = Later(self._build_ray)
        self._seeding: Later[Any] = Later(self._built_seeding)
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
        self.health: Any = None
        self._seeding_built: Any = None
        self.ray_tokens: Any = None
        self.docker_enabled = docker_enabled
        if docker_enabled:
            self._build_workloads(state_dir)
        self.secrets = NodeSecrets(config, self.state, self.ray_tokens)
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
            on_transition=lambda t: self.refresh.gpu_transition(t),
        )
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
        from llmport_agent.ops.timing import ReactorLatenessProbe

        # Reactor lateness, measured on the heartbeat's ticks (no timer of its own while they run).
        self.lateness = ReactorLatenessProbe(reactor)
        self.heartbeat = HeartbeatReporter(
            reactor, self.session, config.heartbeat_interval_sec, lambda: self.status.heartbeat_fields(),
            on_lateness=self.lateness.observe,
            # The stream's keep-alive ping rides each tick (same wake-up, same write).
            on_tick=self.session.keepalive_tick,
        )
        # Heartbeat fields that change (engine, modes, capabilities; GPU health too) call
        # heartbeat.notify_changed(): the backend hears of it at once, not an interval later.
        self.inventory = InventoryReporter(
            reactor, self.session, config.inventory_interval_sec, self.collector,
            on_report=self._inventory_reported,
        )
        self.refresh = InventoryRefresh(
            reactor, self.outbox, self.heartbeat, self.inventory, self.session, running=lambda: bool(self.running)
        )
        if self.engine is not None:
            self.engine.onAvailability(lambda _available: self.heartbeat.notify_changed())
        registry: dict[str, HandlerSpec] = {}
        registry.update(
            node_handler_specs(self.modes, self.refresh.refresh, self.diagnostics, self._check_system_updates)
        )
        from llmport_agent.models.handler import sync_model_handler_spec

        registry["sync_model"] = sync_model_handler_spec(self._models.calls())
        from llmport_agent.ray.fabric import fabric_handler_specs

        # Fabric probes need no Docker: every node can certify its links.
        registry.update(fabric_handler_specs())
        if docker_enabled:
            from llmport_agent.ray.specs import ray_handler_specs, seeding_handler_specs
            from llmport_agent.workloads.specs import workload_handler_specs

            registry.update(workload_handler_specs(self._workloads.calls(), self._workload_settings))
            registry.update(ray_handler_specs(self._ray.calls()))
            registry.update(seeding_handler_specs(self._seeding.calls()))
        else:
            from llmport_agent.ray.specs import no_ray_status_spec

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
        self.session.subscribe(self.lateness)
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
            from llmport_agent.ops.endpoint import OpsService

            self.ops = OpsService(reactor, self, config.ops_port)
            self._ordered.insert(len(self._ordered) - 1, self.ops)
        from llmport_agent.host.sdnotify import Notifier, NotifyService

        self._ordered.insert(3, self.lateness)
        self.status = NodeStatus(
            config, self.session, self.modes, self.collector, self.gpu_monitor, self.pipeline,
            self.engine, self.health, stopping=lambda: self.drain.stopping, secrets=self.secrets.values,
        )
        # Not a child: it must outlive every other service (watchdog pings while draining).
        self.notify = NotifyService(reactor, Notifier(notify_environ), self.status.status_line)
        self.session.subscribe(self.notify)
        self.recent_errors: list[dict[str, Any]] = []
        self._diagnostics: Diagnostics | None = None  # built at the first collect_diagnostics
        pools = self._ordered[:3]
        # The session starts first: its enrollment request (or its connect) leaves before the
        # other services start, and they start while the backend answers (issue 27: start to
        # connected). They stop in the reverse of _ordered all the same: the session first.
        rest = [svc for svc in self._ordered[3:] if svc is not self.session]
        self.startup = Startup(
            self, pools, [self.session, *rest], config, note or "", self.io_pool, self.instance_lock, self.state,
            self.journal, self.outbox, EnvFileCheck(self.io_pool.run, self.log),
            log_observer=lambda: self.log_observer, adoption=self.adoption, notify=self.notify,
            fatal=self._fatal, log=self.log,
        )
        self.drain = Drain(
            reactor, config.shutdown_grace_sec, self.pipeline, self.notify, self.heartbeat, self.session,
            self.outbox, self.log,
        )
        self.teardown = Teardown(
            reactor, self.drain, self._ordered, pools, self.refresh.cancel, self.adoption, self.notify,
            log_observer=lambda: self.log_observer, loki_pool=lambda: self.loki_pool, state=self.state,
            collector=self.collector, http_pool=self.http_pool, instance_lock=self.instance_lock,
            io_pool=self.io_pool, log=self.log,
        )

    # -- logs to Loki (optional) -------------------------------------------------------------

    def _build_log_shipping(self, state_dir: str) -> None:
        from llmport_agent.logs.wiring import build_log_shipping

        # The host label must equal the host the backend stores for this node.
        shipping = build_log_shipping(
            self.reactor, self.config, state_dir=state_dir, host=self.backend_host,
            secrets=self.secrets.values, engine=self.engine, docker_environ=self._docker_environ,
            adoption=self.adoption,
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
        from twisted.logger import globalLogPublisher

        from llmport_agent.logs.sink import sink_config
        from llmport_agent.logs.wiring import build_log_shipping

        if self.log_shipping is not None or not self.running:
            return
        config, note = sink_config(self.config, url)
        if note:
            self.log.warn("{note}", note=note)
        shipping = build_log_shipping(
            self.reactor, config, state_dir=self._state_dir,
            host=self.backend_host, secrets=self.secrets.values, engine=self.engine,
            docker_environ=self._docker_environ, adoption=self.adoption, backend_sink=True,
        )
        self.log_shipping = shipping
        self.loki, self.loki_pool = shipping.shipper, shipping.http_pool
        self.log_observer, self.journald = shipping.observer, shipping.journald
        if shipping.journald is None:
            self.log.info("The host journal is not shipped to the backend's log sink (the agent's own "
                          "lines and its workloads' are); set LLM_PORT_NODE_AGENT_LOG_JOURNAL_UNITS to "
                          "units to ship (or *), or LLM_PORT_NODE_AGENT_LOKI_URL to a sink of your own")
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

    # -- workloads (optional: the Docker executor) ------------------------------------------

    def _build_workloads(self, state_dir: str) -> None:
        from llmport_agent.workloads.engine import DockerEngine
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
        self.adoption = Adoption(
            self.reactor, self.engine, self.state, c.agent_id,
            container_written=tuple(os.path.abspath(p) for p in (c.model_store, c.ray_session_dir) if p),
        )
        self.health = HealthWatcher(
            self.reactor,
            self.engine,
            settings,
            self._emit_event,
            adoption=self.adoption,
        )
        self._workload_settings = settings
        from llmport_agent.ray.token import ClusterTokens

        # Built now: the secrets list reads them (the Ray manager that uses them comes later).
        self.ray_tokens = ClusterTokens(
            self.reactor, self.backend, lambda: self.session.credential(), self.io_pool,
            c.ray_token_dir, timeout=c.request_timeout_sec,
        )

    def _build_workload_manager(self) -> Any:
        """The workload command handlers (at the first workload or Ray command)."""
        from llmport_agent.workloads.handlers import WorkloadManager

        return WorkloadManager(
            self.reactor,
            self.engine,
            self._workload_settings,
            http=self.http,
            backend_url=self.config.backend_url,
            credential=lambda: self.session.credential(),
            sync_model=lambda model_sync, progress: Deferred.fromCoroutine(
                self.models.sync(model_sync, progress)
            ),
            profile=lambda: self.modes.profile,
            health=self.health,
            gpus=lambda: self.collector.last_gpu if self.collector.last_report is not None else None,
            adoption=self.adoption,
        )

    def _build_models(self) -> Any:
        """The model syncer (at the first model sync)."""
        from llmport_agent.models.syncer import ModelSyncer

        c = self.config
        return ModelSyncer(
            self.reactor,
            self.http,
            self.hash_pool,
            store_dir=c.model_store,
            backend_url=c.backend_url,
            credential=lambda: self.session.credential(),
            concurrency=c.model_sync_concurrency,
            connections=c.model_sync_connections,
            segment_size=c.model_sync_segment_mb * 1024 * 1024,
            buffer_bytes=c.model_sync_buffer_mb * 1024 * 1024,
        )

    @property
    def models(self) -> Any:
        """The model syncer (built now if no command built it yet)."""
        return self._models.get()

    def models_if_built(self) -> Any:
        """The model syncer if a command built it, else C{None} (builds nothing: for readers
        such as the metrics, which must not build the model-sync stack at a scrape)."""
        return self._models.if_built()

    @property
    def workloads(self) -> Any:
        """The workload manager (built now if no command built it yet); C{None} without Docker."""
        return self._workloads.get() if self.docker_enabled else None

    @property
    def ray(self) -> Any:
        """The Ray manager (built now if no command built it yet); C{None} without Docker."""
        return self._ray.get() if self.docker_enabled else None

    @property
    def seeding(self) -> Any:
        """The runtime image seeding (built with the Ray manager); C{None} without Docker."""
        return self._seeding.get() if self.docker_enabled else None

    def _build_ray(self) -> Any:
        """
        Multi-node inference on Ray (protocol 10.6): the runtime container's commands, and the
        runtime image seeding (at the first Ray or seeding command).
        """
        from llmport_agent.ray.handlers import RayManager, RaySettings

        c = self.config
        roots = [c.model_store, *c.ray_allowed_mounts]
        session_dir = c.ray_session_dir
        if session_dir:
            roots.append(session_dir)
        workloads = self._workloads.get()
        ray = RayManager(
            self.reactor,
            self.engine,
            workloads.images,
            self.ray_tokens,
            RaySettings(
                agent_id=c.agent_id,
                allowlist=workloads.allowlist,
                allowed_roots=tuple(os.path.abspath(r) for r in roots),
                token_dir=c.ray_token_dir,
                session_dir=os.path.abspath(session_dir) if session_dir else "",
                model_store=os.path.abspath(c.model_store) if c.model_store else "",
            ),
            self.io_pool,
        )
        from llmport_agent.ray.seeding import ImageSeeding

        self._seeding_built = ImageSeeding(
            self.reactor, self.engine, self.io_pool,
            c.image_download_dir or os.path.join(c.state_dir, "images"), ray,
        )
        ray.peer_loader = self._seeding_built.load_from_peer
        return ray

    def _built_seeding(self) -> Any:
        self._ray.get()
        return self._seeding_built

    def _check_system_updates(self) -> Any:
        """C{check_system_updates} (its module, with Twisted's process helpers, imported then)."""
        from llmport_agent.commands.system_updates import check_system_updates, process_runner

        return check_system_updates(process_runner(self.reactor))

    def _inventory_reported(self) -> None:
        self.heartbeat.notify_changed()
        # Start-up has settled by the first report: its freed heap goes back to the system.
        self.heap_trim.once()

    def _emit_event(self, event_type: str, payload: dict[str, Any], severity: str = "info") -> None:
        self.outbox.emit(event_type, payload, severity)

    def _engine_facts(self) -> dict[str, Any]:
        if self.engine is None:
            return {"docker_available": False, "container_runtime": "none"}
        return dict(self.engine.facts())

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        """True from the first stop request (SIGTERM) on: heartbeats say "draining"."""
        return self.drain.stopping

    def startService(self) -> None:
        # The children are started by the startup, in order, once durable state is loaded.
        self.running = 1
        self.startup.begin()

    def whenStarted(self) -> Deferred[None]:
        """Fires once the start is over (done or failed)."""
        return self.startup.started

    def stopService(self) -> Deferred[None]:
        self.running = 0
        self.drain.begin()
        return self.startup.started.addBoth(lambda _: Deferred.fromCoroutine(self.teardown.stop()))

    def _fatal(self, status: int, message: str) -> None:
        self.exit_status = status
        # Not a "message" field: legacy log observers replace a non-tuple "message" in place.
        # Fields are redacted strictly ("token: mint ..." would lose its words): the agent's own
        # fix hint goes into the format literal, the text around it stays fields.
        head, hint, rest = message.partition(TOKEN_HELP)
        if hint:
            literal = TOKEN_HELP.replace("{", "{{").replace("}", "}}")
            self.log.critical("{reason}" + literal + "{reason_rest}", reason=head, reason_rest=rest)
        else:
            self.log.critical("{reason}", reason=message)
        if self._fatal_cb is not None:
            self._fatal_cb(status, message)

    # -- glue ------------------------------------------------------------------------------

    async def diagnostics(self) -> dict[str, Any]:
        """The C{collect_diagnostics} result: structured, secrets masked."""
        if self._diagnostics is None:
            from llmport_agent.ops.diagnostics import Diagnostics

            self._diagnostics = Diagnostics(
                self.config, self.session, self.modes, self.collector, self.gpu_monitor, self.pipeline,
                self.outbox, self.heartbeat, self.inventory, self.status.heartbeat_fields,
                log_shipping=lambda: self.log_shipping, log_sink=self.log_sink,
                recent_errors=self.recent_errors, engine=self.engine, health=self.health, adoption=self.adoption,
            )
        return await self._diagnostics.collect()

