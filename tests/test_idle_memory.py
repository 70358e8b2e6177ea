"""
What an idle agent keeps in memory (issue 27: RSS at idle): the components it wires but an idle
node never uses are imported at their first use (workload, Ray, image seeding and model-sync
handlers at their first command; the ops endpoint's web site and prometheus_client at the first
connection to the ops port), and the start-up's freed heap goes back to the system once
(L{llmport_agent.core.heap.HeapTrim}). No RSS or timing asserts: the figures are
bench/bench_idle.py's (BENCHMARKS.md).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import urllib.request
from typing import Any

from prometheus_client import Histogram as PromHistogram
from twisted.internet import reactor
from twisted.internet.defer import Deferred, succeed
from twisted.internet.protocol import Protocol
from twisted.internet.testing import MemoryReactorClock
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmport_agent.core import heap
from llmport_agent.core.heap import HeapTrim, glibc_malloc_trim
from llmport_agent.core.later import Later
from llmport_agent.ops.endpoint import OpsService, SiteOnFirstConnection
from llmport_agent.ops.timing import Histogram, TimedCalls
from tests.agentharness import AgentTestCase, AnomalyGuard, spawn_agent_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Imported by no idle agent: each comes with the first command (or scrape) that needs it. A
#: top-level import of one of them on the idle path turns IdleImportsTests red.
NOT_AT_IDLE = (
    "llmport_agent.workloads.handlers",
    "llmport_agent.workloads.images",
    "llmport_agent.workloads.imagetransfer",
    "llmport_agent.ray.handlers",
    "llmport_agent.ray.seeding",
    "llmport_agent.models.syncer",
    "llmport_agent.models.transfer",
    "llmport_agent.models._fs",
    "llmport_agent.ops.site",
    "llmport_agent.ops.bounded",
    "llmport_agent.ops.metrics",
    "prometheus_client",
    "twisted.web.server",
    "llmport_agent.host.installer",
    "llmport_agent.host.join",
    "llmport_agent.logs.loki",
    "llmport_agent.logs.wiring",
    "llmport_agent.commands.system_updates",
    "twisted.internet.utils",
    "llmport_agent.ray.container",
    "llmport_agent.ray.bundle",
    # IDNA's UTS 46 table (1.6 MiB): backend requests to a plain host skip it (core/plainurl.py).
    "idna.uts46data",
)
#: What the first scrape of the ops port imports (the lazy site is real, not just absent).
AT_FIRST_SCRAPE = ("llmport_agent.ops.site", "llmport_agent.ops.metrics", "prometheus_client",
                   "twisted.web.server")

#: `llmport-agent run` with a test-only hook: SIGUSR2 writes the imported modules to argv[1].
PROBE = textwrap.dedent(
    """
    import json, os, signal, sys

    out = sys.argv[1]

    def dump(*_):
        with open(out + ".tmp", "w") as f:
            json.dump(sorted(sys.modules), f)
        os.rename(out + ".tmp", out)

    signal.signal(signal.SIGUSR2, dump)
    from llmport_agent.cli import main
    sys.argv = ["llmport-agent", "run"]
    main()
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class IdleImportsTests(AnomalyGuard, TestCase):
    """A real `llmport-agent run` (Docker executor on, no engine), idle after a command."""

    timeout = 150

    async def test_unused_components_are_not_imported_at_idle(self) -> None:
        backend = await self.start_watched_backend()
        ops_port = free_port()
        proc, d, env = spawn_agent_process(self, backend, PROBE, ["{dir}/modules.json"],
                                           "unix:///nonexistent/idle-memory/docker.sock",
                                           OPS_PORT=str(ops_port))
        out = os.path.join(d, "modules.json")
        agent_id = env["LLM_PORT_NODE_AGENT_AGENT_ID"]

        def output() -> str:
            with open(os.path.join(d, "agent.log"), errors="replace") as f:
                return f.read()[-3000:]

        async def modules() -> set[str]:
            if os.path.exists(out):
                os.unlink(out)
            proc.send_signal(signal.SIGUSR2)
            await backend.wait_for(lambda: os.path.exists(out) or proc.poll() is not None, 30)
            self.assertIsNone(proc.poll(), output())
            with open(out) as f:
                return set(json.load(f))

        try:
            await backend.wait_for(lambda: backend.node_by_agent_id(agent_id) is not None
                                   or proc.poll() is not None, 60)
            self.assertIsNone(proc.poll(), output())
            node_id = backend.node_by_agent_id(agent_id)["id"]
            await backend.wait_for(lambda: backend.latest_inventory(node_id) is not None, 60)
            # A command that every idle node runs now and then: it builds none of the handlers.
            cmd = backend.issue_command(node_id, "refresh_inventory", {})
            record = await backend.when_terminal(cmd["id"]).addTimeout(60, reactor)
            self.assertEqual(record["status"], "succeeded", output())
            idle = await modules()
            # The dump is of the agent that ran the command (not a vacuous pass).
            self.assertIn("llmport_agent.agent.service", idle)
            self.assertIn("llmport_agent.ops.endpoint", idle)
            self.assertIn("llmport_agent.workloads.specs", idle)
            self.assertEqual(sorted(idle & set(NOT_AT_IDLE)), [])
            # The ops port answers; its first connection imported the site.
            body = await deferToThread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{ops_port}/metrics", timeout=20).read())
            self.assertIn(b"llmport_agent_build_info", body)
            scraped = await modules()
            self.assertEqual(sorted(set(AT_FIRST_SCRAPE) - scraped), [])
            # The scrape built only the site: no component it reports on (the model syncer's
            # byte counter reads 0 until a sync built it).
            self.assertIn(b"llmport_agent_model_sync_bytes_total 0.0", body)
            self.assertEqual(sorted(scraped & (set(NOT_AT_IDLE) - set(AT_FIRST_SCRAPE) - {"llmport_agent.ops.bounded"})), [])
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            await backend.wait_for(lambda: proc.poll() is not None, 30)
        self.assertEqual(proc.returncode, 0, output())


