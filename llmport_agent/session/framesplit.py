"""
Salvaging a frame that does not parse as a whole.

The backend re-sends its oldest pending commands in every C{commands} frame, so one command
that breaks the JSON parser (nested deeper than the parser's recursion limit, invalid UTF-8 in
one string, a stray byte) would otherwise cost every command listed with it, in every frame,
for ever. L{salvage_frame} takes such a frame apart without parsing it as a whole: a small
scanner finds the boundaries of the top-level values and of the items of top-level arrays,
and each is parsed on its own. An item that still does not parse becomes an L{UnparsedItem}
holding the top-level scalar fields that could be read (a command's C{id}, C{correlation_id},
C{command_type}), so the command can still be answered.

The JSON parser is tried on every part first (fast, in C); the scanner only walks what it
refuses. The scanner is iterative (nothing recurses), linear (regular expressions without
backtracking skip strings, other text and shallow bracket pairs; runs of brackets are one
step), and bounded per frame by L{MAX_SCAN_STEPS} and L{MAX_SCAN_CHARS} on top of the frame
size limit: a frame whose broken parts cost more is salvaged up to that point (the command
being scanned is still answered when its id came before the costly part) and the rest is
left for the backend's next frame, which lists the same commands again.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from attrs import field

from llmport_agent.core.values import frozen

__all__ = ["UnparsedItem", "salvage_frame"]

#: Scalar fields longer than this (JSON text) are not kept in an L{UnparsedItem}.
MAX_FIELD_CHARS = 4096
#: Per frame: at most this many bracket runs are stepped over by the scanner...
MAX_SCAN_STEPS = 100_000
#: ... and at most this many characters of broken parts are scanned.
MAX_SCAN_CHARS = 2 * 1024 * 1024

_WS = re.compile(r"[ \t\n\r]*")
_STRING = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.S)
_SCALAR = re.compile(r"[^,\]}\s]*")
# Depth-neutral text, matched in one step without backtracking (atomic groups, possessive
# quantifiers): strings, runs of other characters, and balanced pairs of brackets up to two
# levels deep. What is left between two such runs are runs of opening or closing brackets.
_F = r'(?>"[^"\\]*+(?:\\.[^"\\]*+)*+"|[^\[\]{}"]++)'
_LEAF1 = rf"(?>\[{_F}*+\]|\{{{_F}*+\}})"
_LEAF2 = rf"(?>\[(?>{_F}|{_LEAF1})*+\]|\{{(?>{_F}|{_LEAF1})*+\}})"


@functools.cache
def _token() -> re.Pattern[str]:
    """The scanner's pattern, compiled at the first salvage (half a millisecond of every start
    otherwise: most agents never see a broken frame)."""
    return re.compile(rf"(?>{_F}|{_LEAF2})++|([\[{{]++)|([\]}}]++)|(\")", re.S)


_DECODER = json.JSONDecoder()


class _Broken(Exception):
    """The text's structure cannot be followed (unterminated, not JSON-shaped)."""


class _OverBudget(Exception):
    """Taking this frame apart any further would cost more than the budget."""


@frozen
class UnparsedItem:
    """
    An item of a frame that could not be parsed.

    @ivar fields: its top-level scalar fields that could be read (strings, numbers, booleans,
        null), e.g. C{{"id": ..., "command_type": ...}}.
    @ivar reason: why it did not parse (one phrase).
    """

    fields: dict[str, Any] = field(factory=dict)
    reason: str = ""

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


