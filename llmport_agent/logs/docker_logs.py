# -*- test-case-name: tests.test_logs_containers -*-
"""
The thread side of following container logs: one engine C{logs} stream, read in a worker
thread, parsed, de-duplicated and redacted there, handed to the reactor in bounded chunks.

B{The stream.} C{GET /containers/<id>/logs?follow=1&stdout=1&stderr=1&timestamps=1&since=<s.ns>}
through docker-py's own connection (unix socket, TCP, TLS as C{DOCKER_HOST} says). The body is
read in blocks as they arrive (not frame by frame through docker-py, which costs about 9 µs a
line), split into the engine's multiplexed frames (8-byte headers; a raw stream for TTY
containers), each frame one log message C{"<RFC3339Nano time> <text>"}. A message longer than
the engine's 16 KiB buffer arrives as several frames, only the last ending in a newline: they
are joined into one line with the first part's time.

B{Positions, exactly.} A L{Position} is the newest line time shipped plus, for the lines that
carry exactly that time, a count per CRC-32 of their raw bytes. A stream is reopened with
C{since=<that time>} (nanoseconds, which the engine honours): the engine returns lines at or
after it, and the L{Deduper} skips, while re-reading, lines older than the position and the
counted lines at it; the first new line ends the re-reading. So neither a gap nor a duplicate
appears across agent, container and engine restarts.

B{Bounded.} The thread puts lines into an L{Inbox} that holds at most C{limit} bytes; when the
reactor does not take them (the shipper is full), the thread waits and stops reading, so the
engine keeps the lines in its log file and nothing grows.
"""

from __future__ import annotations

import calendar
import re
import struct
import threading
import zlib
from collections.abc import Callable
from typing import Any

from attrs import field

from llmport_agent.core.values import define, frozen
from llmport_agent.logs.encoding import ENTRY_OVERHEAD
from llmport_agent.logs.redact import CUT_MARGIN, redact_cut
from llmport_agent.workloads import dockerapi
from llmport_agent.workloads.engine import StreamClosed, StreamControl

#: Lines longer than this many characters are cut (the shipper's own bound, applied here so
#: the hand-over to the reactor costs nothing per line).
MAX_LINE_CHARS = 64 * 1024

__all__ = [
    "FollowResult",
    "FrameParser",
    "Inbox",
    "Position",
    "Deduper",
    "follow_logs",
    "format_since",
    "parse_timestamp",
]

_FRAME = struct.Struct(">BxxxL")
_READ_BYTES = 64 * 1024

#: Lines longer than this (joined from partial messages) are cut.
MAX_LINE_BYTES = 256 * 1024

#: Lines counted at the position's exact time (more lines with one and the same nanosecond
#: are not expected; beyond this they are no longer told apart).
MAX_AT_POSITION = 1024

_TIMESTAMP = re.compile(
    rb"^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(?:[.,](\d{1,9}))?"
    rb"(Z|[+-]\d{2}:?\d{2})(?: |$)"
)


#: Seconds of the "YYYY-MM-DDTHH:MM:SS" prefixes seen lately (many lines share one second).
#: Only the last few seconds are ever looked up again, so it is kept small: at 4096 entries it
#: took a line stream over an hour (one new second a second) to reach its bound, ~0.5 MB/h of
#: steady growth in the soak.
_SECONDS: dict[bytes, int] = {}
_MAX_SECONDS = 64


def parse_timestamp(raw: bytes) -> tuple[int, int] | None:
    """
    The RFC3339Nano timestamp at the start of C{raw} (as Docker writes it with
    C{timestamps=True}): C{(unix_ns, length of the prefix including the separating space)}, or
    C{None} when C{raw} does not start with one.
    """
    # The engine's own form (RFC3339NanoFixed, UTC): 30 bytes, then a space. Fast path.
    if len(raw) >= 30 and raw[29] == 0x5A and raw[19] == 0x2E and (len(raw) == 30 or raw[30] == 0x20):
        frac = raw[20:29]
        seconds = _SECONDS.get(raw[:19])
        if seconds is not None and frac.isdigit():
            return seconds * 1_000_000_000 + int(frac), 31 if len(raw) > 30 else 30
        parsed = _parse_timestamp(raw)
        if parsed is not None:
            if len(_SECONDS) >= _MAX_SECONDS:
                _SECONDS.clear()
            _SECONDS[raw[:19]] = parsed[0] // 1_000_000_000
        return parsed
    return _parse_timestamp(raw)


