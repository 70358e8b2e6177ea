"""
A stand-in for the backend's C{GET <base>/api/node-files/images/save?image=&tag=}: bearer
auth, a C{docker save} tar streamed in chunks without Content-Length with C{X-Image-Size}
(protocol 4.4, and the current backend when it cannot export), or, with C{export} on, as
the current backend serves an export (protocol 10.4): C{Content-Length}, C{X-Image-Id},
C{Range} (206 / 416 C{bytes */size}), and C{409 {detail}} when C{expect_id} /
C{expect_rootfs} name another build. Failure modes: break the connection, go silent, answer
a range with 200.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

SAVE_PATH = "/api/node-files/images/save"


class ImageSaveResource(Resource):
    """
    @ivar tars: C{(image, tag) -> tar bytes}.
    @ivar break_after: abort the connection after this many body bytes (of each response).
    @ivar break_once_after: the same for the first response only.
    @ivar stall_after: stop writing (connection left open) after this many body bytes.
    @ivar export: answer as the current backend's export (Content-Length, X-Image-Id, Range).
    @ivar ids: C{(image, tag) -> (image id, rootfs digest)} for X-Image-Id and the 409 check.
    @ivar ignore_range: answer a ranged request with 200 and the whole tar.
    """

    isLeaf = True

    def __init__(self, reactor: Any, credential: str, base_path: str = "") -> None:
        super().__init__()
        self.reactor = reactor
        self.credential = credential
        self.base_path = base_path.rstrip("/")
        self.tars: dict[tuple[str, str], bytes] = {}
        self.chunk = 64 * 1024
        self.break_after: int | None = None
        self.stall_after: int | None = None
        self.break_once_after: int | None = None
        self.export = False
        self.ids: dict[tuple[str, str], tuple[str, str]] = {}
        self.ignore_range = False
        self.requests: list[dict[str, Any]] = []
        self.sent = 0
        self._calls: set[Any] = set()
        self._open: set[Request] = set()

    def _json(self, request: Request, code: int, detail: str) -> bytes:
        request.setResponseCode(code)
        request.setHeader(b"content-type", b"application/json")
        return json.dumps({"detail": detail}).encode()

    def render_GET(self, request: Request) -> Any:
        path = request.path.decode()
        args = {k.decode(): v[0].decode() for k, v in request.args.items()}
        auth = (request.getHeader("authorization") or "")
        ranged = request.getHeader("range")
        self.requests.append({"path": path, "args": args, "authorization": auth, "range": ranged})
        if path != self.base_path + SAVE_PATH:
            return self._json(request, 404, "Not Found")
        if auth != f"Bearer {self.credential}":
            return self._json(request, 401, "Credential is invalid or revoked.")
        key = (args.get("image", ""), args.get("tag", ""))
        data = self.tars.get(key)
        if data is None:
            return self._json(request, 404, "Image not found on the server.")
        image_id, rootfs = self.ids.get(key, ("", ""))
        want_id, want_rootfs = args.get("expect_id"), args.get("expect_rootfs")
        if (want_id or want_rootfs) and not (
            (want_rootfs and want_rootfs == rootfs) or (want_id and want_id == image_id)
        ):
            return self._json(
                request, 409, f"This server holds a different build (id {image_id or 'unknown'})."
            )
        request.setHeader(b"content-type", b"application/x-tar")
        start = 0
        limit_once = self.break_once_after
        self.break_once_after = None
        if self.export:
            request.setHeader(b"x-image-id", image_id.encode())
            request.setHeader(b"accept-ranges", b"bytes")
            if ranged and ranged.startswith("bytes=") and not self.ignore_range:
                first = ranged[len("bytes="):].split("-", 1)[0]
                start = int(first) if first.isdigit() else 0
                if start >= len(data):
                    request.setResponseCode(416)
                    request.setHeader(b"content-range", f"bytes */{len(data)}".encode())
                    return b""
                request.setResponseCode(206)
                request.setHeader(
                    b"content-range", f"bytes {start}-{len(data) - 1}/{len(data)}".encode()
                )
            request.setHeader(b"content-length", str(len(data) - start).encode())
        else:
            request.setHeader(b"x-image-size", str(len(data)).encode())
        self._open.add(request)
        state = {"offset": start, "done": False, "sent": 0}

        def finished(_: Any) -> None:
            state["done"] = True
            self._open.discard(request)

        request.notifyFinish().addBoth(finished)

        def step() -> None:
            self._calls.discard(call[0])
            if state["done"]:
                return
            offset = state["offset"]
            if self.stall_after is not None and offset >= self.stall_after:
                return  # silent, connection open
            cut = self.break_after if limit_once is None else limit_once
            if cut is not None and state["sent"] >= cut:
                transport: Any = request.channel.transport
                if state["sent"] == 0:
                    request.write(b"")  # the headers, then the connection ends: no body at all
                    transport.loseConnection()
                else:
                    transport.abortConnection()
                return
            piece = data[offset : offset + self.chunk]
            if not piece:
                state["done"] = True
                request.finish()
                return
            if cut is not None:
                piece = piece[: max(0, cut - state["sent"])] or piece
            request.write(piece)
            state["offset"] = offset + len(piece)
            state["sent"] += len(piece)
            self.sent += len(piece)
            call[0] = self.reactor.callLater(0, step)
            self._calls.add(call[0])

        call: list[Any] = [None]
        call[0] = self.reactor.callLater(0, step)
        self._calls.add(call[0])
        return NOT_DONE_YET

    def stop(self) -> None:
        """Cancel pending writes and drop open responses."""
        for c in list(self._calls):
            if c.active():
                c.cancel()
        self._calls.clear()
        for request in list(self._open):
            transport: Any = request.channel.transport if request.channel else None
            if transport is not None:
                transport.abortConnection()


async def serve(reactor: Any, resource: ImageSaveResource) -> tuple[Any, str]:
    """Listen on 127.0.0.1:<free port>; return (port, base URL including the base path)."""
    site = Site(resource)
    site.displayTracebacks = False
    port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(site)
    return port, f"http://127.0.0.1:{port.getHost().port}{resource.base_path}"


def stop_serving(port: Any, resource: ImageSaveResource) -> Deferred[Any]:
    resource.stop()
    return port.stopListening()
