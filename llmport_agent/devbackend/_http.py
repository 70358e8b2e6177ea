"""
The stand-in backend's HTTP side: enrollment, rotation, image transfer, the dev admin API.

Error bodies are shaped like the real backend's (FastAPI): C{{"detail": "..."}} for
HTTP errors, C{{"detail": [{"type", "loc", "msg", "input"}, ...]}} for 422 validation errors,
a plain-text C{Internal Server Error} for 500.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request
from zope.interface import implementer

from llmport_agent.core.values import define
from llmport_agent.devbackend._state import (
    GENERATION_CURRENT,
    AuthError,
    EnrollRejected,
    StoreFailure,
)

if TYPE_CHECKING:
    from llmport_agent.devbackend.backend import DevBackend, ImageEntry

#: Image references the real backend accepts for transfer (protocol 4.4).
IMAGE_REF = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9._/-]*(?::[a-zA-Z0-9._-]+)?")

_CHUNK = 64 * 1024


@define
class ImageFetch:
    """
    One C{GET .../images/save} answered with the tar: which node asked (by its credential),
    for what, from which byte, how many bytes went out and whether the answer was finished.
    """

    node_id: str
    reference: str
    start: int
    bytes_sent: int = 0
    complete: bool = False
_REDACTED = "<redacted>"


def json_response(request: Request, code: int, body: Any) -> bytes:
    """Set C{code} and a JSON content type on C{request}; return the encoded C{body}."""
    request.setResponseCode(code)
    request.setHeader(b"content-type", b"application/json")
    return json.dumps(body).encode("utf-8")


def _internal_error(request: Request) -> bytes:
    request.setResponseCode(500)
    request.setHeader(b"content-type", b"text/plain; charset=utf-8")
    return b"Internal Server Error"


def _header(request: Request, name: bytes) -> str | None:
    value = request.getHeader(name)
    if value is None:
        return None
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def _query(request: Request, name: bytes) -> str | None:
    values = (request.args or {}).get(name)
    if not values:
        return None
    return values[-1].decode("utf-8", "replace")


def _redact(body: Any) -> Any:
    """The request body as echoed in a 422 error, without the enrollment token."""
    if isinstance(body, dict) and "enrollment_token" in body:
        return {**body, "enrollment_token": _REDACTED}
    return body


def _is_json_type(content_type: str) -> bool:
    main = content_type.split(";", 1)[0].strip().lower()
    kind, _, sub = main.partition("/")
    return kind == "application" and (sub == "json" or sub.endswith("+json"))


def read_json_body(request: Request) -> tuple[Any, list[dict[str, Any]]]:
    """
    Read a request body the way FastAPI does for a model parameter.

    @return: C{(body, errors)}; C{errors} is a non-empty pydantic-style list when the body is
        missing, not JSON, or sent with a non-JSON content type.
    """
    raw = request.content.read() if request.content is not None else b""
    content_type = _header(request, b"content-type")
    if content_type is not None and not _is_json_type(content_type):
        text = raw.decode("utf-8", "replace")
        return text, [
            {
                "type": "model_attributes_type",
                "loc": ["body"],
                "msg": "Input should be a valid dictionary or object to extract fields from",
                "input": text,
            }
        ]
    if not raw:
        return None, [{"type": "missing", "loc": ["body"], "msg": "Field required", "input": None}]
    try:
        return json.loads(raw), []
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        pos = getattr(e, "pos", 0)
        reason = getattr(e, "msg", "invalid encoding")
        return None, [
            {
                "type": "json_invalid",
                "loc": ["body", pos],
                "msg": "JSON decode error",
                "input": {},
                "ctx": {"error": reason},
            }
        ]


def validate_model(
    body: Any, fields: dict[str, tuple[str, bool]]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """
    A small pydantic stand-in. C{fields} maps a name to C{(kind, required)} where kind is
    C{str}, C{str?} (string or null), C{dict} or C{any}.
    """
    if not isinstance(body, dict):
        return {}, [
            {
                "type": "model_attributes_type",
                "loc": ["body"],
                "msg": "Input should be a valid dictionary or object to extract fields from",
                "input": _redact(body),
            }
        ]
    errors: list[dict[str, Any]] = []
    out: dict[str, Any] = {}
    for name, (kind, required) in fields.items():
        if name not in body:
            if required:
                errors.append(
                    {
                        "type": "missing",
                        "loc": ["body", name],
                        "msg": "Field required",
                        "input": _redact(body),
                    }
                )
            continue
        value = body[name]
        shown = _REDACTED if name == "enrollment_token" else value
        if kind == "str" or (kind == "str?" and value is not None):
            if not isinstance(value, str):
                errors.append(
                    {
                        "type": "string_type",
                        "loc": ["body", name],
                        "msg": "Input should be a valid string",
                        "input": shown,
                    }
                )
                continue
        elif kind == "dict" and not isinstance(value, dict):
            errors.append(
                {
                    "type": "dict_type",
                    "loc": ["body", name],
                    "msg": "Input should be a valid dictionary",
                    "input": value,
                }
            )
            continue
        out[name] = value
    return out, errors


class JsonResource(Resource):
    """
    A resource whose unknown children and unsupported methods answer like FastAPI:
    C{404 {"detail": "Not Found"}} and C{405 {"detail": "Method Not Allowed"}}.
    """

    def getChild(self, path: bytes, request: Request) -> Resource:
        return NotFound()

    def render(self, request: Request) -> bytes | int:
        method = request.method.decode("ascii", "replace") if request.method else ""
        handler = getattr(self, f"render_{method}", None)
        if handler is None:
            return json_response(request, 405, {"detail": "Method Not Allowed"})
        result: bytes | int = handler(request)
        return result


class NotFound(JsonResource):
    """Every path below answers 404."""

    isLeaf = True

    def render(self, request: Request) -> bytes:
        return json_response(request, 404, {"detail": "Not Found"})


def _admin_allowed(backend: DevBackend, request: Request) -> bool:
    expected = backend.admin_token
    if expected is None:
        return True
    return _header(request, b"authorization") == f"Bearer {expected}"


class TokensResource(JsonResource):
    """C{POST .../nodes/enrollment-tokens} (dev: no user auth unless an admin token is set)."""

    isLeaf = True

    def __init__(self, backend: DevBackend) -> None:
        super().__init__()
        self._backend = backend

    def render_POST(self, request: Request) -> bytes:
        if not _admin_allowed(self._backend, request):
            return json_response(request, 401, {"detail": "Not authenticated"})
        raw = request.content.read() if request.content is not None else b""
        note: Any = None
        if raw.strip():
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):
                return json_response(
                    request,
                    422,
                    {"detail": [{"type": "json_invalid", "loc": ["body"], "msg": "JSON decode error"}]},
                )
            values, errors = validate_model(body, {"note": ("str?", False)})
            if errors:
                return json_response(request, 422, {"detail": errors})
            note = values.get("note")
        return json_response(request, 200, self._backend.mint_token(note))


class EnrollResource(JsonResource):
    """C{POST .../nodes/enroll} (protocol 1)."""

    isLeaf = True
    log = Logger()

    _FIELDS = {
        "enrollment_token": ("str", True),
        "agent_id": ("str", True),
        "host": ("str?", False),
        "capabilities": ("dict", False),
        "version": ("str?", False),
    }

    def __init__(self, backend: DevBackend) -> None:
        super().__init__()
        self._backend = backend

    def render_POST(self, request: Request) -> bytes | int:
        self._backend.enroll_requests += 1
        if self._backend.faults.hang_enroll:
            self.log.info("devbackend fault: enrollment request left unanswered")
            return NOT_DONE_YET
        body, errors = read_json_body(request)
        if errors:
            return json_response(request, 422, {"detail": errors})
        values, errors = validate_model(body, self._FIELDS)
        if errors:
            return json_response(request, 422, {"detail": errors})
        forwarded = _header(request, b"x-forwarded-for")
        if forwarded and forwarded.split(",")[0].strip():
            caller = forwarded.split(",")[0].strip()
        else:
            peer = request.getClientAddress()
            caller = str(getattr(peer, "host", "") or "")
        try:
            reply = self._backend.state.enroll(
                values["enrollment_token"],
                values["agent_id"],
                values.get("host"),
                values.get("capabilities", {}),
                values.get("version"),
                caller,
            )
        except EnrollRejected as e:
            return json_response(request, 401, {"detail": e.detail})
        except StoreFailure as e:
            self.log.warn("devbackend: enrollment insert fails: {why}", why=str(e))
            return _internal_error(request)
        return json_response(request, 200, reply)


class RotateResource(JsonResource):
    """
    C{POST .../nodes/credentials/rotate} (protocol 2): revoke the presented credential at
    once, then reply (or, with C{faults.lose_rotate_reply}, abort without a reply).
    """

    isLeaf = True
    log = Logger()

    def __init__(self, backend: DevBackend) -> None:
        super().__init__()
        self._backend = backend

    def render_POST(self, request: Request) -> bytes | int:
        try:
            _node, record = self._backend.state.authenticate(_header(request, b"authorization"))
        except AuthError as e:
            return json_response(request, 401, {"detail": e.detail})
        reply = self._backend.state.rotate(record)
        if self._backend.faults.lose_rotate_reply:
            self.log.info("devbackend fault: rotate reply lost for node {node_id}",
                          node_id=reply["node_id"])
            assert request.channel is not None
            transport = request.channel.transport
            if transport is not None:
                transport.abortConnection()  # type: ignore[attr-defined]
            return NOT_DONE_YET
        return json_response(request, 200, reply)


class ClusterSecretResource(JsonResource):
    """
    C{GET .../nodes/secrets/{credential_ref}} (protocol 10.6): the Ray cluster token of an
    environment, for a node that is one of its members. 401 bad credential, 404 not a member
    (or no such secret).
    """

    isLeaf = True

    def __init__(self, backend: DevBackend) -> None:
        super().__init__()
        self._backend = backend

    def render_GET(self, request: Request) -> bytes:
        try:
            node, _cred = self._backend.state.authenticate(_header(request, b"authorization"))
        except AuthError as e:
            return json_response(request, 401, {"detail": e.detail})
        path = request.postpath or []
        ref = path[0].decode("utf-8", "replace") if len(path) == 1 else ""
        secret = self._backend.cluster_secrets.get(ref)
        if secret is None or node.id not in secret.members:
            return json_response(request, 404, {"detail": "Secret not found."})
        secret.fetches += 1
        return json_response(request, 200, {"token": secret.token})


class LogSinkResource(JsonResource):
    """
    C{GET .../api/node-files/log-sink} (bearer, protocol 10.7): C{{"loki_url": ...}} with the
    backend's L{DevBackend.log_sink_url}; 404 when it has none, and on an April backend (which
    has no such route). 401 for a bad credential.
    """

    isLeaf = True

    def __init__(self, backend: DevBackend) -> None:
        super().__init__()
        self._backend = backend

    def render_GET(self, request: Request) -> bytes:
        b = self._backend
        b.log_sink_requests += 1
        if b.state.generation != GENERATION_CURRENT:
            return json_response(request, 404, {"detail": "Not Found"})
        try:
            b.state.authenticate(_header(request, b"authorization"))
        except AuthError as e:
            return json_response(request, 401, {"detail": e.detail})
        if b.log_sink_url is None:
            return json_response(request, 404, {"detail": "Not Found"})
        return json_response(request, 200, {"loki_url": b.log_sink_url})


@implementer(IPushProducer)
class _Pacer:
    """Flow control for a streamed response: pauses while the peer is slow."""

    def __init__(self) -> None:
        self.paused = False
        self.stopped = False
        self._waiter: Deferred[None] | None = None

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        self._wake()

    def stopProducing(self) -> None:
        self.stopped = True
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.callback(None)

    async def ready(self) -> None:
        while self.paused and not self.stopped:
            self._waiter = Deferred()
            await self._waiter


class ImageSaveResource(JsonResource):
    """
    C{GET .../api/node-files/images/save?image=&tag=} (protocol 4.4): a registered
    C{docker save} tar, chunked, without Content-Length, file reads off the reactor.
    """

    isLeaf = True
    log = Logger()

    def __init__(self, backend: DevBackend) -> None:
        super().__init__()
        self._backend = backend

    def render_GET(self, request: Request) -> bytes | int:
        try:
            node, _cred = self._backend.state.authenticate(_header(request, b"authorization"))
        except AuthError as e:
            return json_response(request, 401, {"detail": e.detail})
        image = _query(request, b"image")
        if image is None:
            return json_response(
                request,
                422,
                {"detail": [{"type": "missing", "loc": ["query", "image"],
                             "msg": "Field required", "input": None}]},
            )
        tag = _query(request, b"tag")
        reference = f"{image}:{tag if tag is not None else 'latest'}"
        if IMAGE_REF.fullmatch(reference) is None:
            return json_response(
                request, 400, {"detail": f"Invalid image reference: {reference!r}"}
            )
        entry = self._backend.images.get(reference)
        if entry is None:
            return json_response(request, 404, {"detail": f"Image {reference} not found."})
        start = 0
        end: int | None = None
        if self._backend.image_route_current:
            expect_id = _query(request, b"expect_id")
            expect_rootfs = _query(request, b"expect_rootfs")
            if (expect_id or expect_rootfs) and not (
                (expect_rootfs and expect_rootfs == entry.rootfs_digest)
                or (expect_id and expect_id == entry.image_id)
            ):
                return json_response(
                    request,
                    409,
                    {"detail": f"This server holds a different build of the runtime image (id "
                               f"{entry.image_id or 'unknown'}) than the node was asked to run (id "
                               f"{expect_id or 'unset'}); retrying will not change this."},
                )
            if entry.image_id:
                try:
                    size = os.path.getsize(entry.tar_path)
                except OSError:
                    return json_response(request, 404, {"detail": f"Image {reference} not found."})
                answer = _byte_range(_header(request, b"range"), size)
                request.setHeader(b"content-type", b"application/x-tar")
                request.setHeader(b"accept-ranges", b"bytes")
                request.setHeader(b"x-image-id", entry.image_id.encode("ascii", "replace"))
                if answer is None:
                    request.setResponseCode(416)
                    request.setHeader(b"content-range", f"bytes */{size}".encode())
                    return b""
                start, end, ranged = answer
                if ranged:
                    request.setResponseCode(206)
                    request.setHeader(b"content-range", f"bytes {start}-{end - 1}/{size}".encode())
                else:
                    request.setResponseCode(200)
                request.setHeader(b"content-length", str(end - start).encode())
        if end is None:
            request.setResponseCode(200)
            request.setHeader(b"content-type", b"application/x-tar")
            if entry.image_size is not None:
                request.setHeader(b"x-image-size", str(entry.image_size).encode("ascii"))
        fetch = ImageFetch(node.id, reference, start)
        self._backend.image_fetches.append(fetch)
        d = Deferred.fromCoroutine(self._stream(request, entry, start, end, fetch))
        self._backend.track(d)

        def _failed(f: Failure) -> None:
            self.log.failure("devbackend: image stream failed", failure=f)

        d.addErrback(_failed)
        return NOT_DONE_YET

    async def _stream(
        self, request: Request, entry: ImageEntry, start: int = 0, end: int | None = None,
        fetch: ImageFetch | None = None,
    ) -> None:
        runner = self._backend.runner
        pacer = _Pacer()
        done = request.notifyFinish()
        done.addErrback(lambda _f: pacer.stopProducing())
        request.registerProducer(pacer, True)
        limit = self._backend.faults.image_abort_after
        sent = 0
        handle = await runner.run(open, entry.tar_path, "rb")
        if start:
            await runner.run(handle.seek, start)
        left = None if end is None else end - start
        try:
            while not pacer.stopped:
                want = _CHUNK if limit is None else min(_CHUNK, limit - sent)
                if left is not None:
                    want = min(want, left - sent)
                chunk = await runner.run(handle.read, want) if want > 0 else b""
                if pacer.stopped:
                    return
                if chunk:
                    request.write(chunk)
                    sent += len(chunk)
                    if fetch is not None:
                        fetch.bytes_sent = sent
                if limit is not None and sent >= limit:
                    self.log.info("devbackend fault: image stream cut after {n} bytes", n=sent)
                    request.unregisterProducer()
                    transport: Any = request.channel.transport if request.channel else None
                    if transport is not None:
                        transport.loseConnection()
                    return
                if not chunk:
                    request.unregisterProducer()
                    request.finish()
                    if fetch is not None:
                        fetch.complete = True
                    return
                await pacer.ready()
        finally:
            await runner.run(handle.close)


def _byte_range(header: str | None, size: int) -> tuple[int, int, bool] | None:
    """
    C{(start, end, ranged)}: C{[start, end)} of C{Range: bytes=<start>-[<last>]} within
    C{size} bytes (the whole file, C{ranged} false, without a usable header), or C{None} for a
    range that starts past the end (416). Suffix and multiple ranges are answered with the
    whole file, as a server may.
    """
    if not header or not header.strip().lower().startswith("bytes="):
        return 0, size, False
    spec = header.strip()[len("bytes="):]
    if "," in spec:
        return 0, size, False
    first, _, last = spec.partition("-")
    if not first.strip().isdigit():
        return 0, size, False
    start = int(first)
    if start >= size:
        return None
    end = size
    if last.strip().isdigit():
        end = min(size, int(last) + 1)
        if end <= start:
            return None
    return start, end, True


def _decode_path(request: Request) -> list[str]:
    return [seg.decode("utf-8", "replace") for seg in (request.postpath or [])]


class DevApiResource(JsonResource):
    """
    The dev admin API (JSON; for the demo and operators): nodes, inventories, events,
    commands, timelines, runtimes.
    """

    isLeaf = True

    def __init__(self, backend: DevBackend) -> None:
        super().__init__()
        self._backend = backend

    def render_GET(self, request: Request) -> bytes:
        if not _admin_allowed(self._backend, request):
            return json_response(request, 401, {"detail": "Not authenticated"})
        b = self._backend
        path = [p for p in _decode_path(request) if p]
        found: Any
        routes: dict[tuple[str, int], Callable[[list[str]], Any]] = {
            ("nodes", 1): lambda p: b.nodes(),
            ("nodes", 2): lambda p: b.node(p[1]),
            ("runtimes", 1): lambda p: b.runtimes(),
            ("runtimes", 2): lambda p: b.runtime(p[1]),
            ("commands", 1): lambda p: b.commands(),
            ("commands", 2): lambda p: b.command(p[1]) if p[1] in b.state.commands else None,
            ("costs", 1): lambda p: b.costs(),
            ("ray-environments", 1): lambda p: [b.ray_environment(k) for k in sorted(b.ray_environments)],
            ("ray-environments", 2): lambda p: b.ray_environment(p[1]),
            ("backend", 1): lambda p: {
                "generation": b.generation,
                "reaper_scale": b.reaper_scale,
            },
        }
        sub_node: dict[str, Callable[[str], Any]] = {
            "inventory": b.latest_inventory,
            "inventories": b.inventories,
            "events": b.events,
            "commands": b.commands,
            "frames": b.frames,
            "anomalies": b.anomalies,
            "costs": b.costs,
            "models": b.model_availability,
        }
        if not path:
            return json_response(request, 404, {"detail": "Not Found"})
        route = routes.get((path[0], len(path)))
        if route is not None:
            found = route(path)
            if found is None:
                return json_response(request, 404, {"detail": "Not Found"})
            return json_response(request, 200, found)
        if len(path) == 3 and path[0] == "nodes" and path[2] in sub_node:
            if b.node(path[1]) is None:
                return json_response(request, 404, {"detail": "Node not found"})
            return json_response(request, 200, sub_node[path[2]](path[1]))
        if len(path) == 3 and path[0] == "commands" and path[2] == "timeline":
            if path[1] not in b.state.commands:
                return json_response(request, 404, {"detail": "Command not found"})
            return json_response(request, 200, b.timeline(path[1]))
        return json_response(request, 404, {"detail": "Not Found"})

    def _runtimes_post(self, request: Request, path: list[str]) -> bytes:
        """C{POST /dev/runtimes} (create + deploy) and C{POST /dev/runtimes/<id>/<action>}."""
        body, errors = read_json_body(request)
        if errors:
            return json_response(request, 422, {"detail": errors})
        body = body if isinstance(body, dict) else {}
        b = self._backend
        try:
            if len(path) == 1:
                node_id = body.get("node_id")
                provider = body.get("provider")
                if not isinstance(node_id, str) or b.node(node_id) is None:
                    return json_response(request, 404, {"detail": "Node not found"})
                if not isinstance(provider, dict) or not isinstance(provider.get("type"), str):
                    return json_response(request, 422, {"detail": "provider must be an object with a type"})
                command = b.create_runtime(
                    node_id,
                    provider,
                    name=str(body.get("name") or "runtime"),
                    runtime_id=body.get("runtime_id") if isinstance(body.get("runtime_id"), str) else None,
                    generic_config=body.get("generic_config") if isinstance(body.get("generic_config"), dict) else None,
                    model_sync=body.get("model_sync") if isinstance(body.get("model_sync"), dict) else None,
                    container_name=body.get("container_name") if isinstance(body.get("container_name"), str) else None,
                )
            else:
                if path[1] not in b.runtime_defs:
                    return json_response(request, 404, {"detail": "Runtime not found"})
                changes = body.get("provider")
                tail = body.get("tail")
                command = b.runtime_action(
                    path[1],
                    path[2],
                    provider_changes=changes if isinstance(changes, dict) else None,
                    generic_config=body.get("generic_config") if isinstance(body.get("generic_config"), dict) else None,
                    tail=tail if isinstance(tail, int) and not isinstance(tail, bool) else 300,
                )
        except KeyError as e:
            return json_response(request, 404, {"detail": f"Not Found: {e}"})
        except TypeError as e:
            return json_response(request, 422, {"detail": str(e)})
        return json_response(request, 200, command)

    def _ray_post(self, request: Request, path: list[str]) -> bytes:
        """C{POST /dev/ray-environments} (reconcile), C{.../<id>/teardown} and C{.../<id>/retry}."""
        b = self._backend
        if len(path) == 3:
            action = {"teardown": b.teardown_ray_environment, "retry": b.retry_ray_environment}.get(path[2])
            if action is None:
                return json_response(request, 404, {"detail": "Not Found"})
            try:
                return json_response(request, 200, action(path[1]))
            except KeyError:
                return json_response(request, 404, {"detail": "Environment not found"})
        body, errors = read_json_body(request)
        if errors:
            return json_response(request, 422, {"detail": errors})
        try:
            return json_response(request, 200, b.start_ray_environment(body if isinstance(body, dict) else {}))
        except ValueError as e:
            return json_response(request, 422, {"detail": str(e)})

    def _cancel(self, request: Request, command_id: str) -> bytes:
        """C{POST /dev/commands/<id>/cancel}: 409 when terminal or on the April generation."""
        if command_id not in self._backend.state.commands:
            return json_response(request, 404, {"detail": "Command not found"})
        try:
            command = self._backend.cancel_command(command_id)
        except ValueError as e:
            return json_response(request, 409, {"detail": str(e)})
        return json_response(request, 200, command)

    def render_POST(self, request: Request) -> bytes:
        if not _admin_allowed(self._backend, request):
            return json_response(request, 401, {"detail": "Not authenticated"})
        path = [p for p in _decode_path(request) if p]
        if path and path[0] == "runtimes" and len(path) in (1, 3):
            return self._runtimes_post(request, path)
        if len(path) == 3 and path[0] == "commands" and path[2] == "cancel":
            return self._cancel(request, path[1])
        if path and path[0] == "ray-environments" and len(path) in (1, 3):
            return self._ray_post(request, path)
        if len(path) != 3 or path[0] != "nodes" or path[2] not in ("commands", "profile"):
            return json_response(request, 404, {"detail": "Not Found"})
        node_id = path[1]
        if self._backend.node(node_id) is None:
            return json_response(request, 404, {"detail": "Node not found"})
        body, errors = read_json_body(request)
        if errors:
            return json_response(request, 422, {"detail": errors})
        if path[2] == "profile":
            if body is not None and not isinstance(body, dict):
                return json_response(request, 422, {"detail": "profile must be an object or null"})
            self._backend.set_profile(node_id, body)
            return json_response(request, 200, self._backend.node(node_id))
        values, errors = validate_model(
            body,
            {
                "command_type": ("str", True),
                "payload": ("dict", False),
                "idempotency_key": ("str?", False),
                "correlation_id": ("str?", False),
                "timeout_sec": ("any", False),
            },
        )
        timeout = values.get("timeout_sec")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int)):
            errors.append(
                {"type": "int_type", "loc": ["body", "timeout_sec"],
                 "msg": "Input should be a valid integer", "input": timeout}
            )
        if errors:
            return json_response(request, 422, {"detail": errors})
        command = self._backend.issue_command(
            node_id,
            values["command_type"],
            values.get("payload", {}),
            idempotency_key=values.get("idempotency_key"),
            correlation_id=values.get("correlation_id"),
            timeout_sec=timeout,
        )
        return json_response(request, 200, command)
