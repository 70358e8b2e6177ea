"""
The engine side of C{transfer_from_server}: stream an arriving image tar, filtered by
L{ImageTarFilter}, into the engine's C{POST /images/load}. A thread function.

On the engine's unix socket and on plain TCP the request is written by hand: the buffers that
arrived from the backend go to the socket as they are, several at a time in one chunk of the
chunked body (C{sendmsg} scatter-gather), with no copy on the way. Other transports (TLS,
ssh) go through docker-py, which copies each piece once more.

When the filter refuses the archive the upload is broken off before the archive's end: the
engine's load fails on the truncated body and no tag on the host changes.
"""

from __future__ import annotations

import http.client
import json
import queue
import socket
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from llmport_agent.core.lazyimport import LazyModule

from ..commands.base import CommandFailed
from . import dockerapi
from .engine import StreamControl
from .tarfilter import ImageTarFilter, TarRejected

if TYPE_CHECKING:
    import docker
else:
    docker = LazyModule("docker")  # docker-py: imported at its first use

TRANSFER_FAILED = "image_transfer_failed"

#: At most this many bytes go to the engine in one chunk of the request body.
BATCH_BYTES = 4 * 1024 * 1024
#: At most this many buffers per sendmsg call (IOV_MAX is 1024 on Linux).
_MAX_IOV = 512
_END_CHUNK = b"0\r\n\r\n"
#: Sent when the upload is broken off: not a valid chunk size line, so the engine's body
#: reader fails at once instead of seeing a clean end.
_ABORT = b"\r\nllmport-agent: upload aborted\r\n"


class SourceError(Exception):
    """The download feeding the load failed or was stopped (the message says how)."""


class BodySource:
    """
    What the loading thread reads the tar from: a thread-safe queue filled on the reactor.
    Items are byte strings, L{END}, or an exception (the download failed).
    """

    END = object()

    def __init__(self, on_consumed: Callable[[int], None]) -> None:
        self.queue: queue.Queue[Any] = queue.Queue()
        self._on_consumed = on_consumed

    def batches(self, control: StreamControl, max_bytes: int = BATCH_BYTES) -> Iterator[list[bytes]]:
        """Thread side: lists of arriving buffers (at most about C{max_bytes} each), in order."""
        while True:
            item = self.queue.get()
            batch: list[bytes] = []
            size = 0
            ended = False
            while True:
                if item is self.END:
                    ended = True
                    break
                if isinstance(item, BaseException):
                    raise SourceError(str(item) or type(item).__name__)
                batch.append(item)
                size += len(item)
                if size >= max_bytes:
                    break
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
            if control.closed:
                raise SourceError(f"image transfer {control.reason}")
            if batch:
                self._on_consumed(size)
                yield batch
            if ended:
                return


