"""
Workload logs as streams: the thread side (frames, partial messages, timestamps, exact
positions), the scheduler (streams bounded, turns when there are more containers, die and start
events, back-pressure, positions behind the shipper, the state file) with fakes, and the real
Docker engine: 100,000 lines in about 2 s, a container that prints and exits within a second, a
container restart, an engine restart, an agent restart and more containers than streams, each
compared line by line with what the engine itself recorded.
"""

from __future__ import annotations

import json
import os
import struct
import time
import uuid
import zlib
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock, deferLater
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmport_agent.demo.testing import SynchronousRunner
from llmport_agent.logs.containers import STATE_FILE, ContainerLogSource, parse_state
from llmport_agent.logs.docker_logs import (
    ChunkedDecoder,
    Deduper,
    FollowResult,
    FrameParser,
    Position,
    _Joiner,
    format_since,
    parse_timestamp,
)
from llmport_agent.logs.testing import protocol_label_problem
from llmport_agent.workloads.engine import StreamClosed
from llmport_agent.workloads.spec import (
    LABEL_AGENT_ID,
    LABEL_MANAGED,
    LABEL_RUNTIME_ID,
    MANAGED_VALUE,
)
from tests.support.logs import TEST_AGENT_ID, TOKEN, RecordingSink, engine_lines, run_managed

HOST = "10.1.2.3"
T0 = 1_700_000_000_000_000_000


def frame(kind: int, payload: bytes) -> bytes:
    return struct.pack(">BxxxL", kind, len(payload)) + payload


def stamp(ns: int) -> bytes:
    seconds, nanos = divmod(ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)).encode() + f".{nanos:09d}Z ".encode()


class TimestampTests(SynchronousTestCase):
    """The engine's RFC3339Nano prefixes and the since it is given."""

    def test_formats(self) -> None:
        """Z and offsets, short and missing fractions; garbage is None."""
        self.assertEqual(parse_timestamp(b"2023-11-14T22:13:20.000000001Z x"), (T0 + 1, 31))
        self.assertEqual(parse_timestamp(b"2023-11-14T22:13:20.5Z x")[0], T0 + 500_000_000)  # type: ignore[index]
        self.assertEqual(parse_timestamp(b"2023-11-15T00:13:20+02:00 x")[0], T0)  # type: ignore[index]
        self.assertEqual(parse_timestamp(b"2023-11-14T22:13:20Z")[0], T0)  # type: ignore[index]
        for bad in (b"hello", b"2023-13-14T22:13:20Z x", b""):
            self.assertIsNone(parse_timestamp(bad))
        self.assertEqual(format_since(T0 + 42), "1700000000.000000042")
        self.assertEqual(parse_timestamp(stamp(T0 + 7))[0], T0 + 7)  # type: ignore[index]

    def test_seconds_cache_stays_small(self) -> None:
        """
        The cache of parsed seconds stays at a few dozen entries over hours of lines (one new
        second per second of a stream): at its old bound of 4096 it grew for more than an hour,
        the soak's RSS slope. Every line still parses right.
        """
        from llmport_agent.logs import docker_logs

        for s in range(2 * 3600):  # two hours of a line a second
            raw = stamp(T0 + s * 1_000_000_000 + 123) + b" line"
            self.assertEqual(parse_timestamp(raw), (T0 + s * 1_000_000_000 + 123, 31))
        self.assertLessEqual(len(docker_logs._SECONDS), 64)


