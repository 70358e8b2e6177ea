"""
Idle cost of this agent next to the original agent (0.1.13), side by side, against the
stand-in backend on loopback (issue 27).

Both agents run at their default settings (this agent's ops endpoint on, on a free loopback
port), no container engine (DOCKER_HOST names a socket that is not there), no GPU. Both run as
operators run them: each agent's console script (`llmport-agent run`) from its own virtualenv,
its modules compiled to bytecode at install, with the same environment (every PYTHON* variable
cleared, so neither is compiled from source at each start nor runs this machine's site
.pth files). The original is installed once from the package index under
$TMPDIR/llmport-original-agents/<version> (the same place tests/test_adoption.py uses; never
installed for users); this tree is installed (`pip install`, not editable) under
$TMPDIR/llmport-bench-venvs/<hash of the tree's package files>, reused while the hash matches.
The script prints how each was run.

What it prints, for each agent and as the ratio this / original:

This agent runs twice in the window: "this" as a fresh node (it polls for commands until
the backend proves that it pushes them: every 2 s within COMMAND_POLL_ACTIVE_WINDOW_SEC, 600
s, of the connect, then every 8 s), and "this, push" after one pushed command during the
warm-up (a refresh_inventory: the backend then counts as pushing, no polls at all, as on any
node that ever got a command from a current backend; the mode is kept in the state file).
The original gets the same command (it never polls).

 - start to connected: seconds from the process start to the backend counting the node's
   first stream connect (GET /dev/nodes/<id>/costs, polled every 10 ms), median of --starts
   runs of each, alternating, untraced, before the idle window; beside it the CPU seconds the
   process had used when the connect was seen (less sensitive to a busy machine than the
   wall-clock figure), and the minimum of each;
 - over the idle window (after --warmup seconds): RSS and PSS at the end, CPU seconds with
   children (user + system, of the process and of the children it waited for), threads and
   open fds at the end, wake-ups per minute, threads started, frames per minute sent to the
   backend (the backend's own frame counter).

Wake-ups are counted by strace with seccomp-bpf (only the listed calls stop the tracee): every
return of a blocking wait, in any thread: epoll_wait/epoll_pwait/poll/ppoll/select/pselect6,
futex FUTEX_WAIT*, nanosleep/clock_nanosleep. "reactor" is the main thread's event-loop
waits (epoll_wait & co. in the thread whose id is the process id), "all" adds the other
threads. Threads started are the clone/clone3 calls with CLONE_THREAD. strace starts each
idle agent (seccomp-bpf cannot attach with -p), so the start-to-connected runs are separate
and untraced. As a second, ptrace-free counter the script prints the voluntary context
switches of the threads alive at both ends of the window (/proc/<pid>/task/*/status).

Targets (issue 27): event-loop wake-ups <= 20 a minute (the issue's figure: epoll_wait returns of
the reactor thread; the all-threads count is printed beside it), 0 threads started, CPU <= 0.5x the original,
RSS <= 60 MiB, start to connected <= the original's.

Usage: python3 bench/bench_idle.py [--minutes 10 (0: starts only)] [--warmup 30] [--starts 3] [--original 0.1.13]
       [--baseline-tree DIR (another tree of this agent in the start rotation)]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
from typing import Any

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, DevBackendProcess, free_port  # noqa: E402

MIB = 1024 * 1024
NO_ENGINE = "unix:///nonexistent/bench-idle/docker.sock"
WAITS = ("epoll_wait", "epoll_pwait", "epoll_pwait2", "poll", "ppoll", "select", "pselect6")
SLEEPS = ("nanosleep", "clock_nanosleep")
TRACED = ",".join(WAITS + SLEEPS + ("futex", "clone", "clone3"))
# "<pid> <epoch.seconds> <call>(" with strace -f -ttt; resumed lines carry "<... call resumed>".
LINE = re.compile(r"^(\d+)\s+(\d+\.\d+)\s+(?:<\.\.\. (\w+) resumed>|(\w+)\()")


def clean_env() -> dict[str, str]:
    """This environment without any PYTHON* variable (the same hygiene for both agents)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}


def cleared() -> list[str]:
    return sorted(k for k in os.environ if k.startswith("PYTHON"))