def _skip(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()  # type: ignore[union-attr]


class _Scanner:
    """Walks one frame's text, within the budget."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.steps = MAX_SCAN_STEPS
        self.chars = MAX_SCAN_CHARS

    def value_end(self, pos: int) -> int:
        """The index just after the JSON value starting at C{pos} (not whitespace)."""
        text = self.text
        if pos >= len(text):
            raise _Broken("a value is missing")
        c = text[pos]
        if c == '"':
            m = _STRING.match(text, pos)
            if m is None:
                raise _Broken("a string is not terminated")
            return m.end()
        if c not in "[{":
            end = _SCALAR.match(text, pos).end()  # type: ignore[union-attr]
            if end == pos:
                raise _Broken(f"unexpected {c!r}")
            return end
        depth = 1
        # The window bounds even one long depth-neutral match by the budget.
        window = min(len(text), pos + 1 + max(0, self.chars))
        truncated = window < len(text)
        for m in _token().finditer(text, pos + 1, window):
            self.steps -= 1
            self.chars -= m.end() - m.start()
            if self.steps < 0:
                raise _OverBudget()
            kind = m.lastindex
            if kind is None:
                continue  # depth-neutral
            if kind == 1:
                depth += m.end() - m.start()
            elif kind == 2:
                closes = m.end() - m.start()
                if closes >= depth:
                    return m.start() + depth
                depth -= closes
            else:
                if truncated:
                    raise _OverBudget()
                raise _Broken("a string is not terminated")
        if truncated:
            raise _OverBudget()
        raise _Broken("an array or object is not terminated")

    def parse(self, pos: int) -> tuple[int, Any, str | None]:
        """
        The value at C{pos}: (end, value, None) when the JSON parser takes it, else
        (end, an L{UnparsedItem} or None, reason).
        """
        text = self.text
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except (ValueError, RecursionError) as e:
            reason = "it is nested too deeply" if isinstance(e, RecursionError) else (
                f"it is not valid JSON ({str(e)[:80]})")
            if text[pos : pos + 1] == "{":
                end, item = self.unparsed(pos, reason)
                return end, item, reason
            return self.value_end(pos), None, reason
        try:
            text[pos:end].encode("utf-8")
        except UnicodeEncodeError:
            reason = "it is not valid UTF-8"
            if text[pos : pos + 1] == "{":
                end, item = self.unparsed(pos, reason)
                return end, item, reason
            return end, None, reason
        return end, value, None

    def key(self, pos: int) -> tuple[str, int]:
        """An object key at C{pos} and the position after its ':'."""
        m = _STRING.match(self.text, pos)
        if m is None:
            raise _Broken("an object key is missing")
        try:
            key = json.loads(m.group())
        except ValueError:
            raise _Broken("an object key is not a valid string") from None
        pos = _skip(self.text, m.end())
        if self.text[pos : pos + 1] != ":":
            raise _Broken("a ':' is missing")
        return key, _skip(self.text, pos + 1)

    def after(self, pos: int, close: str) -> tuple[int, bool]:
        """After a member or element: (position of the next one, whether the container ended)."""
        pos = _skip(self.text, pos)
        c = self.text[pos : pos + 1]
        if c == ",":
            return _skip(self.text, pos + 1), False
        if c == close:
            return pos + 1, True
        raise _Broken(f"a ',' or {close!r} is missing")

    def unparsed(self, start: int, reason: str) -> tuple[int, UnparsedItem]:
        """
        The object at C{start} that did not parse: its end and its top-level scalar fields.
        Over the budget, the fields read so far ride on the exception.
        """
        fields: dict[str, Any] = {}
        item = UnparsedItem(fields, reason)
        try:
            pos = _skip(self.text, start + 1)
            if self.text[pos : pos + 1] == "}":
                return pos + 1, item
            while True:
                key, vstart = self.key(pos)
                if self.text[vstart : vstart + 1] in ("[", "{"):
                    vend = self.value_end(vstart)
                else:
                    vend, value, bad = self.parse(vstart)
                    if bad is None and vend - vstart <= MAX_FIELD_CHARS:
                        fields[key] = value
                pos, done = self.after(vend, "}")
                if done:
                    return pos, item
        except _OverBudget as e:
            e.args = (item,)
            raise

    def items(self, pos: int) -> tuple[int, list[Any], list[str]]:
        """The elements of the array at C{pos}, one by one: (end, items, problems)."""
        items: list[Any] = []
        problems: list[str] = []
        pos = _skip(self.text, pos + 1)
        if self.text[pos : pos + 1] == "]":
            return pos + 1, items, problems
        while True:
            try:
                end, value, reason = self.parse(pos)
            except _OverBudget as e:
                partial = e.args[0] if e.args else None
                if isinstance(partial, UnparsedItem):
                    items.append(partial)
                e.args = (items, problems)
                raise
            if reason is not None:
                problems.append(f"item {len(items)}: {reason}")
                if value is None:
                    value = UnparsedItem({}, reason)
            items.append(value)
            pos, done = self.after(end, "]")
            if done:
                return pos, items, problems


def salvage_frame(payload: bytes) -> tuple[dict[str, Any], list[str]] | None:
    """
    Take apart a frame that C{json.loads} refused. Returns the frame (top-level values that
    parse; arrays item by item, with L{UnparsedItem}s for items that do not; an object value
    that does not parse as an L{UnparsedItem}; other broken values left out) and a list of
    problems (for the log), or C{None} when the text is not shaped like a JSON object at all.
    """
    scan = _Scanner(payload.decode("utf-8", "surrogateescape"))
    text = scan.text
    frame: dict[str, Any] = {}
    problems: list[str] = []
    key = ""
    try:
        pos = _skip(text, 0)
        if text[pos : pos + 1] != "{":
            return None
        pos = _skip(text, pos + 1)
        done = text[pos : pos + 1] == "}"
        if done:
            pos += 1
        while not done:
            key, vstart = scan.key(pos)
            if text[vstart : vstart + 1] == "[":
                # Item by item straight away (one parse of each; the frame as a whole failed).
                end, items, item_problems = scan.items(vstart)
                frame[key] = items
                problems.extend(f"{key!r} {p}" for p in item_problems)
            else:
                end, value, reason = scan.parse(vstart)
                if reason is None or isinstance(value, UnparsedItem):
                    frame[key] = value
                if reason is not None:
                    problems.append(f"field {key!r}: {reason}")
            pos, done = scan.after(end, "}")
        if _skip(text, pos) != len(text):
            return None
    except _Broken:
        return None
    except _OverBudget as e:
        if e.args and isinstance(e.args[0], list):
            items, item_problems = e.args
            frame[key] = items
            problems.extend(f"{key!r} {p}" for p in item_problems)
        problems.append(
            f"the rest of the frame was left out: its broken parts cost more than "
            f"{MAX_SCAN_STEPS} steps or {MAX_SCAN_CHARS} characters to take apart "
            "(the backend lists the same commands again)"
        )
    return frame, problems
