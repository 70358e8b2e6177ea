"""
Runtime image transfer benchmark (issues 19 and 25), two parts, each against its baseline in
the same run, alternating. Prints figures; asserts nothing.

 1. Peer seeding: the agent's peer download (C{ensure_runtime_image} with C{source.peer_url}:
    Range-resumable HTTP into C{IMAGE_DOWNLOAD_DIR} on a thread) against C{curl} downloading
    the same tar from the same seeder to a file. The seeder is the agent's
    C{serve_runtime_image} on 127.0.0.2, in a process of its own (as on another machine).
 2. Server load: C{ensure_runtime_image} without C{source} (the stand-in backend's
    C{/api/node-files/images/save}, an export with Content-Length and X-Image-Id, streamed
    through the archive filter into the engine's image load under a private name, then the
    pin checked and the bundle's name given) against C{docker load -i} of the same tar. The
    stand-in runs in a process of its own; the image is removed before every run.

The image is busybox with one extra layer of C{--mb} MiB of random bytes, on a private Docker
engine started like the tests do (needs root).

Usage: python3 bench/bench_seed.py [--mb 256] [--repeats 3] [--part peer|server|both]
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from twisted.internet.defer import Deferred, ensureDeferred  # noqa: E402
from twisted.internet.task import react  # noqa: E402
from twisted.internet.threads import deferToThread  # noqa: E402

from bench._common import free_port  # noqa: E402
from llmport_agent.ray import imagepin  # noqa: E402
from llmport_agent.ray.handlers import RayManager, RaySettings  # noqa: E402
from llmport_agent.ray.seeding import ImageSeeding  # noqa: E402
from llmport_agent.workloads.engine import DockerEngine  # noqa: E402
from llmport_agent.workloads.policy import parse_allowlist  # noqa: E402
from tests.support.context import RecordingContext, make_command  # noqa: E402
from tests.support.docker_env import BUSYBOX, require_docker  # noqa: E402

TAG = "llmport-bench/seed-runtime:1"
TOKEN = "bench-seed-token-0123456789"

#: The seeder: the agent's serve_runtime_image in its own process and reactor.
SEEDER = r"""
import os, sys, json
sys.path.insert(0, sys.argv[1])
from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.internet.threads import deferToThread
from llmport_agent.ray.handlers import RayManager, RaySettings
from llmport_agent.ray.seeding import ImageSeeding, seeding_handler_specs
from llmport_agent.workloads.engine import DockerEngine
from llmport_agent.workloads.policy import parse_allowlist
from tests.support.context import RecordingContext, make_command

class Pool:
    def run(self, fn, *a, **kw):
        return deferToThread(fn, *a, **kw)

payload = json.loads(sys.argv[2])
work = sys.argv[3]

async def main():
    engine = DockerEngine(reactor, environ={"DOCKER_HOST": os.environ["DOCKER_HOST"]}, probe_max=1.0)
    engine.startService()
    await engine.whenAvailable()
    settings = RaySettings("bench", parse_allowlist("llmport-bench"), (work,), os.path.join(work, "tok"))
    ray = RayManager(reactor, engine, None, None, settings, Pool())
    seeder = ImageSeeding(reactor, engine, Pool(), os.path.join(work, "serve"), ray)
    ctx = RecordingContext(make_command("serve_runtime_image", payload), reactor)
    ctx.on_progress.append(lambda f: f["phase"] == "serving" and print("READY", flush=True))
    try:
        await seeding_handler_specs(seeder)["serve_runtime_image"].handler(ctx)
    finally:
        await engine.stopService()
        reactor.stop()

reactor.callWhenRunning(lambda: ensureDeferred(main()))
reactor.run()
"""

#: The stand-in backend serving one image tar as the current generation's export.
STANDIN = r"""
import sys
sys.path.insert(0, sys.argv[1])
from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from llmport_agent.devbackend.backend import DevBackend
from llmport_agent.devbackend.imagetar import image_identity

name, tag, path, port = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])

async def main():
    backend = DevBackend(reactor)
    image_id, rootfs = image_identity(path)
    backend.add_image(name, tag, path, image_size=None, image_id=image_id, rootfs_digest=rootfs)
    await backend.listen(port, "127.0.0.1")
    reply = backend.enroll_node("bench-node")
    print("READY", backend.url, reply["credential"], flush=True)

