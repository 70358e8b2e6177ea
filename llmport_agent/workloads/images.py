"""
Images: the local image, C{pull_from_registry} and C{transfer_from_server}.

Pulls stream the engine's progress (per-layer bytes aggregated into C{progress_pct},
C{bytes_done} and C{bytes_total}, at most about one report a second), surface errors that
arrive inside the stream, are abandoned by a stall watchdog (C{pull_stalled}) and are
joined when two commands pull the same reference. Registry credentials come from the
payload or profile and go to the engine in the request header only: never to disk, logs,
progress or error text.

Transfers (L{imagetransfer}) stream the backend's C{docker save} tar into the engine's image
load while it arrives (with flow control), resume with C{Range} where the backend serves an
export, send the image pin when known (C{409}: C{server_image_mismatch}), and stop the load
on cancel or failure; a transfer of a tag already present (and pinned, when a pin is known)
is skipped.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmport_agent.core.lazyimport import LazyModule

from ..commands.base import INVALID_COMMAND, CommandFailed
from . import dockerapi
from .engine import DockerEngine, EngineError, StreamClosed, StreamControl
from .imagetransfer import (
    IMAGE_TRANSFER_FAILED,
    ImageTransfer,
)
from .policy import ImageRef

if TYPE_CHECKING:
    import docker
else:
    docker = LazyModule("docker")  # docker-py: imported at its first use

PULL_FAILED = "pull_failed"
PULL_STALLED = "pull_stalled"
# Transfers (protocol 10.4 codes); see imagetransfer.
TRANSFER_FAILED = IMAGE_TRANSFER_FAILED

#: progress(message, **extra) -> None
Progress = Callable[..., None]

_TRANSFER_NAME_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._/-]*$")
_TRANSFER_TAG_RE = re.compile(r"^[a-zA-Z0-9._-]+$")


def _scrub(text: str, secrets: tuple[str, ...]) -> str:
    for secret in sorted(secrets, key=len, reverse=True):
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


#: The fields of registry credentials whose values are secret (the user name, the e-mail and the
#: registry address are not: they say which registry and account failed).
_AUTH_SECRETS = ("password", "identitytoken", "registrytoken", "auth")


def auth_secrets(auth: dict[str, str] | None) -> tuple[str, ...]:
    """The secret values of registry credentials, and their encodings that could be echoed."""
    if not auth:
        return ()
    values = [v for k, v in auth.items() if k in _AUTH_SECRETS and isinstance(v, str) and v]
    header = docker.auth.encode_header(auth)  # what the engine gets in X-Registry-Auth
    values.append(header.decode() if isinstance(header, bytes) else str(header))
    if auth.get("username") and auth.get("password"):
        values.append(base64.b64encode(f"{auth['username']}:{auth['password']}".encode()).decode())
    return tuple(values)


class PullProgress:
    """Aggregates the engine's per-layer pull messages."""

    def __init__(self) -> None:
        self.layers: dict[str, dict[str, int | str]] = {}
        self.status = ""
        self.done = False

    def update(self, msg: dict[str, Any]) -> bool:
        """Fold one message in; return whether anything observable changed."""
        status = str(msg.get("status", ""))
        layer = msg.get("id")
        detail = msg.get("progressDetail") or {}
        if not layer or not isinstance(layer, str) or status.startswith(("Pulling from", "Digest:", "Status:")):
            changed = status != self.status
            self.status = status or self.status
            if status.startswith("Status:"):
                self.done = True
            return changed
        entry = self.layers.setdefault(layer, {"current": 0, "total": 0, "status": ""})
        before = dict(entry)
        entry["status"] = status
        if status == "Downloading" and isinstance(detail, dict):
            total = detail.get("total")
            current = detail.get("current")
            if isinstance(total, int) and total > 0:
                entry["total"] = total
            if isinstance(current, int):
                entry["current"] = current
        elif status in ("Download complete", "Pull complete", "Already exists", "Verifying Checksum"):
            if entry["total"]:
                entry["current"] = entry["total"]
        elif status == "Extracting" and isinstance(detail, dict) and not entry["total"]:
            total = detail.get("total")
            if isinstance(total, int) and total > 0:
                entry["total"] = total
                entry["current"] = total
        return entry != before

    @property
    def bytes_done(self) -> int:
        return sum(int(e["current"]) for e in self.layers.values())

    @property
    def bytes_total(self) -> int:
        return sum(int(e["total"]) for e in self.layers.values())

    @property
    def complete_layers(self) -> int:
        return sum(
            1 for e in self.layers.values() if e["status"] in ("Pull complete", "Already exists")
        )

    def pct(self) -> int:
        if self.done:
            return 100
        layers = [e for e in self.layers.values() if e["status"] != "Waiting" or e["total"]]
        if not self.layers:
            return 0
        total = self.bytes_total
        download = (self.bytes_done / total) if total else 0.0
        finished = self.complete_layers / max(len(self.layers), 1)
        # Downloads count 90 %, extraction of layers the rest.
        value = int(download * 90 + finished * 10) if layers else 0
        return max(0, min(99, value))

    def extra(self) -> dict[str, Any]:
        return {
            "progress_pct": self.pct(),
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "layers": len(self.layers),
            "layers_done": self.complete_layers,
        }


