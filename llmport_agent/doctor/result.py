"""What one doctor check found: a status, what it saw, and what to do."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from llmport_agent.core.cleantext import shown
from llmport_agent.core.values import frozen

OK = "ok"
WARN = "warn"
FAIL = "fail"
_RANK = {OK: 0, WARN: 1, FAIL: 2}
#: A finding's line is bounded (a detail quoting what others wrote cannot flood the terminal).
LINE_MAX = 2000


@frozen
class Finding:
    """
    One line of the doctor's report.

    @ivar check: the check's name (C{backend tls}, C{model store}, ...).
    @ivar status: L{OK}, L{WARN} or L{FAIL}.
    @ivar detail: what was seen (no secret ever: checks never put one here).
    @ivar fix: what to do about it (empty for C{ok}).
    """

    check: str
    status: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        # Details quote what others wrote (the backend, whatever answers on the ops port, file
        # names): on a terminal, no control character (an escape sequence) gets through.
        text = f"{self.status:<4}  {self.check:<18}  {shown(self.detail, LINE_MAX)}"
        return f"{text} -> {shown(self.fix, LINE_MAX)}" if self.fix else text

    def as_dict(self) -> dict[str, Any]:
        return {"check": self.check, "status": self.status, "detail": self.detail, "fix": self.fix}


def ok(check: str, detail: str) -> Finding:
    return Finding(check, OK, detail)


def warn(check: str, detail: str, fix: str) -> Finding:
    return Finding(check, WARN, detail, fix)


def fail(check: str, detail: str, fix: str) -> Finding:
    return Finding(check, FAIL, detail, fix)


def worst(findings: Iterable[Finding]) -> str:
    statuses = [f.status for f in findings]
    return max(statuses, key=_RANK.__getitem__) if statuses else OK


def exit_status(findings: Iterable[Finding]) -> int:
    """0 when everything is ok, 1 with a warning, 2 with a failure."""
    return _RANK[worst(findings)]
