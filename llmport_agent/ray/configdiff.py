"""
Whether a candidate C{llm_configs} list is what a running Serve application runs
(C{describe_ray_cluster.verify}, protocol 10.6). Pure: no I/O; bounded and iterative.

What counts as equal (the agent decides; the container only says what runs):

  - Lists are compared position by position; a different length is a difference at the
    list's path (C{running} and C{candidate} are the two lengths), and the common part is
    still compared.
  - Objects are compared key by key. A key the candidate gives must be in the running
    configuration with an equal value. A key only the running configuration has is a
    difference too, unless it is one of the running configuration's I{defaults}: the fields
    nobody set, which Ray filled in (the inspection program lists them); a key of a free
    mapping such as C{engine_kwargs} is never a default, so a parser that runs but is not in
    the candidate is a difference.
  - Values are compared strictly by JSON type: C{0.8} and C{"0.8"} differ, C{true} and C{1}
    differ, C{null} equals only C{null}; numbers compare by value (C{1} equals C{1.0}, as JSON
    does not tell them apart), exactly (no tolerance).

A difference is C{{path, running, candidate}} with C{path} like
C{llm_configs.0.engine_kwargs.tool_call_parser}; where one side lacks the key, C{absent}
names that side (C{"running"} or C{"candidate"}) and its value shows as C{null}. Differences
come in a fixed order (keys sorted, depth first), at most L{MAX_DIFFS} of them
(C{diff_truncated} says there were more). A structure deeper than L{MAX_DEPTH} or larger than
L{MAX_VALUES} is not compared: C{equal} is C{None} with an C{explanation}, never a guess.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from llmport_agent.core.values import frozen

MAX_DEPTH = 32
MAX_VALUES = 100_000
MAX_DIFFS = 50
#: A value shown in a difference is at most this long as JSON (else summarised).
_SHOWN = 512
_KEY = 100


@frozen
class Comparison:
    """C{equal} is C{True}, C{False}, or C{None} when it could not be decided (C{explanation})."""

    equal: bool | None
    diff: tuple[dict[str, Any], ...] = ()
    truncated: bool = False
    explanation: str | None = None

    def as_result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"equal": self.equal, "diff": list(self.diff) if self.equal is not None else None}
        if self.truncated:
            out["diff_truncated"] = True
        if self.explanation:
            out["explanation"] = self.explanation
        return out


class _TooBig(Exception):
    pass


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, list | tuple):
        return "array"
    return "other"


def _shown(value: Any) -> Any:
    """A value as a difference shows it: short strings and small structures as they are."""
    if isinstance(value, str):
        return value if len(value) <= _SHOWN else value[:_SHOWN] + "..."
    if isinstance(value, Mapping | list | tuple):
        try:
            text = json.dumps(value, default=str)
        except (TypeError, ValueError, RecursionError):
            text = None
        if text is not None and len(text) <= _SHOWN:
            return json.loads(text)
        return f"<{'object with' if isinstance(value, Mapping) else 'array of'} {len(value)} items>"
    if _kind(value) == "other":
        return str(value)[:_SHOWN]
    return value


def _leaf_equal(a: Any, b: Any) -> bool:
    ka, kb = _kind(a), _kind(b)
    if ka != kb:
        return False
    if ka == "other":
        return False  # not JSON: never taken as equal
    return bool(a == b)


def _key(k: Any) -> str:
    return str(k)[:_KEY]


def compare(
    running: Sequence[Any],
    candidate: Sequence[Any],
    defaults: Sequence[Iterable[str]] = (),
    *,
    root: str = "llm_configs",
    max_depth: int = MAX_DEPTH,
    max_values: int = MAX_VALUES,
    max_diffs: int = MAX_DIFFS,
) -> Comparison:
    """
    Compare C{candidate} with C{running} (both lists of configurations); C{defaults[i]}
    holds the dotted paths (relative to configuration C{i}) that Ray filled in. See the
    module docstring for what is equal.
    """
    if not isinstance(running, list | tuple) or not isinstance(candidate, list | tuple):
        return Comparison(None, explanation="not compared: the running and candidate llm_configs must both be lists")
    default_sets = [frozenset(str(p) for p in d) for d in defaults]
    diffs: list[dict[str, Any]] = []
    truncated = False

    def add(entry: dict[str, Any]) -> bool:
        nonlocal truncated
        if len(diffs) >= max_diffs:
            truncated = True
            return False
        diffs.append(entry)
        return True

    # (running value, candidate value, path parts, depth, config index, path inside that config)
    stack: list[tuple[Any, Any, tuple[str, ...], int, int, str]] = [(running, candidate, (root,), 0, -1, "")]
    seen = 0
    try:
        while stack and not truncated:
            a, b, path, depth, index, rel = stack.pop()
            seen += 1
            if seen > max_values:
                raise _TooBig(f"more than {max_values} values")
            if depth > max_depth:
                raise _TooBig(f"nested more than {max_depth} levels deep")
            here = ".".join(path)
            if isinstance(a, Mapping) and isinstance(b, Mapping):
                keys = sorted({_key(k) for k in a} | {_key(k) for k in b})
                if len(keys) > max_values:
                    raise _TooBig(f"more than {max_values} keys in {here}")
                ka = {_key(k): v for k, v in a.items()}
                kb = {_key(k): v for k, v in b.items()}
                todo = []
                own = default_sets[index] if 0 <= index < len(default_sets) else frozenset()
                for k in keys:
                    sub = f"{rel}.{k}" if rel else k
                    if k not in kb:
                        if sub in own:
                            continue  # Ray's default, not set by anyone: the candidate need not say it
                        todo.append(("absent", k, ka[k], None, "candidate"))
                    elif k not in ka:
                        todo.append(("absent", k, None, kb[k], "running"))
                    else:
                        todo.append(("walk", k, ka[k], kb[k], sub))
                for item in reversed(todo):
                    kind, k, va, vb, extra = item
                    if kind == "walk":
                        stack.append((va, vb, (*path, k), depth + 1, index, extra))
                    else:
                        stack.append((_Absent(va, vb, extra), None, (*path, k), depth + 1, index, rel))
            elif isinstance(a, _Absent):
                if not add({"path": here, "running": _shown(a.running), "candidate": _shown(a.candidate),
                            "absent": a.side}):
                    break
            elif isinstance(a, list | tuple) and isinstance(b, list | tuple):
                if len(a) != len(b):
                    if not add({"path": here, "running": len(a), "candidate": len(b), "length": True}):
                        break
                n = min(len(a), len(b))
                if n > max_values:
                    raise _TooBig(f"more than {max_values} items in {here}")
                for i in reversed(range(n)):
                    if index < 0 and depth == 0:
                        stack.append((a[i], b[i], (*path, str(i)), depth + 1, i, ""))
                    else:
                        stack.append((a[i], b[i], (*path, str(i)), depth + 1, index, f"{rel}.{i}" if rel else str(i)))
            elif not _leaf_equal(a, b):
                if not add({"path": here, "running": _shown(a), "candidate": _shown(b)}):
                    break
    except _TooBig as exc:
        return Comparison(None, explanation=f"not compared: the configurations are too large to compare ({exc})")
    return Comparison(not diffs, tuple(diffs), truncated)


@frozen
class _Absent:
    """A key one side lacks (queued so the differences keep their sorted order)."""

    running: Any
    candidate: Any
    side: str
