# -*- test-case-name: tests.test_logs -*-
"""
A faithful stand-in for Loki's push endpoint, as a twisted.web resource, that also checks what
the agent sends.

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

Controls: C{fail_next(n, code, retry_after=...)} makes the next C{n} pushes answer C{code}
(429 with a C{Retry-After}, 500, 400, 413, ...) without storing anything; C{outage(code)} answers
every push so until C{recover()}; C{hold_next(n)} leaves the next C{n} pushes unanswered until
C{release()}, and C{stall()} all of them (a hung Loki).

Checks, recorded in C{violations} (a test asserts the list is empty) without changing the
answer: with C{check_labels} every stream's label set must be one of protocol 8's exactly
(C{job="node-agent"}: C{job, host, container="node-<agent_id>", agent_id, level};
C{job="node-container"}: C{job, host, container, runtime_id}; C{job="ray-serve"}: C{job, host,
level, app, deployment, replica}); within a stream, entries must come in time order, within
a push and across pushes (C{check_order}; an entry identical to a stored one, from a push
retried after its answer was lost, is exempt); with C{require_gzip} a body must be gzip-encoded.
C{duplicates} counts entries identical to one already stored (Loki keeps one of them).

Every push is recorded (C{pushes}: path, headers, decoded body, status, unless
C{keep_pushes=False}); C{entries()} lists what was stored (unless C{store=False}, which only
counts, for benchmarks); C{on_accept(entries)} is called with each accepted push's entries.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from twisted.internet.defer import Deferred
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from llmport_agent.core.values import define

__all__ = ["FakeLoki", "Push", "StoredEntry", "protocol_label_problem"]

_LABEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PUSH_SUFFIX = b"/loki/api/v1/push"
_LEVELS = {"debug", "info", "warn", "error", "critical"}


def protocol_label_problem(labels: Mapping[str, str]) -> str | None:
    """What is wrong with a stream's label set by protocol section 8, or C{None}."""
    job = labels.get("job")
    if job == "node-agent":
        if set(labels) != {"job", "host", "container", "agent_id", "level"}:
            return (f"node-agent stream with labels {sorted(labels)}, not "
                    "[agent_id, container, host, job, level]")
        if labels["container"] != f"node-{labels['agent_id']}":
            return f"node-agent stream with container={labels['container']!r}, not node-<agent_id>"
        if labels["level"] not in _LEVELS:
            return f"node-agent stream with level={labels['level']!r}"
        return None
    if job == "ray-serve":
        if set(labels) != {"job", "host", "level", "app", "deployment", "replica"}:
            return (f"ray-serve stream with labels {sorted(labels)}, not "
                    "[app, deployment, host, job, level, replica]")
        return None
    if job == "node-container":
        if set(labels) != {"job", "host", "container", "runtime_id"}:
            return (f"node-container stream with labels {sorted(labels)}, not "
                    "[container, host, job, runtime_id]")
        return None
    return f"stream with job={job!r} (protocol 8 and 10.6 know node-agent, node-container, ray-serve)"


