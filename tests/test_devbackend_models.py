"""
The stand-in backend's model availability (protocol 10.4): C{sync_model} progress marks the
model SYNCING on the node (C{progress_pct} or C{progress}, C{message}); a successful result
marks it READY from C{root_path}, C{revision}, C{manifest_sha256}, C{total_size}; a failure
marks it FAILED with the message. Exposed as L{DevBackend.model_availability} and
C{GET /dev/nodes/<id>/models}.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.devbackend._state import BackendState


class ModelAvailabilityTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1_700_000_000)
        self.state = BackendState(self.clock)
        token = self.state.mint_token()["token"]
        self.node = self.state.enroll(token, "node-a", "10.0.0.5", {}, "1.0", "127.0.0.1")["node_id"]

    def sync(self, model_id: str = "m1") -> str:
        cmd = self.state.issue_command(self.node, "sync_model", {"model_sync": {"model_id": model_id}})
        self.state.take_dispatch(self.node)
        return str(cmd["id"])

    def frame(self, **frame: Any) -> None:
        self.state.apply_frame(self.node, frame)

    def rows(self) -> list[dict[str, Any]]:
        return list(self.state.model_availability.get(self.node, {}).values())

    def test_progress_then_ready(self) -> None:
        cid = self.sync()
        self.frame(type="command_progress", command_id=cid, phase="sync_model", message="Downloading", progress_pct=42.5)
        [row] = self.rows()
        self.assertEqual((row["status"], row["progress"], row["status_message"]), ("syncing", 42.5, "Downloading"))
        self.frame(type="command_progress", command_id=cid, message="old style", progress=50)
        self.assertEqual(self.rows()[0]["progress"], 50.0)
        self.frame(
            type="command_result", command_id=cid, success=True,
            result={"root_path": "/srv/m/models--a--b/snapshots/" + "c" * 40, "revision": "c" * 40,
                    "manifest_sha256": "d" * 64, "total_size": 1234, "model_id": "m1"},
        )
        [row] = self.rows()
        self.assertEqual(row["status"], "ready")
        self.assertEqual(row["root_path"], "/srv/m/models--a--b/snapshots/" + "c" * 40)
        self.assertEqual((row["revision"], row["manifest_sha256"], row["size_bytes"]), ("c" * 40, "d" * 64, 1234))
        self.assertEqual(row["progress"], 100.0)
        self.assertIsNone(row["status_message"])
        self.assertEqual(self.state.anomalies.get(self.node, []), [])

    def test_ready_without_fields_is_noted(self) -> None:
        """An old-style result (nothing the current backend reads) is READY without a path, and noted."""
        cid = self.sync()
        self.frame(type="command_result", command_id=cid, success=True, result={"fetched": {}})
        [row] = self.rows()
        self.assertEqual((row["status"], row["root_path"], row["revision"]), ("ready", None, None))
        notes = self.state.anomalies[self.node]
        self.assertTrue(any("without result.root_path" in n for n in notes))
        self.assertTrue(any("without result.manifest_sha256" in n for n in notes))

    def test_failure(self) -> None:
        cid = self.sync()
        self.frame(type="command_result", command_id=cid, success=False, error_code="snapshot_missing",
                   error_message="no snapshot directory")
        [row] = self.rows()
        self.assertEqual((row["status"], row["status_message"]), ("failed", "no snapshot directory"))

    def test_april_reads_nothing(self) -> None:
        """The April generation reads nothing of sync_model (protocol 4): no availability kept."""
        self.state = BackendState(self.clock, generation="2026-04")
        token = self.state.mint_token()["token"]
        self.node = self.state.enroll(token, "node-a", "10.0.0.5", {}, "1.0", "127.0.0.1")["node_id"]
        cid = self.sync()
        self.frame(type="command_progress", command_id=cid, message="x", progress_pct=5)
        self.frame(type="command_result", command_id=cid, success=True, result={"root_path": "/x"})
        self.assertEqual(self.rows(), [])
        self.assertEqual(self.state.commands[cid].status, "succeeded")

    def test_progress_without_percentage_is_noted(self) -> None:
        cid = self.sync()
        self.frame(type="command_progress", command_id=cid, message="working")
        self.assertEqual(self.rows()[0]["progress"], 0.0)
        self.assertTrue(any("without progress_pct" in n for n in self.state.anomalies[self.node]))


class RemoveSetsStoppedTests(SynchronousTestCase):
    """protocol 10.4: a successful remove_workload sets the runtime stopped (current only)."""

    def run_remove(self, generation: str) -> str:
        clock = Clock()
        clock.advance(1_700_000_000)
        state = BackendState(clock, generation=generation)
        token = state.mint_token()["token"]
        node = state.enroll(token, "node-a", "10.0.0.5", {}, "1.0", "127.0.0.1")["node_id"]
        rid = "6f1c3f5e-8a51-4c51-9a43-0d8c3f7a1b22"
        deploy = state.issue_command(node, "deploy_workload", {"runtime_id": rid})
        state.apply_frame(node, {"type": "command_result", "command_id": deploy["id"], "success": True,
                                 "result": {"endpoint_url": "http://127.0.0.1:9001"}})
        self.assertEqual(state.runtimes[rid].status, "running")
        remove = state.issue_command(node, "remove_workload", {"runtime_id": rid})
        state.apply_frame(node, {"type": "command_result", "command_id": remove["id"], "success": True})
        return state.runtimes[rid].status

    def test_current(self) -> None:
        self.assertEqual(self.run_remove("current"), "stopped")

    def test_april(self) -> None:
        self.assertEqual(self.run_remove("2026-04"), "running")


class ImageIdentityTests(SynchronousTestCase):
    """The stand-in's command line reads an image's id and rootfs digest from its docker save tar."""

    def tar(self, members: dict[str, bytes]) -> str:
        import io
        import tarfile

        path = self.mktemp()
        with tarfile.open(path, "w") as tar:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return path

    def test_identity(self) -> None:
        import hashlib
        import json

        from llmport_agent.devbackend.imagetar import image_identity

        config = json.dumps({"rootfs": {"type": "layers", "diff_ids": ["sha256:" + "1" * 64, "sha256:" + "2" * 64]}}).encode()
        cid = hashlib.sha256(config).hexdigest()
        path = self.tar({f"{cid}.json": config, "manifest.json": json.dumps([{"Config": f"{cid}.json"}]).encode()})
        rootfs = "sha256:" + hashlib.sha256(("sha256:" + "1" * 64 + "\nsha256:" + "2" * 64).encode()).hexdigest()
        self.assertEqual(image_identity(path), ("sha256:" + cid, rootfs))
        oci = self.tar({f"blobs/sha256/{cid}": config, "manifest.json": json.dumps([{"Config": f"blobs/sha256/{cid}"}]).encode()})
        self.assertEqual(image_identity(oci), ("sha256:" + cid, rootfs))
        for bad in ({"x": b"y"}, {"manifest.json": b"{}"}, {"manifest.json": b"[{\"Config\": \"missing.json\"}]"}):
            self.assertEqual(image_identity(self.tar(bad)), (None, None))
        junk = self.mktemp()
        with open(junk, "wb") as f:
            f.write(b"not a tar at all" * 100)
        self.assertEqual(image_identity(junk), (None, None))
