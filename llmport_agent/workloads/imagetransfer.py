"""
C{transfer_from_server}: the backend's C{docker save} tar, streamed into the engine's image load
(through L{ImageTarFilter}) while it arrives, for both generations of the backend.

 - The April backend streams: no C{Content-Length}, maybe C{X-Image-Size} (progress only). A
   broken connection fails the transfer (nothing is loaded).
 - The current backend (protocol 10.4) serves a one-time export when it can: a real
   C{Content-Length}, C{Range} and the header C{X-Image-Id}. A connection that breaks is
   resumed with C{Range: bytes=<have>-} into the same, still open image load: nothing is
   written to disk and nothing is sent twice. A C{206} must continue exactly at C{<have>}
   with the same C{X-Image-Id}; a C{200} to a ranged request (or a different image) restarts
   the load from byte 0; a C{416} whose C{Content-Range} gives the full size as C{<have>} means
   everything arrived. Without those headers it streams, as the April one does.
 - C{expect_id} and C{expect_rootfs} (query) are the image the node was told to run, when
   known: a server holding another build answers C{409 {detail}}, which fails at once with
   C{server_image_mismatch} (asking again changes nothing). Other failures are
   C{image_transfer_failed} (or C{transfer_stalled} when the backend stops sending).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.protocol import Protocol
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss

from llmport_agent.core.httpbody import read_prefix

from ..commands.base import CommandFailed
from .engine import DockerEngine, EngineError, StreamClosed, StreamControl
from .imageload import BodySource, SourceError, load_thread
from .policy import parse_image_ref
from .tarfilter import ImageTarFilter

#: Codes of protocol 10.4 (and our own stall code).
IMAGE_TRANSFER_FAILED = "image_transfer_failed"
SERVER_IMAGE_MISMATCH = "server_image_mismatch"
TRANSFER_STALLED = "transfer_stalled"

#: progress(message, **extra) -> None
Progress = Callable[..., None]

_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(?:(\d+)-(\d+)|\*)\s*/\s*(\d+|\*)\s*$", re.IGNORECASE)
#: Error bodies are read up to this size (a 409's detail, a 404's message).
_ERROR_BODY = 16 * 1024


def _scrub(text: str, secret: str) -> str:
    return text.replace(secret, "***") if secret and len(secret) >= 4 else text


def _header(response: Any, name: bytes) -> str | None:
    values = response.headers.getRawHeaders(name) or []
    if not values:
        return None
    value = values[0]
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def _int_header(response: Any, name: bytes) -> int | None:
    value = _header(response, name)
    if value is None or not value.strip().isdigit() or len(value.strip()) > 18:
        return None
    return int(value.strip())


def _length(response: Any) -> int | None:
    """The body's C{Content-Length} (twisted keeps it in C{response.length}, not the headers)."""
    length = getattr(response, "length", None)
    if isinstance(length, int) and not isinstance(length, bool) and length >= 0:
        return length
    return _int_header(response, b"content-length")


def parse_content_range(value: str | None) -> tuple[int | None, int | None, int | None]:
    """C{bytes s-e/size} -> (s, e, size); C{bytes */size} -> (None, None, size); unknown parts None."""
    m = _CONTENT_RANGE.match(value or "")
    if m is None:
        return None, None, None
    start = int(m.group(1)) if m.group(1) is not None else None
    end = int(m.group(2)) if m.group(2) is not None else None
    size = int(m.group(3)) if m.group(3) not in (None, "*") else None
    return start, end, size


class _Restart(Exception):
    """Start the load again from byte 0, with C{response} (a 200) or a fresh request."""

    def __init__(self, why: str, response: Any = None) -> None:
        super().__init__(why)
        self.why = why
        self.response = response


