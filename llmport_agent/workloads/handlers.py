"""
The workload command handlers: deploy, start, restart, update (with rollback), stop,
remove and fetch_container_logs, per protocol 4, 4.1 and 4.2.

L{WorkloadManager} holds the collaborators; L{workload_handler_specs} gives the command
pipeline one L{HandlerSpec} per command type.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from twisted.internet import defer
from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from ..commands.base import (
    CONTAINER_NOT_OWNED,
    INVALID_COMMAND,
    RUNTIME_ERROR,
    Command,
    CommandContext,
    CommandFailed,
)
from ..inventory.gpu import GPUSnapshot
from . import containers as ops
from . import exits
from .engine import DockerEngine, EngineError
from .gpus import place_gpus
from .images import PULL_FAILED, PULL_STALLED, ImageManager
from .policy import (
    PolicyError,
    check_container_name,
    check_image,
    check_runtime_id,
    is_blank,
    parse_allowlist,
)
from .ports import PORT_CONFLICT, choose_host_port, port_is_free
from .readiness import (
    LOG_TAIL_LINES,
    ContainerExit,
    ReadinessFailed,
    make_treq_probe,
    probe_url,
    wait_ready,
)
from .servelogs import RAY_CONTAINER, parse_replica, read_serve_logs, serve_app_name
from .settings import WorkloadSettings
from .spec import (
    LABEL_CONTAINER_PORT,
    LABEL_HEALTH_PATH,
    LABEL_HOST_PORT,
    LABEL_IMAGE,
    LABEL_RUNTIME_ID,
    WorkloadSpec,
    build_spec,
    endpoint_url,
    render,
    slug_container_name,
)
from .specs import workload_handler_specs as workload_handler_specs

__all__ = ["WorkloadManager", "workload_handler_specs"]

#: sync_model(model_sync, progress) -> result; progress(message, **extra)
SyncModel = Callable[[dict[str, Any], Callable[..., None]], Awaitable[dict[str, Any]]]

#: The error code of a deploy, start, restart or update whose wait for readiness a stop or
#: remove of the same runtime ended (issue 26): the stop or remove then goes ahead at once.
SUPERSEDED = "superseded"
#: The commands that end a readiness wait of their runtime (L{WorkloadManager.superseding}).
SUPERSEDING = ("stop_workload", "remove_workload")


class _ReadinessWait:
    """
    One readiness wait in flight. C{result} is what the handler awaits: it fires with the
    wait's outcome, or fails at once (C{CancelledError}) when the wait is superseded or the
    handler is cancelled; the probe loop then ends at its next step (L{stopped}), even where a
    cancelled probe reads as "no answer yet".
    """

    def __init__(self) -> None:
        self.by: tuple[str, str] | None = None  # (command type, command id) that superseded it
        self.stopped = False
        self._loop: Deferred[float] | None = None
        self.result: Deferred[float] = Deferred(lambda _: self._stop())

    def run(self, loop: Deferred[float]) -> None:
        self._loop = loop
        loop.addBoth(self._ended)

    def _ended(self, outcome: Any) -> None:
        if not self.result.called:
            if isinstance(outcome, Failure):
                self.result.errback(outcome)
            else:
                self.result.callback(outcome)
        # Otherwise the handler has moved on: the loop's late outcome is dropped.

    def _stop(self) -> None:
        self.stopped = True
        if self._loop is not None and not self._loop.called:
            self._loop.cancel()

    def supersede(self, by: tuple[str, str]) -> None:
        if self.by is None and not self.result.called:
            self.by = by
            self.result.cancel()


class HealthHooks(Protocol):
    """What the handlers tell the health watcher (see L{health.HealthWatcher})."""

    def hold(self, runtime_id: str) -> None: ...

    def release(
        self, runtime_id: str, *, announce: bool = False, expect: str | None = None
    ) -> None: ...

    def announce(self, runtime_id: str) -> None: ...

    def forget(self, runtime_id: str) -> None: ...


class _NoHealth:
    def hold(self, runtime_id: str) -> None:
        pass

    def release(
        self, runtime_id: str, *, announce: bool = False, expect: str | None = None
    ) -> None:
        pass

    def announce(self, runtime_id: str) -> None:
        pass

    def forget(self, runtime_id: str) -> None:
        pass


def _ids(payload: Mapping[str, Any]) -> tuple[str, str]:
    """(runtime_id, container_name) from a stop/remove/logs payload."""
    if not isinstance(payload, Mapping):
        raise CommandFailed(INVALID_COMMAND, "the payload must be an object")
    try:
        runtime_id = check_runtime_id(payload.get("runtime_id"))
        raw = payload.get("container_name")
        name = (
            slug_container_name(payload.get("runtime_name"))
            if is_blank(raw)
            else check_container_name(raw)
        )
    except PolicyError as exc:
        raise CommandFailed(INVALID_COMMAND, str(exc)) from None
    return runtime_id, name


#: fetch_container_logs answers within this time, whatever the engine does (the API polls 15 s).
LOGS_ANSWER_SEC = 8.0


#: C{fetch_container_logs} answers at least and at most this many lines (protocol 10.4).
TAIL_MIN = 10
TAIL_MAX = 200
#: When C{tail} is absent or not an integer (the original agent's default, then clamped).
TAIL_DEFAULT = 300


def parse_tail(value: object) -> int:
    """
    C{tail} parsed as an integer and clamped to 10..200 (protocol 10.4); absent means the
    default (300, so 200).

    @raise CommandFailed: C{invalid_command} when it is not an integer (the caller answers
        with the default and says so: logs never fail).
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        tail = TAIL_DEFAULT
    elif isinstance(value, bool):
        raise CommandFailed(INVALID_COMMAND, f"tail must be an integer, not {value!r}")
    elif isinstance(value, int):
        tail = value
    elif isinstance(value, float) and value.is_integer():
        tail = int(value)
    elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d{1,12}\s*", value):
        tail = int(value)
    else:
        raise CommandFailed(INVALID_COMMAND, f"tail must be an integer, not {str(value)[:40]!r}")
    return max(TAIL_MIN, min(TAIL_MAX, tail))