reactor.callWhenRunning(lambda: ensureDeferred(main()))
reactor.run()
"""


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

                class Src(io.RawIOBase):
                    left = info.size

                    def readable(self) -> bool:
                        return True

                    def readinto(self, b: Any) -> int:
                        n = min(len(b), self.left, 1024 * 1024)
                        b[:n] = os.urandom(n)
                        self.left -= n
                        return n

                tar.addfile(info, io.BufferedReader(Src()))
            f.seek(0)
            c.put_archive("/", f)
        repo, _, tag = TAG.rpartition(":")
        return c.commit(repository=repo, tag=tag)
    finally:
        c.remove(force=True)


def bundle_of(image: Any) -> dict[str, Any]:
    return {"image": TAG, "digest": image.id,
            "rootfs_digest": imagepin.rootfs_digest(image.attrs["RootFS"]["Layers"]),
            "requirements": {"gpus": "none"}}


def summary(label: str, agent: list[float], base: list[float], base_name: str) -> str:
    a, b = statistics.median(agent), statistics.median(base)
    return (f"{label}: agent {a:.0f} MiB/s ({min(agent):.0f}..{max(agent):.0f}), {base_name} {b:.0f} MiB/s "
            f"({min(base):.0f}..{max(base):.0f}); agent/{base_name} {a / b:.2f}")


async def peer_part(reactor: Any, env: Any, engine: DockerEngine, image: Any, work: str, repeats: int) -> str:
    port = free_port()
    payload = {"runtime_bundle": bundle_of(image), "bind_ip": "127.0.0.2", "port": port, "token": TOKEN,
               "expected_peers": 2 * repeats + 2, "timeout_sec": 3600}
    import json

    seeder = subprocess.Popen([sys.executable, "-c", SEEDER, ROOT, json.dumps(payload), work],
                              stdout=subprocess.PIPE, env=dict(os.environ, DOCKER_HOST=env.host), text=True)
    try:
        line = await deferToThread(seeder.stdout.readline)  # type: ignore[union-attr]
        if not line.startswith("READY"):
            raise SystemExit("the seeder did not start")
        settings = RaySettings("bench", parse_allowlist("llmport-bench"), (work,), os.path.join(work, "tok"))
        ray = RayManager(reactor, engine, None, None, settings, Pool())  # type: ignore[arg-type]
        peer = ImageSeeding(reactor, engine, Pool(), os.path.join(work, "peer"), ray)
        await deferToThread(os.makedirs, peer.download_dir, 0o700, True)
        url = f"http://127.0.0.2:{port}/image"
        agent: list[float] = []
        curl: list[float] = []
        size = 0

        async def by_agent(i: int) -> float:
            ctx = RecordingContext(make_command("ensure_runtime_image", {}), reactor)
            name = f"bench-{i}.tar"
            t0 = time.perf_counter()
            nonlocal size
            size = await peer.download("127.0.0.2", port, "/image", TOKEN.encode(), name, ctx, TAG, 60)
            took = time.perf_counter() - t0
            await deferToThread(os.unlink, os.path.join(peer.download_dir, name))
            return took

        async def by_curl() -> float:
            out = os.path.join(work, "curl.tar")
            t0 = time.perf_counter()
            r = await deferToThread(subprocess.run, ["curl", "-sS", "-f", "-o", out, "-H",
                                                     f"Authorization: Bearer {TOKEN}", url], capture_output=True)
            took = time.perf_counter() - t0
            if r.returncode != 0:
                raise SystemExit(f"curl failed: {r.stderr.decode()[:200]}")
            got = os.path.getsize(out)
            os.unlink(out)
            if size and got != size:
                raise SystemExit("curl got another size")
            return took

        for i in range(repeats):
            # Alternating which goes first, so neither always meets the other's page cache.
            if i % 2:
                curl_s = await by_curl()
                agent_s = await by_agent(i)
            else:
                agent_s = await by_agent(i)
                curl_s = await by_curl()
            agent.append(size / agent_s / 2**20)
            curl.append(size / curl_s / 2**20)
            print(f"peer repeat {i + 1}: tar {size / 2**20:.0f} MiB; agent peer download {agent_s:.2f} s "
                  f"({agent[-1]:.0f} MiB/s), curl {curl_s:.2f} s ({curl[-1]:.0f} MiB/s)", flush=True)
        return summary("peer download (median)", agent, curl, "curl")
    finally:
        seeder.terminate()
        seeder.wait()


async def server_part(reactor: Any, env: Any, engine: DockerEngine, image: Any, work: str, repeats: int) -> str:
    from treq.client import HTTPClient
    from twisted.web.client import Agent, HTTPConnectionPool

    from llmport_agent.workloads.images import ImageManager

    tar = os.path.join(work, "image.tar")
    await deferToThread(lambda: subprocess.run(["docker", "save", "-o", tar, TAG], check=True,
                                               env=dict(os.environ, DOCKER_HOST=env.host)))
    size = os.path.getsize(tar)
    name, _, tag = TAG.rpartition(":")
    port = free_port()
    standin = subprocess.Popen([sys.executable, "-c", STANDIN, ROOT, name, tag, tar, str(port)],
                               stdout=subprocess.PIPE, text=True)
    http_pool = HTTPConnectionPool(reactor)
    try:
        line = await deferToThread(standin.stdout.readline)  # type: ignore[union-attr]
        parts = line.split()
        if len(parts) != 3 or parts[0] != "READY":
            raise SystemExit(f"the stand-in did not start: {line!r}")
        url, credential = parts[1], parts[2]
        images = ImageManager(reactor, engine, stall_sec=60, http=HTTPClient(Agent(reactor, pool=http_pool)),
                              backend_url=url, credential=lambda: credential)
        ray = RayManager(reactor, engine, images, None, RaySettings(  # type: ignore[arg-type]
            "bench", parse_allowlist("llmport-bench"), (work,), os.path.join(work, "tok")), Pool())
        bundle = ray.bundle({"runtime_bundle": bundle_of(image)}, required=True)
        assert bundle is not None
        agent: list[float] = []
        load: list[float] = []
        for i in range(repeats):
            env.remove_image(TAG)
            t0 = time.perf_counter()
            await deferToThread(subprocess.run, ["docker", "load", "-q", "-i", tar], check=True,
                                stdout=subprocess.DEVNULL, env=dict(os.environ, DOCKER_HOST=env.host))
            load_s = time.perf_counter() - t0
            env.remove_image(TAG)
            ctx = RecordingContext(make_command("ensure_runtime_image", {"runtime_bundle": bundle_of(image)}), reactor)
            t0 = time.perf_counter()
            report = await ray.verify(bundle, ctx)
            agent_s = time.perf_counter() - t0
            if report.matched_by is None:
                raise SystemExit("the loaded image is not the pinned one")
            agent.append(size / agent_s / 2**20)
            load.append(size / load_s / 2**20)
            print(f"server repeat {i + 1}: tar {size / 2**20:.0f} MiB; ensure_runtime_image from the stand-in "
                  f"{agent_s:.2f} s ({agent[-1]:.0f} MiB/s), docker load -i {load_s:.2f} s ({load[-1]:.0f} MiB/s)",
                  flush=True)
        return summary("server load (median)", agent, load, "docker load")
    finally:
        await http_pool.closeCachedConnections()
        standin.terminate()
        standin.wait()


async def main(reactor: Any, mib: int, repeats: int, part: str) -> None:
    env = require_docker()
    env.ensure_busybox()
    client = env.client()
    image = make_image(client, mib)
    engine = DockerEngine(reactor, environ={"DOCKER_HOST": env.host}, probe_max=1.0)
    engine.startService()
    await engine.whenAvailable()
    work = tempfile.mkdtemp(prefix="bench-seed-", dir="/var/tmp")
    lines = []
    try:
        if part in ("peer", "both"):
            lines.append(await peer_part(reactor, env, engine, image, work, repeats))
        if part in ("server", "both"):
            lines.append(await server_part(reactor, env, engine, image, work, repeats))
    finally:
        await engine.stopService()
        subprocess.run(["rm", "-rf", work], check=False)
        env.remove_image(TAG)
    print()
    for line in lines:
        print(line, flush=True)


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--part", choices=["peer", "server", "both"], default="both")
    args = parser.parse_args()
    react(lambda reactor: ensureDeferred(main(reactor, args.mb, args.repeats, args.part)))


if __name__ == "__main__":
    run()
