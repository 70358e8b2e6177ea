"""
The Ray command handlers (protocol 10.6): C{ensure_runtime_image}, C{ensure_ray_runtime},
C{start_ray_head}, C{join_ray_cluster}, C{leave_ray_cluster}, C{stop_ray}, C{get_ray_status},
C{get_ray_serve_status}, C{run_serve_app}, C{delete_serve_app}, C{describe_ray_cluster}.

Every Ray process runs inside the runtime container; the agent execs C{ray start}/C{ray stop}
and the image's helper CLI there. The host never runs Ray (and never C{ray stop}: outside a
container it stops every Ray process of the machine). A command that carries a
C{runtime_bundle} uses that bundle's container and fails when it is not running; one without
uses the agent's runtime container when it runs.

L{RayManager} holds the collaborators; L{ray_handler_specs} gives the command pipeline one
L{HandlerSpec} per command type.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from twisted.internet.defer import DeferredLock
from twisted.logger import Logger

from llmport_agent.core.values import frozen

from ..commands.base import (
    INVALID_COMMAND,
    RUNTIME_ERROR,
    CommandContext,
    CommandFailed,
)
from ..workloads.engine import DockerEngine, StreamClosed, StreamControl
from ..workloads.gpus import GPU_UNAVAILABLE
from ..workloads.images import ImageManager
from ..workloads.policy import AllowEntry, PolicyError, parse_image_ref, parse_port
from . import configdiff, describe, helpercli, imagepin
from . import container as rc
from .bundle import DEFAULT_CONTAINER_NAME, RuntimeBundle, check_layout, filter_env, parse_bundle
from .execs import OUTPUT_LIMIT, ExecResult, exec_in, exec_stream
from .specs import no_ray_status_spec as no_ray_status_spec
from .specs import ray_handler_specs as ray_handler_specs
from .token import ClusterTokens, ensure_dir

DEFAULT_RAY_VERSION = "2.58.0"
#: Ray records the cluster a node last joined here (inside the container).
CURRENT_CLUSTER_FILE = "/tmp/ray/ray_current_cluster"
_START_TIMEOUT = 240.0
_STOP_TIMEOUT = 90.0
_PROBE_TIMEOUT = 20.0
_HELPER_TIMEOUT = 60.0
_SERVE_TIMEOUT = 240.0
_APP_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
_HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")
#: Bytes of JSON the agent hands the helper on stdin (a compiled LLMServingArgs).
_SERVE_DOC_LIMIT = 1024 * 1024
#: Why C{describe_ray_cluster.verify} cannot compare when the inspection program could not
#: run: the runtime image's helper CLI has no verb that returns a running app's C{llm_configs}.
VERIFY_UNAVAILABLE = (
    "not compared: the inspection program could not read the running configuration (see errors), "
    "and the runtime image's helper (cluster-status, serve-status) does not report a running "
    "application's llm_configs"
)
#: The inspection program's time (ray.init and the Serve controller's answers); with the
#: helper's fallback it stays under the command's 120 s.
_DESCRIBE_TIMEOUT = 45.0
_FALLBACK_TIMEOUT = 30.0
MAX_VERIFY_ERRORS = 16
_ALREADY = (
    "already part of a ray cluster",
    "already running",
    "address is already in use",
    "does not match persisted value",
)


@frozen
class RaySettings:
    """
    @ivar allowed_roots: host directories bundle mounts may come from.
    @ivar token_dir: C{RAY_TOKEN_DIR}.
    @ivar session_dir: C{RAY_SESSION_DIR}, mounted at C{/tmp/ray} (none when empty).
    @ivar model_store: C{MODEL_STORE}, which workload containers may write: a bundle mount is
        the store itself, never a path inside it.
    """

    agent_id: str
    allowlist: tuple[AllowEntry, ...]
    allowed_roots: tuple[str, ...]
    token_dir: str
    session_dir: str = ""
    model_store: str = ""


def _payload(ctx: CommandContext) -> dict[str, Any]:
    payload = ctx.command.payload
    if not isinstance(payload, Mapping):
        raise CommandFailed(INVALID_COMMAND, "the payload must be an object")
    return dict(payload)


def _opt_int(payload: Mapping[str, Any], key: str, maximum: int = 100000) -> int | None:
    value = payload.get(key)
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise CommandFailed(INVALID_COMMAND, f"{key} must be a whole number")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer past any float
        raise CommandFailed(INVALID_COMMAND, f"{key} must be a whole number, not {str(value)[:20]!r}") from None
    if not number.is_integer() or not 0 <= number <= maximum:
        raise CommandFailed(INVALID_COMMAND, f"{key} {value!r} must be a whole number from 0 to {maximum}")
    return int(number)


def _port(payload: Mapping[str, Any], key: str, default: int) -> int:
    if payload.get(key) in (None, ""):
        return default
    try:
        return parse_port(payload.get(key), key)
    except PolicyError as exc:
        raise CommandFailed(INVALID_COMMAND, str(exc)) from None


def _ip(value: object, key: str) -> str | None:
    if value is None or value == "":
        return None
    try:
        return str(ipaddress.ip_address(str(value).strip()))
    except ValueError:
        raise CommandFailed(INVALID_COMMAND, f"{key} {str(value)[:60]!r} is not an IP address") from None


def _head_address(value: object) -> str:
    """C{<ip>:<port>}, C{<host>:<port>} or C{[<ipv6>]:<port>}, rebuilt in that form."""
    if not isinstance(value, str) or not value.strip():
        raise CommandFailed(INVALID_COMMAND, "head_address is required (<ip>:<port> of the Ray head)")
    text = value.strip()
    bad = CommandFailed(INVALID_COMMAND, f"head_address {value[:80]!r} must be <ip>:<port> or [<ipv6>]:<port>")
    if text.startswith("["):
        inner, sep, port = text[1:].partition("]:")
        try:
            host = f"[{ipaddress.IPv6Address(inner)}]"
        except ValueError:
            raise bad from None
    else:
        host, sep, port = text.rpartition(":")
        if ":" in host:  # an IPv6 address without brackets: its port cannot be told apart
            raise bad
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            if not _HOST_RE.match(host):
                raise bad from None
    if not sep or not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise bad
    return f"{host}:{int(port)}"


def _app_name(payload: Mapping[str, Any], required: bool = True) -> str | None:
    value = payload.get("app_name")
    if value in (None, "") and not required:
        return None
    if not isinstance(value, str) or not _APP_RE.match(value):
        raise CommandFailed(
            INVALID_COMMAND,
            f"app_name {str(value)[:80]!r} must be letters, digits, '_' and '-' (1 to 128 characters)",
        )
    return value


def _bool(payload: Mapping[str, Any], key: str, default: bool) -> bool:
    value = payload.get(key, default)
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value) if value is not None else default


def _means_already(result: ExecResult) -> bool:
    text = (result.err + result.out).lower()
    return any(s in text for s in _ALREADY)


class RayManager:
    """
    Runs the Ray commands against the runtime container.

    @param images: loads a missing runtime image from the llm-port server (the workloads'
        L{ImageManager}); never a registry pull.
    @param tokens: the cluster token (fetch, file, delete).
    @param pool: runs small file operations (the I/O pool).
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        engine: DockerEngine,
        images: ImageManager,
        tokens: ClusterTokens,
        settings: RaySettings,
        pool: Any,
    ) -> None:
        self._reactor = reactor
        self.engine = engine
        self.images = images
        self.tokens = tokens
        self.settings = settings
        self._pool = pool
        #: Lifecycle commands (start, join, leave, stop) one at a time.
        self._lifecycle = DeferredLock()
        #: The runtime container is created, started or replaced by one command at a time.
        self._container = DeferredLock()
        #: One runtime image load at a time (a second command finds it loaded).
        self._loading = DeferredLock()
        #: Fetches a bundle image from a peer (C{source.peer_url}) and loads it under the given
        #: private name; set by peer seeding.
        self.peer_loader: Callable[[RuntimeBundle, Mapping[str, Any], CommandContext, str], Awaitable[None]] | None = None

    # -- pieces -----------------------------------------------------------------------------

    def bundle(self, payload: Mapping[str, Any], required: bool = False) -> RuntimeBundle | None:
        raw = payload.get("runtime_bundle")
        if raw is None or raw == {}:
            if required:
                raise CommandFailed(
                    INVALID_COMMAND,
                    "runtime_bundle is required: this agent runs Ray only inside the digest-pinned "
                    "runtime container (there is no Ray on the host).",
                )
            return None
        s = self.settings
        check_layout(s.model_store, s.session_dir, s.token_dir)
        bundle = parse_bundle(
            raw,
            allowlist=s.allowlist,
            allowed_roots=s.allowed_roots,
            token_dir=s.token_dir,
            agent_mounts=(rc.SESSION_TARGET,) if s.session_dir else (),
            container_written=(s.session_dir,) if s.session_dir else (),
            workload_written=(s.model_store,) if s.model_store else (),
            agent_sources=tuple(p for p in (s.model_store, s.session_dir) if p),
        )
        for target in bundle.ignored_mounts:
            self.log.info(
                "The runtime bundle's mount at {target} is left out: the agent mounts the Ray session "
                "directory {session_dir} there itself (RAY_SESSION_DIR)",
                target=target, session_dir=self.settings.session_dir,
            )
        return bundle

    async def identify(self, bundle: RuntimeBundle) -> imagepin.PinReport:
        identity = await self.engine.call(
            imagepin.image_identity, bundle.image.canonical, what=f"inspecting image {bundle.image.canonical}"
        )
        return imagepin.check(identity, bundle.digest, bundle.rootfs_digest, bundle.repo_digest)

    async def verify(self, bundle: RuntimeBundle, ctx: CommandContext, fetch: bool = True) -> imagepin.PinReport:
        """
        The verified image, or a failure with the codes of protocol 10.6. With C{fetch} an
        image that is absent or another build is loaded (never pulled from a registry): from
        the peer of C{source.peer_url}, else from the llm-port server. The load goes under a
        private name; only an image that matches the pin is then given the bundle's name.

        @raise CommandFailed: C{runtime_image_missing} / C{runtime_image_mismatch} (without
            C{fetch}, or when what was loaded is another build), C{server_image_mismatch},
            C{image_transfer_failed}, C{transfer_stalled}, C{image_seed_failed}.
        """
        report = await self.identify(bundle)
        name = bundle.image.canonical
        if report.matched_by is not None:
            return report
        if not fetch:
            return imagepin.require_match(report, name, bundle.digest, bundle.rootfs_digest)
        await self._loading.acquire()
        try:
            report = await self.identify(bundle)  # another command may have loaded it meanwhile
            if report.matched_by is not None:
                return report
            loaded = await self._load(bundle, ctx, report)
        finally:
            self._loading.release()
        if loaded.matched_by is None:
            imagepin.require_match(
                loaded, name, bundle.digest, bundle.rootfs_digest,
                why=" (this is the build that was just loaded; it was not given the bundle's name)",
            )
        return imagepin.require_match(await self.identify(bundle), name, bundle.digest, bundle.rootfs_digest)

    async def _load(self, bundle: RuntimeBundle, ctx: CommandContext, before: imagepin.PinReport) -> imagepin.PinReport:
        """Load the pinned image under a private name and adopt it (L{imagepin.adopt})."""
        name = bundle.image.canonical
        ref = bundle.image
        if ref.digest and not ref.tag:
            raise CommandFailed(
                INVALID_COMMAND,
                f"The runtime image {name} names no tag: the agent loads only name:tag images "
                "(from the llm-port server or a peer).",
            )
        payload = ctx.command.payload
        source = payload.get("source") if isinstance(payload, Mapping) else None
        state = "not present" if not before.identity.present else "a different build"
        private = imagepin.private_name()
        try:
            if isinstance(source, Mapping) and source.get("peer_url"):
                if self.peer_loader is None:
                    raise CommandFailed(INVALID_COMMAND, "ensure_runtime_image from a peer is not available on this agent.")
                ctx.progress("peer_download", f"Runtime image {name} is {state} here; fetching it from a peer")
                self.log.info("Runtime image {image} is {state} here; fetching it from a peer", image=name, state=state)
                await self.peer_loader(bundle, source, ctx, private)
            else:
                if self.images is None:
                    raise CommandFailed(
                        "image_transfer_failed", "Image transfer from the llm-port server is not configured on this node.")
                ctx.progress("transfer_image", f"Runtime image {name} is {state} here; loading it from the llm-port server")
                self.log.info("Runtime image {image} is {state} here; loading it from the llm-port server",
                              image=name, state=state)
                await self.images.transfer(
                    ref, lambda msg, **kw: ctx.progress("transfer_image", msg, **kw),
                    expect_id=bundle.digest, expect_rootfs=bundle.rootfs_digest,
                    load_as=parse_image_ref(private),
                )
            return await self.engine.call(
                imagepin.adopt, private, ref.familiar_name, ref.effective_tag, bundle.digest, bundle.rootfs_digest,
                bundle.repo_digest, what=f"verifying the loaded image {name}",
            )
        except BaseException:
            try:
                await self.engine.call(imagepin.drop_name, private, what="removing a private image name")
            except Exception as exc:  # noqa: BLE001 - the load's own failure is the one to report
                self.log.warn("Could not remove the private image name {name}: {why}", name=private, why=exc)
            raise

    async def find_container(self, name: str) -> dict[str, Any] | None:
        return await self.engine.call(rc.find, name, what=f"looking up container {name}")

    async def ensure_container(self, bundle: RuntimeBundle, image_id: str) -> dict[str, Any]:
        """The runtime container running the verified image: reused, started or (re)created."""
        await self._container.acquire()
        try:
            return await self._ensure_container(bundle, image_id)
        finally:
            self._container.release()

    async def _ensure_container(self, bundle: RuntimeBundle, image_id: str) -> dict[str, Any]:
        token_dir = self.settings.token_dir
        snap = await self.find_container(bundle.name)
        if snap is not None:
            if not rc.is_ours(snap, self.settings.agent_id):
                raise rc.foreign(bundle.name)
            reason = rc.drift(snap, bundle, image_id, token_dir, self.settings.session_dir or None)
            if reason is None and snap["running"]:
                if snap.get("restart_policy", rc.RESTART_POLICY) != rc.RESTART_POLICY:
                    await self.engine.call(rc.never_restart, snap["id"], what=f"updating {bundle.name}")
                    self.log.info("The Ray runtime container {name} no longer restarts on its own (restart policy "
                                  "{was!r} -> {now!r})", name=bundle.name, was=snap["restart_policy"],
                                  now=rc.RESTART_POLICY)
                return {"container": bundle.name, "created": False, "running": True}
            # A stopped one is never started: the engine would resolve its mount sources again
            # unchecked. It is created afresh from the bundle, its host paths checked again.
            reason = reason or f"it is {snap['status'] or 'stopped'}; a stopped runtime container is created afresh"
            self.log.info("Recreating the Ray runtime container {name}: {reason}", name=bundle.name, reason=reason)
            await self.engine.call(rc.remove, snap["id"], what=f"removing {bundle.name}")
        if bundle.gpus is not None and bundle.accelerator_vendor == "nvidia" and getattr(self.engine, "kind", "docker") == "podman":
            raise CommandFailed(
                GPU_UNAVAILABLE,
                f"The Ray runtime bundle asks for NVIDIA GPUs ({bundle.gpus}), which this node's Podman "
                "engine cannot give (its Docker-compatible API ignores GPU device requests: Ray would start "
                "without GPUs). Run the Ray runtime on Docker with the NVIDIA Container Toolkit.",
            )
        await self._pool.run(ensure_dir, token_dir)
        if self.settings.session_dir:
            await self._pool.run(rc.ensure_session_dir, self.settings.session_dir)
        args = rc.create_args(bundle, image_id, token_dir, self.settings.agent_id, self.settings.session_dir or None)
        snap = await self.engine.call(rc.create_and_start, args, what=f"creating {bundle.name}")
        self.log.info("Created the Ray runtime container {name} from {image}", name=bundle.name, image=bundle.image.canonical)
        return {"container": bundle.name, "created": True, "running": bool(snap["running"]), "container_id": snap["id"][:12]}

    async def running_container(self, bundle: RuntimeBundle | None) -> dict[str, Any] | None:
        """
        The runtime container to use: the bundle's (which must be running: never a silent
        fallback) or, without a bundle, the agent's default one when it runs (else C{None}).
        """
        name = bundle.name if bundle is not None else DEFAULT_CONTAINER_NAME
        snap = await self.find_container(name)
        ours = snap is not None and rc.is_ours(snap, self.settings.agent_id)
        if ours and snap is not None and snap["running"]:
            return snap
        if bundle is not None:
            state = "does not exist" if snap is None else ("is not this agent's" if not ours else f"is {snap['status']}")
            raise CommandFailed(
                RUNTIME_ERROR,
                f"The Ray runtime container {name} {state}; run ensure_runtime_image / start_ray_head "
                "(or join_ray_cluster) on this node first.",
            )
        return None

    async def exec(
        self,
        name: str,
        argv: list[str],
        *,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        timeout: float = _PROBE_TIMEOUT,
    ) -> ExecResult:
        what = f"running {argv[0]} in {name}"
        if timeout <= _PROBE_TIMEOUT:
            return await self.engine.call(exec_in, name, argv, dict(env or {}), stdin, timeout, what=what)
        # Long execs (ray start/stop, the helper) run on the stream pool, as pulls do: they never
        # hold the short pool's threads, and a cancelled command closes the exec's socket.
        control = StreamControl()
        try:
            return await self.engine.stream(
                exec_stream, control, name, argv, dict(env or {}), stdin, timeout, what=what
            )
        except StreamClosed as exc:
            raise CommandFailed(RUNTIME_ERROR, f"{what} was interrupted ({exc}).") from None

    async def joined_cluster(self, name: str) -> str | None:
        """The cluster address this node last joined, when a raylet runs (else C{None})."""
        marker = await self.exec(name, ["cat", CURRENT_CLUSTER_FILE])
        if marker.exit_code != 0 or not marker.out.strip():
            return None
        raylets = await self.exec(name, ["pgrep", "-c", "raylet"])
        if raylets.exit_code != 0 or not raylets.out.strip().isdigit() or int(raylets.out.strip()) < 1:
            return None
        # The container writes this file: only a well-formed <host>:<port> is believed.
        try:
            return _head_address(marker.out.strip().splitlines()[0][:300])
        except CommandFailed:
            return None

    def start_env(self, payload: Mapping[str, Any]) -> dict[str, str]:
        """C{env} for C{ray start}: the six prefixes, reserved names dropped, token auth on."""
        env = filter_env(payload.get("env"))
        env["RAY_AUTH_MODE"] = "token"
        env["RAY_AUTH_TOKEN_PATH"] = rc.token_file(self.settings.token_dir)
        return env

    async def ray_stop(self, name: str, force: bool = True) -> bool:
        result = await self.exec(name, ["ray", "stop", *(["--force"] if force else [])], timeout=_STOP_TIMEOUT)
        return result.exit_code == 0

    async def prepare(self, bundle: RuntimeBundle, ctx: CommandContext) -> dict[str, Any]:
        """Verified image and running container (start/join)."""
        report = await self.verify(bundle, ctx)
        ctx.progress("ensure_container", f"Ensuring the Ray runtime container {bundle.name}")
        return await self.ensure_container(bundle, report.identity.image_id)

    # -- image and runtime ----------------------------------------------------------------------

    async def ensure_runtime_image(self, ctx: CommandContext) -> dict[str, Any]:
        payload = _payload(ctx)
        bundle = self.bundle(payload, required=True)
        assert bundle is not None
        # fetch: false is the backend's probe: only a verified image succeeds; an absent one or
        # another build is a failed result (runtime_image_missing / runtime_image_mismatch).
        report = await self.verify(bundle, ctx, fetch=_bool(payload, "fetch", True))
        result = report.result(bundle.image.canonical, bundle.runtime_handler)
        if report.matched_by is not None and _bool(payload, "ensure_container", False):
            result.update(await self.ensure_container(bundle, report.identity.image_id))
        return result

    async def ensure_ray_runtime(self, ctx: CommandContext) -> dict[str, Any]:
        payload = _payload(ctx)
        requested = str(payload.get("version") or DEFAULT_RAY_VERSION)[:64]
        bundle = self.bundle(payload)
        if bundle is None:
            return {
                "installed": False, "version": requested, "requested_version": requested,
                "runtime": "none",
                "error": "This agent runs Ray only inside the runtime container of a runtime_bundle; "
                         "the command carried none and there is no Ray on the host.",
            }
        try:
            report = await self.verify(bundle, ctx)
            await self.ensure_container(bundle, report.identity.image_id)
            out = await self.exec(bundle.name, ["ray", "--version"], timeout=60)
        except CommandFailed as exc:
            return {
                "installed": False, "version": requested, "requested_version": requested,
                "runtime": "container", "container": bundle.name, "image": bundle.image.canonical,
                "error_code": exc.error_code, "error": exc.error_message,
            }
        version = None
        m = re.search(r"version\s+([0-9][0-9A-Za-z.+-]{0,40})", out.out)
        if out.exit_code == 0 and m:
            version = m.group(1)
        return {
            "installed": version is not None,
            "version": version or requested,
            "requested_version": requested,
            "version_match": version == requested,
            "runtime": "container",
            "container": bundle.name,
            "image": bundle.image.canonical,
            "image_id": report.identity.image_id,
            "digest_verified": True,
            "serve_llm_available": True,
            **({} if version else {"error": f"ray --version failed in {bundle.name}: {out.detail()}"}),
        }

    # -- head and workers -------------------------------------------------------------------------

    async def start_ray_head(self, ctx: CommandContext) -> dict[str, Any]:
        payload = _payload(ctx)
        port = _port(payload, "port", 6379)
        dashboard_port = _port(payload, "dashboard_port", 8265)
        dashboard_host = _ip(payload.get("dashboard_host") or "127.0.0.1", "dashboard_host") or "127.0.0.1"
        include_dashboard = _bool(payload, "include_dashboard", True)
        node_ip = _ip(payload.get("node_ip_address"), "node_ip_address")
        num_cpus = _opt_int(payload, "num_cpus")
        num_gpus = _opt_int(payload, "num_gpus", 1024)
        bundle = self.bundle(payload, required=True)
        assert bundle is not None
        await self._lifecycle.acquire()
        try:
            ctx.progress("starting_head", f"Starting the Ray head on port {port}")
            await self.tokens.ensure(payload.get("credential_ref"))
            await self.prepare(bundle, ctx)
            target = f"{node_ip}:{port}" if node_ip else None
            joined = await self.joined_cluster(bundle.name)
            already = False
            if joined is not None:
                if target is None or joined == target:
                    already = True
                else:
                    ctx.progress("starting_head", f"This node runs Ray for {joined}; stopping it first")
                    await self.ray_stop(bundle.name)
            if not already:
                argv = ["ray", "start", "--head", f"--port={port}", "--disable-usage-stats"]
                if node_ip:
                    argv.append(f"--node-ip-address={node_ip}")
                if include_dashboard:
                    argv += [f"--dashboard-host={dashboard_host}", f"--dashboard-port={dashboard_port}"]
                else:
                    argv.append("--include-dashboard=false")
                if num_cpus is not None:
                    argv.append(f"--num-cpus={num_cpus}")
                if num_gpus is not None:
                    argv.append(f"--num-gpus={num_gpus}")
                result = await self.exec(bundle.name, argv, env=self.start_env(payload), timeout=_START_TIMEOUT)
                if result.exit_code != 0:
                    if not _means_already(result):
                        raise CommandFailed(
                            RUNTIME_ERROR,
                            f"ray start --head failed in {bundle.name} "
                            f"({'timed out' if result.timed_out else f'exit {result.exit_code}'}): {result.detail()}",
                        )
                    already = True
            host = node_ip or dashboard_host
            address = joined if already and joined else f"{host}:{port}"
            return {
                "started": True,
                "already_running": already,
                "cluster_address": address,
                "head_address": address,
                "dashboard_url": f"http://{node_ip or dashboard_host}:{dashboard_port}" if include_dashboard else None,
                "runtime": "container",
                "container": bundle.name,
            }
        finally:
            self._lifecycle.release()

    async def join_ray_cluster(self, ctx: CommandContext) -> dict[str, Any]:
        payload = _payload(ctx)
        head = _head_address(payload.get("head_address"))
        node_ip = _ip(payload.get("node_ip_address"), "node_ip_address")
        num_cpus = _opt_int(payload, "num_cpus")
        num_gpus = _opt_int(payload, "num_gpus", 1024)
        bundle = self.bundle(payload, required=True)
        assert bundle is not None
        await self._lifecycle.acquire()
        try:
            ctx.progress("joining_cluster", f"Joining the Ray cluster at {head}")
            await self.tokens.ensure(payload.get("credential_ref"))
            await self.prepare(bundle, ctx)
            joined = await self.joined_cluster(bundle.name)
            if joined == head:
                return {"joined": True, "already_member": True, "head_address": head,
                        "runtime": "container", "container": bundle.name}
            if joined is not None:
                ctx.progress("joining_cluster", f"This node runs Ray for {joined}; stopping it first")
                await self.ray_stop(bundle.name)
            argv = ["ray", "start", f"--address={head}", "--disable-usage-stats"]
            if node_ip:
                argv.append(f"--node-ip-address={node_ip}")
            if num_cpus is not None:
                argv.append(f"--num-cpus={num_cpus}")
            if num_gpus is not None:
                argv.append(f"--num-gpus={num_gpus}")
            result = await self.exec(bundle.name, argv, env=self.start_env(payload), timeout=_START_TIMEOUT)
            if result.exit_code != 0 and not _means_already(result):
                raise CommandFailed(
                    RUNTIME_ERROR,
                    f"ray start --address={head} failed in {bundle.name} "
                    f"({'timed out' if result.timed_out else f'exit {result.exit_code}'}): {result.detail()}",
                )
            return {"joined": True, "already_member": False, "head_address": head,
                    "runtime": "container", "container": bundle.name}
        finally:
            self._lifecycle.release()

    async def _stop_and_remove(self, payload: Mapping[str, Any], force: bool) -> dict[str, Any]:
        bundle = self.bundle(payload)
        name = bundle.name if bundle is not None else DEFAULT_CONTAINER_NAME
        snap = await self.find_container(name)
        if snap is None:
            return {"stopped": True, "removed": False, "container": name, "runtime": "container"}
        if not rc.is_ours(snap, self.settings.agent_id):
            raise rc.foreign(name)
        stopped = True
        if snap["running"]:
            stopped = await self.ray_stop(name, force)
        await self.engine.call(rc.remove, snap["id"], what=f"removing {name}")
        return {"stopped": True, "ray_stop_clean": stopped, "removed": True, "container": name, "runtime": "container"}

    async def leave_ray_cluster(self, ctx: CommandContext) -> dict[str, Any]:
        payload = _payload(ctx)
        await self._lifecycle.acquire()
        try:
            ctx.progress("leaving_cluster", "Stopping Ray on this node and removing its runtime container")
            result = {"left": True, **await self._stop_and_remove(payload, True)}
            result["token_deleted"] = await self.tokens.delete()
            return result
        finally:
            self._lifecycle.release()

    async def stop_ray(self, ctx: CommandContext) -> dict[str, Any]:
        payload = _payload(ctx)
        force = _bool(payload, "force", False)
        await self._lifecycle.acquire()
        try:
            ctx.progress("stopping_ray", "Stopping Ray on this node")
            result = await self._stop_and_remove(payload, force)
            result["token_deleted"] = await self.tokens.delete()
            return result
        finally:
            self._lifecycle.release()

    # -- status and Serve ---------------------------------------------------------------------------

    async def _helper(self, name: str, argv: list[str], stdin: bytes | None = None,
                      timeout: float = _HELPER_TIMEOUT) -> tuple[ExecResult, dict[str, Any] | None]:
        result = await self.exec(name, [helpercli.HELPER, *argv], stdin=stdin, timeout=timeout)
        # Up to OUTPUT_LIMIT of the container's words: searched on the pool, not the reactor.
        doc = await self._pool.run(helpercli.first_json_object, result.out)
        if doc is None:
            self.log.warn(
                "The runtime helper {verb} in {name} gave no answer (exit {code}): {detail}",
                verb=argv[0], name=name, code=result.exit_code, detail=result.detail(300),
            )
        return result, doc

    async def _token_best_effort(self, payload: Mapping[str, Any]) -> None:
        if payload.get("credential_ref"):
            try:
                await self.tokens.ensure(payload.get("credential_ref"))
            except CommandFailed as exc:
                self.log.warn("Could not refresh the Ray cluster token: {why}", why=exc.error_message)

    async def status_container(self, bundle: RuntimeBundle | None) -> tuple[dict[str, Any] | None, str]:
        """
        The runtime container a status probe reads, or C{None} and why not (this agent's is
        absent or stopped: no Ray runs here). A container of that name that is not this
        agent's is never read, and with a bundle it is an error (its state cannot be told).
        """
        name = bundle.name if bundle is not None else DEFAULT_CONTAINER_NAME
        snap = await self.find_container(name)
        if snap is None:
            return None, f"the Ray runtime container {name} does not exist on this node"
        if not rc.is_ours(snap, self.settings.agent_id):
            if bundle is not None:
                await self.running_container(bundle)  # raises: "is not this agent's"
            return None, f"the container {name} on this node is not this agent's Ray runtime"
        if not snap["running"]:
            return None, f"the Ray runtime container {name} is {snap['status'] or 'stopped'}, so Ray is not running"
        return snap, name

    async def get_ray_status(self, ctx: CommandContext) -> dict[str, Any]:
        payload = _payload(ctx)
        bundle = self.bundle(payload)
        snap, why = await self.status_container(bundle)
        if snap is None:
            # A fact, not a fallback: no Ray runs on this node. The backend's health check
            # reads a failed probe as "not observed" and restarts nothing, so a head whose
            # runtime container is gone or stopped (a reboot: it never restarts on its own)
            # must answer alive: false to be re-formed.
            return helpercli.dead_cluster(detail=why, runtime="container",
                                          container=bundle.name if bundle is not None else DEFAULT_CONTAINER_NAME)
        await self._token_best_effort(payload)
        _, doc = await self._helper(snap["name"], ["cluster-status"])
        expected = payload.get("expected_version")
        # Ray's node records, passed through bounded: copied on the pool, not the reactor.
        status = await self._pool.run(helpercli.cluster_status, doc, str(expected)[:64] if expected else None)
        # Which tiers answered (the backend parses it into its cluster status, as the original's).
        capabilities: dict[str, bool] = {}
        if _bool(payload, "include_serve", True) and status["alive"]:
            _, serve_doc = await self._helper(snap["name"], ["serve-status"])
            status["serve"] = helpercli.serve_status(serve_doc, None)
            capabilities["serve"] = bool(status["serve"]["available"])
        if _bool(payload, "include_metrics", False) and status["alive"]:
            found = await self.exec(snap["name"], ["cat", helpercli.METRICS_DISCOVERY_FILE])
            status["metrics"] = helpercli.metrics_targets(found.out if found.exit_code == 0 else "")
            capabilities["metrics"] = bool(status["metrics"]["enabled"])
        if _bool(payload, "include_state", False):
            status["state"] = {"available": False, "detail": "the state API is not offered by the runtime helper"}
            capabilities["state"] = False
        status["capabilities"] = capabilities
        status["runtime"] = "container"
        status["container"] = snap["name"]
        return status

    async def get_ray_serve_status(self, ctx: CommandContext) -> dict[str, Any]:
        payload = _payload(ctx)
        app = _app_name(payload, required=False)
        bundle = self.bundle(payload)
        snap = await self.running_container(bundle)
        if snap is None:
            return {"available": False, "active": False, "apps": {}, "detail": "no Ray runtime container runs on this node"}
        await self._token_best_effort(payload)
        argv = ["serve-status", *(["--app-name", app] if app else [])]
        _, doc = await self._helper(snap["name"], argv)
        return helpercli.serve_status(doc, app)

    async def run_serve_app(self, ctx: CommandContext) -> dict[str, Any]:
        payload = _payload(ctx)
        app = _app_name(payload)
        assert app is not None
        args = payload.get("llm_serving_args")
        if not isinstance(args, Mapping):
            raise CommandFailed(INVALID_COMMAND, "llm_serving_args must be an object ({llm_configs: [...]})")
        http = payload.get("http_options") or {}
        if not isinstance(http, Mapping):
            raise CommandFailed(INVALID_COMMAND, "http_options must be an object")
        doc: dict[str, Any] = {"llm_serving_args": dict(args), "http_options": dict(http)}
        if payload.get("proxy_location"):
            doc["proxy_location"] = str(payload["proxy_location"])[:64]
        data = json.dumps(doc).encode("utf-8")
        if len(data) > _SERVE_DOC_LIMIT:
            raise CommandFailed(INVALID_COMMAND, f"llm_serving_args is larger than {_SERVE_DOC_LIMIT} bytes")
        bundle = self.bundle(payload)
        snap = await self.running_container(bundle)
        if snap is None:
            raise CommandFailed(RUNTIME_ERROR, "No Ray runtime container runs on this node; start the Ray head first.")
        route = f"/{app}"
        ctx.progress("deploying_app", f"Deploying Serve application {app} at {route}")
        result, answer = await self._helper(
            snap["name"], ["run-serve-app", "--app-name", app, "--route-prefix", route, "--config", "-"],
            stdin=data, timeout=_SERVE_TIMEOUT,
        )
        if not answer or not answer.get("deployed"):
            why = (answer or {}).get("error") if isinstance(answer, dict) else None
            raise CommandFailed(
                RUNTIME_ERROR,
                f"run_serve_app {app} failed in {snap['name']} (exit {result.exit_code}): "
                f"{str(why)[:600] if why else result.detail() or 'no answer from the runtime helper'}",
            )
        prefix = answer.get("route_prefix")
        return {"deployed": True, "app_name": app,
                "route_prefix": prefix if isinstance(prefix, str) and prefix.startswith("/") else route}

    async def delete_serve_app(self, ctx: CommandContext) -> dict[str, Any]:
        payload = _payload(ctx)
        app = _app_name(payload)
        assert app is not None
        bundle = self.bundle(payload)
        snap = await self.running_container(bundle)
        if snap is None:
            return {"deleted": True, "app_name": app, "detail": "no Ray runtime container runs on this node"}
        result, answer = await self._helper(snap["name"], ["delete-serve-app", "--app-name", app])
        if not answer or not answer.get("deleted"):
            why = (answer or {}).get("error") if isinstance(answer, dict) else None
            raise CommandFailed(
                RUNTIME_ERROR,
                f"delete_serve_app {app} failed in {snap['name']} (exit {result.exit_code}): "
                f"{str(why)[:600] if why else result.detail() or 'no answer from the runtime helper'}",
            )
        return {"deleted": True, "app_name": app}

    async def describe_ray_cluster(self, ctx: CommandContext) -> dict[str, Any]:
        """
        The running cluster as Ray itself reports it (the inspection program, L{describe}),
        for a backend taking it over: members, Serve, each app's C{llm_configs} and, per
        candidate in C{verify}, whether it is what runs (compared here, L{configdiff}).
        When the program cannot run, the helper CLI answers what it can (no configurations).
        """
        payload = _payload(ctx)
        raw_verify = payload.get("verify")
        if raw_verify is not None and not isinstance(raw_verify, Mapping):
            raise CommandFailed(INVALID_COMMAND, "verify must be an object: {<app name>: {llm_configs: [...]}}")
        wanted = describe.candidates(raw_verify)
        snap = await self.find_container(DEFAULT_CONTAINER_NAME)
        if snap is None or not rc.is_ours(snap, self.settings.agent_id) or not snap["running"]:
            # The backend's takeover shows C{error} for a machine that could not describe its cluster.
            return {"running": False, "container": rc.facts(snap) if snap is not None else None, "attached": False,
                    "error": f"No Ray runtime container of this agent runs on this node ({DEFAULT_CONTAINER_NAME})."}
        # Read first: the log scrubber then knows a token written before a restart, and what the
        # container prints (it can read the token file) is cleared of it below.
        token = await self.tokens.read()
        errors: list[str] = []
        inspection = await self._inspect(snap["name"], errors)
        if inspection is not None and inspection.ray_importable:
            result = self._described(snap, inspection, errors)
            apps = {app.name: app for app in inspection.apps}
        else:
            result = await self._described_by_helper(snap, errors)
            apps = {}
        listed = set()
        for entry in result["apps"]:
            listed.add(entry["name"])
            if entry["name"] in wanted:
                entry["verify"] = await self._verify(entry["name"], apps.get(entry["name"]), wanted[entry["name"]])
        for name in sorted(set(wanted) - listed)[:MAX_VERIFY_ERRORS]:
            errors.append(f"verify: no application named {name} runs on this cluster")
        if not result["attached"]:
            # What the backend's takeover shows (it reads C{error}, not C{errors}).
            result["error"] = ("Ray in the runtime container could not be reached: "
                               f"{'; '.join(errors)[:600] or 'no reason was given'}")
        result = await self._pool.run(describe.without_secrets, result, [*self.tokens.secrets(), token or ""])
        if _bool(payload, "hand_over_token", False) and result["attached"]:
            if token:
                # The sealed hand-over (protocol 10.6): the backend encrypts it on arrival.
                # Sent from memory: the journal file never holds it (journal.RESULT_SECRET_FIELDS).
                result["cluster_token"] = token
            else:
                result["token_error"] = "the cluster token file is missing or empty"
        return result

    async def _inspect(self, name: str, errors: list[str]) -> describe.Inspection | None:
        """The inspection program's report, or C{None} (and why, in C{errors})."""
        try:
            source = await self._pool.run(describe.program)
        except OSError as exc:
            errors.append(f"the inspection program is missing from this agent's installation ({exc}); reinstall "
                          "the agent. Described with the runtime helper instead, which reports no llm_configs.")
            self.log.warn("describe_ray_cluster: {why}", why=errors[-1])
            return None
        nonce = describe.new_nonce()
        result = await self.exec(name, list(describe.ARGV), env=describe.program_env(nonce), stdin=source,
                                 timeout=_DESCRIBE_TIMEOUT)
        try:
            # Up to OUTPUT_LIMIT of the container's words: parsed on the pool, not the reactor.
            inspection = await self._pool.run(describe.parse_output, result.stdout, nonce)
        except describe.BadOutput as exc:
            how = f"timed out after {_DESCRIBE_TIMEOUT:.0f} s" if result.timed_out else f"exit {result.exit_code}"
            if result.truncated:
                how += f", output cut at {OUTPUT_LIMIT} bytes"
            errors.append(
                f"the inspection program ({' '.join(describe.ARGV)}) gave no usable answer in {name} ({how}): {exc}"
                f"{'; ' + result.detail(300) if result.detail(300) else ''}. Described with the runtime helper "
                "instead, which reports no llm_configs."
            )
            self.log.warn("describe_ray_cluster: {why}", why=errors[-1])
            return None
        if not inspection.ray_importable:
            errors.append(
                f"python3 in {name} cannot import ray ({'; '.join(inspection.errors)[:300]}). Described with "
                "the runtime helper instead, which reports no llm_configs."
            )
            return inspection
        errors.extend(inspection.errors)
        return inspection

    def _described(self, snap: dict[str, Any], found: describe.Inspection, errors: list[str]) -> dict[str, Any]:
        apps = []
        for app in found.apps:
            entry: dict[str, Any] = {
                "name": app.name, "route_prefix": app.route_prefix, "status": app.status,
                "message": app.message, "deployments": list(app.deployments),
                "llm_configs": list(app.llm_configs),
            }
            if app.errors:
                entry["errors"] = list(app.errors)
            apps.append(entry)
        return {
            "running": True,
            "container": rc.facts(snap),
            "attached": found.attached,
            "ray_version": found.ray_version,
            "gcs_address": found.gcs_address,
            "nodes": list(found.nodes),
            "serve": {"running": found.serve_running, "http_options": found.http_options},
            "apps": apps,
            "errors": errors,
            "source": "ray",
        }

    async def _described_by_helper(self, snap: dict[str, Any], errors: list[str]) -> dict[str, Any]:
        _, doc = await self._helper(snap["name"], ["cluster-status"], timeout=_FALLBACK_TIMEOUT)
        status = await self._pool.run(helpercli.cluster_status, doc, None)
        _, serve_doc = await self._helper(snap["name"], ["serve-status"], timeout=_FALLBACK_TIMEOUT)
        serve = helpercli.serve_status(serve_doc, None)
        if serve.get("detail"):
            errors.append(str(serve["detail"]))
        apps = []
        for name, app in serve["apps"].items():
            deployments = [
                {"name": dep_name, "status": dep["status"], "message": dep["message"],
                 "running_replicas": dep["num_replicas_ready"], "num_replicas_ready": dep["num_replicas_ready"],
                 "num_replicas_pending": dep["num_replicas_pending"]}
                for dep_name, dep in app["deployments"].items()
            ]
            apps.append({"name": name, "route_prefix": app.get("route_prefix") or f"/{name}",
                         "status": app["status"], "message": app["message"], "deployments": deployments,
                         "llm_configs": None})
        nodes = [{**n, "ip": n["node_ip"], "hostname": None} for n in status["nodes"]]
        return {
            "running": True,
            "container": rc.facts(snap),
            "attached": bool(status["alive"]),
            "ray_version": status["version"],
            "gcs_address": status["cluster_address"],
            "nodes": nodes,
            "serve": {"running": bool(serve["available"]), "http_options": None},
            "apps": apps,
            "errors": errors,
            "source": "helper",
        }

    async def _verify(self, name: str, app: describe.App | None, candidate: Any) -> dict[str, Any]:
        """One C{verify} answer: compared here, or C{equal: null} with the reason."""
        def unknown(why: str) -> dict[str, Any]:
            # C{error} is what the backend's takeover shows for an answer that is not C{equal}.
            return {"equal": None, "diff": None, "explanation": why, "error": why}

        if isinstance(candidate, str):
            return unknown(f"not compared: {candidate}")
        if app is None:
            return unknown(VERIFY_UNAVAILABLE)
        if not app.ours:
            return unknown(f"not compared: {name} was not deployed by llm-port (its name does not start with "
                           f"{describe.APP_PREFIX}), so its configuration is not read")
        if app.errors:
            return unknown(f"not compared: the running configuration could not be read completely ({app.errors[0]})")
        comparison = await self._pool.run(configdiff.compare, list(app.llm_configs), candidate, app.defaults)
        answer = comparison.as_result()
        if comparison.equal is None and comparison.explanation:
            answer["error"] = comparison.explanation
        return answer
