"""
Log shipping to Loki (protocol section 8): the shipper (batching, grouping, ordering, gzip,
retries, drops, bounds, threads, stop), the agent's log observer (labels, levels, redaction),
the journal reader (arguments, parsing, restarts, position, back-pressure), and end-to-end runs
over loopback against the fake Loki, with real journal files where systemd-journal-remote is
installed.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, cast

from treq.testing import StubTreq
from twisted.internet import reactor as _global_reactor
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import (
    ConnectionRefusedError,
    ProcessDone,
    ProcessExitedAlready,
    ProcessTerminated,
)
from twisted.internet.task import Clock
from twisted.internet.utils import getProcessOutputAndValue
from twisted.logger import ILogObserver, Logger, LogLevel, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site
from zope.interface import implementer
from zope.interface.verify import verifyObject

from llmport_agent.backoff import Backoff
from llmport_agent.logs.agent_source import AgentLogObserver, level_label, node_labels
from llmport_agent.logs.journald import (
    CURSOR_FILE,
    JournaldSource,
    cursor_time,
    parse_entry,
)
from llmport_agent.logs.loki import (
    ILogSink,
    LokiShipper,
    encode_batch,
    loki_http_client,
    push_target,
)
from llmport_agent.logs.redact import Redactor, redact
from llmport_agent.logs.testing import FakeLoki
from llmport_agent.testing import SynchronousRunner

JOURNAL_REMOTE = "/lib/systemd/systemd-journal-remote"
reactor: Any = _global_reactor
CREDENTIAL = f"{uuid.UUID(int=0x1234)}.{'A' * 20}-_{'b' * 21}"
TOKEN = "Zx9_" + "q" * 24 + "-K3w"  # 32 url-safe characters, like an enrollment token
LABELS = {"job": "node-agent", "host": "10.0.0.5", "container": "node-n1", "level": "info"}


def capture_events(case: SynchronousTestCase) -> list[dict[str, Any]]:
    """Record every log event published while the test runs."""
    events: list[dict[str, Any]] = []
    observer = cast(ILogObserver, events.append)
    globalLogPublisher.addObserver(observer)
    case.addCleanup(globalLogPublisher.removeObserver, observer)
    return events


def labels(**extra: str) -> dict[str, str]:
    return dict(LABELS, **extra)


class RefusingHTTP:
    """A treq-like client whose first C{failures} posts fail with a refused connection."""

    def __init__(self, real: Any, failures: int) -> None:
        self.real = real
        self.failures = failures
        self.calls = 0

    def post(self, url: str, **kwargs: Any) -> Deferred[Any]:
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            return fail(ConnectionRefusedError("127.0.0.1:3100"))
        return self.real.post(url, **kwargs)


class WakingClock(Clock):
    """A Clock that also records C{callFromThread} (run later by the test)."""

    def __init__(self) -> None:
        super().__init__()
        self.from_thread: list[Callable[[], None]] = []

    def callFromThread(self, fn: Callable[..., None], *args: Any) -> None:
        self.from_thread.append(lambda: fn(*args))


class ShipperTests(SynchronousTestCase):
    """L{LokiShipper} against the fake Loki through StubTreq, on a Clock."""

    def make(
        self,
        url: str = "http://loki.test:3100",
        batch_size: int = 100,
        max_queue: int = 10000,
        gzip_body: bool = True,
        loki: FakeLoki | None = None,
        http: Any = None,
        clock: Clock | None = None,
        start: bool = True,
    ) -> LokiShipper:
        self.clock = clock or Clock()
        self.loki = loki or FakeLoki()
        self.stub = StubTreq(self.loki)
        shipper = LokiShipper(
            self.clock,
            http if http is not None else self.stub,
            url,
            batch_size=batch_size,
            flush_interval=5,
            max_queue=max_queue,
            timeout=10,
            gzip_body=gzip_body,
            stop_timeout=3,
            jitter=lambda: 1.0,
        )
        if start:
            shipper.startService()

            def stop() -> None:
                if shipper.running:
                    shipper.stopService()
                    self.clock.advance(10)
                self.assertEqual(self.clock.getDelayedCalls(), [])

            self.addCleanup(stop)
        return shipper

    def test_provides_sink_interface(self) -> None:
        """The shipper is a valid ILogSink."""
        self.assertTrue(verifyObject(ILogSink, self.make(start=False)))

    def test_nothing_before_interval_then_batches(self) -> None:
        """Lines wait for the flush interval, then leave in pushes of at most batch_size, in order."""
        shipper = self.make(batch_size=100)
        for i in range(250):
            shipper.push(LABELS, 1_000 + i, f"line {i}")
        self.assertEqual(self.loki.pushes, [])
        self.clock.advance(5)
        self.assertEqual([p.status for p in self.loki.pushes], [204, 204, 204])
        sizes = [sum(len(s["values"]) for s in p.body["streams"]) for p in self.loki.pushes]
        self.assertEqual(sizes, [100, 100, 50])
        self.assertEqual(self.loki.lines(), [f"line {i}" for i in range(250)])
        self.assertEqual(shipper.describe()["sent"], 250)
        self.assertEqual(shipper.describe()["queue_depth"], 0)
        self.assertEqual(shipper.delivered_through(), 250)

    def test_groups_by_label_set(self) -> None:
        """Lines of different label sets go into separate streams of one push."""
        shipper = self.make()
        shipper.push(labels(level="info"), 10, "a")
        shipper.push(labels(level="error"), 11, "b")
        shipper.push(labels(level="info"), 12, "c")
        self.clock.advance(5)
        (push,) = self.loki.pushes
        streams = push.body["streams"]
        self.assertEqual(len(streams), 2)
        self.assertEqual(streams[0], {"stream": labels(level="info"), "values": [["10", "a"], ["12", "c"]]})
        self.assertEqual(streams[1], {"stream": labels(level="error"), "values": [["11", "b"]]})

    def test_values_non_decreasing_within_and_across_pushes(self) -> None:
        """Out-of-order lines are sorted; a line older than its stream's last push gets that time."""
        loki = FakeLoki(reject_out_of_order=True)
        shipper = self.make(loki=loki)
        shipper.push(LABELS, 300, "late")
        shipper.push(LABELS, 100, "early")
        shipper.push(LABELS, 200, "middle")
        self.clock.advance(5)
        self.assertEqual([(e.ts_ns, e.line) for e in loki.entries()],
                         [(100, "early"), (200, "middle"), (300, "late")])
        shipper.push(LABELS, 250, "straggler")
        self.clock.advance(5)
        self.assertEqual(loki.pushes[-1].status, 204)
        self.assertEqual((loki.entries()[-1].ts_ns, loki.entries()[-1].line), (300, "straggler"))

    def test_gzip_json_body_and_headers(self) -> None:
        """The body is gzip-encoded JSON with the right headers; without gzip it is plain JSON."""
        shipper = self.make()
        shipper.push(LABELS, 5, "zipped")
        self.clock.advance(5)
        headers = self.loki.pushes[0].headers
        self.assertEqual(headers["content-encoding"], "gzip")
        self.assertEqual(headers["content-type"], "application/json")
        self.assertEqual(self.loki.lines(), ["zipped"])
        body, _ = encode_batch([], {}, True)
        self.assertEqual(json.loads(gzip.decompress(body)), {"streams": []})

        plain = self.make(gzip_body=False)
        plain.push(LABELS, 5, "plain")
        self.clock.advance(5)
        self.assertNotIn("content-encoding", self.loki.pushes[0].headers)
        self.assertEqual(self.loki.lines(), ["plain"])

    def test_base_path_kept_and_credentials_become_basic_auth(self) -> None:
        """A base path stays in the push URL; user:password moves to an Authorization header."""
        shipper = self.make(url="http://tenant:s3cret-pass@loki.test:3100/gateway/")
        shipper.push(LABELS, 5, "x")
        self.clock.advance(5)
        push = self.loki.pushes[0]
        self.assertEqual(push.path, b"/gateway/loki/api/v1/push")
        self.assertEqual(push.headers["authorization"],
                         "Basic " + base64.b64encode(b"tenant:s3cret-pass").decode())
        self.assertNotIn("s3cret", json.dumps(shipper.describe()))

    def test_push_target(self) -> None:
        """push_target keeps base paths, tolerates a full push URL, and refuses non-http URLs."""
        self.assertEqual(push_target("http://l:3100")[0], "http://l:3100/loki/api/v1/push")
        self.assertEqual(push_target("https://l/base/")[0], "https://l/base/loki/api/v1/push")
        self.assertEqual(push_target("http://l/loki/api/v1/push")[0], "http://l/loki/api/v1/push")
        url, auth, shown = push_target("http://u%40x:p%3Aw@l:1/b")
        self.assertEqual((url, auth, shown), ("http://l:1/b/loki/api/v1/push", ("u@x", "p:w"), url))
        with self.assertRaises(ValueError) as e:
            push_target("ftp://user:hunter22@l/")
        self.assertNotIn("hunter22", str(e.exception))

    def test_retries_429_and_5xx_with_backoff_keeping_order(self) -> None:
        """429 and 500 are retried with growing delays; the same batch goes first, once stored."""
        shipper = self.make()
        self.loki.fail_next(1, 429)
        self.loki.fail_next(1, 500)
        shipper.push(LABELS, 1, "first")
        self.clock.advance(5)
        self.assertEqual([p.status for p in self.loki.pushes], [429])
        shipper.push(LABELS, 2, "second")
        self.clock.advance(1.9)  # jitter 1.0: the first retry waits 2 s
        self.assertEqual(len(self.loki.pushes), 1)
        self.clock.advance(0.1)
        self.assertEqual([p.status for p in self.loki.pushes], [429, 500])
        self.clock.advance(3.9)  # the second retry waits 4 s
        self.assertEqual(len(self.loki.pushes), 2)
        self.clock.advance(0.1)
        self.assertEqual([p.status for p in self.loki.pushes], [429, 500, 204, 204])
        self.assertEqual(self.loki.pushes[0].body, self.loki.pushes[2].body)
        self.assertEqual(self.loki.lines(), ["first", "second"])
        stats = shipper.describe()
        self.assertEqual((stats["failed_pushes"], stats["sent"], stats["dropped"]), (2, 2, 0))
        self.assertEqual(stats["consecutive_failures"], 0)

    def test_backoff_is_capped(self) -> None:
        """Retry delays stop growing at 60 s."""
        shipper = self.make()
        self.loki.fail_next(12, 503)
        shipper.push(LABELS, 1, "x")
        self.clock.advance(5)
        self.clock.pump([1] * 481)  # 2 + 4 + 8 + 16 + 32 + 7 * 60 - 1
        self.assertEqual(len(self.loki.pushes), 12)
        self.assertTrue(all(e.getTime() - self.clock.seconds() <= 60 for e in self.clock.getDelayedCalls()))
        self.clock.advance(1)
        self.assertEqual(len(self.loki.pushes), 13)
        self.assertEqual(self.loki.lines(), ["x"])
        self.flushLoggedErrors()

    def test_network_errors_and_timeouts_are_retried(self) -> None:
        """A refused connection and an unanswered push are both retried."""
        self.make(start=False)
        http = RefusingHTTP(self.stub, failures=1)
        shipper = self.make(http=http, loki=self.loki, clock=self.clock)
        shipper.push(LABELS, 1, "x")
        self.clock.advance(5)
        self.assertEqual(http.calls, 1)
        self.assertIn("ConnectionRefusedError", shipper.describe()["last_error"])
        self.loki.hold_next(1)
        self.clock.advance(2)
        self.assertEqual(http.calls, 2)
        self.assertEqual(self.loki.lines(), [])
        self.clock.advance(10)  # the push times out
        self.assertIn("no answer", shipper.describe()["last_error"])
        self.clock.advance(4)
        self.assertEqual(self.loki.lines(), ["x"])
        self.assertEqual(shipper.describe()["failed_pushes"], 2)

    def test_other_4xx_drops_the_batch_with_one_log_line(self) -> None:
        """A 400 drops that batch (counted, logged once) and the next batch still goes."""
        events = capture_events(self)
        shipper = self.make(batch_size=2)
        self.loki.fail_next(1, 400, b"entry too far behind")
        for i in range(3):
            shipper.push(LABELS, i, f"l{i}")
        self.clock.advance(5)
        self.assertEqual([p.status for p in self.loki.pushes], [400, 204])
        self.assertEqual(self.loki.lines(), ["l2"])
        stats = shipper.describe()
        self.assertEqual((stats["dropped_rejected"], stats["dropped"], stats["failed_pushes"]), (2, 2, 0))
        refused = [e for e in events if e.get("code") == 400]
        self.assertEqual(len(refused), 1)
        self.assertEqual(refused[0]["detail"], "entry too far behind")
        self.assertEqual(shipper.delivered_through(), 3)

    def test_bounded_queue_drops_oldest_and_counts(self) -> None:
        """Beyond max_queue the oldest lines are dropped and counted."""
        shipper = self.make(max_queue=10)
        for i in range(15):
            shipper.push(LABELS, i, f"l{i}")
        self.assertEqual(shipper.describe()["queue_depth"], 10)
        self.assertEqual(shipper.pressure(), 1.0)
        self.clock.advance(5)
        self.assertEqual(self.loki.lines(), [f"l{i}" for i in range(5, 15)])
        self.assertEqual(shipper.describe()["dropped_overflow"], 5)

    def test_queue_stays_bounded_while_retrying(self) -> None:
        """While Loki fails, the held batch stays first and the queue never exceeds its bound."""
        shipper = self.make(batch_size=5, max_queue=20)
        self.loki.fail_next(3, 500)
        for i in range(5):
            shipper.push(LABELS, i, f"held{i}")
        self.clock.advance(5)
        for i in range(100):
            shipper.push(LABELS, 100 + i, f"new{i}")
        self.assertEqual(shipper.describe()["queue_depth"], 25)
        self.assertEqual(shipper.describe()["dropped_overflow"], 80)
        self.clock.pump([10] * 3)
        lines = self.loki.lines()
        self.assertEqual(lines[:5], [f"held{i}" for i in range(5)])
        self.assertEqual(lines[5:], [f"new{i}" for i in range(80, 100)])

    def test_push_from_many_threads(self) -> None:
        """Concurrent pushes from threads lose nothing and keep each thread's order."""
        shipper = self.make(batch_size=500, max_queue=100000)

        def work(n: int) -> None:
            for i in range(500):
                shipper.push(labels(thread=str(n)), 1_000_000 + i, f"{n}:{i}")

        threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.clock.advance(5)
        self.assertEqual(len(self.loki.entries()), 4000)
        for n in range(8):
            self.assertEqual(self.loki.lines(thread=str(n)), [f"{n}:{i}" for i in range(500)])

    def test_full_batch_wakes_the_flusher_early(self) -> None:
        """Reaching batch_size asks the reactor (via callFromThread) for a flush before the interval."""
        clock = WakingClock()
        shipper = self.make(clock=clock, batch_size=3)
        shipper.push(LABELS, 1, "a")
        shipper.push(LABELS, 2, "b")
        self.assertEqual(clock.from_thread, [])
        shipper.push(LABELS, 3, "c")
        shipper.push(LABELS, 4, "d")
        self.assertEqual(len(clock.from_thread), 1)
        clock.from_thread.pop()()
        self.assertEqual(self.loki.lines(), ["a", "b", "c", "d"])

    def test_stop_makes_a_final_flush(self) -> None:
        """Stopping pushes what is queued, then fires."""
        shipper = self.make()
        shipper.push(LABELS, 1, "last words")
        d = shipper.stopService()
        self.successResultOf(d)
        self.assertEqual(self.loki.lines(), ["last words"])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_stop_is_bounded_when_loki_hangs(self) -> None:
        """A hung Loki holds the stop no longer than stop_timeout; the lines are reported unsent."""
        events = capture_events(self)
        shipper = self.make()
        self.loki.hold_next(1)
        shipper.push(LABELS, 1, "stuck")
        d = shipper.stopService()
        self.assertNoResult(d)
        self.clock.advance(3)
        self.successResultOf(d)
        self.assertEqual(shipper.describe()["queue_depth"], 1)
        self.assertTrue(any(e.get("lines") == 1 and "not shipped" in e["log_format"] for e in events))
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_stop_during_backoff_tries_once_more(self) -> None:
        """A stop while waiting to retry makes one immediate last attempt instead of waiting."""
        shipper = self.make()
        self.loki.fail_next(1, 502)
        shipper.push(LABELS, 1, "retry me")
        self.clock.advance(5)
        self.assertTrue(shipper.describe()["retrying"])
        d = shipper.stopService()
        self.successResultOf(d)
        self.assertEqual(self.loki.lines(), ["retry me"])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_stop_gives_up_after_one_failed_last_attempt(self) -> None:
        """At stop a failing Loki is tried once, not retried."""
        shipper = self.make()
        self.loki.fail_next(5, 500)
        shipper.push(LABELS, 1, "x")
        d = shipper.stopService()
        self.successResultOf(d)
        self.assertEqual(len(self.loki.pushes), 1)
        self.assertEqual(shipper.describe()["queue_depth"], 1)

    def test_flush_and_delivered_through(self) -> None:
        """flush() fires True once everything pushed is done, False at its timeout."""
        shipper = self.make()
        seq = shipper.push(LABELS, 1, "a")
        self.assertEqual(shipper.delivered_through(), seq - 1)
        d = shipper.flush(2)
        self.assertTrue(self.successResultOf(d))
        self.assertEqual(shipper.delivered_through(), seq)
        self.assertTrue(self.successResultOf(shipper.flush(2)))
        self.loki.fail_next(1, 500)
        shipper.push(LABELS, 2, "b")
        d = shipper.flush(1.5)
        self.assertNoResult(d)
        self.clock.advance(1.5)
        self.assertFalse(self.successResultOf(d))
        self.assertFalse(self.successResultOf(shipper.flush(5)))  # failing: no waiting
        self.clock.advance(0.5)
        self.assertTrue(self.successResultOf(shipper.flush(5)))

    def test_bad_input_never_raises(self) -> None:
        """Odd labels are made valid, a bad timestamp is counted as dropped, long lines are cut."""
        shipper = self.make()
        shipper.push({"bad-name": "v", "9x": "w", "empty": ""}, 1, "x")
        shipper.push(LABELS, "not a number", "y")  # type: ignore[arg-type]
        shipper.push(LABELS, 2, "z" * 100_000)
        self.clock.advance(5)
        entries = self.loki.entries()
        self.assertEqual(entries[0].labels, {"bad_name": "v", "_9x": "w"})
        self.assertTrue(entries[1].line.endswith("[truncated]"))
        self.assertLess(len(entries[1].line), 70_000)
        self.assertEqual(shipper.describe()["dropped_invalid"], 1)

    def test_own_log_events_do_not_feed_back(self) -> None:
        """The shipper's own complaints reach the log but never its queue."""
        shipper = self.make()
        observer = AgentLogObserver(shipper, node_labels("n1", lambda: "10.0.0.5"))
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        self.loki.fail_next(1, 400)
        self.loki.fail_next(3, 500)
        shipper.push(LABELS, 1, "a")
        self.clock.advance(5)
        shipper.push(LABELS, 2, "b")
        self.clock.advance(5)
        self.assertEqual(shipper.describe()["queue_depth"], 1)
        self.clock.pump([1] * 20)
        self.assertEqual(self.loki.lines(), ["b"])


