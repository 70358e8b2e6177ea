"""
Log shipping benchmarks (issue 11). Prints figures; asserts nothing.

Three processes on loopback: this script (the conductor), the agent's log shipping exactly as
the agent builds it (`build_log_shipping` from the configuration; its own process, so its CPU
and RSS are its own), and a Loki stand-in (the test suite's fake Loki, its own process) that
counts lines per stream, checks sequence numbers and time order, and measures latency.
Needs root, the Docker engine and systemd-journal-remote like the tests.

 1. journald: a backlog of N entries (real journal files) read, parsed and shipped; baseline in
    the same run: journalctl alone writing the same entries as JSON to /dev/null;
 2. one chatty container printing N lines as fast as a shell can; baseline: the engine's own
    `logs` read of the same lines afterwards;
    both with the agent's CPU (its process plus journalctl), peak RSS and reactor lateness p99
    (a 10 ms timer in the agent process);
 3. push latency p50/p95, line written (the engine's time stamp) to line received, at a steady
    200 lines/s;
 4. a Loki outage (default 60 s) at about 5,000 lines/s with an agent restart in the middle:
    lines lost and doubled (must be 0), and spool bytes per million lines.

Usage: python3 bench/bench_loki.py [--journal-lines 200000] [--container-lines 200000]
       [--outage-seconds 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench._common import free_port, percentile  # noqa: E402
from tests.support.probe import LatenessProbe  # noqa: E402

JOURNAL_REMOTE = "/lib/systemd/systemd-journal-remote"


# -- the Loki stand-in process ------------------------------------------------------------------


def serve_loki(port: int) -> None:
    """Child process: the fake Loki with counters, sequence checks and latency samples."""
    import re

    from twisted.internet import reactor
    from twisted.web.resource import Resource
    from twisted.web.server import Site

    from llmport_agent.logs.testing import FakeLoki

    seq = re.compile(r"(?:seq|jseq) (\d+)")
    state: dict[str, Any] = {"lines": 0, "by_job": {}, "gaps": 0, "doubled": 0, "lat": [],
                             "first": None, "last": None}
    expect: dict[tuple[Any, ...], int] = {}

    def on_accept(entries: list[Any]) -> None:
        now = time.time_ns()
        if entries and state["first"] is None:
            state["first"] = now
        if entries:
            state["last"] = now
        state["lines"] += len(entries)
        for e in entries:
            job = e.labels.get("job", "")
            state["by_job"][job] = state["by_job"].get(job, 0) + 1
            m = seq.search(e.line)
            if m is not None:
                n = int(m.group(1))
                key = e.label_key if job == "node-container" else ("journal",)
                want = expect.get(key, 0)
                if n > want:
                    state["gaps"] += n - want
                elif n < want:
                    state["doubled"] += 1
                expect[key] = max(want, n + 1)
            if e.line.startswith("lat ") and len(state["lat"]) < 100_000:
                state["lat"].append((now - e.ts_ns) / 1e6)

    loki = FakeLoki(store=False, keep_pushes=False, on_accept=on_accept)

    class Control(Resource):
        isLeaf = True

        def render_GET(self, request: Any) -> bytes:
            return json.dumps({**state, "violations": loki.violations[:5], "statuses": loki.statuses}).encode()

        def render_POST(self, request: Any) -> bytes:
            cmd = json.loads(request.content.read())
            if cmd.get("outage"):
                loki.outage(int(cmd["outage"]), retry_after="1")
            if cmd.get("recover"):
                loki.recover()
            if cmd.get("reset"):
                state.update(lines=0, by_job={}, gaps=0, doubled=0, lat=[], first=None, last=None)
                expect.clear()
            return b"{}"

    root = Resource()
    root.putChild(b"loki", loki)
    root.putChild(b"control", Control())
    site = Site(root)
    site.noisy = False
    reactor.listenTCP(port, site, interface="127.0.0.1")
    signal.signal(signal.SIGTERM, lambda *a: reactor.callFromThread(reactor.stop))
    reactor.run()


# -- the agent process --------------------------------------------------------------------------


def run_agent(args: argparse.Namespace) -> None:
    """Child process: the agent's log shipping, a lateness probe, stats to a file."""
    import faulthandler

    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid>: every thread's stack on stderr
    from twisted.internet import reactor
    from twisted.internet.defer import ensureDeferred
    from twisted.internet.task import LoopingCall

    from llmport_agent.core.config import load_config
    from llmport_agent.logs.wiring import build_log_shipping
    from llmport_agent.workloads.engine import DockerEngine

    env = {
        "LLM_PORT_NODE_AGENT_AGENT_ID": "bench",
        "LLM_PORT_NODE_AGENT_HOST": "127.0.0.1",
        "LLM_PORT_NODE_AGENT_STATE_PATH": os.path.join(args.state_dir, "state.json"),
        "LLM_PORT_NODE_AGENT_LOKI_URL": args.loki,
        "LLM_PORT_NODE_AGENT_LOG_LEVEL": "WARN",
    }
    config = load_config(env, {})
    engine = DockerEngine(reactor, environ={"DOCKER_HOST": args.docker_host})
    shipping = build_log_shipping(reactor, config, state_dir=args.state_dir, host=lambda: "127.0.0.1",
                                  secrets=lambda: [], engine=engine,
                                  docker_environ={"DOCKER_HOST": args.docker_host},
                                  journal_directory=args.journal_dir)
    order = [shipping.pool, shipping.shipper, shipping.journald, engine, shipping.containers]
    probe = LatenessProbe(0.01)

    def dump() -> None:
        stats = shipping.shipper.stats()
        stats["spool"] = shipping.shipper.describe()["spool"]
        stats["lateness_p99_ms"] = probe.percentile(0.99) * 1000
        stats["lateness_max_ms"] = probe.worst * 1000
        stats["sender"] = {"attempt": shipping.shipper._attempt is not None,
                           "waiting": shipping.shipper._waiting is not None,
                           "sealed": len(shipping.shipper._sealed), "journal": shipping.journald.describe(),
                           "parsing": shipping.journald._parsing is not None}
        # A small write without fsync: this probe must not stall the reactor it measures.
        tmp = os.path.join(args.state_dir, ".bench-stats.json")
        with open(tmp, "w") as f:
            f.write(json.dumps(stats))
        os.replace(tmp, os.path.join(args.state_dir, "bench-stats.json"))

    async def stop() -> None:
        for svc in reversed(order):
            if svc.running:
                await svc.stopService()
        await shipping.http_pool.closeCachedConnections()
        dump()

    for svc in order:
        svc.startService()
    probe.start()
    LoopingCall(dump).start(0.5, now=False)
    # SIGTERM stops the reactor (Twisted's handler); the services stop cleanly before it does.
    reactor.addSystemEventTrigger("before", "shutdown", lambda: ensureDeferred(stop()))
    if os.environ.get("BENCH_LOKI_GC"):  # e.g. "50000,50,1000": gc thresholds, for digging
        import gc

        gc.set_threshold(*(int(x) for x in os.environ["BENCH_LOKI_GC"].split(",")))
    if os.environ.get("BENCH_LOKI_PROFILE"):  # the reactor thread's profile, for digging
        import cProfile

        cProfile.runctx("reactor.run()", globals(), {"reactor": reactor},
                        os.environ["BENCH_LOKI_PROFILE"])
    else:
        reactor.run()


