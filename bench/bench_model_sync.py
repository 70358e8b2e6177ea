#!/usr/bin/env python3
"""
Benchmark: air-gapped model sync over loopback (prints figures; asserts nothing).

For a generated model of ``--size-mb`` (one big weights blob plus small files), served by the
stand-in backend's model files resource in a separate process on 127.0.0.1, it measures per
run (``--repeat`` runs, median and spread printed):

 - baseline: ``curl`` downloading the big blob (same server, same run), MB/s;
 - a fresh ``ModelSyncer.sync`` of the whole model (manifest fetched, blobs streamed,
   hashed, renamed, snapshot linked), MB/s over the model's bytes;
 - reactor lateness during that sync: a ``--tick`` second LoopingCall (the heartbeat's
   shape) and a 10 ms probe, each measuring how late it ran (p99 and max, ms);
 - a repeat sync of the model already present (stat + record only), ms.

Usage::

    python3 bench/bench_model_sync.py                 # 1 GB, 3 runs
    python3 bench/bench_model_sync.py --size-mb 256 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL_ID = "bench-model"
REPO_ID = "bench/model"
BLOCK = 16 * 1024 * 1024


def generate_model(directory: str, size_mb: int) -> None:
    """A weights file of C{size_mb} MiB (random blocks) plus small config/tokenizer files."""
    os.makedirs(directory, exist_ok=True)
    block = os.urandom(BLOCK)
    remaining = size_mb * 1024 * 1024
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        i = 0
        while remaining > 0:
            n = min(BLOCK, remaining)
            # vary each block so no two blocks are identical
            f.write(i.to_bytes(8, "little") + block[8:n])
            remaining -= n
            i += 1
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "hidden_size": 4096}, f)
    with open(os.path.join(directory, "tokenizer.json"), "wb") as f:
        f.write(os.urandom(2 * 1024 * 1024))


def serve(model_dir: str) -> None:
    """Child process: serve the model on 127.0.0.1 until stdin closes."""
    from twisted.internet import reactor as _reactor
    from twisted.internet import stdio
    from twisted.internet.protocol import Protocol
    from twisted.web.resource import Resource
    from twisted.web.server import Site

    from llmport_agent.devbackend.modelfiles import ModelRepository, model_files_resource

    reactor: Any = _reactor
    token = os.environ["BENCH_TOKEN"].encode()
    repo = ModelRepository()
    manifest = repo.add_model_from_dir(MODEL_ID, REPO_ID, model_dir)
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
    big = max(manifest["blobs"], key=lambda b: b["size"])["hash"]
    sys.stdout.write(json.dumps({"port": port.getHost().port, "big": big}) + "\n")
    sys.stdout.flush()

    class StopOnEOF(Protocol):
        def connectionLost(self, reason: Any = None) -> None:
            reactor.stop()

    stdio.StandardIO(StopOnEOF())
    reactor.run()


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def spread(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med:10.1f}   ({min(values):.1f} .. {max(values):.1f})"


def line(label: str, value: str) -> None:
    print(f"  {label:<42}{value}")


async def run(reactor: Any, args: argparse.Namespace, work: str) -> None:
    from treq.client import HTTPClient
    from twisted.internet.defer import Deferred
    from twisted.internet.task import LoopingCall
    from twisted.web.client import Agent, HTTPConnectionPool

    from llmport_agent.models import ModelSyncer
    from llmport_agent.threads import PoolService

    model_dir = os.path.join(work, "source")
    print(f"generating a {args.size_mb} MiB model in {model_dir} ...", flush=True)
    generate_model(model_dir, args.size_mb)
    total = sum(os.path.getsize(os.path.join(model_dir, n)) for n in os.listdir(model_dir))
    token = secrets.token_urlsafe(24)
    server = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve", model_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=dict(os.environ, BENCH_TOKEN=token),
    )
    pool = PoolService(reactor, "bench-models", max(4, args.concurrency + 2))
    pool.startService()
    http_pool = HTTPConnectionPool(reactor, persistent=True)
    http_pool.maxPersistentPerHost = args.concurrency
    try:
        assert server.stdout is not None
        info = json.loads(await pool.run(server.stdout.readline))
        base = f"http://127.0.0.1:{info['port']}"
        blob_url = f"{base}/api/node-files/models/{MODEL_ID}/blob/{info['big']}"
        http = HTTPClient(Agent(reactor, pool=http_pool))
        curl = shutil.which("curl")
        figures: dict[str, list[float]] = {
            k: [] for k in ("curl", "sync", "hb99", "hbmax", "probe99", "probemax", "repeat")
        }
        for i in range(args.repeat):
            if curl:
                out = os.path.join(work, "curl.out")
                proc = await pool.run(
                    subprocess.run,
                    [
                        curl,
                        "-s",
                        "-f",
                        "-o",
                        out,
                        "-H",
                        f"Authorization: Bearer {token}",
                        "-w",
                        "%{time_total} %{size_download}",
                        blob_url,
                    ],
                    capture_output=True,
                    text=True,
                )
                t, size = proc.stdout.split()
                figures["curl"].append(float(size) / float(t) / 1e6)
                os.unlink(out)

            store = os.path.join(work, f"store-{i}")
            syncer = ModelSyncer(
                reactor,
                http,
                pool,
                store_dir=store,
                backend_url=base,
                credential=lambda: token,
                concurrency=args.concurrency,
            )
            hb: list[float] = []
            probe: list[float] = []

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

            loops = [ticker(args.tick, hb), ticker(0.01, probe)]
            started = reactor.seconds()
            try:
                result = await Deferred.fromCoroutine(
                    syncer.sync(
                        {"model_id": MODEL_ID, "source": "sync_from_server"}, lambda *a, **k: None
                    )
                )
            finally:
                for loop in loops:
                    loop.stop()
            took = reactor.seconds() - started
            figures["sync"].append(total / took / 1e6)
            figures["hb99"].append(pct(hb, 99))
            figures["hbmax"].append(max(hb))
            figures["probe99"].append(pct(probe, 99))
            figures["probemax"].append(max(probe))
            assert result["fetched"]["bytes"] == total, result

            started = reactor.seconds()
            again = await Deferred.fromCoroutine(
                syncer.sync({"model_id": MODEL_ID}, lambda *a, **k: None)
            )
            figures["repeat"].append((reactor.seconds() - started) * 1000)
            assert again["fetched"]["count"] == 0 and again["verified"]["count"] == 0, again
            await pool.run(shutil.rmtree, store)
            print(
                f"run {i + 1}: sync {figures['sync'][-1]:.0f} MB/s"
                + (f", curl {figures['curl'][-1]:.0f} MB/s" if figures["curl"] else "")
                + f", heartbeat late p99 {figures['hb99'][-1]:.1f} ms ({len(hb)} ticks)"
                + f", 10ms-probe p99 {figures['probe99'][-1]:.1f} ms ({len(probe)} ticks)"
                + f", repeat sync {figures['repeat'][-1]:.1f} ms",
                flush=True,
            )

        print()
        print(
            f"model: {total / 1e6:.0f} MB ({args.size_mb} MiB weights + small files), "
            f"concurrency {args.concurrency}, {args.repeat} runs; median (min .. max)"
        )
        if figures["curl"]:
            line("curl download of the big blob, MB/s", spread(figures["curl"]))
        else:
            print("  curl download: curl not installed (apt-get install -y curl)")
        line("ModelSyncer fresh sync, MB/s", spread(figures["sync"]))
        if figures["curl"]:
            ratios = [s / c for s, c in zip(figures["sync"], figures["curl"], strict=True)]
            line("sync / curl (median)", f"{statistics.median(ratios):10.2f}")
        line(f"heartbeat ({args.tick:g} s) lateness p99, ms", spread(figures["hb99"]))
        line("heartbeat lateness max, ms", spread(figures["hbmax"]))
        line("10 ms probe lateness p99, ms", spread(figures["probe99"]))
        line("10 ms probe lateness max, ms", spread(figures["probemax"]))
        line("repeat sync (model present), ms", spread(figures["repeat"]))
    finally:
        await http_pool.closeCachedConnections()
        await pool.stopService()
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=int, default=1024, help="size of the weights blob (MiB)")
    parser.add_argument("--repeat", type=int, default=3, help="runs (median and spread printed)")
    parser.add_argument("--concurrency", type=int, default=4, help="blobs downloaded at once")
    parser.add_argument(
        "--tick", type=float, default=1.0, help="heartbeat LoopingCall interval (s)"
    )
    parser.add_argument("--workdir", default=None, help="where to put the model and the store")
    parser.add_argument("--serve", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return

    from twisted.internet.defer import Deferred
    from twisted.internet.task import react

    work = tempfile.mkdtemp(prefix="bench-model-sync-", dir=args.workdir)
    try:
        react(lambda reactor: Deferred.fromCoroutine(run(reactor, args, work)))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
