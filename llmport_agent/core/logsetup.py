"""
Logging for the foreground runner: journal entries, text or JSON lines on stdout, level from
LOG_LEVEL, Autobahn quieted.

Under systemd (C{JOURNAL_STREAM} names stdout, sd_journal_print(3)) with C{LOG_FORMAT=auto} the
agent writes to the journal (L{JournalObserver}): each event one entry whose C{MESSAGE} is the
readable line and whose C{PRIORITY} is the event's level (C{journalctl -p warning} filters by
it), with the structured fields as the entry's own fields (C{LOGGER}, C{ERROR}, and the
event's fields upper-cased: C{journalctl -o json} or C{-o verbose} shows them), sent over the
journal's native socket. Where that socket cannot take an entry, the line goes to stdout with
its C{<N>} priority prefix (sd-daemon(3)), which journald reads the same way, without the fields.

JSON lines (C{--json-logs}, C{LOG_FORMAT=json}, and by default when stdout is not a terminal, as
C{twist --log-format} does) are one flat object each: C{time} (ISO 8601, UTC, milliseconds),
C{level}, C{logger} (the event's namespace), C{message} (the formatted text), the event's own
fields, and C{error} (the traceback) for failures. Twisted's bookkeeping (C{log_*} keys, the
format string, the logger object) stays out. Every text value passes the same redaction as
lines shipped to Loki: anything shaped like a credential, a bearer value or a URL password
becomes C{***}.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import sys
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import IO, Any

from twisted.logger import (
    FilteringLogObserver,
    ILogFilterPredicate,
    ILogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    PredicateResult,
    formatEvent,
    globalLogBeginner,
    textFileLogObserver,
)
from zope.interface import implementer

from llmport_agent.logs.redact import margin_for, redact, redact_cut

LEVELS = {
    "DEBUG": LogLevel.debug,
    "INFO": LogLevel.info,
    "WARN": LogLevel.warn,
    "ERROR": LogLevel.error,
    "CRITICAL": LogLevel.critical,
}

#: Longest text value written (a runaway repr must not make a megabyte line).
MAX_FIELD_CHARS = 8192
#: Keys Twisted (or its legacy bridge) puts on events that are not the event's own fields.
_INTERNAL = frozenset({"format", "message", "isError", "system", "time", "why", "failure", "printed"})


#: Third-party lines that repeat one of the agent's own: (namespace prefix, format prefix).
#: ClientService's "Scheduling retry N ..." (its N restarts at 1 whenever TCP connects, and the
#: delay is unrounded) and Autobahn's "dropping connection ... abort=True" are both said by the
#: session's one line per failed attempt (what happened, the rounded delay, the real attempt).
REPEATED_THIRD_PARTY = (
    ("twisted.application", "Scheduling retry "),
    ("autobahn", "dropping connection to peer "),
)


@implementer(ILogFilterPredicate)
class ThirdPartyRepeats:
    """Drops the L{REPEATED_THIRD_PARTY} events; everything else passes on."""

    def __call__(self, event: dict[str, Any]) -> PredicateResult:
        namespace = str(event.get("log_namespace") or "")
        fmt = event.get("log_format")
        if isinstance(fmt, str):
            for ns, prefix in REPEATED_THIRD_PARTY:
                if namespace.startswith(ns) and fmt.startswith(prefix):
                    return PredicateResult.no
        return PredicateResult.maybe


def level_predicate(level: str) -> LogLevelFilterPredicate:
    predicate = LogLevelFilterPredicate(defaultLogLevel=LEVELS.get(level, LogLevel.info))
    # Autobahn and txaio are chatty at info level about every handshake.
    for namespace in ("autobahn", "txaio"):
        predicate.setLogLevelForNamespace(namespace, LogLevel.warn)
    return predicate


def _plain(value: Any, secrets: Iterable[str], depth: int = 0) -> Any:
    """A JSON-friendly copy of C{value}: scalars kept, text redacted and bounded."""
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else str(value)
    if isinstance(value, str):
        return _cut(value, secrets)  # field values (error texts too) strictly: not the agent's sentence
    if depth < 3 and isinstance(value, dict):
        return {str(k)[:128]: _plain(v, secrets, depth + 1) for k, v in list(value.items())[:64]}
    if depth < 3 and isinstance(value, list | tuple | set | frozenset):
        return [_plain(v, secrets, depth + 1) for v in list(value)[:64]]
    try:
        text = str(value)
    except Exception:
        text = f"<unprintable {type(value).__name__}>"
    return _cut(text, secrets)


def _cut(text: str, secrets: Iterable[str], prose: bool = False, tail: bool = False) -> str:
    """C{text} redacted and cut to L{MAX_FIELD_CHARS}: no part of a secret across the cut."""
    secrets = list(secrets)
    return redact_cut(text, MAX_FIELD_CHARS, lambda t: redact(t, secrets, prose=prose), margin_for(secrets), tail)


def flat_event(event: dict[str, Any], secrets: Iterable[str] = ()) -> dict[str, Any]:
    """
    The flat JSON object for one log event. The event's fields are redacted, and the message is
    formatted from the redacted fields, so the literal text of a message is never mangled by a
    pattern while no field value reaches the line unredacted.
    """
    level = event.get("log_level")
    when = event.get("log_time")
    stamp = datetime.fromtimestamp(when if isinstance(when, int | float) else 0, UTC)
    fields = {
        str(key)[:128]: _plain(value, secrets)
        for key, value in event.items()
        if not key.startswith("log_") and key not in _INTERNAL
    }
    message = _format(event, fields, secrets)
    out: dict[str, Any] = {
        "time": stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "level": getattr(level, "name", "info"),
        "logger": str(event.get("log_namespace") or "-"),
        "message": message[:MAX_FIELD_CHARS],
    }
    for key, value in fields.items():
        out.setdefault(key, value)
    failure = event.get("log_failure")
    if failure is not None:
        try:
            out["error"] = _cut(failure.getTraceback(), secrets, tail=True)
            out["error_type"] = getattr(failure.type, "__name__", str(failure.type))
        except Exception:
            out["error"] = "unprintable failure"
    return out


def _format(event: dict[str, Any], fields: dict[str, Any], secrets: Iterable[str]) -> str:
    plain = {k: v for k, v in event.items() if k.startswith("log_")}
    # Legacy keys (format, message, why, ...) take part in formatting: redacted too.
    # Only the legacy format string is the agent's own sentence (the relaxed prose rule).
    plain.update({k: redact(v, secrets, prose=k == "format") if isinstance(v, str) else v
                  for k, v in event.items() if k in _INTERNAL})
    plain.update(fields)
    plain.pop("log_failure", None)
    try:
        text = formatEvent(plain)
    except Exception:
        text = ""
    if not text or text.startswith("Unable to format event"):
        # The format string needs the objects themselves ({obj.attr}): format, then redact it all.
        try:
            text = redact(formatEvent(event), secrets)
        except Exception:
            text = str(event.get("log_format", ""))
    return text


@implementer(ILogObserver)
class FlatJSONObserver:
    """Writes L{flat_event} objects as JSON lines."""

    def __init__(self, stream: IO[str], secrets: Callable[[], Iterable[str]] | None = None) -> None:
        self._stream = stream
        self._secrets = secrets

    def __call__(self, event: dict[str, Any]) -> None:
        try:
            secrets = list(self._secrets()) if self._secrets is not None else []
        except Exception:
            secrets = []
        try:
            line = json.dumps(flat_event(event, secrets), ensure_ascii=False, default=str)
        except Exception as e:  # never let a log line kill the agent
            line = json.dumps({"level": "error", "logger": "llmport_agent.core.logsetup",
                               "message": f"unloggable event: {type(e).__name__}"})
        try:
            self._stream.write(line + "\n")
            self._stream.flush()
        except (OSError, ValueError):
            pass


#: The journal's native protocol socket (systemd.journal-fields(7), the native protocol).
JOURNAL_SOCKET = "/run/systemd/journal/socket"
#: The most bytes of one entry sent to the journal (fields past it are left out).
MAX_ENTRY_BYTES = 96 * 1024
#: syslog priorities (sd-daemon(3)) of Twisted's levels.
PRIORITIES = {"debug": 7, "info": 6, "warn": 4, "error": 3, "critical": 2}
#: Field names the journal or the agent sets itself: an event field of that name is renamed.
_RESERVED = frozenset({"MESSAGE", "MESSAGE_ID", "PRIORITY", "SYSLOG_IDENTIFIER", "SYSLOG_FACILITY",
                       "SYSLOG_PID", "SYSLOG_TIMESTAMP", "CODE_FILE", "CODE_LINE", "CODE_FUNC", "ERRNO",
                       "LOGGER", "ERROR", "ERROR_TYPE", "TIME", "LEVEL", "INVOCATION_ID",
                       "DOCUMENTATION", "TID", "UNIT", "USER_UNIT"})
_NOT_FIELD = re.compile(r"[^A-Z0-9_]")


def journal_field_name(key: str) -> str | None:
    """An event field's name as a journal field (upper case, A-Z 0-9 _), or C{None}."""
    name = _NOT_FIELD.sub("_", key.upper()).lstrip("_0123456789")[:64]
    if not name:
        return None
    if name in _RESERVED:
        name = ("FIELD_" + name)[:64]
    return name