class StoredEntry(NamedTuple):
    """One accepted log line (C{labels} is shared by the entries of one pushed stream)."""

    labels: dict[str, str]
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

    def __init__(
        self,
        reject_out_of_order: bool = False,
        *,
        check_labels: bool = False,
        check_order: bool = True,
        require_gzip: bool = False,
        store: bool = True,
        keep_pushes: bool = True,
        on_accept: Callable[[list[StoredEntry]], None] | None = None,
    ) -> None:
        super().__init__()
        self.reject_out_of_order = reject_out_of_order
        self.check_labels = check_labels
        self.check_order = check_order
        self.require_gzip = require_gzip
        self.store = store
        self.keep_pushes = keep_pushes
        self.on_accept = on_accept
        self.pushes: list[Push] = []
        self.violations: list[str] = []
        self.duplicates = 0
        self.accepted = 0
        self.statuses: dict[int, int] = {}
        self._entries: list[StoredEntry] = []
        self._seen: set[tuple[tuple[tuple[str, str], ...], int, str]] = set()
        self._newest: dict[tuple[tuple[str, str], ...], int] = {}
        self._failures: list[tuple[int, bytes, str | None]] = []
        self._outage: tuple[int, bytes, str | None] | None = None
        self._hold = 0
        self._stalled = False
        self._held: list[Request] = []
        self._waiters: list[tuple[int, Deferred[list[StoredEntry]]]] = []

    # -- test controls ---------------------------------------------------------------------

    def fail_next(
        self, count: int, code: int = 500, body: bytes | None = None, retry_after: str | None = None
    ) -> None:
        """
        Answer the next C{count} pushes with C{code} (and C{body}, and a C{Retry-After} header
        when given), storing nothing.
        """
        text = body if body is not None else f"fake loki: failing with {code}\n".encode()
        self._failures.extend([(code, text, retry_after)] * count)

    def outage(self, code: int = 503, retry_after: str | None = None) -> None:
        """Answer every push with C{code} until L{recover} (Loki down behind its gateway)."""
        self._outage = (code, f"fake loki: down ({code})\n".encode(), retry_after)

    def recover(self) -> None:
        """End an L{outage} or a L{stall} (held pushes are answered) and pending failures."""
        self._outage = None
        self._failures.clear()
        self._stalled = False
        self.release()

    def hold_next(self, count: int = 1) -> None:
        """Leave the next C{count} pushes unanswered until L{release} (a hung Loki)."""
        self._hold += count

    def stall(self) -> None:
        """Leave every push unanswered until L{recover} or L{release}."""
        self._stalled = True

    def drop_held(self) -> None:
        """Forget the held pushes without answering them (Loki died with them)."""
        self._held.clear()

    def release(self) -> None:
        """Answer the held pushes (as if Loki had been slow, then fine)."""
        self._stalled = False
        held, self._held = self._held, []
        for request in held:
            if not request.finished and not getattr(request, "_disconnected", False):
                body = self._handle(request)
                request.write(body)
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
        if self.accepted >= count:
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
        if self._stalled or self._hold > 0:
            if not self._stalled:
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
        if self.keep_pushes:
            self.pushes.append(push)
        retry_after: str | None = None
        try:
            if self.require_gzip and headers.get("content-encoding", "").lower() != "gzip":
                self.violations.append("a push without Content-Encoding: gzip")
            body = self._decode(headers, raw)
            push.body = body
            failure = self._outage
            if failure is None and self._failures:
                failure = self._failures.pop(0)
            if failure is not None:
                code, text, retry_after = failure
                raise _BadPush(code, text.decode("utf-8", "replace"))
            accepted = self._validate(body)
        except _BadPush as e:
            push.status = e.code
            push.error = e.message
            self.statuses[e.code] = self.statuses.get(e.code, 0) + 1
            request.setResponseCode(e.code)
            request.setHeader(b"content-type", b"text/plain; charset=utf-8")
            if retry_after is not None:
                request.setHeader(b"retry-after", retry_after.encode())
            return e.message.encode("utf-8")
        self.statuses[204] = self.statuses.get(204, 0) + 1
        fresh: list[StoredEntry] = []
        for entry in accepted:
            newest = self._newest.get(entry.label_key, 0)
            repeat = self.store and (entry.label_key, entry.ts_ns, entry.line) in self._seen
            # A repeat of a stored entry (a push retried because its answer was lost) is not
            # out of order: Loki stores it once, wherever it falls.
            if self.check_order and entry.ts_ns < newest and not repeat:
                self.violations.append(
                    f"entry at {entry.ts_ns} after {newest} in stream {dict(entry.label_key)}"
                )
            if entry.ts_ns > newest:
                self._newest[entry.label_key] = entry.ts_ns
            if self.store:
                marker = (entry.label_key, entry.ts_ns, entry.line)
                if marker in self._seen:
                    self.duplicates += 1
                    continue
                self._seen.add(marker)
                self._entries.append(entry)
            fresh.append(entry)
        self.accepted += len(fresh)
        if self.on_accept is not None:
            self.on_accept(fresh)
        self._notify()
        request.setResponseCode(204)
        return b""

    def _notify(self) -> None:
        ready = [w for w in self._waiters if self.accepted >= w[0]]
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
            if self.check_labels:
                problem = protocol_label_problem(labels)
                if problem is not None and problem not in self.violations:
                    self.violations.append(problem)
            values = stream.get("values")
            if not isinstance(values, list):
                raise _BadPush(400, f"streams[{i}].values: expected an array\n")
            shared = dict(labels)
            floor = newest.get(key, 0)
            strict = self.reject_out_of_order
            append = out.append
            for j, value in enumerate(values):
                if type(value) is not list or not 2 <= len(value) <= 3:
                    raise _BadPush(400, f"streams[{i}].values[{j}]: expected [\"<ns>\", \"<line>\"]\n")
                stamp, line = value[0], value[1]
                if type(stamp) is not str or type(line) is not str:
                    raise _BadPush(400, f"streams[{i}].values[{j}]: expected [\"<ns>\", \"<line>\"]\n")
                if not stamp.isdigit():
                    raise _BadPush(400, f"streams[{i}].values[{j}]: invalid timestamp {stamp!r}\n")
                ts = int(stamp)
                if strict and ts < floor:
                    raise _BadPush(
                        400,
                        f"entry with timestamp {ts} ignored, reason: 'entry out of order' for "
                        f"stream: {labels}\n",
                    )
                if ts > floor:
                    floor = ts
                append(StoredEntry(shared, key, ts, line))
            newest[key] = floor
        return out