def original_exe(version: str) -> str:
    """The original agent's console script in its own venv (installed once)."""
    venv = os.path.join(os.environ.get("TMPDIR") or tempfile.gettempdir(), "llmport-original-agents", version)
    exe = os.path.join(venv, "bin", "llmport-agent")
    if os.access(exe, os.X_OK):
        return exe
    print(f"installing the original agent {version} into {venv} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, env=clean_env())
    subprocess.run([os.path.join(venv, "bin", "pip"), "install", "-q", f"llmport-agent=={version}"],
                   check=True, env=clean_env())
    return exe


# What `pip install <tree>` packs: the hash of these names what the venv holds.
PACKAGED = ("pyproject.toml", "README.md", "llmport_agent", os.path.join("twisted", "plugins"))


def tree_files(root: str) -> list[str]:
    """The tree's packaged files (relative paths, sorted), without caches or test leftovers."""
    out: list[str] = []
    for top in PACKAGED:
        path = os.path.join(root, top)
        if os.path.isfile(path):
            out.append(top)
            continue
        for d, dirs, files in os.walk(path):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__" and not x.startswith("_trial_temp"))
            out += [os.path.relpath(os.path.join(d, f), root) for f in sorted(files)
                    if not f.endswith((".pyc", ".pyo")) and f != "dropin.cache"]
    return out


def this_exe(root: str = ROOT) -> str:
    """This tree's console script in its own venv, `pip install`ed (bytecode compiled) from a
    copy of the tree's packaged files; reused while their hash matches."""
    files = tree_files(root)
    h = hashlib.sha256(sys.version.encode())
    for rel in files:
        h.update(rel.encode() + b"\0")
        with open(os.path.join(root, rel), "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    base = os.path.join(os.environ.get("TMPDIR") or tempfile.gettempdir(), "llmport-bench-venvs")
    venv = os.path.join(base, h.hexdigest()[:16])
    exe = os.path.join(venv, "bin", "llmport-agent")
    done = os.path.join(venv, "installed")  # written last: a half-made venv is made again
    if os.path.exists(done) and os.access(exe, os.X_OK):
        return exe
    os.makedirs(base, exist_ok=True)
    with open(venv + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs at once: one installs, the other waits
        if not (os.path.exists(done) and os.access(exe, os.X_OK)):
            _install(root, files, base, venv, done)
    return exe


def _install(root: str, files: list[str], base: str, venv: str, done: str) -> None:
    print(f"installing this tree into {venv} ...", flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    work = tempfile.mkdtemp(prefix="tree-", dir=base)
    try:
        src = os.path.join(work, "src")
        for rel in files:  # a copy: an in-tree build would leave build/ (stale modules) behind
            os.makedirs(os.path.dirname(os.path.join(src, rel)), exist_ok=True)
            shutil.copy2(os.path.join(root, rel), os.path.join(src, rel))
        subprocess.run([sys.executable, "-m", "venv", venv], check=True, env=clean_env())
        subprocess.run([os.path.join(venv, "bin", "pip"), "install", "-qq", src],
                       check=True, env=clean_env(), cwd=work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with open(done, "w") as f:
        f.write(root + "\n")


class Agent:
    """One agent process (this one or the original), optionally under strace."""

    def __init__(self, kind: str, argv: list[str], env: dict[str, str], state_dir: str,
                 agent_id: str, trace: bool) -> None:
        self.kind = kind
        self.name = kind
        self.agent_id = agent_id
        self.trace_path = os.path.join(state_dir, "strace.txt") if trace else ""
        if trace:
            argv = ["strace", "-f", "--seccomp-bpf", "-qq", "-ttt", "-e", f"trace={TRACED}",
                    "-o", self.trace_path, "--", *argv]
        self.log = open(os.path.join(state_dir, "agent.log"), "wb")  # noqa: SIM115
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=state_dir)
        self._pid = 0
        #: CPU seconds (with children) when wait_connected saw the connect.
        self.cpu_at_connect = 0.0

    @property
    def pid(self) -> int:
        """The agent's own pid (strace's child when traced)."""
        if not self._pid:
            if not self.trace_path:
                self._pid = self.proc.pid
            else:
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    kids = psutil.Process(self.proc.pid).children()
                    if kids:
                        self._pid = kids[0].pid
                        break
                    time.sleep(0.01)
                else:
                    raise RuntimeError("strace did not start the agent")
        return self._pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def make_agent(kind: str, backend: DevBackendProcess, root: str, n: int, exes: dict[str, str],
               trace: bool, name: str = "") -> Agent:
    d = os.path.join(root, f"{kind}-{n}")
    os.makedirs(d)
    agent_id = f"idle-{kind}-{n}"
    env = {k: v for k, v in clean_env().items() if not k.startswith("LLM_PORT_NODE_AGENT_")}
    env.update({
        "HOME": d,
        "DOCKER_HOST": NO_ENGINE,
        "LLM_PORT_NODE_AGENT_BACKEND_URL": backend.url,
        "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN": backend.token(),
        "LLM_PORT_NODE_AGENT_AGENT_ID": agent_id,
        "LLM_PORT_NODE_AGENT_HOST": "127.0.0.1",
        "LLM_PORT_NODE_AGENT_ADVERTISE_HOST": "127.0.0.1",
        "LLM_PORT_NODE_AGENT_STATE_PATH": os.path.join(d, "state.json"),
        "LLM_PORT_NODE_AGENT_MODEL_STORE": os.path.join(d, "models"),
    })
    if kind != "original":
        env["LLM_PORT_NODE_AGENT_OPS_PORT"] = str(free_port())
        env["LLM_PORT_NODE_AGENT_LOG_FORMAT"] = "text"
    argv = [exes[kind], "run"]
    agent = Agent(kind, argv, env, d, agent_id, trace)
    agent.name = name or kind
    return agent


def node_of(backend: DevBackendProcess, agent_id: str) -> str | None:
    for n in backend.get("/dev/nodes"):
        if n["agent_id"] == agent_id:
            return str(n["id"])
    return None


def costs(backend: DevBackendProcess, node_id: str) -> dict[str, Any]:
    return dict(backend.get(f"/dev/nodes/{node_id}/costs"))


def wait_connected(backend: DevBackendProcess, agent: Agent, timeout: float = 120) -> tuple[str, float]:
    """The node id and seconds from the process start to its first stream connect."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if agent.proc.poll() is not None:
            raise RuntimeError(f"the {agent.kind} agent exited ({agent.proc.returncode}); see {agent.log.name}")
        try:
            node = node_of(backend, agent.agent_id)
            if node is not None and costs(backend, node)["connects"] >= 1:
                took = time.monotonic() - agent.started
                agent.cpu_at_connect = tree_cpu(agent.pid)
                return node, took
        except (OSError, urllib.error.HTTPError):
            pass
        time.sleep(0.01)
    raise RuntimeError(f"the {agent.kind} agent did not connect within {timeout:g} s")


def tree_cpu(pid: int) -> float:
    """CPU seconds of the process and of the children it waited for."""
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system + t.children_user + t.children_system)


def voluntary_switches(pid: int) -> dict[int, int]:
    out: dict[int, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        out[int(tid)] = int(line.split()[1])
        except OSError:
            pass
    return out


def count_trace(path: str, main_pid: int, t0: float, t1: float) -> dict[str, int]:
    """Blocking-wait returns and thread starts in [t0, t1] (epoch seconds) from an strace -ttt log."""
    reactor = waits = threads = processes = 0
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.match(line)
            if not m:
                continue
            when = float(m.group(2))
            if when < t0 or when > t1:
                continue
            pid = int(m.group(1))
            resumed = m.group(3) is not None
            call = m.group(3) or m.group(4)
            unfinished = line.rstrip().endswith("<unfinished ...>")
            if call in ("clone", "clone3"):
                if unfinished:
                    continue
                if "CLONE_THREAD" in line:
                    threads += 1
                elif resumed or "= " in line:
                    processes += 1
                continue
            if unfinished:
                continue  # counted when it resumes (that is the wake-up)
            if call == "futex":
                if "FUTEX_WAIT" not in line and not resumed:
                    continue
                if resumed and "FUTEX_WAKE" in line:
                    continue
            elif call not in WAITS and call not in SLEEPS:
                continue
            waits += 1
            if pid == main_pid and call in WAITS:
                reactor += 1
    return {"reactor": reactor, "all": waits, "threads": threads, "processes": processes}


def measure(backend: DevBackendProcess, agents: list[Agent], nodes: dict[str, str],
            minutes: float) -> dict[str, dict[str, float]]:
    procs = {a.name: psutil.Process(a.pid) for a in agents}
    cpu0 = {a.name: tree_cpu(a.pid) for a in agents}
    vol0 = {a.name: voluntary_switches(a.pid) for a in agents}
    frames0 = {a.name: costs(backend, nodes[a.name])["frames"] for a in agents}
    wall0 = time.time()
    t0 = time.monotonic()
    time.sleep(minutes * 60)
    elapsed = time.monotonic() - t0
    wall1 = time.time()
    per_min = 60.0 / elapsed
    out: dict[str, dict[str, float]] = {}
    for a in agents:
        p = procs[a.name]
        mem = p.memory_full_info()
        vol1 = voluntary_switches(a.pid)
        vol = sum(v - vol0[a.name][t] for t, v in vol1.items() if t in vol0[a.name])
        out[a.name] = {
            "rss": mem.rss / MIB,
            "pss": mem.pss / MIB,
            "cpu": tree_cpu(a.pid) - cpu0[a.name],
            "threads": p.num_threads(),
            "fds": p.num_fds(),
            "frames": (costs(backend, nodes[a.name])["frames"] - frames0[a.name]) * per_min,
            "voluntary": vol * per_min,
        }
        if a.trace_path:
            c = count_trace(a.trace_path, a.pid, wall0, wall1)
            out[a.name].update(reactor=c["reactor"] * per_min, wakeups=c["all"] * per_min,
                               started=c["threads"], spawned=c["processes"])
    return out


def prove_push(backend: DevBackendProcess, agent: Agent, node_id: str, tries: int = 5) -> bool:
    """Push refresh_inventory commands at the node until it says the backend pushes (its log)."""
    for _ in range(tries):
        time.sleep(3.3)  # a silence longer than the proof window, between two polls or not
        command = backend.post(f"/dev/nodes/{node_id}/commands", {"command_type": "refresh_inventory"})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if backend.get(f"/dev/commands/{command['id']}")["status"] in ("succeeded", "failed"):
                break
            time.sleep(0.1)
        with open(os.path.join(os.path.dirname(agent.log.name), "agent.log"), errors="replace") as f:
            if "Command dispatch: push" in f.read():
                return True
    return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0,
                   help="idle window (default 10; 0: only the start-to-connected runs)")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds after connect before the window")
    p.add_argument("--starts", type=int, default=3, help="start-to-connected runs of each (default 3)")
    p.add_argument("--original", default="0.1.13", help="the original agent's version")
    p.add_argument("--baseline-tree", default="",
                   help="another tree of this agent (e.g. main checked out elsewhere), installed the same "
                        "way and started in the same rotation: start to connected before/after in one run")
    args = p.parse_args()
    # A background run ignores SIGINT: SIGTERM (or ^C) ends it through the cleanup below.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: sys.exit("bench_idle: stopped"))
    if shutil.which("strace") is None:
        sys.exit("bench_idle needs strace (apt-get install strace) to count wake-ups and thread starts")
    exes = {"this": this_exe(), "original": original_exe(args.original)}
    if args.baseline_tree:
        exes["baseline"] = this_exe(os.path.abspath(args.baseline_tree))
    print("how each runs: `<venv>/bin/llmport-agent run`, cwd its own state directory, "
          f"PYTHON* cleared for both ({', '.join(cleared()) or 'none were set'}), LLM_PORT_NODE_AGENT_* "
          "set to the stand-in's URL, a fresh token and state paths; this agent also "
          "OPS_PORT=<free port> LOG_FORMAT=text")
    for kind, exe in exes.items():
        print(f"  {kind}: {exe} run")
    backend = DevBackendProcess()
    root = tempfile.mkdtemp(prefix="bench-idle-")
    kinds = ("this", "baseline", "original") if args.baseline_tree else ("this", "original")
    started: dict[str, list[float]] = {k: [] for k in kinds}
    start_cpu: dict[str, list[float]] = {k: [] for k in kinds}
    live: list[Agent] = []
    try:
        n = 0
        for i in range(args.starts):
            for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:  # each goes first in turn
                n += 1
                a = make_agent(kind, backend, root, n, exes, trace=False)
                live.append(a)
                started[kind].append(wait_connected(backend, a)[1])
                start_cpu[kind].append(a.cpu_at_connect)
                a.stop()
                live.remove(a)
        s_this, s_orig = statistics.median(started["this"]), statistics.median(started["original"])
        start_line = (f"  {'start to connected (s, median)':<32} {s_this:10.3f} {s_this / s_orig:6.2f}x "
                      f"{'':>18} {s_orig:10.3f}   (this {', '.join(f'{v:.3f}' for v in started['this'])}; "
                      f"original {', '.join(f'{v:.3f}' for v in started['original'])})")
        c_this, c_orig = statistics.median(start_cpu["this"]), statistics.median(start_cpu["original"])
        start_line += (f"\n  {'CPU s to connected (median)':<32} {c_this:10.3f} {c_this / c_orig:6.2f}x "
                       f"{'':>18} {c_orig:10.3f}   (min: this {min(start_cpu['this']):.3f}, original "
                       f"{min(start_cpu['original']):.3f}; wall min: this {min(started['this']):.3f}, "
                       f"original {min(started['original']):.3f})")
        if args.baseline_tree:
            b, cb = statistics.median(started["baseline"]), statistics.median(start_cpu["baseline"])
            start_line += (f"\n  {'baseline tree: start, CPU s':<32} {b:10.3f} {b / s_orig:6.2f}x "
                           f"{cb:10.3f} {cb / c_orig:6.2f}x   (wall min {min(started['baseline']):.3f}, "
                           f"CPU min {min(start_cpu['baseline']):.3f}; {args.baseline_tree})")
        if args.minutes <= 0:
            print(start_line.replace("\n  ", "\n").strip())
            print(f"target: start to connected <= the original's: {'met' if s_this <= s_orig else 'MISSED'}")
            return
        agents = [make_agent("this", backend, root, 100, exes, trace=True),
                  make_agent("this", backend, root, 101, exes, trace=True, name="this, push"),
                  make_agent("original", backend, root, 102, exes, trace=True)]
        live += agents
        nodes = {a.name: wait_connected(backend, a)[0] for a in agents}
        pushed = prove_push(backend, agents[1], nodes["this, push"])
        backend.post(f"/dev/nodes/{nodes['original']}/commands", {"command_type": "refresh_inventory"})
        time.sleep(args.warmup)
        for a in agents:
            if a.proc.poll() is not None:
                sys.exit(f"the {a.name} agent exited during the warm-up; see {a.log.name}")
        r = measure(backend, agents, nodes, args.minutes)
        names = [a.name for a in agents]
        orig = r["original"]

        def row(label: str, key: str, fmt: str) -> None:
            cells = []
            for name in names[:-1]:
                a, b = r[name][key], orig[key]
                ratio = f"{a / b:.2f}x" if b else ("=" if a == b else "n/a")
                cells.append(f"{a:{fmt}} {ratio:>7}")
            print(f"  {label:<32} " + " ".join(f"{c:>18}" for c in cells) + f" {orig[key]:{fmt}}")

        print(f"idle, side by side, {args.minutes:g} min window after {args.warmup:g} s warm-up; "
              f"stand-in backend (current generation), default settings, no engine, no GPU")
        if not pushed:
            print("  (the push-proven node did not see a push: its column polls like a fresh node)")
        print(f"  {'':<32} " + " ".join(f"{n + ' (ratio)':>18}" for n in names[:-1])
              + f" {args.original:>10}")
        print(start_line)
        row("RSS at end (MiB)", "rss", "10.1f")
        row("PSS at end (MiB)", "pss", "10.1f")
        row("CPU with children (s)", "cpu", "10.2f")
        row("threads at end", "threads", "10.0f")
        row("open fds at end", "fds", "10.0f")
        row("wake-ups/min, all threads", "wakeups", "10.1f")
        row("wake-ups/min, event loop", "reactor", "10.1f")
        row("threads started", "started", "10.0f")
        row("processes started", "spawned", "10.0f")
        row("frames/min to the backend", "frames", "10.1f")
        row("voluntary switches/min (live)", "voluntary", "10.1f")
        for name in names[:-1]:
            this = r[name]
            checks = [
                ("event-loop wake-ups <= 20/min", this["reactor"] <= 20),
                ("0 threads started", this["started"] == 0),
                ("CPU <= 0.5x the original", this["cpu"] <= 0.5 * orig["cpu"]),
                ("RSS <= 60 MiB", this["rss"] <= 60),
                ("start to connected <= the original's", s_this <= s_orig),
            ]
            print(f"targets ({name}): "
                  + "; ".join(f"{label}: {'met' if ok else 'MISSED'}" for label, ok in checks))
    finally:
        for a in live:
            a.stop()
        backend.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
