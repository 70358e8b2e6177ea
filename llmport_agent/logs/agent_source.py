# -*- test-case-name: tests.test_logs -*-
"""
The agent's own log events as Loki lines (protocol section 8, "system logs").

L{AgentLogObserver} is an C{ILogObserver} to add to the global log beginner / publisher. For
each event at or above C{min_level} (info by default) it ships one line,
C{"[<namespace>] <formatted text>"} plus the traceback for failures, with the labels
C{{job: "node-agent", host, container: "node-<agent_id>", agent_id, level}} and the event's own
time.

Events from C{llmport_agent.logs} (the shipper's own complaints) are never shipped, so a Loki
outage cannot feed itself. Every line goes through the L{Redactor} first.

Observers run on whichever thread emitted the event: this one only formats, redacts and calls
the sink's thread-safe C{push}. It never raises and never logs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from twisted.logger import ILogObserver, LogEvent, LogLevel, PredicateResult, formatEvent
from zope.interface import implementer

from llmport_agent.core.logsetup import ThirdPartyRepeats
from llmport_agent.logs import LOG_NAMESPACE
from llmport_agent.logs.loki import ILogSink
from llmport_agent.logs.redact import Redactor

__all__ = ["AgentLogObserver", "LEVEL_LABELS", "level_label", "node_labels"]

#: Third-party lines that repeat the agent's own are not shipped either (as on stdout).
_REPEATS = ThirdPartyRepeats()

#: The C{level} label for each twisted.logger level.
LEVEL_LABELS: dict[LogLevel, str] = {
    LogLevel.debug: "debug",
    LogLevel.info: "info",
    LogLevel.warn: "warn",
    LogLevel.error: "error",
    LogLevel.critical: "critical",
}

_PRIORITY: dict[LogLevel, int] = {
    LogLevel.debug: 0,
    LogLevel.info: 1,
    LogLevel.warn: 2,
    LogLevel.error: 3,
    LogLevel.critical: 4,
}


def level_label(level: LogLevel) -> str:
    """The C{level} label value for C{level} (C{info} for anything unknown)."""
    return LEVEL_LABELS.get(level, "info")


def node_labels(
    agent_id: str, host: Callable[[], str], job: str = "node-agent"
) -> Callable[[], dict[str, str]]:
    """
    The base labels of the node's system logs: C{{job, host, container: "node-<agent_id>",
    agent_id}} (protocol 8 and 10.7: the current backend's agent labels system logs with its
    C{agent_id} too; the UI matches on C{host}).

    @param host: returns the current C{host} label: what the backend stores as the node host
        (normally the advertised IP). Called for every line, from any thread: keep it cheap.
    """
    container = f"node-{agent_id}"

    def labels() -> dict[str, str]:
        return {"job": job, "host": str(host()), "container": container, "agent_id": agent_id}

    return labels


@implementer(ILogObserver)
class AgentLogObserver:
    """
    Ships the agent's log events to a L{ILogSink}.

    @param shipper: the sink (the L{LokiShipper}).
    @param labels_fn: returns the base labels (see L{node_labels}); C{level} is added here.
    @param secrets: returns the exact secret values to mask in every line.
    @param min_level: the lowest level shipped (C{LogLevel.debug} ships debug events too).
    @param exclude_namespaces: namespaces (and their children) never shipped.
    @ivar errors: events that could not be shipped because something raised.
    """

    def __init__(
        self,
        shipper: ILogSink,
        labels_fn: Callable[[], Mapping[str, str]],
        *,
        secrets: Callable[[], Iterable[str | None]] | None = None,
        min_level: LogLevel = LogLevel.info,
        exclude_namespaces: Sequence[str] = (LOG_NAMESPACE,),
        wallclock: Callable[[], float] = time.time,
    ) -> None:
        self._sink = shipper
        self._labels_fn = labels_fn
        self._redact = Redactor(secrets, prose=True)  # the agent's own words
        self._strict = Redactor(secrets)  # field values and tracebacks: text from elsewhere
        self._min = _PRIORITY.get(min_level, 1)
        self._excluded = tuple(exclude_namespaces)
        self._wallclock = wallclock
        self.errors = 0

    def _excluded_namespace(self, namespace: str) -> bool:
        for prefix in self._excluded:
            if namespace == prefix or namespace.startswith(prefix + "."):
                return True
        return False

    def __call__(self, event: LogEvent) -> None:
        try:
            self._observe(event)
        except Exception:
            # Logging from inside an observer would recurse; count it instead.
            self.errors += 1

    def _observe(self, event: LogEvent) -> None:
        namespace = event.get("log_namespace")
        namespace = namespace if isinstance(namespace, str) else ""
        if self._excluded_namespace(namespace) or _REPEATS(event) is PredicateResult.no:
            return
        level: Any = event.get("log_level")
        try:
            priority = _PRIORITY[level]
        except (KeyError, TypeError):
            level = LogLevel.error if event.get("isError") else LogLevel.info
            priority = _PRIORITY[level]
        if priority < self._min:
            return
        # String fields are masked strictly before formatting; the relaxed rule then only
        # spares words of the agent's own format text.
        strict = self._strict.snapshot()
        text = formatEvent({k: strict(v) if isinstance(v, str) and not k.startswith("log_") else v
                            for k, v in event.items()})
        line = self._redact(f"[{namespace}] {text}" if namespace else text)
        failure: Any = event.get("log_failure")
        if failure is not None:
            try:
                line = f"{line}\n{strict(failure.getTraceback())}".rstrip("\n")
            except Exception:
                line = f"{line}\n(traceback unavailable)"
        when = event.get("log_time")
        if not isinstance(when, (int, float)) or when != when or when < 0:
            when = self._wallclock()
        labels = dict(self._labels_fn())
        labels["level"] = level_label(level)
        self._sink.push(labels, int(when * 1_000_000_000), line)
