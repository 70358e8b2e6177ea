# -*- test-case-name: tests.test_logs -*-
"""
A faithful stand-in for Loki's push endpoint, as a twisted.web resource.

L{FakeLoki} answers C{POST .../loki/api/v1/push} the way Loki does for JSON pushes:

 - C{Content-Encoding: gzip} bodies are gunzipped (a corrupt gzip body is a 400);
 - C{Content-Type} must be C{application/json} (Loki would parse anything else as
   protobuf; here that is a 400, not retryable, like a body Loki cannot decode);
 - the body must be C{{"streams": [{"stream": {labels}, "values": [["<ns>", "<line>"], ...]}]}}
   with at least one valid label per stream (names C{[a-zA-Z_][a-zA-Z0-9_]*}), timestamps as
   strings of integer nanoseconds and lines as strings; otherwise 400 with Loki-like text;
 - with C{reject_out_of_order} (the behaviour of Loki before 2.4, and of streams with
   unordered writes off), an entry older than the newest one of its stream is a 400;
 - success is 204 with no body; an identical entry (same stream, time and line) is stored once;
 - other paths are 404, other methods 405.

C{fail_next(n, code)} makes the next C{n} pushes answer C{code} (429, 500, 400, ...) without
storing anything; C{hold_next(n)} leaves the next C{n} pushes unanswered until C{release()}.
Every push is recorded (C{pushes}: path, headers, decoded body, status); C{entries()} lists
what was stored.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Mapping
from typing import Any

from attrs import define, field, frozen
from twisted.internet.defer import Deferred
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

__all__ = ["FakeLoki", "Push", "StoredEntry"]

_LABEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PUSH_SUFFIX = b"/loki/api/v1/push"


@frozen
class StoredEntry:
    """One accepted log line."""

    labels: dict[str, str] = field(eq=False)
    label_key: tuple[tuple[str, str], ...]
    ts_ns: int
    line: str


@define
class Push:
    """One push request as received."""

    path: bytes
    headers: dict[str, str]
    body: Any
    status: int
    error: str | None = None


class _BadPush(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class FakeLoki(Resource):
    """See the module docstring. A leaf: mount it at the root or under a base path."""

    isLeaf = True

    def __init__(self, reject_out_of_order: bool = False) -> None:
        super().__init__()
        self.reject_out_of_order = reject_out_of_order
        self.pushes: list[Push] = []
        self._entries: list[StoredEntry] = []
        self._seen: set[tuple[tuple[tuple[str, str], ...], int, str]] = set()
        self._newest: dict[tuple[tuple[str, str], ...], int] = {}
        self._failures: list[tuple[int, bytes]] = []
        self._hold = 0
        self._held: list[Request] = []
        self._waiters: list[tuple[int, Deferred[list[StoredEntry]]]] = []

    # -- test controls ---------------------------------------------------------------------

    def fail_next(self, count: int, code: int = 500, body: bytes | None = None) -> None:
        """Answer the next C{count} pushes with C{code} (and C{body}), storing nothing."""
        text = body if body is not None else f"fake loki: failing with {code}\n".encode()
        self._failures.extend([(code, text)] * count)

    def hold_next(self, count: int = 1) -> None:
        """Leave the next C{count} pushes unanswered until L{release} (a hung Loki)."""
        self._hold += count

    def release(self) -> None:
        """Answer the held pushes (as if Loki had been slow, then fine)."""
        held, self._held = self._held, []
        for request in held:
            if not request.finished and not getattr(request, "_disconnected", False):
                self._handle(request)
                request.finish()

    def entries(self, **match: str) -> list[StoredEntry]:
        """Stored entries in arrival order, optionally only those whose labels include C{match}."""
        return [e for e in self._entries if all(e.labels.get(k) == v for k, v in match.items())]

    def lines(self, **match: str) -> list[str]:
        """The stored lines, optionally filtered by labels."""
        return [e.line for e in self.entries(**match)]

    def when_entries(self, count: int) -> Deferred[list[StoredEntry]]:
        """Fire once at least C{count} entries are stored."""
        d: Deferred[list[StoredEntry]] = Deferred()
        if len(self._entries) >= count:
            d.callback(list(self._entries))
        else:
            self._waiters.append((count, d))
        return d

    # -- HTTP ------------------------------------------------------------------------------

    def render(self, request: Request) -> bytes | int:
        path = request.path or b""
        if not path.endswith(PUSH_SUFFIX):
            request.setResponseCode(404)
            return b"404 page not found\n"
        if request.method != b"POST":
            request.setResponseCode(405)
            return b"method not allowed\n"
        if self._hold > 0:
            self._hold -= 1
            self._held.append(request)
            return NOT_DONE_YET
        return self._handle(request)

    def _handle(self, request: Request) -> bytes:
        headers = {
            k.decode("latin-1").lower(): b",".join(v).decode("latin-1")
            for k, v in request.requestHeaders.getAllRawHeaders()
        }
        assert request.content is not None
        raw = request.content.read()
        push = Push(path=request.path or b"", headers=headers, body=None, status=204)
        self.pushes.append(push)
        try:
            body = self._decode(headers, raw)
            push.body = body
            if self._failures:
                code, text = self._failures.pop(0)
                raise _BadPush(code, text.decode("utf-8", "replace"))
            accepted = self._validate(body)
        except _BadPush as e:
            push.status = e.code
            push.error = e.message
            request.setResponseCode(e.code)
            request.setHeader(b"content-type", b"text/plain; charset=utf-8")
            return e.message.encode("utf-8")
        for entry in accepted:
            marker = (entry.label_key, entry.ts_ns, entry.line)
            if marker in self._seen:
                continue
            self._seen.add(marker)
            self._entries.append(entry)
            self._newest[entry.label_key] = max(self._newest.get(entry.label_key, 0), entry.ts_ns)
        self._notify()
        request.setResponseCode(204)
        return b""

    def _notify(self) -> None:
        ready = [w for w in self._waiters if len(self._entries) >= w[0]]
        for w in ready:
            self._waiters.remove(w)
            w[1].callback(list(self._entries))

    def _decode(self, headers: Mapping[str, str], raw: bytes) -> Any:
        encoding = headers.get("content-encoding", "").strip().lower()
        if encoding == "gzip":
            try:
                raw = gzip.decompress(raw)
            except (OSError, EOFError, zlib.error) as e:
                raise _BadPush(400, f"gzip: invalid body: {e}\n") from None
        elif encoding not in ("", "identity"):
            raise _BadPush(400, f"unsupported Content-Encoding {encoding!r}\n")
        content_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            raise _BadPush(
                400, f"unsupported Content-Type {content_type!r} (this fake only speaks JSON)\n"
            )
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise _BadPush(400, f"loghttp.PushRequest: invalid JSON: {e}\n") from None

    def _validate(self, body: Any) -> list[StoredEntry]:
        if not isinstance(body, dict) or not isinstance(body.get("streams"), list):
            raise _BadPush(400, "loghttp.PushRequest.Streams: expected an array\n")
        out: list[StoredEntry] = []
        newest = dict(self._newest)
        for i, stream in enumerate(body["streams"]):
            if not isinstance(stream, dict):
                raise _BadPush(400, f"streams[{i}]: expected an object\n")
            labels = stream.get("stream")
            if not isinstance(labels, dict) or not labels:
                raise _BadPush(400, "error at least one label pair is required per stream\n")
            for name, value in labels.items():
                if not _LABEL_NAME.match(name):
                    raise _BadPush(400, f"error parsing labels: invalid label name {name!r}\n")
                if not isinstance(value, str) or not value:
                    raise _BadPush(400, f"error parsing labels: invalid value for {name!r}\n")
            key = tuple(sorted(labels.items()))
            values = stream.get("values")
            if not isinstance(values, list):
                raise _BadPush(400, f"streams[{i}].values: expected an array\n")
            for j, value in enumerate(values):
                if (
                    not isinstance(value, list)
                    or len(value) not in (2, 3)
                    or not isinstance(value[0], str)
                    or not isinstance(value[1], str)
                ):
                    raise _BadPush(
                        400, f"streams[{i}].values[{j}]: expected [\"<ns>\", \"<line>\"]\n"
                    )
                if not value[0].isdigit():
                    raise _BadPush(400, f"streams[{i}].values[{j}]: invalid timestamp {value[0]!r}\n")
                ts = int(value[0])
                if self.reject_out_of_order and ts < newest.get(key, 0):
                    raise _BadPush(
                        400,
                        f"entry with timestamp {ts} ignored, reason: 'entry out of order' for "
                        f"stream: {labels}\n",
                    )
                newest[key] = max(newest.get(key, 0), ts)
                out.append(StoredEntry(labels=dict(labels), label_key=key, ts_ns=ts, line=value[1]))
        return out
