"""
Peer image seeding benchmark (issue 19): throughput of the agent's peer download of a runtime
image tar (C{ensure_runtime_image} with C{source.peer_url}: Range-resumable HTTP into
C{IMAGE_DOWNLOAD_DIR}, writes on the thread pool) against C{curl} downloading the same tar
from the same seeder to a file, in one run, alternating. Prints figures; asserts nothing.

The seeder is the agent's C{serve_runtime_image} on 127.0.0.2, serving a busybox-based image
with one extra layer of C{--mb} MiB on a private Docker engine (started like the tests do;
needs root). The engine load is not timed (it is the engine's own work either way).

Usage: python3 bench/bench_seed.py [--mb 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twisted.internet.defer import Deferred, ensureDeferred  # noqa: E402
from twisted.internet.task import react  # noqa: E402
from twisted.internet.threads import deferToThread  # noqa: E402

from bench._common import free_port  # noqa: E402
from llmport_agent.ray import imagepin  # noqa: E402
from llmport_agent.ray.handlers import RayManager, RaySettings  # noqa: E402
from llmport_agent.ray.seeding import ImageSeeding, seeding_handler_specs  # noqa: E402
from llmport_agent.workloads.engine import DockerEngine  # noqa: E402
from llmport_agent.workloads.policy import parse_allowlist  # noqa: E402
from tests.support.context import RecordingContext, make_command  # noqa: E402
from tests.support.docker_env import BUSYBOX, require_docker  # noqa: E402

TAG = "llmport-bench/seed-runtime:1"
TOKEN = "bench-seed-token-0123456789"


class Pool:
    def run(self, fn: Any, *args: Any, **kw: Any) -> Deferred[Any]:
        return deferToThread(fn, *args, **kw)


def make_image(client: Any, mib: int) -> Any:
    c = client.containers.create(BUSYBOX, ["true"], network_mode="none")
    try:
        with tempfile.TemporaryFile() as f:
            with tarfile.open(fileobj=f, mode="w") as tar:
                info = tarfile.TarInfo("payload.bin")
                info.size = mib * 1024 * 1024
                block = os.urandom(1024 * 1024)

                class Src(io.RawIOBase):
                    left = info.size

                    def readable(self) -> bool:
                        return True

                    def readinto(self, b: Any) -> int:
                        n = min(len(b), self.left, len(block))
                        b[:n] = block[:n]
                        self.left -= n
                        return n

                tar.addfile(info, io.BufferedReader(Src()))
            f.seek(0)
            c.put_archive("/", f)
        repo, _, tag = TAG.rpartition(":")
        return c.commit(repository=repo, tag=tag)
    finally:
        c.remove(force=True)


async def main(reactor: Any, mib: int, repeats: int) -> None:
    env = require_docker()
    env.ensure_busybox()
    client = env.client()
    image = make_image(client, mib)
    engine = DockerEngine(reactor, environ={"DOCKER_HOST": env.host}, probe_max=1.0)
    engine.startService()
    await engine.whenAvailable()
    work = tempfile.mkdtemp(prefix="bench-seed-")
    try:
        settings = RaySettings("bench", parse_allowlist("llmport-bench"), (work,), os.path.join(work, "tok"))
        ray = RayManager(reactor, engine, None, None, settings, Pool())  # type: ignore[arg-type]
        seeder = ImageSeeding(reactor, engine, Pool(), os.path.join(work, "serve"), ray)
        peer = ImageSeeding(reactor, engine, Pool(), os.path.join(work, "peer"), ray)
        port = free_port()
        bundle = {"image": TAG, "digest": image.id,
                  "rootfs_digest": imagepin.rootfs_digest(image.attrs["RootFS"]["Layers"]),
                  "requirements": {"gpus": "none"}}
        payload = {"runtime_bundle": bundle, "bind_ip": "127.0.0.2", "port": port, "token": TOKEN,
                   "expected_peers": 2 * repeats, "timeout_sec": 3600}
        sctx = RecordingContext(make_command("serve_runtime_image", payload), reactor)
        ready: Deferred[None] = Deferred()
        sctx.on_progress.append(lambda f: f["phase"] == "serving" and not ready.called and ready.callback(None))
        served = ensureDeferred(seeding_handler_specs(seeder)["serve_runtime_image"].handler(sctx))
        await ready
        url = f"http://127.0.0.2:{port}/image"
        await deferToThread(os.makedirs, peer.download_dir, 0o700, True)
        agent_rates: list[float] = []
        curl_rates: list[float] = []
        size = 0
        for i in range(repeats):
            ctx = RecordingContext(make_command("ensure_runtime_image", {}), reactor)
            name = f"bench-{i}.tar"
            t0 = time.perf_counter()
            size = await peer._download(url, TOKEN.encode(), name, ctx, TAG)
            agent_s = time.perf_counter() - t0
            await deferToThread(os.unlink, os.path.join(peer.download_dir, name))
            out = os.path.join(work, "curl.tar")
            t0 = time.perf_counter()
            r = await deferToThread(subprocess.run, ["curl", "-sS", "-f", "-o", out, "-H",
                                                     f"Authorization: Bearer {TOKEN}", url], capture_output=True)
            curl_s = time.perf_counter() - t0
            if r.returncode != 0:
                raise SystemExit(f"curl failed: {r.stderr.decode()[:200]}")
            if os.path.getsize(out) != size:
                raise SystemExit("curl got another size")
            os.unlink(out)
            agent_rates.append(size / agent_s / 2**20)
            curl_rates.append(size / curl_s / 2**20)
            print(f"repeat {i + 1}: tar {size / 2**20:.0f} MiB; agent peer download {agent_s:.2f} s "
                  f"({agent_rates[-1]:.0f} MiB/s), curl {curl_s:.2f} s ({curl_rates[-1]:.0f} MiB/s)", flush=True)
        result = await served
        print(f"seeder: served {result['served']}/{result['expected']}, {result['bytes_sent']} bytes, "
              f"{result['seconds']:.1f} s including docker save", flush=True)
        print(f"median: agent {statistics.median(agent_rates):.0f} MiB/s "
              f"({min(agent_rates):.0f}..{max(agent_rates):.0f}), curl {statistics.median(curl_rates):.0f} MiB/s "
              f"({min(curl_rates):.0f}..{max(curl_rates):.0f}); agent/curl "
              f"{statistics.median(agent_rates) / statistics.median(curl_rates):.2f}", flush=True)
    finally:
        await engine.stopService()
        subprocess.run(["rm", "-rf", work], check=False)
        env.remove_image(TAG)


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    react(lambda reactor: ensureDeferred(main(reactor, args.mb, args.repeats)))


if __name__ == "__main__":
    run()
