"""
Peer image seeding (protocol 10.6) with the real Docker engine on loopback: a node serves its
verified runtime image (C{serve_runtime_image}), a peer fetches it (C{ensure_runtime_image} with
C{source.peer_url}) through L{RayManager.verify}: the image loads and verifies, a cut connection
resumes with Range, a wrong token is refused (401), a peer serving a wrong build ends in
C{runtime_image_mismatch}, and no tar is left in C{IMAGE_DOWNLOAD_DIR}.
"""

from __future__ import annotations

import io
import json
import os
import socket
import tarfile
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.threads import deferToThread
from twisted.logger import formatEvent, globalLogPublisher
from twisted.protocols import portforward
from twisted.trial.unittest import TestCase

from llmport_agent.commands.base import CommandFailed
from llmport_agent.ray import imagepin
from llmport_agent.ray.handlers import RayManager, RaySettings
from llmport_agent.ray.seeding import IMAGE_SEED_FAILED, ImageSeeding, seeding_handler_specs
from llmport_agent.workloads.engine import DockerEngine
from llmport_agent.workloads.policy import parse_allowlist
from tests.support.context import RecordingContext, make_command
from tests.support.docker_env import BUSYBOX, free_port, require_docker

TAG = "llmport-test/seed-runtime:1"
TOKEN = "seed-" + "k3y" * 10
PAYLOAD_BYTES = 3 * 1024 * 1024


class Pool:
    def run(self, fn: Any, *args: Any, **kw: Any) -> Deferred[Any]:
        return deferToThread(fn, *args, **kw)


def _make_image(client: Any, fill: bytes, repo_tag: str) -> Any:
    """A busybox image with one more layer holding C{PAYLOAD_BYTES} of C{fill}."""
    c = client.containers.create(BUSYBOX, ["true"], network_mode="none")
    try:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo("seed.bin")
            info.size = PAYLOAD_BYTES
            tar.addfile(info, io.BytesIO(fill * PAYLOAD_BYTES))
        c.put_archive("/", buf.getvalue())
        repo, _, tag = repo_tag.rpartition(":")
        return c.commit(repository=repo, tag=tag)
    finally:
        c.remove(force=True)


class CutProxy(portforward.ProxyFactory):
    """Forwards to the seeder; the first connection is cut after C{cut} bytes of answer."""

    def __init__(self, host: str, port: int, cut: int) -> None:
        super().__init__(host, port)
        self.cut = cut
        self.connections = 0

    def buildProtocol(self, addr: Any) -> Any:
        self.connections += 1
        proto = super().buildProtocol(addr)
        if self.connections == 1:
            factory = self

            class CutClientFactory(portforward.ProxyClientFactory):
                def buildProtocol(inner, addr: Any) -> Any:  # noqa: N805
                    client = super().buildProtocol(addr)
                    sent = [0]
                    original = client.dataReceived

                    def data(d: bytes) -> None:
                        sent[0] += len(d)
                        if sent[0] > factory.cut:
                            client.transport.loseConnection()
                            client.peer.transport.loseConnection()
                            return
                        original(d)

                    client.dataReceived = data
                    return client

            proto.clientProtocolFactory = CutClientFactory
        return proto


