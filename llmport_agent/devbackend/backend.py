"""
L{DevBackend}: an in-process stand-in of the llm-port backend's node-facing side.

One twisted.web L{Site} serves HTTP and the WebSocket stream on one port, optionally under a
base path and over TLS. Built from C{protocol.md} alone, quirks included; used by the
agent's tests, its C{demo} command and C{llmport-agent devbackend}.

All methods must be called on the reactor thread.
"""

from __future__ import annotations

import copy
import importlib
import secrets
import uuid
from collections import deque
from collections.abc import Callable
from types import ModuleType
from typing import Any, cast

from autobahn.twisted.resource import WebSocketResource
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.task import LoopingCall, deferLater
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from llmport_agent.core.threads import BlockingRunner, PoolService
from llmport_agent.core.values import define, frozen
from llmport_agent.devbackend._http import (
    ClusterSecretResource,
    DevApiResource,
    EnrollResource,
    ImageFetch,
    ImageSaveResource,
    JsonResource,
    LogSinkResource,
    RotateResource,
    TokensResource,
)
from llmport_agent.devbackend._state import (
    GENERATION_CURRENT,
    REAPER_INTERVAL_SEC,
    TERMINAL,
    AuthError,
    BackendState,
)
from llmport_agent.devbackend._stream import StreamFactory, StreamProtocol
from llmport_agent.devbackend.runtimes import ACTIONS, Provider, Runtime, build_payload
from llmport_agent.devbackend.tls import TLSFiles

#: Where the stream lives below the base path.
STREAM_PATH = "/api/admin/system/nodes/stream"

_MODELFILES = "llmport_agent.devbackend.modelfiles"


@define
class Faults:
    """
    Fault knobs, changeable at any time.

    @ivar lose_rotate_reply: rotation revokes the old credential and issues a new one, then
        aborts the TCP connection without answering (stays on until reset).
    @ivar idle_timeout: seconds without a text frame before a stream is closed with 4408
        (read when the timer is re-armed, i.e. at each frame).
    @ivar image_abort_after: cut image downloads (TCP close) after this many bytes.
    @ivar stream_deny_status: refuse every stream upgrade with this HTTP status.
    @ivar hold_commands: never send commands (neither in C{hello_ack} nor in replies).
    @ivar hang_enroll: accept enrollment requests and never answer them (a backend that
        hangs; C{enroll_requests} counts them).
    """

    lose_rotate_reply: bool = False
    idle_timeout: float = 120.0
    image_abort_after: int | None = None
    stream_deny_status: int | None = None
    hold_commands: bool = False
    hang_enroll: bool = False


@frozen
class ImageEntry:
    """
    A registered C{docker save} tar.

    @ivar image_id: the image's config id (C{sha256:...}); with it the current generation
        serves the tar as its one-time export (Content-Length, Range, C{X-Image-Id}), without
        it (no room to export) it streams like the April one.
    @ivar rootfs_digest: C{sha256:} of the RootFS diff ids joined by newlines (the pin).
    """

    name: str
    tag: str
    tar_path: str
    image_size: int | None
    image_id: str | None = None
    rootfs_digest: str | None = None


@define
class ClusterSecret:
    """A Ray cluster token, the node ids allowed to fetch it, and how often they did."""

    token: str
    members: set[str]
    fetches: int = 0


class _TrackedConnection(ProtocolWrapper):
    """A connection of the site whose end can be awaited."""

    def __init__(self, factory: Any, wrappedProtocol: Any) -> None:
        super().__init__(factory, wrappedProtocol)
        self.lost: Deferred[None] = Deferred()

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        try:
            super().connectionLost(reason)
        finally:
            self.lost.callback(None)


class _ConnectionTracker(WrappingFactory):
    protocol = _TrackedConnection
    noisy = False


def _load_modelfiles() -> ModuleType | None:
    try:
        return importlib.import_module(_MODELFILES)
    except ModuleNotFoundError as e:
        if e.name == _MODELFILES:
            return None
        raise


