"""
Peer image seeding (protocol 10.6): C{serve_runtime_image} and C{ensure_runtime_image} with
C{source: {peer_url, token}}.

A node that holds the verified runtime image listens at once on the fabric IP and port it is
given, C{docker save}s the image to a tar under C{IMAGE_DOWNLOAD_DIR} (answering C{503} with
C{Retry-After} meanwhile: the backend sends the receivers their command at the same moment),
then serves it over plain HTTP (C{GET /image}, bearer token compared in constant time, single
C{Range}, clamped to the file) until C{expected_peers} peers each received the whole file, or
the timeout; then it stops listening and deletes the tar.

The server listens where every machine of the fabric reaches it, before any token is checked:
connections that have not presented the token are few and short-lived (a header deadline of
L{PRE_AUTH_DEADLINE_S} seconds, at most L{PRE_AUTH_PER_HOST} per address and L{PRE_AUTH_MAX} in
all, the oldest dropped for a new one), so idle sockets never lock a real peer out; a peer counts
as served only once every byte of the file went to it (byte ranges tracked per address, and per
download id where the receiver names one: L{DOWNLOAD_ID_HEADER}).

A peer downloads the tar into C{IMAGE_DOWNLOAD_DIR} with resume (C{Range}) on a thread (large
reads straight to the file, no hand-off to the reactor per chunk), retrying a seeder that still
exports (refused connections, C{503}) for the command's budget with a progress message every
L{WAIT_NOTE_S} seconds; loads it into the engine through the workloads' archive filter under a
private name, and deletes it; the caller checks the pin before the image takes the bundle's
name (a peer serving a wrong image ends in C{runtime_image_mismatch}, its build nameless).

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
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from twisted.internet import error as ierror
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint
from twisted.internet.task import LoopingCall, deferLater
from twisted.logger import Logger
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from llmport_agent.core import safefs
from llmport_agent.core.values import define
from llmport_agent.ops.bounded import BoundedSite

from ..commands.base import INVALID_COMMAND, CommandContext, CommandFailed
from ..workloads.engine import DockerEngine, StreamControl
from ..workloads.imageload import BodySource, load_thread
from ..workloads.policy import parse_image_ref
from ..workloads.tarfilter import ImageTarFilter
from . import imagepin
from .bundle import RuntimeBundle
from .specs import MAX_TIMEOUT_SEC
from .specs import seeding_handler_specs as seeding_handler_specs

IMAGE_SEED_FAILED = "image_seed_failed"
#: Free space kept beyond the tar itself.
SPACE_MARGIN = 256 * 1024 * 1024
#: Largest image tar accepted from a peer.
MAX_IMAGE_BYTES = 1024 ** 4
MAX_PEERS = 256
MAX_TOKEN = 4096
CHUNK = 1024 * 1024
#: Bytes the seeder reads from the tar per pool call (one more is read ahead).
SEND_READ = 2 * 1024 * 1024
#: Bytes a receiver asks the socket for at once (written to the file as they come).
RECV_BUFFER = 4 * 1024 * 1024
_RANGE_RE = re.compile(r"^bytes=(\d{1,15})-(\d{0,15})$")
_CONTENT_RANGE_RE = re.compile(r"^bytes (\d{1,15})-(\d{1,15})/(\d{1,15})$")
_UNSATISFIED_RE = re.compile(r"^bytes \*/(\d{1,15})$")
#: Names one receiver's download (across its resumes), so that receivers behind one address are
#: told apart; without it a peer is its address.
DOWNLOAD_ID_HEADER = "X-Llmport-Download"
_DOWNLOAD_ID_RE = re.compile(r"[A-Za-z0-9-]{8,64}")
#: The path of a peer URL (it goes into the request line as it is).
_PATH_RE = re.compile(r"/[A-Za-z0-9._~/-]{0,256}")
#: Connections that have not presented the token: seconds to send their headers, how many one
#: address may hold, how many in all (the oldest is dropped for a new one).
PRE_AUTH_DEADLINE_S = 3.0
PRE_AUTH_PER_HOST = 4
PRE_AUTH_MAX = 32
#: A receiver says it still waits for its seeder this often (seconds).
WAIT_NOTE_S = 30.0
#: How long a receiver retries a seeder that is not serving yet when the command has no budget.
DEFAULT_PEER_WAIT_S = 300.0
#: Byte ranges remembered per peer address, and addresses tracked.
_MAX_SPANS = 256
_MAX_TRACKED = 4 * MAX_PEERS

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


def write_all(fd: int, data: bytes | memoryview) -> int:
    view = memoryview(data)
    n = len(view)
    while view:
        view = view[os.write(fd, view):]
    return n


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


# -- the receiver's download (a thread function per attempt) -------------------------------


@define
class Attempt:
    """
    What one request to the seeder came to.

    C{kind}: C{unreachable} (no connection, or closed before an answer), C{busy} (503),
    C{denied} (401/403), C{range} (416, C{total} from its Content-Range), C{http} (any other
    answer, C{why}), C{nospace}, or C{body} (a 200/206 whose bytes went to the file: C{have}
    bytes on disk now, C{complete} when all of them came).
    """

    kind: str
    why: str = ""
    code: int = 0
    retry_after: float | None = None
    total: int | None = None
    have: int = 0
    complete: bool = False


class Meter:
    """Bytes of the tar on disk so far: written by the download thread, read by the reactor."""

    def __init__(self, have: int = 0) -> None:
        self.have = have
        self.total: int | None = None


class _SocketCloser:
    """Unblocks the download thread (for L{StreamControl}: a cancelled command)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _headers(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit() or len(parts[1]) != 3:
        return 0, {}
    fields: dict[str, str] = {}
    for line in lines[1:64]:
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    return int(parts[1]), fields


def _header_int(text: str | None, limit: int = 10**15) -> int | None:
    if text is None or not text.isascii() or not text.isdigit() or len(text) > 15:
        return None
    value = int(text)
    return value if value <= limit else None


def fetch_attempt(client: Any, control: StreamControl, host: str, port: int, path: str, token: bytes,
                  download_id: str, directory: str, name: str, have: int, stall_sec: float, meter: Meter) -> Attempt:
    """
    Thread function (C{client} unused): one C{GET} of the seeder's tar, resuming at C{have};
    the body goes from the socket to C{directory/name} in large reads, with no other copy.

    @raise CommandFailed: writing the tar failed (a full disk).
    """
    try:
        sock = socket.create_connection((host, port), timeout=min(10.0, stall_sec))
    except OSError as exc:
        return Attempt("unreachable", why=exc.strerror or type(exc).__name__)
    try:
        control.attach(_SocketCloser(sock))
        sock.settimeout(stall_sec)
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        lines = [f"GET {path} HTTP/1.1", f"Host: {where}", "User-Agent: llmport-agent", "Connection: close",
                 f"{DOWNLOAD_ID_HEADER}: {download_id}"]
        if have:
            lines.append(f"Range: bytes={have}-")
        request = "\r\n".join(lines).encode("ascii") + b"\r\nAuthorization: Bearer " + token + b"\r\n\r\n"
        try:
            sock.sendall(request)
            buf = b""
            while b"\r\n\r\n" not in buf:
                if len(buf) > 16384:
                    return Attempt("http", why="the answer's headers are longer than 16 KiB")
                data = sock.recv(16384)
                if not data:
                    return Attempt("unreachable", why="the seeder closed the connection without an answer")
                buf += data
        except OSError as exc:
            control.check()
            return Attempt("unreachable", why=exc.strerror or type(exc).__name__)
        head, _, rest = buf.partition(b"\r\n\r\n")
        code, fields = _headers(head)
        if code in (401, 403):
            return Attempt("denied", code=code)
        if code == 503:
            return Attempt("busy", code=code, why="HTTP 503", retry_after=_header_int(fields.get("retry-after"), 3600))
        if code == 416:
            m = _UNSATISFIED_RE.match(fields.get("content-range", ""))
            return Attempt("range", code=code, total=int(m.group(1)) if m else None)
        if code not in (200, 206):
            return Attempt("http", code=code, why=f"HTTP {code}" if code else "not an HTTP answer")
        length = _header_int(fields.get("content-length"))
        if length is None:
            return Attempt("http", code=code, why="an answer without a Content-Length")
        if code == 206:
            m = _CONTENT_RANGE_RE.match(fields.get("content-range", ""))
            if m is None or int(m.group(1)) != have or int(m.group(2)) - have + 1 != length \
                    or int(m.group(2)) != int(m.group(3)) - 1:
                return Attempt("http", code=code, why="a resume answered with the wrong byte range")
            total = int(m.group(3))
        else:
            have, total = 0, length
        if total > MAX_IMAGE_BYTES:
            return Attempt("http", code=code, why=f"an image tar of {total} bytes (more than {MAX_IMAGE_BYTES})")
        free = prepare_dir(directory)
        if free < (total - have) + SPACE_MARGIN:
            return Attempt("nospace", why=f"Not enough disk space in IMAGE_DOWNLOAD_DIR {directory}: {free} bytes "
                                          f"free, {total - have + SPACE_MARGIN} needed. Free space there and retry.")
        fd, size = open_append(directory, name, code == 206)
        meter.total, meter.have = total, size
        try:
            if size != have:
                os.ftruncate(fd, 0)
                return Attempt("range", why="the partial tar changed on disk", total=None)
            left = length
            chunk: bytes | memoryview = rest[:left]
            buffer = bytearray(RECV_BUFFER)
            view = memoryview(buffer)
            while True:
                if chunk:
                    try:
                        write_all(fd, chunk)
                    except OSError as exc:
                        raise _fail(f"Writing the image tar to {directory} failed: {exc.strerror or exc}. "
                                    "Free space there and retry.") from None
                    left -= len(chunk)
                    have += len(chunk)
                    meter.have = have
                if left <= 0:
                    return Attempt("body", code=code, total=total, have=have, complete=True)
                try:
                    n = sock.recv_into(view[:min(RECV_BUFFER, left)])
                except TimeoutError:
                    return Attempt("body", code=code, total=total, have=have, why="stalled")
                except OSError as exc:
                    control.check()
                    return Attempt("body", code=code, total=total, have=have, why=exc.strerror or type(exc).__name__)
                if not n:
                    return Attempt("body", code=code, total=total, have=have, why="the connection broke")
                chunk = view[:n]
        finally:
            os.close(fd)
    finally:
        sock.close()


# -- the server ---------------------------------------------------------------------------


class _Serving:
    """State of one C{serve_runtime_image}: exporting (C{fd} None), serving, finished."""

    def __init__(self, reactor: Any, pool: Any, fd: int | None, size: int, token: bytes, expected: int,
                 image_id: str) -> None:
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
        #: Byte ranges [start, end) sent to each peer address, merged; addresses served whole.
        self.coverage: dict[str, list[tuple[int, int]]] = {}
        self.served_peers: set[str] = set()
        #: Reads of the tar running on the pool (the file is closed only once they are done).
        self.reads: set[Deferred[bytes]] = set()

    @property
    def exporting(self) -> bool:
        return self.fd is None

    def ready(self, fd: int, size: int) -> None:
        """The export is written: serve it."""
        self.fd, self.size = fd, size

    def finish(self, complete: bool) -> None:
        if not self.finished:
            self.finished = True
            self.done.callback(complete)

    def record(self, peer: str, start: int, end: int) -> None:
        """Bytes [start, end) went to C{peer}."""
        if end <= start:
            return
        spans = self.coverage.get(peer)
        if spans is None:
            if len(self.coverage) >= _MAX_TRACKED:
                return
            spans = self.coverage[peer] = []
        spans.append((start, end))
        spans.sort()
        merged = [spans[0]]
        for s, e in spans[1:]:
            if s <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((s, e))
        spans[:] = merged[:_MAX_SPANS]

    def served_whole(self, peer: str) -> bool:
        """Whether every byte of the file went to C{peer} (counted once per peer)."""
        if peer in self.served_peers or self.coverage.get(peer) != [(0, self.size)]:
            return False
        self.served_peers.add(peer)
        return True


class _FileSender:
    """Writes one byte range of the tar to a request, reading ahead on the pool, paced by the peer."""

    def __init__(self, state: _Serving, request: Any, start: int, end: int, peer: str) -> None:
        self.state = state
        self.request = request
        self.start = start
        self.offset = start
        self.end = end  # inclusive
        self.peer = peer
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

    def _read(self, offset: int) -> Deferred[bytes]:
        s = self.state
        d: Deferred[bytes] = s.pool.run(os.pread, s.fd, min(SEND_READ, self.end - offset + 1), offset)
        s.reads.add(d)

        def done(result: Any) -> Any:
            s.reads.discard(d)
            return result

        d.addBoth(done)
        return d

    async def run(self) -> None:
        s = self.state
        s.active.add(self)
        self.request.registerProducer(self, True)
        ahead: Deferred[bytes] | None = None
        try:
            while self.offset <= self.end and not self.stopped and not s.finished:
                if ahead is None:
                    ahead = self._read(self.offset)
                data = await ahead
                ahead = None
                if not data or self.stopped:
                    break
                following = self.offset + len(data)
                if following <= self.end:
                    ahead = self._read(following)  # read while this piece goes out
                self.request.write(data)
                self.offset = following
                s.bytes_sent += len(data)
                if self.paused and not self.stopped:
                    self._resume = Deferred()
                    await self._resume
        finally:
            if ahead is not None:
                ahead.addErrback(lambda _f: None)  # its bytes are not needed any more
            s.active.discard(self)
            s.record(self.peer, self.start, self.offset)
            if self.request.channel is not None:  # None: the peer went away while a read ran
                self.request.unregisterProducer()
        if self.stopped or self.offset <= self.end:
            if not self.stopped:
                self.request.loseConnection()
            return
        self.request.finish()
        if s.served_whole(self.peer):
            s.completed += 1
            log.info("A peer received the whole runtime image ({done}/{expected})", done=s.completed,
                     expected=s.expected)
            if s.completed >= s.expected:
                s.finish(True)


def _refuse(request: Any, code: int, text: bytes, retry_after: int | None = None) -> Any:
    """A short answer, and the connection closed after it."""
    request.setResponseCode(code)
    request.setHeader(b"content-type", b"text/plain")
    request.setHeader(b"connection", b"close")
    if retry_after is not None:
        request.setHeader(b"retry-after", str(retry_after).encode())
    if code == 401:
        request.setHeader(b"www-authenticate", b"Bearer")
    request.setHeader(b"content-length", str(len(text)).encode())
    channel = request.channel
    request.write(text)
    request.finish()
    if channel is not None:
        channel.loseConnection()
    return NOT_DONE_YET


class ImageResource(Resource):
    """C{GET /image}: the tar, for a bearer of the token."""

    isLeaf = True

    def __init__(self, state: _Serving) -> None:
        super().__init__()
        self.state = state

    def render_GET(self, request: Any) -> Any:
        s = self.state
        given = request.getHeader(b"authorization") or b""
        scheme, _, value = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(value.strip(), s.token):
            return _refuse(request, 401, b"a valid bearer token is required\n")
        site = getattr(request.channel, "site", None)
        if isinstance(site, _SeedSite) and not site.promote(request.channel):
            return _refuse(request, 503, b"too many connections at once; retry\n", retry_after=5)
        if s.finished:
            return _refuse(request, 503, b"seeding has ended\n")
        if s.exporting:
            return _refuse(request, 503, b"the image is still being exported; retry\n", retry_after=5)
        if len(s.active) >= s.max_active:
            return _refuse(request, 503, b"too many downloads at once; retry\n", retry_after=5)
        start, end = 0, s.size - 1
        raw = (request.getHeader(b"range") or b"").decode("latin-1").strip()
        code = 200
        m = _RANGE_RE.match(raw) if raw else None
        if m is not None:  # another form (several ranges, a suffix): the whole tar
            start = int(m.group(1))
            end = min(int(m.group(2)), s.size - 1) if m.group(2) else s.size - 1
            if start >= s.size or end < start:
                request.setResponseCode(416)
                request.setHeader(b"content-range", f"bytes */{s.size}".encode())
                request.setHeader(b"content-length", b"0")
                return b""
            code = 206
            request.setHeader(b"content-range", f"bytes {start}-{end}/{s.size}".encode())
        request.setResponseCode(code)
        request.setHeader(b"content-type", b"application/x-tar")
        request.setHeader(b"accept-ranges", b"bytes")
        request.setHeader(b"x-image-id", s.image_id.encode("ascii", "replace"))
        request.setHeader(b"content-length", str(end - start + 1).encode())
        peer = str(getattr(request.getClientAddress(), "host", "") or "")
        download = (request.getHeader(DOWNLOAD_ID_HEADER.lower().encode()) or b"").decode("latin-1")
        if _DOWNLOAD_ID_RE.fullmatch(download):
            peer = f"{peer} {download}"
        sender = _FileSender(s, request, start, end, peer)
        request.notifyFinish().addErrback(lambda _: sender.stopProducing())
        Deferred.fromCoroutine(sender.run()).addErrback(
            lambda f: log.failure("Serving the runtime image failed", f)
        )
        return NOT_DONE_YET


_Channel: Any = BoundedSite.protocol


class _SeedChannel(_Channel):  # type: ignore[misc]
    #: The kernel's own send buffer (autotuned), not the ops endpoint's 32 KiB: a bulk transfer
    #: through a buffer that small waits for a delayed ACK (40 ms) at every window, about
    #: 1.6 MB/s whatever the link (a 642 MB image took 400 s on loopback). Before the token, a
    #: client is only ever answered a few bytes (401, 503), so the small buffer bounds nothing.
    send_buffer = None

    def connectionLost(self, reason: Any = None) -> None:  # noqa: N802
        site = self.site
        super().connectionLost(reason)
        if isinstance(site, _SeedSite):
            site.forget(self)


class _SeedSite(BoundedSite):
    """
    The seeder listens on a fabric address every machine of that network reaches, before any
    token is checked. A connection that has not presented the token has L{PRE_AUTH_DEADLINE_S}
    seconds for its headers; one address holds at most L{PRE_AUTH_PER_HOST} such connections
    and all of them at most L{PRE_AUTH_MAX}: a new one makes the oldest go, so idle sockets
    never keep a peer out. Connections that presented the token are counted apart (at most
    C{max_authenticated}). The ops endpoint's other bounds hold (no request body, bounded
    headers) and there is no access log.
    """

    protocol = _SeedChannel

    def __init__(self, resource: Any, reactor: Any, max_authenticated: int) -> None:
        super().__init__(resource, reactor, max_connections=2 * PRE_AUTH_MAX + max_authenticated,
                         idle_timeout=120.0, header_deadline=PRE_AUTH_DEADLINE_S)
        self.max_authenticated = max_authenticated
        self._unauthenticated: dict[Any, str] = {}  # in the order they came
        self.authenticated: set[Any] = set()
        self.evicted = 0

    @property
    def unauthenticated(self) -> int:
        return len(self._unauthenticated)

    def buildProtocol(self, addr: Any) -> Any:  # noqa: N802
        host = str(getattr(addr, "host", "") or "")
        same = [c for c, h in self._unauthenticated.items() if h == host]
        if len(same) >= PRE_AUTH_PER_HOST:
            self._evict(same[0])
        elif len(self._unauthenticated) >= PRE_AUTH_MAX:
            self._evict(next(iter(self._unauthenticated)))
        channel = super().buildProtocol(addr)
        if channel is not None:
            self._unauthenticated[channel] = host
        return channel

    def _evict(self, channel: Any) -> None:
        self._unauthenticated.pop(channel, None)
        self.evicted += 1
        # It no longer counts now (its connectionLost comes later, after this accept batch;
        # release is idempotent): else the open count runs ahead and room gets made below.
        self.release(channel)
        channel.evict()

    def _make_room(self) -> bool:
        """Room for a new connection is made only by closing an unauthenticated one."""
        ranked = [(rank, c) for c in self._unauthenticated if (rank := c.eviction_rank()) is not None]
        if not ranked:
            return False
        self._evict(min(ranked, key=lambda r: r[0])[1])
        return True

    def promote(self, channel: Any) -> bool:
        """C{channel} presented the token: it no longer counts as unauthenticated."""
        if channel in self.authenticated:
            return True
        if len(self.authenticated) >= self.max_authenticated:
            return False
        self._unauthenticated.pop(channel, None)
        self.authenticated.add(channel)
        return True

    def forget(self, channel: Any) -> None:
        self._unauthenticated.pop(channel, None)
        self.authenticated.discard(channel)

    def log(self, request: Any) -> None:
        """No access log (the agent logs what matters itself)."""


def seeding_site(state: _Serving, reactor: Any) -> _SeedSite:
    """The HTTP site serving C{state}'s tar."""
    return _SeedSite(ImageRoot(state), reactor, max_authenticated=state.max_active + 16)


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
    """The seeding token: one word of printable ASCII (no whitespace, no control character)."""
    if (not isinstance(value, str) or not value or len(value) > MAX_TOKEN or not value.isascii()
            or not value.isprintable() or any(c.isspace() for c in value)):
        raise CommandFailed(INVALID_COMMAND, f"{key} is required (one word of at most {MAX_TOKEN} printable "
                                             "ASCII characters, no whitespace)")
    return value.encode("ascii")


def _peer_wait(ctx: CommandContext) -> float:
    """How long a receiver retries a seeder that is not serving yet: the command's budget."""
    budget = ctx.command.timeout_sec
    if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0:
        return float(min(max(budget, 30), MAX_TIMEOUT_SEC))
    return DEFAULT_PEER_WAIT_S


#: attempt(host, port, path, token, download_id, tar_name, have, meter) -> Attempt
AttemptRunner = Callable[[str, int, str, bytes, str, str, int, Meter], "Deferred[Attempt]"]


class ImageSeeding:
    """
    Both sides of peer seeding for one node.

    @param download_dir: C{IMAGE_DOWNLOAD_DIR}.
    @param pool: the I/O pool (file reads and writes).
    @param progress_interval: seconds between progress frames while a download runs.
    """

    def __init__(self, reactor: Any, engine: DockerEngine, pool: Any, download_dir: str, manager: Any,
                 *, stall_sec: float = 60.0, resume_attempts: int = 5, resume_delay: float = 1.0,
                 progress_interval: float = 5.0) -> None:
        self._reactor = reactor
        self._engine = engine
        self._pool = pool
        self.download_dir = download_dir
        self._manager = manager
        self.stall_sec = stall_sec
        self.resume_attempts = resume_attempts
        self.resume_delay = resume_delay
        self.progress_interval = progress_interval
        #: Runs one request to a seeder (a thread on the engine's stream pool); replaceable in tests.
        self.attempt: AttemptRunner = self._attempt_on_thread

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
        state = _Serving(self._reactor, self._pool, None, 0, token, expected, image_id)
        site = seeding_site(state, self._reactor)
        endpoint_type = TCP6ServerEndpoint if ":" in ip else TCP4ServerEndpoint
        try:
            listening = await endpoint_type(self._reactor, port, interface=ip).listen(site)
        except ierror.CannotListenError as exc:
            raise _fail(f"Cannot serve the runtime image on {ip}:{port} ({exc.socketError}): "
                        "is the IP an address of this node and the port free?") from None
        # Listening before the export is written: the receivers, told at the same moment, are
        # answered 503 (retry later) instead of a refused connection meanwhile.
        timer = self._reactor.callLater(timeout, state.finish, False)
        control = StreamControl()

        def ended(complete: bool) -> bool:
            control.close("seeding ended")  # a save still running stops
            return complete

        state.done.addCallback(ended)
        fd: int | None = None
        try:
            ctx.progress("save_image", f"Listening on {ip}:{port}; saving {name} for {expected} peer(s)")
            log.info("Saving the runtime image {image} for {n} peer(s) on {ip}:{port}", image=name, n=expected,
                     ip=ip, port=port)
            try:
                size = await self._engine.stream(save_thread, control, name, self.download_dir, tar_name,
                                                 free - SPACE_MARGIN // 2, what=f"saving image {name}")
            except CommandFailed:
                raise
            except Exception as exc:  # noqa: BLE001 - one line for the user
                if state.finished:
                    size = -1
                else:
                    raise _fail(f"Saving {name} for peers failed: {str(exc)[:300]}. Check the engine and disk, "
                                "then retry.") from None
            if not state.finished:
                fd, _ = await self._pool.run(open_read, self.download_dir, tar_name)
                state.ready(fd, size)
                ctx.progress("serving", f"Serving the runtime image ({size} bytes) on {ip}:{port} to {expected} peer(s)")
                log.info("Serving the runtime image {image} ({size} bytes) on {ip}:{port}", image=name, size=size,
                         ip=ip, port=port)
            complete = await state.done
        finally:
            if timer.active():
                timer.cancel()
            state.finish(False)
            await listening.stopListening()
            for sender in list(state.active):
                sender.stopProducing()
                sender.request.loseConnection()
            for channel in list(site.authenticated):
                channel.transport.loseConnection()
            if fd is not None:
                if state.reads:  # reads still on the pool: the descriptor must not be reused under them
                    await DeferredList(list(state.reads), consumeErrors=True)
                os.close(fd)
            await self._pool.run(remove_file, self.download_dir, tar_name)
        result = {
            "served": state.completed,
            "expected": expected,
            "bytes_sent": state.bytes_sent,
            "seconds": round(self._reactor.seconds() - started, 3),
            "timed_out": not complete,
        }
        log.info("Stopped serving the runtime image: {served} of {expected} peer(s) served, {sent} bytes sent",
                 served=state.completed, expected=expected, sent=state.bytes_sent)
        return result

    # -- fetch --------------------------------------------------------------------------

    async def load_from_peer(self, bundle: RuntimeBundle, source: Mapping[str, Any], ctx: CommandContext,
                             load_as: str) -> None:
        """
        The peer loader of L{RayManager}: download, load under the private name C{load_as},
        delete the tar (the caller verifies the image before it gets the bundle's name).
        """
        url = source.get("peer_url")
        parts = urlsplit(url) if isinstance(url, str) else None
        try:
            port = parts.port if parts is not None else None
        except ValueError:
            port = None
        if (parts is None or parts.scheme != "http" or not parts.hostname or parts.username or parts.password
                or port is None or not _PATH_RE.fullmatch(parts.path or "/")):
            raise CommandFailed(INVALID_COMMAND, "source.peer_url must be http://<peer ip>:<port>/image")
        token = _token(source.get("token"), "source.token")
        name = bundle.image.canonical
        tar_name = f"peer-{bundle.digest.split(':')[-1][:32]}.tar"
        await self._pool.run(prepare_dir, self.download_dir)
        try:
            size = await self.download(parts.hostname, port, parts.path or "/", token, tar_name, ctx, name,
                                       _peer_wait(ctx))
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

    def _attempt_on_thread(self, host: str, port: int, path: str, token: bytes, download_id: str, tar_name: str,
                           have: int, meter: Meter) -> Deferred[Attempt]:
        return Deferred.fromCoroutine(self._engine.stream(
            fetch_attempt, StreamControl(), host, port, path, token, download_id, self.download_dir, tar_name, have,
            self.stall_sec, meter, what="downloading the runtime image from a peer"))

    async def download(self, host: str, port: int, path: str, token: bytes, tar_name: str, ctx: CommandContext,
                       name: str, wait: float) -> int:
        """
        The seeder's tar into C{download_dir/tar_name}; its size. A seeder that refuses the
        connection or answers 503 (still exporting) is retried for C{wait} seconds, with a
        progress message every L{WAIT_NOTE_S}; a broken download resumes with C{Range}.
        """
        where = f"{host}:{port}"
        download_id = secrets.token_hex(8)
        clock = self._reactor
        started = clock.seconds()
        have = 0
        total: int | None = None
        stuck = 0
        waits = 0
        noted: float | None = None
        while True:
            meter = Meter(have)

            def report(meter: Meter = meter) -> None:
                if meter.total:
                    ctx.progress("peer_download", f"Downloading {name} from the peer {where}", bytes_done=meter.have,
                                 bytes_total=meter.total,
                                 progress_pct=min(99, int(meter.have * 100 / max(1, meter.total))))

            ticker = LoopingCall(report)
            ticker.clock = clock
            ticker.start(self.progress_interval, now=False)
            try:
                attempt = await self.attempt(host, port, path, token, download_id, tar_name, have, meter)
            finally:
                ticker.stop()
            now = clock.seconds()
            if attempt.kind == "body":
                before, have, total = have, attempt.have, attempt.total
                ctx.progress("peer_download", f"Downloading {name} from the peer {where}", bytes_done=have,
                             bytes_total=total, progress_pct=min(100 if attempt.complete else 99,
                                                                 int(have * 100 / max(1, total or 1))))
                if attempt.complete:
                    log.info("Downloaded the runtime image {image} from the peer {peer} ({size} bytes)",
                             image=name, peer=where, size=have)
                    return have
                stuck = 0 if have > before else stuck + 1
                why = attempt.why
                delay = self.resume_delay
            elif attempt.kind == "range":
                if attempt.total is not None and total is not None and have == attempt.total == total:
                    return have
                have, stuck, why, delay = 0, stuck + 1, "the seeder refused the resume", self.resume_delay
            elif attempt.kind == "denied":
                raise _fail(f"The peer refused the seeding token (HTTP {attempt.code}); the backend must send the "
                            "token the serving node was given.")
            elif attempt.kind in ("http", "nospace"):
                raise _fail(attempt.why if attempt.kind == "nospace" else
                            f"The peer {where} answered {attempt.why} for the runtime image; is it serving "
                            "(serve_runtime_image) on that address?")
            else:  # unreachable or busy: the seeder may still be exporting (minutes for a big image)
                if now - started >= wait:
                    raise _fail(f"The peer {where} did not serve the runtime image within {wait:.0f} s "
                                f"({attempt.why}); the llm-port server can send it instead.")
                if noted is None or now - noted >= WAIT_NOTE_S:
                    noted = now
                    ctx.progress("waiting_for_peer", f"Waiting for the peer {where} to serve {name} "
                                                     f"({int(now - started)} s so far; it may still be exporting "
                                                     f"the image): {attempt.why}")
                    log.info("Waiting for the peer {peer} to serve the runtime image ({why})", peer=where,
                             why=attempt.why)
                waits += 1
                if attempt.kind == "busy" and attempt.retry_after:
                    delay = float(min(max(attempt.retry_after, 1), 30))
                else:
                    delay = min(5.0, self.resume_delay * 2 ** min(waits - 1, 8))
                await deferLater(clock, max(0.0, min(delay, started + wait - now)), lambda: None)
                continue
            if stuck > self.resume_attempts:
                raise _fail(f"Downloading {name} from the peer {where} failed ({why}) at {have} of "
                            f"{total or '?'} bytes after {self.resume_attempts} resumes without progress. "
                            "Check the peer and the fabric.")
            await deferLater(clock, min(30.0, delay * 2 ** max(0, stuck - 1)), lambda: None)


class ImageRoot(Resource):
    def __init__(self, state: _Serving) -> None:
        super().__init__()
        self.putChild(b"image", ImageResource(state))