class AgentWiringTests(AgentTestCase):
    """The composition root builds the deferred components at their first command."""

    timeout = 90

    async def test_handlers_built_at_their_first_command_and_heap_trimmed_once(self) -> None:
        backend = await self.start_backend()
        agent = self.start_agent(backend, docker_host="unix:///nonexistent/idle-memory/docker.sock")
        node_id = await self.wait_connected(backend, agent)
        await backend.wait_for(lambda: backend.latest_inventory(node_id) is not None, 30)
        await backend.wait_for(lambda: agent.heap_trim.runs == 1 or not agent.heap_trim.available, 10)
        self.assertEqual(agent.heap_trim.runs, 1 if agent.heap_trim.available else 0)
        self.assertFalse(agent._workloads.built)
        self.assertFalse(agent._ray.built)
        self.assertFalse(agent._models.built)
        # A second inventory report trims nothing more.
        cmd = backend.issue_command(node_id, "refresh_inventory", {})
        await backend.when_terminal(cmd["id"]).addTimeout(30, reactor)
        self.assertLessEqual(agent.heap_trim.runs, 1)
        # A Ray command builds the Ray manager (with the workload manager and the seeding).
        cmd = backend.issue_command(node_id, "get_ray_status", {})
        record = await backend.when_terminal(cmd["id"]).addTimeout(30, reactor)
        self.assertIn(record["status"], ("succeeded", "failed"))
        self.assertTrue(agent._ray.built)
        self.assertTrue(agent._workloads.built)
        self.assertIs(agent.seeding, agent._seeding.get())
        self.assertEqual(agent.ray.peer_loader, agent.seeding.load_from_peer)
        self.assertFalse(agent._models.built)
        # The syncer is built with the agent's own HTTP client at its first use.
        self.assertIs(agent.models._http, agent.http)
        # check_system_updates imports its module at its first run, and answers.
        cmd = backend.issue_command(node_id, "check_system_updates", {})
        record = await backend.when_terminal(cmd["id"]).addTimeout(60, reactor)
        self.assertEqual(record["status"], "succeeded", record)


