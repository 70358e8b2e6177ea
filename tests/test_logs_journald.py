"""
The journal reader: journalctl's JSON parsed (off the reactor, in chunks) into protocol-8 lines,
its restarts, its position (which moves only behind the shipper), back-pressure, and real
journal files from systemd-journal-remote read by real journalctl: a 50,000-line burst shipped
in order, once, and a restart that neither loses nor repeats a line.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from twisted.internet import reactor as _global_reactor
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.error import ProcessDone, ProcessExitedAlready, ProcessTerminated
from twisted.internet.task import Clock
from twisted.internet.utils import getProcessOutputAndValue
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.server import Site

from llmport_agent.core.backoff import Backoff
from llmport_agent.core.threads import PoolService
from llmport_agent.demo.testing import SynchronousRunner
from llmport_agent.logs.agent_source import node_labels
from llmport_agent.logs.journald import (
    CHUNK_LINES,
    CURSOR_FILE,
    INLINE_LINES,
    MAX_PENDING_BYTES,
    JournaldSource,
    cursor_time,
    parse_entry,
)
from llmport_agent.logs.loki import LokiShipper, loki_http_client
from llmport_agent.logs.testing import FakeLoki, protocol_label_problem
from tests.support.logs import TOKEN, RecordingSink, capture_events

JOURNAL_REMOTE = "/lib/systemd/systemd-journal-remote"
reactor: Any = _global_reactor


class HeldRunner:
    """A runner whose calls wait until the test releases them (a busy worker pool)."""

    def __init__(self) -> None:
        self.pending: list[tuple[Deferred[Any], Callable[..., Any], tuple[Any, ...]]] = []

    def run(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Deferred[Any]:
        if getattr(fn, "__name__", "") != "parse_chunk":
            return maybeDeferred(fn, *args, **kw)
        d: Deferred[Any] = Deferred()
        self.pending.append((d, fn, args))
        return d

    def release_all(self) -> None:
        pending, self.pending = self.pending, []
        for d, fn, args in pending:
            d.callback(fn(*args))


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
        self.runner = kw.pop("runner", None) or SynchronousRunner()
        source = JournaldSource(
            self.clock,
            self.sink,
            node_labels("n1", lambda: "10.0.0.5"),
            self.runner,
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
            "--output-fields=MESSAGE,PRIORITY,_SYSTEMD_UNIT,SYSLOG_IDENTIFIER,_COMM,_PID",
            "--priority=6", "--directory=/var/log/journal",
            "--unit=docker.service", "--unit=llmport-agent.service", "--since=@1700000100",
        ])
        self.assertTrue(os.path.isabs(args[0]))
        self.assertTrue(transport.stdin_closed)
        self.assertEqual(env["SYSTEMD_COLORS"], "0")
        self.assertEqual(self.saved(), "@1700000100")

    def test_entries_become_lines(self) -> None:
        """Entries split across reads become redacted "unit: message" lines with protocol 8 labels."""
        self.make(secrets=lambda: [TOKEN])
        data = jentry(1, priority="3") + jentry(2, message=f"join with {TOKEN}", unit=None,
                                                SYSLOG_IDENTIFIER="kernel")
        self.transport.out(data[:30])
        self.assertEqual(self.sink.pushed, [])
        self.transport.out(data[30:])
        (l1, t1, m1), (l2, t2, m2) = self.sink.pushed
        self.assertEqual(l1, {"job": "node-agent", "host": "10.0.0.5", "container": "node-n1",
                              "agent_id": "n1", "level": "error"})
        self.assertIsNone(protocol_label_problem(l1))
        self.assertEqual((t1, m1), (1_700_000_000_000_001_000, "docker.service: entry 1"))
        self.assertEqual((l2["level"], m2), ("info", "kernel: join with ***"))
        self.assertNotIn("parse_chunk", self.runner.calls)  # two lines: parsed on the spot

    def test_a_backlog_is_parsed_by_the_worker_in_chunks(self) -> None:
        """More than INLINE_LINES pending lines go to the worker pool, in chunks, in order."""
        source = self.make()
        self.transport.out(b"".join(jentry(i) for i in range(CHUNK_LINES + 300)))
        self.assertEqual(self.runner.calls.count("parse_chunk"), 2)
        self.assertEqual(self.sink.lines(), [f"docker.service: entry {i}" for i in range(CHUNK_LINES + 300)])
        self.assertEqual(source.describe()["parse_jobs"], 2)

    def test_the_agents_own_entries_are_skipped(self) -> None:
        """Entries of the agent's own process are not shipped again (nor its Loki complaints)."""
        source = self.make(own_pid="4242")
        self.transport.out(jentry(1, _PID="4242") + jentry(2, _PID="17"))
        self.assertEqual(self.sink.lines(), ["docker.service: entry 2"])
        self.assertEqual(source.describe()["skipped_own"], 1)
        self.sink.delivered = 1
        source._tick()
        self.assertEqual(self.saved(), json.loads(jentry(2))["__CURSOR"])

    def test_parsing_backlog_pauses_reading(self) -> None:
        """When parsing falls behind by more than MAX_PENDING_BYTES, the pipe is not read."""
        runner = HeldRunner()
        source = self.make(runner=runner)
        line = jentry(1, message="m" * 2000)
        self.transport.out(line * (INLINE_LINES + 1))  # a backlog: to the (held) worker
        self.assertEqual(len(runner.pending), 1)
        more = MAX_PENDING_BYTES // len(line) + 2
        for _ in range(more):
            self.transport.out(line)
        self.assertTrue(self.transport.paused)
        self.assertTrue(source.paused)
        while runner.pending:
            runner.release_all()
        self.assertFalse(self.transport.paused)
        self.assertEqual(len(self.sink.pushed), INLINE_LINES + 1 + more)

    def test_bad_and_oversized_lines_are_skipped(self) -> None:
        """Garbage lines and lines over the limit are counted and skipped; reading goes on."""
        source = self.make()
        self.transport.out(b"not json\n" + b"x" * (1024 * 1024 + 10))
        self.transport.out(b"still the long line\n" + jentry(3))
        self.transport.out(b'{"PRIORITY": "3"}\n')
        self.assertEqual(self.sink.lines(), ["docker.service: entry 3"])
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
        self.transport.out(jentry(1) + jentry(2))
        self.transport.out(jentry(3))
        self.clock.advance(5)
        self.assertEqual(self.saved(), "@1700000100")
        self.sink.delivered = 2
        self.clock.advance(5)
        self.assertEqual(self.saved(), json.loads(jentry(2))["__CURSOR"])
        self.sink.delivered = 3
        self.clock.advance(5)
        self.assertEqual(self.saved(), json.loads(jentry(3))["__CURSOR"])

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
        self.assertEqual(self.sink.lines(), [f"docker.service: entry {i}" for i in (1, 2, 3)])
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
        """With the shipper full, the pipe is not read and the position stands; room resumes it."""
        source = self.make()
        self.transport.out(jentry(1))
        self.sink.delivered = 1
        source._tick()
        self.sink.set_level(0.9)
        self.transport.out(jentry(2) + jentry(3))
        self.assertTrue(self.transport.paused)
        self.assertTrue(source.describe()["paused"])
        self.assertEqual(self.sink.lines(), ["docker.service: entry 1"])  # not parsed either
        self.clock.advance(30)
        self.assertTrue(self.transport.paused)
        self.assertEqual(self.saved(), json.loads(jentry(1))["__CURSOR"])
        self.sink.set_level(0.4)
        self.assertFalse(self.transport.paused)
        self.assertEqual(len(self.sink.pushed), 3)


