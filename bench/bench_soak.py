"""
Soak (issue 12, item 6): the agent as a real process for a long run, with a command every few
seconds and a log stream; are its RSS, open files and threads flat? Prints figures; asserts
nothing.

Processes on loopback: this script (the conductor), the stand-in backend
(`llmport-agent devbackend`), one agent (`llmport-agent run`, as bench_idle starts it), the Loki
stand-in of bench_loki (the agent ships its own log lines there, and its workload containers'
lines), and, when the Docker engine can be had (root, dockerd, busybox-static), the test engine
of tests/support/docker_env.py.

 - commands, one every `--interval` seconds, each issued after the previous one resolved, in a
   fixed cycle of cheap ones the agent answers without a GPU (refresh_inventory,
   collect_diagnostics, sync_node_profile, maintenance on then off, drain then resume, host_op,
   which is refused by design); with the engine, every `--docker-every`-th slot is a step of a
   busybox httpd runtime's life through the backend's runtime API: deploy, logs, stop, remove
   (a new runtime each cycle);
 - a log stream: with the engine, one workload printing `--log-rate` lines per second for the
   whole run, followed to Loki; always, the agent's own log lines (INFO) to Loki;
 - every `--sample-sec` seconds: the agent process's RSS, open file descriptors and threads
   (psutil); after `--warmup-minutes` a least-squares slope per hour of each, with its standard
   error, the first and last values and a verdict line against a threshold (`--rss-mb-per-hour`,
   `--fds-per-hour`, `--threads-per-hour`; the slope, not the noise, is what is judged);
 - commands issued / resolved (succeeded + failed; host_op fails by design), pickup-to-result
   time per kind, Loki lines by job, the backend's protocol anomalies for the node.

Usage: python3 bench/bench_soak.py [--minutes 60] [--interval 5] [--sample-sec 10]
       [--warmup-minutes 5] [--docker auto|yes|no] [--csv samples.csv]
       python3 bench/bench_soak.py --analyse samples.csv   (the slopes of a saved run)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from typing import Any

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench._common import AgentProcess, DevBackendProcess, free_port, percentile  # noqa: E402
from bench.bench_loki import Loki  # noqa: E402

TERMINAL = ("succeeded", "failed")
#: Commands that fail by design (a refusal is an answer).
EXPECTED_FAILURES = {"host_op"}
#: How long one command may take to resolve before the soak counts it unresolved and moves on.
RESOLVE_TIMEOUT = 120.0

#: The busybox httpd test workload (tests/support/rig.py), on the port the agent chose.
SERVE = "mkdir -p /www && echo ok > /www/health && exec httpd -f -p $LLM_PORT_LISTEN_PORT -h /www"


def chatty_script(rate: int) -> str:
    """A workload that prints C{rate} numbered lines a second and serves /health."""
    burst = "; ".join(['i=$((i+1)); echo "soak line $i"'] * max(1, rate))
    return f"i=0; (while true; do {burst}; sleep 1; done) & {SERVE}"


# -- fitting ---------------------------------------------------------------------------------------


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope of value over time (per unit of time) and its standard error."""
    n = len(points)
    if n < 2:
        return 0.0, math.inf
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    sxx = sum((t - mt) ** 2 for t, _ in points)
    if sxx == 0:
        return 0.0, math.inf
    slope = sum((t - mt) * (v - mv) for t, v in points) / sxx
    if n < 3:
        return slope, math.inf
    resid = sum((v - (mv + slope * (t - mt))) ** 2 for t, v in points)
    return slope, math.sqrt(resid / (n - 2) / sxx)


def verdict(slope: float, threshold: float) -> str:
    if abs(slope) <= threshold:
        return "FLAT"
    return "GROWING" if slope > 0 else "FALLING"


# -- the Loki stand-in ------------------------------------------------------------------------------


def LokiProcess() -> Loki:
    """bench_loki's Loki stand-in (FakeLoki with counters) in a child process, its output dropped."""
    return Loki(quiet=True)


# -- the command cycle ------------------------------------------------------------------------------