class LaterTests(SynchronousTestCase):
    def test_built_once_at_first_get(self) -> None:
        made: list[object] = []
        later: Later[object] = Later(lambda: made.append(object()) or made[-1])
        self.assertFalse(later.built)
        self.assertIsNone(later.if_built())
        self.assertEqual(made, [])
        first = later.get()
        self.assertIs(later.get(), first)
        self.assertEqual(len(made), 1)
        self.assertIs(later.if_built(), first)

    def test_calls_build_at_the_first_call_only(self) -> None:
        class Manager:
            def __init__(self) -> None:
                self.seen: list[Any] = []

            def deploy(self, ctx: Any, *, flag: bool = False) -> tuple[Any, bool]:
                self.seen.append(ctx)
                return ctx, flag

        later: Later[Manager] = Later(Manager)
        calls = later.calls()
        deploy = calls.deploy  # reading the method builds nothing
        self.assertFalse(later.built)
        self.assertEqual(deploy("c1", flag=True), ("c1", True))
        self.assertTrue(later.built)
        calls.deploy("c2")
        self.assertEqual(later.get().seen, ["c1", "c2"])
        self.assertEqual(deploy.__name__, "deploy")

    def test_a_failed_build_is_tried_again(self) -> None:
        attempts: list[int] = []

        def build() -> str:
            attempts.append(1)
            if len(attempts) == 1:
                raise RuntimeError("not yet")
            return "built"

        later: Later[str] = Later(build)
        self.assertRaises(RuntimeError, later.get)
        self.assertFalse(later.built)
        self.assertEqual(later.get(), "built")


class SiteOnFirstConnectionTests(SynchronousTestCase):
    def test_listening_builds_no_site(self) -> None:
        clock = MemoryReactorClock()
        ops = OpsService(clock, agent=object(), port=9464)
        ops.startService()
        self.addCleanup(ops.stopService)
        self.assertEqual(len(clock.tcpServers), 1)
        factory = clock.tcpServers[0][1]
        self.assertIsInstance(factory, SiteOnFirstConnection)
        self.assertFalse(ops.site_built)
        self.assertFalse(factory.built)

    def test_first_connection_builds_the_site_once_and_hands_it_the_port(self) -> None:
        built: list[FakeSite] = []

        def build() -> FakeSite:
            built.append(FakeSite())
            return built[-1]

        factory = SiteOnFirstConnection(build)
        factory.doStart()  # the port starts listening
        self.assertEqual(built, [])
        p1 = factory.buildProtocol(None)
        p2 = factory.buildProtocol(None)
        self.assertEqual(len(built), 1)
        site = built[0]
        self.assertEqual(site.protocols, [p1, p2])
        self.assertEqual(site.started, 1)  # the port's start reached the site once it existed
        factory.doStop()
        self.assertEqual(site.started, 0)

    def test_site_built_before_the_port_starts(self) -> None:
        factory = SiteOnFirstConnection(FakeSite)
        site = factory.site()
        self.assertEqual(site.started, 0)
        factory.doStart()
        self.assertEqual(site.started, 1)


class FakeSite:
    def __init__(self) -> None:
        self.started = 0
        self.protocols: list[Protocol] = []

    def doStart(self) -> None:  # noqa: N802
        self.started += 1

    def doStop(self) -> None:  # noqa: N802
        self.started -= 1

    def buildProtocol(self, addr: Any) -> Protocol:  # noqa: N802
        p = Protocol()
        self.protocols.append(p)
        return p


class HistogramTests(SynchronousTestCase):
    """The plain histograms expose what prometheus_client's own Histogram would."""

    def samples(self, metrics: Any) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
        return [(s.name, tuple(sorted(s.labels.items())), s.value) for m in metrics for s in m.samples
                if not s.name.endswith("_created")]

    def test_same_samples_as_prometheus_client(self) -> None:
        buckets = (0.005, 0.1, 1, 2.5, 60)
        ours = Histogram("x_seconds", "doc", ("type", "outcome"), buckets)
        theirs = PromHistogram("x_seconds", "doc", ["type", "outcome"], buckets=buckets, registry=None)
        for value, labels in [(0.0, ("a", "ok")), (0.005, ("a", "ok")), (0.0051, ("a", "ok")),
                              (1, ("b", "error")), (2.5, ("a", "ok")), (61, ("a", "ok")), (1e9, ("b", "ok"))]:
            ours.observe(value, *labels)
            theirs.labels(*labels).observe(value)
        self.assertEqual(sorted(self.samples(ours.collect())), sorted(self.samples(theirs.collect())))
        self.assertEqual(ours.count("a", "ok"), 5)
        family = next(iter(ours.collect()))
        self.assertEqual((family.name, family.type, family.documentation), ("x_seconds", "histogram", "doc"))

    def test_unlabelled_series_exists_before_any_observation(self) -> None:
        ours = Histogram("late_seconds", "doc", buckets=(0.1, 1))
        theirs = PromHistogram("late_seconds", "doc", buckets=(0.1, 1), registry=None)
        self.assertEqual(self.samples(ours.collect()), self.samples(theirs.collect()))

    def test_wrong_label_count_refused(self) -> None:
        ours = Histogram("x_seconds", "doc", ("type",), (1,))
        self.assertRaises(ValueError, ours.observe, 1.0)

    def test_timed_calls_bound_their_names(self) -> None:
        calls = TimedCalls("c_seconds", "doc", ("type", "outcome"), (1,), max_names=2)
        for name in ("a", "b", "c", "d"):
            calls.observe(name, "ok", 0.5)
        names = {s.labels["type"] for m in calls.collect() for s in m.samples}
        self.assertEqual(names, {"a", "b", "other"})

    def test_recording_imports_no_prometheus_client(self) -> None:
        probe = textwrap.dedent(
            """
            import sys
            from llmport_agent.ops.timing import ReactorLatenessProbe, command_calls
            from twisted.internet.task import Clock
            ReactorLatenessProbe(Clock()).observe(0.01)
            command_calls(lambda: ["x"]).observe("x", "success", 0.2)
            print("prometheus_client" in sys.modules)
            """
        )
        out = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, PYTHONPATH=ROOT),
                             capture_output=True, text=True, timeout=120, check=False)
        self.assertEqual(out.returncode, 0, out.stderr[-2000:])
        self.assertEqual(out.stdout.strip(), "False")