class SeedingTests(TestCase):
    timeout = 240

    async def setUp(self) -> None:
        self.env = require_docker()
        self.env.ensure_busybox()
        self.client = self.env.client()
        self.good = _make_image(self.client, b"A", TAG)
        self.addCleanup(self.env.remove_image, TAG)
        self.engine = DockerEngine(reactor, environ={"DOCKER_HOST": self.env.host}, probe_max=1.0)
        self.engine.startService()
        self.addCleanup(self.engine.stopService)
        await self.engine.whenAvailable()
        self.dir = os.path.abspath(self.mktemp())
        store = os.path.abspath(self.mktemp())
        os.makedirs(store)
        settings = RaySettings("agent-1", parse_allowlist("llmport-test"), (store,), os.path.abspath(self.mktemp()))
        self.ray = RayManager(reactor, self.engine, None, None, settings, Pool())  # type: ignore[arg-type]
        self.seeding = ImageSeeding(reactor, self.engine, Pool(), self.dir, self.ray,
                                    stall_sec=10, resume_attempts=3, resume_delay=0.1)
        self.ray.peer_loader = self.seeding.load_from_peer
        self.lines: list[str] = []
        observer = lambda e: self.lines.append(formatEvent(e) or "")  # noqa: E731
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)

    def bundle(self, image: Any) -> dict[str, Any]:
        layers = image.attrs["RootFS"]["Layers"]
        return {"image": TAG, "digest": image.id, "rootfs_digest": imagepin.rootfs_digest(layers),
                "requirements": {"gpus": "none"}}

    def assertNoSecret(self, *things: Any) -> None:
        for thing in [*things, *self.lines]:
            self.assertNotIn(TOKEN, json.dumps(thing, default=str))

    async def serve(self, image: Any, port: int, **over: Any) -> tuple[Deferred[dict[str, Any]], RecordingContext]:
        payload = {"runtime_bundle": self.bundle(image), "bind_ip": "127.0.0.2", "port": port,
                   "token": TOKEN, "expected_peers": 1, "timeout_sec": 60, **over}
        ctx = RecordingContext(make_command("serve_runtime_image", payload), reactor)
        listening: Deferred[None] = Deferred()
        ctx.on_progress.append(lambda f: f["phase"] == "serving" and not listening.called and listening.callback(None))
        served = ensureDeferred(seeding_handler_specs(self.seeding)["serve_runtime_image"].handler(ctx))
        served.addErrback(lambda f: (listening.called or listening.errback(f), f)[1])
        await listening
        return served, ctx

    async def fetch(self, pin: Any, url: str, token: str = TOKEN) -> tuple[RecordingContext, imagepin.PinReport]:
        payload = {"runtime_bundle": self.bundle(pin), "source": {"peer_url": url, "token": token}}
        ctx = RecordingContext(make_command("ensure_runtime_image", payload), reactor)
        bundle = self.ray.bundle(payload, required=True)
        assert bundle is not None
        return ctx, await self.ray.verify(bundle, ctx)

    def leftovers(self) -> list[str]:
        return os.listdir(self.dir) if os.path.isdir(self.dir) else []

    async def test_seed_to_a_peer(self) -> None:
        port = free_port()
        served, sctx = await self.serve(self.good, port)
        self.client.images.remove(TAG, force=True)  # the peer has no image: it must come from the seeder
        ctx, report = await self.fetch(self.good, f"http://127.0.0.2:{port}/image")
        self.assertEqual(report.matched_by, "rootfs_digest")
        self.assertEqual(report.identity.image_id, self.good.id)
        result = await served
        self.assertEqual((result["served"], result["expected"], result["timed_out"]), (1, 1, False))
        self.assertGreater(result["bytes_sent"], PAYLOAD_BYTES)
        self.assertEqual(self.leftovers(), [])
        self.assertIn("peer_download", [f["phase"] for f in ctx.frames])
        self.assertNoSecret(result, ctx.frames, sctx.frames)
        # The seeder stopped listening.
        with self.assertRaises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port), timeout=5).close()

    async def test_receiver_asked_before_the_seeder_listens(self) -> None:
        """
        The backend sends both commands at the same moment: the receiver's download starts
        against a port nobody listens on yet (refused), keeps trying, and completes once the
        seeder serves; the wait is said in a progress frame.
        """
        from twisted.internet.task import deferLater

        port = free_port()
        ctx = RecordingContext(make_command("ensure_runtime_image", {}), reactor)
        os.makedirs(self.dir, exist_ok=True)
        self.seeding.resume_delay = 0.2
        download = Deferred.fromCoroutine(self.seeding.download(
            "127.0.0.2", port, "/image", TOKEN.encode(), "early.tar", ctx, TAG, 60))
        await deferLater(reactor, 1.5, lambda: None)
        self.assertFalse(download.called)
        served, _ = await self.serve(self.good, port)
        size = await download
        self.assertGreater(size, PAYLOAD_BYTES)
        self.assertEqual(os.path.getsize(os.path.join(self.dir, "early.tar")), size)
        os.unlink(os.path.join(self.dir, "early.tar"))
        waits = [f for f in ctx.frames if f["phase"] == "waiting_for_peer"]
        self.assertEqual(len(waits), 1)
        self.assertIn("may still be exporting", waits[0]["message"])
        self.assertEqual((await served)["served"], 1)

    async def test_resume_after_cut(self) -> None:
        port = free_port()
        served, _ = await self.serve(self.good, port)
        proxy = CutProxy("127.0.0.2", port, cut=PAYLOAD_BYTES // 2)
        listening = reactor.listenTCP(0, proxy, interface="127.0.0.1")
        self.addCleanup(listening.stopListening)
        self.client.images.remove(TAG, force=True)
        ctx, report = await self.fetch(self.good, f"http://127.0.0.1:{listening.getHost().port}/image")
        self.assertEqual(report.identity.image_id, self.good.id)
        self.assertGreaterEqual(proxy.connections, 2)
        result = await served
        self.assertEqual(result["served"], 1)
        # The resume asked only for the rest: less than two whole tars went out.
        done = [f for f in ctx.frames if f["phase"] == "peer_download"]
        total = done[-1]["bytes_total"]
        self.assertLess(result["bytes_sent"], 2 * total)
        self.assertGreater(len(done), 1)
        self.assertEqual(self.leftovers(), [])

    async def test_wrong_token(self) -> None:
        port = free_port()
        served, _ = await self.serve(self.good, port, timeout_sec=2)
        self.client.images.remove(TAG, force=True)
        with self.assertRaises(CommandFailed) as caught:
            await self.fetch(self.good, f"http://127.0.0.2:{port}/image", token="not-the-token")
        self.assertEqual(caught.exception.error_code, IMAGE_SEED_FAILED)
        self.assertIn("HTTP 401", caught.exception.error_message)
        result = await served
        self.assertEqual((result["served"], result["timed_out"]), (0, True))
        self.assertEqual(self.leftovers(), [])
        self.assertNoSecret(result)

    async def test_peer_serving_a_wrong_image(self) -> None:
        port = free_port()
        served, _ = await self.serve(self.good, port)
        other = _make_image(self.client, b"B", "llmport-test/seed-other:1")
        self.addCleanup(self.env.remove_image, "llmport-test/seed-other:1")
        self.client.images.remove(TAG, force=True)
        with self.assertRaises(CommandFailed) as caught:
            await self.fetch(other, f"http://127.0.0.2:{port}/image")
        self.assertEqual(caught.exception.error_code, imagepin.RUNTIME_IMAGE_MISMATCH)
        await served
        self.assertEqual(self.leftovers(), [])
        # The peer's build never took the bundle's name, and no private name is left on it.
        import docker

        with self.assertRaises(docker.errors.ImageNotFound):
            self.client.images.get(TAG)
        self.assertEqual([t for i in self.client.images.list() for t in i.tags if imagepin.PRIVATE_REPO in t], [])

    async def test_serve_refuses_an_unverified_image(self) -> None:
        other = _make_image(self.client, b"C", "llmport-test/seed-other:2")
        self.addCleanup(self.env.remove_image, "llmport-test/seed-other:2")
        payload = {"runtime_bundle": self.bundle(other), "bind_ip": "127.0.0.2", "port": free_port(), "token": TOKEN}
        ctx = RecordingContext(make_command("serve_runtime_image", payload), reactor)
        with self.assertRaises(CommandFailed) as caught:
            await seeding_handler_specs(self.seeding)["serve_runtime_image"].handler(ctx)
        self.assertEqual(caught.exception.error_code, imagepin.RUNTIME_IMAGE_MISMATCH)

    async def test_http_answers(self) -> None:
        """The seeder's HTTP: 401 without the token, 206 for a range, 416 past the end."""
        import urllib.error
        import urllib.request

        port = free_port()
        served, _ = await self.serve(self.good, port, timeout_sec=3)
        url = f"http://127.0.0.2:{port}/image"

        def get(headers: dict[str, str]) -> tuple[int, bytes, dict[str, str]]:
            req = urllib.request.Request(url, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status, r.read(), dict(r.headers)
            except urllib.error.HTTPError as e:
                return e.code, e.read(), dict(e.headers)

        auth = {"Authorization": f"Bearer {TOKEN}"}
        code, _, headers = await deferToThread(get, {})
        self.assertEqual((code, headers.get("WWW-Authenticate")), (401, "Bearer"))
        code, _, _ = await deferToThread(get, {"Authorization": f"Bearer {TOKEN[:-1]}x"})
        self.assertEqual(code, 401)
        code, body, headers = await deferToThread(get, {**auth, "Range": "bytes=10-19"})
        self.assertEqual((code, len(body)), (206, 10))
        total = int(headers["Content-Range"].rsplit("/", 1)[1])
        code, _, headers = await deferToThread(get, {**auth, "Range": f"bytes={total}-"})
        self.assertEqual((code, headers.get("Content-Range")), (416, f"bytes */{total}"))
        result = await served
        # Partial ranges are not complete downloads.
        self.assertEqual((result["served"], result["timed_out"]), (0, True))
        self.assertEqual(self.leftovers(), [])


class ServerLoadTests(TestCase):
    """
    C{ensure_runtime_image} without C{source}, on the real engine, from the stand-in backend's
    C{images/save} (an export with Range and X-Image-Id): the pinned build is loaded and named;
    a server holding another build answers 409 (C{server_image_mismatch}); a server that sends
    another build anyway (no pin check of its own) ends in C{runtime_image_mismatch} with the
    bundle's name never on that build.
    """

    timeout = 240

    async def setUp(self) -> None:
        from treq.client import HTTPClient
        from twisted.web.client import Agent, HTTPConnectionPool

        from llmport_agent.devbackend.backend import DevBackend
        from llmport_agent.workloads.images import ImageManager

        self.env = require_docker()
        self.env.ensure_busybox()
        self.client = self.env.client()
        self.good = _make_image(self.client, b"G", TAG)
        self.addCleanup(self.env.remove_image, TAG)
        self.other = _make_image(self.client, b"O", "llmport-test/seed-other:3")
        self.addCleanup(self.env.remove_image, "llmport-test/seed-other:3")
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.good_tar = os.path.join(self.dir, "good.tar")
        self.other_tar = os.path.join(self.dir, "other.tar")
        await deferToThread(self._save, TAG, self.good_tar)
        # The other build's tar names the bundle's image, as a server holding the wrong build sends.
        repo, _, tag = TAG.rpartition(":")
        self.client.api.tag(self.other.id, repo, tag, force=True)
        await deferToThread(self._save, TAG, self.other_tar)
        self.client.api.tag(self.good.id, repo, tag, force=True)
        self.backend = DevBackend(reactor)
        await self.backend.listen(0, "127.0.0.1")
        self.addCleanup(self.backend.stop)
        credential = self.backend.enroll_node("server-load")["credential"]
        self.engine = DockerEngine(reactor, environ={"DOCKER_HOST": self.env.host}, probe_max=1.0)
        self.engine.startService()
        self.addCleanup(self.engine.stopService)
        await self.engine.whenAvailable()
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(pool.closeCachedConnections)
        images = ImageManager(reactor, self.engine, stall_sec=20, http=HTTPClient(Agent(reactor, pool=pool)),
                              backend_url=self.backend.url, credential=lambda: credential)
        store = os.path.abspath(self.mktemp())
        os.makedirs(store)
        settings = RaySettings("agent-1", parse_allowlist("llmport-test"), (store,), os.path.abspath(self.mktemp()))
        self.ray = RayManager(reactor, self.engine, images, None, settings, Pool())  # type: ignore[arg-type]

    def _save(self, ref: str, path: str) -> None:
        with open(path, "wb") as out:
            for chunk in self.client.api.get_image(ref):
                out.write(chunk)

    def serve(self, path: str, pinned: bool = True) -> None:
        from llmport_agent.devbackend.imagetar import image_identity

        image_id, rootfs = image_identity(path) if pinned else (None, None)
        name, _, tag = TAG.rpartition(":")
        self.backend.add_image(name, tag, path, image_id=image_id, rootfs_digest=rootfs)

    async def ensure(self) -> tuple[RecordingContext, imagepin.PinReport]:
        layers = self.good.attrs["RootFS"]["Layers"]
        payload = {"runtime_bundle": {"image": TAG, "digest": self.good.id, "rootfs_digest": imagepin.rootfs_digest(layers),
                                      "requirements": {"gpus": "none"}}}
        ctx = RecordingContext(make_command("ensure_runtime_image", payload), reactor)
        bundle = self.ray.bundle(payload, required=True)
        assert bundle is not None
        return ctx, await self.ray.verify(bundle, ctx)

    def names(self) -> list[str]:
        return sorted(t for i in self.client.images.list() for t in i.tags)

    async def test_loaded_from_the_server_and_named(self) -> None:
        self.serve(self.good_tar)
        self.client.images.remove(TAG, force=True)
        ctx, report = await self.ensure()
        self.assertEqual(report.identity.image_id, self.good.id)
        self.assertEqual(self.client.images.get(TAG).id, self.good.id)
        self.assertIn("transfer_image", [f["phase"] for f in ctx.frames])
        self.assertEqual([n for n in self.names() if imagepin.PRIVATE_REPO in n], [])

    async def test_a_server_holding_another_build_answers_409(self) -> None:
        self.serve(self.other_tar)
        self.client.images.remove(TAG, force=True)
        with self.assertRaises(CommandFailed) as caught:
            await self.ensure()
        self.assertEqual(caught.exception.error_code, "server_image_mismatch")

    async def test_another_build_sent_anyway_never_takes_the_name(self) -> None:
        import docker

        self.backend.image_route_current = False  # a server that streams and checks no pin (2026-04)
        self.serve(self.other_tar, pinned=False)
        self.client.images.remove(TAG, force=True)
        with self.assertRaises(CommandFailed) as caught:
            await self.ensure()
        self.assertEqual(caught.exception.error_code, imagepin.RUNTIME_IMAGE_MISMATCH)
        with self.assertRaises(docker.errors.ImageNotFound):
            self.client.images.get(TAG)
        self.assertEqual([n for n in self.names() if imagepin.PRIVATE_REPO in n], [])
        self.assertEqual(self.client.images.get("llmport-test/seed-other:3").id, self.other.id)