class FakeLokiTests(SynchronousTestCase):
    """The fake Loki answers like Loki's push endpoint."""

    def post(self, loki: FakeLoki, body: Any, path: str = "/loki/api/v1/push",
             headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        stub: Any = StubTreq(loki)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = self.successResultOf(stub.post(
            "http://loki.test" + path, data=data,
            headers=headers if headers is not None else {"Content-Type": "application/json"}))
        return response.code, self.successResultOf(response.content())

    def test_answers(self) -> None:
        """204 for a good push; 404, 405 and 400 (with a reason) for the rest; 429 on demand."""
        loki = FakeLoki()
        good = {"streams": [{"stream": {"job": "x"}, "values": [["1", "a"]]}]}
        self.assertEqual(self.post(loki, good), (204, b""))
        self.assertEqual(self.post(loki, good)[0], 204)
        self.assertEqual(loki.lines(), ["a"])  # identical entries are stored once
        self.assertEqual(self.post(loki, good, path="/api/v1/push")[0], 404)
        self.assertEqual(self.successResultOf(cast(Any, StubTreq(loki)).get("http://l/loki/api/v1/push")).code, 405)
        for bad, reason in [
            ({"streams": [{"stream": {}, "values": []}]}, b"at least one label"),
            ({"streams": [{"stream": {"bad-name": "x"}, "values": []}]}, b"invalid label name"),
            ({"streams": [{"stream": {"job": "x"}, "values": [[1, "a"]]}]}, b"expected"),
            ({"nope": 1}, b"Streams"),
            (b"{", b"invalid JSON"),
        ]:
            code, text = self.post(loki, bad)
            self.assertEqual(code, 400)
            self.assertIn(reason, text)
        self.assertEqual(self.post(loki, good, headers={"Content-Type": "application/x-protobuf"})[0], 400)
        self.assertEqual(self.post(loki, b"not gzip", headers={
            "Content-Type": "application/json", "Content-Encoding": "gzip"})[0], 400)
        loki.fail_next(1, 429)
        self.assertEqual(self.post(loki, good)[0], 429)

    def test_out_of_order_rejected_when_asked(self) -> None:
        """With reject_out_of_order, an entry older than its stream's newest is a 400."""
        loki = FakeLoki(reject_out_of_order=True)
        self.assertEqual(self.post(loki, {"streams": [{"stream": {"a": "b"}, "values": [["5", "x"]]}]})[0], 204)
        code, text = self.post(loki, {"streams": [{"stream": {"a": "b"}, "values": [["4", "y"]]}]})
        self.assertEqual(code, 400)
        self.assertIn(b"out of order", text)


@implementer(ILogSink)
class RecordingSink:
    """An ILogSink that records pushes; the test decides what is delivered."""

    def __init__(self) -> None:
        self.pushed: list[tuple[dict[str, str], int, str]] = []
        self.delivered = 0
        self.level = 0.0
        self.flushes: list[float] = []
        self.flush_result: Deferred[bool] | None = None

    def push(self, labels: Mapping[str, str], ts_ns: int, line: str) -> int:
        self.pushed.append((dict(labels), ts_ns, line))
        return len(self.pushed)

    def delivered_through(self) -> int:
        return self.delivered

    def flush(self, timeout: float) -> Deferred[bool]:
        self.flushes.append(timeout)
        if self.flush_result is not None:
            return self.flush_result
        self.delivered = len(self.pushed)
        return succeed(True)

    def pressure(self) -> float:
        return self.level

    def lines(self) -> list[str]:
        return [p[2] for p in self.pushed]


class AgentObserverTests(SynchronousTestCase):
    """L{AgentLogObserver}: labels, levels, formatting, filtering and redaction."""

    def setUp(self) -> None:
        self.sink = RecordingSink()
        self.host = "10.0.0.5"
        self.secrets: list[str] = [TOKEN]
        self.observer = AgentLogObserver(
            self.sink,
            node_labels("n1", lambda: self.host),
            secrets=lambda: self.secrets,
            wallclock=lambda: 1234.5,
        )
        self.log = Logger(namespace="llmport_agent.session", observer=self.observer)

    def test_labels_levels_and_time(self) -> None:
        """Each event becomes one line with node labels, its level and its own time."""
        self.log.info("connected to {url}", url="wss://b/x")
        self.log.warn("slow")
        self.log.error("bad")
        self.log.critical("worse")
        self.host = "10.0.0.6"
        self.log.info("moved")
        levels = [p[0]["level"] for p in self.sink.pushed]
        self.assertEqual(levels, ["info", "warn", "error", "critical", "info"])
        first = self.sink.pushed[0]
        self.assertEqual(first[0], {"job": "node-agent", "host": "10.0.0.5", "container": "node-n1", "level": "info"})
        self.assertEqual(first[2], "[llmport_agent.session] connected to wss://b/x")
        self.assertEqual(self.sink.pushed[-1][0]["host"], "10.0.0.6")
        self.assertLess(abs(first[1] / 1e9 - time.time()), 60)
        self.assertEqual(level_label(LogLevel.warn), "warn")

    def test_debug_only_when_configured(self) -> None:
        """Debug events are skipped unless min_level is debug."""
        self.log.debug("noise")
        self.assertEqual(self.sink.pushed, [])
        verbose = AgentLogObserver(self.sink, node_labels("n1", lambda: "h"), min_level=LogLevel.debug)
        Logger(namespace="x", observer=verbose).debug("noise")
        self.assertEqual(self.sink.pushed[0][0]["level"], "debug")

    def test_failure_text_included(self) -> None:
        """A failure event carries its traceback in the line."""
        try:
            raise ZeroDivisionError("division by zero")
        except ZeroDivisionError:
            self.log.failure("math broke")
        ((lbl, _, line),) = self.sink.pushed
        self.assertEqual(lbl["level"], "critical")
        self.assertIn("math broke", line)
        self.assertIn("ZeroDivisionError", line)
        self.assertIn("Traceback", line)

    def test_own_namespace_skipped(self) -> None:
        """Events of llmport_agent.logs (and children) are not shipped; similar names are."""
        Logger(namespace="llmport_agent.logs.loki.LokiShipper", observer=self.observer).warn("x")
        Logger(namespace="llmport_agent.logs", observer=self.observer).warn("x")
        Logger(namespace="llmport_agent.logsetup", observer=self.observer).warn("kept")
        self.assertEqual(len(self.sink.pushed), 1)

    def test_secrets_redacted(self) -> None:
        """Credentials, bearer values, URL passwords and configured secrets never leave."""
        self.log.info("credential {c}", c=CREDENTIAL)
        self.log.info("header Authorization: Bearer {v}", v="abcdefghijklmnop")
        self.log.info("token {t} used", t=TOKEN)
        self.log.info("registry https://user:pa55word@reg.example/v2")
        self.log.info('payload {p}', p=json.dumps({"enrollment_token": "whatever-it-is", "n": 1}))
        text = "\n".join(self.sink.lines())
        for secret in (CREDENTIAL, "abcdefghijklmnop", TOKEN, "pa55word", "whatever-it-is"):
            self.assertNotIn(secret, text)
        self.assertIn("Bearer ***", text)
        self.assertIn("token *** used", text)
        self.assertIn("https://user:***@reg.example/v2", text)

    def test_failure_text_redacted(self) -> None:
        """A secret inside an exception message is masked in the traceback too."""
        try:
            raise RuntimeError(f"request with Bearer {CREDENTIAL} failed")
        except RuntimeError:
            self.log.failure("call failed")
        self.assertNotIn(CREDENTIAL, self.sink.lines()[0])

    def test_never_raises(self) -> None:
        """A failing labels callable or a strange event is counted, not raised."""
        broken = AgentLogObserver(self.sink, lambda: 1 / 0)  # type: ignore[arg-type,return-value]
        broken({"log_format": "x", "log_level": LogLevel.info, "log_namespace": "a", "log_time": 1.0})
        self.assertEqual(broken.errors, 1)
        self.observer({"log_format": "{", "log_level": ["odd"], "log_time": "never"})
        ((lbl, ts, line),) = self.sink.pushed
        self.assertEqual((lbl["level"], ts), ("info", 1234500000000))
        self.assertIn("Unable to format event", line)

    def test_legacy_error_events(self) -> None:
        """A legacy isError event without a level is shipped as an error."""
        self.observer({"isError": 1, "log_format": "boom", "log_time": 1.0, "log_namespace": "legacy"})
        self.assertEqual(self.sink.pushed[0][0]["level"], "error")


class RedactionTests(SynchronousTestCase):
    """The redaction pass on its own."""

    def test_patterns(self) -> None:
        """Each secret shape is masked; ordinary text is not."""
        self.assertEqual(redact(f"x {CREDENTIAL} y"), "x *** y")
        self.assertEqual(redact("bearer abcdefgh12345"), "bearer ***")
        self.assertEqual(redact("the bearer of news"), "the bearer of news")
        self.assertEqual(redact("password=hunter2!"), "password=***")
        self.assertEqual(redact('{"credential": "c.d"}'), '{"credential": "***"}')
        self.assertEqual(redact("tokens: 5, max_tokens=7"), "tokens: 5, max_tokens=7")
        self.assertEqual(redact(f"{TOKEN}", [TOKEN]), "***")
        self.assertEqual(redact(f"{TOKEN}"), TOKEN)  # a 32-char value alone is not a secret
        self.assertEqual(redact("abc", ["abc"]), "abc")  # too short to search for

    def test_redactor_reads_secrets_each_time(self) -> None:
        """A Redactor sees secrets added later and survives a failing callable."""
        secrets: list[str] = []
        r = Redactor(lambda: secrets)
        self.assertEqual(r("rotated-secret-1"), "rotated-secret-1")
        secrets.append("rotated-secret-1")
        self.assertEqual(r("rotated-secret-1"), "***")
        self.assertEqual(Redactor(lambda: 1 / 0)(CREDENTIAL), "***")  # type: ignore[arg-type,return-value]


class FakeProcessTransport:
    """The parts of a process transport the journal reader uses."""

    def __init__(self, proto: Any) -> None:
        self.proto = proto
        self.signals: list[str] = []
        self.paused = False
        self.stdin_closed = False
        self.exited = False

    def closeStdin(self) -> None:
        self.stdin_closed = True

    def signalProcess(self, signal: str) -> None:
        if self.exited:
            raise ProcessExitedAlready()
        self.signals.append(signal)

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False

    def out(self, data: bytes) -> None:
        self.proto.childDataReceived(1, data)

    def exit(self, code: int = 0, signal: int | None = None) -> None:
        self.exited = True
        reason = ProcessDone(0) if code == 0 and signal is None else ProcessTerminated(code, signal)
        self.proto.processEnded(Failure(reason))


class ProcessClock(Clock):
    """A Clock that records spawnProcess calls."""

    def __init__(self) -> None:
        super().__init__()
        self.spawned: list[tuple[list[str], dict[str, str], FakeProcessTransport]] = []

    def spawnProcess(self, proto: Any, executable: str, args: list[str], env: dict[str, str], **kw: Any) -> Any:
        transport = FakeProcessTransport(proto)
        self.spawned.append((list(args), env, transport))
        proto.makeConnection(transport)
        return transport


def jentry(i: int, message: Any = None, priority: str | None = "6", unit: Any = "docker.service",
           ts_us: int | None = None, **extra: Any) -> bytes:
    obj: dict[str, Any] = {
        "__CURSOR": f"s=abc;i={i:x};b=boot;m=1;t={(ts_us or 1_700_000_000_000_000 + i):x};x=1",
        "__REALTIME_TIMESTAMP": str(ts_us or 1_700_000_000_000_000 + i),
        "MESSAGE": message if message is not None else f"entry {i}",
    }
    if priority is not None:
        obj["PRIORITY"] = priority
    if unit is not None:
        obj["_SYSTEMD_UNIT"] = unit
    obj.update(extra)
    return json.dumps(obj).encode() + b"\n"


class JournalParseTests(SynchronousTestCase):
    """parse_entry and cursor_time."""

    def test_levels_units_and_time(self) -> None:
        """PRIORITY maps to level labels; the unit falls back to the identifier then the command."""
        levels = [parse_entry(jentry(0, priority=str(p)), 0).level for p in range(8)]  # type: ignore[union-attr]
        self.assertEqual(levels, ["critical"] * 3 + ["error", "warn", "info", "info", "debug"])
        e = parse_entry(jentry(1, priority=None, unit=None, SYSLOG_IDENTIFIER="sshd"), 0)
        assert e is not None
        self.assertEqual((e.level, e.unit, e.ts_ns), ("info", "sshd", 1_700_000_000_000_001_000))
        e = parse_entry(jentry(1, unit=None, _COMM="python3"), 0)
        assert e is not None
        self.assertEqual(e.unit, "python3")
        e = parse_entry(b'{"MESSAGE": "m", "PRIORITY": "x", "__REALTIME_TIMESTAMP": "soon"}', 77)
        assert e is not None
        self.assertEqual((e.level, e.unit, e.ts_ns, e.cursor), ("info", "unknown", 77, None))

    def test_message_shapes(self) -> None:
        """Binary messages are decoded, repeated fields use the first value, no MESSAGE is skipped."""
        e = parse_entry(jentry(1, message=list(b"caf\xc3\xa9 \xff\n")), 0)
        assert e is not None
        self.assertEqual(e.message, "caf\u00e9 \ufffd")
        e = parse_entry(jentry(1, unit=["a.service", "b.service"]), 0)
        assert e is not None
        self.assertEqual(e.unit, "a.service")
        self.assertIsNone(parse_entry(b'{"PRIORITY": "3"}', 0))

    def test_bad_lines(self) -> None:
        """Lines that are not JSON objects raise ValueError saying why."""
        with self.assertRaisesRegex(ValueError, "not JSON"):
            parse_entry(b"{oops", 0)
        with self.assertRaisesRegex(ValueError, "not a JSON object"):
            parse_entry(b"[1]", 0)

    def test_cursor_time(self) -> None:
        """The t= part of a cursor is its entry's time."""
        self.assertEqual(cursor_time("s=a;i=1;b=c;m=1;t=5f5e100;x=2"), 100.0)
        self.assertIsNone(cursor_time("garbage"))


class JournaldSourceTests(SynchronousTestCase):
    """L{JournaldSource} with a fake process reactor and a recording sink."""

    def make(self, start: bool = True, **kw: Any) -> JournaldSource:
        self.clock = ProcessClock()
        self.clock.advance(1_700_000_100)
        self.sink = RecordingSink()
        self.dir = kw.pop("state_dir", None) or self.mktemp()
        os.makedirs(self.dir, exist_ok=True)
        kw.setdefault("journalctl", shutil.which("true") or "/bin/true")
        source = JournaldSource(
            self.clock,
            self.sink,
            node_labels("n1", lambda: "10.0.0.5"),
            SynchronousRunner(),
            state_dir=self.dir,
            backoff=Backoff(1.0, 60.0, lambda: 1.0),
            wallclock=self.clock.seconds,
            **kw,
        )
        if start:
            source.startService()

            def stop() -> None:
                if source.running:
                    d = source.stopService()
                    for _, _, t in self.clock.spawned:
                        if not t.exited:
                            t.exit(0, 15)
                    self.clock.advance(10)
                    self.successResultOf(d)
                self.assertEqual(self.clock.getDelayedCalls(), [])

            self.addCleanup(stop)
        return source

    @property
    def transport(self) -> FakeProcessTransport:
        return self.clock.spawned[-1][2]

    def saved(self) -> str:
        with open(os.path.join(self.dir, CURSOR_FILE)) as f:
            return f.read().strip()

    def test_arguments_first_start(self) -> None:
        """journalctl follows JSON from now, with the directory and unit filters, no shell."""
        self.make(directory="/var/log/journal", units=["docker.service", "llmport-agent.service"])
        args, env, transport = self.clock.spawned[0]
        self.assertEqual(args[1:], [
            "--follow", "--output=json", "--all", "--no-pager",
            "--output-fields=MESSAGE,PRIORITY,_SYSTEMD_UNIT,SYSLOG_IDENTIFIER,_COMM",
            "--priority=6", "--directory=/var/log/journal",
            "--unit=docker.service", "--unit=llmport-agent.service", "--since=@1700000100",
        ])
        self.assertTrue(os.path.isabs(args[0]))
        self.assertTrue(transport.stdin_closed)
        self.assertEqual(env["SYSTEMD_COLORS"], "0")
        self.assertEqual(self.saved(), "@1700000100")

    def test_entries_become_lines(self) -> None:
        """Entries split across reads become redacted lines with level, unit and their own time."""
        self.make(secrets=lambda: [TOKEN])
        data = jentry(1, priority="3") + jentry(2, message=f"join with {TOKEN}", unit=None,
                                                SYSLOG_IDENTIFIER="kernel")
        self.transport.out(data[:30])
        self.assertEqual(self.sink.pushed, [])
        self.transport.out(data[30:])
        (l1, t1, m1), (l2, t2, m2) = self.sink.pushed
        self.assertEqual(l1, {"job": "node-agent", "host": "10.0.0.5", "container": "node-n1",
                              "level": "error", "unit": "docker.service"})
        self.assertEqual((t1, m1), (1_700_000_000_000_001_000, "entry 1"))
        self.assertEqual((l2["unit"], l2["level"], m2), ("kernel", "info", "join with ***"))

    def test_bad_and_oversized_lines_are_skipped(self) -> None:
        """Garbage lines and lines over the limit are counted and skipped; reading goes on."""
        source = self.make()
        self.transport.out(b"not json\n" + b"x" * (1024 * 1024 + 10))
        self.transport.out(b"still the long line\n" + jentry(3))
        self.transport.out(b'{"PRIORITY": "3"}\n')
        self.assertEqual(self.sink.lines(), ["entry 3"])
        d = source.describe()
        self.assertEqual((d["bad_lines"], d["oversized_lines"], d["skipped_without_message"]), (1, 1, 1))
        self.flushLoggedErrors()

    def test_restart_with_backoff_after_exit(self) -> None:
        """When journalctl exits it is restarted after a growing delay, after the last cursor."""
        source = self.make()
        self.transport.out(jentry(1) + jentry(2))
        self.transport.exit(1)
        self.assertEqual(source.state, "restarting")
        self.clock.advance(1.9)
        self.assertEqual(len(self.clock.spawned), 1)
        self.clock.advance(0.1)
        self.assertEqual(len(self.clock.spawned), 2)
        self.assertEqual(self.clock.spawned[1][0][-1], "--after-cursor=" + json.loads(jentry(2))["__CURSOR"])
        self.transport.exit(1)
        self.clock.advance(3.9)
        self.assertEqual(len(self.clock.spawned), 2)
        self.clock.advance(0.1)
        self.assertEqual(len(self.clock.spawned), 3)
        self.clock.advance(30)  # ran long enough: the backoff starts over
        self.transport.exit(0)
        self.clock.advance(2)
        self.assertEqual(len(self.clock.spawned), 4)
        self.assertEqual(source.describe()["restarts"], 3)

    def test_missing_journalctl_logged_once(self) -> None:
        """Without journalctl there is one clear log line and no process, no retries."""
        events = capture_events(self)
        source = self.make(journalctl="/nonexistent/bin/journalctl")
        self.clock.advance(600)
        self.assertEqual(self.clock.spawned, [])
        self.assertEqual(source.state, "unavailable")
        self.assertEqual(len([e for e in events if "not found" in e["log_format"]]), 1)

    def test_position_follows_the_shipper(self) -> None:
        """The saved cursor is that of the last entry the shipper is done with, not the last read."""
        self.make(cursor_interval=5)
        self.transport.out(jentry(1) + jentry(2) + jentry(3))
        self.clock.advance(5)
        self.assertEqual(self.saved(), "@1700000100")
        self.sink.delivered = 2
        self.clock.advance(5)
        self.assertEqual(self.saved(), json.loads(jentry(2))["__CURSOR"])

    def test_stop_terminates_flushes_and_saves(self) -> None:
        """Stop sends SIGTERM, waits for the exit, lets the shipper flush, then saves the position."""
        source = self.make()
        self.transport.out(jentry(1) + jentry(2))
        d = source.stopService()
        self.assertEqual(self.transport.signals, ["TERM"])
        self.assertNoResult(d)
        self.transport.out(jentry(3))  # printed before it exited: still shipped
        self.transport.exit(0, 15)
        self.successResultOf(d)
        self.assertEqual(self.sink.flushes, [5.0])
        self.assertEqual(self.sink.lines(), ["entry 1", "entry 2", "entry 3"])
        self.assertEqual(self.saved(), json.loads(jentry(3))["__CURSOR"])
        self.assertEqual(source.state, "stopped")

    def test_stop_kills_a_stuck_journalctl(self) -> None:
        """A journalctl that ignores SIGTERM is killed after the stop timeout."""
        source = self.make(stop_timeout=3)
        d = source.stopService()
        self.clock.advance(3)
        self.assertEqual(self.transport.signals, ["TERM", "KILL"])
        self.transport.exit(0, 9)
        self.successResultOf(d)

    def test_restart_resumes_after_saved_cursor(self) -> None:
        """A new source resumes after the saved cursor; a stale one is replaced by the window."""
        source = self.make()
        self.transport.out(jentry(1, ts_us=1_700_000_050_000_000))
        d = source.stopService()
        self.transport.exit(0, 15)
        self.successResultOf(d)
        cursor = self.saved()
        again = self.make(state_dir=self.dir)
        self.assertEqual(self.clock.spawned[0][0][-1], f"--after-cursor={cursor}")
        d = again.stopService()
        self.transport.exit(0, 15)
        self.successResultOf(d)
        stale = self.make(state_dir=self.dir, replay_window=10)
        self.assertEqual(self.clock.spawned[0][0][-1], "--since=@1700000090")
        self.assertTrue(stale.running)

    def test_refused_cursor_falls_back_to_now(self) -> None:
        """If journalctl fails at once on the saved cursor, the next run starts from now."""
        dir_ = self.mktemp()
        os.makedirs(dir_)
        with open(os.path.join(dir_, CURSOR_FILE), "w") as f:
            f.write("s=bad;t=zz\n")
        self.make(state_dir=dir_)
        self.assertEqual(self.clock.spawned[0][0][-1], "--after-cursor=s=bad;t=zz")
        self.transport.exit(1)
        self.clock.advance(2)
        self.assertEqual(self.clock.spawned[1][0][-1], "--since=@1700000100")

    def test_back_pressure_pauses_and_resumes_reading(self) -> None:
        """Reading pauses while the shipper's queue is nearly full and resumes once it drains."""
        source = self.make()
        self.sink.level = 0.9
        self.transport.out(jentry(1))
        self.assertTrue(self.transport.paused)
        self.assertTrue(source.describe()["paused"])
        self.clock.advance(1)
        self.assertTrue(self.transport.paused)
        self.sink.level = 0.4
        self.clock.advance(1)
        self.assertFalse(self.transport.paused)


class LoopbackTests(TestCase):
    """The shipper against the fake Loki over real loopback HTTP."""

    timeout = 15

    def serve(self) -> FakeLoki:
        loki = FakeLoki()
        root = Resource()
        root.putChild(b"gw", loki)
        port = reactor.listenTCP(0, Site(root), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.url = f"http://127.0.0.1:{port.getHost().port}/gw"
        return loki

    def shipper(self, **kw: Any) -> LokiShipper:
        http, pool = loki_http_client(reactor)
        self.addCleanup(pool.closeCachedConnections)
        kw.setdefault("batch_size", 50)
        kw.setdefault("flush_interval", 0.05)
        shipper = LokiShipper(reactor, http, self.url, timeout=5,
                              backoff=Backoff(0.05, 0.2), **kw)
        shipper.startService()
        self.addCleanup(lambda: shipper.stopService() if shipper.running else None)
        return shipper

    async def test_lines_reach_loki_and_survive_a_failure(self) -> None:
        """Lines pushed from the reactor and a thread arrive; a 500 in between is retried."""
        loki = self.serve()
        shipper = self.shipper()
        loki.fail_next(1, 500)
        for i in range(120):
            shipper.push(labels(), time.time_ns(), f"line {i}")
        t = threading.Thread(target=lambda: [shipper.push(labels(level="warn"), time.time_ns(), f"t{i}")
                                             for i in range(30)])
        t.start()
        t.join()
        await loki.when_entries(150)
        self.assertEqual(loki.lines(level="info"), [f"line {i}" for i in range(120)])
        self.assertEqual(loki.lines(level="warn"), [f"t{i}" for i in range(30)])
        self.assertEqual({p.path for p in loki.pushes}, {b"/gw/loki/api/v1/push"})
        self.assertEqual(loki.pushes[0].status, 500)
        self.assertGreaterEqual(shipper.describe()["failed_pushes"], 1)
        await shipper.stopService()

    async def test_stop_flushes_over_loopback(self) -> None:
        """Lines queued right before stop are delivered by the stop itself."""
        loki = self.serve()
        shipper = self.shipper(flush_interval=60)
        shipper.push(labels(), time.time_ns(), "goodbye")
        await shipper.stopService()
        self.assertEqual(loki.lines(), ["goodbye"])


def export_entry(message: str, ts_us: int, priority: int, unit: str) -> str:
    return (
        f"__REALTIME_TIMESTAMP={ts_us}\n__MONOTONIC_TIMESTAMP={ts_us % 10**9}\n"
        f"_BOOT_ID=0123456789abcdef0123456789abcdef\n_HOSTNAME=node\n"
        f"MESSAGE={message}\nPRIORITY={priority}\n_SYSTEMD_UNIT={unit}\n\n"
    )


class RealJournalTests(TestCase):
    """Real journal files (systemd-journal-remote) read by real journalctl, shipped over loopback."""

    timeout = 20

    def setUp(self) -> None:
        if not os.access(JOURNAL_REMOTE, os.X_OK):
            raise self.skipTest(f"{JOURNAL_REMOTE} is not installed (Debian systemd-journal-remote)")
        if shutil.which("journalctl") is None:
            raise self.skipTest("journalctl is not installed")
        self.journal_dir = os.path.abspath(self.mktemp())
        os.makedirs(self.journal_dir)
        self.state_dir = os.path.abspath(self.mktemp())
        os.makedirs(self.state_dir)
        self.loki = FakeLoki()
        port = reactor.listenTCP(0, Site(self.loki), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.url = f"http://127.0.0.1:{port.getHost().port}"
        self.counter = 0

    async def write(self, *entries: tuple[str, int, str]) -> None:
        self.counter += 1
        path = os.path.join(self.journal_dir, f"export-{self.counter}.txt")
        now = time.time_ns() // 1000
        with open(path, "w") as f:
            for i, (message, priority, unit) in enumerate(entries):
                f.write(export_entry(message, now + i, priority, unit))
        out, err, code = await getProcessOutputAndValue(
            JOURNAL_REMOTE, [f"--output={self.journal_dir}/remote.journal", path], env={}
        )
        self.assertEqual(code, 0, err)

    async def run_once(self, expect_total: int, *entries: tuple[str, int, str]) -> None:
        http, pool = loki_http_client(reactor)
        self.addCleanup(pool.closeCachedConnections)
        shipper = LokiShipper(reactor, http, self.url, batch_size=100, flush_interval=0.05)
        source = JournaldSource(
            reactor, shipper, node_labels("n1", lambda: "10.0.0.5"), SynchronousRunner(),
            state_dir=self.state_dir, directory=self.journal_dir, secrets=lambda: [TOKEN],
        )
        shipper.startService()
        source.startService()
        try:
            if entries:
                await self.write(*entries)
            await self.loki.when_entries(expect_total)
        finally:
            await source.stopService()
            await shipper.stopService()

    def pushed_lines(self) -> list[str]:
        return [v[1] for p in self.loki.pushes if p.status == 204
                for s in p.body["streams"] for v in s["values"]]

    async def test_follow_restart_without_loss_or_duplicates(self) -> None:
        """Entries are shipped with their labels; after a restart only the new ones follow."""
        old = time.time_ns() // 1000 - 3600 * 1_000_000
        with open(os.path.join(self.journal_dir, "old.txt"), "w") as f:
            f.write(export_entry("before the agent", old, 6, "docker.service"))
        out, err, code = await getProcessOutputAndValue(
            JOURNAL_REMOTE, [f"--output={self.journal_dir}/remote.journal",
                             os.path.join(self.journal_dir, "old.txt")], env={})
        self.assertEqual(code, 0, err)

        # The first run starts from "now": these are written once it runs.
        await self.run_once(3, ("dockerd started", 6, "docker.service"),
                            (f"token {TOKEN} seen", 3, "llmport-agent.service"),
                            ("disk warning", 4, "docker.service"))
        first = self.loki.entries()
        self.assertEqual([e.line for e in first], ["dockerd started", "token *** seen", "disk warning"])
        self.assertEqual(first[1].labels, {"job": "node-agent", "host": "10.0.0.5", "container": "node-n1",
                                           "level": "error", "unit": "llmport-agent.service"})
        self.assertEqual(first[2].labels["level"], "warn")
        self.assertLess(abs(first[0].ts_ns / 1e9 - time.time()), 60)
        with open(os.path.join(self.state_dir, CURSOR_FILE)) as f:
            self.assertTrue(f.read().startswith("s="))

        # The second run resumes after the saved cursor: this one is written before it starts.
        await self.write(("while stopped", 6, "docker.service"))
        await self.run_once(4)
        self.assertEqual(self.pushed_lines(),
                         ["dockerd started", "token *** seen", "disk warning", "while stopped"])