class Conductor:
    """Issues the commands, one at a time, and records how each ended."""

    def __init__(self, backend: DevBackendProcess, node_id: str, docker: bool, docker_every: int) -> None:
        self.backend = backend
        self.node_id = node_id
        self.docker = docker
        self.docker_every = max(1, docker_every)
        self.issued: list[dict[str, Any]] = []  # {"id", "type", "issued_at", "status", "took"}
        self.pending: dict[str, Any] | None = None
        self._cheap = self._cheap_cycle()
        self._docker = self._docker_cycle()
        self._slot = 0
        self.runtimes_deployed = 0
        self.runtimes_removed = 0
        self._mode_on = False  # maintenance or draining: a deploy now would be refused

    def node_command(self, command_type: str, payload: dict[str, Any]) -> dict[str, Any]:
        return dict(self.backend.post(f"/dev/nodes/{self.node_id}/commands",
                                      {"command_type": command_type, "payload": payload}))

    def create_runtime(self, name: str, script: str) -> dict[str, Any]:
        from tests.support.docker_env import BUSYBOX

        provider = {"type": "llamacpp", "image": BUSYBOX, "command": ["sh", "-c", script],
                    "container_port": str(free_port())}
        return dict(self.backend.post("/dev/runtimes", {"node_id": self.node_id, "name": name, "provider": provider}))

    def runtime_action(self, runtime_id: str, action: str) -> dict[str, Any]:
        return dict(self.backend.post(f"/dev/runtimes/{runtime_id}/{action}", {}))

    def _cheap_cycle(self) -> Iterator[tuple[str, dict[str, Any]]]:
        n = 0
        while True:
            n += 1
            yield "refresh_inventory", {}
            yield "collect_diagnostics", {}
            yield "sync_node_profile", {"profile": {"id": f"soak-{n % 3}", "name": "soak profile",
                                                    "settings": {"round": n, "tags": ["a", "b"]}}}
            yield "set_maintenance_mode", {"enabled": True}
            yield "set_maintenance_mode", {"enabled": False}
            yield "refresh_inventory", {}
            yield "drain_node", {}
            yield "resume_node", {}
            yield "host_op", {"op": "reboot"}

    def _docker_cycle(self) -> Iterator[tuple[str, str]]:
        n = 0
        while True:
            n += 1
            yield "deploy", f"soak-{n}"
            yield "logs", ""
            yield "stop", ""
            yield "remove", ""

    def issue_next(self) -> None:
        self._slot += 1
        if self.docker and self._slot % self.docker_every == 0 and not self._mode_on:
            step, name = next(self._docker)
            if step == "deploy":
                cmd = self.create_runtime(name, SERVE)
                self._runtime = cmd["payload"]["runtime_id"]
                self.runtimes_deployed += 1
            else:
                cmd = self.runtime_action(self._runtime, step)
                self.runtimes_removed += step == "remove"
        else:
            command_type, payload = next(self._cheap)
            if command_type in ("set_maintenance_mode", "drain_node", "resume_node"):
                self._mode_on = command_type == "drain_node" or bool(payload.get("enabled"))
            cmd = self.node_command(command_type, payload)
        self.track(cmd)

    def track(self, cmd: dict[str, Any]) -> None:
        self.pending = {"id": cmd["id"], "type": cmd["command_type"], "issued_at": time.monotonic(),
                        "status": cmd["status"], "took": None, "error": None}
        self.issued.append(self.pending)

    def poll(self) -> bool:
        """Check the pending command; True when there is none left (resolved or given up)."""
        if self.pending is None:
            return True
        rec = self.backend.get(f"/dev/commands/{self.pending['id']}")
        self.pending["status"] = rec["status"]
        if rec["status"] in TERMINAL:
            self.pending["took"] = time.monotonic() - self.pending["issued_at"]
            self.pending["error"] = rec.get("error_code")
            self.pending = None
            return True
        if time.monotonic() - self.pending["issued_at"] > RESOLVE_TIMEOUT:
            self.pending = None  # counted unresolved; re-checked at the end
            return True
        return False

    def recheck(self) -> None:
        for c in self.issued:
            if c["status"] not in TERMINAL:
                rec = self.backend.get(f"/dev/commands/{c['id']}")
                c["status"], c["error"] = rec["status"], rec.get("error_code")

    def wait_resolved(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.poll() and time.monotonic() < deadline:
            time.sleep(0.5)


# -- sampling ---------------------------------------------------------------------------------------


def sample(proc: psutil.Process) -> tuple[float, int, int, float]:
    """RSS (MB), open file descriptors, threads, CPU seconds of the agent process."""
    with proc.oneshot():
        cpu = proc.cpu_times()
        return proc.memory_info().rss / 1e6, proc.num_fds(), proc.num_threads(), cpu.user + cpu.system


def prefill_journal(state_dir: str, count: int) -> int:
    """
    Write C{count} delivered records into the agent's command journal before it starts (as a
    node that has answered commands for a while has): the journal holds delivered records up
    to its bound (5000 by default), so a fresh agent's memory grows by design until then; with
    the journal full from the start, each new record makes it drop its oldest, and a slope is
    the agent's own. Returns the journal's record bound.
    """
    import uuid

    from attrs import fields

    from llmport_agent.commands.journal import DELIVERED, CommandJournal, JournalRecord

    now = time.time()
    with open(os.path.join(state_dir, "commands.jsonl"), "w") as f:
        os.fchmod(f.fileno(), 0o600)
        for i in range(count):
            cid = str(uuid.uuid4())
            frame = {"type": "command_result", "command_id": cid, "correlation_id": cid, "success": True,
                     "result": {"inventory_sent": True}, "error_code": None, "error_message": None}
            rec = JournalRecord(id=cid, command_type="refresh_inventory", correlation_id=cid, state=DELIVERED,
                                received_at=now - 3600 - count + i, finished_at=now - 3600 - count + i + 0.5,
                                acked=True, result_frame=frame)
            f.write(json.dumps(rec.as_dict()) + "\n")
    return int(fields(CommandJournal).max_records.default or 0)


def wait_node(backend: DevBackendProcess, agent_id: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for n in backend.get("/dev/nodes"):
            if n["agent_id"] == agent_id and n["status"] not in ("offline", "unknown", ""):
                return str(n["id"])
        time.sleep(0.2)
    raise RuntimeError(f"the agent {agent_id} did not come online within {timeout:.0f} s")


def start_docker(mode: str) -> Any:
    if mode == "no":
        return None
    try:
        from tests.support.docker_env import require_docker

        return require_docker()
    except Exception as exc:  # SkipTest or a failure: say why
        if mode == "yes":
            raise
        print(f"Docker test engine unavailable ({exc}); commands and logs without workloads", flush=True)
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0, help="length of the soak (after the agent is up)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between commands")
    p.add_argument("--sample-sec", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--warmup-minutes", type=float, default=5.0,
                   help="samples before this are not fitted (capped at a quarter of the run)")
    p.add_argument("--docker", choices=["auto", "yes", "no"], default="auto")
    p.add_argument("--docker-every", type=int, default=3, help="every Nth command is a workload step")
    p.add_argument("--log-rate", type=int, default=2, help="lines per second of the chatty workload")
    p.add_argument("--rss-mb-per-hour", type=float, default=1.0)
    p.add_argument("--fds-per-hour", type=float, default=2.0)
    p.add_argument("--threads-per-hour", type=float, default=2.0)
    p.add_argument("--prefill-journal", type=int, default=5000,
                   help="delivered records written into the agent's command journal before it starts "
                        "(5000, its bound: memory a fresh agent grows by design is not in the slope; 0: fresh)")
    p.add_argument("--csv", help="write every sample here (t_s,rss_mb,fds,threads,cpu_s)")
    p.add_argument("--analyse", metavar="CSV", help="print the slopes of a saved --csv file (no run)")
    args = p.parse_args(argv)
    if args.analyse:
        saved = read_csv(args.analyse)
        print_slopes(args, saved, saved[-1][0] if saved else 0.0)
        return 0

    def stop_on_term(signum: int, frame: Any) -> None:  # SIGTERM: clean up as for Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop_on_term)
    tmp = tempfile.mkdtemp(prefix="bench-soak-")
    env = start_docker(args.docker)
    if env is not None:
        os.environ["DOCKER_HOST"] = env.host
    else:
        os.environ["DOCKER_HOST"] = "unix:///nonexistent/bench-soak/docker.sock"
    backend = DevBackendProcess(log_path=os.path.join(tmp, "devbackend.log"))
    loki = LokiProcess()
    agent_env = {"LOKI_URL": loki.url, "LOG_LEVEL": "INFO"}
    if env is not None:
        agent_env.update(WORKLOAD_NETWORK="host", READINESS_TIMEOUT_SEC="30", STOP_GRACE_SEC="1")
    bound = prefill_journal(tmp, args.prefill_journal) if args.prefill_journal > 0 else None
    agent = AgentProcess(backend.url, backend.token(), tmp, "soak", **agent_env)
    samples: list[Sample] = []
    code = 0
    try:
        node_id = wait_node(backend, "soak")
        proc = psutil.Process(agent.proc.pid)
        conductor = Conductor(backend, node_id, env is not None, args.docker_every)
        chatty = None
        if env is not None:
            cmd = conductor.create_runtime("soak-chatty", chatty_script(args.log_rate))
            chatty = cmd["payload"]["runtime_id"]
            conductor.track(cmd)
            conductor.wait_resolved(RESOLVE_TIMEOUT)
        print(f"bench_soak: {args.minutes:g} min, a command every {args.interval:g} s, a sample every "
              f"{args.sample_sec:g} s; Docker engine: {'yes' if env is not None else 'no'}; "
              f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}", flush=True)
        print(f"command journal: {args.prefill_journal} delivered records written before the start"
              + (f" (its bound is {bound})" if bound is not None else " (a fresh agent: the journal "
                 "grows by design up to its bound, in the slope)"), flush=True)
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        next_sample = t0
        next_command = t0
        next_report = t0 + 300
        next_poll = t0
        csv = open(args.csv, "w", buffering=1) if args.csv else None  # noqa: SIM115
        if csv is not None:
            csv.write("t_s,rss_mb,fds,threads,cpu_s\n")
        while True:
            now = time.monotonic()
            if now >= next_sample:
                samples.append((now - t0, *sample(proc)))
                next_sample += args.sample_sec
                if csv is not None:
                    s = samples[-1]
                    csv.write(f"{s[0]:.1f},{s[1]:.2f},{s[2]},{s[3]},{s[4]:.2f}\n")
            if now >= end:
                break
            if now >= next_poll:
                next_poll = now + 0.5
                if conductor.poll() and now >= next_command:
                    conductor.issue_next()
                    next_command = now + args.interval
            if now >= next_report:
                s = samples[-1]
                print(f"  {s[0] / 60:5.1f} min: RSS {s[1]:.1f} MB, fds {s[2]}, threads {s[3]}, "
                      f"commands {len(conductor.issued)}", flush=True)
                next_report += 300
            if agent.proc.poll() is not None:
                raise RuntimeError(f"the agent exited with {agent.proc.returncode}; see {agent.log_path}")
            time.sleep(max(0.0, min(next_sample, next_poll, end) - time.monotonic()))
        elapsed = time.monotonic() - t0
        conductor.wait_resolved(RESOLVE_TIMEOUT)
        conductor.recheck()
        time.sleep(2)  # the last log lines reach Loki (flush interval <= 1 s)
        loki_stats = loki.stats()
        anomalies = backend.get(f"/dev/nodes/{node_id}/anomalies")
        report(args, samples, elapsed, conductor, loki_stats, anomalies)
        if chatty is not None:
            conductor.track(conductor.runtime_action(chatty, "remove"))
            conductor.wait_resolved(60)
        if csv is not None:
            csv.close()
    except Exception as exc:  # one line, and the agent's log tail, then clean up
        print(f"bench_soak failed: {exc}", flush=True)
        traceback.print_exc()
        code = 1
    finally:
        rc = agent.stop()
        loki.stop()
        backend.stop()
        if env is not None:
            env.remove_all_containers()
        if code:
            with open(agent.log_path, "rb") as f:
                print(f.read()[-3000:].decode("utf-8", "replace"))
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"agent exit status after SIGTERM: {rc}")
    return code


