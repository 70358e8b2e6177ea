"""
Hostile tests of the model store: MODEL_STORE is mounted into workload containers, so a
container can plant symbolic links, FIFOs and device nodes where the agent (root) keeps its
own directories and files. The agent must never follow them: a sentinel directory outside
the store, which the planted links point at, must come out of every sync untouched.

 - L{PlantedStoreTests}: the plants are made by the test process (runs everywhere).
 - L{ContainerPlantedStoreTests}: the same plants made by a container on the real Docker
   engine through its mount of the store, before the sync.
 - L{ReadOnlyStoreMountTests}: a C{sync_from_server} workload (and every workload with
   C{MODEL_STORE_READ_ONLY}) gets the store read-only: a write from inside fails.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import signal
import stat
from typing import Any

from treq.client import HTTPClient
from twisted.internet import reactor as _global_reactor
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.server import Site

from llmport_agent.commands.base import CommandFailed
from llmport_agent.core import safefs
from llmport_agent.core.threads import PoolService
from llmport_agent.devbackend.modelfiles import ModelRepository
from llmport_agent.models import ModelSyncer
from tests.support.docker_env import BUSYBOX, require_docker
from tests.support.rig import SERVE, WorkloadTestBase, httpd_payload
from tests.test_models import SECRET, _backend_root, _TrackingFactory

reactor: Any = _global_reactor

# (model, relative path in the model directory, kind, target in the sentinel or "")
# kind: "link" (a symlink to the sentinel path), "fifo", "chardev", "dir"
PLANTS: list[tuple[str, str, str, str]] = [
    ("tmp", ".llmport-tmp", "link", "tmpdir"),  # was emptied: the sentinel lost its files
    ("blobs", "blobs", "link", "blobsdir"),  # blobs were written into the sentinel as root
    ("refs", "refs", "link", "refsdir"),
    ("refs", "snapshots", "link", "snapdir"),
    ("files", "blobs/{big}", "link", "victim-blob.txt"),
    ("files", "blobs/{tok}.part", "link", "victim-part.txt"),
    ("files", "blobs/{cfg}.progress", "link", "victim-progress.txt"),
    ("files", "refs/main", "link", "victim-ref.txt"),
    ("files", ".llmport-verified.json", "link", "victim-record.txt"),
    ("files", "snapshots/{commit}", "link", "snapdir2"),
    ("dir", "", "link", "modeldir"),  # the model directory itself
    ("fifo", "blobs/{big}.part", "fifo", ""),  # opening it would block a thread
    ("fifo", "blobs/{tok}", "fifo", ""),
    ("fifo", "blobs/{cfg}.part", "chardev", ""),  # /dev/zero's numbers: never opened
    ("deep", "refs/pr", "link", "prdir"),  # the ref pr/1 would have been written into it
    ("deep", ".llmport-tmp/x/y", "dir", ""),
    ("deep", ".llmport-tmp/x/y/escape", "link", "tmpdir2"),  # cleanup removes the link only
]
MODELS = sorted({m for m, *_ in PLANTS})


def _files() -> dict[str, bytes]:
    rng = random.Random(21)
    return {
        "config.json": b'{"model_type": "llama"}',
        "tokenizer.json": rng.randbytes(40_000),
        "model.safetensors": rng.randbytes(3 * 1024 * 1024 + 17),
    }


def make_sentinel(root: str) -> str:
    """A directory tree outside the store with content the planted links point at."""
    sentinel = os.path.join(root, "sentinel")
    for d in ("tmpdir/sub", "tmpdir2", "blobsdir", "refsdir", "snapdir", "snapdir2", "prdir",
              "modeldir"):
        os.makedirs(os.path.join(sentinel, d))
    for rel in ("tmpdir/a", "tmpdir/sub/b", "tmpdir2/c", "snapdir2/d", "modeldir/e",
                "victim-blob.txt", "victim-part.txt", "victim-progress.txt", "victim-ref.txt",
                "victim-record.txt"):
        with open(os.path.join(sentinel, rel), "wb") as f:
            f.write(b"host data that must survive: " + rel.encode())
    return sentinel


def tree_state(root: str) -> dict[str, tuple[str, int, str]]:
    """Every entry under C{root} (not following links): kind, mode, content hash."""
    out: dict[str, tuple[str, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            digest = ""
            if stat.S_ISREG(st.st_mode):
                with open(full, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(full, root)] = (stat.filemode(st.st_mode), st.st_size, digest)
    return out


def make_deep_tree(top: str, depth: int) -> None:
    """C{top}/d/d/.../d, C{depth} levels below C{top} (deeper than a path may be long)."""
    os.makedirs(top)
    d = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=d)
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=d)
        os.close(d)
        d = child
    os.close(d)


class _StoreRig:
    """The stand-in backend on 127.0.0.1 with one model per plant group, and a syncer."""

    def __init__(self, case: TestCase, store: str) -> None:
        self.repo = ModelRepository()
        self.files = _files()
        self.manifests = {
            name: self.repo.add_model(f"model-{name}", f"acme/{name}", self.files, ref="main")
            for name in MODELS
        }
        self.manifests["deep"] = self.repo.add_model(
            "model-deep", "acme/deep", self.files, ref="pr/1"
        )
        h = {k: hashlib.sha256(v).hexdigest() for k, v in self.files.items()}
        self.names = {
            "big": h["model.safetensors"],
            "tok": h["tokenizer.json"],
            "cfg": h["config.json"],
            "commit": self.manifests["files"]["refs"][0]["commit"],
        }
        site = Site(_backend_root(self.repo))
        self.factory = _TrackingFactory(site)
        self.port = reactor.listenTCP(0, self.factory, interface="127.0.0.1")
        self.pool = PoolService(reactor, "store-hostile", 9)
        self.pool.startService()
        self.http_pool = HTTPConnectionPool(reactor, persistent=True)
        self.store = store
        self.syncer = ModelSyncer(
            reactor,
            HTTPClient(Agent(reactor, pool=self.http_pool)),
            self.pool,
            store_dir=store,
            backend_url=f"http://127.0.0.1:{self.port.getHost().port}",
            credential=lambda: SECRET,
            retry_initial_delay=0.01,
            retry_max_delay=0.05,
            connections=2,
            segment_size=1024 * 1024,
        )
        case.addCleanup(self.stop)

    async def stop(self) -> None:
        await self.http_pool.closeCachedConnections()
        await self.pool.stopService()
        await self.port.stopListening()
        await self.factory.close_all()

    def plant_path(self, model: str, rel: str) -> str:
        return os.path.join(f"models--acme--{model}", rel.format(**self.names)).rstrip("/")


class _PlantedStoreChecks:
    """What must hold after a sync of a store full of plants."""

    timeout = 120

    def setUp(self) -> None:
        root = os.path.abspath(self.mktemp())  # type: ignore[attr-defined]
        self.store = os.path.join(root, "store")
        os.makedirs(self.store)
        self.sentinel = make_sentinel(root)
        self.before = tree_state(self.sentinel)
        self.rig = _StoreRig(self, self.store)  # type: ignore[arg-type]

    async def sync_all_and_check(self, planted: bool = True) -> None:
        results: dict[str, dict[str, Any]] = {}
        for name in MODELS:
            results[name] = await self.rig.syncer.sync(
                self.rig.manifests[name], lambda *a, **k: None
            )
        # The sentinel is exactly as it was: nothing deleted, written, created or moved.
        self.assertEqual(tree_state(self.sentinel), self.before)  # type: ignore[attr-defined]
        for name, result in results.items():
            self.assertValidModel(name, self.rig.manifests[name])
            removed = " ".join(result["removed_foreign"])
            if not planted:
                self.assertEqual(removed, "")  # type: ignore[attr-defined]
                continue
            for rel in [rel for m, rel, *_ in PLANTS if m == name]:
                if rel.startswith(".llmport-tmp/x"):
                    continue  # inside the temporary folder: removed with it, not reported
                path = os.path.join(self.store, self.rig.plant_path(name, rel))
                self.assertIn(path + ":", removed + " ", f"{name}: {rel} not reported")
        # The only links left in the store are the snapshot links the agent made: relative,
        # pointing into the model's own blobs.
        for dirpath, dirnames, filenames in os.walk(self.store):
            for entry in dirnames + filenames:
                full = os.path.join(dirpath, entry)
                st = os.lstat(full)
                if stat.S_ISLNK(st.st_mode):
                    rel = os.path.relpath(full, self.store).split(os.sep)
                    self.assertEqual(rel[1], "snapshots", full)  # type: ignore[attr-defined]
                    target = os.readlink(full)
                    self.assertFalse(os.path.isabs(target), full)  # type: ignore[attr-defined]
                    resolved = os.path.realpath(full)
                    self.assertEqual(  # type: ignore[attr-defined]
                        os.path.dirname(resolved),
                        os.path.realpath(os.path.join(self.store, rel[0], "blobs")),
                    )
                else:
                    self.assertTrue(  # type: ignore[attr-defined]
                        stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode), full
                    )

    def assertValidModel(self, name: str, manifest: dict[str, Any]) -> None:  # noqa: N802
        model_dir = os.path.join(self.store, manifest["model_dir_name"])
        self.assertFalse(os.path.islink(model_dir))  # type: ignore[attr-defined]
        for blob in manifest["blobs"]:
            path = os.path.join(model_dir, "blobs", blob["hash"])
            st = os.lstat(path)
            self.assertTrue(stat.S_ISREG(st.st_mode), path)  # type: ignore[attr-defined]
            with open(path, "rb") as f:
                self.assertEqual(hashlib.sha256(f.read()).hexdigest(), blob["hash"])  # type: ignore[attr-defined]
        for ref in manifest["refs"]:
            path = os.path.join(model_dir, "refs", *ref["name"].split("/"))
            self.assertTrue(stat.S_ISREG(os.lstat(path).st_mode), path)  # type: ignore[attr-defined]
            with open(path, "rb") as f:
                self.assertEqual(f.read(), ref["commit"].encode())  # type: ignore[attr-defined]
        for snap in manifest["snapshots"]:
            root = os.path.join(model_dir, "snapshots", snap["commit"])
            self.assertFalse(os.path.islink(root))  # type: ignore[attr-defined]
            for link in snap["links"]:
                with open(os.path.join(root, *link["path"].split("/")), "rb") as f:
                    self.assertEqual(hashlib.sha256(f.read()).hexdigest(), link["blob_hash"])  # type: ignore[attr-defined]


class PlantedStoreTests(_PlantedStoreChecks, TestCase):
    """The plants made by the test process itself (no engine needed)."""

    def plant(self) -> None:
        for model, rel, kind, target in PLANTS:
            path = os.path.join(self.store, self.rig.plant_path(model, rel))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if kind == "link":
                os.symlink(os.path.join(self.sentinel, target), path)
            elif kind == "fifo":
                os.mkfifo(path)
            elif kind == "chardev":
                if os.geteuid() == 0:
                    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))
                else:
                    os.mkfifo(path)
            else:
                os.makedirs(path, exist_ok=True)

    async def test_planted_links_are_not_followed(self) -> None:
        """
        Symlinks planted for the temporary folder, blobs/, refs/, snapshots/, a blob, a
        .part, a progress record, a ref, the verification record, a snapshot, the model
        directory itself and a ref's parent directory, plus FIFOs and a device node where
        files belong: every sync succeeds, every plant is removed without being followed
        and reported in the result, and the sentinel they point at is untouched.
        """
        self.plant()
        await self.sync_all_and_check()

    async def test_repeat_syncs_stay_clean(self) -> None:
        """Planting again after a good sync is cleaned up by the next one just the same."""
        await self.sync_all_and_check(planted=False)
        self.before = tree_state(self.sentinel)
        for name in MODELS:  # the model dirs exist now: plants go over the real ones
            model_dir = os.path.join(self.store, f"models--acme--{name}")
            for sub in ("blobs", "refs", "snapshots", ".llmport-tmp"):
                path = os.path.join(model_dir, sub)
                for dirpath, dirnames, filenames in os.walk(path, topdown=False):
                    for f in filenames:
                        os.unlink(os.path.join(dirpath, f))
                    for d in dirnames:
                        full = os.path.join(dirpath, d)
                        (os.unlink if os.path.islink(full) else os.rmdir)(full)
                os.rmdir(path)
            os.unlink(os.path.join(model_dir, ".llmport-verified.json"))
            os.rmdir(model_dir)
        self.plant()
        await self.sync_all_and_check()


class ContainerPlantedStoreTests(_PlantedStoreChecks, TestCase):
    """The plants made by a workload container through its read-write mount of the store."""

    def script(self) -> str:
        lines = ["set -e", "cd /data/hf-cache"]
        for model, rel, kind, target in PLANTS:
            path = self.rig.plant_path(model, rel)
            parent = os.path.dirname(path)
            if parent:
                lines.append(f"mkdir -p '{parent}'")
            if kind == "link":
                lines.append(f"ln -s '{os.path.join(self.sentinel, target)}' '{path}'")
            elif kind == "fifo":
                lines.append(f"mkfifo '{path}'")
            elif kind == "chardev":
                lines.append(f"mknod '{path}' c 1 5 || mkfifo '{path}'")
            else:
                lines.append(f"mkdir -p '{path}'")
        lines.append("echo planted")
        return "\n".join(lines)

    async def test_container_plants_links_before_sync(self) -> None:
        """
        A container with the store mounted read-write (as a download_from_hf workload has
        it) plants links to a host directory in the tmp folder, blobs, refs, snapshots and a
        blob file (and the rest of the plants); the next syncs leave the host directory
        untouched.
        """
        env = require_docker()
        script = self.script()

        def run_container() -> bytes:
            client = env.client()
            container = client.containers.create(
                BUSYBOX,
                ["sh", "-c", script],
                volumes={self.store: {"bind": "/data/hf-cache", "mode": "rw"}},
                network_mode="none",
            )
            try:
                container.start()
                status = container.wait(timeout=60)
                logs: bytes = container.logs()
                if status.get("StatusCode") != 0:
                    raise AssertionError(f"planting failed: {logs!r}")
                return logs
            finally:
                container.remove(force=True)

        logs = await deferToThread(run_container)
        self.assertIn(b"planted", logs)
        self.assertTrue(os.path.islink(os.path.join(self.store, "models--acme--dir")))
        await self.sync_all_and_check()


class ReadOnlyStoreMountTests(WorkloadTestBase):
    """Who may write into the store from inside a container."""

    async def deploy_and_touch(self, model_sync: dict[str, Any], **overrides: Any) -> int:
        """Deploy an httpd workload with the store; return the exit code of a write inside."""
        store = os.path.abspath(self.mktemp())
        os.makedirs(store)

        async def sync_model(ms: dict[str, Any], progress: Any) -> dict[str, Any]:
            return {"fetched": 0}

        from tests.support.rig import Rig

        await self.rig.stop()
        self.rig = Rig(reactor, self.env, sync_model=sync_model, model_store=store, **overrides)
        await self.rig.start()
        payload = httpd_payload(script=SERVE, model_sync=model_sync)
        await self.rig.run("deploy_workload", payload)
        [container] = self.env.managed_containers(payload["runtime_id"])

        def touch() -> int:
            listing = container.exec_run(["ls", "/data/hf-cache"])
            if listing.exit_code != 0:
                raise AssertionError(f"the store is not readable inside: {listing.output!r}")
            return int(container.exec_run(["touch", "/data/hf-cache/probe"]).exit_code)

        code = await deferToThread(touch)
        self.assertEqual(os.path.exists(os.path.join(store, "probe")), code == 0)
        return code

    async def test_sync_from_server_workload_cannot_write(self) -> None:
        """A sync_from_server workload gets the store read-only: a write from inside fails."""
        code = await self.deploy_and_touch(
            {"source": "sync_from_server", "hf_repo_id": "org/m", "model_id": "m", "blobs": []}
        )
        self.assertNotEqual(code, 0)

    async def test_download_from_hf_writes_unless_forced_read_only(self) -> None:
        """
        A download_from_hf workload downloads into the store (read-write), unless the
        operator set MODEL_STORE_READ_ONLY.
        """
        hf = {"source": "download_from_hf", "hf_repo_id": "org/m"}
        self.assertEqual(await self.deploy_and_touch(hf), 0)
        self.env.remove_all_containers()
        self.assertNotEqual(await self.deploy_and_touch(hf, model_store_read_only=True), 0)


class SafeFsTests(SynchronousTestCase):
    """The primitives under the store never follow a link, never open a FIFO or device."""

    def setUp(self) -> None:
        root = os.path.abspath(self.mktemp())
        self.sentinel = make_sentinel(root)
        self.before = tree_state(self.sentinel)
        self.dir = os.path.join(root, "work")
        os.makedirs(self.dir)
        self.fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        self.addCleanup(os.close, self.fd)
        # A hang (an open that blocks on a FIFO) must fail the test, not the whole run.
        signal.signal(signal.SIGALRM, self._timeout)
        signal.alarm(20)
        self.addCleanup(signal.alarm, 0)

    def _timeout(self, *_: Any) -> None:
        raise AssertionError("blocked: something opened a FIFO")

    def tearDown(self) -> None:
        self.assertEqual(tree_state(self.sentinel), self.before)

    def test_remove_tree_unlinks_links(self) -> None:
        """A tree holding links to directories and files outside is removed; they are not."""
        top = os.path.join(self.dir, "t")
        os.makedirs(os.path.join(top, "a", "b"))
        os.symlink(os.path.join(self.sentinel, "tmpdir"), os.path.join(top, "a", "dirlink"))
        os.symlink(os.path.join(self.sentinel, "victim-blob.txt"), os.path.join(top, "a", "b", "f"))
        os.mkfifo(os.path.join(top, "fifo"))
        safefs.remove_tree(self.fd, "t")
        self.assertEqual(os.listdir(self.dir), [])
        # The top itself being a link: the link goes, not its target's content.
        os.symlink(os.path.join(self.sentinel, "tmpdir"), os.path.join(self.dir, "t2"))
        safefs.remove_tree(self.fd, "t2")
        self.assertEqual(os.listdir(self.dir), [])

    def test_remove_tree_a_directory_swapped_for_a_link_before_its_rmdir(self) -> None:
        """
        A writer swaps an emptied directory for a link just before its rmdir (fault-injected:
        the real rmdir then fails ENOTDIR): the link goes, the removal finishes, the target stays.
        """
        top = os.path.join(self.dir, "t")
        os.makedirs(os.path.join(top, "a", "b"))
        real_rmdir = os.rmdir
        swapped: list[str] = []

        def rmdir(name: str, *, dir_fd: int | None = None) -> None:
            if name == "b" and not swapped:
                real_rmdir(name, dir_fd=dir_fd)
                os.symlink(os.path.join(self.sentinel, "tmpdir"), name, dir_fd=dir_fd)
                swapped.append(name)
            real_rmdir(name, dir_fd=dir_fd)

        self.patch(safefs.os, "rmdir", rmdir)
        safefs.remove_tree(self.fd, "t")
        self.assertEqual(swapped, ["b"])
        self.assertEqual(os.listdir(self.dir), [])

    def test_remove_tree_depth_cannot_stop_it(self) -> None:
        """
        Issue 29 #7: a tree far deeper than the descriptors held (a chain of 1000, a file and a
        link out at every level) is removed whole: no recursion, no descriptor leak, at most
        MAX_TREE_DEPTH held, no link followed (the sentinel's files stay).
        """
        top = os.path.join(self.dir, "deep")
        make_deep_tree(top, 1000)
        d = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
        for _level in range(1000):
            with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=d), "w") as f:
                f.write("x")
            os.symlink(os.path.join(self.sentinel, "tmpdir"), "out", dir_fd=d)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=d)
            os.close(d)
            d = child
        os.close(d)
        before = sorted(os.listdir(self.sentinel))
        fds = len(os.listdir("/proc/self/fd"))
        most = [0]
        real_open = os.open

        def counting_open(*a: Any, **kw: Any) -> int:
            fd = real_open(*a, **kw)
            most[0] = max(most[0], len(os.listdir("/proc/self/fd")))
            return fd

        self.patch(safefs.os, "open", counting_open)
        safefs.remove_tree(self.fd, "deep")
        self.assertEqual(os.listdir(self.dir), [])
        self.assertEqual(len(os.listdir("/proc/self/fd")), fds)
        # Two per level held (the directory and its listing), whatever the depth.
        self.assertLessEqual(most[0], fds + 2 * safefs.MAX_TREE_DEPTH + 8)
        self.assertEqual(sorted(os.listdir(self.sentinel)), before)

    def test_a_tree_that_keeps_growing_is_bounded(self) -> None:
        """More deep directories than MAX_HOISTED: ELOOP, not a walk for ever."""
        make_deep_tree(os.path.join(self.dir, "deep"), safefs.MAX_TREE_DEPTH * 4)
        self.patch(safefs, "MAX_HOISTED", 2)
        fds = len(os.listdir("/proc/self/fd"))
        with self.assertRaises(OSError) as cm:
            safefs.remove_tree(self.fd, "deep")
        self.assertEqual(cm.exception.errno, errno.ELOOP)
        self.assertEqual(len(os.listdir("/proc/self/fd")), fds)
        # Without the bound it goes (and leaves trial's recursive clean-up nothing too deep).
        self.patch(safefs, "MAX_HOISTED", 1 << 20)
        safefs.remove_tree(self.fd, "deep")
        self.assertEqual(os.listdir(self.dir), [])

    def test_open_file_refuses_links_fifos_devices(self) -> None:
        """open_file_at opens regular files only; the rest raise without being opened."""
        os.symlink(os.path.join(self.sentinel, "victim-blob.txt"), os.path.join(self.dir, "l"))
        os.mkfifo(os.path.join(self.dir, "fifo"))
        names = ["l", "fifo"]
        if os.geteuid() == 0:
            os.mknod(os.path.join(self.dir, "dev"), 0o600 | stat.S_IFCHR, os.makedev(1, 5))
            names.append("dev")
        for name in names:
            with self.assertRaises(safefs.NotRegularFile, msg=name):
                safefs.open_file_at(self.fd, name, os.O_RDWR)
        with open(os.path.join(self.dir, "ok"), "wb") as f:
            f.write(b"fine")
        fd, st = safefs.open_file_at(self.fd, "ok")
        os.close(fd)
        self.assertEqual(st.st_size, 4)

    def test_atomic_write_replaces_a_link(self) -> None:
        """atomic_write_at over a link replaces the link; the file it pointed at is unchanged."""
        os.symlink(os.path.join(self.sentinel, "victim-ref.txt"), os.path.join(self.dir, "ref"))
        safefs.atomic_write_at(self.fd, "ref", b"commit", 0o644)
        self.assertFalse(os.path.islink(os.path.join(self.dir, "ref")))
        with open(os.path.join(self.dir, "ref"), "rb") as f:
            self.assertEqual(f.read(), b"commit")

    def test_open_dir_replaces_what_is_in_the_way(self) -> None:
        """A link or a file where a directory belongs is removed and reported (create=True)."""
        os.symlink(os.path.join(self.sentinel, "blobsdir"), os.path.join(self.dir, "blobs"))
        with self.assertRaises(NotADirectoryError):
            safefs.open_dir_at(self.fd, "blobs")
        seen: list[tuple[str, str]] = []
        fd = safefs.open_dir_at(self.fd, "blobs", create=True,
                                on_foreign=lambda rel, what: seen.append((rel, what)))
        os.close(fd)
        self.assertEqual(seen, [("blobs", "a symbolic link")])
        self.assertTrue(os.path.isdir(os.path.join(self.dir, "blobs")))
        self.assertFalse(os.path.islink(os.path.join(self.dir, "blobs")))


class DeepPlantTests(TestCase):
    """A plant no descriptor bound can stop: the sync puts it right and proceeds."""

    timeout = 60

    async def test_too_deep_a_tree_in_the_temporary_folder(self) -> None:
        """
        Issue 29 #7: a chain of 300 directories planted in .llmport-tmp (deeper than the
        descriptors the removal holds) no longer fails every sync with ELOOP: it is removed and
        the sync proceeds.
        """
        store = os.path.abspath(self.mktemp())
        rig = _StoreRig(self, store)
        top = os.path.join(store, "models--acme--tmp", ".llmport-tmp", "deep")
        make_deep_tree(top, 300)
        await rig.syncer.sync(rig.manifests["tmp"], lambda *a, **k: None)
        self.assertFalse(os.path.lexists(top))
        self.assertEqual(os.listdir(os.path.join(store, "models--acme--tmp", ".llmport-tmp")), [])


class BlobIdentityTests(TestCase):
    """
    A workload that writes the store can rewrite a verified blob in place (restoring its
    mtime), or swap a download's `.part` name for a link just before it is moved into place.
    Neither may end in a blob that does not match its hash being taken as verified.
    """

    timeout = 60

    def setUp(self) -> None:
        root = os.path.abspath(self.mktemp())
        self.store = os.path.join(root, "store")
        os.makedirs(self.store)
        self.sentinel = make_sentinel(root)
        self.before = tree_state(self.sentinel)
        self.rig = _StoreRig(self, self.store)
        self.manifest = self.rig.manifests["files"]
        self.blob = os.path.join(self.store, self.rig.plant_path("files", "blobs/{big}"))

    async def sync(self) -> dict[str, Any]:
        return await self.rig.syncer.sync(self.manifest, lambda *a, **k: None)

    async def test_rewrite_in_place_with_the_mtime_restored(self) -> None:
        """
        Before: the record held size and mtime only, the next sync reused the rewritten blob
        and its snapshot served other content under the blob's hash.
        """
        await self.sync()
        st = os.stat(self.blob)
        with open(self.blob, "r+b") as f:
            f.write(b"\0" * 4096)  # same size, other content
        os.utime(self.blob, ns=(st.st_atime_ns, st.st_mtime_ns))
        self.assertEqual(os.stat(self.blob).st_mtime_ns, st.st_mtime_ns)
        await self.sync()
        _PlantedStoreChecks.assertValidModel(self, "files", self.manifest)  # type: ignore[arg-type]

    async def test_a_replacement_file_with_every_time_restored(self) -> None:
        """A new file (another inode) put in the blob's place is verified again, not reused."""
        await self.sync()
        st = os.stat(self.blob)
        with open(self.blob + ".evil", "wb") as f:
            f.write(b"\0" * st.st_size)
        os.utime(self.blob + ".evil", ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(self.blob + ".evil", self.blob)
        await self.sync()
        _PlantedStoreChecks.assertValidModel(self, "files", self.manifest)  # type: ignore[arg-type]

    async def test_part_swapped_for_a_link_before_the_rename(self) -> None:
        """
        The `.part` name is replaced by a symlink to a host file between the agent's check of
        the download (on its descriptor) and its rename: before, the link became the blob and
        the sync said succeeded. Now the link is removed and reported, the sync does not
        report a verified blob that is a link, the host file is untouched, and the next sync
        puts the right blob in place.
        """
        from llmport_agent.models import _fs

        part = self.blob + ".part"
        victim = os.path.join(self.sentinel, "victim-blob.txt")
        real_fsync = _fs.os.fsync
        swapped: list[str] = []

        def fsync(fd: int) -> None:
            real_fsync(fd)
            if not swapped and os.path.lexists(part) and os.path.samestat(os.fstat(fd), os.lstat(part)):
                os.rename(part, part + ".moved")
                os.symlink(victim, part)
                swapped.append(part)

        self.patch(_fs.os, "fsync", fsync)
        try:
            result: dict[str, Any] | None = await self.sync()
        except CommandFailed as exc:
            result = None
            self.assertIn("swapped", exc.error_message)
        self.assertEqual(swapped, [part])
        self.assertFalse(os.path.islink(self.blob), "the swapped link became the blob")
        if result is not None:
            self.assertIn(self.blob, " ".join(result["removed_foreign"]))
        self.assertEqual(tree_state(self.sentinel), self.before)
        self.patch(_fs.os, "fsync", real_fsync)
        await self.sync()
        _PlantedStoreChecks.assertValidModel(self, "files", self.manifest)  # type: ignore[arg-type]
