"""
Images: the local image, C{pull_from_registry} and C{transfer_from_server}.

Pulls stream the engine's progress (per-layer bytes aggregated into C{progress_pct},
C{bytes_done} and C{bytes_total}, at most about one report a second), surface errors that
arrive inside the stream, are abandoned by a stall watchdog (C{pull_stalled}) and are
joined when two commands pull the same reference. Registry credentials come from the
payload or profile and go to the engine in the request header only: never to disk, logs,
progress or error text.

Transfers stream the backend's C{docker save} tar into the engine's image load while it
arrives (with flow control), report progress against C{X-Image-Size}, and stop the load on
cancel or failure.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

import docker
from docker.types import CancellableStream
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss

from ..commands.base import INVALID_COMMAND, CommandFailed
from .engine import DockerEngine, EngineError, StreamClosed, StreamControl
from .imageload import BodySource, SourceError, load_thread
from .policy import ImageRef, parse_image_ref
from .tarfilter import ImageTarFilter

PULL_FAILED = "pull_failed"
PULL_STALLED = "pull_stalled"
TRANSFER_FAILED = "transfer_failed"
TRANSFER_STALLED = "transfer_stalled"

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
    response = api._post(
        api._url("/images/create"),
        params={"fromImage": repository, "tag": tag},
        headers=headers,
        stream=True,
        timeout=None,
    )
    stream = CancellableStream(api._stream_helper(response, decode=True), response)
    control.attach(stream)
    api._raise_for_status(response)
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


class _BodyFeeder(Protocol):
    """
    Receives the transfer's body on the reactor and hands it to the loading thread
    through a L{BodySource}, pausing the download while too much is buffered.
    """

    def __init__(self, engine: DockerEngine, high_water: int = 16 * 1024 * 1024) -> None:
        self._engine = engine
        self.source = BodySource(self._consumedFromThread)
        self.received = 0
        self.consumed = 0
        self.high_water = high_water
        self.paused = False
        self.done: Deferred[None] = Deferred()
        self.on_data: Callable[[], None] = lambda: None

    def _producer(self) -> Any:
        # The response body's transport is a push producer (pause/resume/stop).
        return self.transport

    def dataReceived(self, data: bytes) -> None:
        self.received += len(data)
        self.source.queue.put(data)
        self.on_data()
        if not self.paused and self.received - self.consumed > self.high_water and self.transport:
            self.paused = True
            self._producer().pauseProducing()

    def connectionLost(self, reason: Failure = ResponseDone()) -> None:  # type: ignore[assignment]
        if reason.check(ResponseDone, PotentialDataLoss):
            self.source.queue.put(BodySource.END)
            if not self.done.called:
                self.done.callback(None)
        else:
            self.source.queue.put(SourceError(f"the backend connection broke after {self.received} bytes"))
            if not self.done.called:
                self.done.errback(reason)

    def _consumedFromThread(self, n: int) -> None:
        self._engine.callFromThread(self._consumed, n)

    def _consumed(self, n: int) -> None:
        self.consumed += n
        if self.paused and self.received - self.consumed < self.high_water // 2 and self.transport:
            self.paused = False
            self._producer().resumeProducing()

    def abort(self) -> None:
        """Stop the download and end the loader's input with an error."""
        self.source.queue.put(SourceError("image transfer aborted"))
        if self.transport is not None and not self.done.called:
            try:
                self._producer().stopProducing()
            except Exception:  # noqa: BLE001
                pass