def _parse_timestamp(raw: bytes) -> tuple[int, int] | None:
    m = _TIMESTAMP.match(raw)
    if m is None:
        return None
    try:
        year, month, day, hour, minute, second = (int(m.group(i)) for i in range(1, 7))
        if not (1 <= month <= 12 and 1 <= day <= 31 and hour < 24 and minute < 60 and second < 61):
            return None
        seconds = calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0))
    except (ValueError, OverflowError):
        return None
    frac = m.group(7) or b""
    nanos = int(frac.ljust(9, b"0")) if frac else 0
    zone = m.group(8)
    if zone != b"Z":
        sign = -1 if zone[:1] == b"-" else 1
        digits = zone[1:].replace(b":", b"")
        seconds -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    ns = seconds * 1_000_000_000 + nanos
    if ns < 0:
        return None
    return ns, m.end()


def format_since(ts_ns: int) -> str:
    """The engine's C{since} for a time in Unix nanoseconds: C{"<seconds>.<9 digits>"}."""
    return f"{ts_ns // 1_000_000_000}.{ts_ns % 1_000_000_000:09d}"


class FrameParser:
    """
    Splits the engine's log stream into messages: C{(stream, bytes)} with stream 1 (stdout) or
    2 (stderr), each message as the engine sent it (normally one line with its newline).

    @param tty: the container has a TTY: the stream is raw (no frame headers), split on
        newlines, all of it stdout.
    """

    def __init__(self, tty: bool) -> None:
        self._tty = tty
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        buf = self._buffer
        buf += data
        out: list[tuple[int, bytes]] = []
        if self._tty:
            end = buf.rfind(b"\n")
            if end < 0:
                if len(buf) > MAX_LINE_BYTES:
                    out.append((1, bytes(buf)))
                    buf.clear()
                return out
            parts = bytes(buf[: end + 1]).split(b"\n")
            del buf[: end + 1]
            parts.pop()  # empty: the block ended with the newline
            out.extend((1, part + b"\n") for part in parts)
            return out
        offset = 0
        size = len(buf)
        while size - offset >= 8:
            kind, length = _FRAME.unpack_from(buf, offset)
            if size - offset - 8 < length:
                break
            start = offset + 8
            out.append((kind, bytes(buf[start : start + length])))
            offset = start + length
        if offset:
            del buf[:offset]
        return out

    def end(self) -> list[tuple[int, bytes]]:
        """What is left when the stream ends (a partial raw line)."""
        rest, self._buffer = bytes(self._buffer), bytearray()
        if self._tty and rest:
            return [(1, rest)]
        return []


@define
class Position:
    """
    How far a container's log has been read: the newest line time (Unix ns; 0 = nothing yet)
    and, for the lines at exactly that time, C{{crc32 of the raw line: count}}.
    """

    ts: int = 0
    at: dict[int, int] = field(factory=dict)

    def copy(self) -> Position:
        return Position(self.ts, dict(self.at))

    def since(self) -> str | None:
        """The engine's C{since} to resume from (C{None}: from the first line)."""
        return format_since(self.ts) if self.ts > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {"ts": self.ts, "at": [[crc, n] for crc, n in sorted(self.at.items())]}

    @classmethod
    def from_json(cls, doc: Any) -> Position:
        """@raise ValueError: not a position as L{to_json} writes it."""
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        ts = doc.get("ts")
        if not isinstance(ts, int) or isinstance(ts, bool) or ts < 0:
            raise ValueError("'ts' is not a non-negative integer")
        at: dict[int, int] = {}
        for item in doc.get("at") or []:
            if (
                not isinstance(item, list)
                or len(item) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in item)
                or item[1] < 1
            ):
                raise ValueError("'at' holds something that is not [crc, count]")
            at[item[0]] = item[1]
        if len(at) > MAX_AT_POSITION:
            raise ValueError("'at' is too long")
        return cls(ts, at)


class Deduper:
    """
    Decides which lines of a (re)opened stream are new, and tracks the position.

    While I{re-reading} (from the start of the stream until the first new line): a line older
    than the position is skipped, a line at exactly its time is skipped when it was counted
    there (each count once). Every other line is new, and so is everything after it.
    """

    def __init__(self, position: Position | None) -> None:
        self.position = position.copy() if position is not None else Position()
        self._replay = dict(self.position.at)
        self._replaying = self.position.ts > 0
        self.skipped = 0

    def accept(self, ts: int, raw: bytes) -> bool:
        pos = self.position
        if self._replaying:
            if ts < pos.ts:
                self.skipped += 1
                return False
            if ts == pos.ts:
                crc = zlib.crc32(raw)
                left = self._replay.get(crc, 0)
                if left:
                    self._replay[crc] = left - 1
                    self.skipped += 1
                    return False
            self._replaying = False
        if ts > pos.ts:
            pos.ts = ts
            pos.at = {zlib.crc32(raw): 1}
        elif ts == pos.ts and len(pos.at) < MAX_AT_POSITION:
            crc = zlib.crc32(raw)
            pos.at[crc] = pos.at.get(crc, 0) + 1
        return True


