"""
Peer image seeding (protocol 10.6): C{serve_runtime_image} and C{ensure_runtime_image} with
C{source: {peer_url, token}}.

A node that holds the verified runtime image C{docker save}s it to a tar under
C{IMAGE_DOWNLOAD_DIR} and serves it over plain HTTP (C{GET /image}, bearer token compared in
constant time, single C{Range}) on the fabric IP and port it is given, until C{expected_peers}
complete downloads or the timeout; then it stops listening and deletes the tar. A peer
downloads the tar into C{IMAGE_DOWNLOAD_DIR} with resume (C{Range}), loads it into the engine
through the workloads' archive filter, and deletes it; the caller re-verifies the pin (a peer
serving a wrong image ends in C{runtime_image_mismatch}).

Disk space is checked before anything is written. Saving, reading, writing and loading run on
the thread pools; the token never reaches a log line, a result or the journal (the journal
scrubs C{token} fields).
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from twisted.internet import error as ierror
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint
from twisted.internet.protocol import Protocol
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.web.client import Agent, ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from .. import safefs
from ..commands.base import INVALID_COMMAND, CommandContext, CommandFailed, HandlerSpec
from ..opshttp import BoundedSite
from ..workloads.engine import DockerEngine, StreamControl
from ..workloads.imageload import BodySource, load_thread
from ..workloads.policy import parse_image_ref
from ..workloads.tarfilter import ImageTarFilter
from . import imagepin
from .bundle import RuntimeBundle

IMAGE_SEED_FAILED = "image_seed_failed"
#: Free space kept beyond the tar itself.
SPACE_MARGIN = 256 * 1024 * 1024
#: Largest image tar accepted from a peer.
MAX_IMAGE_BYTES = 1024 ** 4
MAX_TIMEOUT_SEC = 6 * 3600.0
MAX_PEERS = 256
MAX_TOKEN = 4096
CHUNK = 1024 * 1024
_HIGH_WATER = 8 * 1024 * 1024
_RANGE_RE = re.compile(r"^bytes=(\d{1,15})-(\d{0,15})$")
_CONTENT_RANGE_RE = re.compile(r"^bytes (\d{1,15})-(\d{1,15})/(\d{1,15})$")

log = Logger()


def _fail(message: str, **extra: Any) -> CommandFailed:
    return CommandFailed(IMAGE_SEED_FAILED, message, extra)


# -- thread functions ---------------------------------------------------------------------


def prepare_dir(path: str) -> int:
    """Thread function: free bytes of C{path} (created 0700 when missing)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    return int(shutil.disk_usage(path).free)


def remove_file(path: str, name: str) -> None:
    """Thread function: delete C{name} in C{path} (never through a link); absent is fine."""
    fd = safefs.open_dir(path)
    try:
        try:
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            pass
    finally:
        os.close(fd)


def image_size(client: Any, name: str) -> int:
    """Thread function: the engine's size of image C{name}."""
    return int(client.api.inspect_image(name).get("Size") or 0)


def save_thread(client: Any, control: StreamControl, name: str, path: str, name_in_dir: str, limit: int) -> int:
    """Thread function: C{docker save name} into C{path/name_in_dir} (new file, 0600); its size."""
    dfd = safefs.open_dir(path)
    try:
        try:
            os.unlink(name_in_dir, dir_fd=dfd)
        except FileNotFoundError:
            pass
        fd = safefs.create_file_at(dfd, name_in_dir, 0o600, os.O_WRONLY)
    finally:
        os.close(dfd)
    size = 0
    try:
        for chunk in client.api.get_image(name, chunk_size=CHUNK):
            control.check()
            size += len(chunk)
            if size > limit:
                raise OSError(errno.ENOSPC, f"the image tar grew past {limit} bytes (the free space)")
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    return size


def open_read(path: str, name: str) -> tuple[int, int]:
    """Thread function: C{(fd, size)} of the regular file C{path/name}, never through a link."""
    dfd = safefs.open_dir(path)
    try:
        fd, st = safefs.open_file_at(dfd, name)
    finally:
        os.close(dfd)
    return fd, int(st.st_size)