def _field(name: str, value: str) -> bytes:
    data = value.encode("utf-8", "replace")
    if b"\n" in data:  # the binary-safe form: name, newline, 64-bit little-endian length, data
        return name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
    return name.encode() + b"=" + data + b"\n"


def journal_entry(flat: dict[str, Any], identifier: str = "llmport-agent") -> bytes:
    """One native-protocol datagram for a L{flat_event} (bounded by L{MAX_ENTRY_BYTES})."""
    level = str(flat.get("level", "info"))
    out = [
        _field("MESSAGE", str(flat.get("message", ""))),
        _field("PRIORITY", str(PRIORITIES.get(level, 6))),
        _field("SYSLOG_IDENTIFIER", identifier),
        _field("LOGGER", str(flat.get("logger", "-"))),
    ]
    size = sum(map(len, out))
    extra = {k: v for k, v in flat.items() if k not in ("time", "level", "logger", "message")}
    for key, value in extra.items():
        name = "ERROR" if key == "error" else "ERROR_TYPE" if key == "error_type" else journal_field_name(key)
        if name is None or value is None:
            continue
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        item = _field(name, text)
        if size + len(item) > MAX_ENTRY_BYTES:
            continue
        out.append(item)
        size += len(item)
    return b"".join(out)


def journal_stream_is(stream: IO[str] | None, environ: dict[str, str] | None = None) -> bool:
    """Whether C{JOURNAL_STREAM} names C{stream}'s file (stdout connected to the journal)."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat((stream or sys.stdout).fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


@implementer(ILogObserver)
class JournalObserver:
    """
    Writes events to the journal: native entries with fields, else C{<N>}-prefixed text lines on
    C{stream} (see the module's docstring). Never blocks: the datagram is sent without waiting,
    and a full journal socket sends that entry to C{stream} instead.
    """

    def __init__(self, stream: IO[str], secrets: Callable[[], Iterable[str]] | None = None,
                 socket_path: str | None = JOURNAL_SOCKET) -> None:
        self._stream = stream
        self._secrets = secrets
        self._path = socket_path
        self._sock: socket.socket | None = None
        #: Entries that went to the stream because the socket would not take them.
        self.fallbacks = 0

    def _socket(self) -> socket.socket | None:
        if self._sock is None and self._path:
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            except OSError:
                return None
            self._sock = sock
        return self._sock

    def __call__(self, event: dict[str, Any]) -> None:
        try:
            secrets = list(self._secrets()) if self._secrets is not None else []
        except Exception:
            secrets = []
        try:
            flat = flat_event(event, secrets)
        except Exception as e:  # never let a log line kill the agent
            flat = {"level": "error", "logger": "llmport_agent.core.logsetup",
                    "message": f"unloggable event: {type(e).__name__}"}
        sock = self._socket()
        if sock is not None and self._path:
            try:
                sock.sendto(journal_entry(flat), socket.MSG_DONTWAIT, self._path)
                return
            except OSError:
                self.fallbacks += 1
        self._text(flat)

    def _text(self, flat: dict[str, Any]) -> None:
        prefix = f"<{PRIORITIES.get(str(flat.get('level', 'info')), 6)}>"
        lines = str(flat.get("message", "")).splitlines() or [""]
        error = flat.get("error")
        if isinstance(error, str) and error:
            lines += error.rstrip("\n").splitlines()
        try:
            self._stream.write("".join(prefix + line + "\n" for line in lines))
            self._stream.flush()
        except (OSError, ValueError):
            pass


def choose_format(log_format: str, stream: IO[str] | None = None, environ: dict[str, str] | None = None) -> str:
    """
    C{journal}, C{json} or C{text} for C{LOG_FORMAT}: C{auto} is the journal when
    C{JOURNAL_STREAM} names stdout (under systemd), else JSON unless stdout is a terminal.
    """
    if log_format in ("json", "text", "journal"):
        return log_format
    if journal_stream_is(stream, environ):
        return "journal"
    return "json" if want_json("auto", stream) else "text"


def want_json(log_format: str, stream: IO[str] | None = None) -> bool:
    """C{auto}: JSON unless stdout is a terminal."""
    if log_format == "json":
        return True
    if log_format == "text":
        return False
    out = stream or sys.stdout
    try:
        return not out.isatty()
    except (AttributeError, ValueError):
        return True


def make_observer(
    level: str,
    stream: IO[str] | None = None,
    json: bool = False,
    secrets: Callable[[], Iterable[str]] | None = None,
    format: str | None = None,
    journal_socket: str | None = JOURNAL_SOCKET,
) -> ILogObserver:
    """C{format}: C{journal}, C{json} or C{text} (C{None}: JSON if C{json}, else text)."""
    out = stream or sys.stdout
    chosen = format or ("json" if json else "text")
    base: ILogObserver
    if chosen == "journal":
        base = JournalObserver(out, secrets, journal_socket)
    elif chosen == "json":
        base = FlatJSONObserver(out, secrets)
    else:
        base = textFileLogObserver(out)
    return FilteringLogObserver(base, [ThirdPartyRepeats(), level_predicate(level)])


class SecretsHolder:
    """Where the running agent puts its secrets provider, so log lines can mask them exactly."""

    def __init__(self) -> None:
        self.provider: Callable[[], Iterable[str]] | None = None

    def __call__(self) -> Iterable[str]:
        return self.provider() if self.provider is not None else ()


def begin_logging(level: str, json: bool = False, secrets: Callable[[], Iterable[str]] | None = None,
                  format: str | None = None) -> None:
    globalLogBeginner.beginLoggingTo([make_observer(level, json=json, secrets=secrets, format=format)],
                                     redirectStandardIO=False)


def twistd_json_observer() -> ILogObserver:
    """For C{twistd --logger llmport_agent.core.logsetup.twistd_json_observer}: the same JSON lines."""
    return FilteringLogObserver(FlatJSONObserver(sys.stdout), [ThirdPartyRepeats()])