Sample = tuple[float, float, int, int, float]


def print_slopes(args: argparse.Namespace, samples: list[Sample], elapsed: float) -> None:
    """The samples line, a slope and a verdict per metric, and the CPU after the warm-up."""
    warmup = min(args.warmup_minutes * 60, elapsed / 4)
    fitted = [s for s in samples if s[0] >= warmup]
    print(f"\nsamples: {len(samples)} in {elapsed / 60:.1f} min; {len(fitted)} fitted after a "
          f"{warmup / 60:.1f} min warm-up")
    metrics = [("RSS", 1, "MB", args.rss_mb_per_hour, 1), ("open fds", 2, "", args.fds_per_hour, 0),
               ("threads", 3, "", args.threads_per_hour, 0)]
    for name, i, unit, threshold, digits in metrics:
        pts = [(s[0] / 3600, float(s[i])) for s in fitted]
        if not pts:
            print(f"{name}: no samples after the warm-up")
            continue
        slope, err = fit(pts)
        late, _ = fit(pts[len(pts) // 2:])
        vals = [v for _, v in pts]
        u = f" {unit}" if unit else ""
        print(f"{name:9s} start {vals[0]:.{digits}f}{u}, end {vals[-1]:.{digits}f}{u}, "
              f"min {min(vals):.{digits}f}, max {max(vals):.{digits}f}; slope {slope:+.3f}{u}/h "
              f"(± {err:.3f}; second half {late:+.3f}{u}/h)")
        print(f"  verdict: {name} {verdict(slope, threshold)} (threshold |slope| <= {threshold:g}{u}/h)")
    if len(fitted) >= 2:
        cpu = 100 * (fitted[-1][4] - fitted[0][4]) / max(1e-9, fitted[-1][0] - fitted[0][0])
        print(f"CPU after the warm-up: {cpu:.2f} % of one core")


def read_csv(path: str) -> list[Sample]:
    with open(path) as f:
        rows = [line.strip().split(",") for line in f.readlines()[1:] if line.strip()]
    return [(float(r[0]), float(r[1]), int(r[2]), int(r[3]), float(r[4])) for r in rows]


def report(args: argparse.Namespace, samples: list[Sample], elapsed: float,
           conductor: Conductor, loki_stats: dict[str, Any], anomalies: list[str]) -> None:
    print_slopes(args, samples, elapsed)
    issued = conductor.issued
    resolved = [c for c in issued if c["status"] in TERMINAL]
    failed = [c for c in resolved if c["status"] == "failed"]
    unexpected = [c for c in failed if c["type"] not in EXPECTED_FAILURES]
    print(f"commands issued {len(issued)}, resolved {len(resolved)} "
          f"(succeeded {len(resolved) - len(failed)}, failed {len(failed)}: "
          f"{len(failed) - len(unexpected)} host_op refusals by design, {len(unexpected)} unexpected)")
    for c in unexpected[:5]:
        print(f"  unexpected failure: {c['type']} {c['id']} {c['error']}")
    kinds: dict[str, list[float]] = {}
    for c in resolved:
        if c["took"] is not None:
            kinds.setdefault(c["type"], []).append(c["took"])
    for kind, took in sorted(kinds.items()):
        print(f"  {kind:22s} n={len(took):4d}  issue -> result p50 {percentile(took, 0.5):.2f} s, "
              f"p95 {percentile(took, 0.95):.2f} s")
    print(f"workload runtimes deployed {conductor.runtimes_deployed}, removed {conductor.runtimes_removed} "
          f"(besides the chatty one, which runs throughout)")
    by_job = loki_stats.get("by_job", {})
    print(f"Loki lines received: {loki_stats.get('lines', 0)} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(by_job.items())) or 'none'}); "
          f"violations {len(loki_stats.get('violations', []))}")
    print(f"protocol anomalies at the backend: {len(anomalies)}")
    for a in anomalies[:5]:
        print(f"  {a}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
