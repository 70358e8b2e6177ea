"""
A stand-in for the backend's C{GET <base>/api/node-files/images/save?image=&tag=}
(protocol 4.4): bearer auth, a C{docker save} tar streamed in chunks without
Content-Length, C{X-Image-Size}, and failure modes (break the connection, go silent).
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
    @ivar break_after: abort the connection after this many body bytes.
    @ivar stall_after: stop writing (connection left open) after this many body bytes.
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
        self.requests.append({"path": path, "args": args, "authorization": auth})
        if path != self.base_path + SAVE_PATH:
            return self._json(request, 404, "Not Found")
        if auth != f"Bearer {self.credential}":
            return self._json(request, 401, "Credential is invalid or revoked.")
        data = self.tars.get((args.get("image", ""), args.get("tag", "")))
        if data is None:
            return self._json(request, 404, "Image not found on the server.")
        request.setHeader(b"content-type", b"application/x-tar")
        request.setHeader(b"x-image-size", str(len(data)).encode())
        self._open.add(request)
        state = {"offset": 0, "done": False}

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
            if self.break_after is not None and offset >= self.break_after:
                transport: Any = request.channel.transport
                transport.abortConnection()
                return
            piece = data[offset : offset + self.chunk]
            if not piece:
                state["done"] = True
                request.finish()
                return
            request.write(piece)
            state["offset"] = offset + len(piece)
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
