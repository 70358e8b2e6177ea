"""
Fuzzing with hypothesis: inbound frames and command payloads against the session's frame
parsing (L{AgentClientProtocol.onMessage}, L{salvage_frame}) and the command pipeline
(L{parse_command}, L{CommandPipeline}).

Inputs vary types, sizes, encodings (ASCII-escaped or raw UTF-8, invalid UTF-8, stray bytes),
nesting (up to past the parser's recursion limit), odd ids (ints, empty, not UUIDs, other
spellings of one UUID), unicode, huge and non-finite numbers and duplicated keys. Properties:
nothing raises out of the agent's code, nothing is logged as a crash, each frame is handled in
bounded time, and every command with an id is answered exactly once (one ack, then exactly one
result, nothing after the result), also when the backend lists it again.

CI runs a fixed, derandomised number of examples (profile C{ci}); set
C{LLMPORT_FUZZ_EXAMPLES=<n>} for a long run (random, C{n} examples per test). The number of
cases run is printed at the end and, with C{LLMPORT_FUZZ_REPORT=<file>}, written there as JSON.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from types import SimpleNamespace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.base import is_uuid
from llmport_agent.commands.parse import Malformed, parse_command
from llmport_agent.session.framesplit import salvage_frame
from llmport_agent.session.protocol import AgentClientProtocol

from .test_pipeline import Harness

_LONG = os.environ.get("LLMPORT_FUZZ_EXAMPLES")
settings.register_profile(
    "llmport-ci", max_examples=100, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "llmport-long", max_examples=int(_LONG or 0) or 1000, derandomize=False, deadline=None,
    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = settings.get_profile("llmport-long" if _LONG else "llmport-ci")
#: One frame (or command) must be handled well within this (no hang, no quadratic blow-up).
PER_CASE_SECONDS = 20.0

CASES: dict[str, int] = {}


def _count(name: str) -> None:
    CASES[name] = CASES.get(name, 0) + 1


# -- strategies ---------------------------------------------------------------------------------

_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
_scalars = st.one_of(
    st.none(), st.booleans(), _text,
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True),
)
_json = st.recursive(
    _scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=5), st.dictionaries(_text, children, max_size=5)
    ),
    max_leaves=25,
)
_uuid_spellings = st.uuids().flatmap(
    lambda u: st.sampled_from([str(u), str(u).upper(), u.hex, "{" + str(u) + "}", "urn:uuid:" + str(u)])
)
_odd_ids = st.one_of(
    st.integers(), st.just(""), _text, st.none(), st.lists(st.integers(), max_size=2),
    st.just("not-a-uuid"), st.just(str(uuid.UUID(int=0))),
)
#: Command types without a gate (every one of them finishes by itself in the harness).
_types = st.one_of(
    st.sampled_from([
        "noop", "fails", "fetch_container_logs", "refresh_inventory", "collect_diagnostics",
        "set_maintenance_mode", "drain_node", "resume_node", "host_op", "frobnicate", "",
        " ", "x" * 129,
    ]),
    _text.filter(lambda t: not t.startswith("gated") and t not in ("deploy_workload", "boom")),
    st.integers(), st.none(), st.lists(_text, max_size=1),
)


@st.composite
def commands(draw: Any) -> Any:
    """One item of a C{commands} list: mostly command-shaped objects, some anything at all."""
    kind = draw(st.sampled_from(["command"] * 6 + ["odd_id", "not_object"]))
    if kind == "not_object":
        return draw(_json)
    obj: dict[str, Any] = {
        "id": draw(_uuid_spellings) if kind == "command" else draw(_odd_ids),
        "node_id": draw(st.one_of(st.uuids().map(str), _scalars)),
        "command_type": draw(_types),
        "status": "dispatched",
        "correlation_id": draw(st.one_of(st.none(), _text, st.integers())),
        "idempotency_key": draw(st.one_of(_text, st.none(), st.integers())),
        "payload": draw(st.one_of(st.dictionaries(_text, _json, max_size=6), _json)),
        "result": None,
        "timeout_sec": draw(st.one_of(st.none(), st.integers(min_value=-(10**30), max_value=10**30),
                                      st.floats(), _text)),
        "issued_at": draw(st.one_of(st.just("2026-01-01T00:00:00+00:00"), _text, st.integers(), st.none())),
    }
    for key in draw(st.lists(st.sampled_from(sorted(obj)), max_size=3, unique=True)):
        del obj[key]
    if draw(st.booleans()):
        obj.update(draw(st.dictionaries(_text, _json, max_size=3)))
    if draw(st.integers(0, 9)) == 0:
        obj["signature"] = draw(st.one_of(_text, st.integers(), st.just("0" * 64)))
    return obj


def _dump(obj: Any, ascii_only: bool) -> str:
    return json.dumps(obj, ensure_ascii=ascii_only, allow_nan=True, default=str)


@st.composite
def frames(draw: Any) -> tuple[bytes, list[str], set[str]]:
    """
    A C{commands} frame as the bytes of a text message, the JSON text of each item, and how
    the frame was damaged on purpose (C{deep}: valid JSON past the parser's recursion limit;
    C{stray}, C{truncate}, C{utf8}: not JSON any more; C{untyped}: no C{type} field).
    """
    items = draw(st.lists(commands(), max_size=8))
    # The backend lists the same command more than once, sometimes with other content.
    if items and draw(st.booleans()):
        items.append(draw(st.sampled_from(items)))
    ascii_only = draw(st.booleans())
    texts = [_dump(item, ascii_only) for item in items]
    damage: set[str] = set()
    out = list(texts)
    # Three frames in four are valid JSON (duplicated keys at most); the rest damaged.
    damaging = draw(st.integers(0, 3)) == 0
    kinds = ["none"] * 4 + ["duplicate_key"] + (["deep", "deep", "stray", "truncate"] if damaging else [])
    for i, text in enumerate(texts):
        how = draw(st.sampled_from(kinds))
        if how == "duplicate_key" and text.startswith("{") and len(text) > 2:
            # A first "id" the parser overrides with the later one (duplicated keys).
            out[i] = texts[i] = '{"id": "00000000-0000-0000-0000-00000000dead", ' + text[1:]
        elif how == "deep" and text.startswith("{") and len(text) > 2:
            out[i] = text[:-1] + ', "deep": ' + "[" * 20000 + "]" * 20000 + "}"
            damage.add("deep")
            texts[i] = ""  # not predicted
        elif how == "stray":
            out[i] = text + "\x01"
            damage.add("stray")
        elif how == "truncate" and len(text) > 3:
            out[i] = text[: draw(st.integers(1, len(text) - 1))]
            damage.add("truncate")
    head = draw(st.sampled_from(['{"type": "commands", "items": ['] * 4 + ['{"items": [',
                                 '{"type":"commands","type":"commands","items":[']))
    if '"type"' not in head:
        damage.add("untyped")
    body = (head + ", ".join(out) + "]}").encode("utf-8")
    if damaging and draw(st.integers(0, 3)) == 0:
        at = draw(st.integers(0, len(body)))
        body = body[:at] + b"\xff\xfe" + body[at:]
        damage.add("utf8")
    return body, texts, damage


# -- the agent under test -----------------------------------------------------------------------


class _Wired:
    """Bytes -> AgentClientProtocol.onMessage -> (the session's routing) -> CommandPipeline."""

    def __init__(self, case: SynchronousTestCase) -> None:
        self.h = Harness(case)
        self.delivered: list[dict[str, Any]] = []
        self.proto = AgentClientProtocol()
        self.proto.factory = SimpleNamespace(session=self)  # type: ignore[assignment]

    def frame_received(self, proto: Any, frame: dict[str, Any]) -> None:
        self.delivered.append(frame)
        self.h.pipeline.frame_received(frame)

    def feed(self, payload: bytes) -> None:
        self.proto.onMessage(payload, False)
        self.settle()

    def settle(self) -> None:
        for _ in range(50):
            self.h.drain()
            self.h.clock.advance(1)
            if not self.h.pipeline._tasks and not self.h.pipeline._intake:
                break

    def per_command(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for f in self.h.session.frames:
            cid = f.get("command_id")
            if cid is not None:
                out.setdefault(cid, []).append(f["type"])
        return out


def _canonical(value: Any) -> str | None:
    return str(uuid.UUID(value)) if is_uuid(value) else None


class FuzzBase(SynchronousTestCase):
    def check_answers(self, wired: _Wired, expected: set[str], known: set[str]) -> None:
        answers = wired.per_command()
        for cid, kinds in answers.items():
            self.assertIn(cid, known, f"frames for a command that was never sent: {cid}")
            self.assertEqual(kinds.count("command_result"), 1, (cid, kinds))
            self.assertLessEqual(kinds.count("command_ack"), 1, (cid, kinds))
            self.assertEqual(kinds[-1], "command_result", (cid, kinds))  # nothing after the result
            if "command_ack" in kinds:
                self.assertEqual(kinds[0], "command_ack", (cid, kinds))
        for cid in expected:
            self.assertIn(cid, answers, f"command {cid} was never answered")
        self.assertEqual(self.flushLoggedErrors(), [], "the agent logged a crash")

    def tearDown(self) -> None:
        self.flushLoggedErrors()


class FrameFuzzTests(FuzzBase):
    @settings(PROFILE)
    @given(frames())
    def test_commands_frames_end_to_end(self, case: tuple[bytes, list[str], set[str]]) -> None:
        """Bytes of a commands frame into the session's parser and the pipeline, twice (re-listed)."""
        _count("commands frames")
        payload, texts, damage = case
        started = time.monotonic()
        wired = _Wired(self)
        wired.feed(payload)
        wired.feed(payload)  # the backend lists pending commands again in its next frame
        self.assertLess(time.monotonic() - started, PER_CASE_SECONDS)
        # Oracle: the standard parser (the last of duplicated keys wins). A frame it refuses
        # only because an item is too deep: the other items, each parsed on its own, must be
        # answered all the same. Other damage: nothing predicted, but no answer goes to an id
        # that is not in the frame, and none twice.
        expected: set[str] = set()
        if not damage:
            frame = json.loads(payload)
            self.assertEqual(wired.delivered[0], frame)
            items = [json.loads(t) for t in texts]
        elif damage == {"deep"}:
            items = [json.loads(t) for t in texts if t]
        else:
            items = []
        for item in items:
            if isinstance(item, dict) and _canonical(item.get("id")):
                expected.add(str(_canonical(item.get("id"))))
        known = expected | set(_uuid_like(payload.decode("utf-8", "replace")))
        self.check_answers(wired, expected, known)

    @settings(PROFILE)
    @given(st.binary(max_size=2048))
    def test_arbitrary_bytes(self, payload: bytes) -> None:
        """Any bytes at all: no crash, and a frame is delivered only if it is a JSON object."""
        _count("arbitrary bytes")
        wired = _Wired(self)
        started = time.monotonic()
        wired.feed(payload)
        self.assertLess(time.monotonic() - started, PER_CASE_SECONDS)
        for frame in wired.delivered:
            self.assertIsInstance(frame, dict)
        self.assertEqual(self.flushLoggedErrors(), [])

    @settings(PROFILE)
    @given(_json, st.booleans())
    def test_any_json_value_as_a_frame(self, value: Any, ascii_only: bool) -> None:
        """Any JSON value as the whole frame: objects are delivered as they are, others dropped."""
        _count("json values")
        wired = _Wired(self)
        wired.feed(_dump(value, ascii_only).encode("utf-8"))
        if isinstance(value, dict):
            self.assertEqual(len(wired.delivered), 1)
        else:
            self.assertEqual(wired.delivered, [])
        self.assertEqual(self.flushLoggedErrors(), [])


def _uuid_like(text: str) -> list[str]:
    import re

    out = []
    for m in re.finditer(r"[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}", text):
        try:
            out.append(str(uuid.UUID(m.group(0))))
        except ValueError:
            pass
    return out


class CommandFuzzTests(FuzzBase):
    @settings(PROFILE)
    @given(st.lists(commands(), min_size=1, max_size=6), st.sampled_from(["commands", "hello_ack"]))
    def test_command_objects_into_the_pipeline(self, items: list[Any], kind: str) -> None:
        """Command objects straight into the pipeline: every one with a UUID id answered once."""
        _count("command lists")
        wired = _Wired(self)
        key = "items" if kind == "commands" else "commands"
        started = time.monotonic()
        wired.h.pipeline.frame_received({"type": kind, key: items})
        wired.settle()
        wired.h.pipeline.frame_received({"type": "commands", "items": items})
        wired.settle()
        self.assertLess(time.monotonic() - started, PER_CASE_SECONDS)
        expected = {c for c in (_canonical(i.get("id")) for i in items if isinstance(i, dict)) if c}
        self.check_answers(wired, expected, expected)

    @settings(PROFILE)
    @given(commands())
    def test_parse_command_total(self, obj: Any) -> None:
        """parse_command never raises; an answerable verdict carries the canonical id."""
        _count("parse_command")
        parsed = parse_command(obj)
        cid = _canonical(obj.get("id")) if isinstance(obj, dict) else None
        if isinstance(parsed, Malformed):
            self.assertIn(parsed.command_id, (None, cid))
            self.assertLessEqual(len(parsed.message), 400)
        else:
            self.assertEqual(parsed.id, cid)

    @settings(PROFILE)
    @given(st.binary(max_size=4096) | frames().map(lambda f: f[0]))
    def test_salvage_is_total_and_bounded(self, payload: bytes) -> None:
        """salvage_frame on anything: None or (object, problems), quickly."""
        _count("salvage_frame")
        started = time.monotonic()
        out = salvage_frame(payload)
        self.assertLess(time.monotonic() - started, PER_CASE_SECONDS)
        if out is not None:
            frame, problems = out
            self.assertIsInstance(problems, list)
            self.assertIsNotNone(frame)


class ZZReport(SynchronousTestCase):
    """Runs last in this module (trial sorts by name): prints and records the cases run."""

    def test_report(self) -> None:
        total = sum(CASES.values())
        line = f"fuzz cases run: {total} ({', '.join(f'{k} {v}' for k, v in sorted(CASES.items()))})"
        print("\n" + line)
        path = os.environ.get("LLMPORT_FUZZ_REPORT")
        if path:
            with open(path, "w") as f:
                json.dump({"total": total, "by_test": CASES, "profile": "long" if _LONG else "ci"}, f)
