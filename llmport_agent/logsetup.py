"""
Logging for the foreground runner: text or JSON lines on stdout, level from LOG_LEVEL, Autobahn
quieted.

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

from llmport_agent.logs.redact import redact

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
        return redact(value[:MAX_FIELD_CHARS], secrets)
    if depth < 3 and isinstance(value, dict):
        return {str(k)[:128]: _plain(v, secrets, depth + 1) for k, v in list(value.items())[:64]}
    if depth < 3 and isinstance(value, list | tuple | set | frozenset):
        return [_plain(v, secrets, depth + 1) for v in list(value)[:64]]
    try:
        text = str(value)
    except Exception:
        text = f"<unprintable {type(value).__name__}>"
    return redact(text[:MAX_FIELD_CHARS], secrets)


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
            out["error"] = redact(failure.getTraceback()[-MAX_FIELD_CHARS:], secrets)
            out["error_type"] = getattr(failure.type, "__name__", str(failure.type))
        except Exception:
            out["error"] = "unprintable failure"
    return out


def _format(event: dict[str, Any], fields: dict[str, Any], secrets: Iterable[str]) -> str:
    plain = {k: v for k, v in event.items() if k.startswith("log_")}
    # Legacy keys (format, message, why, ...) take part in formatting: redacted too.
    plain.update({k: redact(v, secrets) if isinstance(v, str) else v for k, v in event.items() if k in _INTERNAL})
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
            line = json.dumps({"level": "error", "logger": "llmport_agent.logsetup",
                               "message": f"unloggable event: {type(e).__name__}"})
        try:
            self._stream.write(line + "\n")
            self._stream.flush()
        except (OSError, ValueError):
            pass


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
) -> ILogObserver:
    out = stream or sys.stdout
    base = FlatJSONObserver(out, secrets) if json else textFileLogObserver(out)
    return FilteringLogObserver(base, [ThirdPartyRepeats(), level_predicate(level)])


class SecretsHolder:
    """Where the running agent puts its secrets provider, so log lines can mask them exactly."""

    def __init__(self) -> None:
        self.provider: Callable[[], Iterable[str]] | None = None

    def __call__(self) -> Iterable[str]:
        return self.provider() if self.provider is not None else ()


def begin_logging(level: str, json: bool = False, secrets: Callable[[], Iterable[str]] | None = None) -> None:
    globalLogBeginner.beginLoggingTo([make_observer(level, json=json, secrets=secrets)],
                                     redirectStandardIO=False)


def twistd_json_observer() -> ILogObserver:
    """For C{twistd --logger llmport_agent.logsetup.twistd_json_observer}: the same JSON lines."""
    return FilteringLogObserver(FlatJSONObserver(sys.stdout), [ThirdPartyRepeats()])