def _inspect_image(client: docker.DockerClient, name: str) -> dict[str, Any] | None:
    try:
        info = client.api.inspect_image(name)
    except docker.errors.NotFound:
        return None
    return {
        "id": info.get("Id", ""),
        "repo_tags": list(info.get("RepoTags") or []),
        "repo_digests": list(info.get("RepoDigests") or []),
        "size": int(info.get("Size") or 0),
    }


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
    ) -> None:
        self._reactor = reactor
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

    async def transfer(self, ref: ImageRef, progress: Progress) -> dict[str, Any]:
        """
        Stream the backend's C{docker save} of C{ref} into the engine's image load.

        @raise CommandFailed: C{invalid_command} for references the backend cannot serve,
            C{transfer_failed}, C{transfer_stalled}, or C{runtime_error}.
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
        url = (
            self._backend_url.rstrip("/")
            + "/api/node-files/images/save?"
            + urlencode({"image": name, "tag": tag})
        )
        token = self._credential()
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/x-tar"}
        self.log.info("Transferring image {image} from the backend", image=f"{name}:{tag}")
        try:
            response = await self._http.get(url, headers=headers, unbuffered=True, timeout=60)
        except CancelledError:
            raise
        except Exception as exc:
            raise CommandFailed(
                TRANSFER_FAILED,
                _scrub(
                    f"Transferring {name}:{tag} failed: the backend could not be reached: "
                    f"{type(exc).__name__}: {exc}",
                    (token,),
                ),
            ) from None
        if response.code != 200:
            try:
                body = (await response.text())[:300]
            except Exception:  # noqa: BLE001
                body = ""
            raise CommandFailed(
                TRANSFER_FAILED,
                _scrub(
                    f"Transferring {name}:{tag} failed: the backend answered HTTP "
                    f"{response.code}: {' '.join(body.split())}",
                    (token,),
                ),
            )
        size_header = response.headers.getRawHeaders(b"x-image-size") or []
        try:
            total = int(size_header[0]) if size_header else 0
        except ValueError:
            total = 0

        feeder = _BodyFeeder(self._engine)
        control = StreamControl()
        clock = self._reactor
        state = {"last_data": clock.seconds(), "last_emit": 0.0, "stalled": False}
        timer: Any = None

        def extra() -> dict[str, Any]:
            out: dict[str, Any] = {"bytes_done": feeder.received}
            if total:
                out["bytes_total"] = total
                out["progress_pct"] = min(99, int(feeder.received * 100 / total))
            return out

        def on_data() -> None:
            now = clock.seconds()
            state["last_data"] = now
            if now - state["last_emit"] >= self.progress_interval:
                state["last_emit"] = now
                progress(f"Transferring {name}:{tag} from the backend", **extra())

        feeder.on_data = on_data
        response.deliverBody(feeder)

        def watchdog() -> None:
            nonlocal timer
            if feeder.done.called:
                timer = None
                return
            idle = clock.seconds() - state["last_data"]
            if idle >= self.stall_sec:
                state["stalled"] = True
                feeder.abort()
                control.close("stalled")
                timer = None
                return
            timer = clock.callLater(max(0.1, self.stall_sec - idle), watchdog)

        timer = clock.callLater(self.stall_sec, watchdog)
        body_error: list[Failure] = []

        def _bodyFailed(f: Failure) -> None:
            body_error.append(f)
            control.close("download failed")

        feeder.done.addErrback(_bodyFailed)
        # Only the requested tag may come out of the archive (see tarfilter).
        tar = ImageTarFilter(f"{name}:{tag}", lambda text: parse_image_ref(text).canonical)
        try:
            outcome = await self._engine.stream(
                load_thread, control, feeder.source, tar, what=f"loading image {name}:{tag}"
            )
        except CancelledError:
            feeder.abort()
            raise
        except (StreamClosed, EngineError) as exc:
            feeder.abort()
            if state["stalled"]:
                raise CommandFailed(
                    TRANSFER_STALLED,
                    f"Transferring {name}:{tag} from the backend made no progress for "
                    f"{self.stall_sec:g} s and was abandoned after {feeder.received} bytes.",
                    extra(),
                ) from None
            if body_error:
                raise CommandFailed(
                    TRANSFER_FAILED,
                    f"Transferring {name}:{tag} failed: the backend connection broke after "
                    f"{feeder.received} bytes; nothing was loaded.",
                    extra(),
                ) from None
            if isinstance(exc, EngineError) and exc.unreachable:
                raise
            cause = exc.explanation if isinstance(exc, EngineError) else str(exc)
            raise CommandFailed(
                TRANSFER_FAILED,
                f"Transferring {name}:{tag} failed: the engine's image load failed: {cause}",
                extra(),
            ) from None
        except CommandFailed as exc:
            # The archive was refused (it names other references): the upload was broken off.
            feeder.abort()
            self.log.warn("Refused the image archive from the backend: {why}", why=exc.error_message)
            exc.result.update(extra())
            raise
        finally:
            if timer is not None and timer.active():
                timer.cancel()
        if body_error:
            raise CommandFailed(
                TRANSFER_FAILED,
                f"Transferring {name}:{tag} failed: the backend connection broke after "
                f"{feeder.received} bytes.",
                extra(),
            )
        if outcome["error"]:
            raise CommandFailed(
                TRANSFER_FAILED,
                f"Transferring {name}:{tag} failed: the engine refused the image: "
                f"{' '.join(str(outcome['error']).split())[:500]}",
                extra(),
            )
        image = await self.inspect(ref)
        if image is None:
            loaded = ", ".join(outcome["loaded"]) or "nothing"
            raise CommandFailed(
                TRANSFER_FAILED,
                f"Transferring {name}:{tag}: the backend's archive loaded {loaded}, not "
                f"{name}:{tag}.",
            )
        final = extra()
        final["progress_pct"] = 100
        progress(f"Loaded {name}:{tag} ({feeder.received} bytes)", **final)
        self.log.info(
            "Loaded image {image} from the backend ({size} bytes)", image=f"{name}:{tag}", size=feeder.received
        )
        return {"image": ref.canonical, "image_id": image["id"], **final}

    # -- dispatch ------------------------------------------------------------------------

    async def ensure(
        self,
        ref: ImageRef,
        source: str | None,
        progress: Callable[..., None],
        auth: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """
        Make C{ref} present per C{image_source}: C{None} uses the local image (pulling it
        when absent), C{pull_from_registry} pulls, C{transfer_from_server} transfers.
        C{progress(phase, message, **extra)} receives C{pull_image}/C{transfer_image}.
        """
        if source == "transfer_from_server":
            progress("transfer_image", f"Transferring image {ref.canonical} from the backend")
            return await self.transfer(ref, lambda msg, **kw: progress("transfer_image", msg, **kw))
        if source is None:
            local = await self.inspect(ref)
            if local is not None:
                progress("pull_image", f"Using the local image {ref.canonical}", progress_pct=100)
                return {"image": ref.canonical, "image_id": local["id"], "local": True}
            progress("pull_image", f"Image {ref.canonical} is not present locally; pulling it")
        else:
            progress("pull_image", f"Pulling image {ref.canonical}")
        return await self.pull(ref, lambda msg, **kw: progress("pull_image", msg, **kw), auth)