def open_append(path: str, name: str, keep: bool) -> tuple[int, int]:
    """Thread function: C{(fd, size)} of C{path/name} for writing at its end (created 0600;
    emptied unless C{keep})."""
    dfd = safefs.open_dir(path)
    try:
        try:
            fd, st = safefs.open_file_at(dfd, name, os.O_WRONLY)
        except FileNotFoundError:
            fd = safefs.create_file_at(dfd, name, 0o600, os.O_WRONLY)
        if not keep:
            os.ftruncate(fd, 0)
        size = os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(dfd)
    return fd, size


def write_all(fd: int, data: bytes) -> int:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    return len(data)


class FileSource(BodySource):
    """A L{BodySource} reading a tar file from the loading thread itself (bounded reads)."""

    def __init__(self, fd: int) -> None:
        super().__init__(lambda n: None)
        self._fd = fd

    def batches(self, control: StreamControl, max_bytes: int = 4 * CHUNK) -> Iterator[list[bytes]]:
        while True:
            control.check()
            data = os.read(self._fd, max_bytes)
            if not data:
                return
            yield [data]


def load_file_thread(client: Any, control: StreamControl, path: str, name: str, ref: str,
                     load_as: str | None = None) -> dict[str, Any]:
    """
    Thread function: load the tar C{path/name} into the engine through L{ImageTarFilter}
    (named C{load_as} instead of C{ref} when given).
    """
    fd, _ = open_read(path, name)
    try:
        tar = ImageTarFilter(ref, lambda text: parse_image_ref(text).canonical, load_as)
        return load_thread(client, control, FileSource(fd), tar)
    finally:
        os.close(fd)


# -- the server ---------------------------------------------------------------------------


class _Serving:
    """State of one C{serve_runtime_image}."""

    def __init__(self, reactor: Any, pool: Any, fd: int, size: int, token: bytes, expected: int, image_id: str) -> None:
        self.reactor = reactor
        self.pool = pool
        self.fd = fd
        self.size = size
        self.token = token
        self.expected = expected
        self.image_id = image_id
        self.max_active = min(64, expected * 2 + 2)
        self.active: set[_FileSender] = set()
        self.completed = 0
        self.bytes_sent = 0
        self.finished = False
        self.done: Deferred[bool] = Deferred()

    def finish(self, complete: bool) -> None:
        if not self.finished:
            self.finished = True
            self.done.callback(complete)


class _FileSender:
    """Writes one byte range of the tar to a request, reading on the pool, paced by the peer."""

    def __init__(self, state: _Serving, request: Any, start: int, end: int) -> None:
        self.state = state
        self.request = request
        self.offset = start
        self.end = end  # inclusive
        self.paused = False
        self.stopped = False
        self._resume: Deferred[None] | None = None

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        if self._resume is not None:
            d, self._resume = self._resume, None
            d.callback(None)

    def stopProducing(self) -> None:
        self.stopped = True
        self.resumeProducing()

    async def run(self) -> None:
        s = self.state
        s.active.add(self)
        self.request.registerProducer(self, True)
        try:
            while self.offset <= self.end and not self.stopped and not s.finished:
                if self.paused:
                    self._resume = Deferred()
                    await self._resume
                    continue
                n = min(CHUNK, self.end - self.offset + 1)
                data = await s.pool.run(os.pread, s.fd, n, self.offset)
                if not data or self.stopped:
                    break
                self.request.write(data)
                self.offset += len(data)
                s.bytes_sent += len(data)
        finally:
            s.active.discard(self)
            if self.request.channel is not None:  # None: the peer went away while a read ran
                self.request.unregisterProducer()
        if self.stopped or self.offset <= self.end:
            if not self.stopped:
                self.request.loseConnection()
            return
        self.request.finish()
        if self.end == s.size - 1:
            s.completed += 1
            log.info("A peer downloaded the runtime image ({done}/{expected})", done=s.completed, expected=s.expected)
            if s.completed >= s.expected:
                s.finish(True)


