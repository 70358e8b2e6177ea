# -*- test-case-name: tests.test_logs -*-
"""
Loki push bodies (protocol section 8): label sets, entries, and the JSON (optionally gzip)
encoding of a batch. Pure functions, safe in any thread; the shipper runs the expensive ones
(encoding and compressing a large batch, decoding one to split it) off the reactor thread.

An I{entry} is a plain tuple C{(label_key, unix_ns, line)}; a I{label key} is the label set as a
sorted tuple of C{(name, value)} pairs (hashable, so streams group by it cheaply).
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "ENTRY_OVERHEAD",
    "Entry",
    "LabelKey",
    "decode_body",
    "encode_batch",
    "label_key",
]

LabelKey = tuple[tuple[str, str], ...]
Entry = tuple[LabelKey, int, str]

#: Bytes counted per entry on top of its line, for memory accounting (the tuple, the int, the
#: list slot and the str header that Python keeps per line).
ENTRY_OVERHEAD = 120

_LABEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LABEL_BAD_CHARS = re.compile(r"[^A-Za-z0-9_]")


def label_key(labels: Mapping[str, str]) -> LabelKey:
    """
    The label key of C{labels}: names made valid for Loki (C{[A-Za-z_][A-Za-z0-9_]*}, other
    characters become C{_}), empty values left out, sorted. Never empty (C{job="llmport-agent"}
    when nothing is left).
    """
    items: dict[str, str] = {}
    for name, value in labels.items():
        name = str(name)
        if not _LABEL_NAME.match(name):
            name = _LABEL_BAD_CHARS.sub("_", name) or "_"
            if name[0].isdigit():
                name = "_" + name
        text = str(value)
        if text:
            items[name] = text
    if not items:
        items["job"] = "llmport-agent"
    return tuple(sorted(items.items()))


def encode_batch(
    entries: Sequence[Entry], floors: Mapping[LabelKey, int], gzip_level: int = 1
) -> tuple[bytes, dict[LabelKey, int]]:
    """
    The push body for C{entries}: one stream per label key (in first-seen order), each stream's
    values in time order (stable: lines with equal times keep their order) and never earlier
    than C{floors[key]}, the last time that stream was given before (an older line is stamped
    with that time, so a Loki that refuses out-of-order entries takes it).

    Returns the body (gzip-compressed at C{gzip_level}, plain JSON when it is 0) and each
    stream's last time. Pure; safe in any thread.
    """
    grouped: dict[LabelKey, list[tuple[int, str]]] = {}
    for key, ts, line in entries:
        values = grouped.get(key)
        if values is None:
            values = grouped[key] = []
        values.append((ts, line))
    streams: list[dict[str, Any]] = []
    last: dict[LabelKey, int] = {}
    for key, values in grouped.items():
        values.sort(key=_time)
        floor = floors.get(key, 0)
        out: list[list[str]] = []
        for ts, line in values:
            if ts < floor:
                ts = floor
            floor = ts
            out.append([str(ts), line])
        last[key] = floor
        streams.append({"stream": dict(key), "values": out})
    raw = json.dumps({"streams": streams}, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "replace"
    )
    if gzip_level > 0:
        raw = gzip.compress(raw, compresslevel=gzip_level, mtime=0)
    return raw, last


def _time(value: tuple[int, str]) -> int:
    return value[0]


def decode_body(body: bytes) -> list[Entry]:
    """
    The entries of a body made by L{encode_batch} (gzip or not), stream by stream.

    @raise ValueError: the body is not such a push body.
    """
    if body[:2] == b"\x1f\x8b":
        try:
            body = gzip.decompress(body)
        except (OSError, EOFError) as e:
            raise ValueError(f"not a gzip body ({e})") from None
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    streams = doc.get("streams") if isinstance(doc, dict) else None
    if not isinstance(streams, list):
        raise ValueError("no 'streams' array")
    out: list[Entry] = []
    for stream in streams:
        if not isinstance(stream, dict) or not isinstance(stream.get("stream"), dict):
            raise ValueError("a stream without labels")
        key = label_key(stream["stream"])
        for value in stream.get("values") or ():
            if not isinstance(value, list) or len(value) < 2:
                raise ValueError("a value that is not [ns, line]")
            out.append((key, int(value[0]), str(value[1])))
    return out