class _Input:
    """
    What one engine load reads: a L{BodySource} filled from one response after another,
    with flow control against whichever response is delivering now.
    """

    def __init__(self, engine: DockerEngine, high_water: int = 16 * 1024 * 1024) -> None:
        self._engine = engine
        self.source = BodySource(self._consumedFromThread)
        self.received = 0
        self.consumed = 0
        self.high_water = high_water
        self.producer: Any = None
        self.paused = False
        self.closed = False

    def put(self, data: bytes) -> None:
        self.received += len(data)
        self.source.queue.put(data)
        if not self.paused and self.received - self.consumed > self.high_water and self.producer:
            self.paused = True
            self.producer.pauseProducing()

    def end(self) -> None:
        if not self.closed:
            self.closed = True
            self.source.queue.put(BodySource.END)

    def fail(self, why: str) -> None:
        if not self.closed:
            self.closed = True
            self.source.queue.put(SourceError(why))

    def attach(self, producer: Any) -> None:
        self.producer = producer
        if self.paused and producer is not None:
            producer.pauseProducing()

    def _consumedFromThread(self, n: int) -> None:
        self._engine.callFromThread(self._consumed, n)

    def _consumed(self, n: int) -> None:
        self.consumed += n
        if self.paused and self.received - self.consumed < self.high_water // 2:
            self.paused = False
            if self.producer is not None:
                self.producer.resumeProducing()


class _Receiver(Protocol):
    """One response body into the shared L{_Input}; C{done} fires when it ends."""

    def __init__(self, into: _Input, on_data: Callable[[int], None]) -> None:
        self._into = into
        self._on_data = on_data
        self.done: Deferred[None] = Deferred()
        self.stopped = False

    def connectionMade(self) -> None:
        self._into.attach(self.transport)

    def dataReceived(self, data: bytes) -> None:
        if self.stopped:
            return
        self._into.put(data)
        self._on_data(len(data))

    def connectionLost(self, reason: Failure = ResponseDone()) -> None:  # type: ignore[assignment]
        if self._into.producer is self.transport:
            self._into.producer = None
        if self.done.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss) and not self.stopped:
            self.done.callback(None)
        else:
            self.done.errback(reason)

    def abort(self) -> None:
        """Stop this response (the connection is dropped); C{done} fails."""
        self.stopped = True
        if self.transport is not None and not self.done.called:
            try:
                self.transport.stopProducing()  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001
                pass


