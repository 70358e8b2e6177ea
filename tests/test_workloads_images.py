"""
Images on the real engine: pulls from a real registry (progress, an error inside the
stream, a stall behind a proxy that stops sending, joined pulls) and transfers from a
stand-in of the backend's image-save endpoint (progress, broken and stalled downloads,
refusals, cancel).
"""

from __future__ import annotations

import uuid
from typing import Any

from twisted.internet import reactor as _global_reactor
from twisted.internet.defer import CancelledError, ensureDeferred
from twisted.internet.task import deferLater
from twisted.logger import globalLogPublisher

from llmport_agent.commands.base import INVALID_COMMAND, CommandFailed
from llmport_agent.workloads.policy import parse_image_ref

from .support.docker_env import BUSYBOX, Registry, require_registry
from .support.imageserver import ImageSaveResource, serve, stop_serving
from .support.proxy import StallingProxy
from .support.rig import Rig, WorkloadTestBase, httpd_payload

reactor: Any = _global_reactor

CREDENTIAL = "0b7f3f0e-0000-4000-8000-000000000001.s3cr3t-node-credential-value-abcdefghijk"

_big: dict[str, str] = {}


def big_image(registry: Registry) -> str:
    """A two-layer image (~3 MB random layer) in the registry, made once per process."""
    if "ref" not in _big:
        _big["ref"] = registry.make_layered_image("llmport/big:1", 3_000_000)
    return _big["ref"]