def run_probe(path: str) -> None:
    """Child process: only a 10 ms timer (the lateness any process sees on this loaded machine)."""
    from twisted.internet import reactor

    probe = LatenessProbe(0.01)

    def dump() -> None:
        with open(path, "w") as f:
            json.dump({"p99": probe.percentile(0.99) * 1000, "max": probe.worst * 1000}, f)

    probe.start()
    reactor.addSystemEventTrigger("before", "shutdown", dump)
    reactor.run()


class Probe:
    """The same-run baseline of reactor lateness: a process doing nothing but the timer."""

    def __init__(self) -> None:
        self.path = tempfile.mktemp(prefix="bench-loki-probe-")
        self.proc = subprocess.Popen([sys.executable, __file__, "probe", "--state-dir", self.path], cwd=ROOT,
                                     env=dict(os.environ, PYTHONPATH=ROOT))

    def stop(self) -> float:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(10)
        try:
            with open(self.path) as f:
                return float(json.load(f)["p99"])
        except (OSError, ValueError):
            return 0.0
        finally:
            if os.path.exists(self.path):
                os.unlink(self.path)


# -- the conductor ------------------------------------------------------------------------------


class Loki:
    """The Loki stand-in (FakeLoki with counters, C{/control}) in a child process; C{quiet} drops its output."""

    def __init__(self, quiet: bool = False) -> None:
        self.port = free_port()
        out = subprocess.DEVNULL if quiet else None
        self.proc = subprocess.Popen([sys.executable, __file__, "loki", "--port", str(self.port)], cwd=ROOT,
                                     env=dict(os.environ, PYTHONPATH=ROOT), stdout=out, stderr=out)
        self.url = f"http://127.0.0.1:{self.port}/loki"
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                self.stats()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("the Loki stand-in did not start")

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/control", timeout=10) as r:
            return dict(json.loads(r.read()))

    def cpu(self) -> float:
        import psutil

        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def control(self, **cmd: Any) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/control", data=json.dumps(cmd).encode(),
                                     method="POST")
        urllib.request.urlopen(req, timeout=10).read()

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class Agent:
    def __init__(self, state_dir: str, loki: Loki, docker_host: str, journal_dir: str) -> None:
        import psutil

        self.state_dir = state_dir
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "agent", "--state-dir", state_dir, "--loki", loki.url,
             "--docker-host", docker_host, "--journal-dir", journal_dir],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
        self.ps = psutil.Process(self.proc.pid)
        self.peak_rss = 0
        self.samples: list[tuple[float, float]] = []  # (time, CPU seconds so far)

    def ready(self, timeout: float = 30) -> None:
        """Wait until the agent runs (its first stats file is written half a second after start)."""
        wait(lambda: bool(self.stats()), timeout, self)

    def cpu_between(self, start: float, end: float) -> float:
        """CPU seconds spent between two times (the samples just outside them)."""
        before = [c for t, c in self.samples if t <= start] or [self.samples[0][1]]
        after = [c for t, c in self.samples if t >= end] or [self.samples[-1][1]]
        return after[0] - before[-1]

    def cpu(self) -> float:
        """CPU seconds of the agent and its children (journalctl) so far."""
        t = self.ps.cpu_times()
        total = t.user + t.system
        for child in self.ps.children(recursive=True):
            try:
                ct = child.cpu_times()
                total += ct.user + ct.system
            except Exception:  # noqa: BLE001 - a child that just ended
                pass
        return total

    def own_cpu(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def sample(self) -> None:
        try:
            self.peak_rss = max(self.peak_rss, self.ps.memory_info().rss)
            self.samples.append((time.time(), self.cpu()))
        except Exception:  # noqa: BLE001
            pass

    def stats(self) -> dict[str, Any]:
        try:
            with open(os.path.join(self.state_dir, "bench-stats.json")) as f:
                return dict(json.load(f))
        except (OSError, ValueError):
            return {}

    def stop(self) -> dict[str, Any]:
        children = self.ps.children(recursive=True)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            print("   (the agent did not stop within 60 s: killed)")
            for proc in [self.ps, *children]:
                try:
                    proc.kill()
                except Exception:  # noqa: BLE001 - already gone
                    pass
            self.proc.wait(10)
        return self.stats()


def wait(predicate: Any, timeout: float, agent: Agent | None = None) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if agent is not None:
            agent.sample()
        if predicate():
            return True
        time.sleep(0.05)
    return False


def write_journal(directory: str, count: int, start_us: int) -> float:
    """Journal files with C{count} entries (their times from C{start_us}); returns seconds taken."""
    path = os.path.join(directory, "export.txt")
    with open(path, "w") as f:
        for i in range(count):
            f.write(f"__REALTIME_TIMESTAMP={start_us + i}\n__MONOTONIC_TIMESTAMP={i + 1}\n"
                    f"_BOOT_ID=0123456789abcdef0123456789abcdef\n_HOSTNAME=node\n"
                    f"MESSAGE=jseq {i} GET /v1/completions 200 12ms model=llama user=bench\n"
                    f"PRIORITY=6\n_SYSTEMD_UNIT=app.service\n_PID=4242\n\n")
    t0 = time.time()
    subprocess.run([JOURNAL_REMOTE, f"--output={directory}/remote.journal", path], check=True,
                   capture_output=True)
    os.unlink(path)
    return time.time() - t0


def container(env: Any, script: str) -> Any:
    from llmport_agent.workloads.spec import LABEL_MANAGED, LABEL_RUNTIME_ID, MANAGED_VALUE
    from tests.support.docker_env import BUSYBOX

    return env.client().containers.run(
        BUSYBOX, ["sh", "-c", script], name=f"bench-{uuid.uuid4().hex[:8]}",
        labels={LABEL_MANAGED: MANAGED_VALUE, LABEL_RUNTIME_ID: str(uuid.uuid4())},
        network_mode="none", detach=True)


def bench_journald(env: Any, lines: int, repeats: int) -> None:
    print(f"\n== journald: a backlog of {lines} entries read, parsed and shipped ==")
    runs, base = Runs(), []
    for _ in range(repeats):
        work = tempfile.mkdtemp(prefix="bench-loki-")
        journal_dir = os.path.join(work, "journal")
        state_dir = os.path.join(work, "state")
        os.makedirs(journal_dir)
        os.makedirs(state_dir)
        start_us = int(time.time() * 1e6) - 60_000_000
        write_journal(journal_dir, lines, start_us)
        t0 = time.time()
        subprocess.run(["journalctl", f"--directory={journal_dir}", "--output=json", "--all", "--no-pager",
                        "--output-fields=MESSAGE,PRIORITY,_SYSTEMD_UNIT,SYSLOG_IDENTIFIER,_COMM,_PID"],
                       stdout=subprocess.DEVNULL, check=True)
        base.append(lines / (time.time() - t0))
        with open(os.path.join(state_dir, "journal.cursor"), "w") as f:
            f.write(f"@{start_us // 1_000_000 - 1}\n")  # replay the backlog
        loki = Loki()
        probe = Probe()
        loki_cpu = loki.cpu()
        agent = Agent(state_dir, loki, env.host, journal_dir)  # it reads the backlog at once
        ok = wait(lambda loki=loki: loki.stats()["by_job"].get("node-agent", 0) >= lines, 300, agent)
        wait(lambda: False, 0.2, agent)  # one more CPU sample after the last line
        idle = probe.stop()
        window = loki.stats()
        # From the first line Loki received to the last (the agent's start-up is not counted).
        first, last = window["first"] / 1e9, window["last"] / 1e9
        elapsed = max(1e-3, last - first)
        cpu = agent.cpu_between(first, last)
        print(f"   (the fake Loki used {(loki.cpu() - loki_cpu) / elapsed * 100:.0f} % of a core)")
        stats = agent.stop()
        got = loki.stats()
        loki.stop()
        shutil.rmtree(work, ignore_errors=True)
        runs.add(ok, lines, elapsed, cpu, agent, stats, got, "agent+journalctl", idle)
    runs.report("journalctl alone to /dev/null", base)


def bench_container(env: Any, lines: int, repeats: int) -> None:
    print(f"\n== one chatty container: {lines} lines printed as fast as a shell can ==")
    runs, base, printed = Runs(), [], []
    for _ in range(repeats):
        work = tempfile.mkdtemp(prefix="bench-loki-")
        os.makedirs(os.path.join(work, "journal"))
        loki = Loki()
        agent = Agent(work, loki, env.host, os.path.join(work, "journal"))
        agent.ready()
        probe = Probe()
        c0 = agent.cpu()
        t0 = time.time()
        c = container(env, f'i=0; while [ $i -lt {lines} ]; do echo "seq $i GET /v1/completions 200 12ms"; '
                           "i=$((i+1)); done")
        ok = wait(lambda loki=loki: loki.stats()["by_job"].get("node-container", 0) >= lines, 300, agent)
        elapsed = time.time() - t0
        cpu = agent.cpu() - c0
        idle = probe.stop()
        c.reload()
        started = c.attrs["State"]["StartedAt"]
        finished = c.attrs["State"]["FinishedAt"]
        stats = agent.stop()
        got = loki.stats()
        loki.stop()
        t1 = time.time()
        raw = env.client().api.logs(c.id, stdout=True, stderr=True, timestamps=True)
        base.append(raw.count(b"\n") / (time.time() - t1))
        printed.append(_seconds(finished) - _seconds(started))
        c.remove(force=True)
        shutil.rmtree(work, ignore_errors=True)
        runs.add(ok, lines, elapsed, cpu, agent, stats, got, f"printed in {printed[-1]:.1f} s; agent", idle)
    print(f"   the container printed them in {summary(printed, ' s', 1)}")
    runs.report("the engine's own logs read of the same lines", base)


def bench_latency(env: Any, seconds: int) -> None:
    print(f"\n== push latency: line written (engine time) to line received, 200 lines/s for {seconds} s ==")
    work = tempfile.mkdtemp(prefix="bench-loki-")
    os.makedirs(os.path.join(work, "journal"))
    loki = Loki()
    agent = Agent(work, loki, env.host, os.path.join(work, "journal"))
    agent.ready()
    c = container(env, f'i=0; while [ $i -lt {seconds * 200} ]; do echo "lat $i"; i=$((i+1)); usleep 5000; done')
    wait(lambda: loki.stats()["by_job"].get("node-container", 0) >= seconds * 200 * 0.9, seconds * 3 + 30, agent)
    time.sleep(2)
    samples = loki.stats()["lat"]
    agent.stop()
    loki.stop()
    c.remove(force=True)
    shutil.rmtree(work, ignore_errors=True)
    if samples:
        print(f"   latency p50 {percentile(samples, 0.5):.0f} ms, p95 {percentile(samples, 0.95):.0f} ms, "
              f"max {max(samples):.0f} ms (n={len(samples)}); by design a push starts once "
              "LOG_BATCH_SIZE (100) lines wait, 0.5 s at this rate, or after 1 s")


def bench_outage(env: Any, seconds: float) -> None:
    print(f"\n== a {seconds:.0f} s Loki outage at about 5,000 lines/s, agent restarted in the middle ==")
    work = tempfile.mkdtemp(prefix="bench-loki-")
    os.makedirs(os.path.join(work, "journal"))
    loki = Loki()
    agent = Agent(work, loki, env.host, os.path.join(work, "journal"))
    agent.ready()
    c = container(env, "i=0; while true; do j=0; while [ $j -lt 60 ]; do echo \"seq $i INFO "
                       "POST /v1/chat/completions 200 in $((i % 97 + 3))ms model=llama-3-8b "
                       "tokens=$((i % 4096))\"; i=$((i+1)); j=$((j+1)); done; usleep 10000; done")
    wait(lambda: loki.stats()["by_job"].get("node-container", 0) >= 5000, 60, agent)
    loki.control(outage=503)
    t0 = time.time()
    time.sleep(seconds / 2)
    before = agent.stop()
    agent = Agent(work, loki, env.host, os.path.join(work, "journal"))
    agent.ready()
    time.sleep(max(0.0, seconds - (time.time() - t0)))
    mid = agent.stats()
    spool_bytes = mid.get("spool", {}).get("bytes", 0)
    spool_lines = mid.get("spool_lines", 0)
    loki.control(recover=True)
    c.stop(timeout=0)
    truth = env.client().api.logs(c.id, stdout=True, stderr=True).count(b"\n")
    wait(lambda: loki.stats()["by_job"].get("node-container", 0) >= truth, 600, agent)
    time.sleep(1)
    got = loki.stats()
    agent.stop()
    loki.stop()
    c.remove(force=True)
    shutil.rmtree(work, ignore_errors=True)
    shipped = got["by_job"].get("node-container", 0)
    print(f"   printed {truth} lines ({truth / (time.time() - t0):.0f} lines/s over the run); received {shipped}; "
          f"lines lost: {max(0, truth - shipped) + got['gaps']} (gaps {got['gaps']}); doubled: {got['doubled']}")
    print(f"   spooled before the restart: {before.get('spool', {}).get('appended_lines', 0)} lines; "
          f"at the end of the outage the spool held {spool_lines} lines in {spool_bytes} bytes = "
          f"{spool_bytes / max(1, spool_lines) * 1e6 / 1e6:.1f} MB per million lines")


def _seconds(stamp: str) -> float:
    from llmport_agent.logs.docker_logs import parse_timestamp

    raw = stamp.encode()
    if b"." in raw:
        head, frac = raw.split(b".", 1)
        frac = frac.rstrip(b"Z")[:9].ljust(9, b"0")
        raw = head + b"." + frac + b"Z"
    parsed = parse_timestamp(raw)
    return parsed[0] / 1e9 if parsed else 0.0


class Runs:
    """The figures of repeated runs of one phase, printed per run and summarised."""

    def __init__(self) -> None:
        self.rates: list[float] = []
        self.cpus: list[float] = []
        self.rss: list[float] = []
        self.lateness: list[float] = []
        self.idle_lateness: list[float] = []

    def add(self, ok: bool, lines: int, elapsed: float, cpu: float, agent: Agent, stats: dict[str, Any],
            got: dict[str, Any], what: str, probe: float) -> None:
        self.idle_lateness.append(probe)
        if not ok:
            print(f"   run incomplete: {got['by_job']} of {lines}")
            return
        self.rates.append(lines / elapsed)
        self.cpus.append(cpu / elapsed * 100)
        self.rss.append(agent.peak_rss / 1e6)
        self.lateness.append(stats.get("lateness_p99_ms", 0.0))
        print(f"   run: {lines / elapsed:8.0f} lines/s ({what} CPU {cpu / elapsed * 100:5.1f} % of a core), "
              f"peak RSS {agent.peak_rss / 1e6:.0f} MB, lateness p99 {stats.get('lateness_p99_ms', 0):.1f} ms "
              f"(max {stats.get('lateness_max_ms', 0):.1f}; an idle process meanwhile: {probe:.1f}), "
              f"gaps {got['gaps']}, doubled {got['doubled']}, pushes {stats.get('pushes')}")

    def report(self, baseline: str, base: list[float]) -> None:
        print(f"   shipped:  {summary(self.rates, ' lines/s', 0)}")
        print(f"   baseline: {baseline} {summary(base, ' lines/s', 0)}")
        print(f"   CPU {summary(self.cpus, ' %', 1)}; peak RSS {summary(self.rss, ' MB', 0)}; "
              f"lateness p99 {summary(self.lateness, ' ms', 1)} (baseline, a process doing nothing but "
              f"the timer on the same machine meanwhile: {summary(self.idle_lateness, ' ms', 1)})")


def summary(values: list[float], unit: str, digits: int) -> str:
    if not values:
        return "n/a"
    return (f"median {statistics.median(values):.{digits}f}{unit} "
            f"[{min(values):.{digits}f} .. {max(values):.{digits}f}] n={len(values)}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("loki", "agent", "probe"):
        p = argparse.ArgumentParser()
        p.add_argument("role")
        p.add_argument("--port", type=int)
        p.add_argument("--state-dir")
        p.add_argument("--loki")
        p.add_argument("--docker-host")
        p.add_argument("--journal-dir")
        args = p.parse_args()
        if args.role == "loki":
            serve_loki(args.port)
        elif args.role == "probe":
            run_probe(args.state_dir)
        else:
            run_agent(args)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--journal-lines", type=int, default=200_000)
    p.add_argument("--container-lines", type=int, default=200_000)
    p.add_argument("--latency-seconds", type=int, default=10)
    p.add_argument("--outage-seconds", type=float, default=60.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip", default="", help="comma-separated: journald,container,latency,outage")
    args = p.parse_args()
    from tests.support.docker_env import require_docker

    env = require_docker()
    skip = set(args.skip.split(","))
    print(f"bench_loki on {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    if "journald" not in skip:
        bench_journald(env, args.journal_lines, args.repeats)
    if "container" not in skip:
        bench_container(env, args.container_lines, args.repeats)
    if "latency" not in skip:
        bench_latency(env, args.latency_seconds)
    if "outage" not in skip:
        bench_outage(env, args.outage_seconds)


if __name__ == "__main__":
    main()