class ImageResource(Resource):
    """C{GET /image}: the tar, for a bearer of the token."""

    isLeaf = True

    def __init__(self, state: _Serving) -> None:
        super().__init__()
        self.state = state

    def render_GET(self, request: Any) -> Any:
        s = self.state
        request.setHeader(b"content-type", b"text/plain")
        given = request.getHeader(b"authorization") or b""
        scheme, _, value = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(value.strip(), s.token):
            request.setResponseCode(401)
            request.setHeader(b"www-authenticate", b"Bearer")
            return b"a valid bearer token is required\n"
        if s.finished:
            request.setResponseCode(503)
            return b"seeding has ended\n"
        if len(s.active) >= s.max_active:
            request.setResponseCode(503)
            request.setHeader(b"retry-after", b"5")
            return b"too many downloads at once; retry\n"
        start, end = 0, s.size - 1
        raw = (request.getHeader(b"range") or b"").decode("latin-1").strip()
        code = 200
        if raw:
            m = _RANGE_RE.match(raw)
            if m is None:
                code = 200  # a form this server does not do (several ranges): the whole tar
            else:
                start = int(m.group(1))
                end = min(int(m.group(2)), s.size - 1) if m.group(2) else s.size - 1
                if start >= s.size or end < start:
                    request.setResponseCode(416)
                    request.setHeader(b"content-range", f"bytes */{s.size}".encode())
                    return b""
                code = 206
                request.setHeader(b"content-range", f"bytes {start}-{end}/{s.size}".encode())
        request.setResponseCode(code)
        request.setHeader(b"content-type", b"application/x-tar")
        request.setHeader(b"accept-ranges", b"bytes")
        request.setHeader(b"x-image-id", s.image_id.encode("ascii", "replace"))
        request.setHeader(b"content-length", str(end - start + 1).encode())
        sender = _FileSender(s, request, start, end)
        request.notifyFinish().addErrback(lambda _: sender.stopProducing())
        Deferred.fromCoroutine(sender.run()).addErrback(
            lambda f: log.failure("Serving the runtime image failed", f)
        )
        return NOT_DONE_YET


#: Connections the seeder holds at once beyond its downloads (peers retrying, a 401 or a 503).
_EXTRA_CONNECTIONS = 16


class _QuietSite(BoundedSite):
    """
    The seeder listens on a fabric address every machine of that network reaches, before any
    token is checked: the ops endpoint's bounds (L{BoundedSite}: a capped number of connections,
    headers within a deadline, no request body, so nothing is spooled to disk), and no access log.
    """

    def log(self, request: Any) -> None:
        """No access log (the agent logs what matters itself)."""


def seeding_site(state: _Serving, reactor: Any) -> _QuietSite:
    """The HTTP site serving C{state}'s tar (its downloads plus L{_EXTRA_CONNECTIONS} at once)."""
    return _QuietSite(ImageRoot(state), reactor, max_connections=state.max_active + _EXTRA_CONNECTIONS,
                      idle_timeout=120.0)


def _unicast_ip(value: object, key: str) -> str:
    try:
        address = ipaddress.ip_address(str(value).strip()) if isinstance(value, str) else None
    except ValueError:
        address = None
    if address is None or address.is_unspecified or address.is_multicast:
        raise CommandFailed(INVALID_COMMAND, f"{key} must be the unicast fabric IP address to serve on")
    return str(address)