class Inbox:
    """
    Lines handed from one stream thread to the reactor, at most C{limit} bytes at a time.

    The thread calls L{put} (it waits while the inbox is full); the first put after a L{take}
    schedules C{deliver} on the reactor thread; the reactor calls L{take} when it has room.
    L{close} wakes a waiting thread for good (it then raises L{StreamClosed}).
    """

    def __init__(self, call_from_thread: Callable[..., Any], deliver: Callable[[], None],
                 limit: int = 512 * 1024) -> None:
        self._call_from_thread = call_from_thread
        self._deliver = deliver
        self._limit = limit
        self._cond = threading.Condition()
        self._items: list[tuple[int, str]] = []
        self._bytes = 0
        self._position: Position | None = None
        self._scheduled = False
        self._closed = False
        self.waits = 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, items: list[tuple[int, str]], size: int, position: Position) -> None:
        """Thread side: add lines (and the position after them). @raise StreamClosed."""
        with self._cond:
            while self._bytes >= self._limit and not self._closed:
                self.waits += 1
                self._cond.wait(1.0)
            if self._closed:
                raise StreamClosed("closed")
            self._items.extend(items)
            self._bytes += size
            self._position = position
            schedule = not self._scheduled
            self._scheduled = True
        if schedule:
            self._call_from_thread(self._deliver)

    def take(self) -> tuple[list[tuple[int, str]], Position | None, int]:
        """Reactor side: everything waiting, the position after it, and its size."""
        with self._cond:
            items, self._items = self._items, []
            position, self._position = self._position, None
            size, self._bytes = self._bytes, 0
            self._scheduled = False
            self._cond.notify_all()
        return items, position, size

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


@frozen
class FollowResult:
    """How a stream ended by itself (the engine closed it: the container stopped)."""

    lines: int
    skipped: int
    running: bool  # the container runs again (it was restarted meanwhile)
    tty: bool


@frozen
class Decoded:
    """A chunk of new lines, redacted, and their byte count."""

    items: list[tuple[int, str]]
    size: int


class _Joiner:
    """Turns messages into lines: partial messages joined, times parsed, duplicates skipped."""

    def __init__(self, dedupe: Deduper, redact: Callable[[str], str]) -> None:
        self.dedupe = dedupe
        self.redact = redact
        self._partial: dict[int, tuple[int, bytearray]] = {}
        self._last_ts = 0
        self.lines = 0
        self.unparsed = 0

    def messages(self, messages: list[tuple[int, bytes]]) -> Decoded:
        out: list[tuple[int, str]] = []
        size = 0
        redact = self.redact
        accept = self.dedupe.accept
        for kind, message in messages:
            parsed = parse_timestamp(message)
            if parsed is None:
                self.unparsed += 1
                ts, body = self._last_ts, message
            else:
                ts, body = parsed[0], message[parsed[1] :]
                self._last_ts = ts
            if not body.endswith(b"\n"):
                held = self._partial.get(kind)
                if held is None:
                    self._partial[kind] = (ts, bytearray(body))
                else:
                    if len(held[1]) < MAX_LINE_BYTES:
                        held[1].extend(body)
                continue
            held = self._partial.pop(kind, None)
            if held is not None:
                held[1].extend(body)
                ts, raw = held[0], bytes(held[1])
            else:
                raw = body
            raw = raw[:-1]
            if raw.endswith(b"\r"):
                raw = raw[:-1]
            if not accept(ts, raw[:MAX_LINE_BYTES]):
                continue
            # Redacted over a window wider than the cut, then cut: a secret across the cut is
            # masked whole, never shipped in part (margin: the snapshot's longest secret + 128).
            margin = getattr(redact, "margin", CUT_MARGIN)
            window = MAX_LINE_BYTES + 4 * margin
            text = raw[:window].decode("utf-8", "replace")
            if len(raw) > window:
                text = redact_cut(text, len(text) - margin, redact, margin)
            else:
                text = redact(text)
            if len(text) > MAX_LINE_CHARS:
                text = text[:MAX_LINE_CHARS] + " [truncated]"
            out.append((ts, text))
            size += len(text) + ENTRY_OVERHEAD
        self.lines += len(out)
        return Decoded(out, size)

    def end(self) -> Decoded:
        """The stream ended: a held partial message becomes a line of its own."""
        rest = [(kind, bytes(b) + b"\n") for kind, (ts, b) in sorted(self._partial.items())]
        times = {kind: ts for kind, (ts, _) in self._partial.items()}
        self._partial.clear()
        out: list[tuple[int, str]] = []
        size = 0
        for kind, raw in rest:
            line = raw[:-1]
            if self.dedupe.accept(times[kind], line):
                text = self.redact(line.decode("utf-8", "replace"))[:MAX_LINE_CHARS]
                out.append((times[kind], text))
                size += len(text) + ENTRY_OVERHEAD
        self.lines += len(out)
        return Decoded(out, size)


