"""
Fleet simulation: several hundred real agents (AgentService instances, many per process, over
real loopback sockets) against the stand-in backend in its own process, of the April 2026
generation (commands in reply to a frame: the polling path this bench measures).

Prints:
- idle cost per node, from the stand-in's cost counters (protocol 3.2 figures: 4.4 ms of backend
  CPU per frame with seq, 2.9 ms without): frames, offset writes and estimated backend CPU per
  minute, for half the fleet polling as before (idle interval = fast interval) and half with
  the idle interval, in the same run; plus the whole fleet's frames and offset writes per second;
- command pickup latency (issue -> the agent's ack reaches the backend) for commands issued
  GAP seconds after the previous one on the same node (default 5 s and 60 s, real time), and
  for commands reaching an idle node (past the active window: what a command 15 min after the
  previous one meets; the window is scaled down to --window seconds so the run stays short);
- the backend stopped for --outage seconds and started again on the same port with the same
  state: time until 50/95/100 % of the nodes are back (stream open; and first heartbeat),
  and connection attempts per second (peak).

Usage: python3 bench/bench_fleet.py [--agents 500] [--workers 4] [--idle-minutes 3] [--outage 30]
(roles --role backend / --role worker are this script's own child processes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import ROOT, free_port, percentile  # noqa: E402

sys.path.insert(0, ROOT)


# -- the backend process ------------------------------------------------------------------


def run_backend(port: int) -> None:
    from twisted.internet import reactor, stdio
    from twisted.internet.defer import Deferred, DeferredList
    from twisted.internet.task import deferLater
    from twisted.protocols.basic import LineReceiver

    from llmport_agent.devbackend import DevBackend

    r: Any = reactor
    # The April 2026 generation: this bench measures the polling path (bench_generations
    # compares it with the current, pushing one).
    backend = DevBackend(r, keep_frames=False, generation="2026-04")
    opens: dict[str, list[float]] = {}
    first_heartbeat: dict[str, float] = {}
    acked: dict[str, Deferred[float]] = {}
    resulted: dict[str, Deferred[None]] = {}
    marks: dict[str, float] = {}
    register = backend.register_stream

    def register_stream(proto: Any) -> None:
        opens.setdefault(proto.node_id, []).append(time.time())
        register(proto)

    backend.register_stream = register_stream  # type: ignore[method-assign]

    def hook(node_id: str, frame: dict[str, Any]) -> None:
        kind = frame.get("type")
        if kind == "heartbeat" and "up_at" in marks and node_id not in first_heartbeat:
            first_heartbeat[node_id] = time.time()
        elif kind == "command_ack":
            d = acked.pop(str(frame.get("command_id")), None)
            if d is not None:
                d.callback(time.time())
        elif kind == "command_result":
            d2 = resulted.pop(str(frame.get("command_id")), None)
            if d2 is not None:
                d2.callback(None)

    backend.frame_hook = hook

    async def one_command(node_id: str) -> float:
        issued = time.time()
        cmd = backend.issue_command(node_id, "resume_node", {})
        ack: Deferred[float] = Deferred()
        done: Deferred[None] = Deferred()
        acked[cmd["id"]] = ack
        resulted[cmd["id"]] = done
        at = await ack
        await done
        return at - issued

    async def pickup(gaps: list[float], rounds: int, jitter: float, nodes: list[str]) -> dict[str, Any]:
        out: dict[str, list[float]] = {str(g): [] for g in gaps}

        async def node_run(node_id: str) -> None:
            await deferLater(r, random.uniform(0, 2), lambda: None)
            await one_command(node_id)  # primer: the gap before it is unknown
            for gap in gaps:
                for _ in range(rounds):
                    await deferLater(r, max(0.0, gap + random.uniform(-jitter, jitter)), lambda: None)
                    out[str(gap)].append(await one_command(node_id))

        await DeferredList([Deferred.fromCoroutine(node_run(n)) for n in nodes], consumeErrors=True)
        return out

    async def pickup_idle(spread: float, nodes: list[str]) -> list[float]:
        async def node_run(node_id: str) -> float:
            await deferLater(r, random.uniform(0, spread), lambda: None)
            return await one_command(node_id)

        results = await DeferredList([Deferred.fromCoroutine(node_run(n)) for n in nodes], consumeErrors=True)
        return [v for ok, v in results if ok]

    async def outage(seconds: float) -> dict[str, float]:
        marks.pop("up_at", None)
        first_heartbeat.clear()
        marks["stop_at"] = time.time()
        await backend.stop()
        marks["down_at"] = time.time()
        await deferLater(r, seconds, lambda: None)
        await backend.listen(port, "127.0.0.1")
        marks["up_at"] = time.time()
        return dict(marks)

    class Control(LineReceiver):
        delimiter = b"\n"

        def reply(self, obj: Any) -> None:
            self.transport.write(json.dumps(obj).encode() + b"\n")

        def run(self, coro: Any) -> None:
            d = Deferred.fromCoroutine(coro)
            d.addCallbacks(self.reply, lambda f: self.reply({"error": f.getErrorMessage()}))

        def lineReceived(self, line: bytes) -> None:
            cmd, *args = line.decode().split()
            if cmd == "streams":
                self.reply({"open": sum(1 for n in backend.state.nodes if backend.connection_count(n)),
                            "nodes": len(backend.state.nodes)})
            elif cmd == "nodes":
                self.reply({n.agent_id: n.id for n in backend.state.nodes.values()})
            elif cmd == "pickup":
                gaps = [float(g) for g in args[0].split(",")]
                self.run(pickup(gaps, int(args[1]), float(args[2]), args[3:]))
            elif cmd == "pickup_idle":
                self.run(pickup_idle(float(args[0]), args[1:]))
            elif cmd == "outage":
                self.run(outage(float(args[0])))
            elif cmd == "curve":
                up = marks.get("up_at", 0.0)
                back = {n: min((t for t in ts if t >= up), default=None) for n, ts in opens.items()}
                self.reply({"marks": marks, "open_after_up": back, "heartbeat_after_up": first_heartbeat})
            elif cmd == "quit":
                d = backend.stop()
                d.addBoth(lambda _: r.stop())

        def connectionLost(self, reason: Any = None) -> None:
            if r.running:
                backend.stop().addBoth(lambda _: r.stop())

    async def start() -> None:
        await backend.listen(port, "127.0.0.1")
        stdio.StandardIO(Control())
        sys.stdout.write(json.dumps({"ready": backend.url}) + "\n")
        sys.stdout.flush()

    r.callWhenRunning(lambda: Deferred.fromCoroutine(start()))
    r.run()


# -- a worker process: many agents ---------------------------------------------------------


def run_worker(config_path: str) -> None:
    from twisted.internet import reactor, stdio
    from twisted.internet.defer import DeferredList
    from twisted.internet.endpoints import TCP4ClientEndpoint
    from twisted.logger import (
        FilteringLogObserver,
        LogLevel,
        LogLevelFilterPredicate,
        globalLogBeginner,
        textFileLogObserver,
    )
    from twisted.protocols.basic import LineReceiver

    from llmport_agent.agent.service import AgentService
    from llmport_agent.core.config import load_config
    from llmport_agent.inventory.gpu import NoGPUSource

    r: Any = reactor
    with open(config_path) as f:
        spec = json.load(f)
    log = open(spec["log"], "a")
    predicate: Any = LogLevelFilterPredicate(defaultLogLevel=LogLevel.warn)
    globalLogBeginner.beginLoggingTo(
        [FilteringLogObserver(textFileLogObserver(log), [predicate])], redirectStandardIO=False
    )
    attempts: list[float] = []

    class Counted:
        def __init__(self, host: str, port: int) -> None:
            self._inner = TCP4ClientEndpoint(r, host, port, timeout=20)

        def connect(self, factory: Any) -> Any:
            attempts.append(time.time())
            return self._inner.connect(factory)

    agents: list[AgentService] = []

    def start_one(a: dict[str, Any]) -> None:
        os.makedirs(a["dir"], exist_ok=True)
        env = {
            "BACKEND_URL": spec["backend_url"], "AGENT_ID": a["agent_id"], "HOST": "127.0.0.1",
            "STATE_PATH": os.path.join(a["dir"], "state.json"),
            "MODEL_STORE": os.path.join(a["dir"], "models"), "OPS_PORT": "0",
            "ENROLLMENT_TOKEN": a["token"], **a["env"],
        }
        config = load_config({"LLM_PORT_NODE_AGENT_" + k: v for k, v in env.items()}, {})
        agent = AgentService(r, config, fatal=lambda code, msg: log.write(f"fatal {code} {msg}\n"),
                             gpu_source=NoGPUSource(), docker_enabled=False,
                             endpoint_factory=lambda host, port, tls: Counted(host, port))
        agent.startService()
        agents.append(agent)

    # Staggered start (the fleet's first enrollment is not what is measured).
    for i, a in enumerate(spec["agents"]):
        r.callLater(i * spec["stagger"], start_one, a)

    class Control(LineReceiver):
        delimiter = b"\n"

        def lineReceived(self, line: bytes) -> None:
            cmd = line.decode().strip()
            if cmd == "report":
                self.transport.write(json.dumps({"attempts": attempts, "agents": len(agents)}).encode() + b"\n")
            elif cmd == "stop":
                d = DeferredList([a.stopService() for a in agents], consumeErrors=True)
                d.addBoth(lambda _: r.stop())

        def connectionLost(self, reason: Any = None) -> None:
            if r.running:
                DeferredList([a.stopService() for a in agents], consumeErrors=True).addBoth(lambda _: r.stop())

    r.callWhenRunning(lambda: stdio.StandardIO(Control()))
    r.run()


# -- pickup latency on a virtual clock, default settings -------------------------------------


def _run_to(clock: Any, t: float) -> None:
    """Advance C{clock} to C{t}, one pending call at a time."""
    while clock.seconds() < t:
        due = min([c.getTime() for c in clock.getDelayedCalls()] + [t])
        clock.advance(max(0.0, due - clock.seconds()))


def _next_frame_after(clock: Any, proto: Any, t: float) -> float:
    """When the agent sends its first frame at or after C{t}."""
    _run_to(clock, t)
    while proto.last < t:
        due = min(c.getTime() for c in clock.getDelayedCalls())
        clock.advance(max(0.0, due - clock.seconds()))
    return float(proto.last)


def virtual_pickup(gaps: list[float], samples: int, seed: int = 7) -> dict[float, list[float]]:
    """
    The real SessionService and HeartbeatReporter (with inventory every 60 s) on a virtual
    clock, default settings (window 600 s): a command is answered, then another is issued
    C{gap} (+-1) s later; its pickup is the time until the agent's next frame (the backend
    answers frames only). Transport and processing times are left out (a few ms on loopback).
    """
    from twisted.internet.defer import succeed
    from twisted.internet.endpoints import TCP4ClientEndpoint
    from twisted.internet.task import LoopingCall
    from twisted.internet.testing import MemoryReactorClock

    from llmport_agent.core.config import load_config
    from llmport_agent.core.state import StateStore
    from llmport_agent.demo.testing import SynchronousRunner
    from llmport_agent.session.reporting import HeartbeatReporter
    from llmport_agent.session.service import SessionService

    class Proto:
        def __init__(self, clock: Any) -> None:
            self.clock, self.opened_at, self.can_send, self.frames_sent = clock, clock.seconds(), True, 0
            self.last = clock.seconds()
            self.is_closed = succeed(None)

        def send_frame(self, frame: dict[str, Any], *, seq: bool = True) -> int:
            self.last = self.clock.seconds()
            return 0

        def sendClose(self, *a: Any, **kw: Any) -> None:
            self.can_send = False

    class NoBackend:
        pass

    rng = random.Random(seed)
    config = load_config({"LLM_PORT_NODE_AGENT_BACKEND_URL": "http://127.0.0.1:8000"}, {})
    tmp = tempfile.mkdtemp(prefix="bench-fleet-model-")
    out: dict[float, list[float]] = {g: [] for g in gaps}
    for gap in gaps:
        for i in range(samples):
            clock = MemoryReactorClock()
            state = StateStore(SynchronousRunner(), os.path.join(tmp, f"s{gap}-{i}.json"))
            state.load()
            state.update(credential="x.y", node_id="n")
            svc = SessionService(clock, config, state, NoBackend(),  # type: ignore[arg-type]
                                 lambda: succeed({}), lambda c, m: None, version="0",
                                 endpoint_factory=lambda h, p, t, c=clock: TCP4ClientEndpoint(c, h, p))
            proto = Proto(clock)
            svc.proto = proto  # type: ignore[assignment]
            svc.connection_opened(proto)  # type: ignore[arg-type]
            hb = HeartbeatReporter(clock, svc, config.heartbeat_interval_sec, lambda: {"status": "healthy"})
            hb.session_opened()
            inventory = LoopingCall(svc.send, {"type": "inventory"})
            inventory.clock = clock
            clock.advance(rng.uniform(0, 60))
            inventory.start(config.inventory_interval_sec, now=True)

            # The previous command: it arrives with the next frame, is acked and answered.
            _run_to(clock, clock.seconds() + rng.uniform(0, 30))
            seen = _next_frame_after(clock, proto, clock.seconds())
            svc.frame_received(proto, {"type": "commands", "items": [{"id": "c"}]})  # type: ignore[arg-type]
            svc.send({"type": "command_ack", "command_id": "c"})
            svc.send({"type": "command_result", "command_id": "c"})
            issued = seen + gap + rng.uniform(-1, 1)
            out[gap].append(_next_frame_after(clock, proto, issued) - issued)
            inventory.stop()
            hb.session_closed()
            svc.connection_closed(proto, True, 1000, "", None)  # type: ignore[arg-type]
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return out


def print_model(samples: int) -> None:
    model = virtual_pickup([5.0, 60.0, 900.0], samples)
    print(f"  virtual clock, default settings (window 600 s, idle interval 8 s), pickup = time to "
          f"the agent's next frame, n={samples} each:")
    for gap, lat in model.items():
        print(f"    {gap:>4g} s after the previous command: p50 {percentile(lat, 0.5):.2f} s, "
              f"p95 {percentile(lat, 0.95):.2f} s, max {max(lat):.2f} s")


# -- the orchestrator -----------------------------------------------------------------------


class Child:
    """A child process spoken to with JSON lines on stdin/stdout."""

    def __init__(self, args: list[str], log_path: str) -> None:
        self.stderr = open(log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     env=dict(os.environ, PYTHONPATH=ROOT))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def read(self, timeout: float = 600) -> Any:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError("child process did not answer")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"child process ended (status {self.proc.wait()})")
        return json.loads(line)

    def ask(self, line: str, timeout: float = 600) -> Any:
        self.send(line)
        return self.read(timeout)

    def finish(self, line: str, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            try:
                self.send(line)
                self.proc.wait(timeout)
            except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


def http_json(url: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def per_minute(c0: dict[str, Any], c1: dict[str, Any], nodes: list[str], minutes: float) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"frames": [], "offset_writes": [], "cpu_ms": [], "cpu_ms_all_seq": []}
    for n in nodes:
        a, b = c0["nodes"].get(n), c1["nodes"].get(n)
        if a is None or b is None:
            continue
        frames = (b["frames"] - a["frames"]) / minutes
        out["frames"].append(frames)
        out["offset_writes"].append((b["offset_writes"] - a["offset_writes"]) / minutes)
        out["cpu_ms"].append((b["cpu_ms"] - a["cpu_ms"]) / minutes)
        # The same frames if every one carried seq (the agent before this change).
        out["cpu_ms_all_seq"].append((b["dispatch_queries"] - a["dispatch_queries"]) * 4.4 / minutes)
    return out


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def wait_until(pred: Any, timeout: float, step: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=["main", "backend", "worker"], default="main")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--config", default="")
    p.add_argument("--agents", type=int, default=500)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--window", type=float, default=90.0,
                   help="COMMAND_POLL_ACTIVE_WINDOW_SEC for the run (scaled down from 600 s)")
    p.add_argument("--fast", type=float, default=2.0, help="COMMAND_POLL_INTERVAL_SEC")
    p.add_argument("--idle-interval", type=float, default=8.0, help="COMMAND_POLL_IDLE_INTERVAL_SEC (after)")
    p.add_argument("--idle-minutes", type=float, default=3.0)
    p.add_argument("--outage", type=float, default=30.0)
    p.add_argument("--gaps", default="5,60", help="pickup gaps in seconds (each below --window)")
    p.add_argument("--rounds", type=int, default=2, help="pickup commands per node and gap")
    p.add_argument("--pickup-nodes", type=int, default=40, help="nodes per pickup sample")
    p.add_argument("--reconnect-max", type=float, default=30.0, help="RECONNECT_MAX_SEC (default 30)")
    p.add_argument("--stagger", type=float, default=0.02, help="seconds between agent starts in a worker")
    p.add_argument("--idle-spread", type=float, default=16.0,
                   help="idle pickups are issued at random times over this many seconds")
    p.add_argument("--settle", type=float, default=5.0,
                   help="seconds past the window before the idle measurement starts")
    p.add_argument("--model-samples", type=int, default=300,
                   help="samples per gap of the virtual-clock pickup model (0 = skip)")
    p.add_argument("--model-only", action="store_true", help="print only the virtual-clock pickup model")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    args = p.parse_args()
    if args.role == "backend":
        run_backend(args.port)
        return 0
    if args.role == "worker":
        run_worker(args.config)
        return 0
    if args.model_only:
        print_model(args.model_samples or 300)
        return 0
    return orchestrate(args)


def orchestrate(args: Any) -> int:  # noqa: C901
    gaps = [float(g) for g in args.gaps.split(",")]
    if max(gaps) + 1 >= args.window:
        print("--gaps must stay below --window", file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="bench-fleet-")
    port = free_port()
    t_begin = time.time()
    backend = Child(["--role", "backend", "--port", str(port)], os.path.join(tmp, "backend.log"))
    workers: list[Child] = []
    try:
        url = backend.read(60)["ready"]
        before_env = {"COMMAND_POLL_INTERVAL_SEC": str(args.fast),
                      "COMMAND_POLL_IDLE_INTERVAL_SEC": str(args.fast),
                      "COMMAND_POLL_ACTIVE_WINDOW_SEC": str(args.window),
                      "RECONNECT_MAX_SEC": str(args.reconnect_max)}
        after_env = dict(before_env, COMMAND_POLL_IDLE_INTERVAL_SEC=str(args.idle_interval))
        agents = []
        for i in range(args.agents):
            group = "before" if i % 2 == 0 else "after"
            token = http_json(url + "/api/admin/system/nodes/enrollment-tokens", {"note": "fleet"})["token"]
            agents.append({"agent_id": f"fleet-{group}-{i:04d}", "token": token, "group": group,
                           "dir": os.path.join(tmp, f"a{i:04d}"),
                           "env": before_env if group == "before" else after_env})
        for w in range(args.workers):
            path = os.path.join(tmp, f"worker{w}.json")
            with open(path, "w") as f:
                json.dump({"backend_url": url, "agents": agents[w::args.workers], "stagger": args.stagger,
                           "log": os.path.join(tmp, f"worker{w}.log")}, f)
            workers.append(Child(["--role", "worker", "--config", path], os.path.join(tmp, f"worker{w}.err")))
        t0 = time.monotonic()
        ok = wait_until(lambda: backend.ask("streams")["open"] >= args.agents, 120 + args.agents * 0.2, 1.0)
        connected_in = time.monotonic() - t0
        state = backend.ask("streams")
        print(f"fleet: {args.agents} agents in {args.workers} worker processes "
              f"({args.agents // args.workers} per process), {state['open']} connected "
              f"{connected_in:.1f} s after the workers started{'' if ok else ' (NOT ALL)'}")
        ids = backend.ask("nodes")
        before_nodes = [ids[a["agent_id"]] for a in agents if a["group"] == "before" and a["agent_id"] in ids]
        after_nodes = [ids[a["agent_id"]] for a in agents if a["group"] == "after" and a["agent_id"] in ids]
        rng = random.Random(12)
        sample = rng.sample(after_nodes, min(len(after_nodes) // 2, args.pickup_nodes))
        idle_sample = rng.sample([n for n in after_nodes if n not in sample],
                                 min(len(after_nodes) - len(sample), args.pickup_nodes))

        # 1. Pickup while active (commands GAP s after the previous one).
        active = backend.ask(f"pickup {args.gaps} {args.rounds} 1 {' '.join(sample)}")
        last_activity = time.monotonic()
        # 2. Idle cost, once every node is past the window.
        time.sleep(max(0.0, args.window + args.settle - (time.monotonic() - last_activity)))
        c0 = http_json(url + "/dev/costs")
        time.sleep(args.idle_minutes * 60)
        c1 = http_json(url + "/dev/costs")
        minutes = (c1["at"] - c0["at"]) / 60
        # 3. Pickup on idle nodes (past the window: what a command 15 min after the last meets).
        idle = backend.ask(f"pickup_idle {args.idle_spread} {' '.join(idle_sample)}")
        # 4. Backend outage and the reconnect curve.
        attempts_before = [len(w.ask("report")["attempts"]) for w in workers]
        marks = backend.ask(f"outage {args.outage}", timeout=args.outage + 120)
        up = marks["up_at"]
        wait_until(lambda: backend.ask("streams")["open"] >= args.agents, 90 + args.reconnect_max * 2, 0.5)
        time.sleep(2)
        curve = backend.ask("curve")
        reports = [w.ask("report") for w in workers]
        attempts = [t for rep, n in zip(reports, attempts_before, strict=True) for t in rep["attempts"][n:]]

        # -- figures ---------------------------------------------------------------------
        b = per_minute(c0, c1, before_nodes, minutes)
        a = per_minute(c0, c1, after_nodes, minutes)
        original = 6 * 4.4
        print(f"\nidle cost per node over {minutes:.1f} min (median of {len(b['frames'])} / {len(a['frames'])} "
              f"nodes; fast interval {args.fast:g} s, heartbeat 15 s, inventory 60 s):")
        print(f"  before (idle interval {args.fast:g} s):  {med(b['frames']):5.1f} frames/min, "
              f"{med(b['offset_writes']):4.1f} offset writes/min, {med(b['cpu_ms']):5.1f} ms backend CPU/min "
              f"({med(b['cpu_ms_all_seq']):5.1f} ms with seq on the polls, as the agent did so far)")
        print(f"  after  (idle interval {args.idle_interval:g} s):  {med(a['frames']):5.1f} frames/min, "
              f"{med(a['offset_writes']):4.1f} offset writes/min, {med(a['cpu_ms']):5.1f} ms backend CPU/min")
        print(f"  original agent (protocol 3.2): ~6 frames/min, all with seq: {original:.1f} ms/min; "
              f"after / original = {med(a['cpu_ms']) / original:.2f}x; "
              f"before (seq on polls) / after = {med(b['cpu_ms_all_seq']) / med(a['cpu_ms']):.1f}x")
        for name, g in (("before", b), ("after", a)):
            n = args.agents
            print(f"  a fleet of {n} nodes all '{name}': {sum(g['frames']) / len(g['frames']) * n / 60:6.1f} "
                  f"frames/s, {sum(g['offset_writes']) / len(g['offset_writes']) * n / 60:5.1f} offset writes/s, "
                  f"{sum(g['cpu_ms']) / len(g['cpu_ms']) * n / 60 / 10:5.1f} % of one backend core")
        print(f"\npickup latency (issue -> ack at the backend), window scaled to {args.window:g} s, "
              f"gap jitter +-1 s:")
        for gap in gaps:
            lat = active[str(gap)]
            if lat:
                print(f"  {gap:>4g} s after the previous command: p50 {percentile(lat, 0.5):.2f} s, "
                      f"p95 {percentile(lat, 0.95):.2f} s, max {max(lat):.2f} s (n={len(lat)})")
        if idle:
            print(f"  idle node (past the window; a command 15 min after the previous one): p50 "
                  f"{percentile(idle, 0.5):.2f} s, p95 {percentile(idle, 0.95):.2f} s, max {max(idle):.2f} s "
                  f"(n={len(idle)})")
        if args.model_samples:
            print_model(args.model_samples)
        back = sorted(t - up for t in curve["open_after_up"].values() if t is not None)
        beats = sorted(t - up for t in curve["heartbeat_after_up"].values())
        total = args.agents
        print(f"\nbackend stopped {marks['down_at'] - marks['stop_at']:.1f} s (closing {total} streams), "
              f"down {up - marks['down_at']:.1f} s, then started again on the same port with the same state:")

        def at(frac: float, values: list[float]) -> str:
            need = max(1, int(round(frac * total)))
            return f"{values[need - 1]:.1f} s" if len(values) >= need else "not reached"

        print(f"  streams back: 50 % {at(0.5, back)}, 95 % {at(0.95, back)}, 100 % {at(1.0, back)} "
              f"({len(back)}/{total})")
        print(f"  first heartbeat: 50 % {at(0.5, beats)}, 95 % {at(0.95, beats)}, 100 % {at(1.0, beats)}")
        per_sec = Counter(int(t - marks["stop_at"]) for t in attempts)
        peak_s, peak = max(per_sec.items(), key=lambda kv: kv[1]) if per_sec else (0, 0)
        after_up = Counter(int(t - up) for t in attempts if t >= up)
        print(f"  connection attempts: {len(attempts)} in all, peak {peak}/s "
              f"({peak_s} s after the stop began), peak after the restart "
              f"{max(after_up.values()) if after_up else 0}/s")
        print(f"\nrun took {time.time() - t_begin:.0f} s; logs in {tmp}" if args.keep else
              f"\nrun took {time.time() - t_begin:.0f} s")
        return 0 if len(back) == total else 1
    finally:
        for w in workers:
            w.finish("stop", timeout=60)
        backend.finish("quit", timeout=30)
        if not args.keep:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