_TS_RE = re.compile(rb"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z?)\s")


def merge_log_lines(raw: bytes, max_bytes: int) -> tuple[str, int, bool]:
    """
    Order timestamped lines by time (stdout and stderr interleaved; lines without a
    timestamp stay after their predecessor) and keep the newest C{max_bytes}.
    Returns (text, line count, truncated).
    """
    lines = raw.splitlines()
    keyed: list[tuple[bytes, int, bytes]] = []
    last = b""
    for i, line in enumerate(lines):
        m = _TS_RE.match(line)
        if m:
            # Pad fractional seconds so they sort as text.
            stamp = m.group(1).rstrip(b"Z")
            if b"." in stamp:
                head, frac = stamp.split(b".", 1)
                stamp = head + b"." + frac.ljust(9, b"0")
            else:
                stamp += b".000000000"
            last = stamp
        keyed.append((last, i, line))
    keyed.sort()
    out: list[bytes] = []
    size = 0
    truncated = False
    for _, _, line in reversed(keyed):
        if size + len(line) + 1 > max_bytes:
            truncated = True
            break
        out.append(line)
        size += len(line) + 1
    out.reverse()
    text = b"\n".join(out).decode("utf-8", "replace")
    if truncated:
        text = f"[... older output truncated to the last {max_bytes} bytes ...]\n" + text
    return text, len(out), truncated


def _with_cause(cause: CommandFailed, before: str, after: str = "") -> str:
    """
    C{before + cause + after}; a readiness failure's log lines stay at the end and the whole
    within its bound (protocol 10.4: the backend keeps 2000 characters).
    """
    if isinstance(cause, ReadinessFailed):
        return cause.reworded(f"{before}{cause.summary}{after}")
    return f"{before}{cause.error_message}{after}"


def _port_error(exc: EngineError) -> CommandFailed:
    text = exc.explanation.lower()
    if "port is already allocated" in text or "address already in use" in text:
        return CommandFailed(
            PORT_CONFLICT,
            f"The host port is already in use: {exc.explanation}",
        )
    if "could not select device driver" in text or ("nvidia" in text and "not found" in text):
        return CommandFailed(
            RUNTIME_ERROR,
            f"{exc.error_message} (GPUs were requested but the engine has no NVIDIA container "
            "runtime/toolkit configured)",
        )
    return exc


