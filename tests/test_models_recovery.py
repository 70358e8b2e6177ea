"""
Model sync recovery paths, against the stand-in backend's model files on 127.0.0.1 (real
sockets, real threads):

- a resumed blob whose joined content fails verification is downloaded again from zero;
- a 206 whose Content-Range starts elsewhere than the offset asked is never spliced in;
- HTTP 416 on a resume starts the blob over without Range;
- ENOSPC while writing a blob gives one clear insufficient_disk failure and no blob file
  (nothing corrupt in the store), and a later sync with space completes.
"""

from __future__ import annotations

import errno
import hashlib
import os
from typing import Any

from twisted.trial.unittest import TestCase

from llmport_agent.commands.base import CommandFailed

from .test_models import DIR_NAME, MODEL_ID, REPO_ID, _files, _LoopbackSync


class _Base(TestCase):
    timeout = 120
    connections = 1
    segment = 8 * 1024 * 1024
    ranged = False
    # borrowed from the loopback sync tests, without their test methods
    setUp = _LoopbackSync.setUp
    _teardown = _LoopbackSync._teardown
    syncer = _LoopbackSync.syncer
    assertValidCache = _LoopbackSync.assertValidCache

    def leave_part(self, blob_hash: str, data: bytes) -> str:
        """A .part left by an interrupted earlier run."""
        blobs = os.path.join(self.store, DIR_NAME, "blobs")
        os.makedirs(blobs, exist_ok=True)
        path = os.path.join(blobs, blob_hash + ".part")
        with open(path, "wb") as f:
            f.write(data)
        return path

    def big(self, big_mb: int = 2) -> tuple[dict[str, Any], dict[str, bytes], str]:
        files = _files(big_mb=big_mb)
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files)
        return manifest, files, hashlib.sha256(files["model.safetensors"]).hexdigest()

    async def sync(self, manifest: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self.syncer().sync(manifest, lambda *a, **k: None)
        return result


class ResumeVerificationTests(_Base):
    async def test_resumed_blob_that_fails_verification_is_downloaded_again(self) -> None:
        """
        The .part of an earlier run holds bytes of another version: the resumed blob fails
        its sha256, so it is fetched once more from zero (not declared bad, not kept).
        """
        manifest, files, big = self.big()
        stale = bytes(b ^ 0xFF for b in files["model.safetensors"][:777_777])
        self.leave_part(big, stale)
        result = await self.sync(manifest)
        self.assertValidCache(manifest, files)
        self.assertEqual(result["resumed"], 1)
        reqs = self.repo.blob_requests(big)
        self.assertEqual([r.range_header for r in reqs], ["bytes=777777-", None])
        self.assertEqual([r.status for r in reqs], [206, 200])
        self.assertIn("open_fresh_part", self.runner.names())

    async def test_second_failure_is_a_checksum_mismatch(self) -> None:
        """Fetched again from zero and still wrong: the blob is bad, said once, nothing kept."""
        manifest, files, big = self.big()
        self.leave_part(big, b"\0" * 777_777)
        self.repo.faults.corrupt_blob = big
        with self.assertRaises(CommandFailed) as cm:
            await self.sync(manifest)
        self.assertEqual(cm.exception.error_code, "checksum_mismatch")
        self.assertEqual(len(self.repo.blob_requests(big)), 2)
        blobs = os.path.join(self.store, DIR_NAME, "blobs")
        self.assertFalse(os.path.exists(os.path.join(blobs, big)))


class ContentRangeStartTests(_Base):
    async def test_range_from_another_start_is_not_spliced(self) -> None:
        """
        Asked for bytes=777777-, the server answers 206 from 0 (Content-Range bytes 0-...):
        the response is abandoned and the blob starts over as one stream; the misplaced
        bytes are never written at 777777 (no verification failure, no second fresh start).
        """
        manifest, files, big = self.big()
        self.leave_part(big, files["model.safetensors"][:777_777])
        self.repo.faults.wrong_range_start = 0
        await self.sync(manifest)
        self.assertValidCache(manifest, files)
        reqs = self.repo.blob_requests(big)
        self.assertEqual([(r.range_header, r.status, r.start) for r in reqs][:1], [("bytes=777777-", 206, 0)])
        self.assertEqual(reqs[-1].range_header, None)
        names = self.runner.names()
        self.assertNotIn("open_fresh_part", names)  # never failed verification
        self.assertEqual(names.count("finish_part"), len(manifest["blobs"]))

    async def test_later_start_is_not_spliced_either(self) -> None:
        """A 206 that starts after the offset (a gap) is refused the same way."""
        manifest, files, big = self.big()
        self.leave_part(big, files["model.safetensors"][:777_777])
        self.repo.faults.wrong_range_start = 900_000
        await self.sync(manifest)
        self.assertValidCache(manifest, files)
        self.assertNotIn("open_fresh_part", self.runner.names())


class RangeRefusedTests(_Base):
    async def test_416_on_resume_starts_over(self) -> None:
        """HTTP 416 for the resume: the blob is fetched from zero without Range, and completes."""
        manifest, files, big = self.big()
        self.leave_part(big, files["model.safetensors"][:777_777])
        self.repo.faults.refuse_range_times = 1
        await self.sync(manifest)
        self.assertValidCache(manifest, files)
        reqs = self.repo.blob_requests(big)
        self.assertEqual([(r.range_header, r.status) for r in reqs], [("bytes=777777-", 416), (None, 200)])

    async def test_416_every_time_still_completes(self) -> None:
        """A server that refuses every range: one start over, no loop of ranged requests."""
        manifest, files, big = self.big()
        self.leave_part(big, files["model.safetensors"][:777_777])
        self.repo.faults.refuse_range_times = 1000
        await self.sync(manifest)
        self.assertValidCache(manifest, files)
        self.assertLessEqual(len(self.repo.blob_requests(big)), 2)


class DiskFullTests(_Base):
    async def test_enospc_mid_blob(self) -> None:
        manifest, files, big = self.big(big_mb=4)
        real = os.pwritev
        written = [0]

        def pwritev(fd: int, buffers: Any, offset: int) -> int:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.endswith(big + ".part"):
                if written[0] > 1_000_000:
                    raise OSError(errno.ENOSPC, "No space left on device")
                n = real(fd, buffers, offset)
                written[0] += n
                return n
            return real(fd, buffers, offset)

        self.patch(os, "pwritev", pwritev)
        with self.assertRaises(CommandFailed) as cm:
            await self.sync(manifest)
        e = cm.exception
        self.assertEqual(e.error_code, "insufficient_disk")
        self.assertIn("ran out of disk space", e.error_message)
        self.assertIn(REPO_ID, e.error_message)
        self.assertNotIn("Traceback", e.error_message)
        self.assertEqual(len(e.error_message.splitlines()), 1)
        model_dir = os.path.join(self.store, DIR_NAME)
        # No blob file for the blob that could not be written, no snapshot pointing at it.
        self.assertFalse(os.path.exists(os.path.join(model_dir, "blobs", big)))
        self.assertFalse(os.path.exists(os.path.join(model_dir, "snapshots", manifest["snapshots"][0]["commit"])))
        # Space again: the next sync completes with a valid cache.
        self.patch(os, "pwritev", real)
        await self.sync(manifest)
        self.assertValidCache(manifest, files)
