#!/usr/bin/env python3
"""
Benchmark: air-gapped model sync over loopback (prints figures; asserts nothing).

One stand-in backend process on 127.0.0.1 serves generated models: one big blob per
``--sizes`` entry (MiB), a model of ``--shards`` blobs of ``--shards-mb`` MiB in all, and a
model of many small files. Every sync runs in its own client process, so the agent's code
at another tree (``--baseline-tree``, e.g. a ``git worktree`` of main) is measured in the
same run, through the same harness, against the same server. Per run and size:

 - ``curl`` writing the blob to a file beside the store, MB/s (the plain-download limit);
 - sha256 of the same bytes (read from the page cache in 8 MiB blocks), MB/s (one blob's
   hash is sequential: the agent's limit for one blob);
 - ``ModelSyncer.sync`` of a fresh store, MB/s, for each ``--connections`` setting (1 = one
   stream per blob; N = N ranged connections per large blob), and for the baseline tree;
 - sync / min(curl, sha256) (the issue's target is >= 0.8);
 - heartbeat lateness meanwhile: a 1 s LoopingCall (the heartbeat's shape) and a 10 ms
   probe in the client process, p99 (ms);
 - CPU seconds per GiB of the client (reactor thread and worker threads), of the server,
   and of curl (with the server's share while curl ran): on a loaded machine these say
   more than wall-clock rates;
 - the load average around each measurement;
 - a SUMMARY line per setting: the median of the runs' sync / min(curl, sha256) and the
   CPU seconds per GiB of the agent and of curl.

``--rate-mbps N`` makes the server limit each response to N MB/s (a link or proxy that
limits each connection): where ranged connections are meant to help.

Usage::

    python3 bench/bench_model_sync.py                                  # 1 GiB and 4 GiB, 5 runs
    python3 bench/bench_model_sync.py --sizes 1024 --shards 0 --connections 0   # the issue's figure
    python3 bench/bench_model_sync.py --write-sizes 2048,1024,512,256 --repeat 8  # page-cache writes
    python3 bench/bench_model_sync.py --page-cache 4 --repeat 3   # pages dropped behind or kept
    git worktree add --detach /tmp/main-tree main
    python3 bench/bench_model_sync.py --baseline-tree /tmp/main-tree --sizes 1024
    python3 bench/bench_model_sync.py --sizes 1024 --rate-mbps 200 --connections 1,4
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 16 * 1024 * 1024


# --- models -----------------------------------------------------------------------------


def write_random(path: str, size: int, seed: int) -> None:
    """C{size} bytes of pseudo-random blocks (no two blocks alike)."""
    block = os.urandom(BLOCK)
    with open(path, "wb") as f:
        i = 0
        left = size
        while left > 0:
            n = min(BLOCK, left)
            f.write((seed * 1_000_003 + i).to_bytes(8, "little") + block[8:n])
            left -= n
            i += 1


def generate(work: str, args: argparse.Namespace) -> dict[str, str]:
    """The model directories to serve: {model_id: directory}."""
    models: dict[str, str] = {}
    for size_mb in args.sizes:
        d = os.path.join(work, "src", f"big-{size_mb}")
        os.makedirs(d)
        write_random(os.path.join(d, "model.safetensors"), size_mb * 1024 * 1024, size_mb)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({"model_type": "llama", "hidden_size": 4096}, f)
        models[f"big-{size_mb}"] = d
    if args.shards:
        d = os.path.join(work, "src", "shards")
        os.makedirs(d)
        each = args.shards_mb * 1024 * 1024 // args.shards
        for i in range(args.shards):
            write_random(os.path.join(d, f"model-{i:05d}.safetensors"), each, 100 + i)
        models["shards"] = d
    if args.small_files:
        d = os.path.join(work, "src", "small")
        os.makedirs(os.path.join(d, "a", "b"))
        for i in range(args.small_files):
            sub = ("", "a", os.path.join("a", "b"))[i % 3]
            with open(os.path.join(d, sub, f"f{i:05d}.json"), "wb") as f:
                f.write(os.urandom(4096))
        models["small"] = d
    return models


# --- the server (child process) ---------------------------------------------------------


def serve(spec: str) -> None:
    """Serve the models of C{spec} (JSON {model_id: dir}) on 127.0.0.1 until stdin closes."""
    sys.path.insert(0, HERE)
    from twisted.internet import reactor as _reactor
    from twisted.internet import stdio
    from twisted.internet.protocol import Protocol
    from twisted.web.resource import Resource
    from twisted.web.server import Site

    from llmport_agent.devbackend.modelfiles import ModelRepository, model_files_resource

    reactor: Any = _reactor
    token = os.environ["BENCH_TOKEN"].encode()
    repo = ModelRepository()
    repo.faults.rate_limit = int(float(os.environ.get("BENCH_RATE_MBPS", "0")) * 1e6)
    blobs: dict[str, list[dict[str, Any]]] = {}
    for model_id, directory in json.loads(spec).items():
        manifest = repo.add_model_from_dir(model_id, f"bench/{model_id}", directory)
        blobs[model_id] = sorted(manifest["blobs"], key=lambda b: -b["size"])
    root = Resource()
    api = Resource()
    node_files = Resource()
    root.putChild(b"api", api)
    api.putChild(b"node-files", node_files)
    node_files.putChild(
        b"models",
        model_files_resource(repo, lambda r: r.getHeader(b"authorization") == b"Bearer " + token),  # type: ignore[arg-type]
    )
    site = Site(root)
    site.log = lambda request: None  # type: ignore[method-assign]
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    sys.stdout.write(json.dumps({"port": port.getHost().port, "blobs": blobs}) + "\n")
    sys.stdout.flush()

    class StopOnEOF(Protocol):
        def dataReceived(self, data: bytes) -> None:
            if data.strip() == b"cpu":
                t = os.times()
                sys.stdout.write(json.dumps({"cpu": t.user + t.system}) + "\n")
                sys.stdout.flush()

        def connectionLost(self, reason: Any = None) -> None:
            reactor.stop()

    stdio.StandardIO(StopOnEOF())
    reactor.run()


# --- one sync (child process) -------------------------------------------------------------


def _thread_cpu() -> dict[str, float]:
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[tid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def client(cfg: dict[str, Any]) -> None:
    """Run one fresh sync with the ModelSyncer of C{cfg['tree']}; print JSON figures."""
    sys.path.insert(0, cfg["tree"])
    from treq.client import HTTPClient
    from twisted.internet import reactor as _reactor
    from twisted.internet.defer import Deferred
    from twisted.internet.task import LoopingCall, react
    from twisted.web.client import Agent, HTTPConnectionPool

    from llmport_agent.core.threads import PoolService
    from llmport_agent.models import ModelSyncer

    reactor: Any = _reactor
    out: dict[str, Any] = {}
    trace: list[str] = []
    if cfg.get("trace"):
        from twisted.logger import formatEvent, globalLogPublisher

        t_start = time.perf_counter()

        def scaler_events(event: dict[str, Any]) -> None:
            fmt = event.get("log_format") or ""
            if "connections" in fmt and "last window" in fmt:
                trace.append(f"{time.perf_counter() - t_start:6.2f}s {formatEvent(event)}")

        globalLogPublisher.addObserver(scaler_events)  # type: ignore[arg-type]

    async def main(reactor: Any) -> None:
        concurrency = cfg["concurrency"]
        connections = cfg["connections"]
        pool = PoolService(reactor, "bench-files", 2 * concurrency + 1)
        pool.startService()
        http_pool = HTTPConnectionPool(reactor, persistent=True)
        http_pool.maxPersistentPerHost = concurrency * (connections or 4) + 2
        try:
            from llmport_agent.session.endpoints import backend_agent
            from llmport_agent.session.tls import https_policy

            agent = backend_agent(reactor, https_policy(True, None), http_pool)
        except ImportError:  # an older tree: the plain Agent
            agent = Agent(reactor, pool=http_pool)
        kwargs: dict[str, Any] = {"concurrency": concurrency}
        params = inspect.signature(ModelSyncer).parameters
        for name in ("connections", "segment_size"):
            if name in params:
                kwargs[name] = cfg[name]
        syncer = ModelSyncer(
            reactor,
            HTTPClient(agent),
            pool,
            store_dir=cfg["store"],
            backend_url=cfg["url"],
            credential=lambda: cfg["token"],
            **kwargs,
        )
        late: dict[str, list[float]] = {"hb": [], "probe": []}

        def ticker(interval: float, into: list[float]) -> LoopingCall:
            expected = [reactor.seconds()]

            def tick() -> None:
                now = reactor.seconds()
                into.append(max(0.0, now - expected[0]) * 1000)
                expected[0] = now + interval

            loop = LoopingCall(tick)
            loop.clock = reactor
            loop.start(interval, now=True)
            return loop

        loops = [ticker(1.0, late["hb"]), ticker(0.01, late["probe"])]
        cpu0 = _thread_cpu()
        started = time.perf_counter()
        try:
            result = await Deferred.fromCoroutine(
                syncer.sync({"model_id": cfg["model_id"], "source": "sync_from_server"},
                            lambda *a, **k: None)
            )
        finally:
            for loop in loops:
                loop.stop()
        took = time.perf_counter() - started
        cpu1 = _thread_cpu()
        main_tid = str(os.getpid())
        reactor_cpu = cpu1.get(main_tid, 0) - cpu0.get(main_tid, 0)
        workers = sum(v - cpu0.get(t, 0) for t, v in cpu1.items() if t != main_tid)
        out.update(
            seconds=took,
            bytes=result["fetched"]["bytes"],
            connections_used=result.get("connections_used", 1),
            hb99=pct(late["hb"], 99),
            probe99=pct(late["probe"], 99),
            probemax=max(late["probe"]),
            cpu_reactor=reactor_cpu,
            cpu_workers=workers,
            trace=trace,
        )
        started = time.perf_counter()
        again = await Deferred.fromCoroutine(
            syncer.sync({"model_id": cfg["model_id"]}, lambda *a, **k: None)
        )
        out["repeat_ms"] = (time.perf_counter() - started) * 1000
        assert again["fetched"]["count"] == 0, again
        await http_pool.closeCachedConnections()
        await pool.stopService()

    del reactor
    try:
        react(lambda r: Deferred.fromCoroutine(main(r)))
    finally:
        sys.stdout.write("RESULT " + json.dumps(out) + "\n")


# --- page-cache writes by write size --------------------------------------------------------


def write_sizes(work: str, repeat: int, sizes_kib: list[int]) -> None:
    """
    CPU seconds per GiB written into a preallocated file as the agent's writer does it
    (pwritev at offsets, writeback started behind each 2 MiB, one fsync), by write size;
    interleaved runs, median and spread.
    """
    sys.path.insert(0, HERE)
    from llmport_agent.models import _fs

    data = os.urandom(2 * 1024 * 1024)
    view = memoryview(data)
    path = os.path.join(work, "writes.bin")
    cpu: dict[int, list[float]] = {k: [] for k in sizes_kib}
    for _ in range(repeat):
        for kib in sizes_kib:
            step = kib * 1024
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, 1 << 30)
                t0 = os.times()
                for off in range(0, 1 << 30, len(data)):
                    for s in range(0, len(data), step):
                        os.pwritev(fd, [view[s:s + step]], off + s)
                    _fs.start_writeback(fd, off, len(data))
                os.fsync(fd)
                t1 = os.times()
            finally:
                os.close(fd)
                os.unlink(path)
            cpu[kib].append(t1.user - t0.user + t1.system - t0.system)
    print(f"page-cache writes of 1 GiB, {repeat} runs each: CPU s/GiB by write size, "
          "median (min .. max)")
    for kib in sizes_kib:
        print(f"  {f'{kib} KiB writes':<46}{spread(cpu[kib], '{:8.2f}')}")
    print(f"  (the agent writes {_fs.WRITE_SIZE // 1024} KiB at a time)", flush=True)


def page_cache(work: str, gib: int, repeat: int) -> None:
    """
    CPU seconds for each GiB of one C{gib} GiB part file written as the agent's writer does
    it (L{_fs.write_batch}: 256 KiB writes, writeback started per 2 MiB batch), with the
    written pages dropped 32 MiB behind the writes (the agent) and kept (as before): the cost
    of a page cache that grows by the whole blob. Alternating runs.
    """
    sys.path.insert(0, HERE)
    from llmport_agent.models import _fs

    batch = [os.urandom(1024 * 1024), os.urandom(1024 * 1024)]
    size = sum(len(c) for c in batch)
    path = os.path.join(work, "page-cache.bin")
    kept_limit = 1 << 62
    per_gib: dict[str, list[list[float]]] = {"dropped behind": [], "kept": []}
    walls: dict[str, list[float]] = {k: [] for k in per_gib}
    for _ in range(repeat):
        for label in per_gib:
            saved = _fs.DROP_BEHIND
            _fs.DROP_BEHIND = saved if label == "dropped behind" else kept_limit
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                part = _fs.PartFile(None, None, fd, True, [])  # type: ignore[arg-type]
                os.posix_fallocate(fd, 0, gib << 30)
                cpu: list[float] = []
                t0 = os.times()
                w0 = time.perf_counter()
                for off in range(0, gib << 30, size):
                    _fs.write_batch(part, off, batch)
                    if (off + size) % (1 << 30) == 0:
                        t1 = os.times()
                        cpu.append(t1.user - t0.user + t1.system - t0.system)
                        t0 = t1
                os.fsync(fd)
                walls[label].append(time.perf_counter() - w0)
            finally:
                _fs.DROP_BEHIND = saved
                os.close(fd)
                os.unlink(path)
            per_gib[label].append(cpu)
            time.sleep(3)  # let the freed pages go back to the host, as between syncs
    print(f"one {gib} GiB part file written as the agent's writer does, {repeat} runs each: "
          "CPU s per GiB written, GiB by GiB (median of the runs), and wall seconds")
    for label, runs in per_gib.items():
        cols = [statistics.median(r[i] for r in runs) for i in range(gib)]
        print(f"  {'pages ' + label:<30}" + " ".join(f"{c:6.2f}" for c in cols)
              + f"   total {sum(cols):.2f} CPU-s, {statistics.median(walls[label]):.2f} s")
    print(flush=True)


# --- measuring ----------------------------------------------------------------------------


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))]


def spread(values: list[float], fmt: str = "{:8.1f}") -> str:
    values = [v for v in values if v == v]
    if not values:
        return "       -"
    med = statistics.median(values)
    return fmt.format(med) + f"   ({min(values):.1f} .. {max(values):.1f})"


class Bench:
    def __init__(self, args: argparse.Namespace, work: str) -> None:
        self.args = args
        self.work = work
        self.token = secrets.token_urlsafe(24)
        self.models = generate(work, args)
        env = dict(os.environ, BENCH_TOKEN=self.token, BENCH_RATE_MBPS=str(args.rate_mbps))
        self.server = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", json.dumps(self.models)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self.server.stdout is not None
        info = json.loads(self.server.stdout.readline())
        self.url = f"http://127.0.0.1:{info['port']}"
        self.blobs: dict[str, list[dict[str, Any]]] = info["blobs"]

    def server_cpu(self) -> float:
        assert self.server.stdin is not None and self.server.stdout is not None
        self.server.stdin.write(b"cpu\n")
        self.server.stdin.flush()
        return float(json.loads(self.server.stdout.readline())["cpu"])

    def close(self) -> None:
        if self.server.stdin is not None:
            self.server.stdin.close()
        try:
            self.server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()

    def curl(self, model_id: str) -> tuple[float, float, float]:
        """curl of every blob of the model one after the other: (MB/s, CPU s, server CPU s)."""
        curl = shutil.which("curl")
        if curl is None:
            return float("nan"), float("nan"), float("nan")
        server0 = self.server_cpu()
        out = os.path.join(self.work, "curl.out")
        total = 0
        elapsed = 0.0
        before = os.times()
        for blob in self.blobs[model_id]:
            proc = subprocess.run(
                [curl, "-s", "-f", "-o", out, "-H", f"Authorization: Bearer {self.token}",
                 "-w", "%{time_total} %{size_download}",
                 f"{self.url}/api/node-files/models/{model_id}/blob/{blob['hash']}"],
                capture_output=True, text=True, check=True,
            )
            t, size = proc.stdout.split()
            elapsed += float(t)
            total += int(size)
            os.unlink(out)
        after = os.times()
        cpu = (after.children_user - before.children_user) + (
            after.children_system - before.children_system
        )
        return total / elapsed / 1e6, cpu, self.server_cpu() - server0

    def sha256(self, model_id: str) -> float:
        """sha256 of every blob's bytes (from the page cache), MB/s."""
        buf = bytearray(8 * 1024 * 1024)
        view = memoryview(buf)
        total = 0
        started = time.perf_counter()
        for dirpath, _dirs, names in os.walk(self.models[model_id]):
            for name in names:
                h = hashlib.sha256()
                with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                    while n := f.readinto(buf):
                        h.update(view[:n])
                        total += n
        return total / (time.perf_counter() - started) / 1e6

    def sync(self, model_id: str, tree: str, connections: int) -> dict[str, Any]:
        store = os.path.join(self.work, "store")
        shutil.rmtree(store, ignore_errors=True)
        cfg = {
            "tree": tree, "url": self.url, "token": self.token, "model_id": model_id,
            "store": store, "concurrency": self.args.concurrency, "connections": connections,
            "segment_size": self.args.segment_mb * 1024 * 1024, "trace": self.args.trace,
        }
        cpu0 = self.server_cpu()
        load0 = os.getloadavg()[0]
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--client", json.dumps(cfg)],
            capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=tree),
        )
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not line or line[0] == "RESULT {}":
            raise RuntimeError(f"sync client failed: {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
        out: dict[str, Any] = json.loads(line[0][7:])
        out["server_cpu"] = self.server_cpu() - cpu0
        out["load"] = (load0 + os.getloadavg()[0]) / 2
        shutil.rmtree(store, ignore_errors=True)
        return out


def report_model(b: Bench, model_id: str, label: str, trees: list[tuple[str, str, int]]) -> None:
    args = b.args
    size = sum(x["size"] for x in b.blobs[model_id])
    gib = size / 2**30
    curl: list[float] = []
    curl_cpu: list[float] = []
    curl_server_cpu: list[float] = []
    sha: list[float] = []
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in trees}
    for i in range(args.repeat):
        sha.append(b.sha256(model_id))
        c, cc, cs = b.curl(model_id)
        curl.append(c)
        curl_cpu.append(cc / gib)
        curl_server_cpu.append(cs / gib)
        line = f"  run {i + 1}: curl {c:.0f} MB/s, sha256 {sha[-1]:.0f} MB/s"
        for name, tree, connections in trees:
            r = b.sync(model_id, tree, connections)
            runs[name].append(r)
            line += (f", {name} {r['bytes'] / r['seconds'] / 1e6:.0f} MB/s"
                     f" [{r.get('connections_used', 1)} conn]")
            for event in r.get("trace", []):
                line += f"\n      {name}: {event}"
        print(line + f" (load {os.getloadavg()[0]:.1f})", flush=True)
    limit = [min(c, s) if c == c else s for c, s in zip(curl, sha, strict=True)]
    print(f"\n{label}: {size / 1e6:.0f} MB in {len(b.blobs[model_id])} blobs, "
          f"{args.repeat} runs; median (min .. max)")
    print(f"  {'curl to a file, MB/s':<46}{spread(curl)}")
    print(f"  {'  curl CPU s/GiB':<46}{spread(curl_cpu, '{:8.2f}')}")
    print(f"  {'  curl + server CPU s/GiB':<46}"
          f"{spread([c + s for c, s in zip(curl_cpu, curl_server_cpu, strict=True)], '{:8.2f}')}")
    print(f"  {'sha256 of the same bytes, MB/s':<46}{spread(sha)}")
    for name, _, _ in trees:
        rs = runs[name]
        mbps = [r["bytes"] / r["seconds"] / 1e6 for r in rs]
        print(f"  {name + ' sync, MB/s':<46}{spread(mbps)}")
        print(f"  {'  sync time, s':<46}{spread([r['seconds'] for r in rs], '{:8.2f}')}")
        ratio = [m / lim for m, lim in zip(mbps, limit, strict=True)]
        print(f"  {'  / min(curl, sha256)':<46}{spread(ratio, '{:8.2f}')}")
        print(f"  {'  heartbeat (1 s) lateness p99, ms':<46}{spread([r['hb99'] for r in rs])}")
        print(f"  {'  10 ms probe lateness p99, ms':<46}{spread([r['probe99'] for r in rs])}")
        print(f"  {'  10 ms probe lateness max, ms':<46}{spread([r['probemax'] for r in rs])}")
        print(f"  {'  CPU s/GiB reactor + workers + server':<46}"
              + "{:8.2f} + {:.2f} + {:.2f}".format(
                  statistics.median(r["cpu_reactor"] / gib for r in rs),
                  statistics.median(r["cpu_workers"] / gib for r in rs),
                  statistics.median(r["server_cpu"] / gib for r in rs)))
        agent_cpu = [(r["cpu_reactor"] + r["cpu_workers"]) / gib for r in rs]
        print(f"  {'  agent CPU s/GiB (vs curl above)':<46}{spread(agent_cpu, '{:8.2f}')}")
        print(f"  {'  agent + server CPU s/GiB':<46}"
              f"{spread([a + r['server_cpu'] / gib for a, r in zip(agent_cpu, rs, strict=True)], '{:8.2f}')}")
        print(f"  {'  repeat sync (model present), ms':<46}{spread([r['repeat_ms'] for r in rs])}")
        print(f"  {'  load average':<46}{spread([r['load'] for r in rs], '{:8.2f}')}")
    print()
    for name, _, _ in trees:
        rs = runs[name]
        ratio = [r["bytes"] / r["seconds"] / 1e6 / lim for r, lim in zip(rs, limit, strict=True)]
        agent_cpu = [(r["cpu_reactor"] + r["cpu_workers"]) / gib for r in rs]
        print(f"  SUMMARY {label}, {name}: {statistics.median(ratio):.2f}x min(curl, sha256) "
              f"(median of {len(rs)} runs, target >= 0.8); CPU s/GiB agent "
              f"{statistics.median(agent_cpu):.2f}, curl {statistics.median(curl_cpu):.2f}")
    print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1024,4096",
                        help="big-blob sizes in MiB, comma-separated")
    parser.add_argument("--size-mb", type=int, default=None,
                        help="one big-blob size in MiB (the earlier form of --sizes; no shards)")
    parser.add_argument("--shards", type=int, default=10, help="blobs of the many-blob model (0 = none)")
    parser.add_argument("--shards-mb", type=int, default=4096, help="MiB of the many-blob model in all")
    parser.add_argument("--small-files", type=int, default=0,
                        help="files of a many-small-files model (metadata cost), 0 = none")
    parser.add_argument("--repeat", type=int, default=5, help="runs (median and spread printed)")
    parser.add_argument("--concurrency", type=int, default=4, help="blobs downloaded at once")
    parser.add_argument("--connections", default="0,1,4",
                        help="MODEL_SYNC_CONNECTIONS settings to measure, comma-separated "
                             "(0 = auto)")
    parser.add_argument("--segment-mb", type=int, default=32, help="MiB per ranged request")
    parser.add_argument("--rate-mbps", type=float, default=0,
                        help="limit each server response to this many MB/s (0 = none)")
    parser.add_argument("--trace", action="store_true",
                        help="print the connection scaler's decisions of each sync (the rate, "
                             "this process's busy CPUs and the host's idle CPUs of the window "
                             "behind each)")
    parser.add_argument("--baseline-tree", default=None,
                        help="another checkout of the agent (e.g. a git worktree of main) to "
                             "measure in the same run")
    parser.add_argument("--workdir", default=None, help="where to put the models and the store")
    parser.add_argument("--write-sizes", default=None, metavar="KIB,...",
                        help="instead: CPU per GiB of page-cache writes by write size in KiB "
                             "(e.g. 2048,1024,512,256), --repeat runs each")
    parser.add_argument("--page-cache", type=int, default=None, metavar="GIB",
                        help="instead: CPU per GiB of one GIB GiB part file written with its "
                             "pages dropped behind the writes and kept, --repeat runs each")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    if args.client:
        client(json.loads(args.client))
        return
    if args.write_sizes:
        work = tempfile.mkdtemp(prefix="bench-write-sizes-", dir=args.workdir)
        try:
            write_sizes(work, args.repeat, [int(x) for x in args.write_sizes.split(",")])
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    if args.page_cache:
        work = tempfile.mkdtemp(prefix="bench-page-cache-", dir=args.workdir)
        try:
            page_cache(work, args.page_cache, args.repeat)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    if args.size_mb is not None:
        args.sizes, args.shards = str(args.size_mb), 0
    args.sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    connections = [int(x) for x in args.connections.split(",") if x.strip()]
    trees: list[tuple[str, str, int]] = [
        (f"agent ({c or 'auto'} conn)", HERE, c) for c in connections
    ]
    if args.baseline_tree:
        trees.append(("baseline tree", os.path.abspath(args.baseline_tree), 1))
    work = tempfile.mkdtemp(prefix="bench-model-sync-", dir=args.workdir)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"{os.cpu_count()} CPUs; per-connection limit: "
          f"{args.rate_mbps or 'none'} MB/s", flush=True)
    bench: Bench | None = None
    try:
        bench = Bench(args, work)
        for size_mb in args.sizes:
            report_model(bench, f"big-{size_mb}", f"one {size_mb} MiB blob", trees)
        if args.shards:
            report_model(bench, "shards", f"{args.shards}-blob model", trees)
        if args.small_files:
            report_model(bench, "small", f"{args.small_files} small files", trees)
    finally:
        if bench is not None:
            bench.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