def _put(parent: Resource, name: bytes, child: Any) -> None:
    # putChild is typed with IResource, which mypy cannot match without mypy-zope.
    parent.putChild(name, child)


def _normalize_base(base_path: str) -> str:
    parts = [p for p in base_path.split("/") if p]
    return "".join(f"/{p}" for p in parts)


class DevBackend:
    """
    The stand-in backend.

    @ivar faults: the L{Faults} knobs.
    @ivar state: the tables (L{BackendState}); prefer the query methods below.
    @ivar frame_hook: called as C{hook(node_id, frame)} for every accepted inbound frame,
        after the frame was processed and before any C{commands} reply (so a hook that cuts
        the link prevents that reply).
    @ivar inbound_filter: called as C{filter(node_id, frame)} after the C{seq} check;
        returning C{False} discards the frame as if lost on the wire (not processed, no
        dispatch).
    @ivar keep_frames: keep a copy of every inbound frame (L{frames}); a fleet benchmark
        turns it off (the cost counters, L{costs}, count either way).
    @ivar models: the model repository served under C{api/node-files/models/} when
        C{llmport_agent.devbackend.modelfiles} exists, else C{None}.
    @ivar generation: C{"current"} (default; protocol 10: push, re-dispatch, stream-lost
        failures, reapers) or C{"2026-04"} (sections 1-9 only).
    @ivar reaper_scale: multiplies the current generation's reaper constants (the 300 s
        silence floor, the 600 s offline grace, the 300 s stale session and the 60 s sweep
        interval), so tests can run them in seconds; never a command's C{timeout_sec}.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        *,
        idle_timeout: float = 120.0,
        token_ttl: float = 1800.0,
        base_path: str = "",
        clock: Any = None,
        admin_token: str | None = None,
        runner: BlockingRunner | None = None,
        models: Any = None,
        keep_frames: bool = True,
        generation: str = GENERATION_CURRENT,
        reaper_scale: float = 1.0,
        log_sink_url: str | None = None,
    ) -> None:
        self.reactor = reactor
        #: What C{GET /api/node-files/log-sink} names (protocol 10.7); C{None}: 404, no sink.
        self.log_sink_url = log_sink_url
        self.log_sink_requests = 0
        # An IReactorTime (seconds, callLater): idle timers, reaper sweeps and timestamps.
        self.clock: Any = clock if clock is not None else reactor
        self.faults = Faults(idle_timeout=idle_timeout)
        self.state = BackendState(
            self.clock,
            token_ttl,
            keep_frames=keep_frames,
            generation=generation,
            reaper_scale=reaper_scale,
        )
        self.state.wake = self._wake
        # Nodes woken while no stream of theirs was open (the real per-node event stays set).
        self._pending_wakes: set[str] = set()
        self._sweeper: LoopingCall | None = None
        self.base_path = _normalize_base(base_path)
        self.admin_token = admin_token
        self.images: dict[str, ImageEntry] = {}
        self.frame_hook: Callable[[str, dict[str, Any]], None] | None = None
        self.inbound_filter: Callable[[str, dict[str, Any]], bool] | None = None
        self._streams: dict[str, set[StreamProtocol]] = {}
        #: (node id, close code) of every stream that closed, the last 1,000 (tests read it:
        #: a clean stop of the agent closes with 1000; a dropped connection has no code).
        self.stream_closes: deque[tuple[str | None, int | None]] = deque(maxlen=1000)
        self._pool: PoolService | None = None
        if runner is None:
            self._pool = PoolService(reactor, "devbackend", 4)
            runner = self._pool
        self.runner: BlockingRunner = runner
        self._modelfiles = _load_modelfiles()
        self.models: Any = models
        if self.models is None and self._modelfiles is not None:
            self.models = self._modelfiles.ModelRepository()
        self._port: Any = None
        self._tracker: _ConnectionTracker | None = None
        self._scheme = "http"
        self._interface = "127.0.0.1"
        self._inflight: set[Deferred[Any]] = set()
        #: The image-save route as the current generation has it (protocol 10.4): C{expect_id}
        #: / C{expect_rootfs} checked (409), and an entry with an image id served as an export
        #: (Content-Length, Range, X-Image-Id). C{False} (the April generation): the route
        #: ignores the pins and always streams with X-Image-Size.
        self.image_route_current = generation == GENERATION_CURRENT
        #: Runtimes created through L{create_runtime} (the backend's runtime API), by id.
        self.runtime_defs: dict[str, Runtime] = {}
        #: Enrollment requests received (answered or, with C{faults.hang_enroll}, not).
        self.enroll_requests = 0
        from .onboarding import Onboarding

        #: Join requests and whoami (protocol 10.7): served by the current generation only (the
        #: April one answers 404 Not Found); C{onboarding.enabled} switches them alone.
        self.onboarding = Onboarding(self, enabled=generation == GENERATION_CURRENT)
        #: Ray cluster tokens by credential_ref (protocol 10.6), see L{add_cluster_secret}.
        self.cluster_secrets: dict[str, ClusterSecret] = {}
        #: Ray environments driven through the dev admin API, by id (L{start_ray_environment}).
        self.ray_environments: dict[str, Any] = {}
        #: Every answer of the image-save route that sent the tar (L{ImageFetch}), in order:
        #: which node fetched what and how much of it.
        self.image_fetches: list[ImageFetch] = []
        # Deferreds waiting for a command to be terminal (L{when_terminal}), by command id.
        self._terminal_waiters: dict[str, list[Deferred[dict[str, Any]]]] = {}
        self.state.finished = self._command_finished

    # -- serving ----------------------------------------------------------------------------

    def resource(self) -> Resource:
        """The root resource (base path included)."""
        app = JsonResource()
        api = JsonResource()
        _put(app, b"api", api)
        admin = JsonResource()
        _put(api, b"admin", admin)
        system = JsonResource()
        _put(admin, b"system", system)
        nodes = JsonResource()
        _put(system, b"nodes", nodes)
        _put(nodes, b"enrollment-tokens", TokensResource(self))
        _put(nodes, b"enroll", EnrollResource(self))
        credentials = JsonResource()
        _put(nodes, b"credentials", credentials)
        _put(credentials, b"rotate", RotateResource(self))
        _put(nodes, b"stream", WebSocketResource(StreamFactory(self)))
        _put(nodes, b"secrets", ClusterSecretResource(self))
        node_files = JsonResource()
        _put(api, b"node-files", node_files)
        images = JsonResource()
        _put(node_files, b"images", images)
        _put(images, b"save", ImageSaveResource(self))
        _put(node_files, b"log-sink", LogSinkResource(self))
        from .onboarding import install as install_onboarding

        install_onboarding(self.onboarding, nodes, node_files)
        if self._modelfiles is not None and self.models is not None:
            models = self._modelfiles.model_files_resource(self.models, self.authorize_node)
            _put(node_files, b"models", models)
        _put(app, b"dev", DevApiResource(self))
        root: JsonResource = app
        for segment in reversed([p for p in self.base_path.split("/") if p]):
            parent = JsonResource()
            _put(parent, segment.encode("utf-8"), root)
            root = parent
        return root

    def authorize_node(self, request: Request) -> bool:
        """True when C{request} carries a valid C{Bearer <credential>} header."""
        value = request.getHeader(b"authorization")
        header = value.decode("latin-1") if isinstance(value, bytes) else value
        try:
            self.state.authenticate(header)
        except AuthError:
            return False
        return True

    def listen(
        self,
        port: int = 0,
        interface: str = "127.0.0.1",
        tls: TLSFiles | None = None,
        client_ca: str | None = None,
    ) -> Deferred[int]:
        """
        Start serving; fires with the bound port number.

        @param client_ca: with C{tls}, a PEM file of CAs: every connection must then present a
            client certificate issued by one of them (mTLS), as a backend behind such a proxy.
        """
        return Deferred.fromCoroutine(self._listen(port, interface, tls, client_ca))

    @property
    def generation(self) -> str:
        return self.state.generation

    @property
    def reaper_scale(self) -> float:
        return self.state.reaper_scale

    def _start_sweeper(self) -> None:
        if not self.state.current or self._sweeper is not None:
            return
        sweeper = LoopingCall(self._sweep_logged)
        sweeper.clock = self.clock
        self._sweeper = sweeper
        sweeper.start(REAPER_INTERVAL_SEC * self.state.reaper_scale, now=False)

    def _sweep_logged(self) -> None:
        try:
            self.state.sweep()
        except Exception:
            # A bug in a sweep must not stop the next ones.
            self.log.failure("devbackend: reaper sweep failed")

    def _stop_sweeper(self) -> None:
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None and sweeper.running:
            sweeper.stop()

    def sweep(self) -> None:
        """Run the current generation's reapers once now (they also run every 60 s x scale)."""
        self.state.sweep()

    async def _listen(self, port: int, interface: str, tls: TLSFiles | None, client_ca: str | None = None) -> int:
        if self._port is not None:
            raise RuntimeError("DevBackend is already listening")
        if self._pool is not None and not self._pool.running:
            self._pool.startService()
        site = Site(self.resource(), reactor=self.reactor)
        site.displayTracebacks = False
        site.noisy = False
        factory: Any = site
        if tls is not None:
            from twisted.internet.ssl import PrivateCertificate
            from twisted.protocols.tls import TLSMemoryBIOFactory

            def _read() -> bytes:
                with open(tls.cert_pem, "rb") as c, open(tls.key_pem, "rb") as k:
                    return c.read() + b"\n" + k.read()

            pem = await self.runner.run(_read)
            authorities = []
            if client_ca is not None:
                from twisted.internet.ssl import Certificate

                def _read_ca() -> bytes:
                    with open(client_ca, "rb") as f:
                        return f.read()

                authorities.append(Certificate.loadPEM(await self.runner.run(_read_ca)))
            # With authorities: a client certificate issued by one of them is required.
            options = PrivateCertificate.loadPEM(pem).options(*authorities)
            # TLS inside the tracker, so that the HTTP channel's transport is the TLS
            # protocol itself (Autobahn reads TLS details from it).
            factory = TLSMemoryBIOFactory(options, False, cast(Any, site))
            self._scheme = "https"
        else:
            self._scheme = "http"
        tracker = _ConnectionTracker(factory)
        listening = self.reactor.listenTCP(port, tracker, interface=interface)
        self._port = listening
        self._start_sweeper()
        self._tracker = tracker
        self._interface = interface
        bound = int(listening.getHost().port)
        self.log.info("devbackend listening on {url}", url=self.url)
        return bound

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("DevBackend is not listening")
        return int(self._port.getHost().port)

    @property
    def url(self) -> str:
        """The backend URL agents use, e.g. C{http://127.0.0.1:PORT/base}."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(
            self._interface, self._interface
        )
        shown = f"[{host}]" if ":" in host else host
        return f"{self._scheme}://{shown}:{self.port}{self.base_path}"

    @property
    def stream_url(self) -> str:
        """The WebSocket URL of the stream (C{ws://} or C{wss://})."""
        return "ws" + self.url[len("http") :] + STREAM_PATH

    def track(self, d: Deferred[Any]) -> None:
        """Keep C{d} (a response being streamed) until it fires; L{stop} waits for it."""
        self._inflight.add(d)

        def _done(result: Any) -> Any:
            self._inflight.discard(d)
            return result

        d.addBoth(_done)

    def stop(self) -> Deferred[None]:
        """
        Stop listening, close every stream (code 1000) and every HTTP connection, wait until
        all are gone (aborting stragglers), then stop the file thread pool.
        """
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        self._stop_sweeper()
        for env in self.ray_environments.values():
            env.stop()
        port, self._port = self._port, None
        if port is not None:
            await port.stopListening()
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            connections = list(tracker.protocols)
            for conn in connections:
                inner = conn.wrappedProtocol
                while isinstance(inner, ProtocolWrapper):
                    inner = inner.wrappedProtocol
                if isinstance(inner, StreamProtocol):
                    inner.close(1000, "Server shutting down")
                else:
                    conn.loseConnection()
            waiting: Deferred[Any] = DeferredList([c.lost for c in connections])
            waiting.addTimeout(3, self.reactor)
            try:
                await waiting
            except Exception:
                for conn in connections:
                    if not conn.lost.called:
                        conn.abortConnection()
                await DeferredList([c.lost for c in connections])
        if self._inflight:
            await DeferredList(list(self._inflight), consumeErrors=True)
        if self._pool is not None and self._pool.running:
            await self._pool.stopService()

    # -- stream registry --------------------------------------------------------------------

    def register_stream(self, proto: StreamProtocol) -> None:
        assert proto.node_id is not None
        self._streams.setdefault(proto.node_id, set()).add(proto)

    def unregister_stream(self, proto: StreamProtocol) -> None:
        assert proto.node_id is not None and proto.session_id is not None
        live = self._streams.get(proto.node_id, set())
        live.discard(proto)
        self.state.session_closed(proto.session_id, last=not live)

    def _wake(self, node_id: str) -> None:
        """A command was queued for C{node_id} (current generation): wake its streams."""
        streams = self._streams.get(node_id)
        if not streams:
            self._pending_wakes.add(node_id)
            return
        for proto in list(streams):
            proto.wake()

    def take_pending_wake(self, node_id: str) -> bool:
        """True (once) when C{node_id} was woken while none of its streams was open."""
        if node_id in self._pending_wakes:
            self._pending_wakes.discard(node_id)
            return True
        return False

    def connection_count(self, node_id: str) -> int:
        """How many streams of C{node_id} are open now."""
        return len(self._streams.get(node_id, ()))

    def streams(self, node_id: str) -> list[StreamProtocol]:
        """The open stream protocols of C{node_id} (e.g. to send raw frames in tests)."""
        return list(self._streams.get(node_id, ()))

    def drop_connections(self, node_id: str | None = None, abort: bool = True) -> None:
        """Cut the TCP connections of C{node_id}'s streams (all nodes when C{None})."""
        for nid, protos in list(self._streams.items()):
            if node_id is not None and nid != node_id:
                continue
            for proto in list(protos):
                proto.dropConnection(abort=abort)

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> Deferred[None]:
        """Fire once C{predicate()} is true (polled on the reactor); fail after C{timeout}."""

        async def _poll() -> None:
            deadline = self.reactor.seconds() + timeout
            while not predicate():
                if self.reactor.seconds() >= deadline:
                    raise TimeoutError(f"condition not met within {timeout} seconds")
                await deferLater(self.reactor, 0.01, lambda: None)

        return Deferred.fromCoroutine(_poll())

    # -- admin operations -------------------------------------------------------------------

    def mint_token(self, note: str | None = None) -> dict[str, Any]:
        """An enrollment token: C{{"id", "token", "expires_at", "note"}}."""
        return self.state.mint_token(note)

    def enroll_node(
        self,
        agent_id: str,
        host: str = "127.0.0.1",
        capabilities: dict[str, Any] | None = None,
        version: str | None = "0",
    ) -> dict[str, Any]:
        """Enroll in-process (no HTTP); returns the enroll reply with the credential."""
        token = self.mint_token("in-process")["token"]
        return self.state.enroll(token, agent_id, host, capabilities or {}, version, host)

    def issue_command(
        self,
        node_id: str,
        command_type: str,
        payload: Any,
        *,
        idempotency_key: str | None = None,
        correlation_id: str | None = None,
        timeout_sec: int | None = None,
        raw_override: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """
        Queue a command: the current generation pushes it to the node's open streams at
        once, the April one sends it in reply to the node's next frame. C{raw_override}
        keys replace fields of the wire object (use L{OMIT} to remove one), e.g. to add a
        C{signature}.
        """
        return self.state.issue_command(
            node_id,
            command_type,
            payload,
            idempotency_key=idempotency_key,
            correlation_id=correlation_id,
            timeout_sec=timeout_sec,
            raw_override=raw_override,
        )

    def when_terminal(self, command_id: str) -> Deferred[dict[str, Any]]:
        """
        Fire with the command's record once it is terminal (at once if it is); cancelling
        the Deferred (e.g. C{addTimeout}) stops waiting. C{KeyError} for an unknown id.
        """
        record = self.command(command_id)
        if record["status"] in TERMINAL:
            return succeed(record)
        waiters = self._terminal_waiters.setdefault(command_id, [])

        def _cancel(d: Deferred[dict[str, Any]]) -> None:
            if d in waiters:
                waiters.remove(d)
            if not waiters:
                self._terminal_waiters.pop(command_id, None)

        d: Deferred[dict[str, Any]] = Deferred(_cancel)
        waiters.append(d)
        return d

    def _command_finished(self, command_id: str) -> None:
        for d in self._terminal_waiters.pop(command_id, []):
            d.callback(self.command(command_id))

    def cancel_command(self, command_id: str) -> dict[str, Any]:
        """
        Cancel a command that is not terminal (current generation): it becomes
        C{canceled} and is never dispatched again; the node is not told. C{KeyError} for an
        unknown id, C{ValueError} for a terminal command or on the April generation.
        """
        return self.state.cancel_command(command_id)
    def start_ray_environment(self, body: dict[str, Any]) -> dict[str, Any]:
        """
        Drive a Ray environment up in the background (the newest backend's reconcile, protocol
        10.6; L{llmport_agent.devbackend.rayenv}): C{{head: {node_id, node_ip}, workers: [...],
        runtime_bundle, port?, num_cpus?, env?, seed_port?, id?}}. Its view is
        L{ray_environment}. C{ValueError} for a malformed body or unknown node.
        """
        from llmport_agent.devbackend.rayenv import RayEnvironment, parse_node

        head = parse_node(body.get("head"), "head")
        workers = [parse_node(w, "workers[]") for w in (body.get("workers") or [])]
        for n in (head, *workers):
            if self.node(n.node_id) is None:
                raise ValueError(f"no node {n.node_id}")
        bundle = body.get("runtime_bundle")
        if not isinstance(bundle, dict):
            raise ValueError("runtime_bundle must be an object")
        env_id = str(body.get("id") or "env-" + uuid.uuid4().hex[:8])
        if env_id in self.ray_environments:
            raise ValueError(f"environment {env_id} exists")

        def whole(name: str, default: int | None) -> int | None:
            value = body.get(name, default)
            return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536 else default

        env = RayEnvironment(
            self, env_id, head, workers, bundle,
            port=whole("port", 6379) or 6379,
            num_cpus=whole("num_cpus", None),
            seed_port=whole("seed_port", 8271) or 8271,
            env={str(k): str(v) for k, v in (body.get("env") or {}).items()} if isinstance(body.get("env"), dict) else {},
        )
        self.ray_environments[env_id] = env
        env.want("running")
        return env.view()

    def teardown_ray_environment(self, env_id: str) -> dict[str, Any]:
        """Workers leave, then the head stops (in the background). C{KeyError} when unknown."""
        env = self.ray_environments[env_id]
        env.want("stopped")
        return dict(env.view())

    def retry_ray_environment(self, env_id: str) -> dict[str, Any]:
        """The operator's "try again": the failure and recovery memory forgotten, a pass now."""
        env = self.ray_environments[env_id]
        env.retry_now()
        return dict(env.view())

    def ray_environment(self, env_id: str) -> dict[str, Any] | None:
        env = self.ray_environments.get(env_id)
        return dict(env.view()) if env is not None else None

    def add_cluster_secret(self, credential_ref: str, members: list[str], token: str | None = None) -> str:
        """Register a Ray cluster token served to C{members} (node ids); returns the token."""
        value = token if token is not None else secrets.token_urlsafe(32)
        self.cluster_secrets[credential_ref] = ClusterSecret(value, set(members))
        return value

    def set_profile(self, node_id: str, profile: dict[str, Any] | None) -> None:
        """Assign the flat profile object sent in C{hello_ack}."""
        self.state.set_profile(node_id, profile)

    def add_runtime(
        self,
        runtime_id: str,
        node_id: str | None = None,
        *,
        name: str | None = None,
        status: str = "creating",
        endpoint_url: str | None = None,
    ) -> dict[str, Any]:
        """Create a runtime row (issuing a deploy/start/restart/update also creates one)."""
        return self.state.add_runtime(
            runtime_id, node_id, name=name, status=status, endpoint_url=endpoint_url
        )

    def add_image(
        self,
        name: str,
        tag: str,
        tar_path: str,
        image_size: int | None = None,
        *,
        image_id: str | None = None,
        rootfs_digest: str | None = None,
    ) -> None:
        """Register a C{docker save} tar for C{GET .../images/save?image=name&tag=tag}."""
        self.images[f"{name}:{tag}"] = ImageEntry(
            name, tag, tar_path, image_size, image_id, rootfs_digest
        )

    # -- the runtime API (payloads as the real backend builds them) --------------------------

    def create_runtime(
        self,
        node_id: str,
        provider: Provider | dict[str, Any],
        *,
        name: str = "runtime",
        runtime_id: str | None = None,
        generic_config: dict[str, Any] | None = None,
        model_id: str = "model",
        model_sync: dict[str, Any] | None = None,
        container_name: str | None = None,
    ) -> dict[str, Any]:
        """
        Create a runtime on C{node_id} and issue its C{deploy_workload}, with the payload the
        real backend builds (see L{runtimes}). Returns the command.
        """
        self.state.require_node(node_id)
        prov = provider if isinstance(provider, Provider) else Provider.from_dict(dict(provider))
        runtime = Runtime(
            id=runtime_id or str(uuid.uuid4()),
            name=name,
            node_id=node_id,
            provider=prov,
            model_id=model_id,
            generic_config=dict(generic_config or {}),
            model_sync=model_sync,
            container_name=container_name,
        )
        self.runtime_defs[runtime.id] = runtime
        return self.runtime_action(runtime.id, "deploy")

    def runtime_action(
        self,
        runtime_id: str,
        action: str,
        *,
        provider_changes: dict[str, Any] | None = None,
        generic_config: dict[str, Any] | None = None,
        tail: int = 300,
    ) -> dict[str, Any]:
        """
        Issue C{action} (C{deploy}, C{start}, C{restart}, C{update}, C{stop}, C{remove},
        C{logs}) on a runtime made by L{create_runtime}; C{update} applies the edits first.
        Returns the command. C{KeyError} for an unknown runtime or action.
        """
        runtime = self.runtime_defs[runtime_id]
        command_type = ACTIONS[action]
        if action == "update":
            if provider_changes:
                runtime.provider.changed(provider_changes)
            if generic_config is not None:
                runtime.generic_config = dict(generic_config)
        payload = build_payload(command_type, runtime, tail=tail)
        # The backend's keys: a command of a runtime that is lost after its ack blocks every
        # later command of that kind for that runtime (protocol 3.1).
        key = f"runtime-{action}-{runtime_id}" if action != "logs" else None
        return self.issue_command(runtime.node_id, command_type, payload, idempotency_key=key)

    def revoke_credentials(self, node_id: str) -> None:
        """Revoke every credential of the node (open streams stay open)."""
        self.state.revoke_credentials(node_id)

    def delete_node(self, node_id: str) -> None:
        """
        Delete the node row, as the real backend does while a session is open (protocol 9):
        the open stream's handler fails at its next frame and the connection drops (no close
        frame: the agent sees 1006), and every later upgrade gets HTTP 403 ("Credential node
        no longer exists."). Re-enrolling the same agent id afterwards creates a new node.
        """
        self.state.delete_node(node_id)

    # -- queries (copies) -------------------------------------------------------------------

    def node(self, node_id: str) -> dict[str, Any] | None:
        record = self.state.nodes.get(node_id)
        return record.to_dict() if record is not None else None

    def nodes(self) -> list[dict[str, Any]]:
        return [n.to_dict() for n in self.state.nodes.values()]

    def node_by_agent_id(self, agent_id: str) -> dict[str, Any] | None:
        record = self.state.node_by_agent_id(agent_id)
        return record.to_dict() if record is not None else None

    def node_status_history(self, node_id: str) -> list[str]:
        record = self.state.nodes.get(node_id)
        return list(record.status_history) if record is not None else []

    def command(self, command_id: str) -> dict[str, Any]:
        """The command object; C{KeyError} when unknown."""
        return self.state.commands[command_id].to_dict()

    def commands(self, node_id: str | None = None) -> list[dict[str, Any]]:
        """Commands in issue order, optionally of one node."""
        records = sorted(self.state.commands.values(), key=lambda c: c.order)
        return [c.to_dict() for c in records if node_id is None or c.node_id == node_id]

    def timeline(self, command_id: str) -> list[dict[str, Any]]:
        """Timeline events (issued, dispatched, acked, progress, result) of a command."""
        return copy.deepcopy(self.state.commands[command_id].timeline)

    def status_history(self, command_id: str) -> list[str]:
        """Every status the command went through, in order (regressions included)."""
        return list(self.state.commands[command_id].history)

    def latest_inventory(self, node_id: str) -> dict[str, Any] | None:
        snapshots = self.state.inventories.get(node_id)
        return self.inventories(node_id)[-1] if snapshots else None

    def inventories(self, node_id: str) -> list[dict[str, Any]]:
        return copy.deepcopy(self.state.inventories.get(node_id, []))

    def events(self, node_id: str) -> list[dict[str, Any]]:
        return copy.deepcopy(self.state.events.get(node_id, []))

    def runtime(self, runtime_id: str) -> dict[str, Any] | None:
        record = self.state.runtimes.get(runtime_id)
        return record.to_dict() if record is not None else None

    def runtimes(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self.state.runtimes.values()]

    def frames(self, node_id: str) -> list[dict[str, Any]]:
        """
        Every frame received from the node, in order, each with C{_received_at} and
        C{_accepted} (false for frames dropped by the C{seq} check or the inbound filter).
        """
        return copy.deepcopy(self.state.frames.get(node_id, []))

    def costs(self, node_id: str | None = None) -> dict[str, Any]:
        """
        What the frames received so far would cost the real backend (protocol 3.2), per node
        (C{node_id} given: that node only) and in total: C{frames}, C{offset_writes} (frames
        with C{seq} that passed the check), C{dispatch_queries} (accepted frames: one
        pending-commands query and commit each), C{connects} and C{cpu_ms} (4.4 ms per frame
        with C{seq}, 2.9 ms without). C{at} is the backend clock's time of the reading.
        """
        from llmport_agent.devbackend._state import FrameCost

        if node_id is not None:
            found = self.state.costs.get(node_id, FrameCost())
            return {"at": self.clock.seconds(), "node_id": node_id, **found.to_dict()}
        total = FrameCost()
        nodes = {}
        for nid, cost in self.state.costs.items():
            total.add(cost)
            nodes[nid] = cost.to_dict()
        return {"at": self.clock.seconds(), "total": total.to_dict(), "nodes": nodes}

    def model_availability(self, node_id: str) -> list[dict[str, Any]]:
        """
        The models' availability on the node, as the current backend keeps it from
        C{sync_model} progress (C{syncing}) and results (C{ready} with C{root_path},
        C{revision}, C{manifest_sha256}, C{size_bytes}; or C{failed}).
        """
        rows = self.state.model_availability.get(node_id, {})
        return [copy.deepcopy(row) for _, row in sorted(rows.items())]

    def anomalies(self, node_id: str) -> list[str]:
        """Notes about suspicious frames and dropped connections of the node."""
        return list(self.state.anomalies.get(node_id, []))
