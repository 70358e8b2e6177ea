"""Logging for the foreground runner: text lines on stdout, level from LOG_LEVEL, Autobahn quieted."""

from __future__ import annotations

import sys
from typing import IO

from twisted.logger import (
    FilteringLogObserver,
    ILogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    globalLogBeginner,
    jsonFileLogObserver,
    textFileLogObserver,
)

LEVELS = {
    "DEBUG": LogLevel.debug,
    "INFO": LogLevel.info,
    "WARN": LogLevel.warn,
    "ERROR": LogLevel.error,
    "CRITICAL": LogLevel.critical,
}


def level_predicate(level: str) -> LogLevelFilterPredicate:
    predicate = LogLevelFilterPredicate(defaultLogLevel=LEVELS.get(level, LogLevel.info))
    # Autobahn and txaio are chatty at info level about every handshake.
    for namespace in ("autobahn", "txaio"):
        predicate.setLogLevelForNamespace(namespace, LogLevel.warn)
    return predicate


def make_observer(level: str, stream: IO[str] | None = None, json: bool = False) -> ILogObserver:
    out = stream or sys.stdout
    base = jsonFileLogObserver(out) if json else textFileLogObserver(out)
    return FilteringLogObserver(base, [level_predicate(level)])


def begin_logging(level: str, json: bool = False) -> None:
    globalLogBeginner.beginLoggingTo([make_observer(level, json=json)], redirectStandardIO=False)