class WorkloadManager:
    """
    Runs workload commands against the Docker engine.

    @param http: a treq C{HTTPClient} (readiness probes and image transfers).
    @param credential: returns the node credential (image transfers).
    @param sync_model: fetches a C{sync_from_server} model into the model store.
    @param profile: returns the node profile (for registry credentials), or C{None}.
    @param health: the health watcher's hooks (hold/release/forget).
    @param probe: overrides the readiness probe (C{url -> Deferred[status]}).
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        engine: DockerEngine,
        settings: WorkloadSettings,
        *,
        http: Any = None,
        backend_url: str = "",
        credential: Callable[[], str] | None = None,
        sync_model: SyncModel | None = None,
        profile: Callable[[], Mapping[str, Any] | None] | None = None,
        health: HealthHooks | None = None,
        probe: Callable[[str], Deferred[int]] | None = None,
        port_free: Callable[[int], bool] = port_is_free,
        gpus: Callable[[], GPUSnapshot | None] | None = None,
        adoption: Any = None,
    ) -> None:
        self._reactor = reactor
        #: The original agent's containers taken over (L{adoption.Adoption}), or C{None}.
        self.adoption = adoption
        self.engine = engine
        self.settings = settings
        self.allowlist = parse_allowlist(settings.image_allowlist)
        self.images = ImageManager(
            reactor,
            engine,
            stall_sec=settings.pull_stall_sec,
            http=http,
            backend_url=backend_url,
            credential=credential,
        )
        self._sync_model = sync_model
        self._profile = profile or (lambda: None)
        self.health: HealthHooks = health or _NoHealth()
        if probe is None:
            if http is None:
                raise ValueError("WorkloadManager needs an HTTP client (http=) or a probe")
            probe = make_treq_probe(http)
        self._probe = probe
        self._port_free = port_free
        self._claimed: set[int] = set()
        self._gpus = gpus or (lambda: None)
        #: runtime id -> its readiness wait in flight (one at a time: the runtime's lane).
        self._waits: dict[str, _ReadinessWait] = {}
        #: runtime id -> {command id: command type} of the stops/removes taken and not yet run.
        self._superseding: dict[str, dict[str, str]] = {}

    # -- helpers ----------------------------------------------------------------------

    def _spec(self, ctx: CommandContext) -> WorkloadSpec:
        profile = self._profile()
        spec = build_spec(ctx.command.payload, self.settings, self.allowlist, profile)
        # GPUs against this node's GPUs, their health and the engine (issue 13).
        return place_gpus(spec, self._gpus(), getattr(self.engine, "kind", "docker"))

    async def _adopted(self) -> dict[str, str]:
        """The adopted containers (container id -> runtime id), once the start's pass is over."""
        if self.adoption is None:
            return {}
        await self.adoption.ready()
        snapshot: dict[str, str] = self.adoption.snapshot()
        return snapshot

    def _note_deployed(self, ctx: CommandContext, result: Mapping[str, Any]) -> None:
        if self.adoption is not None and isinstance(result.get("runtime_id"), str):
            name = ctx.command.payload.get("runtime_name") if isinstance(ctx.command.payload, Mapping) else None
            self.adoption.deployed(result["runtime_id"], result, name if isinstance(name, str) else None)

    async def _find(self, runtime_id: str, name: str | None) -> list[dict[str, Any]]:
        adopted = await self._adopted()
        return await self.engine.call(
            ops.find_runtime, runtime_id, name, self.settings.agent_id, adopted, what="looking up the workload"
        )

    @staticmethod
    def _primary(found: list[dict[str, Any]]) -> dict[str, Any] | None:
        for snap in found:
            if not snap["foreign"] and snap["canonical"]:
                return snap
        return None

    def _check_foreign(self, found: list[dict[str, Any]], runtime_id: str) -> None:
        for snap in found:
            if snap["foreign"]:
                raise CommandFailed(
                    RUNTIME_ERROR,
                    f"A container named {snap['name']} already exists on this node and does not "
                    f"belong to runtime {runtime_id}; remove or rename it, or choose another "
                    "container name.",
                )

    @staticmethod
    def _refuse_foreign(found: list[dict[str, Any]], runtime_id: str, verb: str) -> None:
        """
        Stop and remove of a runtime whose named container exists but is not this agent's
        (ownership: L{ops.is_owned}) fail: a success would tell the backend the runtime is
        stopped or gone while that container keeps serving.
        """
        for snap in found:
            if snap["foreign"]:
                raise CommandFailed(
                    CONTAINER_NOT_OWNED,
                    f"The container {snap['name']} on this node is not managed by this agent (it "
                    f"lacks this agent's labels for runtime {runtime_id}), so it was not {verb} and "
                    f"is still {snap.get('status') or 'there'}: if it is this runtime's, stop or "
                    f"remove it by hand (docker rm -f {snap['name']}); otherwise rename it. Then retry.",
                )

    async def _reserved_ports(self, runtime_id: str) -> set[int]:
        rows = await self.engine.call(ops.list_managed, self.settings.agent_id, await self._adopted(),
                                      what="listing managed workloads")
        ports: set[int] = set(self._claimed)
        for row in rows:
            labels = row["labels"]
            if labels.get(LABEL_RUNTIME_ID) == runtime_id:
                continue
            try:
                ports.add(int(labels.get(LABEL_HOST_PORT, "0")))
            except ValueError:
                pass
            for p in row["ports"]:
                if p.get("host_port"):
                    ports.add(int(p["host_port"]))
        ports.discard(0)
        return ports

    async def _exit_info(self, cid: str) -> ContainerExit | None:
        # The real last exit (the engine's die event), not State.ExitCode after a restart.
        info = await self.engine.call(
            exits.exit_info, cid, LOG_TAIL_LINES, what="checking the container"
        )
        if info is None:
            return None
        return ContainerExit(
            status=info["status"],
            exit_code=info["exit_code"],
            restart_count=info["restart_count"],
            logs_tail=info["logs"],
            error=info["error"],
        )

    # -- supersession (issue 26) -------------------------------------------------------

    def superseding(self, command: Command) -> None:
        """
        The pipeline took a C{stop_workload} or C{remove_workload} (L{HandlerSpec.on_arrival}),
        before it waits behind the commands of its runtime: a deploy, start, restart or update
        of that runtime waiting for readiness ends now with a L{SUPERSEDED} failure, and so does
        any that reaches its readiness wait before this command runs. The container is left to
        the stop or remove.
        """
        try:
            runtime_id = check_runtime_id(command.runtime_id)
        except PolicyError:
            return  # the handler answers the bad payload
        self._superseding.setdefault(runtime_id, {})[command.id] = command.command_type
        wait = self._waits.get(runtime_id)
        if wait is not None:
            self.log.info(
                "{type} {id} of runtime {runtime} ends the readiness wait of the command before it",
                type=command.command_type, id=command.id, runtime=runtime_id,
            )
            wait.supersede((command.command_type, command.id))

    def _superseder(self, runtime_id: str) -> tuple[str, str] | None:
        """The first stop/remove of C{runtime_id} taken and not yet run, as (type, id)."""
        pending = self._superseding.get(runtime_id)
        if not pending:
            return None
        cid, kind = next(iter(pending.items()))
        return kind, cid

    def _runs(self, ctx: CommandContext) -> None:
        """A stop/remove starts (whatever its payload): it no longer ends readiness waits."""
        for runtime_id, pending in list(self._superseding.items()):
            if pending.pop(ctx.command.id, None) is not None and not pending:
                del self._superseding[runtime_id]

    def _superseded(self, ctx: CommandContext, name: str, by: tuple[str, str]) -> CommandFailed:
        kind, cid = by
        what = "stop" if kind == "stop_workload" else "removal"
        return CommandFailed(
            SUPERSEDED,
            f"{ctx.command.command_type} of {name} was superseded by {kind} {cid} while waiting for "
            f"the container to become ready: the wait ended and the {what} goes ahead.",
            {"container_name": name, "superseded_by": cid, "superseded_by_type": kind},
        )

    async def _await_ready(
        self, ctx: CommandContext, runtime_id: str, cid: str, name: str, host_port: int, health_path: str
    ) -> float:
        """
        L{wait_ready} for the runtime's container; ended at once (L{SUPERSEDED}) by a stop or
        remove of the runtime that the pipeline took (L{superseding}).
        """
        by = self._superseder(runtime_id)
        if by is not None:
            raise self._superseded(ctx, name, by)
        url = probe_url(host_port, health_path)
        endpoint = endpoint_url(self.settings, host_port)

        def progress(elapsed: float) -> None:
            ctx.progress(
                "waiting_for_ready",
                f"Waiting for {name} to answer on {health_path} ({elapsed:.0f} s so far)",
                elapsed_sec=round(elapsed, 1),
                endpoint_url=endpoint,
            )

        ctx.progress(
            "waiting_for_ready",
            f"Waiting for {name} to answer on {health_path}",
            elapsed_sec=0,
            endpoint_url=endpoint,
        )
        wait = _ReadinessWait()
        wait.run(Deferred.fromCoroutine(wait_ready(
            self._reactor,
            url=url,
            container_name=name,
            probe=self._probe,
            check_exit=lambda: self._exit_info(cid),
            progress=progress,
            timeout=self.settings.readiness_timeout_sec,
            interval=self.settings.readiness_interval_sec,
            progress_every=self.settings.readiness_progress_sec,
            read_logs=lambda: self.engine.call(
                ops.log_tail, cid, LOG_TAIL_LINES, what=f"reading the logs of {name}"
            ),
            stopped=lambda: wait.stopped,
        )))
        self._waits[runtime_id] = wait
        try:
            return await wait.result
        except CancelledError:
            if wait.by is not None:
                raise self._superseded(ctx, name, wait.by) from None
            raise
        except CommandFailed as exc:
            if exc.error_code == "container_exited":
                # Stop the crash loop the restart policy would otherwise keep going.
                try:
                    await self.engine.call(ops.stop_for_good, cid, 1, what="stopping the failed container")
                except EngineError:
                    pass
            raise
        finally:
            if self._waits.get(runtime_id) is wait:
                del self._waits[runtime_id]

    def _sync_progress(self, ctx: CommandContext) -> Callable[..., None]:
        def progress(*args: Any, **extra: Any) -> None:
            if len(args) >= 2:
                if args[0] != "sync_model":
                    extra.setdefault("step", str(args[0]))
                message = str(args[1])
            elif args:
                message = str(args[0])
            else:
                message = str(extra.pop("message", "Syncing the model"))
            extra.pop("phase", None)
            ctx.progress("sync_model", message, **extra)

        return progress

    def _notes(self, ctx: CommandContext, spec: WorkloadSpec) -> None:
        """Say, in the command's progress, what the local policy changed in the request."""
        for note in spec.notes:
            self.log.info("{runtime}: {note}", runtime=spec.container_name, note=note)
            ctx.progress("validate", note, container_name=spec.container_name)

    async def _image(
        self, ctx: CommandContext, spec: WorkloadSpec, *, local_first: bool
    ) -> dict[str, Any]:
        """
        Make the image present. The rule (docs/workloads.md, "Images"):

         - start/restart of a missing container (C{local_first}): the image already on this
           node is used when present, whatever C{image_source} says (the backend sends
           C{pull_from_registry} there by default, even for a local-only image; protocol 9);
         - C{pull_from_registry} otherwise pulls (an update may want a newer image under the
           same tag), and when the registry cannot provide it but the image is present
           locally, the local one is used and the progress says so;
         - nothing is pulled or transferred that the payload did not ask for.
        """
        ref = spec.image
        if local_first and spec.image_source is not None:
            local = await self.images.inspect(ref)
            if local is not None:
                ctx.progress(
                    "pull_image",
                    f"Using the image already on this node, {ref.canonical} ({local['id'][:19]}): "
                    f"a start of a missing container runs the runtime's image as it is here "
                    f"(the backend's image_source {spec.image_source!r} on start/restart is its "
                    "default, not a request for a newer image; use update to refresh it)",
                    progress_pct=100,
                )
                return {"image": ref.canonical, "image_id": local["id"], "local": True}
        try:
            return await self.images.ensure(ref, spec.image_source, ctx.progress, spec.registry_auth)
        except CommandFailed as exc:
            if spec.image_source != "pull_from_registry" or exc.error_code not in (
                PULL_FAILED,
                PULL_STALLED,
            ):
                raise
            local = await self.images.inspect(ref)
            if local is None:
                raise
            ctx.progress(
                "pull_image",
                f"{exc.error_message.rstrip('.')}. The image is present on this node: using the "
                f"local {ref.canonical} ({local['id'][:19]}) instead.",
                progress_pct=100,
            )
            self.log.warn(
                "The registry could not provide {image}; using the local image instead",
                image=ref.canonical,
            )
            return {
                "image": ref.canonical,
                "image_id": local["id"],
                "local": True,
                "pull_error": exc.error_message,
            }

    async def _prepare(
        self, ctx: CommandContext, spec: WorkloadSpec, *, local_first: bool = False
    ) -> dict[str, Any]:
        """sync_model then pull_image/transfer_image."""
        if spec.model_source == "sync_from_server" and spec.model_sync:
            if self._sync_model is None:
                raise CommandFailed(
                    RUNTIME_ERROR,
                    "The runtime needs its model synced from the backend, but model sync is "
                    "not available on this node.",
                )
            repo = spec.model_sync.get("hf_repo_id") or spec.model_sync.get("model_id") or "the model"
            ctx.progress("sync_model", f"Syncing {repo} from the backend")
            await self._sync_model(dict(spec.model_sync), self._sync_progress(ctx))
            ctx.progress("sync_model", f"Model {repo} is in the model store", progress_pct=100)
        elif spec.model_source == "download_from_hf":
            ctx.progress("sync_model", "The container downloads the model itself (download_from_hf)")
        else:
            ctx.progress("sync_model", "No model sync needed")
        return await self._image(ctx, spec, local_first=local_first)

    async def _launch(
        self,
        ctx: CommandContext,
        spec: WorkloadSpec,
        *,
        preferred_port: int | None = None,
    ) -> dict[str, Any]:
        """start_container, resolve_endpoint, waiting_for_ready, ready."""
        reserved = await self._reserved_ports(spec.runtime_id)
        requested = spec.requested_host_port
        if requested is None and preferred_port is not None and preferred_port not in reserved and self._port_free(preferred_port):
            requested = preferred_port
        host_port = choose_host_port(
            spec.container_port, requested, reserved, is_free=self._port_free
        )
        self._claimed.add(host_port)
        try:
            args = render(
                spec,
                host_port=host_port,
                command_id=ctx.command.id,
                agent_id=self.settings.agent_id,
                publish_host_ip=self.settings.publish_host_ip,
            )
            ctx.progress(
                "start_container",
                f"Starting {spec.container_name} from {spec.image.canonical} "
                f"(host port {host_port}, {spec.network_mode} network)",
                host_port=host_port,
                container_port=spec.container_port,
            )
            try:
                created = await self.engine.call(
                    ops.create_and_start, args, what=f"starting container {spec.container_name}"
                )
            except EngineError as exc:
                raise _port_error(exc) from None
            cid = created["id"]
            snap = await self.engine.call(ops.inspect, cid, what="inspecting the container")
            real_port = (ops.host_port_of(snap, spec.container_port) if snap else None) or host_port
            url = endpoint_url(self.settings, real_port)
            ctx.progress(
                "resolve_endpoint", f"Endpoint {url}", endpoint_url=url, host_port=real_port
            )
        finally:
            self._claimed.discard(host_port)
        elapsed = await self._await_ready(
            ctx, spec.runtime_id, cid, spec.container_name, real_port, spec.health_path
        )
        ctx.progress(
            "ready",
            f"{spec.container_name} is ready at {url} after {elapsed:.1f} s",
            endpoint_url=url,
            progress_pct=100,
        )
        return {
            "runtime_id": spec.runtime_id,
            "container_name": spec.container_name,
            "container_id": cid,
            "endpoint_url": url,
            "host_port": real_port,
            "container_port": spec.container_port,
            "image": spec.image.canonical,
            "ready_after_sec": round(elapsed, 2),
        }

    def _event(self, ctx: CommandContext, event_type: str, payload: dict[str, Any], severity: str = "info") -> None:
        try:
            ctx.emit_event(event_type, payload, severity, ctx.command.reply_correlation_id)
        except Exception:
            self.log.failure("emitting {event} failed", event=event_type)

    async def _check_requested_port(self, spec: WorkloadSpec, found: list[dict[str, Any]]) -> None:
        """
        An explicit host port held by someone else fails with C{port_conflict} before anything
        is removed, pulled or created (a port held by this runtime's own old container is fine:
        it is about to be replaced).
        """
        requested = spec.requested_host_port
        if requested is None:
            return
        own = {ops.host_port_of(snap) for snap in found}
        if requested in own:
            return
        reserved = await self._reserved_ports(spec.runtime_id)
        choose_host_port(spec.container_port, requested, reserved, is_free=self._port_free)

    async def _remove_all(self, found: list[dict[str, Any]], grace: int) -> int:
        removed = 0
        for snap in found:
            if snap["running"] or snap["restarting"]:
                await self.engine.call(ops.stop, snap["id"], grace, what=f"stopping {snap['name']}")
            if await self.engine.call(ops.remove, snap["id"], what=f"removing {snap['name']}"):
                removed += 1
        return removed

    @property
    def _grace(self) -> int:
        return max(0, int(round(self.settings.stop_grace_sec)))

    # -- deploy -----------------------------------------------------------------------

    async def deploy(self, ctx: CommandContext) -> dict[str, Any]:
        """C{deploy_workload}."""
        spec = self._spec(ctx)
        self.health.hold(spec.runtime_id)
        expect = None
        try:
            result = await self._deploy(ctx, spec)
            expect = "running"
        finally:
            self.health.release(spec.runtime_id, expect=expect)
        self._note_deployed(ctx, result)
        self._event(ctx, "workload.deployed", self._eventPayload(result))
        return result

    async def _deploy(
        self, ctx: CommandContext, spec: WorkloadSpec, *, local_first: bool = False
    ) -> dict[str, Any]:
        ctx.progress(
            "validate",
            f"Validated {spec.provider_type} workload {spec.container_name} "
            f"(image {spec.image.canonical})",
            image=spec.image.canonical,
            container_name=spec.container_name,
        )
        self._notes(ctx, spec)
        found = await self._find(spec.runtime_id, spec.container_name)
        self._check_foreign(found, spec.runtime_id)
        await self._check_requested_port(spec, found)
        removed = await self._remove_all(found, self._grace)
        ctx.progress(
            "remove_stale",
            f"Removed {removed} stale container(s)" if removed else "No stale container",
        )
        image = await self._prepare(ctx, spec, local_first=local_first)
        result = await self._launch(ctx, spec)
        if image.get("image_id"):
            result["image_id"] = image["image_id"]
        if image.get("local"):
            result["image_local"] = True
        return result

    @staticmethod
    def _eventPayload(result: Mapping[str, Any]) -> dict[str, Any]:
        return {
            k: result[k]
            for k in ("runtime_id", "container_name", "container_id", "endpoint_url", "image")
            if k in result
        }

    # -- start / restart --------------------------------------------------------------

    async def start(self, ctx: CommandContext) -> dict[str, Any]:
        """C{start_workload}: start the labelled container; deploy when it is missing."""
        return await self._startOrRestart(ctx, restart=False)

    async def restart(self, ctx: CommandContext) -> dict[str, Any]:
        """C{restart_workload}: restart the labelled container; deploy when it is missing."""
        return await self._startOrRestart(ctx, restart=True)

    async def _startOrRestart(self, ctx: CommandContext, *, restart: bool) -> dict[str, Any]:
        payload = ctx.command.payload
        runtime_id, name = _ids(payload)
        self.health.hold(runtime_id)
        expect = None
        try:
            found = await self._find(runtime_id, name)
            primary = self._primary(found)
            if primary is None:
                spec = self._spec(ctx)
                ctx.progress(
                    "validate",
                    f"No container for runtime {runtime_id} on this node; deploying it",
                )
                result = await self._deploy(ctx, spec, local_first=True)
                event = "workload.deployed"
            else:
                result = await self._startExisting(ctx, runtime_id, primary, restart=restart)
                event = "workload.restarted" if restart else "workload.started"
            expect = "running"
        finally:
            self.health.release(runtime_id, expect=expect)
        if event == "workload.deployed":
            self._note_deployed(ctx, result)
        self._event(ctx, event, self._eventPayload(result))
        return result

    async def _startExisting(
        self, ctx: CommandContext, runtime_id: str, snap: dict[str, Any], *, restart: bool
    ) -> dict[str, Any]:
        labels = snap["labels"]
        name = snap["name"]
        image_label = labels.get(LABEL_IMAGE) or snap["image"]
        if image_label and not image_label.startswith("sha256:"):
            check_image(image_label, self.allowlist, "the container's image")
        try:
            container_port = int(labels.get(LABEL_CONTAINER_PORT) or 0) or None
        except ValueError:
            container_port = None
        host_port = ops.host_port_of(snap, container_port)
        if host_port is None:
            raise CommandFailed(
                RUNTIME_ERROR,
                f"Container {name} publishes no port; remove the runtime's container and deploy again.",
            )
        health_path = labels.get(LABEL_HEALTH_PATH) or "/health"
        ctx.progress(
            "validate",
            f"{'Restarting' if restart else 'Starting'} the existing container {name} "
            f"(host port {host_port})",
            container_name=name,
            host_port=host_port,
        )
        running = snap["running"] and not snap["restarting"]
        if not running:
            reserved = await self._reserved_ports(runtime_id)
            if host_port in reserved or not self._port_free(host_port):
                raise CommandFailed(
                    PORT_CONFLICT,
                    f"Host port {host_port}, recorded for {name}, is now in use by something "
                    "else on this node; stop that, or remove the runtime's container and deploy "
                    "again to get a free port.",
                )
        ctx.progress("start_container", f"{'Restarting' if restart else 'Starting'} {name}")
        try:
            if restart and running:
                await self.engine.call(ops.restart, snap["id"], self._grace, what=f"restarting {name}")
            elif not running or restart:
                if snap["restarting"]:
                    await self.engine.call(ops.stop, snap["id"], self._grace, what=f"stopping {name}")
                await self.engine.call(ops.start, snap["id"], what=f"starting {name}")
        except EngineError as exc:
            raise _port_error(exc) from None
        url = endpoint_url(self.settings, host_port)
        ctx.progress("resolve_endpoint", f"Endpoint {url}", endpoint_url=url, host_port=host_port)
        elapsed = await self._await_ready(ctx, runtime_id, snap["id"], name, host_port, health_path)
        ctx.progress(
            "ready", f"{name} is ready at {url} after {elapsed:.1f} s", endpoint_url=url, progress_pct=100
        )
        return {
            "runtime_id": runtime_id,
            "container_name": name,
            "container_id": snap["id"],
            "endpoint_url": url,
            "host_port": host_port,
            "container_port": container_port,
            "image": image_label,
            "ready_after_sec": round(elapsed, 2),
        }

    # -- update -----------------------------------------------------------------------

    async def update(self, ctx: CommandContext) -> dict[str, Any]:
        """
        C{update_workload}: prepare the new image first, then replace the container; if
        the new one does not become ready, remove it and bring the old one back.
        """
        spec = self._spec(ctx)
        self.health.hold(spec.runtime_id)
        announce = False
        try:
            result = await self._update(ctx, spec)
            announce = True
        except CommandFailed as exc:
            # The previous container runs (restored, or never touched): say so after the
            # failed result, or the backend leaves the runtime in error.
            announce = bool(exc.result.get("rolled_back") or exc.result.get("previous_running"))
            raise
        finally:
            # The current backend ignores workload.health.running while the update is in
            # flight (protocol 4, 10.4): the running container is announced once the backend
            # confirmed the update's result, not before.
            self.health.release(spec.runtime_id)
            if announce:
                rid = spec.runtime_id
                ctx.after_result(lambda: self.health.announce(rid))
        self._note_deployed(ctx, result)
        self._event(ctx, "workload.updated", self._eventPayload(result))
        return result

    async def _update(self, ctx: CommandContext, spec: WorkloadSpec) -> dict[str, Any]:
        ctx.progress(
            "validate",
            f"Validated the update of {spec.container_name} (image {spec.image.canonical})",
            image=spec.image.canonical,
        )
        self._notes(ctx, spec)
        found = await self._find(spec.runtime_id, spec.container_name)
        self._check_foreign(found, spec.runtime_id)
        old = self._primary(found)
        leftovers = [s for s in found if s is not old]
        removed = await self._remove_all(leftovers, self._grace)
        try:
            image = await self._prepare(ctx, spec)
        except CommandFailed as exc:
            if old is not None and old["running"] and not old["restarting"]:
                exc.result["previous_running"] = True
                exc.error_message += " The current container was left running unchanged."
                exc.args = (exc.error_message,)
            raise
        if old is None:
            ctx.progress(
                "remove_stale",
                f"No current container (removed {removed} stale); deploying fresh",
            )
            result = await self._launch(ctx, spec)
            result["image_id"] = image.get("image_id", "")
            return result
        old_port = ops.host_port_of(old, None)
        old_running = old["running"] or old["restarting"]
        backup = f"{spec.container_name}-prev-{old['id'][:12]}"[:128]
        ctx.progress(
            "remove_stale",
            f"Stopping the current container {old['name']} (kept as {backup} until the new one is ready)",
        )
        try:
            if old_running:
                await self.engine.call(ops.stop, old["id"], self._grace, what=f"stopping {old['name']}")
            await self.engine.call(ops.rename, old["id"], backup, what=f"renaming {old['name']}")
        except CommandFailed:
            if old_running:
                # Best effort: the old container keeps its name; bring it back up.
                try:
                    await self.engine.call(ops.start, old["id"], what=f"starting {old['name']} again")
                except CommandFailed:
                    pass
            raise
        try:
            result = await self._launch(ctx, spec, preferred_port=old_port)
        except CancelledError:
            self._rollbackLater(spec, old, backup, old_running)
            raise
        except CommandFailed as exc:
            raise await self._rollback(ctx, spec, old, backup, old_running, exc) from None
        await self.engine.call(ops.remove, old["id"], what=f"removing the previous container {backup}")
        result["image_id"] = image.get("image_id", "")
        result["replaced_container_id"] = old["id"]
        return result

    async def _rollback(
        self,
        ctx: CommandContext,
        spec: WorkloadSpec,
        old: dict[str, Any],
        backup: str,
        old_running: bool,
        cause: CommandFailed,
    ) -> CommandFailed:
        ctx.progress("rollback", f"The new container failed ({cause.error_code}); rolling back")
        try:
            await self._removeNew(spec)
            await self.engine.call(ops.rename, old["id"], spec.container_name, what="restoring the previous container's name")
            url = ""
            if old_running:
                await self.engine.call(ops.start, old["id"], what="starting the previous container")
                port = ops.host_port_of(old, None)
                if port and cause.error_code != SUPERSEDED:
                    url = endpoint_url(self.settings, port)
                    health_path = old["labels"].get(LABEL_HEALTH_PATH) or spec.health_path
                    await self._await_ready(ctx, spec.runtime_id, old["id"], spec.container_name, port, health_path)
        except CancelledError:
            raise
        except CommandFailed as rb:
            return CommandFailed(
                cause.error_code,
                _with_cause(
                    cause,
                    f"Update of {spec.container_name} failed: ",
                    f" Rolling back also failed: {rb.error_message}",
                ),
                {**cause.result, "rolled_back": False},
            )
        if cause.error_code == SUPERSEDED and old_running:
            state = "is back and started (not waited for: the stop or removal of the runtime comes next)"
        else:
            state = f"is running again at {url}" if url else "is back (it was not running before)"
        ctx.progress("rollback", f"Rolled back: the previous container {state}", endpoint_url=url)
        return CommandFailed(
            cause.error_code,
            _with_cause(
                cause,
                f"Update of {spec.container_name} failed and was rolled back: the previous "
                f"container (image {old['labels'].get(LABEL_IMAGE) or old['image']}) {state}. "
                "Cause: ",
            ),
            {**cause.result, "rolled_back": True, "endpoint_url": url},
        )

    async def _removeNew(self, spec: WorkloadSpec) -> None:
        snap = await self.engine.call(ops.by_exact_name, spec.container_name, what="finding the new container")
        if snap is not None and ops.is_owned(snap["labels"], self.settings.agent_id, spec.runtime_id):
            await self.engine.call(ops.remove, snap["id"], what="removing the new container")

    def _rollbackLater(self, spec: WorkloadSpec, old: dict[str, Any], backup: str, old_running: bool) -> None:
        """Best effort after a cancel (deadline): put the previous container back."""

        async def restore() -> None:
            await self._removeNew(spec)
            await self.engine.call(ops.rename, old["id"], spec.container_name, what="restoring the previous container")
            if old_running:
                await self.engine.call(ops.start, old["id"], what="starting the previous container")

        d = Deferred.fromCoroutine(restore())
        d.addErrback(lambda f: self.log.failure("rollback after cancel failed", f))

    # -- stop / remove ----------------------------------------------------------------

    async def stop(self, ctx: CommandContext) -> dict[str, Any]:
        """C{stop_workload}: SIGTERM, C{stop_grace_sec}, SIGKILL. Missing is success."""
        self._runs(ctx)
        runtime_id, name = _ids(ctx.command.payload)
        self.health.hold(runtime_id)
        expect = None
        try:
            found = await self._find(runtime_id, name)
            self._refuse_foreign(found, runtime_id, "stopped")
            if not found:
                return {
                    "runtime_id": runtime_id,
                    "container_name": name,
                    "stopped": False,
                    "message": f"No container for runtime {runtime_id} on this node; nothing to stop.",
                }
            stopped = []
            for snap in found:
                if snap["running"] or snap["restarting"]:
                    ctx.progress("stop", f"Stopping {snap['name']} (grace {self._grace} s)")
                    await self.engine.call(ops.stop, snap["id"], self._grace, what=f"stopping {snap['name']}")
                    stopped.append(snap["name"])
            expect = "stopped"
        finally:
            self.health.release(runtime_id, expect=expect)
        primary = self._primary(found) or found[0]
        self._event(ctx, "workload.stopped", {"runtime_id": runtime_id, "container_name": primary["name"]})
        return {
            "runtime_id": runtime_id,
            "container_name": primary["name"],
            "stopped": True,
            "was_running": bool(stopped),
        }

    async def remove(self, ctx: CommandContext) -> dict[str, Any]:
        """C{remove_workload}: idempotent; a missing container is success."""
        self._runs(ctx)
        runtime_id, name = _ids(ctx.command.payload)
        self.health.hold(runtime_id)
        try:
            found = await self._find(runtime_id, name)
            self._refuse_foreign(found, runtime_id, "removed")
            removed = await self._remove_all(found, self._grace)
            self.health.forget(runtime_id)
        finally:
            self.health.release(runtime_id)
        if self.adoption is not None:
            self.adoption.removed(runtime_id)
        self._event(ctx, "workload.removed", {"runtime_id": runtime_id, "container_name": name})
        return {
            "runtime_id": runtime_id,
            "container_name": name,
            "removed": removed,
            "message": (
                f"Removed {removed} container(s)."
                if removed
                else f"No container for runtime {runtime_id} on this node; nothing to remove."
            ),
        }

    # -- logs -------------------------------------------------------------------------

    async def logs(self, ctx: CommandContext) -> dict[str, Any]:
        """
        C{fetch_container_logs}: fast, read-only, and never a failure. Any failed command puts
        its runtime in C{error} in the backend (protocol 7), so a bad C{tail}, a missing
        container, an unreachable engine or a slow engine are all answered with a successful
        result whose text says what happened.
        """
        payload = ctx.command.payload
        note = ""
        try:
            tail = parse_tail(payload.get("tail"))
        except CommandFailed as e:
            tail = parse_tail(None)
            note = f"[llmport-agent: {e.error_message}; showing the last {tail} lines]\n"
        try:
            runtime_id, name = _ids(payload)
        except CommandFailed as e:
            return {"logs": f"No logs: {e.error_message}", "found": False}
        app = serve_app_name(payload.get("runtime_name"))
        replica = parse_replica(payload.get("replica_id"))
        if app and not is_blank(payload.get("replica_id")) and replica is None:
            note += "[llmport-agent: replica_id is not a Serve replica id; showing every replica]\n"
        d = Deferred.fromCoroutine(self._logs(runtime_id, name, tail, app, replica))
        d.addTimeout(LOGS_ANSWER_SEC, self._reactor)
        try:
            result = await d
        except CommandFailed as e:
            result = {"runtime_id": runtime_id, "container_name": name, "found": False,
                      "logs": f"No logs: {e.error_message}", "error_code": e.error_code}
        except (defer.TimeoutError, defer.CancelledError):
            result = {"runtime_id": runtime_id, "container_name": name, "found": False,
                      "logs": f"No logs: the Docker engine did not answer within {LOGS_ANSWER_SEC:g} s; "
                              "try again in a moment."}
        if note:
            result["logs"] = note + result["logs"]
        return result

    async def _logs(
        self, runtime_id: str, name: str, tail: int, app: str | None = None, replica: str | None = None
    ) -> dict[str, Any]:
        serve_note = ""
        if app is not None:
            # A Ray Serve app: its replicas' log files in the Ray runtime container first.
            try:
                serve = await self.engine.call(
                    read_serve_logs,
                    app,
                    replica,
                    tail,
                    self.settings.logs_max_bytes,
                    self.settings.agent_id,
                    what=f"reading the Serve replica logs of {app}",
                )
            except EngineError as exc:
                if exc.unreachable:
                    raise
                serve = None
                serve_note = f"[llmport-agent: {exc.error_message}]\n"
            if serve is not None:
                return {
                    "runtime_id": runtime_id,
                    "container_name": serve["container_name"],
                    "app_name": app,
                    "source": "ray_serve",
                    "logs": serve["logs"],
                    "files": serve["files"],
                    "truncated": serve["truncated"],
                    "found": True,
                }
            serve_note += (
                f"[llmport-agent: no Ray Serve replica logs of {app}"
                + (f" (replica {replica})" if replica else "")
                + f" in {RAY_CONTAINER} on this node; showing container logs]\n"
            )
        result = await self._containerLogs(runtime_id, name, tail)
        if serve_note:
            result["logs"] = serve_note + result["logs"]
        return result

    async def _containerLogs(self, runtime_id: str, name: str, tail: int) -> dict[str, Any]:
        target = await self.engine.call(
            ops.find_runtime_light, runtime_id, self.settings.agent_id, await self._adopted(),
            what="finding the container",
        )
        missing = {
            "runtime_id": runtime_id,
            "container_name": name,
            "logs": (
                f"No managed container for runtime {runtime_id} (expected name {name}) exists "
                "on this node, so there are no logs. Deploy or start the runtime to create it."
            ),
            "found": False,
        }
        if target is None:
            return missing
        raw = await self.engine.call(ops.logs, target["id"], tail, what=f"reading the logs of {target['name']}")
        if raw is None:
            return missing
        text, count, truncated = merge_log_lines(raw, self.settings.logs_max_bytes)
        return {
            "runtime_id": runtime_id,
            "container_name": target["name"],
            "logs": text,
            "lines": count,
            "truncated": truncated,
            "found": True,
        }
