"""
Image transfer (transfer_from_server) against `docker load` of the same tar from a local file,
on the real Docker engine the tests start (needs root, docker.io, busybox-static).

An image with one random layer of --size-mb is made and saved to a file; a server in a separate
process streams that file like the backend's image-save endpoint (no Content-Length,
X-Image-Size; with --export as the current backend serves its export: Content-Length and
X-Image-Id, the resumable path); the agent's ImageManager.transfer streams it (filtered: only the requested tag may
come out of the archive) into the engine's image load. The image is removed before every run, and
transfer and `docker load -i <file>` alternate, so both meet the same engine state. A 10 ms
reactor probe runs during the transfers. Prints figures; asserts nothing.

Usage: python3 bench/bench_image_transfer.py [--size-mb 512] [--repeat 3] [--export]
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

from twisted.internet.defer import ensureDeferred  # noqa: E402
from twisted.internet.task import react  # noqa: E402

from bench._common import free_port  # noqa: E402
from llmport_agent.workloads.policy import parse_image_ref  # noqa: E402
from tests.support.docker_env import require_docker  # noqa: E402
from tests.support.probe import LatenessProbe  # noqa: E402
from tests.support.rig import Rig  # noqa: E402

SERVER = r"""
import http.server, os, sys
path = sys.argv[1]
export = sys.argv[3] == "export"
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "application/x-tar")
        if export:  # the current backend's export: a real length and the image id
            self.send_header("Content-Length", str(os.path.getsize(path)))
            self.send_header("X-Image-Id", "sha256:" + "0" * 64)
        else:
            self.send_header("X-Image-Size", str(os.path.getsize(path)))
        self.end_headers()
        with open(path, "rb") as f:
            while True:
                block = f.read(1 << 20)
                if not block:
                    break
                self.wfile.write(block)
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), H).serve_forever()
"""

REF = "llmport-bench/transfer:1"


def make_image(env: Any, size_mb: int, workdir: str) -> str:
    """Import a one-layer image holding size_mb of random bytes; save it to a file."""
    rootfs = os.path.join(workdir, "rootfs.tar")
    with tarfile.open(rootfs, "w") as tar:
        info = tarfile.TarInfo("data.bin")
        info.size = size_mb * 1024 * 1024
        with open("/dev/urandom", "rb") as rnd:
            tar.addfile(info, io.BufferedReader(_Limited(rnd, info.size)))  # type: ignore[arg-type]
    api = env.client().api
    repo, tag = REF.rsplit(":", 1)
    with open(rootfs, "rb") as f:
        api.import_image_from_data(f, repository=repo, tag=tag)
    os.unlink(rootfs)
    saved = os.path.join(workdir, "image.tar")
    with open(saved, "wb") as out:
        for chunk in api.get_image(REF):
            out.write(chunk)
    return saved


class _Limited(io.RawIOBase):
    def __init__(self, f: Any, n: int) -> None:
        self.f, self.n = f, n

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self.n <= 0:
            return 0
        data = self.f.read(min(len(b), self.n, 1 << 20))
        b[: len(data)] = data
        self.n -= len(data)
        return len(data)


def remove(env: Any) -> None:
    env.remove_image(REF)


def docker_load(env: Any, path: str) -> float:
    started = time.perf_counter()
    subprocess.run(["docker", "load", "-q", "-i", path], check=True, stdout=subprocess.DEVNULL,
                   env=dict(os.environ, DOCKER_HOST=env.host))
    return time.perf_counter() - started


async def main(reactor: Any, size_mb: int, repeat: int, export: bool = False) -> None:
    env = require_docker()
    workdir = tempfile.mkdtemp(prefix="llmport-bench-xfer-", dir="/var/tmp")
    print(f"making a {size_mb} MB image ...", flush=True)
    path = make_image(env, size_mb, workdir)
    size = os.path.getsize(path)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, path, str(port), "export" if export else "stream"]
    )
    rig = Rig(reactor, env, backend_url=f"http://127.0.0.1:{port}", credential=lambda: "bench")
    await rig.start()
    probe = LatenessProbe()
    loads: list[float] = []
    transfers: list[float] = []
    try:
        time.sleep(0.5)
        for i in range(repeat):
            remove(env)
            loads.append(docker_load(env, path))
            remove(env)
            probe.start()
            started = time.perf_counter()
            await ensureDeferred(rig.manager.images.transfer(parse_image_ref(REF), lambda *a, **k: None))
            transfers.append(time.perf_counter() - started)
            probe.stop()
            print(f"  run {i + 1}: docker load {size / loads[-1] / 1e6:.0f} MB/s, "
                  f"transfer {size / transfers[-1] / 1e6:.0f} MB/s", flush=True)
    finally:
        probe.stop()
        await rig.stop()
        server.terminate()
        server.wait()
        remove(env)
        os.unlink(path)
        os.rmdir(workdir)

    def rate(values: list[float]) -> str:
        rates = [size / v / 1e6 for v in values]
        return f"{statistics.median(rates):.0f} MB/s ({min(rates):.0f}..{max(rates):.0f})"

    mode = "export (Content-Length, X-Image-Id)" if export else "stream (X-Image-Size)"
    print(f"\n== image transfer, {size / 1e6:.0f} MB tar, {repeat} runs each, {mode} ==")
    print(f"docker load -i <file>           : {rate(loads)}")
    print(f"transfer_from_server (filtered) : {rate(transfers)}")
    print(f"ratio transfer / docker load    : {statistics.median(loads) / statistics.median(transfers):.2f}")
    print(f"10 ms reactor probe during the last transfer: {probe.summary()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--export", action="store_true", help="serve as the current backend's export")
    args = parser.parse_args()
    react(lambda reactor: ensureDeferred(main(reactor, args.size_mb, args.repeat, args.export)))
