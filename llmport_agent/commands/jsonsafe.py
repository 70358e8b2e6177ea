"""
Whether a command result can become JSON (protocol 10.4, C{result_not_serializable}).

The session serialises frames with C{default=str} and sends C{null} for NaN and infinities,
so odd leaf values (a set, bytes, a path) arrive as text. What it cannot serialise, and what
would lose the result (and leave the command stuck in the backend), is a structure nested
too deeply or circular, a mapping key that JSON has no form for, or a structure too large to
walk. L{json_problem} finds those in one bounded, iterative walk (no recursion).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Deeper than this is refused (commands are refused at the same depth, parse.MAX_COMMAND_DEPTH).
MAX_RESULT_DEPTH = 64
#: At most this many values are looked at (a shared sub-structure counts every time).
MAX_RESULT_VALUES = 1_000_000

_KEY_TYPES = (str, int, float, bool, type(None))


def json_problem(
    obj: Any, *, max_depth: int = MAX_RESULT_DEPTH, max_values: int = MAX_RESULT_VALUES
) -> str | None:
    """C{None} when C{obj} can be sent as JSON, else what is wrong and where (one phrase)."""
    stack: list[tuple[Any, int, str]] = [(obj, 0, "result")]
    seen = 0
    while stack:
        value, depth, where = stack.pop()
        seen += 1
        if seen > max_values:
            return f"it holds more than {max_values} values"
        if isinstance(value, Mapping):
            if depth >= max_depth:
                return f"{where} is nested more than {max_depth} levels deep (or circular)"
            for key, item in value.items():
                if not isinstance(key, _KEY_TYPES):
                    return f"{where} has a key of type {type(key).__name__}"
                stack.append((item, depth + 1, f"{where}.{str(key)[:40]}"))
        elif isinstance(value, list | tuple):
            if depth >= max_depth:
                return f"{where} is nested more than {max_depth} levels deep (or circular)"
            for i, item in enumerate(value):
                stack.append((item, depth + 1, f"{where}[{i}]"))
    return None