class ImageTransfer:
    """
    One backend's image endpoint. L{run} transfers one reference.

    @param resume_attempts: resumes in a row that bring no new byte before giving up.
    @param resume_delay: first wait before a resume (doubling, at most 30 s).
    @param max_restarts: loads started again from byte 0 at most this many times.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        engine: DockerEngine,
        http: Any,
        backend_url: str,
        credential: Callable[[], str],
        *,
        stall_sec: float,
        progress_interval: float = 1.0,
        resume_attempts: int = 8,
        resume_delay: float = 1.0,
        max_restarts: int = 2,
    ) -> None:
        self._reactor = reactor
        self._engine = engine
        self._http = http
        self._backend_url = backend_url.rstrip("/")
        self._credential = credential
        self.stall_sec = stall_sec
        self.progress_interval = progress_interval
        self.resume_attempts = resume_attempts
        self.resume_delay = resume_delay
        self.max_restarts = max_restarts

    # -- requests ------------------------------------------------------------------------

    def url(self, name: str, tag: str, expect_id: str | None, expect_rootfs: str | None) -> str:
        params = {"image": name, "tag": tag}
        if expect_id:
            params["expect_id"] = expect_id
        if expect_rootfs:
            params["expect_rootfs"] = expect_rootfs
        return self._backend_url + "/api/node-files/images/save?" + urlencode(params)

    async def _get(self, url: str, token: str, ref: str, start: int | None, timeout: float = 60) -> Any:
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/x-tar"}
        if start:
            headers["Range"] = f"bytes={start}-"
        try:
            return await self._http.get(url, headers=headers, unbuffered=True, timeout=timeout)
        except CancelledError:
            raise
        except Exception as exc:
            raise CommandFailed(
                IMAGE_TRANSFER_FAILED,
                _scrub(
                    f"Transferring {ref} failed: the backend could not be reached: "
                    f"{type(exc).__name__}: {exc}",
                    token,
                ),
            ) from None

    async def _refusal(self, response: Any, ref: str, token: str) -> CommandFailed:
        """The failure for an answer other than the ones we can use."""
        body = ""
        try:
            raw = await read_prefix(response, _ERROR_BODY)
            body = raw.decode("utf-8", "replace")
        except Exception:  # noqa: BLE001
            pass
        detail = body
        try:
            import json

            doc = json.loads(body)
            if isinstance(doc, dict) and doc.get("detail") is not None:
                detail = str(doc["detail"])
        except (ValueError, RecursionError):
            pass
        detail = " ".join(detail.split())
        if response.code == 409:
            return CommandFailed(
                SERVER_IMAGE_MISMATCH,
                _scrub(
                    f"The backend holds a different build of {ref} than this node was asked to "
                    f"run, so nothing was transferred: {detail[:600]} Import the expected build "
                    "on the llm-port server; asking again will not change the answer.",
                    token,
                ),
            )
        return CommandFailed(
            IMAGE_TRANSFER_FAILED,
            _scrub(
                f"Transferring {ref} failed: the backend answered HTTP {response.code}: "
                f"{detail[:300]}",
                token,
            ),
        )

    # -- the transfer --------------------------------------------------------------------

    async def run(
        self,
        name: str,
        tag: str,
        progress: Progress,
        *,
        expect_id: str | None = None,
        expect_rootfs: str | None = None,
        load_as: str | None = None,
    ) -> dict[str, Any]:
        """
        Transfer C{name:tag} into the engine; return C{{bytes_done, bytes_total, progress_pct,
        resumed, restarted, resumable}}. With C{load_as} (C{name:tag}) the engine names the
        image that instead (the archive must still name C{name:tag} or nothing).

        @raise CommandFailed: C{server_image_mismatch}, C{image_transfer_failed},
            C{transfer_stalled}, or C{runtime_error} (the engine is unreachable).
        """
        ref = f"{name}:{tag}"
        url = self.url(name, tag, expect_id, expect_rootfs)
        token = self._credential()
        self.log.info("Transferring image {image} from the backend", image=ref)
        response: Any = None
        restarts = 0
        while True:
            if response is None:
                response = await self._get(url, token, ref, None)
                if response.code != 200:
                    raise await self._refusal(response, ref, token)
            try:
                outcome = await self._load(response, ref, url, token, progress, load_as)
            except _Restart as r:
                restarts += 1
                if restarts > self.max_restarts:
                    raise CommandFailed(
                        IMAGE_TRANSFER_FAILED,
                        f"Transferring {ref} failed: the load was started over {restarts - 1} "
                        f"times and still could not be resumed ({r.why}).",
                    ) from None
                self.log.warn("Transfer of {image} starts over: {why}", image=ref, why=r.why)
                progress(f"Transferring {ref} again from the start: {r.why}", bytes_done=0)
                response = r.response
                continue
            outcome["restarted"] = restarts
            return outcome

    async def _load(
        self, response: Any, ref: str, url: str, token: str, progress: Progress, load_as: str | None = None
    ) -> dict[str, Any]:
        length = _length(response)
        image_id = _header(response, b"x-image-id")
        resumable = length is not None and bool(image_id)
        total = length if resumable else (_int_header(response, b"x-image-size") or 0)
        into = _Input(self._engine)
        control = StreamControl()
        clock = self._reactor
        state: dict[str, Any] = {
            "have": 0, "last_data": clock.seconds(), "last_emit": 0.0, "stalled": False, "resumed": 0,
            "broken": False,
        }
        current: list[_Receiver | None] = [None]
        download_error: list[Failure] = []
        timer: Any = None

        def extra() -> dict[str, Any]:
            out: dict[str, Any] = {"bytes_done": state["have"]}
            if total:
                out["bytes_total"] = total
                out["progress_pct"] = min(99, int(state["have"] * 100 / total))
            if state["resumed"]:
                out["resumed"] = state["resumed"]
            return out

        def on_data(n: int) -> None:
            state["have"] += n
            now = clock.seconds()
            state["last_data"] = now
            if now - state["last_emit"] >= self.progress_interval:
                state["last_emit"] = now
                progress(f"Transferring {ref} from the backend", **extra())

        def watchdog() -> None:
            nonlocal timer
            timer = None
            if into.closed:
                return
            idle = clock.seconds() - state["last_data"]
            if idle >= self.stall_sec:
                receiver = current[0]
                if resumable:
                    # Drop the silent connection; the download loop resumes it.
                    if receiver is not None:
                        state["stalled"] = True
                        receiver.abort()
                    state["last_data"] = clock.seconds()
                    idle = 0.0
                else:
                    state["stalled"] = True
                    if receiver is not None:
                        receiver.abort()
                    into.fail("image transfer stalled")
                    control.close("stalled")
                    return
            timer = clock.callLater(max(0.1, self.stall_sec - idle), watchdog)

        async def download() -> None:
            body = response
            failures = 0
            have_at_failure = -1
            while True:
                receiver = _Receiver(into, on_data)
                current[0] = receiver
                body.deliverBody(receiver)
                try:
                    await receiver.done
                    broke = None if (not resumable or state["have"] >= (total or 0)) else "closed early"
                except CancelledError:
                    receiver.abort()
                    raise
                except Exception as exc:  # noqa: BLE001 - the body broke
                    broke = "stalled" if state["stalled"] else type(exc).__name__
                finally:
                    current[0] = None
                if broke is None:
                    if resumable and state["have"] > (total or 0):
                        into.fail("the backend sent more than its Content-Length")
                        raise CommandFailed(
                            IMAGE_TRANSFER_FAILED,
                            f"Transferring {ref} failed: the backend sent {state['have']} bytes, "
                            f"more than the {total} it announced.",
                        )
                    into.end()
                    return
                if not resumable:
                    state["broken"] = True
                    into.fail(f"the backend connection broke after {state['have']} bytes")
                    return
                stalled, state["stalled"] = state["stalled"], False
                failures = 1 if state["have"] != have_at_failure else failures + 1
                have_at_failure = state["have"]
                nxt = None
                while nxt is None:
                    if failures > self.resume_attempts:
                        into.fail("gave up resuming")
                        raise CommandFailed(
                            TRANSFER_STALLED if stalled else IMAGE_TRANSFER_FAILED,
                            f"Transferring {ref} failed: the backend connection broke ({broke}) "
                            f"at {state['have']} of {total} bytes and {self.resume_attempts} "
                            "resumes in a row brought nothing new.",
                            extra(),
                        )
                    delay = min(30.0, self.resume_delay * (2 ** (failures - 1)))
                    progress(
                        f"Connection to the backend broke at {state['have']} of {total} bytes; "
                        f"resuming in {delay:g} s (attempt {failures} of {self.resume_attempts})",
                        **extra(),
                    )
                    await deferLater(clock, delay, lambda: None)
                    state["last_data"] = clock.seconds()
                    try:
                        # A resume answered by silence is a stall too: no longer than the
                        # stall bound for its headers (the first request keeps 60 s).
                        nxt = await self._get(url, token, ref, state["have"], timeout=min(60.0, self.stall_sec))
                    except CommandFailed as exc:
                        broke = exc.error_message
                        failures += 1
                body = await self._resume_answer(nxt, ref, token, state["have"], total, image_id)
                if body is None:  # 416 with the full size: everything is here
                    into.end()
                    return
                state["resumed"] += 1
                state["last_data"] = clock.seconds()
                self.log.info(
                    "Resumed the transfer of {image} at {have} of {total} bytes",
                    image=ref, have=state["have"], total=total,
                )

        tar = ImageTarFilter(ref, lambda text: parse_image_ref(text).canonical, load_as)
        download_d = Deferred.fromCoroutine(download())

        def _downloadFailed(f: Failure) -> None:
            if f.check(CancelledError):
                return
            download_error.append(f)
            # The loading thread may be waiting for input: end it, then close the load.
            into.fail("download failed")
            control.close("download failed")

        download_d.addErrback(_downloadFailed)
        timer = clock.callLater(self.stall_sec, watchdog)
        try:
            outcome = await self._engine.stream(
                load_thread, control, into.source, tar, what=f"loading image {ref}"
            )
        except CancelledError:
            into.fail("cancelled")
            download_d.cancel()
            raise
        except (StreamClosed, EngineError) as exc:
            into.fail("the load failed")
            download_d.cancel()
            if download_error:
                download_error[0].raiseException()
            if state["stalled"]:
                raise CommandFailed(
                    TRANSFER_STALLED,
                    f"Transferring {ref} from the backend made no progress for "
                    f"{self.stall_sec:g} s and was abandoned after {state['have']} bytes.",
                    extra(),
                ) from None
            if isinstance(exc, EngineError) and exc.unreachable:
                raise
            if state["broken"]:
                raise CommandFailed(
                    IMAGE_TRANSFER_FAILED,
                    f"Transferring {ref} failed: the backend connection broke after "
                    f"{state['have']} bytes; nothing was loaded.",
                    extra(),
                ) from None
            cause = exc.explanation if isinstance(exc, EngineError) else str(exc)
            raise CommandFailed(
                IMAGE_TRANSFER_FAILED,
                f"Transferring {ref} failed: the engine's image load failed: {cause}",
                extra(),
            ) from None
        except CommandFailed as exc:
            # The archive was refused (it names other references): the upload was broken off.
            into.fail("refused")
            download_d.cancel()
            self.log.warn("Refused the image archive from the backend: {why}", why=exc.error_message)
            exc.result.update(extra())
            raise
        finally:
            if timer is not None and timer.active():
                timer.cancel()
            receiver = current[0]
            if receiver is not None:
                receiver.abort()  # a no-op once its body has ended
        if download_error:
            download_error[0].raiseException()
        if outcome["error"]:
            raise CommandFailed(
                IMAGE_TRANSFER_FAILED,
                f"Transferring {ref} failed: the engine refused the image: "
                f"{' '.join(str(outcome['error']).split())[:500]}",
                extra(),
            )
        final = extra()
        final["progress_pct"] = 100
        final["resumable"] = resumable
        final["resumed"] = state["resumed"]
        final["loaded"] = list(outcome.get("loaded") or [])
        if image_id:
            final["server_image_id"] = image_id
        return final

    async def _resume_answer(
        self, response: Any, ref: str, token: str, have: int, total: int | None, image_id: str | None
    ) -> Any:
        """
        The answer to C{Range: bytes=<have>-}: the response to keep reading (206), C{None}
        when everything has arrived (416 with the full size), or L{_Restart}.
        """
        code = response.code
        if code == 206:
            start, _end, size = parse_content_range(_header(response, b"content-range"))
            same = _header(response, b"x-image-id") in (None, image_id)
            if start == have and size in (None, total) and same:
                return response
            await _discard(response)
            raise _Restart(
                "the backend's resumed answer did not continue where the transfer stopped"
                if same else "the backend's image changed during the transfer"
            )
        if code == 416:
            _s, _e, size = parse_content_range(_header(response, b"content-range"))
            await _discard(response)
            if size is not None and size == have:
                return None
            raise _Restart(f"the backend refused the range (its size {size}, received {have})")
        if code == 200:
            return _raise_restart(response)
        raise await self._refusal(response, ref, token)


def _raise_restart(response: Any) -> Any:
    raise _Restart("the backend answered the resume with the whole image", response)


async def _discard(response: Any) -> None:
    try:
        await read_prefix(response, _ERROR_BODY)
    except Exception:  # noqa: BLE001
        pass