class _SocketCloser:
    """Unblocks a thread reading or writing C{sock} (for L{StreamControl})."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def _raw_connection(api: Any) -> http.client.HTTPConnection | None:
    """A plain connection to the engine, or C{None} where docker-py must do the transport."""
    adapter = dockerapi.custom_adapter(api)
    timeout = getattr(api, "timeout", None)
    if isinstance(adapter, docker.transport.UnixHTTPAdapter):
        return _UnixConnection(adapter.socket_path, timeout)
    base = str(getattr(api, "base_url", ""))
    if base.startswith("http://"):
        parts = urlsplit(base)
        if parts.hostname:
            return http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    return None


def send_buffers(sock: socket.socket, buffers: list[bytes | memoryview]) -> None:
    """Write every buffer, in order, with as few system calls as the kernel allows."""
    views = [b if isinstance(b, memoryview) else memoryview(b) for b in buffers if len(b)]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + _MAX_IOV])
        while sent and i < len(views):
            n = len(views[i])
            if sent >= n:
                sent -= n
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


def _send_chunk(sock: socket.socket, pieces: list[bytes | memoryview]) -> None:
    total = sum(len(p) for p in pieces)
    if total:
        send_buffers(sock, [b"%x\r\n" % total, *pieces, b"\r\n"])


def _messages(messages: Iterator[Any]) -> dict[str, Any]:
    loaded: list[str] = []
    error = ""
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        if msg.get("error") or msg.get("errorDetail"):
            detail = msg.get("errorDetail") or {}
            error = str(
                msg.get("error") or (detail.get("message") if isinstance(detail, dict) else "") or "unknown error"
            )
        text = msg.get("stream")
        if isinstance(text, str) and "Loaded image" in text:
            loaded.append(text.split(":", 1)[1].strip() if ":" in text else text.strip())
    return {"loaded": loaded, "error": error}


def _abort(sock: socket.socket) -> None:
    try:
        sock.sendall(_ABORT)
    except OSError:
        pass


def _rejected(tar: ImageTarFilter, exc: TarRejected) -> CommandFailed:
    return CommandFailed(TRANSFER_FAILED, f"Transferring {tar.requested} failed: {exc}")


def load_thread(
    client: docker.DockerClient, control: StreamControl, source: BodySource, tar: ImageTarFilter
) -> dict[str, Any]:
    """
    Thread function: POST the arriving tar, filtered, to the engine's image load. Returns
    C{{"loaded": [...], "error": str, "transport": "socket"|"docker-py"}}.

    @raise CommandFailed: C{image_transfer_failed} when the filter refuses the archive.
    """
    api = client.api
    conn = _raw_connection(api)
    if conn is None:
        return _load_via_docker_py(client, control, source, tar)
    target = urlsplit(dockerapi.url(api, "/images/load"))
    conn.connect()
    sock = conn.sock
    assert sock is not None
    sock.settimeout(None)  # the engine may take minutes to register big layers
    control.attach(_SocketCloser(sock))
    try:
        conn.putrequest("POST", f"{target.path}?quiet=0", skip_accept_encoding=True)
        conn.putheader("Content-Type", "application/x-tar")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.putheader("User-Agent", "llmport-agent")
        conn.endheaders()
        try:
            for batch in source.batches(control):
                pieces: list[bytes | memoryview] = []
                for data in batch:
                    pieces.extend(tar.feed(data))
                _send_chunk(sock, pieces)
            _send_chunk(sock, tar.finish())
        except TarRejected as exc:
            _abort(sock)
            raise _rejected(tar, exc) from None
        except SourceError:
            _abort(sock)
            raise
        except OSError:
            # The engine may have answered (an error) and closed: read what it said.
            control.check()
            return _read_response(conn, control, sending_failed=True)
        sock.sendall(_END_CHUNK)
        return _read_response(conn, control, sending_failed=False)
    finally:
        conn.close()


def _read_response(
    conn: http.client.HTTPConnection, control: StreamControl, *, sending_failed: bool
) -> dict[str, Any]:
    try:
        response = conn.getresponse()
    except (OSError, http.client.HTTPException) as exc:
        control.check()
        raise ConnectionError(
            f"the engine closed the connection during the image load ({type(exc).__name__})"
        ) from None
    if response.status >= 400:
        body = response.read(64 * 1024).decode("utf-8", "replace")
        explanation = body
        try:
            doc = json.loads(body)
            if isinstance(doc, dict) and isinstance(doc.get("message"), str):
                explanation = doc["message"]
        except ValueError:
            pass
        raise docker.errors.APIError(f"HTTP {response.status}", explanation=explanation.strip())
    chunks = iter(lambda: response.read1(64 * 1024), b"")
    outcome = _messages(docker.utils.json_stream.json_stream(c.decode("utf-8", "replace") for c in chunks))
    control.check()
    if sending_failed and not outcome["error"]:
        outcome["error"] = "the engine stopped reading the archive before its end"
    outcome["transport"] = "socket"
    return outcome


def _load_via_docker_py(
    client: docker.DockerClient, control: StreamControl, source: BodySource, tar: ImageTarFilter
) -> dict[str, Any]:
    api = client.api
    rejected: list[TarRejected] = []

    def body() -> Iterator[bytes]:
        try:
            for batch in source.batches(control):
                pieces: list[bytes | memoryview] = []
                for data in batch:
                    pieces.extend(tar.feed(data))
                if pieces:
                    yield b"".join(pieces)
            tail = b"".join(tar.finish())
            if tail:
                yield tail
        except TarRejected as exc:
            rejected.append(exc)
            raise

    class _Closer:
        def close(self) -> None:
            source.queue.put(SourceError("image transfer aborted"))

    control.attach(_Closer())
    try:
        response = dockerapi.post(
            api,
            dockerapi.url(api, "/images/load"),
            data=body(),
            params={"quiet": "0"},
            headers={"Content-Type": "application/x-tar"},
            stream=True,
            timeout=None,
        )
    except Exception:
        if rejected:
            raise _rejected(tar, rejected[0]) from None
        raise
    if rejected:
        raise _rejected(tar, rejected[0])
    stream = docker.types.CancellableStream(dockerapi.json_messages(api, response), response)
    control.attach(stream)
    dockerapi.raise_for_status(api, response)
    outcome = _messages(iter(stream))
    control.check()
    outcome["transport"] = "docker-py"
    return outcome


__all__ = ["BodySource", "SourceError", "load_thread", "send_buffers"]