class ChunkedDecoder:
    """Incremental decoder of HTTP/1.1 chunked transfer encoding (the engine's stream body)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._left = 0  # data bytes left in the current chunk
        self._crlf = False  # the CRLF after a chunk's data is due
        self.done = False

    def feed(self, data: bytes) -> bytes:
        """The body bytes in C{data}. @raise ValueError: not chunked encoding."""
        buf = self._buffer
        buf += data
        out = bytearray()
        while not self.done:
            if self._left:
                take = min(self._left, len(buf))
                if not take:
                    break
                out += buf[:take]
                del buf[:take]
                self._left -= take
                if self._left:
                    break
                self._crlf = True
            if self._crlf:
                if len(buf) < 2:
                    break
                if buf[:2] != b"\r\n":
                    raise ValueError("a chunk does not end with CRLF")
                del buf[:2]
                self._crlf = False
            end = buf.find(b"\r\n")
            if end < 0:
                if len(buf) > 4096:
                    raise ValueError("a chunk size line is too long")
                break
            line = bytes(buf[:end]).split(b";", 1)[0].strip()
            del buf[: end + 2]
            try:
                size = int(line, 16)
            except ValueError:
                raise ValueError(f"bad chunk size {line[:20]!r}") from None
            if size == 0:
                self.done = True  # trailers, if any, are not needed
                break
            self._left = size
        return bytes(out)


def body_blocks(response: Any) -> Any:
    """
    The body of a streaming docker-py (requests) response in blocks as they arrive: one read
    of the connection returns everything buffered, many log lines at once (urllib3's own
    reader returns one HTTP chunk, which the engine makes one line, at a time).
    """
    raw = response.raw
    fp = getattr(getattr(raw, "_fp", None), "fp", None)
    if fp is None or not hasattr(fp, "read1"):
        yield from raw.stream(_READ_BYTES, decode_content=False)
        return
    chunked = "chunked" in str(response.headers.get("Transfer-Encoding", "")).lower()
    decoder = ChunkedDecoder() if chunked else None
    while True:
        data = fp.read1(_READ_BYTES)
        if not data:
            return
        if decoder is None:
            yield data
            continue
        body = decoder.feed(data)
        if body:
            yield body
        if decoder.done:
            return


def _open_stream(api: Any, cid: str, since: str | None) -> Any:
    """The C{logs} response (headers read), its socket timeout off (a quiet log is normal)."""
    params: dict[str, Any] = {"follow": 1, "stdout": 1, "stderr": 1, "timestamps": 1}
    if since is not None:
        params["since"] = since
    response = dockerapi.get(
        api, dockerapi.url(api, "/containers/{0}/logs", cid), params=params, stream=True
    )
    dockerapi.raise_for_status(api, response)
    try:
        dockerapi.disable_socket_timeout(api, response)
    except Exception:  # noqa: BLE001 - a transport without a socket keeps its timeout
        pass
    return response


def follow_logs(
    client: Any,
    control: StreamControl,
    inbox: Inbox,
    cid: str,
    position: Position | None,
    since: str | None,
    redact: Callable[[], Callable[[str], str]],
) -> FollowResult:
    """
    Thread function: follow one container's log until the engine ends it (the container
    stopped) or C{control} is closed (L{StreamClosed}). Lines go to C{inbox}.

    @param position: where shipping stands (C{None}: nothing shipped yet).
    @param since: the C{since} to ask for (C{None}: from the first line).
    @param redact: returns a redacting function (called once per block read).
    """
    from docker.types.daemon import CancellableStream

    api = client.api
    control.check()
    info = api.inspect_container(cid)
    tty = bool((info.get("Config") or {}).get("Tty"))
    response = _open_stream(api, cid, since)
    control.attach(CancellableStream(iter(()), response))
    parser = FrameParser(tty)
    dedupe = Deduper(position)
    joiner = _Joiner(dedupe, redact())
    try:
        for data in body_blocks(response):
            control.check()
            messages = parser.feed(data)
            if not messages:
                continue
            joiner.redact = redact()
            decoded = joiner.messages(messages)
            if decoded.items:
                inbox.put(decoded.items, decoded.size, dedupe.position.copy())
    except StreamClosed:
        raise
    except Exception:
        if control.closed:
            raise StreamClosed(control.reason) from None
        raise
    control.check()
    tail = joiner.messages(parser.end())
    last = joiner.end()
    items = tail.items + last.items
    if items:
        inbox.put(items, tail.size + last.size, dedupe.position.copy())
    state = api.inspect_container(cid).get("State") or {}
    return FollowResult(joiner.lines, dedupe.skipped, bool(state.get("Running")), tty)
