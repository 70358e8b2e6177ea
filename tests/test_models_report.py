"""
What a C{sync_model} result carries for the current backend (protocol 10.4), which then marks
the model READY on the node: C{root_path} (the snapshot directory on this node), C{revision}
(the commit used), C{manifest_sha256} (the backend's digest of the manifest), C{total_size},
C{synced}, C{model_id}, C{hf_repo_id}, C{model_dir_name}, C{cache_root}, C{files_synced}; the
revision choice; a missing C{snapshots/<commit>} directory is a failure; progress frames carry
C{progress_pct} and C{message}.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from typing import Any, cast

from treq.client import HTTPClient
from treq.testing import StubTreq
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.base import Command, CommandFailed
from llmport_agent.devbackend.modelfiles import ModelRepository
from llmport_agent.models import ModelSyncer, parse_manifest, sync_model_handler_spec
from llmport_agent.models.manifest import choose_revision, manifest_digest

from .test_models import DIR_NAME, MODEL_ID, REPO_ID, SECRET, SyncRunner, _backend_root

C1, C2, C3 = "1" * 40, "2" * 40, "3" * 40


def backend_digest(m: dict[str, Any]) -> str:
    """protocol 10.4 / the backend's manifest digest, written out once more for the test."""
    canonical = {
        "blobs": sorted(({"hash": b["hash"], "size": b["size"]} for b in m["blobs"]), key=lambda x: x["hash"]),
        "refs": sorted(({"commit": r["commit"], "name": r["name"]} for r in m["refs"]), key=lambda x: x["name"]),
        "snapshots": sorted(
            (
                {"commit": s["commit"], "links": sorted(
                    ({"blob_hash": x["blob_hash"], "path": x["path"]} for x in s["links"]), key=lambda x: x["path"]
                )}
                for s in m["snapshots"]
            ),
            key=lambda x: x["commit"],
        ),
    }
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Ctx:
    def __init__(self, payload: dict[str, Any]) -> None:
        self.command = Command(id="c1", command_type="sync_model", payload=payload)
        self.frames: list[dict[str, Any]] = []

    def progress(self, phase: str, message: str, **extra: Any) -> None:
        self.frames.append({"phase": phase, "message": message, **extra})

    def emit_event(self, *a: Any, **k: Any) -> None:
        pass


class RevisionChoiceTests(SynchronousTestCase):
    def manifest(self, refs: dict[str, str], commits: list[str]) -> Any:
        return parse_manifest({
            "model_id": MODEL_ID, "hf_repo_id": REPO_ID, "model_dir_name": DIR_NAME,
            "blobs": [], "refs": [{"name": n, "commit": c} for n, c in refs.items()],
            "snapshots": [{"commit": c, "links": []} for c in commits],
        })

    def test_order(self) -> None:
        """Requested (ref or commit), else main, master, the first ref, the first snapshot."""
        m = self.manifest({"dev": C3, "main": C1, "master": C2}, [C1, C2, C3])
        self.assertEqual(choose_revision(m, "dev"), C3)
        self.assertEqual(choose_revision(m, C2), C2)
        self.assertEqual(choose_revision(m, None), C1)
        self.assertEqual(choose_revision(m, "nope"), C1)
        self.assertEqual(choose_revision(self.manifest({"dev": C3, "master": C2}, []), None), C2)
        self.assertEqual(choose_revision(self.manifest({"dev": C3, "v1": C2}, []), None), C3)
        self.assertEqual(choose_revision(self.manifest({}, [C2, C1]), None), C2)
        self.assertEqual(choose_revision(self.manifest({}, [C2, C1]), C1), C1)
        self.assertIsNone(choose_revision(self.manifest({}, []), "main"))

    def test_digest_matches_backend(self) -> None:
        """The digest is the backend's: order of entries in the manifest does not matter."""
        repo = ModelRepository()
        raw = repo.add_model(MODEL_ID, REPO_ID, {"b.json": b"{}", "a/w.bin": b"x" * 10, "c": b"c"})
        self.assertEqual(manifest_digest(parse_manifest(raw)), backend_digest(raw))
        self.assertEqual(raw["manifest_sha256"], backend_digest(raw))  # the stand-in agrees
        shuffled = copy.deepcopy(raw)
        shuffled["blobs"].reverse()
        shuffled["snapshots"][0]["links"].reverse()
        self.assertEqual(manifest_digest(parse_manifest(shuffled)), backend_digest(raw))
        changed = copy.deepcopy(raw)
        changed["blobs"][0]["size"] += 1
        self.assertNotEqual(manifest_digest(parse_manifest(changed)), backend_digest(raw))


class SyncModelResultTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.repo = ModelRepository()
        self.stub = StubTreq(_backend_root(self.repo))
        self.store = os.path.abspath(self.mktemp())
        self.syncer = ModelSyncer(
            self.clock,
            cast(HTTPClient, self.stub),
            SyncRunner(),
            store_dir=self.store,
            backend_url="http://backend.invalid:8000/",
            credential=lambda: SECRET,
            free_space=lambda path: 10**12,
        )
        self.spec = sync_model_handler_spec(self.syncer)

    def run_handler(self, payload: dict[str, Any]) -> tuple[Ctx, Deferred[dict[str, Any]]]:
        ctx = Ctx(payload)
        d: Deferred[dict[str, Any]] = ensureDeferred(cast(Any, self.spec.handler(cast(Any, ctx))))
        for _ in range(40):
            self.stub.flush()
            if d.called:
                break
            self.clock.advance(1)
        return ctx, d

    def test_result_fields(self) -> None:
        """Every field the backend reads, with the snapshot directory that exists."""
        files = {"config.json": b'{"a": 1}', "nested/w.bin": b"w" * 5000}
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, files, commit=C1)
        ctx, d = self.run_handler({"model_sync": manifest})
        result = self.successResultOf(d)
        root = os.path.join(self.store, DIR_NAME, "snapshots", C1)
        self.assertEqual(result["root_path"], root)
        self.assertTrue(os.path.isdir(root))
        with open(os.path.join(root, "config.json"), "rb") as f:
            self.assertEqual(f.read(), files["config.json"])
        self.assertEqual(result["revision"], C1)
        self.assertEqual(result["manifest_sha256"], backend_digest(manifest))
        self.assertEqual(result["total_size"], sum(len(v) for v in files.values()))
        self.assertIs(result["synced"], True)
        self.assertEqual(result["model_id"], MODEL_ID)
        self.assertEqual(result["hf_repo_id"], REPO_ID)
        self.assertEqual(result["model_dir_name"], DIR_NAME)
        self.assertEqual(result["cache_root"], self.store)
        self.assertEqual(result["files_synced"], 2)
        json.dumps(result)  # a JSON object
        # Progress: every frame with progress_pct and message (the backend's SYNCING row).
        self.assertTrue(ctx.frames)
        for frame in ctx.frames:
            self.assertIsInstance(frame["message"], str)
            self.assertTrue(frame["message"])
            self.assertIsInstance(frame["progress_pct"], (int, float))
        self.assertEqual(ctx.frames[-1]["progress_pct"], 100.0)

    def test_requested_revision(self) -> None:
        """A requested ref (payload or model_sync) picks its commit; an unknown one falls back to main."""
        self.repo.add_model(MODEL_ID, REPO_ID, {"a": b"1"}, commit=C1, ref="main")
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, {"a": b"2"}, commit=C2, ref="v2")
        _, d = self.run_handler({"model_sync": manifest, "revision": "v2"})
        self.assertEqual(self.successResultOf(d)["revision"], C2)
        _, d = self.run_handler({"model_sync": dict(manifest, revision=C1)})
        r = self.successResultOf(d)
        self.assertEqual((r["revision"], r["root_path"]), (C1, os.path.join(self.store, DIR_NAME, "snapshots", C1)))
        _, d = self.run_handler({"model_sync": manifest, "revision": "v9"})
        self.assertEqual(self.successResultOf(d)["revision"], C1)

    def test_missing_snapshot_is_a_failure(self) -> None:
        """A ref whose commit has no snapshot: snapshot_missing, naming the path; no READY claim."""
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, {"a": b"1"}, commit=C1)
        manifest = copy.deepcopy(manifest)
        manifest["refs"] = [{"name": "main", "commit": C3}]
        _, d = self.run_handler({"model_sync": manifest})
        exc = self.failureResultOf(d, CommandFailed).value
        self.assertEqual(exc.error_code, "snapshot_missing")
        self.assertIn(os.path.join(DIR_NAME, "snapshots", C3), exc.error_message)
        no_revision = dict(manifest, refs=[], snapshots=[])
        _, d = self.run_handler({"model_sync": no_revision})
        self.assertEqual(self.failureResultOf(d, CommandFailed).value.error_code, "snapshot_missing")

    def test_symlinked_snapshot_is_not_a_directory(self) -> None:
        """A symlink in place of snapshots/<commit> does not count as the model's directory."""
        manifest = self.repo.add_model(MODEL_ID, REPO_ID, {"a": b"1"}, commit=C1)
        self.successResultOf(self.run_handler({"model_sync": manifest})[1])
        snaps = os.path.join(self.store, DIR_NAME, "snapshots")
        os.symlink(os.path.join(snaps, C1), os.path.join(snaps, C3))
        bad = copy.deepcopy(manifest)
        bad["refs"] = [{"name": "main", "commit": C3}]
        _, d = self.run_handler({"model_sync": bad})
        self.assertEqual(self.failureResultOf(d, CommandFailed).value.error_code, "snapshot_missing")

    def test_download_from_hf_is_refused(self) -> None:
        """sync_model of a download_from_hf model: refused (a READY claim for nothing copied)."""
        _, d = self.run_handler({"model_sync": {"source": "download_from_hf", "hf_repo_id": "org/x"}})
        exc = self.failureResultOf(d, CommandFailed).value
        self.assertEqual(exc.error_code, "invalid_command")
        self.assertIn("downloaded by the workload's container", exc.error_message)