def export_entry(message: str, ts_us: int, priority: int, unit: str) -> str:
    return (
        f"__REALTIME_TIMESTAMP={ts_us}\n__MONOTONIC_TIMESTAMP={ts_us % 10**9}\n"
        f"_BOOT_ID=0123456789abcdef0123456789abcdef\n_HOSTNAME=node\n"
        f"MESSAGE={message}\nPRIORITY={priority}\n_SYSTEMD_UNIT={unit}\n\n"
    )


class RealJournalTests(TestCase):
    """Real journal files (systemd-journal-remote) read by real journalctl, shipped over loopback."""

    timeout = 60

    def setUp(self) -> None:
        from tests.support.packages import require_package

        require_package("systemd-journal-remote", JOURNAL_REMOTE)
        require_package("systemd", "journalctl")
        self.journal_dir = os.path.abspath(self.mktemp())
        os.makedirs(self.journal_dir)
        self.state_dir = os.path.abspath(self.mktemp())
        os.makedirs(self.state_dir)
        self.loki = FakeLoki(check_labels=True, require_gzip=True)
        port = reactor.listenTCP(0, Site(self.loki), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.url = f"http://127.0.0.1:{port.getHost().port}"
        self.counter = 0

    async def write(self, *entries: tuple[str, int, str], ahead: float = 0.0) -> None:
        """
        Append entries (stamped C{ahead} seconds from now) to the journal files. They are
        written while no reader follows: journalctl --follow misses entries that
        systemd-journal-remote appends under it (about a quarter of a 50,000-entry append,
        measured), which journald itself, writing the host journal, does not cause.
        """
        self.counter += 1
        path = os.path.join(self.journal_dir, f"export-{self.counter}.txt")
        now = time.time_ns() // 1000 + int(ahead * 1_000_000)
        with open(path, "w") as f:
            for i, (message, priority, unit) in enumerate(entries):
                f.write(export_entry(message, now + i, priority, unit))
        out, err, code = await getProcessOutputAndValue(
            JOURNAL_REMOTE, [f"--output={self.journal_dir}/remote.journal", path], env={}
        )
        self.assertEqual(code, 0, err)
        os.unlink(path)

    async def run_once(self, expect_total: int) -> None:
        http, pool = loki_http_client(reactor)
        self.addCleanup(pool.closeCachedConnections)
        workers = PoolService(reactor, "logs", 2)
        workers.startService()
        self.addCleanup(workers.stopService)
        shipper = LokiShipper(reactor, http, self.url, batch_size=100, flush_interval=5, runner=workers)
        source = JournaldSource(
            reactor, shipper, node_labels("n1", lambda: "10.0.0.5"), workers,
            state_dir=self.state_dir, directory=self.journal_dir, secrets=lambda: [TOKEN],
        )
        shipper.startService()
        source.startService()
        try:
            arrived = self.loki.when_entries(expect_total)
            arrived.addTimeout(40, reactor)
            try:
                await arrived
            except Exception:
                self.fail(f"only {self.loki.accepted} of {expect_total} entries arrived: shipper "
                          f"{shipper.stats()} sender waiting {shipper._waiting is not None} attempt "
                          f"{shipper._attempt is not None} sealed {len(shipper._sealed)} encoding "
                          f"{shipper._encoding} age {shipper._age_call}; journal {source.describe()} "
                          f"parsing {source._parsing} pending {len(source._pending)}")
        finally:
            await source.stopService()
            await shipper.stopService()

    def pushed_lines(self) -> list[str]:
        return [v[1] for p in self.loki.pushes if p.status == 204
                for s in p.body["streams"] for v in s["values"]]

    async def test_follow_restart_without_loss_or_duplicates(self) -> None:
        """Entries are shipped with protocol 8 labels; after a restart only the new ones follow."""
        old = time.time_ns() // 1000 - 3600 * 1_000_000
        with open(os.path.join(self.journal_dir, "old.txt"), "w") as f:
            f.write(export_entry("before the agent", old, 6, "docker.service"))
        out, err, code = await getProcessOutputAndValue(
            JOURNAL_REMOTE, [f"--output={self.journal_dir}/remote.journal",
                             os.path.join(self.journal_dir, "old.txt")], env={})
        self.assertEqual(code, 0, err)

        # The first run starts from "now": the old entry is skipped, these (stamped just after
        # the start) are shipped.
        await self.write(("dockerd started", 6, "docker.service"),
                         (f"token {TOKEN} seen", 3, "llmport-agent.service"),
                         ("disk warning", 4, "docker.service"), ahead=5)
        await self.run_once(3)
        first = self.loki.entries()
        self.assertEqual([e.line for e in first], ["docker.service: dockerd started",
                                                   "llmport-agent.service: token *** seen",
                                                   "docker.service: disk warning"])
        self.assertEqual(first[1].labels, {"job": "node-agent", "host": "10.0.0.5", "container": "node-n1",
                                           "agent_id": "n1", "level": "error"})
        self.assertEqual(first[2].labels["level"], "warn")
        self.assertLess(abs(first[0].ts_ns / 1e9 - time.time()), 60)
        with open(os.path.join(self.state_dir, CURSOR_FILE)) as f:
            self.assertTrue(f.read().startswith("s="))

        # The second run resumes after the saved cursor: this one is written while it is stopped.
        await self.write(("while stopped", 6, "docker.service"), ahead=6)
        await self.run_once(4)
        self.assertEqual(self.pushed_lines(),
                         ["docker.service: dockerd started", "llmport-agent.service: token *** seen",
                          "docker.service: disk warning", "docker.service: while stopped"])
        self.assertEqual((self.loki.violations, self.loki.duplicates), ([], 0))

    async def test_a_burst_of_50000_entries_is_shipped_in_order_once(self) -> None:
        """50,000 journal entries written at once all reach Loki, in order, each once."""
        count = 50_000
        await self.write(*[(f"burst {i:05d} {TOKEN}", 6, "burst.service") for i in range(count)], ahead=5)
        await self.run_once(count)
        lines = self.pushed_lines()
        self.assertEqual(lines, [f"burst.service: burst {i:05d} ***" for i in range(count)])
        self.assertEqual((self.loki.violations, self.loki.duplicates), ([], 0))
        self.assertGreater(len(self.loki.pushes), 1)