def _number(payload: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = payload.get(key)
    if value is None or value == "":
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise CommandFailed(INVALID_COMMAND, f"{key} must be a number")
    if value < low:
        raise CommandFailed(INVALID_COMMAND, f"{key} must be at least {low:g}")
    return float(min(value, high))  # compared first: an integer past any float is not converted


def _token(value: object, key: str) -> bytes:
    if not isinstance(value, str) or not value or len(value) > MAX_TOKEN or any(c in value for c in "\r\n "):
        raise CommandFailed(INVALID_COMMAND, f"{key} is required (one word of at most {MAX_TOKEN} characters)")
    return value.encode("utf-8")


class ImageSeeding:
    """
    Both sides of peer seeding for one node.

    @param download_dir: C{IMAGE_DOWNLOAD_DIR}.
    @param pool: the I/O pool (file reads and writes).
    """

    def __init__(self, reactor: Any, engine: DockerEngine, pool: Any, download_dir: str, manager: Any,
                 *, stall_sec: float = 60.0, resume_attempts: int = 5, resume_delay: float = 1.0) -> None:
        self._reactor = reactor
        self._engine = engine
        self._pool = pool
        self.download_dir = download_dir
        self._manager = manager
        self.stall_sec = stall_sec
        self.resume_attempts = resume_attempts
        self.resume_delay = resume_delay

    # -- serve --------------------------------------------------------------------------

    async def serve_runtime_image(self, ctx: CommandContext) -> dict[str, Any]:
        payload = ctx.command.payload if isinstance(ctx.command.payload, Mapping) else {}
        bundle: RuntimeBundle = self._manager.bundle(payload, required=True)
        ip = _unicast_ip(payload.get("bind_ip"), "bind_ip")
        port = payload.get("port")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise CommandFailed(INVALID_COMMAND, "port must be a port number from 1 to 65535")
        token = _token(payload.get("token"), "token")
        expected = int(_number(payload, "expected_peers", 1, 1, MAX_PEERS))
        timeout = _number(payload, "timeout_sec", 3600.0, 1, MAX_TIMEOUT_SEC)
        name = bundle.image.canonical
        report = imagepin.require_match(
            await self._manager.identify(bundle), name, bundle.digest, bundle.rootfs_digest,
            why=" (a node serves only the verified image)")
        image_id = report.identity.image_id
        free = await self._pool.run(prepare_dir, self.download_dir)
        need = await self._engine.call(image_size, image_id, what=f"inspecting image {name}")
        if free < need + SPACE_MARGIN:
            raise _fail(f"Not enough disk space in IMAGE_DOWNLOAD_DIR {self.download_dir} to save {name}: "
                        f"{free} bytes free, about {need + SPACE_MARGIN} needed. Free space there and retry.")
        tar_name = f"serve-{image_id.split(':')[-1][:32]}.tar"
        started = self._reactor.seconds()
        ctx.progress("save_image", f"Saving {name} for peers")
        try:
            try:
                size = await self._engine.stream(save_thread, StreamControl(), name, self.download_dir, tar_name,
                                                 free - SPACE_MARGIN // 2, what=f"saving image {name}")
            except CommandFailed:
                raise
            except Exception as exc:  # noqa: BLE001 - one line for the user
                raise _fail(f"Saving {name} for peers failed: {str(exc)[:300]}. Check the engine and disk, then retry.") from None
            fd, _ = await self._pool.run(open_read, self.download_dir, tar_name)
            try:
                return await self._serve(ctx, fd, size, token, expected, timeout, ip, port, image_id, started)
            finally:
                os.close(fd)
        finally:
            await self._pool.run(remove_file, self.download_dir, tar_name)

    async def _serve(self, ctx: CommandContext, fd: int, size: int, token: bytes, expected: int, timeout: float,
                     ip: str, port: int, image_id: str, started: float) -> dict[str, Any]:
        state = _Serving(self._reactor, self._pool, fd, size, token, expected, image_id)
        site = seeding_site(state, self._reactor)
        endpoint_type = TCP6ServerEndpoint if ":" in ip else TCP4ServerEndpoint
        try:
            listening = await endpoint_type(self._reactor, port, interface=ip).listen(site)
        except ierror.CannotListenError as exc:
            raise _fail(f"Cannot serve the runtime image on {ip}:{port} ({exc.socketError}): "
                        "is the IP an address of this node and the port free?") from None
        ctx.progress("serving", f"Serving the runtime image ({size} bytes) on {ip}:{port} to {expected} peer(s)")
        timer = self._reactor.callLater(timeout, state.finish, False)
        try:
            complete = await state.done
        finally:
            if timer.active():
                timer.cancel()
            state.finish(False)
            await listening.stopListening()
            for sender in list(state.active):
                sender.stopProducing()
                sender.request.loseConnection()
        return {
            "served": state.completed,
            "expected": expected,
            "bytes_sent": state.bytes_sent,
            "seconds": round(self._reactor.seconds() - started, 3),
            "timed_out": not complete,
        }

    # -- fetch --------------------------------------------------------------------------

    async def load_from_peer(self, bundle: RuntimeBundle, source: Mapping[str, Any], ctx: CommandContext,
                             load_as: str) -> None:
        """
        The peer loader of L{RayManager}: download, load under the private name C{load_as},
        delete the tar (the caller verifies the image before it gets the bundle's name).
        """
        url = source.get("peer_url")
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme != "http" or not parts.hostname or parts.username or parts.password:
            raise CommandFailed(INVALID_COMMAND, "source.peer_url must be http://<peer ip>:<port>/image")
        assert isinstance(url, str)
        token = _token(source.get("token"), "source.token")
        name = bundle.image.canonical
        tar_name = f"peer-{bundle.digest.split(':')[-1][:32]}.tar"
        await self._pool.run(prepare_dir, self.download_dir)
        try:
            size = await self._download(url, token, tar_name, ctx, name)
            ctx.progress("load_image", f"Loading {name} ({size} bytes) from the peer's tar")
            try:
                outcome = await self._engine.stream(load_file_thread, StreamControl(), self.download_dir, tar_name,
                                                    name, load_as, what=f"loading image {name}")
            except CommandFailed as exc:
                raise _fail(f"Loading {name} from the peer failed: {exc.error_message}") from None
            except Exception as exc:  # noqa: BLE001
                raise _fail(f"Loading {name} from the peer failed: {str(exc)[:300]}") from None
            if outcome.get("error"):
                raise _fail(f"The engine refused the image from the peer: {' '.join(str(outcome['error']).split())[:300]}")
        finally:
            await self._pool.run(remove_file, self.download_dir, tar_name)

    async def _download(self, url: str, token: bytes, tar_name: str, ctx: CommandContext, name: str) -> int:
        agent = Agent(self._reactor, connectTimeout=30)
        have = 0
        total: int | None = None
        failures = 0
        keep = False
        while True:
            headers = Headers({b"authorization": [b"Bearer " + token], b"user-agent": [b"llmport-agent"]})
            if have:
                headers.addRawHeader(b"range", f"bytes={have}-".encode())
            try:
                response = await agent.request(b"GET", url.encode("ascii", "replace"), headers)
            except Exception as exc:  # noqa: BLE001 - a dial failure: retried
                why = type(exc).__name__
                response = None
            if response is not None:
                code = response.code
                if code in (401, 403):
                    response.deliverBody(_Discard())
                    raise _fail(f"The peer refused the seeding token (HTTP {code}); the backend must send the "
                                "token the serving node was given.")
                if code == 416 and total is not None and have >= total:
                    response.deliverBody(_Discard())
                    return have
                if code == 200:
                    have, keep = 0, False
                    total = response.length if isinstance(response.length, int) else None
                elif code == 206:
                    m = _CONTENT_RANGE_RE.match(_header(response, b"content-range"))
                    if m is None or int(m.group(1)) != have:
                        response.deliverBody(_Discard())
                        raise _fail("The peer answered a resume with the wrong byte range.")
                    total, keep = int(m.group(3)), True
                else:
                    response.deliverBody(_Discard())
                    raise _fail(f"The peer answered HTTP {code} for the runtime image; is it serving "
                                "(serve_runtime_image) on that address?")
                if total is None or total > MAX_IMAGE_BYTES:
                    response.deliverBody(_Discard())
                    raise _fail("The peer sent no usable size for the image tar.")
                free = await self._pool.run(prepare_dir, self.download_dir)
                if free < (total - have) + SPACE_MARGIN:
                    response.deliverBody(_Discard())
                    raise _fail(f"Not enough disk space in IMAGE_DOWNLOAD_DIR {self.download_dir} for {name}: "
                                f"{free} bytes free, {total - have + SPACE_MARGIN} needed. Free space and retry.")
                fd, have = await self._pool.run(open_append, self.download_dir, tar_name, keep)
                before = have
                writer = _ToFile(self._reactor, self._pool, fd, total - have, self.stall_sec)
                response.deliverBody(writer)
                try:
                    why = await writer.done
                finally:
                    os.close(fd)
                have += writer.written
                ctx.progress("peer_download", f"Downloading {name} from the peer", bytes_done=have,
                             bytes_total=total, progress_pct=min(99, int(have * 100 / max(1, total))))
                if have >= total:
                    return have
                failures = 0 if have > before else failures + 1
            else:
                failures += 1
            if failures > self.resume_attempts:
                raise _fail(f"Downloading {name} from the peer failed ({why}) at {have} of {total or '?'} bytes "
                            f"after {self.resume_attempts} resumes without progress. Check the peer and the fabric.")
            await deferLater(self._reactor, min(30.0, self.resume_delay * 2 ** max(0, failures - 1)), lambda: None)


def _header(response: Any, name: bytes) -> str:
    values = response.headers.getRawHeaders(name) or []
    return values[0].decode("latin-1").strip() if values else ""


class _Discard(Protocol):
    def dataReceived(self, data: bytes) -> None:
        self.transport.stopProducing()  # type: ignore[union-attr]


class _ToFile(Protocol):
    """A response body appended to a file on the pool, the peer paused while writes lag."""

    transport: Any

    def __init__(self, reactor: Any, pool: Any, fd: int, limit: int, stall_sec: float) -> None:
        self._reactor = reactor
        self._pool = pool
        self._fd = fd
        self._limit = limit
        self._buf = bytearray()
        self._writing = False
        self._ended: str | None = None
        self._paused = False
        self.received = 0
        self.written = 0
        self.done: Deferred[str] = Deferred()
        self._stall_sec = stall_sec
        self._watch = reactor.callLater(stall_sec, self._stalled)

    def _stalled(self) -> None:
        self._watch = None
        if self.transport is not None:
            self.transport.stopProducing()

    def dataReceived(self, data: bytes) -> None:
        if self._watch is not None and self._watch.active():
            self._watch.reset(self._stall_sec)
        room = self._limit - self.received
        if len(data) > room:
            data = data[:room]
            self.transport.stopProducing()
        self.received += len(data)
        self._buf += data
        if len(self._buf) > _HIGH_WATER and not self._paused:
            self._paused = True
            self.transport.pauseProducing()
        self._kick()

    def _kick(self) -> None:
        if self._writing:
            return
        if not self._buf:
            if self._ended is not None and not self.done.called:
                self.done.callback(self._ended)
            return
        chunk = bytes(self._buf)
        self._buf.clear()
        self._writing = True
        d: Deferred[int] = self._pool.run(write_all, self._fd, chunk) if chunk else succeed(0)
        d.addCallbacks(self._written, self._write_failed)

    def _written(self, n: int) -> None:
        self._writing = False
        self.written += n
        if self._paused and self._ended is None:
            self._paused = False
            self.transport.resumeProducing()
        self._kick()

    def _write_failed(self, failure: Any) -> None:
        self._writing = False
        self._buf.clear()
        if self._ended is None and self.transport is not None:
            self.transport.stopProducing()
        if not self.done.called:
            self.done.errback(_fail(f"Writing the image tar failed: {failure.getErrorMessage()[:200]}"))

    def connectionLost(self, reason: Any = None) -> None:
        if self._watch is not None and self._watch.active():
            self._watch.cancel()
        self._watch = None
        ok = reason is not None and reason.check(ResponseDone, PotentialDataLoss)
        self._ended = "ended" if ok else "the connection broke"
        self._kick()


class ImageRoot(Resource):
    def __init__(self, state: _Serving) -> None:
        super().__init__()
        self.putChild(b"image", ImageResource(state))


def seeding_handler_specs(seeding: ImageSeeding) -> dict[str, HandlerSpec]:
    return {
        # Not idempotent: the token is scrubbed from the journal, so a restart cannot resume it.
        "serve_runtime_image": HandlerSpec(seeding.serve_runtime_image, "runtime", False, MAX_TIMEOUT_SEC + 1800.0),
    }