def _pull_thread(
    client: docker.DockerClient,
    control: StreamControl,
    repository: str,
    tag: str,
    registry: str,
    auth: dict[str, str] | None,
    on_message: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Thread function: run the engine's pull, forwarding each message to the reactor."""
    api = client.api
    headers: dict[str, str] = {}
    if auth:
        headers["X-Registry-Auth"] = docker.auth.encode_header(auth)
    else:
        header = docker.auth.get_config_header(api, registry)
        if header:
            headers["X-Registry-Auth"] = header
    response = dockerapi.post(
        api,
        dockerapi.url(api, "/images/create"),
        params={"fromImage": repository, "tag": tag},
        headers=headers,
        stream=True,
        timeout=None,
    )
    stream = docker.types.CancellableStream(dockerapi.json_messages(api, response), response)
    control.attach(stream)
    dockerapi.raise_for_status(api, response)
    error = ""
    final = ""
    for msg in stream:
        if control.closed:
            break
        if not isinstance(msg, dict):
            continue
        if msg.get("error") or msg.get("errorDetail"):
            detail = msg.get("errorDetail") or {}
            error = str(msg.get("error") or (detail.get("message") if isinstance(detail, dict) else "") or "unknown error")
        status = msg.get("status")
        if isinstance(status, str) and status.startswith("Status:"):
            final = status
        on_message(msg)
    control.check()
    return {"error": error, "final": final}


class _SharedPull:
    """One running pull, shared by every command that asked for the same reference."""

    def __init__(self) -> None:
        self.listeners: list[Progress] = []
        self.waiters: list[Deferred[dict[str, Any]]] = []
        self.control = StreamControl()
        self.task: Deferred[dict[str, Any]] | None = None
        self.progress = PullProgress()


def _inspect_image(client: docker.DockerClient, name: str) -> dict[str, Any] | None:
    try:
        info = client.api.inspect_image(name)
    except docker.errors.NotFound:
        return None
    layers = [str(x) for x in ((info.get("RootFS") or {}).get("Layers") or [])]
    return {
        "id": info.get("Id", ""),
        "repo_tags": list(info.get("RepoTags") or []),
        "repo_digests": list(info.get("RepoDigests") or []),
        "size": int(info.get("Size") or 0),
        "rootfs_digest": rootfs_digest(layers) if layers else None,
    }


def rootfs_digest(layer_diff_ids: list[str]) -> str:
    """
    The content identity llm-port pins an image by (protocol 10.6): C{sha256:} and the
    SHA-256 of the image's RootFS layer diff ids joined by newlines.
    """
    return "sha256:" + hashlib.sha256("\n".join(layer_diff_ids).encode()).hexdigest()


def image_matches(local: dict[str, Any], expect_id: str | None, expect_rootfs: str | None) -> bool:
    """Whether a local image (L{_inspect_image}) is the pinned one: by rootfs digest or id."""
    if expect_rootfs and local.get("rootfs_digest") == expect_rootfs:
        return True
    return bool(expect_id and local.get("id") == expect_id)


class ImageManager:
    """
    Makes images present on the engine.

    @param http: a treq C{HTTPClient} for the backend (transfers).
    @param backend_url: C{LLM_PORT_NODE_AGENT_BACKEND_URL} (may carry a base path).
    @param credential: returns the node credential (bearer) at the time of the request.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        engine: DockerEngine,
        *,
        stall_sec: float,
        http: Any = None,
        backend_url: str = "",
        credential: Callable[[], str] | None = None,
        progress_interval: float = 1.0,
        resume_attempts: int = 8,
        resume_delay: float = 1.0,
    ) -> None:
        self._reactor = reactor
        self.resume_attempts = resume_attempts
        self.resume_delay = resume_delay
        self._engine = engine
        self.stall_sec = stall_sec
        self._http = http
        self._backend_url = backend_url
        self._credential = credential
        self.progress_interval = progress_interval
        self._pulls: dict[str, _SharedPull] = {}

    # -- local ---------------------------------------------------------------------------

    async def inspect(self, ref: ImageRef) -> dict[str, Any] | None:
        """The local image for C{ref}, or C{None}."""
        return await self._engine.call(_inspect_image, ref.canonical, what=f"inspecting image {ref.canonical}")

    # -- pull ----------------------------------------------------------------------------

    async def pull(
        self, ref: ImageRef, progress: Progress, auth: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """
        Pull C{ref}, reporting progress through C{progress(message, **extra)}; joins a pull
        of the same reference already running.

        @raise CommandFailed: C{pull_failed}, C{pull_stalled}, or C{runtime_error} when
            the engine is unreachable.
        """
        key = ref.canonical
        shared = self._pulls.get(key)
        if shared is None:
            shared = _SharedPull()
            self._pulls[key] = shared
            shared.task = Deferred.fromCoroutine(self._runPull(shared, ref, auth))
            shared.task.addBoth(self._pullDone, shared, key)
        else:
            progress(f"Joining the pull of {key} already in progress", **shared.progress.extra())
        shared.listeners.append(progress)

        def _leave(d: Deferred[dict[str, Any]]) -> None:
            if d in shared.waiters:
                shared.waiters.remove(d)
            if not shared.waiters and shared.task is not None and not shared.task.called:
                shared.control.close("cancelled")
                shared.task.cancel()

        waiter: Deferred[dict[str, Any]] = Deferred(_leave)
        shared.waiters.append(waiter)
        try:
            return await waiter
        finally:
            if progress in shared.listeners:
                shared.listeners.remove(progress)

    def _pullDone(self, result: Any, shared: _SharedPull, key: str) -> None:
        if self._pulls.get(key) is shared:
            del self._pulls[key]
        waiters, shared.waiters = shared.waiters, []
        for waiter in waiters:
            if isinstance(result, Failure):
                waiter.errback(result)
            else:
                waiter.callback(result)
        if isinstance(result, Failure) and not waiters:
            result.trap(CancelledError, CommandFailed)

    def _emit(self, shared: _SharedPull, message: str) -> None:
        extra = shared.progress.extra()
        for listener in list(shared.listeners):
            try:
                listener(message, **extra)
            except Exception:
                self.log.failure("pull progress listener failed")

    async def _runPull(
        self, shared: _SharedPull, ref: ImageRef, auth: dict[str, str] | None
    ) -> dict[str, Any]:
        secrets = auth_secrets(auth)
        clock = self._reactor
        state = {"last_change": clock.seconds(), "last_emit": 0.0}
        stalled = {"yes": False}
        timer: Any = None

        def on_message(msg: dict[str, Any]) -> None:
            if shared.progress.update(msg):
                state["last_change"] = clock.seconds()
            now = clock.seconds()
            if now - state["last_emit"] >= self.progress_interval:
                state["last_emit"] = now
                self._emit(shared, f"Pulling {ref.canonical}: {shared.progress.status or 'in progress'}")

        def watchdog() -> None:
            nonlocal timer
            idle = clock.seconds() - state["last_change"]
            if idle >= self.stall_sec:
                stalled["yes"] = True
                shared.control.close("stalled")
                timer = None
                return
            timer = clock.callLater(max(0.1, self.stall_sec - idle), watchdog)

        timer = clock.callLater(self.stall_sec, watchdog)

        def forward(msg: dict[str, Any]) -> None:
            self._engine.callFromThread(on_message, msg)

        tag = ref.digest or ref.effective_tag
        self.log.info("Pulling image {image}", image=ref.canonical)
        try:
            outcome = await self._engine.stream(
                _pull_thread,
                shared.control,
                ref.pull_name,
                tag,
                ref.registry,
                auth,
                forward,
                what=f"pulling image {ref.canonical}",
            )
        except StreamClosed:
            if stalled["yes"]:
                raise CommandFailed(
                    PULL_STALLED,
                    f"Pulling {ref.canonical} made no progress for {self.stall_sec:g} s and was "
                    f"abandoned after {shared.progress.bytes_done} bytes; check that the "
                    f"registry {ref.registry} is reachable from this node.",
                    shared.progress.extra(),
                ) from None
            raise CancelledError() from None
        except EngineError as exc:
            if exc.unreachable:
                raise
            raise CommandFailed(
                PULL_FAILED,
                _scrub(self._pullMessage(ref, exc.explanation or exc.error_message), secrets),
            ) from None
        finally:
            if timer is not None and timer.active():
                timer.cancel()
        if outcome["error"]:
            raise CommandFailed(
                PULL_FAILED,
                _scrub(self._pullMessage(ref, outcome["error"]), secrets),
                shared.progress.extra(),
            )
        image = await self.inspect(ref)
        if image is None:
            raise CommandFailed(
                PULL_FAILED,
                f"Pulling {ref.canonical} ended before the image was complete "
                "(the engine closed the stream without an error).",
            )
        shared.progress.done = True
        self._emit(shared, f"Pulled {ref.canonical}")
        self.log.info("Pulled image {image} ({id})", image=ref.canonical, id=image["id"])
        return {"image": ref.canonical, "image_id": image["id"], **shared.progress.extra()}

    @staticmethod
    def _pullMessage(ref: ImageRef, cause: str) -> str:
        cause = " ".join(cause.split())[:800]
        text = f"Pulling {ref.canonical} failed: {cause}"
        low = cause.lower()
        if any(w in low for w in ("unauthorized", "denied", "authentication required", "no basic auth")):
            text += " (check the registry credentials in the runtime or the node profile)"
        elif "not found" in low or "manifest unknown" in low:
            text += " (check the image name and tag)"
        return text

    # -- transfer ------------------------------------------------------------------------

    async def transfer(
        self,
        ref: ImageRef,
        progress: Progress,
        *,
        expect_id: str | None = None,
        expect_rootfs: str | None = None,
        load_as: ImageRef | None = None,
    ) -> dict[str, Any]:
        """
        Stream the backend's C{docker save} of C{ref} into the engine's image load, resuming
        where the backend allows it (see L{imagetransfer}).

        @param expect_id: the image id the node was told to run, when known (query).
        @param expect_rootfs: its rootfs digest, when known (query).
        @param load_as: the name the engine gives the loaded image instead of C{ref} (a
            private name: the caller verifies the image before it takes C{ref}).
        @raise CommandFailed: C{invalid_command} for references the backend cannot serve,
            C{server_image_mismatch}, C{image_transfer_failed}, C{transfer_stalled}, or
            C{runtime_error}.
        """
        if self._http is None or not self._backend_url or self._credential is None:
            raise CommandFailed(
                TRANSFER_FAILED, "Image transfer from the backend is not configured on this node."
            )
        name = ref.familiar_name
        tag = ref.effective_tag
        if ref.digest or not _TRANSFER_NAME_RE.match(name) or not _TRANSFER_TAG_RE.match(tag):
            raise CommandFailed(
                INVALID_COMMAND,
                f"Image {ref.original!r} cannot be transferred from the backend: it serves only "
                "name:tag references (no digests, no registry ports).",
            )
        transfer = ImageTransfer(
            self._reactor,
            self._engine,
            self._http,
            self._backend_url,
            self._credential,
            stall_sec=self.stall_sec,
            progress_interval=self.progress_interval,
            resume_attempts=self.resume_attempts,
            resume_delay=self.resume_delay,
        )
        outcome = await transfer.run(
            name, tag, progress, expect_id=expect_id, expect_rootfs=expect_rootfs,
            load_as=load_as.canonical if load_as is not None else None,
        )
        image = await self.inspect(load_as or ref)
        if image is None:
            loaded = ", ".join(outcome.get("loaded") or []) or "nothing"
            raise CommandFailed(
                TRANSFER_FAILED,
                f"Transferring {name}:{tag}: the backend's archive loaded {loaded}, not "
                f"{name}:{tag}.",
            )
        outcome.pop("loaded", None)
        progress(f"Loaded {name}:{tag} ({outcome['bytes_done']} bytes)", **outcome)
        self.log.info(
            "Loaded image {image} from the backend ({size} bytes, resumed {resumed} times)",
            image=f"{name}:{tag}", size=outcome["bytes_done"], resumed=outcome.get("resumed", 0),
        )
        return {"image": ref.canonical, "image_id": image["id"], **outcome}

    # -- dispatch ------------------------------------------------------------------------

    async def ensure(
        self,
        ref: ImageRef,
        source: str | None,
        progress: Callable[..., None],
        auth: dict[str, str] | None = None,
        *,
        expect_id: str | None = None,
        expect_rootfs: str | None = None,
    ) -> dict[str, Any]:
        """
        Make C{ref} present per C{image_source}: C{None} uses the local image (pulling it
        when absent), C{pull_from_registry} pulls, C{transfer_from_server} transfers unless
        the tag is present (and is the pinned image, when C{expect_id}/C{expect_rootfs} say
        which).
        C{progress(phase, message, **extra)} receives C{pull_image}/C{transfer_image}.
        """
        if source == "transfer_from_server":
            # Skipped when the tag is already here and is the pinned image, when a pin is known
            # (protocol 10.4; a multi-GB transfer for an image already present is waste).
            local = await self.inspect(ref)
            if local is not None and (
                not (expect_id or expect_rootfs) or image_matches(local, expect_id, expect_rootfs)
            ):
                progress(
                    "transfer_image",
                    f"Image {ref.canonical} is already on this node ({local['id'][:19]}); not "
                    "transferring it again",
                    progress_pct=100,
                )
                return {"image": ref.canonical, "image_id": local["id"], "local": True,
                        "transfer_skipped": True}
            progress("transfer_image", f"Transferring image {ref.canonical} from the backend")
            return await self.transfer(
                ref,
                lambda msg, **kw: progress("transfer_image", msg, **kw),
                expect_id=expect_id,
                expect_rootfs=expect_rootfs,
            )
        if source is None:
            local = await self.inspect(ref)
            if local is not None:
                progress("pull_image", f"Using the local image {ref.canonical}", progress_pct=100)
                return {"image": ref.canonical, "image_id": local["id"], "local": True}
            progress("pull_image", f"Image {ref.canonical} is not present locally; pulling it")
        else:
            progress("pull_image", f"Pulling image {ref.canonical}")
        return await self.pull(ref, lambda msg, **kw: progress("pull_image", msg, **kw), auth)
