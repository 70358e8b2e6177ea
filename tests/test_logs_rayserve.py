"""
Tests for L{llmport_agent.logs.rayserve}: Ray Serve replica logs from C{RAY_SESSION_DIR} as a
lossless stream (positions across restarts, rotation, truncation, back-pressure), reading files
a container writes (no link followed, FIFOs never opened, lines and passes bounded).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmport_agent.logs.loki import MAX_LINE_CHARS
from llmport_agent.logs.rayserve import (
    MAX_FILES,
    STATE_FILE,
    Known,
    RayServeLogSource,
    line_fields,
    replica_labels,
    scan,
)
from llmport_agent.logs.testing import protocol_label_problem
from tests.agentharness import AgentTestCase
from tests.support.logs import RecordingSink

SESSION = "session_2026-12-02_10-00-00_123456_1"
REPLICA = "replica_llmport-5f2a_LLMServer:Qwen--Qwen3-8B_k3x9q2.log"
NOW = 1_764_669_600 * 1_000_000_000  # 2025-12-02 10:00 UTC
SECRET = "RAYTOKEN-abcdefghijklmnopqrstuvwxyz012345"


class SyncRunner:
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Deferred[Any]:
        return defer.maybeDeferred(fn, *args, **kwargs)


class Tree:
    """A RAY_SESSION_DIR as the runtime container leaves it on the host."""

    def __init__(self, root: str, session: str = SESSION) -> None:
        self.root = root
        self.session = session
        self.serve = os.path.join(root, session, "logs", "serve")
        os.makedirs(self.serve)
        # Ray writes the link with the container's absolute path: dangling on the host.
        os.symlink(f"/tmp/ray/{session}", os.path.join(root, "session_latest"))

    def path(self, name: str = REPLICA) -> str:
        return os.path.join(self.serve, name)

    def append(self, *lines: str, name: str = REPLICA, end: str = "\n") -> None:
        with open(self.path(name), "a") as f:
            f.write("".join(line + end for line in lines))


class ParsingTests(SynchronousTestCase):
    """File names and lines."""

    def test_replica_labels(self) -> None:
        """The app (llm-port's, with hyphens), the deployment (may hold _ and :), the replica id."""
        self.assertEqual(replica_labels(REPLICA), {"app": "llmport-5f2a", "deployment": "LLMServer:Qwen--Qwen3-8B",
                                                   "replica": "k3x9q2"})
        self.assertEqual(replica_labels("replica_app_my_deploy_r1.log"),
                         {"app": "app", "deployment": "my_deploy", "replica": "r1"})
        self.assertEqual(replica_labels("replica_r1.log"), {"app": "unknown", "deployment": "unknown", "replica": "r1"})
        self.assertEqual(replica_labels("other.log")["app"], "unknown")

    def test_line_fields(self) -> None:
        """JSON (timestamp_ns, created, asctime with a comma) and text lines; junk is unknown, now."""
        ns = NOW - 5_000_000_000
        self.assertEqual(line_fields(json.dumps({"levelname": "WARNING", "timestamp_ns": ns}), NOW), (ns, "warn"))
        self.assertEqual(line_fields(json.dumps({"levelname": "ERROR", "created": ns / 1e9}), NOW)[1], "error")
        self.assertEqual(line_fields('{"levelname": "INFO", "asctime": "2025-12-02 09:59:00,250"}', NOW),
                         (NOW - 60 * 10**9 + 250_000_000, "info"))
        self.assertEqual(line_fields("INFO 2025-12-02 09:59:30,5 llmport-5f2a_LLMServer k3x9q2 -- ok", NOW),
                         (NOW - 30 * 10**9 + 500_000_000, "info"))
        self.assertEqual(line_fields("Traceback (most recent call last):", NOW), (NOW, "unknown"))
        self.assertEqual(line_fields('{"levelname": "INFO", "timestamp_ns": 5}', NOW), (NOW, "info"))  # far past
        self.assertEqual(line_fields("{not json", NOW), (NOW, "unknown"))


class SourceTests(SynchronousTestCase):
    """The source on a Clock with a recording sink."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.tree = Tree(os.path.abspath(self.mktemp()))
        self.state = os.path.abspath(self.mktemp())
        os.makedirs(self.state)
        self.sink = RecordingSink()

    def source(self, **kw: Any) -> RayServeLogSource:
        src = RayServeLogSource(self.clock, self.sink, lambda: "10.0.0.5", SyncRunner(),
                                session_dir=self.tree.root, state_dir=self.state,
                                secrets=lambda: [SECRET], wallclock_ns=lambda: NOW, **kw)
        src.startService()
        self.addCleanup(lambda: src.running and src.stopService())
        return src

    def restart(self, src: RayServeLogSource, **kw: Any) -> RayServeLogSource:
        self.successResultOf(src.stopService())
        return self.source(**kw)

    def tick(self, n: int = 1) -> None:
        for _ in range(n):
            self.clock.advance(2.0)

    def mark_state_seen(self) -> None:
        """Not the first run: a positions file exists (existing files are read whole)."""
        with open(os.path.join(self.state, STATE_FILE), "w") as f:
            json.dump({"version": 1, "files": {}}, f)

    def test_lines_with_labels(self) -> None:
        """Every line once, with job ray-serve and the replica's labels; levels split streams; redacted."""
        self.mark_state_seen()
        self.tree.append(json.dumps({"levelname": "INFO", "message": "up"}), "ERROR x " + SECRET)
        self.source()
        self.assertEqual(len(self.sink.pushed), 2)
        labels = {p[0]["level"] for p in self.sink.pushed}
        self.assertEqual(labels, {"info", "error"})
        first = self.sink.pushed[0][0]
        self.assertEqual(first, {"job": "ray-serve", "host": "10.0.0.5", "level": first["level"], "app": "llmport-5f2a",
                                 "deployment": "LLMServer:Qwen--Qwen3-8B", "replica": "k3x9q2"})
        for p in self.sink.pushed:
            self.assertIsNone(protocol_label_problem(p[0]))
        self.assertNotIn(SECRET, json.dumps(self.sink.lines()))
        self.tree.append("more")
        self.tick()
        self.assertEqual(self.sink.lines()[-1], "more")
        self.assertEqual(len(self.sink.pushed), 3)

    def test_first_run_skips_history(self) -> None:
        """No positions file yet: what files held is skipped; what they get next, and new files, are read."""
        self.tree.append("old 1", "old 2")
        self.source()
        self.assertEqual(self.sink.pushed, [])
        self.tree.append("new 1")
        self.tree.append("other 1", name="replica_llmport-5f2a_LLMServer_b2.log")
        self.tick()
        self.assertEqual(sorted(self.sink.lines()), ["new 1", "other 1"])

    def test_restart_resumes_behind_delivered(self) -> None:
        """Saved positions move only with delivery: undelivered lines are read again after a restart."""
        self.mark_state_seen()
        self.tree.append("a", "b")
        src = self.source()
        self.assertEqual(self.sink.lines(), ["a", "b"])
        self.sink.flush_result = Deferred()  # the shipper cannot deliver them
        self.clock.advance(10)
        stopping = src.stopService()
        self.clock.advance(10)  # the bounded wait for the shipper runs out
        self.successResultOf(stopping)
        self.sink.flush_result = None
        self.tree.append("c")
        self.sink.pushed.clear()
        self.sink.delivered = 0
        self.source()
        self.assertEqual(self.sink.lines(), ["a", "b", "c"])  # a and b again: nothing lost

    def test_restart_no_duplicates_once_delivered(self) -> None:
        """Delivered lines are not read again; lines written while the agent was down are."""
        self.mark_state_seen()
        self.tree.append("a", "b")
        src = self.source()
        self.sink.delivered = len(self.sink.pushed)
        src = self.restart(src)
        self.assertEqual(self.sink.lines(), ["a", "b"])
        self.tree.append("c")
        self.tick()
        self.assertEqual(self.sink.lines(), ["a", "b", "c"])
        with open(os.path.join(self.state, STATE_FILE)) as f:
            saved = json.load(f)
        self.assertEqual(list(saved["files"]), [f"{SESSION}/{REPLICA}"])
        self.assertEqual(os.stat(os.path.join(self.state, STATE_FILE)).st_mode & 0o777, 0o600)

    def test_rotation_lossless(self) -> None:
        """x.log renamed to x.log.1 with unread lines, a new x.log: both read, each line once."""
        self.mark_state_seen()
        self.tree.append("1", "2")
        self.source()
        self.tree.append("3")  # written before the rotation, not read yet
        os.rename(self.tree.path(), self.tree.path() + ".1")
        self.tree.append("4", "5")
        self.tick()
        self.assertEqual(self.sink.lines(), ["1", "2", "3", "4", "5"])
        self.tick(3)
        self.assertEqual(len(self.sink.pushed), 5)

    def test_truncated_in_place(self) -> None:
        """A file cut to zero and written again is read from its start."""
        self.mark_state_seen()
        self.tree.append("one", "two")
        self.source()
        with open(self.tree.path(), "w") as f:
            f.write("three\n")
        self.tick()
        self.assertEqual(self.sink.lines(), ["one", "two", "three"])

    def test_partial_line_waits(self) -> None:
        """A line without its newline yet is not shipped in halves."""
        self.mark_state_seen()
        self.tree.append("start of", end="")
        self.source()
        self.assertEqual(self.sink.pushed, [])
        self.tree.append(" a line")
        self.tick()
        self.assertEqual(self.sink.lines(), ["start of a line"])

    def test_old_session_read_to_its_end(self) -> None:
        """A new session starts: the old session's file still gets its last lines shipped."""
        self.mark_state_seen()
        self.tree.append("old 1")
        self.source()
        self.tree.append("old 2")
        new = "session_2026-12-02_11-00-00_000001_2"
        os.makedirs(os.path.join(self.tree.root, new, "logs", "serve"))
        os.unlink(os.path.join(self.tree.root, "session_latest"))
        os.symlink(f"/tmp/ray/{new}", os.path.join(self.tree.root, "session_latest"))
        with open(os.path.join(self.tree.root, new, "logs", "serve", REPLICA), "w") as f:
            f.write("new 1\n")
        self.tick()
        self.assertEqual(sorted(self.sink.lines()), ["new 1", "old 1", "old 2"])

    def test_back_pressure(self) -> None:
        """While the shipper is full nothing is read; once there is room the lines come."""
        self.mark_state_seen()
        self.sink.set_level(0.9)
        self.tree.append("wait")
        self.source()
        self.tick(3)
        self.assertEqual(self.sink.pushed, [])
        self.sink.set_level(0.1)
        self.assertEqual(self.sink.lines(), ["wait"])

    def test_no_session_dir(self) -> None:
        """A node without Ray: no directory, no line, no complaint, and it is picked up later."""
        os.rename(self.tree.root, self.tree.root + ".away")
        src = self.source()
        self.tick(2)
        self.assertEqual(self.sink.pushed, [])
        os.rename(self.tree.root + ".away", self.tree.root)
        self.tree.append("late")
        self.tick()
        self.assertEqual(self.sink.lines(), ["late"])  # it was the first run: only new lines
        self.assertGreater(src.passes, 3)


class HostileTreeTests(SynchronousTestCase):
    """What a container can plant in the directory it writes."""

    def setUp(self) -> None:
        self.root = os.path.abspath(self.mktemp())
        self.tree = Tree(self.root)
        self.outside = os.path.abspath(self.mktemp())
        os.makedirs(os.path.join(self.outside, "logs", "serve"))
        self.secret_file = os.path.join(self.outside, "host-secret")
        with open(self.secret_file, "w") as f:
            f.write("root:HOST-SECRET\n")

    def lines(self, known: dict[str, Known] | None = None, **kw: Any) -> list[str]:
        result = scan(self.root, known or {}, first_run=False, now_ns=NOW, **kw)
        return [e[2] for f in result.files for e in f.entries]

    def test_symlinked_file_not_read(self) -> None:
        """replica_x.log -> a host file: never opened."""
        os.symlink(self.secret_file, self.tree.path("replica_a_b_c.log"))
        self.tree.append("real")
        self.assertEqual(self.lines(), ["real"])

    def test_symlinked_directories_not_followed(self) -> None:
        """serve -> elsewhere, or session_latest -> a directory outside, leads nowhere."""
        with open(os.path.join(self.outside, "logs", "serve", REPLICA), "w") as f:
            f.write("from outside\n")
        serve = self.tree.serve
        os.rename(serve, serve + ".real")
        os.symlink(os.path.join(self.outside, "logs", "serve"), serve)
        self.assertEqual(self.lines(), [])
        # session_latest pointing at a real directory outside, by a name that exists nowhere inside
        os.unlink(os.path.join(self.root, "session_latest"))
        os.symlink(self.outside, os.path.join(self.root, "session_latest"))
        self.assertEqual(self.lines(), [])
        # a session directory that is itself a link, named by session_latest
        planted = "session_2099-01-01_00-00-00_000000_9"
        os.symlink(self.outside, os.path.join(self.root, planted))
        self.assertEqual(self.lines(), [])
        os.unlink(os.path.join(self.root, "session_latest"))
        os.symlink(f"/tmp/ray/{planted}", os.path.join(self.root, "session_latest"))
        self.assertEqual(self.lines(), [])

    def test_fifo_not_opened(self) -> None:
        """A FIFO named like a replica log is skipped without blocking the thread."""
        os.mkfifo(self.tree.path("replica_a_b_fifo.log"))
        self.tree.append("real")
        self.assertEqual(self.lines(), ["real"])

    def test_huge_line_cut(self) -> None:
        """A 200 KiB line without a newline is shipped in pieces of at most MAX_LINE_CHARS."""
        with open(self.tree.path(), "w") as f:
            f.write("x" * 200_000)
        known: dict[str, Known] = {}
        shipped: list[str] = []
        for _ in range(10):
            result = scan(self.root, known, first_run=False, now_ns=NOW)
            for fr in result.files:
                shipped += [e[2] for e in fr.entries]
                if fr.known is not None:
                    known[fr.key] = fr.known
        self.assertEqual("".join(shipped), "x" * 200_000)
        self.assertLessEqual(max(len(s) for s in shipped), MAX_LINE_CHARS)

    def test_bounded_pass(self) -> None:
        """A pass reads at most its byte budget and says there is more; files beyond the cap wait."""
        for i in range(MAX_FILES + 20):
            self.tree.append("l" * 99, name=f"replica_a_b_{i:04d}.log")
        result = scan(self.root, {}, first_run=False, now_ns=NOW, pass_bytes=5000)
        self.assertEqual(len(result.files), MAX_FILES)
        self.assertEqual(sum(len(f.entries) for f in result.files), 50)
        self.assertTrue(result.more)


class RealShipperTests(TestCase):
    """The reader behind the real shipper and a loopback Loki that checks protocol labels."""

    timeout = 60

    async def test_lines_reach_loki(self) -> None:
        from twisted.internet import reactor
        from twisted.web.server import Site

        from llmport_agent.core.threads import PoolService
        from llmport_agent.logs.loki import LokiShipper, loki_http_client
        from llmport_agent.logs.testing import FakeLoki

        loki = FakeLoki(check_labels=True)
        port = reactor.listenTCP(0, Site(loki), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        pool = PoolService(reactor, "logs", 2)
        http, http_pool = loki_http_client(reactor)
        shipper = LokiShipper(reactor, http, f"http://127.0.0.1:{port.getHost().port}",
                              batch_size=10, flush_interval=0.2, runner=pool)
        tree = Tree(os.path.abspath(self.mktemp()))
        state = os.path.abspath(self.mktemp())
        os.makedirs(state)
        with open(os.path.join(state, STATE_FILE), "w") as f:
            json.dump({"version": 1, "files": {}}, f)
        tree.append(*[json.dumps({"levelname": "INFO", "message": f"m{i}"}) for i in range(50)])
        src = RayServeLogSource(reactor, shipper, lambda: "127.0.0.1", pool, session_dir=tree.root,
                                state_dir=state, interval=0.1)
        for svc in (pool, shipper, src):
            svc.startService()
        try:
            for _ in range(100):
                if len(loki.entries()) >= 50:
                    break
                await deferLater(reactor, 0.05)
        finally:
            for svc in (src, shipper, pool):
                await svc.stopService()
            await http_pool.closeCachedConnections()
        self.assertEqual([json.loads(e.line)["message"] for e in loki.entries()], [f"m{i}" for i in range(50)])
        self.assertEqual(loki.violations, [])
        with open(os.path.join(state, STATE_FILE)) as f:
            saved = json.load(f)["files"][f"{SESSION}/{REPLICA}"]
        self.assertEqual(saved["offset"], os.path.getsize(tree.path()))


def deferLater(reactor: Any, seconds: float) -> Deferred[None]:
    from twisted.internet.task import deferLater as later

    return later(reactor, seconds, lambda: None)


class SaveOrderTests(SynchronousTestCase):
    """Position writes never overtake each other (an older one landing last would go back)."""

    def test_one_write_at_a_time(self) -> None:
        """A save while another is in flight waits for it; the file ends with the newest positions."""
        from llmport_agent.core.storage import atomic_write

        class HeldRunner:
            def __init__(self) -> None:
                self.held: list[tuple[Callable[..., Any], tuple[Any, ...], Deferred[Any]]] = []

            def run(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Deferred[Any]:
                if fn is atomic_write:
                    d: Deferred[Any] = Deferred()
                    self.held.append((fn, args, d))
                    return d
                return defer.maybeDeferred(fn, *args, **kw)

            def release(self, i: int) -> None:
                fn, args, d = self.held.pop(i)
                defer.maybeDeferred(fn, *args).chainDeferred(d)

        clock = Clock()
        clock.advance(100)
        tree = Tree(os.path.abspath(self.mktemp()))
        state = os.path.abspath(self.mktemp())
        os.makedirs(state)
        with open(os.path.join(state, STATE_FILE), "w") as f:
            json.dump({"version": 1, "files": {}}, f)
        sink = RecordingSink()
        runner = HeldRunner()
        tree.append("a")
        src = RayServeLogSource(clock, sink, lambda: "h", runner, session_dir=tree.root, state_dir=state,
                                wallclock_ns=lambda: NOW)
        src.startService()
        sink.delivered = len(sink.pushed)
        tree.append("b")
        clock.advance(2.0)  # a second pass: its save must wait for the first
        sink.delivered = len(sink.pushed)
        stopping = src.stopService()
        self.assertEqual(len(runner.held), 1)  # the first write only
        runner.release(0)
        while runner.held:
            runner.release(len(runner.held) - 1)
        self.successResultOf(stopping)
        with open(os.path.join(state, STATE_FILE)) as f:
            saved = json.load(f)["files"][f"{SESSION}/{REPLICA}"]
        self.assertEqual(saved["offset"], os.path.getsize(tree.path()))


class AgentWiringTests(AgentTestCase):
    """A whole agent with a Loki sink reads RAY_SESSION_DIR."""

    async def test_agent_ships_replica_logs(self) -> None:
        from twisted.internet import reactor
        from twisted.internet.endpoints import TCP4ServerEndpoint
        from twisted.web.server import Site

        from llmport_agent.logs.testing import FakeLoki

        loki = FakeLoki(check_labels=True)
        port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Site(loki))
        self.addCleanup(port.stopListening)
        tree = Tree(os.path.abspath(self.mktemp()))
        backend = await self.start_backend()
        agent = self.start_agent(backend, LOKI_URL=f"http://127.0.0.1:{port.getHost().port}",
                                 LOG_FLUSH_INTERVAL_SEC="0.2", RAY_SESSION_DIR=tree.root)
        await self.wait_connected(backend, agent)
        await backend.wait_for(lambda: agent.log_shipping.ray_serve.passes > 0, 10)
        tree.append("INFO 2026-12-02 10:00:00,000 replica ready", f"token {agent.state.credential}")
        await backend.wait_for(lambda: len(loki.entries(job="ray-serve")) == 2, 10)
        entries = loki.entries(job="ray-serve")
        self.assertEqual({e.labels["replica"] for e in entries}, {"k3x9q2"})
        self.assertEqual({e.labels["host"] for e in entries}, {"127.0.0.1"})
        self.assertNotIn(agent.state.credential, "\n".join(e.line for e in entries))
        self.assertEqual(loki.violations, [])
        await agent.stopService()