class Pool:
    """A thread pool's C{run} that records the calls and runs them (as a pool thread would)."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def run(self, fn: Any, *args: Any) -> Deferred[Any]:
        self.calls.append(fn)
        return succeed(fn(*args))


class HeapTrimTests(SynchronousTestCase):
    def test_runs_once_on_the_pool(self) -> None:
        trims: list[int] = []
        pool = Pool()
        trim = HeapTrim(pool.run, find=lambda: lambda: trims.append(1))
        self.assertTrue(trim.available)
        self.assertEqual(trims, [])  # nothing at construction
        trim.once()
        trim.once()
        trim.once()
        self.assertEqual(len(pool.calls), 1)
        self.assertEqual(trims, [1])
        self.assertEqual(trim.runs, 1)

    def test_never_on_the_calling_thread(self) -> None:
        ran: list[int] = []
        pending: list[Any] = []
        trim = HeapTrim(lambda fn: pending.append(fn) or Deferred(), find=lambda: lambda: ran.append(1))
        trim.once()
        self.assertEqual(ran, [])  # handed to the pool, not run here
        self.assertEqual(len(pending), 1)

    def test_nothing_where_there_is_no_malloc_trim(self) -> None:
        pool = Pool()
        trim = HeapTrim(pool.run, find=lambda: None)
        self.assertFalse(trim.available)
        trim.once()
        self.assertEqual(pool.calls, [])
        self.assertEqual(trim.runs, 0)

    def test_a_failed_trim_is_logged_not_raised(self) -> None:
        def boom() -> None:
            raise OSError("no")

        trim = HeapTrim(run_here, find=lambda: boom)
        trim.once()  # the failure is handled (a debug line): no unhandled error in a Deferred
        self.assertEqual(trim.runs, 1)

    def test_glibc_lookup(self) -> None:
        self.patch(heap.sys, "platform", "darwin")
        self.assertIsNone(glibc_malloc_trim())
        self.patch(heap.sys, "platform", "linux")

        class Musl:
            malloc_trim = object()  # no gnu_get_libc_version: not glibc

        self.patch(heap.ctypes, "CDLL", lambda name: Musl())
        self.assertIsNone(glibc_malloc_trim())

        def unloadable(name: Any) -> Any:
            raise OSError("static binary")

        self.patch(heap.ctypes, "CDLL", unloadable)
        self.assertIsNone(glibc_malloc_trim())

    def test_glibc_here(self) -> None:
        import platform

        if platform.libc_ver()[0] != "glibc":
            raise self.skipTest("not a glibc system")
        trim = glibc_malloc_trim()
        assert trim is not None
        self.assertIn(trim(), (0, 1))


def run_here(fn: Any) -> Deferred[Any]:
    """A pool's C{run} that runs C{fn} at once: its exception becomes the Deferred's failure."""
    d: Deferred[Any] = Deferred()
    try:
        d.callback(fn())
    except Exception as e:
        d.errback(e)
    return d