class FrameTests(SynchronousTestCase):
    """FrameParser and the joining of messages into lines."""

    def test_multiplexed_frames_split_anywhere(self) -> None:
        """Frames split across reads at any byte come out whole, with their stream."""
        data = frame(1, stamp(T0) + b"out\n") + frame(2, stamp(T0 + 1) + b"err\n")
        for cut in range(len(data)):
            parser = FrameParser(tty=False)
            out = parser.feed(data[:cut]) + parser.feed(data[cut:])
            self.assertEqual(out, [(1, stamp(T0) + b"out\n"), (2, stamp(T0 + 1) + b"err\n")])

    def test_tty_stream_split_on_newlines(self) -> None:
        """A TTY container's raw stream is split on newlines; a tail without one comes at the end."""
        parser = FrameParser(tty=True)
        self.assertEqual(parser.feed(stamp(T0) + b"a\n" + stamp(T0 + 1) + b"b"), [(1, stamp(T0) + b"a\n")])
        self.assertEqual(parser.feed(b"c\r\n"), [(1, stamp(T0 + 1) + b"bc\r\n")])
        parser.feed(b"tail")
        self.assertEqual(parser.end(), [(1, b"tail")])

    def test_chunked_transfer_encoding_split_anywhere(self) -> None:
        """The engine's chunked body decodes the same however the reads cut it."""
        body = b"first line\nsecond\n" + b"x" * 300
        wire = b"".join(f"{len(part):x}\r\n".encode() + part + b"\r\n"
                        for part in (body[:11], body[11:18], body[18:])) + b"0\r\n\r\n"
        for cut in range(0, len(wire), 7):
            decoder = ChunkedDecoder()
            out = decoder.feed(wire[:cut]) + decoder.feed(wire[cut:])
            self.assertEqual(out, body)
            self.assertTrue(decoder.done)
        with self.assertRaises(ValueError):
            ChunkedDecoder().feed(b"zz\r\n")
        with self.assertRaises(ValueError):
            ChunkedDecoder().feed(b"2\r\nabXX")

    def test_partial_messages_are_joined(self) -> None:
        """A long line arrives as several messages: one line, with the first part's time."""
        joiner = _Joiner(Deduper(None), lambda s: s)
        decoded = joiner.messages([
            (1, stamp(T0) + b"AAAA"), (2, stamp(T0 + 1) + b"err\r\n"),
            (1, stamp(T0 + 2) + b"BBBB"), (1, stamp(T0 + 3) + b"CC\n"),
        ])
        self.assertEqual(decoded.items, [(T0 + 1, "err"), (T0, "AAAABBBBCC")])
        self.assertEqual(joiner.end().items, [])
        joiner.messages([(1, stamp(T0 + 9) + b"cut off")])
        self.assertEqual(joiner.end().items, [(T0 + 9, "cut off")])

    def test_lines_are_redacted_and_undated_ones_keep_the_last_time(self) -> None:
        """Redaction runs in the thread; a message without a time takes the previous one's."""
        joiner = _Joiner(Deduper(None), lambda s: s.replace(TOKEN, "***"))
        decoded = joiner.messages([(1, stamp(T0) + f"t {TOKEN}\n".encode()), (1, b"no stamp\n")])
        self.assertEqual(decoded.items, [(T0, "t ***"), (T0, "no stamp")])
        self.assertEqual(joiner.unparsed, 1)


    def test_a_secret_across_the_line_cut_is_not_shipped_in_part(self) -> None:
        """A line over MAX_LINE_BYTES, a secret straddling the cut: none of it ships."""
        from llmport_agent.logs.docker_logs import MAX_LINE_BYTES
        from llmport_agent.logs.redact import Redactor

        secret = "Registry-Passw0rd-" + "Z" * 30
        piece = ("x " + secret).encode()
        # Copies of the secret (masked: the line shrinks below MAX_LINE_CHARS), one across the cut.
        body = piece * (MAX_LINE_BYTES // len(piece)) + b"y" * (MAX_LINE_BYTES % len(piece)) + b"zz"
        body = body[:MAX_LINE_BYTES - 20] + secret.encode() + b" " * 40000 + b"\n"
        joiner = _Joiner(Deduper(None), Redactor(lambda: [secret]).snapshot())
        ((_ts, text),) = joiner.messages([(1, stamp(T0) + body)]).items
        self.assertIn("x ***", text)
        self.assertNotIn(secret[:8], text)


class DeduperTests(SynchronousTestCase):
    """Exact positions: what a reopened stream repeats is skipped, nothing else."""

    def test_first_read_takes_everything(self) -> None:
        """Without a position every line is new; the position counts the lines at its time."""
        d = Deduper(None)
        self.assertTrue(all(d.accept(ts, raw) for ts, raw in [(T0, b"a"), (T0 + 1, b"b"), (T0 + 1, b"b")]))
        self.assertEqual(d.position, Position(T0 + 1, {zlib.crc32(b"b"): 2}))

    def test_reread_skips_what_was_shipped_at_and_before_the_position(self) -> None:
        """Older lines and the counted lines at the exact time are skipped; the next is new."""
        position = Position(T0 + 5, {zlib.crc32(b"same"): 1, zlib.crc32(b"twin"): 2})
        d = Deduper(position)
        read = [(T0 + 4, b"old"), (T0 + 5, b"same"), (T0 + 5, b"twin"), (T0 + 5, b"twin"),
                (T0 + 5, b"new at five"), (T0 + 6, b"later"), (T0 + 3, b"reordered, live")]
        self.assertEqual([d.accept(ts, raw) for ts, raw in read], [False, False, False, False, True, True, True])
        self.assertEqual(d.skipped, 4)
        self.assertEqual(d.position.ts, T0 + 6)
        self.assertEqual(position.at, {zlib.crc32(b"same"): 1, zlib.crc32(b"twin"): 2})  # not changed

    def test_json_round_trip_and_bad_shapes(self) -> None:
        """Positions survive the state file; malformed ones are refused."""
        p = Position(T0, {1: 2, 3: 4})
        self.assertEqual(Position.from_json(json.loads(json.dumps(p.to_json()))), p)
        for bad in ([], {"ts": -1}, {"ts": "x"}, {"ts": 1, "at": [[1]]}, {"ts": 1, "at": [[1, 0]]}):
            with self.assertRaises(ValueError):
                Position.from_json(bad)

    def test_state_file_versions(self) -> None:
        """Version 2 holds positions; version 1 (the polling reader's ns) resumes just after it."""
        doc = {"version": 2, "containers": {"c1": {"name": "n", "position": Position(T0, {9: 1}).to_json()}}}
        self.assertEqual(parse_state(json.dumps(doc).encode()), {"c1": ("n", Position(T0, {9: 1}))})
        old = {"version": 1, "containers": {"c1": {"ns": T0, "name": "n"}}}
        self.assertEqual(parse_state(json.dumps(old).encode()), {"c1": ("n", Position(T0 + 1, {}))})
        for bad in (b"{", b"[]", b'{"version": 3, "containers": {}}', b'{"version": 2, "containers": []}'):
            with self.assertRaises(ValueError):
                parse_state(bad)


# -- the scheduler, with fakes ------------------------------------------------------------------


class ThreadClock(Clock):
    """A Clock whose callFromThread runs at once (the fake threads are the test itself)."""

    def callFromThread(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)


class FakeAPI:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def containers(self, all: bool = False, filters: Any = None) -> list[dict[str, Any]]:
        return list(self.rows)


class FakeEngine:
    """Availability, listeners and short calls (run at once against the fake API)."""

    def __init__(self) -> None:
        self.available = True
        self.api = FakeAPI()
        self.listeners: list[Callable[[bool], None]] = []
        self.checks = 0

    def call(self, fn: Callable[..., Any], *args: Any, what: str | None = None) -> Deferred[Any]:
        client = type("C", (), {"api": self.api})()
        return succeed(fn(client, *args))

    def onAvailability(self, listener: Callable[[bool], None]) -> None:
        self.listeners.append(listener)

    def checkNow(self) -> None:
        self.checks += 1

    def add(self, name: str, state: str = "running", created: float = 1_700_000_000,
            agent_id: str = TEST_AGENT_ID) -> str:
        cid = uuid.uuid4().hex * 2
        self.api.rows.append({"Id": cid, "Names": [f"/{name}"], "State": state, "Status": "",
                              "Created": int(created),
                              "Labels": {LABEL_MANAGED: MANAGED_VALUE, LABEL_RUNTIME_ID: f"rt-{name}",
                                         LABEL_AGENT_ID: agent_id}})
        return cid


class FakeStreams:
    """The stream pool: records each thread function call; the test plays the thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], Deferred[Any]]] = []

    def run(self, fn: Callable[..., Any], *args: Any) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        self.calls.append((getattr(fn, "__name__", ""), args, d))
        return d

    def follows(self, open_only: bool = True) -> list[tuple[tuple[Any, ...], Deferred[Any]]]:
        return [(a, d) for n, a, d in self.calls if n == "_follow_thread" and not (open_only and d.called)]

    def follow_of(self, cid: str) -> tuple[tuple[Any, ...], Deferred[Any]]:
        (found,) = [(a, d) for a, d in self.follows() if a[2] == cid]
        return found

    def events(self) -> list[tuple[tuple[Any, ...], Deferred[Any]]]:
        return [(a, d) for n, a, d in self.calls if n == "_events_thread" and not d.called]


class SchedulerTests(SynchronousTestCase):
    """L{ContainerLogSource} with a fake engine, fake stream threads and a recording sink."""

    def make(self, streams: int = 4, state_dir: str | None = None, **kw: Any) -> ContainerLogSource:
        self.clock = ThreadClock()
        self.clock.advance(1_700_000_000)
        self.engine = getattr(self, "engine", None) or FakeEngine()
        self.sink = RecordingSink()
        self.streams = FakeStreams()
        self.state_dir = state_dir or self.mktemp()
        source = ContainerLogSource(
            self.clock, self.engine, self.sink, lambda: HOST, agent_id=TEST_AGENT_ID, runner=SynchronousRunner(),
            streams=streams, stream_pool=self.streams, state_dir=self.state_dir,
            secrets=lambda: [TOKEN], wallclock=self.clock.seconds, **kw,
        )
        source.startService()
        self.addCleanup(self.stop, source)
        return source

    def stop(self, source: ContainerLogSource) -> None:
        if not source.running:
            return
        d = source.stopService()
        for _, _args, pending in self.streams.calls:
            if not pending.called:
                pending.errback(Failure(StreamClosed("agent stopping")))
        self.successResultOf(d)

    def lines_for(self, cid: str, *lines: tuple[int, str]) -> None:
        """Play the thread: put lines into the stream's inbox."""
        args, _ = self.streams.follow_of(cid)
        inbox, position = args[1], args[3]
        d = Deduper(position)
        items = []
        for ts, text in lines:
            if d.accept(ts, text.encode()):
                items.append((ts, text))
        inbox.put(items, sum(len(t) + 120 for _, t in items), d.position.copy())

    def state(self) -> dict[str, Any]:
        with open(os.path.join(self.state_dir, STATE_FILE)) as f:
            return dict(json.load(f)["containers"])

    def test_labels_lines_and_positions(self) -> None:
        """A running container gets a stream from its first line; lines carry protocol 8 labels."""
        self.engine = FakeEngine()
        cid = self.engine.add("web")
        self.make()
        args, _ = self.streams.follow_of(cid)
        self.assertEqual((args[3], args[4]), (None, None))  # no position, no since: the first line
        self.lines_for(cid, (T0, "hello"), (T0 + 1, "world"))
        self.assertEqual(self.sink.pushed[0][0], {"job": "node-container", "host": HOST, "container": "web",
                                                  "runtime_id": "rt-web"})
        self.assertIsNone(protocol_label_problem(self.sink.pushed[0][0]))
        self.assertEqual(self.sink.lines(), ["hello", "world"])
        self.clock.advance(5)
        self.assertNotIn(cid, self.state())  # not delivered yet: no position saved
        self.sink.delivered = 2
        self.clock.advance(5)
        self.assertEqual(self.state()[cid]["position"]["ts"], T0 + 1)

    def test_streams_are_bounded_and_containers_take_turns(self) -> None:
        """With more containers than streams, long-open streams are closed in turn; none starves."""
        self.engine = FakeEngine()
        cids = [self.engine.add(f"c{i}") for i in range(5)]
        source = self.make(streams=2, slice_seconds=5)
        self.assertEqual(len(self.streams.follows()), 2)
        self.assertEqual(source.describe()["waiting_for_a_stream"], 3)
        served: set[str] = {a[2] for a, _ in self.streams.follows()}
        for _ in range(6):
            self.clock.advance(5)
            for args, d in self.streams.follows():
                if args[0].closed:
                    d.errback(Failure(StreamClosed("slice")))
            self.assertLessEqual(len(self.streams.follows()), 2)
            served |= {a[2] for a, _ in self.streams.follows()}
        self.assertEqual(served, set(cids))
        self.assertGreaterEqual(source.describe()["slices"], 3)

    def test_a_container_queued_while_the_engine_is_away_gets_a_stream_when_it_is_back(self) -> None:
        """
        A stream that ends while the engine is away (dockerd restarting) queues its container;
        when the engine answers again that container is opened, even though the list that
        follows finds it already queued (it waited forever: the real engine-restart test's flake).
        """
        self.engine = FakeEngine()
        cid = self.engine.add("web")
        source = self.make()
        _, d = self.streams.follow_of(cid)
        self.engine.available = False
        for listener in self.engine.listeners:
            listener(False)
        d.callback(FollowResult(1, 0, running=True, tty=False))  # the stream ends: still running
        self.assertEqual(self.streams.follows(), [])
        self.assertEqual(source.describe()["waiting_for_a_stream"], 1)
        self.engine.available = True
        for listener in self.engine.listeners:
            listener(True)
        args, _ = self.streams.follow_of(cid)
        self.assertEqual(source.describe()["waiting_for_a_stream"], 0)
        self.assertEqual(source.describe()["streams_opened"], 2)

    def test_a_die_event_reads_a_stopped_container_to_its_end_once(self) -> None:
        """A container that died without a stream open is read once more, then left alone."""
        self.engine = FakeEngine()
        self.make()
        (events_args, _), = self.streams.events()
        on_event = events_args[2]
        cid = uuid.uuid4().hex * 2
        attrs = {"name": "quick", LABEL_RUNTIME_ID: "rt-q", LABEL_MANAGED: MANAGED_VALUE,
                 LABEL_AGENT_ID: TEST_AGENT_ID}
        on_event({"Action": "start", "id": cid, "Actor": {"ID": cid, "Attributes": attrs}})
        args, d = self.streams.follow_of(cid)
        self.lines_for(cid, (T0, "printed"), (T0 + 1, "and exited"))
        on_event({"Action": "die", "id": cid, "Actor": {"ID": cid, "Attributes": attrs}})
        d.callback(FollowResult(2, 0, running=False, tty=False))
        self.assertEqual(self.streams.follows(), [])  # drained: no new stream
        self.clock.advance(30)
        self.assertEqual(self.streams.follows(), [])
        # It ran again (its start went unseen) and died: the die alone brings a final read.
        on_event({"Action": "die", "id": cid, "Actor": {"ID": cid, "Attributes": attrs}})
        args, d = self.streams.follow_of(cid)
        self.assertEqual(args[4], format_since(T0 + 1))  # from where shipping stands
        d.callback(FollowResult(0, 1, running=False, tty=False))
        on_event({"Action": "start", "id": cid, "Actor": {"ID": cid, "Attributes": attrs}})
        args, _ = self.streams.follow_of(cid)
        self.assertEqual(args[4], format_since(T0 + 1))  # resumes from its position
        self.assertEqual(self.sink.pushed[0][0]["container"], "quick")
        on_event({"Action": "destroy", "id": cid, "Actor": {"ID": cid, "Attributes": attrs}})
        self.assertTrue(args[0].closed)

    def test_a_stream_the_engine_does_not_end_after_a_die_is_read_afresh(self) -> None:
        """If the engine keeps a stopped container's stream open, it is reopened from the position."""
        self.engine = FakeEngine()
        cid = self.engine.add("stuck")
        source = self.make(drain_timeout=10)
        (events_args, _), = self.streams.events()
        args, d = self.streams.follow_of(cid)
        self.lines_for(cid, (T0, "before the end"))
        events_args[2]({"Action": "die", "id": cid, "Actor": {"ID": cid, "Attributes": {"name": "stuck"}}})
        self.clock.advance(9)
        self.assertFalse(args[0].closed)
        self.clock.advance(1)
        self.assertTrue(args[0].closed)
        d.errback(Failure(StreamClosed(args[0].reason)))
        again, _ = self.streams.follow_of(cid)
        self.assertEqual(again[4], format_since(T0))
        self.assertEqual(source.describe()["drain_stalls"], 1)
        self.flushLoggedErrors()

    def test_a_stopped_container_without_stream_gets_a_final_read(self) -> None:
        """A die with no stream open (it started and died between two looks) opens one."""
        self.engine = FakeEngine()
        cid = self.engine.add("gone-quickly", state="exited")
        self.make()
        args, d = self.streams.follow_of(cid)
        self.lines_for(cid, (T0, "last words"))
        d.callback(FollowResult(1, 0, running=False, tty=False))
        self.assertEqual(self.sink.lines(), ["last words"])
        self.assertEqual(self.streams.follows(), [])

    def test_back_pressure_leaves_lines_with_the_thread(self) -> None:
        """While the shipper is full, lines are not taken and positions stand; room resumes."""
        self.engine = FakeEngine()
        cid = self.engine.add("chatty")
        source = self.make()
        self.sink.set_level(0.9)
        self.lines_for(cid, (T0, "waiting"))
        self.assertEqual(self.sink.pushed, [])
        self.assertTrue(source.describe()["paused"])
        args, _ = self.streams.follow_of(cid)
        self.assertEqual(args[1].bytes, len("waiting") + 120)  # still in the thread's inbox
        self.sink.set_level(0.3)
        self.assertEqual(self.sink.lines(), ["waiting"])
        self.assertFalse(source.describe()["paused"])

    def test_a_failing_stream_is_retried_and_a_missing_container_forgotten(self) -> None:
        """An engine error retries that container with backoff; a 404 forgets it."""
        self.engine = FakeEngine()
        cid = self.engine.add("flaky")
        source = self.make(backoff=None)
        _, d = self.streams.follow_of(cid)
        d.errback(Failure(RuntimeError("connection reset")))
        self.assertEqual(self.streams.follows(), [])
        self.assertEqual(self.engine.checks, 1)
        self.clock.advance(2)
        _, d = self.streams.follow_of(cid)

        class NotFound(Exception):
            status_code = 404

        self.engine.api.rows.clear()  # removed: the engine says 404
        d.errback(Failure(NotFound("no such container")))
        self.assertEqual(source.describe()["containers"], 0)
        self.clock.advance(60)
        self.assertEqual(self.streams.follows(), [])
        self.flushLoggedErrors()

    def test_restart_resumes_from_the_saved_position(self) -> None:
        """A new source reads the state file and opens the stream with since = the position."""
        self.engine = FakeEngine()
        cid = self.engine.add("svc")
        source = self.make()
        self.lines_for(cid, (T0, "a"), (T0 + 10, "b"))
        d = source.stopService()
        for _, _, pending in self.streams.calls:
            if not pending.called:
                pending.errback(Failure(StreamClosed("agent stopping")))
        self.successResultOf(d)
        self.assertEqual(self.sink.flushes, [5.0])
        again = self.make(state_dir=self.state_dir)
        args, _ = self.streams.follow_of(cid)
        self.assertEqual(args[4], format_since(T0 + 10))
        self.assertEqual(args[3], Position(T0 + 10, {zlib.crc32(b"b"): 1}))
        self.assertTrue(again.running)

    def test_an_old_container_without_position_starts_from_the_replay_window(self) -> None:
        """A container created long before (first install) is read from 6 hours back, not all."""
        self.engine = FakeEngine()
        old = self.engine.add("ancient", created=1_700_000_000 - 30 * 86400)
        new = self.engine.add("recent", created=1_700_000_000 - 60)
        self.make()
        self.assertEqual(self.streams.follow_of(old)[0][4], format_since((1_700_000_000 - 6 * 3600) * 10**9))
        self.assertIsNone(self.streams.follow_of(new)[0][4])

    def test_another_agents_containers_are_not_shipped(self) -> None:
        """
        Containers labelled managed by ANOTHER agent (or forging the managed label) get no
        stream, whether found by the list or announced by an event (issue 21: they were
        shipped to this node's Loki).
        """
        self.engine = FakeEngine()
        self.engine.add("theirs", agent_id="another-node")
        ours = self.engine.add("ours")
        self.make()
        self.assertEqual([a[2] for a, _ in self.streams.follows()], [ours])
        (events_args, _), = self.streams.events()
        on_event = events_args[2]
        for attrs in ({"name": "ev", LABEL_RUNTIME_ID: "rt-e", LABEL_MANAGED: MANAGED_VALUE,
                       LABEL_AGENT_ID: "another-node"},
                      {"name": "ev2", LABEL_RUNTIME_ID: "rt-e", LABEL_MANAGED: MANAGED_VALUE}):
            cid = uuid.uuid4().hex * 2
            on_event({"Action": "start", "id": cid, "Actor": {"ID": cid, "Attributes": attrs}})
            self.assertEqual([a[2] for a, _ in self.streams.follows()], [ours])

    def test_the_periodic_list_finds_containers_events_missed(self) -> None:
        """A container that appears without an event gets its stream at the next list."""
        self.engine = FakeEngine()
        source = self.make(reconcile_interval=60)
        self.assertEqual(self.streams.follows(), [])
        cid = self.engine.add("unannounced")
        self.clock.advance(59)
        self.assertEqual(self.streams.follows(), [])
        self.clock.advance(1)
        self.assertEqual(self.streams.follow_of(cid)[0][2], cid)
        self.assertGreaterEqual(source.describe()["reconciles"], 2)

    def test_the_inbox_holds_a_thread_at_its_bound(self) -> None:
        """A stream thread that fills its inbox waits until the reactor takes the lines."""
        import threading

        from llmport_agent.logs.docker_logs import Inbox

        delivered: list[int] = []
        inbox = Inbox(lambda fn: fn(), lambda: delivered.append(1), limit=1000)
        done = threading.Event()

        def thread() -> None:
            for i in range(5):
                inbox.put([(T0 + i, "x" * 400)], 520, Position(T0 + i))
            done.set()

        t = threading.Thread(target=thread)
        t.start()
        self.assertFalse(done.wait(0.3))  # two puts fit, the third waits
        self.assertLessEqual(inbox.bytes, 1040)
        while not done.is_set():
            inbox.take()
            done.wait(0.05)
        t.join()
        self.assertGreaterEqual(inbox.waits, 1)
        inbox.close()
        with self.assertRaises(StreamClosed):
            inbox.put([], 0, Position())

    def test_unreadable_state_is_ignored_with_one_line(self) -> None:
        """A damaged state file is reported and containers start from their first line."""
        state_dir = self.mktemp()
        os.makedirs(state_dir)
        with open(os.path.join(state_dir, STATE_FILE), "w") as f:
            f.write("{broken")
        self.engine = FakeEngine()
        cid = self.engine.add("svc")
        self.make(state_dir=state_dir)
        self.assertIsNone(self.streams.follow_of(cid)[0][3])


# -- the real engine ------------------------------------------------------------------------------


class RealEngineTests(TestCase):
    """Real dockerd, real shipper over loopback to the fake Loki, compared with the engine's logs."""

    timeout = 180

    async def setUp(self) -> None:
        from twisted.internet import reactor
        from twisted.web.server import Site

        from llmport_agent.logs.testing import FakeLoki
        from tests.support.docker_env import require_docker

        self.reactor: Any = reactor
        self.env = require_docker()
        self.loki = FakeLoki(check_labels=True, require_gzip=True)
        port = reactor.listenTCP(0, Site(self.loki), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.url = f"http://127.0.0.1:{port.getHost().port}"
        self.state_dir = os.path.abspath(self.mktemp())
        os.makedirs(self.state_dir)
        self.parts: list[Any] = []

    async def start(self, streams: int = 16, **kw: Any) -> ContainerLogSource:
        from llmport_agent.core.threads import PoolService
        from llmport_agent.logs.loki import LokiShipper, loki_http_client
        from llmport_agent.workloads.engine import DockerEngine

        pool = PoolService(self.reactor, "logs", 2)
        http, http_pool = loki_http_client(self.reactor)
        shipper = LokiShipper(self.reactor, http, self.url, batch_size=100, flush_interval=5, runner=pool)
        engine = DockerEngine(self.reactor, environ={"DOCKER_HOST": self.env.host}, probe_max=1.0)
        source = ContainerLogSource(self.reactor, engine, shipper, lambda: HOST, agent_id=TEST_AGENT_ID, runner=pool,
                                    streams=streams, environ={"DOCKER_HOST": self.env.host},
                                    state_dir=self.state_dir, secrets=lambda: [TOKEN],
                                    reconcile_interval=5, **kw)
        self.parts = [pool, shipper, engine, source, http_pool]
        for svc in (pool, shipper, engine):
            svc.startService()
        await engine.whenAvailable()
        source.startService()
        self.addCleanup(self.stop)
        return source

    async def stop(self) -> None:
        if not self.parts:
            return
        pool, shipper, engine, source, http_pool = self.parts
        self.parts = []
        for svc in (source, engine, shipper, pool):
            if svc.running:
                await svc.stopService()
        await http_pool.closeCachedConnections()

    def run_container(self, script: str, **kw: Any) -> Any:
        container = run_managed(self.env.client(), script, **kw)
        self.addCleanup(lambda: self.env.client().containers.get(container.id).remove(force=True)
                        if self.env.running else None)
        return container

    def engine_lines(self, container: Any) -> list[str]:
        return engine_lines(self.env.client(), container.id)

    async def until(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                self.fail(f"timed out waiting for {what}: {self.state()}")
            await deferLater(self.reactor, 0.2, lambda: None)

    def state(self) -> str:
        """What the parts say (for a failure message)."""
        if not self.parts:
            return "stopped"
        _, shipper, engine, source, _ = self.parts
        streams = [(c.name, c.running, c.drained, c.stream is not None, c.queued, c.position)
                   for c in source._tracked.values()]
        return (f"accepted {self.loki.accepted}, shipper {shipper.stats()}, source {source.describe()}, "
                f"engine available {engine.available}, streams {streams}")

    def shipped(self, container: Any) -> list[str]:
        return self.loki.lines(container=container.name)

    async def assert_all_shipped_once(self, container: Any, timeout: float = 60) -> None:
        """Loki holds exactly what the engine recorded: every line, in order, once."""
        truth = self.engine_lines(container)  # the container has stopped: this is final
        self.assertTrue(truth)
        await self.until(lambda: self.loki.accepted >= len(truth), timeout, f"the lines of {container.name}")
        await deferLater(self.reactor, 0.3, lambda: None)  # anything extra would show up now
        self.assertEqual(self.shipped(container), truth)
        self.assertEqual((self.loki.violations, self.loki.duplicates), ([], 0))
        entry = self.loki.entries(container=container.name)[0]
        self.assertEqual(set(entry.labels), {"job", "host", "container", "runtime_id"})

    async def test_100000_lines_in_about_2_seconds_all_shipped_in_order_once(self) -> None:
        """A container printing 100,000 lines as fast as a shell can: every line, in order, once."""
        await self.start()
        started = time.monotonic()
        container = self.run_container(
            'i=0; while [ $i -lt 100000 ]; do echo "line $i of a chatty workload"; i=$((i+1)); done')
        await self.until(lambda: self.env.client().containers.get(container.id).status == "exited", 30,
                         "the container to finish")
        printed = time.monotonic() - started
        await self.assert_all_shipped_once(container, timeout=90)
        self.assertEqual(len(self.shipped(container)), 100_000)
        self.assertLess(printed, 10)  # generous: about 1-2 s on this machine

    async def test_another_agents_container_is_not_shipped(self) -> None:
        """
        On a shared engine, a container labelled managed by ANOTHER agent (started before and
        after the source) ships nothing to this node's Loki; ours ships everything.
        """
        theirs_before = self.run_container("echo theirs-before; sleep 2", agent_id="another-node")
        await self.start()
        theirs_after = self.run_container("echo theirs-after; sleep 2", agent_id="another-node")
        ours = self.run_container("echo ours; sleep 1")
        await self.until(lambda: self.env.client().containers.get(ours.id).status == "exited", 30,
                         "our container to finish")
        await self.assert_all_shipped_once(ours)
        await deferLater(self.reactor, 1.0, lambda: None)
        self.assertEqual(self.shipped(theirs_before), [])
        self.assertEqual(self.shipped(theirs_after), [])

    async def test_a_container_that_prints_and_exits_within_a_second_is_shipped(self) -> None:
        """Started and gone before a poll could have seen it: its lines arrive anyway."""
        source = await self.start()
        container = self.run_container(f"echo first; echo token={TOKEN}; echo last >&2; exit 3")
        await self.until(lambda: len(self.shipped(container)) >= 3, 30, "the quick container's lines")
        # In the engine's time order (stdout and stderr are two pipes), redacted.
        truth = [line.replace(TOKEN, "***") for line in self.engine_lines(container)]
        self.assertEqual(sorted(truth), ["first", "last", "token=***"])
        self.assertEqual(self.shipped(container), truth)
        self.assertEqual(source.describe()["streams_open"], 0)
        self.assertGreaterEqual(source.describe()["drains"], 1)

    async def test_a_container_restart_mid_stream_leaves_no_gap_and_no_duplicate(self) -> None:
        """Lines before, across and after `docker restart` are each shipped once."""
        await self.start()
        container = self.run_container(
            'r=$(date +%s%N); i=0; while [ $i -lt 60 ]; do echo "run $r line $i"; i=$((i+1)); '
            "usleep 20000; done; sleep 600")
        await self.until(lambda: self.loki.accepted >= 20, 30, "lines before the restart")
        container.restart(timeout=0)
        await self.until(lambda: self.loki.accepted >= 100, 60, "lines after the restart")
        container.stop(timeout=0)
        await self.assert_all_shipped_once(container)

    async def test_an_engine_restart_mid_stream_leaves_no_gap_and_no_duplicate(self) -> None:
        """dockerd stops and starts while a container prints; the stream resumes exactly."""
        source = await self.start()
        container = self.run_container(
            'r=$(date +%s%N); i=0; while [ $i -lt 80 ]; do echo "run $r line $i"; i=$((i+1)); '
            "usleep 20000; done; sleep 600", restart_policy={"Name": "always"})
        await self.until(lambda: self.loki.accepted >= 20, 30, "lines before the restart")
        await self.reactor_thread(self.env.restart)
        await self.until(lambda: self.loki.accepted >= 120, 90, "lines after the restart")
        await self.reactor_thread(lambda: self.env.client().containers.get(container.id).stop(timeout=0))
        await self.assert_all_shipped_once(container, timeout=60)
        self.assertGreaterEqual(source.describe()["streams_opened"], 2)

    async def reactor_thread(self, fn: Callable[[], Any]) -> Any:
        """Run a blocking test action in a thread (the agent keeps running meanwhile)."""
        from twisted.internet.threads import deferToThread

        return await deferToThread(fn)

    async def test_an_agent_restart_mid_stream_leaves_no_gap_and_no_duplicate(self) -> None:
        """The readers stop and start again (same state directory) while a container prints."""
        await self.start()
        container = self.run_container(
            'i=0; while [ $i -lt 150 ]; do echo "line $i"; i=$((i+1)); usleep 10000; done; sleep 600')
        await self.until(lambda: self.loki.accepted >= 30, 30, "lines before the restart")
        await self.stop()
        with open(os.path.join(self.state_dir, STATE_FILE)) as f:
            self.assertIn(container.id, json.load(f)["containers"])
        await deferLater(self.reactor, 0.3, lambda: None)  # it prints on while the agent is away
        await self.start()
        await self.until(lambda: self.loki.accepted >= 150, 60, "lines after the restart")
        container.stop(timeout=0)
        await self.assert_all_shipped_once(container)

    async def test_more_containers_than_streams_take_turns_without_loss(self) -> None:
        """Five printing containers with two streams: every line of every container arrives."""
        source = await self.start(streams=2, slice_seconds=1)
        containers = [
            self.run_container(f'i=0; while [ $i -lt 40 ]; do echo "c{n} line $i"; i=$((i+1)); '
                               "usleep 50000; done; sleep 600")
            for n in range(5)
        ]
        for container in containers:
            await self.until(lambda c=container: len(self.shipped(c)) >= 40, 90, f"{container.name}")
        for container in containers:
            self.assertEqual(self.shipped(container), self.engine_lines(container))
        self.assertLessEqual(source.describe()["streams_open"], 2)
        self.assertGreater(source.describe()["slices"], 0)
        self.assertEqual((self.loki.violations, self.loki.duplicates), ([], 0))