class Recorder:
    """Collects progress(message, **extra) calls."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, message: str, **extra: Any) -> None:
        self.calls.append({"message": message, **extra})


class PullTests(WorkloadTestBase):
    """pull_from_registry against a real registry."""

    timeout = 180

    async def setUp(self) -> None:  # type: ignore[override]
        await super().setUp()
        self.registry = require_registry()

    async def test_deploy_pulls_with_progress(self) -> None:
        """A deploy with pull_from_registry pulls the image (phase pull_image) and becomes ready."""
        ref = big_image(self.registry)
        self.env.remove_image(ref)
        payload = httpd_payload(image=ref, image_source="pull_from_registry")
        ctx, result = await self.rig.run("deploy_workload", payload)
        frames = ctx.frames_of("pull_image")
        self.assertTrue(frames)
        self.assertEqual(frames[-1]["progress_pct"], 100)
        self.assertGreater(frames[-1]["bytes_total"], 0)
        self.assertTrue(result["image_id"].startswith("sha256:"))

    async def test_credentials_never_leak(self) -> None:
        """Registry credentials from the payload reach the engine only: not progress, events, results, errors or logs."""
        secret = "pw-" + uuid.uuid4().hex
        captured: list[str] = []

        def _observe(event: dict[str, Any]) -> None:
            captured.append(repr(event))

        observe: Any = _observe

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)
        ref = self.registry.ref("llmport/busybox:1")
        self.env.remove_image(ref)
        auth = {"registry_auth": {"username": "robot", "password": secret}}
        payload = httpd_payload(image=ref, image_source="pull_from_registry", provider_config=auth)
        ctx, result = await self.rig.run("deploy_workload", payload)
        missing = httpd_payload(
            image=self.registry.ref("llmport/nothing-here:1"),
            image_source="pull_from_registry",
            provider_config=auth,
        )
        ctx2, exc = await self.failure("deploy_workload", missing)
        self.assertEqual(exc.error_code, "pull_failed")
        text = repr([ctx.frames, ctx.events, result, ctx2.frames, exc.error_message, exc.result, captured])
        self.assertNotIn(secret, text)

    async def test_pull_progress_bytes(self) -> None:
        """A multi-layer pull reports aggregated bytes, ending at 100 % and the full size."""
        ref = big_image(self.registry)
        self.env.remove_image(ref)
        rec = Recorder()
        start = reactor.seconds()
        result = await self.rig.manager.images.pull(parse_image_ref(ref), rec)
        elapsed = reactor.seconds() - start
        self.assertEqual(result["progress_pct"], 100)
        self.assertGreaterEqual(result["bytes_total"], 3_000_000)
        self.assertEqual(result["bytes_done"], result["bytes_total"])
        self.assertEqual(result["layers"], 2)
        self.assertEqual(rec.calls[-1]["progress_pct"], 100)
        # At most about one report per second (plus the final one).
        self.assertLessEqual(len(rec.calls), int(elapsed) + 2)

    async def test_pull_error_in_stream(self) -> None:
        """An error that arrives inside the pull stream (a corrupt layer) fails with pull_failed."""
        before = set(self.registry.blob_paths(400_000))
        ref = self.registry.make_layered_image(f"llmport/broken-{uuid.uuid4().hex[:6]}:1", 500_000)
        self.env.remove_image(ref)
        fresh = set(self.registry.blob_paths(400_000)) - before
        self.assertEqual(len(fresh), 1)
        for path in fresh:
            data = bytearray(open(path, "rb").read())
            data[len(data) // 2] ^= 0xFF
            open(path, "wb").write(bytes(data))
        rec = Recorder()
        with self.assertRaises(CommandFailed) as cm:
            await self.rig.manager.images.pull(parse_image_ref(ref), rec)
        self.assertEqual(cm.exception.error_code, "pull_failed")
        self.assertIn("verification failed", cm.exception.error_message)

    async def test_pull_unknown_image(self) -> None:
        """A reference the registry does not have fails with pull_failed naming the image."""
        ref = self.registry.ref("llmport/does-not-exist:1")
        with self.assertRaises(CommandFailed) as cm:
            await self.rig.manager.images.pull(parse_image_ref(ref), Recorder())
        self.assertEqual(cm.exception.error_code, "pull_failed")
        self.assertIn("does-not-exist", cm.exception.error_message)

    async def test_pull_stalls(self) -> None:
        """A registry that stops sending mid-blob makes the pull fail with pull_stalled."""
        big_image(self.registry)  # pushed through the real port
        proxy = StallingProxy(reactor, self.registry.port, stall_after=300_000)
        port = await proxy.start()
        self.addCleanup(proxy.stop)
        ref = f"127.0.0.1:{port}/llmport/big:1"
        self.env.remove_image(ref)
        self.env.remove_image(_big["ref"])
        rec = Recorder()
        start = reactor.seconds()
        with self.assertRaises(CommandFailed) as cm:
            await self.rig.manager.images.pull(parse_image_ref(ref), rec)
        self.assertEqual(cm.exception.error_code, "pull_stalled")
        self.assertIn("no progress for 3 s", cm.exception.error_message)
        self.assertTrue(proxy.stalled)
        self.assertLess(reactor.seconds() - start, 30)

    async def test_joined_pulls(self) -> None:
        """Two concurrent pulls of one reference share one engine pull."""
        ref = self.registry.ref("llmport/busybox:1")
        self.env.remove_image(ref)
        images = self.rig.manager.images
        r1, r2 = Recorder(), Recorder()
        d1 = ensureDeferred(images.pull(parse_image_ref(ref), r1))
        d2 = ensureDeferred(images.pull(parse_image_ref(ref), r2))
        self.assertEqual(len(images._pulls), 1)
        a, b = await d1, await d2
        self.assertEqual(a["image_id"], b["image_id"])
        self.assertIn("Joining", r2.calls[0]["message"])
        self.assertEqual(images._pulls, {})

    async def test_cancel_one_joined_pull(self) -> None:
        """Cancelling one of two joined pulls leaves the other running to completion."""
        ref = self.registry.ref("llmport/busybox:1")
        self.env.remove_image(ref)
        images = self.rig.manager.images
        d1 = ensureDeferred(images.pull(parse_image_ref(ref), Recorder()))
        d2 = ensureDeferred(images.pull(parse_image_ref(ref), Recorder()))
        d1.cancel()
        with self.assertRaises(CancelledError):
            await d1
        result = await d2
        self.assertTrue(result["image_id"])


def saved_tar(env: Any, source: str, target: str) -> bytes:
    """A `docker save` of C{source} tagged as C{target} (the local tag is dropped again)."""
    api = env.client().api
    repo, tag = target.rsplit(":", 1)
    api.tag(source, repo, tag)
    data = b"".join(api.get_image(target))
    api.remove_image(target)
    return data


class TransferTests(WorkloadTestBase):
    """transfer_from_server from a stand-in backend (with a base path)."""

    timeout = 120

    async def setUp(self) -> None:  # type: ignore[override]
        await super().setUp()
        self.resource = ImageSaveResource(reactor, CREDENTIAL, base_path="/llm-port")
        self.port, self.base_url = await serve(reactor, self.resource)
        self.addCleanup(lambda: stop_serving(self.port, self.resource))
        # Rebuild the rig with the backend configured.
        await self.rig.stop()
        self.rig = Rig(reactor, self.env, backend_url=self.base_url, credential=lambda: CREDENTIAL)
        await self.rig.start()
        self.name = f"llmport/xfer-{uuid.uuid4().hex[:6]}"
        self.ref = f"{self.name}:1"
        self.resource.tars[(self.name, "1")] = saved_tar(self.env, BUSYBOX, self.ref)

    async def test_deploy_with_transfer(self) -> None:
        """A deploy with transfer_from_server loads the streamed tar and runs the image."""
        payload = httpd_payload(image=self.ref, image_source="transfer_from_server")
        ctx, result = await self.rig.run("deploy_workload", payload)
        self.assertIn("transfer_image", ctx.phases())
        self.assertNotIn("pull_image", ctx.phases())
        final = ctx.frames_of("transfer_image")[-1]
        size = len(self.resource.tars[(self.name, "1")])
        self.assertEqual(final["bytes_total"], size)
        self.assertEqual(final["bytes_done"], size)
        self.assertEqual(final["progress_pct"], 100)
        [request] = self.resource.requests
        self.assertEqual(request["path"], "/llm-port/api/node-files/images/save")
        self.assertEqual(request["args"], {"image": self.name, "tag": "1"})
        self.assertEqual(request["authorization"], f"Bearer {CREDENTIAL}")
        self.assertTrue(result["endpoint_url"])
        for frame in ctx.frames:
            self.assertNotIn(CREDENTIAL, repr(frame))

    async def test_broken_download(self) -> None:
        """
        A streamed (not resumable) download that breaks fails with image_transfer_failed;
        nothing is loaded, and it is not asked again with a Range it could not honour.
        """
        self.resource.break_after = 256 * 1024
        with self.assertRaises(CommandFailed) as cm:
            await self.rig.manager.images.transfer(parse_image_ref(self.ref), Recorder())
        self.assertEqual(cm.exception.error_code, "image_transfer_failed")
        self.assertEqual(len(self.resource.requests), 1)
        self.assertIn("broke", cm.exception.error_message)
        self.assertIsNone(await self.rig.manager.images.inspect(parse_image_ref(self.ref)))

    async def test_stalled_download(self) -> None:
        """A backend that stops sending makes the transfer fail with transfer_stalled."""
        self.resource.stall_after = 256 * 1024
        with self.assertRaises(CommandFailed) as cm:
            await self.rig.manager.images.transfer(parse_image_ref(self.ref), Recorder())
        self.assertEqual(cm.exception.error_code, "transfer_stalled")
        self.assertIsNone(await self.rig.manager.images.inspect(parse_image_ref(self.ref)))

    async def test_refused(self) -> None:
        """HTTP errors from the backend fail with image_transfer_failed and never echo the credential."""
        self.resource.credential = "something-else"
        with self.assertRaises(CommandFailed) as cm:
            await self.rig.manager.images.transfer(parse_image_ref(self.ref), Recorder())
        self.assertEqual(cm.exception.error_code, "image_transfer_failed")
        self.assertIn("HTTP 401", cm.exception.error_message)
        self.assertNotIn(CREDENTIAL, cm.exception.error_message)

    async def test_unknown_image(self) -> None:
        """An image the backend does not have: HTTP 404 in the message."""
        with self.assertRaises(CommandFailed) as cm:
            await self.rig.manager.images.transfer(parse_image_ref("llmport/nope:9"), Recorder())
        self.assertIn("HTTP 404", cm.exception.error_message)

    async def test_unservable_reference(self) -> None:
        """Digests and registry ports cannot be transferred: invalid_command before any request."""
        for ref in ("127.0.0.1:5000/x/y:1", "x/y@sha256:" + "c" * 64):
            with self.assertRaises(CommandFailed) as cm:
                await self.rig.manager.images.transfer(parse_image_ref(ref), Recorder())
            self.assertEqual(cm.exception.error_code, INVALID_COMMAND)
        self.assertEqual(self.resource.requests, [])

    async def test_cancel_stops_load(self) -> None:
        """Cancelling a transfer mid-stream stops the download and the load."""
        self.resource.stall_after = 128 * 1024
        rec = Recorder()
        d = ensureDeferred(self.rig.manager.images.transfer(parse_image_ref(self.ref), rec))
        for _ in range(50):
            if self.resource.sent >= 128 * 1024:
                break
            await deferLater(reactor, 0.05, lambda: None)
        d.cancel()
        with self.assertRaises(CancelledError):
            await d
        await deferLater(reactor, 0.2, lambda: None)
        self.assertIsNone(await self.rig.manager.images.inspect(parse_image_ref(self.ref)))



class ResumableTransferTests(TransferTests):
    """
    The current backend's export (protocol 10.4): Content-Length, X-Image-Id, Range resume
    into the same image load, 200-to-a-range restarts, 409 for another build. Every test of
    TransferTests runs here too, against the export.
    """

    async def setUp(self) -> None:  # type: ignore[override]
        await super().setUp()
        self.resource.export = True
        self.image_id = "sha256:" + "a" * 64
        self.rootfs = "sha256:" + "b" * 64
        self.resource.ids[(self.name, "1")] = (self.image_id, self.rootfs)
        self.rig.manager.images.resume_delay = 0.05
        self.size = len(self.resource.tars[(self.name, "1")])

    async def test_broken_download(self) -> None:
        """Every response breaks at 256 KiB: resumed until done, each resume where it stopped."""
        self.resource.break_after = 256 * 1024
        rec = Recorder()
        result = await self.rig.manager.images.transfer(parse_image_ref(self.ref), rec)
        self.assertIsNotNone(await self.rig.manager.images.inspect(parse_image_ref(self.ref)))
        self.assertEqual(result["bytes_done"], self.size)
        ranges = [r["range"] for r in self.resource.requests]
        expected = [None] + [f"bytes={n}-" for n in range(256 * 1024, self.size, 256 * 1024)]
        self.assertEqual(ranges, expected)
        self.assertEqual(result["resumed"], len(expected) - 1)
        self.assertTrue(any("resuming" in c["message"] for c in rec.calls))

    async def test_resume_once(self) -> None:
        """One break: one ranged request, the image loads, nothing sent twice."""
        self.resource.break_once_after = 300_000
        result = await self.rig.manager.images.transfer(parse_image_ref(self.ref), Recorder())
        self.assertEqual([r["range"] for r in self.resource.requests], [None, "bytes=300000-"])
        self.assertEqual((result["resumed"], result["restarted"]), (1, 0))
        self.assertEqual(self.resource.sent, self.size)
        self.assertIsNotNone(await self.rig.manager.images.inspect(parse_image_ref(self.ref)))

    async def test_200_to_a_range_restarts(self) -> None:
        """A 200 answering a ranged request starts the load over from byte 0, and it completes."""
        self.resource.break_once_after = 300_000
        self.resource.ignore_range = True
        result = await self.rig.manager.images.transfer(parse_image_ref(self.ref), Recorder())
        self.assertEqual(result["restarted"], 1)
        self.assertEqual(result["bytes_done"], self.size)
        self.assertIsNotNone(await self.rig.manager.images.inspect(parse_image_ref(self.ref)))

    async def test_resumes_exhausted(self) -> None:
        """A backend that never sends another byte: image_transfer_failed after the resumes."""
        self.rig.manager.images.resume_attempts = 2
        self.resource.break_once_after = 300_000
        self.resource.break_after = 0  # the resumes: headers, then the connection ends
        with self.assertRaises(CommandFailed) as cm:
            await self.rig.manager.images.transfer(parse_image_ref(self.ref), Recorder())
        self.assertEqual(cm.exception.error_code, "image_transfer_failed")
        self.assertIn("at 300000 of", cm.exception.error_message)
        self.assertIn("2 resumes in a row", cm.exception.error_message)
        self.assertEqual([r["range"] for r in self.resource.requests], [None] + ["bytes=300000-"] * 2)
        self.assertIsNone(await self.rig.manager.images.inspect(parse_image_ref(self.ref)))

    async def test_stalled_download(self) -> None:
        """
        A silent backend: dropped and resumed; a backend silent every time ends transfer_stalled.
        The resume it answers with silence (not even headers) is a stall too: bounded by the
        stall time (2 s here), not by the 60 s of a first request, hence this test's timeout.
        """
        self.rig.manager.images.resume_attempts = 1
        self.rig.manager.images.stall_sec = 2.0
        self.resource.stall_after = 256 * 1024
        with self.assertRaises(CommandFailed) as cm:
            await self.rig.manager.images.transfer(parse_image_ref(self.ref), Recorder())
        self.assertEqual(cm.exception.error_code, "transfer_stalled")
        self.assertEqual([r["range"] for r in self.resource.requests][:2], [None, f"bytes={256 * 1024}-"])
        self.assertIsNone(await self.rig.manager.images.inspect(parse_image_ref(self.ref)))

    test_stalled_download.timeout = 45  # type: ignore[attr-defined]

    async def test_pin_sent_and_mismatch_is_final(self) -> None:
        """expect_id/expect_rootfs go in the query; a 409 is server_image_mismatch, asked once."""
        images = self.rig.manager.images
        with self.assertRaises(CommandFailed) as cm:
            await images.transfer(parse_image_ref(self.ref), Recorder(), expect_id="sha256:" + "9" * 64)
        self.assertEqual(cm.exception.error_code, "server_image_mismatch")
        self.assertIn("different build", cm.exception.error_message)
        self.assertEqual(len(self.resource.requests), 1)
        self.assertIsNone(await images.inspect(parse_image_ref(self.ref)))
        await images.transfer(parse_image_ref(self.ref), Recorder(), expect_id="sha256:" + "9" * 64,
                              expect_rootfs=self.rootfs)
        self.assertEqual(
            self.resource.requests[-1]["args"],
            {"image": self.name, "tag": "1", "expect_id": "sha256:" + "9" * 64, "expect_rootfs": self.rootfs},
        )

    async def test_skipped_when_present(self) -> None:
        """transfer_from_server of a tag already here: no request; with a pin it must match."""
        images = self.rig.manager.images
        ref = parse_image_ref(self.ref)
        await images.transfer(ref, Recorder())
        local = await images.inspect(ref)
        assert local is not None
        self.assertTrue(local["rootfs_digest"].startswith("sha256:"))
        self.resource.requests.clear()
        steps: list[tuple[str, str]] = []

        def progress(phase: str, message: str, **kw: Any) -> None:
            steps.append((phase, message))

        out = await images.ensure(ref, "transfer_from_server", progress)
        self.assertTrue(out["transfer_skipped"])
        out = await images.ensure(ref, "transfer_from_server", progress, expect_rootfs=local["rootfs_digest"])
        self.assertTrue(out["transfer_skipped"])
        self.assertEqual(self.resource.requests, [])
        self.assertIn("already on this node", steps[0][1])
        # Present, but not the pinned build: transferred, with the pin in the query.
        self.resource.ids[(self.name, "1")] = (self.image_id, "sha256:" + "c" * 64)
        out = await images.ensure(ref, "transfer_from_server", progress, expect_rootfs="sha256:" + "c" * 64)
        self.assertNotIn("transfer_skipped", out)
        self.assertEqual(self.resource.requests[0]["args"]["expect_rootfs"], "sha256:" + "c" * 64)
