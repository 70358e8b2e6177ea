"""
The Ray command handlers against a fake engine (a faithful stand-in of the thread functions'
answers) and a stand-in backend over StubTreq: idempotent start and join, env to the exec
only, the image pin's error codes, the runtime container's reuse, and the cluster token's
privacy (fetched once per 300 s, 0600, deleted by stop_ray, in no result or log line).
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from treq.testing import StubTreq
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource

from llmport_agent.commands.base import CommandFailed
from llmport_agent.ray import container as rc
from llmport_agent.ray import describe, helpercli, imagepin
from llmport_agent.ray.execs import ExecResult
from llmport_agent.ray.handlers import (
    CURRENT_CLUSTER_FILE,
    VERIFY_UNAVAILABLE,
    RayManager,
    RaySettings,
    _head_address,
    ray_handler_specs,
)
from llmport_agent.ray.token import ClusterTokens
from llmport_agent.session.backend_http import BackendHTTP
from llmport_agent.workloads.policy import parse_allowlist
from tests.support.context import RecordingContext, make_command
from tests.test_ray_describe import APP, CANDIDATE, DEFAULTS, RUNNING

LAYERS = ("sha256:" + "1" * 64,)
IMAGE_ID = "sha256:" + "a" * 64
TOKEN = "tok-" + "s3cr3t" * 8
REF = "env-1-token"


class SecretResource(Resource):
    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.code = 200

    def render_GET(self, request: Any) -> bytes:
        self.calls += 1
        request.setResponseCode(self.code)
        if request.getHeader(b"authorization") != b"Bearer cred.secret":
            request.setResponseCode(401)
            return b'{"detail": "Invalid credential."}'
        if not request.path.endswith(REF.encode()):
            request.setResponseCode(404)
            return b'{"detail": "Secret not found."}'
        return json.dumps({"token": TOKEN}).encode()


class Pool:
    """Runs blocking functions inline (the unit tests' thread pool)."""

    def run(self, fn: Any, *args: Any, **kw: Any) -> Deferred[Any]:
        try:
            return succeed(fn(*args, **kw))
        except Exception as exc:  # noqa: BLE001
            from twisted.internet.defer import fail

            return fail(exc)


RUNTIME_IMAGE = "llmport-test/ray-runtime:2.58.0"


class FakeImageAPI:
    """The engine's image names (inspect, tag, remove), as docker-py's low-level API answers."""

    def __init__(self) -> None:
        #: name:tag -> (id, layers)
        self.names: dict[str, tuple[str, tuple[str, ...]]] = {}
        #: Every name an image was ever given, in order (a foreign build must never get the bundle's).
        self.tagged: list[tuple[str, str]] = []
        self.removed: list[str] = []

    def inspect_image(self, name: str) -> dict[str, Any]:
        import docker

        if name not in self.names:
            raise docker.errors.NotFound(f"No such image: {name}")
        image_id, layers = self.names[name]
        return {"Id": image_id, "RepoDigests": [], "RootFS": {"Layers": list(layers)}}

    def tag(self, image: str, repository: str, tag: str, force: bool = False) -> bool:
        entry = next(v for v in self.names.values() if v[0] == image)
        self.names[f"{repository}:{tag}"] = entry
        self.tagged.append((f"{repository}:{tag}", image))
        return True

    def remove_image(self, name: str) -> None:
        import docker

        if name not in self.names:
            raise docker.errors.NotFound(f"No such image: {name}")
        del self.names[name]
        self.removed.append(name)


class FakeEngine:
    """Answers the Ray thread functions the way the engine and Ray in the container do."""

    def __init__(self) -> None:
        self.api = FakeImageAPI()
        self.client = type("Client", (), {"api": self.api})()
        self.identity = imagepin.Identity(True, IMAGE_ID, (), LAYERS)
        self.container: dict[str, Any] | None = None
        self.cluster: str | None = None  # what ray_current_cluster says while a raylet runs
        self.execs: list[tuple[list[str], dict[str, str]]] = []
        self.created: list[dict[str, Any]] = []
        self.removed = 0
        self.updated = 0
        self.streams = 0
        self.hold_create: Deferred[None] | None = None
        self.helper_out = json.dumps({"alive": True, "version": "2.58.0", "num_nodes": 1, "nodes": []})
        #: What the describe program prints (wrapped in its markers), or a full ExecResult.
        self.describe_doc: dict[str, Any] | ExecResult = {"attached": True, "ray_version": "2.58.0", "nodes": [],
                                                          "serve": {"running": False}, "apps": [], "errors": []}
        self.programs: list[tuple[bytes | None, dict[str, str]]] = []

    @property
    def identity(self) -> imagepin.Identity:
        return imagepin.image_identity(self.client, RUNTIME_IMAGE)  # type: ignore[arg-type]

    @identity.setter
    def identity(self, identity: imagepin.Identity) -> None:
        """What the engine holds under the runtime image's name (absent: nothing)."""
        self.api.names.pop(RUNTIME_IMAGE, None)
        if identity.present:
            self.api.names[RUNTIME_IMAGE] = (identity.image_id, identity.diff_ids)

    async def call(self, fn: Any, *args: Any, what: str | None = None) -> Any:
        if fn in (imagepin.image_identity, imagepin.adopt, imagepin.drop_name):
            return fn(self.client, *args)
        if fn is rc.find:
            return self.container
        if fn is rc.create_and_start:
            if self.hold_create is not None:
                await self.hold_create
            args_ = args[0]
            self.created.append(args_)
            self.container = {
                "id": "c" * 64, "name": args_["name"], "labels": dict(args_["labels"]), "running": True,
                "status": "running", "started_at": "now", "image": None, "image_id": args_["image_id"],
                "mounts": {(b.split(":")[0], b.split(":")[1], b.endswith(":ro")) for b in args_["binds"]},
                "restart_policy": rc.RESTART_POLICY,
            }
            return self.container
        if fn is rc.remove:
            self.removed += 1
            self.container = None
            self.cluster = None
            return True
        if fn is rc.never_restart:
            assert self.container is not None
            self.container["restart_policy"] = rc.RESTART_POLICY
            self.updated += 1
            return None
        if fn.__name__ == "exec_in":
            name, argv, env, stdin, timeout = args
            self.execs.append((list(argv), dict(env)))
            return self._exec(list(argv), env, stdin)
        raise AssertionError(f"unexpected engine call {fn!r}")

    async def stream(self, fn: Any, control: Any, *args: Any, what: str | None = None) -> Any:
        assert fn.__name__ == "exec_stream", fn
        name, argv, env, stdin, timeout = args
        self.execs.append((list(argv), dict(env)))
        self.streams += 1
        return self._exec(list(argv), env, stdin)

    def _exec(self, argv: list[str], env: dict[str, str] | None = None, stdin: bytes | None = None) -> ExecResult:
        if argv == ["python3", "-"]:
            assert env is not None
            self.programs.append((stdin, dict(env)))
            if isinstance(self.describe_doc, ExecResult):
                return self.describe_doc
            begin, end = describe.markers(env["LLMPORT_DESCRIBE_NONCE"])
            out = f"INFO worker.py -- Connecting\n{begin}{json.dumps(self.describe_doc)}{end}\n"
            return ExecResult(0, out.encode(), b"")
        if argv == ["cat", CURRENT_CLUSTER_FILE]:
            return ExecResult(0 if self.cluster else 1, (self.cluster or "").encode(), b"")
        if argv[:2] == ["pgrep", "-c"]:
            return ExecResult(0 if self.cluster else 1, b"1\n" if self.cluster else b"0\n", b"")
        if argv[:2] == ["ray", "start"]:
            address = next((a.split("=", 1)[1] for a in argv if a.startswith("--address=")), None)
            if address is None:
                ip = next((a.split("=", 1)[1] for a in argv if a.startswith("--node-ip-address=")), "10.9.9.9")
                port = next(a.split("=", 1)[1] for a in argv if a.startswith("--port="))
                address = f"{ip}:{port}"
            self.cluster = address
            return ExecResult(0, b"Ray runtime started.\n", b"")
        if argv[:2] == ["ray", "stop"]:
            self.cluster = None
            return ExecResult(0, b"Stopped all 5 Ray processes.\n", b"")
        if argv[:2] == ["ray", "--version"]:
            return ExecResult(0, b"ray, version 2.58.0\n", b"")
        if argv == ["cat", helpercli.METRICS_DISCOVERY_FILE]:
            return ExecResult(0, json.dumps([{"targets": ["10.0.0.1:8089"]}]).encode(), b"")
        if argv[0] == "llm-port-ray-runtime":
            return ExecResult(0, ("INFO connecting\n" + self.helper_out + "\n").encode(), b"")
        raise AssertionError(f"unexpected exec {argv}")


class RayHandlerTests(TestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.secret = SecretResource()
        root = Resource()
        root.putChild(b"api", self.secret)
        self.http = StubTreq(self.secret)
        backend = BackendHTTP(self.clock, self.http, "http://backend.test", 5)
        self.token_dir = os.path.abspath(self.mktemp())
        store = os.path.abspath(self.mktemp())
        os.makedirs(store)
        self.store = store
        self.tokens = ClusterTokens(self.clock, backend, lambda: "cred.secret", Pool(), self.token_dir)
        self.engine = FakeEngine()
        self.pulls: list[Any] = []
        self.transfers: list[dict[str, Any]] = []
        #: What the stand-in server's transfer loads: (id, layers), or a failure to raise.
        self.served: tuple[str, tuple[str, ...]] | CommandFailed = (IMAGE_ID, LAYERS)
        engine = self.engine

        class Images:
            async def pull(inner, ref: Any, progress: Any) -> dict[str, Any]:  # noqa: N805
                self.pulls.append(ref)
                raise CommandFailed("pull_failed", "no such image in the registry")

            async def transfer(inner, ref: Any, progress: Any, *, expect_id: Any = None,  # noqa: N805
                               expect_rootfs: Any = None, load_as: Any = None) -> dict[str, Any]:
                self.transfers.append({"ref": ref.canonical, "expect_id": expect_id, "expect_rootfs": expect_rootfs,
                                       "load_as": load_as.canonical if load_as is not None else None})
                progress("Transferring from the backend", bytes_done=10)
                if isinstance(self.served, CommandFailed):
                    raise self.served
                # The engine names the loaded image as the (filtered) archive says: load_as.
                engine.api.names[(load_as or ref).canonical] = self.served
                return {"bytes_done": 10}

        self.session_dir = os.path.abspath(self.mktemp())
        self.extra_root = os.path.abspath(self.mktemp())
        os.makedirs(self.extra_root)
        settings = RaySettings("agent-1", parse_allowlist("llmport-test"), (store, self.extra_root, self.session_dir),
                               self.token_dir, session_dir=self.session_dir, model_store=store)
        self.ray = RayManager(self.clock, self.engine, Images(), self.tokens, settings, Pool())  # type: ignore[arg-type]
        self.specs = ray_handler_specs(self.ray)
        self.lines: list[str] = []

        def observe(event: dict[str, Any]) -> None:
            self.lines.append(formatEvent(event) or "")

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)

    def bundle(self, **over: Any) -> dict[str, Any]:
        b = {"image": "llmport-test/ray-runtime:2.58.0", "digest": IMAGE_ID,
             "rootfs_digest": imagepin.rootfs_digest(LAYERS),
             "requirements": {"gpus": "none"},
             "mounts": [{"host_path": self.store, "container_path": "/models"}]}
        b.update(over)
        return b

    async def do(self, kind: str, payload: dict[str, Any]) -> tuple[RecordingContext, dict[str, Any]]:
        ctx = RecordingContext(make_command(kind, payload), self.clock)
        result = await self.specs[kind].handler(ctx)
        # Every result must survive the journal (JSON) and never carry the token.
        self.assertFalse(TOKEN in json.dumps(result), "the token is in the result")
        self.assertFalse(TOKEN in json.dumps(ctx.frames), "the token is in a progress frame")
        return ctx, result

    async def fails(self, kind: str, payload: dict[str, Any]) -> CommandFailed:
        ctx = RecordingContext(make_command(kind, payload), self.clock)
        with self.assertRaises(CommandFailed) as cm:
            await self.specs[kind].handler(ctx)
        self.assertFalse(TOKEN in cm.exception.error_message, "the token is in the error message")
        return cm.exception

    def head(self, **over: Any) -> dict[str, Any]:
        p = {"credential_ref": REF, "port": 6379, "node_ip_address": "10.0.0.1", "include_dashboard": False,
             "runtime_bundle": self.bundle(), "env": {"NCCL_SOCKET_IFNAME": "ib0", "PATH": "/evil",
                                                     "RAY_AUTH_TOKEN_PATH": "/tmp/x", "CUDA_VISIBLE_DEVICES": "0",
                                                     "RAY_AUTH_TOKEN": "attacker-token"}}
        p.update(over)
        return p

    def starts(self) -> list[list[str]]:
        return [argv for argv, _env in self.engine.execs if argv[:2] == ["ray", "start"]]

    async def test_start_head_idempotent_and_env_to_exec_only(self) -> None:
        _ctx, result = await self.do("start_ray_head", self.head())
        self.assertEqual(result["head_address"], "10.0.0.1:6379")
        self.assertFalse(result["already_running"])
        (argv,) = self.starts()
        self.assertIn("--head", argv)
        env = next(e for a, e in self.engine.execs if a[:2] == ["ray", "start"])
        self.assertEqual(env, {"NCCL_SOCKET_IFNAME": "ib0", "RAY_AUTH_MODE": "token",
                               "RAY_AUTH_TOKEN_PATH": os.path.join(self.token_dir, "cluster.token")})
        created = self.engine.created[0]
        self.assertNotIn("NCCL_SOCKET_IFNAME", created["env"])
        self.assertEqual(created["image_id"], IMAGE_ID)
        # Same address: success, nothing started; the token is not fetched again within 300 s.
        _ctx, again = await self.do("start_ray_head", self.head())
        self.assertTrue(again["already_running"])
        self.assertEqual(len(self.starts()), 1)
        self.assertEqual(len(self.engine.created), 1)
        self.assertEqual(self.secret.calls, 1)
        # Another address: stopped first, then started there.
        self.clock.advance(301)
        _ctx, moved = await self.do("start_ray_head", self.head(node_ip_address="10.0.0.2"))
        self.assertEqual(moved["head_address"], "10.0.0.2:6379")
        kinds = [a[:2] for a, _ in self.engine.execs if a[0] == "ray"]
        self.assertEqual(kinds[-2:], [["ray", "stop"], ["ray", "start"]])
        self.assertEqual(self.secret.calls, 2)

    async def test_join_idempotent(self) -> None:
        payload = {"head_address": "10.0.0.1:6379", "credential_ref": REF, "node_ip_address": "10.0.0.2",
                   "runtime_bundle": self.bundle()}
        _c, r = await self.do("join_ray_cluster", payload)
        self.assertEqual((r["joined"], r["already_member"]), (True, False))
        _c, r = await self.do("join_ray_cluster", payload)
        self.assertTrue(r["already_member"])
        self.assertEqual(len(self.starts()), 1)
        _c, r = await self.do("join_ray_cluster", {**payload, "head_address": "10.0.0.9:6379"})
        self.assertFalse(r["already_member"])
        self.assertEqual([a[:2] for a, _ in self.engine.execs if a[0] == "ray"][-2:], [["ray", "stop"], ["ray", "start"]])
        bad = await self.fails("join_ray_cluster", {**payload, "head_address": "10.0.0.1; rm -rf /"})
        self.assertEqual(bad.error_code, "invalid_command")

    async def test_join_ipv6_head_keeps_its_brackets(self) -> None:
        payload = {"head_address": "[::1]:6379", "credential_ref": REF, "runtime_bundle": self.bundle()}
        _c, r = await self.do("join_ray_cluster", payload)
        self.assertEqual(r["head_address"], "[::1]:6379")
        self.assertIn("--address=[::1]:6379", self.starts()[-1])
        _c, r = await self.do("join_ray_cluster", payload)
        self.assertTrue(r["already_member"])  # the recorded marker reads back as the same head
        self.assertEqual(len(self.starts()), 1)

    def test_head_address_forms(self) -> None:
        for given, rebuilt in [("10.0.0.1:6379", "10.0.0.1:6379"), (" ray-head.local:06379 ", "ray-head.local:6379"),
                               ("[::1]:6379", "[::1]:6379"), ("[2001:DB8:0:0::1]:10001", "[2001:db8::1]:10001")]:
            self.assertEqual(_head_address(given), rebuilt, given)
        for bad in ["::1:6379", "[::1]", "[::1]6379", "[10.0.0.1]:6379", "[not-ip]:6379", "[::1]:0",
                    "10.0.0.1:65536", "10.0.0.1", "10.0.0.1:\uff16\uff13", ":6379", "[]:6379", "a b:1"]:
            with self.assertRaises(CommandFailed, msg=bad) as cm:
                _head_address(bad)
            self.assertEqual(cm.exception.error_code, "invalid_command")

    async def test_token_file_private_and_deleted_by_stop(self) -> None:
        await self.do("start_ray_head", self.head())
        path = os.path.join(self.token_dir, "cluster.token")
        self.assertEqual(os.stat(path).st_mode & 0o777, 0o600)
        with open(path) as f:
            self.assertEqual(f.read(), TOKEN)
        _c, result = await self.do("stop_ray", {"force": True, "runtime_bundle": self.bundle()})
        self.assertTrue(result["stopped"])
        self.assertTrue(result["token_deleted"])
        self.assertFalse(os.path.exists(path))
        self.assertIsNone(self.engine.container)
        self.assertEqual(self.tokens.secrets(), [])
        for line in self.lines:
            self.assertFalse(TOKEN in line, "the token is in a log line")

    async def test_token_never_followed_through_a_link(self) -> None:
        os.makedirs(self.token_dir)
        outside = os.path.abspath(self.mktemp())
        os.symlink(outside, os.path.join(self.token_dir, "cluster.token"))
        await self.do("start_ray_head", self.head())
        self.assertFalse(os.path.exists(outside))
        self.assertFalse(os.path.islink(os.path.join(self.token_dir, "cluster.token")))

    async def test_token_errors_say_what_to_do(self) -> None:
        err = await self.fails("start_ray_head", self.head(credential_ref="other-ref"))
        self.assertIn("not a member", err.error_message)
        err = await self.fails("start_ray_head", self.head(credential_ref="../../etc"))
        self.assertEqual(err.error_code, "invalid_command")

    async def test_get_ray_status_without_ray(self) -> None:
        _c, r = await self.do("get_ray_status", {})
        self.assertEqual((r["alive"], r["version"], r["num_nodes"], r["nodes"]), (False, None, 0, []))

    async def test_health_check_of_a_head_whose_container_is_gone_or_stopped(self) -> None:
        """
        The backend's health check (get_ray_status {runtime_bundle, include_metrics}) reads a
        FAILED probe as "not observed" and restarts nothing: a head whose runtime container is
        gone, or stopped (after a reboot: it never restarts on its own), must answer
        alive: false (the backend then re-forms the cluster), never fail, and never exec.
        """
        probe = {"runtime_bundle": self.bundle(), "include_metrics": True}
        _c, r = await self.do("get_ray_status", probe)
        self.assertEqual((r["alive"], r["version"], r["num_nodes"], r["nodes"]), (False, None, 0, []))
        self.assertIn("does not exist", r["detail"])
        await self.do("start_ray_head", self.head())
        assert self.engine.container is not None
        self.engine.container.update(running=False, status="exited")
        before = len(self.engine.execs)
        _c, r = await self.do("get_ray_status", probe)
        self.assertEqual((r["alive"], r["nodes"], r["container"]), (False, [], "llm-port-ray-runtime"))
        self.assertIn("is exited", r["detail"])
        self.assertEqual(self.engine.execs[before:], [])

    async def test_get_ray_status_through_helper(self) -> None:
        await self.do("start_ray_head", self.head())
        _c, r = await self.do("get_ray_status", {"include_serve": False})
        self.assertEqual((r["alive"], r["version"], r["num_nodes"]), (True, "2.58.0", 1))

    async def test_health_check_probe_passes_node_records_through(self) -> None:
        """
        The backend's minute health check (get_ray_status {runtime_bundle, include_metrics}):
        each nodes[] record carries every key the helper gave (the backend matches members by
        node_ip, node_manager_address or node_name), the Serve status carries active, and the
        metrics targets are there.
        """
        await self.do("start_ray_head", self.head())
        head = {"node_id": "h", "node_ip": "10.0.0.1", "node_manager_address": "10.0.0.1", "node_name": "gpu-a",
                "alive": True, "is_head": True, "state": "ALIVE", "gpus": 8.0, "cpus": 64.0,
                "metrics_export_port": 8089, "resources": {"GPU": 8.0, "CPU": 64.0}}
        worker = {**head, "node_id": "w", "node_ip": "10.0.0.2", "node_manager_address": "10.0.0.2",
                  "node_name": "gpu-b", "is_head": False}
        self.engine.helper_out = json.dumps({
            "alive": True, "version": "2.58.0", "num_nodes": 2, "nodes": [head, worker],
            "available": True, "applications": {"llmport-d1": {"status": "RUNNING", "deployments": {
                "LLMServer:m": {"status": "HEALTHY", "num_replicas_ready": 1}}}}})
        _c, r = await self.do("get_ray_status", {"runtime_bundle": self.bundle(), "include_metrics": True})
        self.assertEqual(r["nodes"], [head, worker])
        self.assertTrue(r["serve"]["active"])
        self.assertEqual([t["url"] for t in r["metrics"]["targets"]], ["http://10.0.0.1:8089/metrics"])
        # Which tiers answered, as the original agent reports them (the backend parses capabilities).
        self.assertEqual(r["capabilities"], {"serve": True, "metrics": True})
        _c, r = await self.do("get_ray_status", {"runtime_bundle": self.bundle(), "include_serve": False,
                                                 "include_state": True})
        self.assertEqual(r["capabilities"], {"state": False})

    async def test_recovery_leave_then_join_gets_a_fresh_container(self) -> None:
        """
        The backend's recovery of a lost worker is leave_ray_cluster then a fresh
        join_ray_cluster: leave REMOVES the runtime container (and the token), so the join
        creates a new one and runs ray start in it.
        """
        join = {"head_address": "10.0.0.1:6379", "credential_ref": REF, "runtime_bundle": self.bundle()}
        await self.do("join_ray_cluster", join)
        self.assertEqual(len(self.engine.created), 1)
        _c, r = await self.do("leave_ray_cluster", {"runtime_bundle": self.bundle()})
        self.assertEqual((r["left"], r["stopped"], r["removed"], r["token_deleted"]), (True, True, True, True))
        self.assertIsNone(self.engine.container)
        self.assertEqual(self.engine.removed, 1)
        # Without a bundle (the teardown's payload): the agent's default container is removed too.
        await self.do("join_ray_cluster", join)
        _c, r = await self.do("leave_ray_cluster", {"version": "2.58.0"})
        self.assertTrue(r["removed"])
        self.assertIsNone(self.engine.container)
        _c, r = await self.do("join_ray_cluster", join)
        self.assertFalse(r["already_member"])
        self.assertEqual(len(self.engine.created), 3)
        self.assertEqual(len(self.starts()), 3)
        # The head's recovery: stop_ray {force} removes it the same way.
        _c, r = await self.do("stop_ray", {"force": True, "version": "2.58.0"})
        self.assertTrue(r["removed"])
        self.assertIsNone(self.engine.container)

    async def test_helper_answer_parsed_off_the_reactor(self) -> None:
        """
        The helper's output (up to 1 MiB the container writes) is searched for its JSON answer
        on the pool, never on the reactor: 64 long unterminated objects cost about a second.
        """
        await self.do("start_ray_head", self.head())
        ran: list[str] = []
        inline = self.ray._pool

        class Recording:
            def run(inner, fn: Any, *args: Any, **kw: Any) -> Deferred[Any]:  # noqa: N805
                ran.append(getattr(fn, "__name__", ""))
                return inline.run(fn, *args, **kw)

        self.ray._pool = Recording()  # type: ignore[assignment]
        _c, r = await self.do("get_ray_status", {"include_serve": False})
        self.assertTrue(r["alive"])
        self.assertIn("first_json_object", ran)

    async def test_probe_fails_unless_verified(self) -> None:
        """
        fetch: false (the backend's probe): only the pinned build succeeds, verified; an absent
        image is a failed runtime_image_missing, another build a failed runtime_image_mismatch
        (the backend reads "succeeded" without verified as a broken node). Nothing is loaded.
        """
        probe = {"runtime_bundle": self.bundle(), "ensure_container": True, "fetch": False}
        self.engine.identity = imagepin.Identity(False)
        err = await self.fails("ensure_runtime_image", probe)
        self.assertEqual(err.error_code, "runtime_image_missing")
        self.assertEqual((err.result["verified"], err.result["present"]), (False, False))
        self.engine.identity = imagepin.Identity(True, "sha256:" + "9" * 64, (), ("sha256:" + "2" * 64,))
        err = await self.fails("ensure_runtime_image", {**probe, "fetch": "false"})
        self.assertEqual(err.error_code, "runtime_image_mismatch")
        self.assertEqual((err.result["verified"], err.result["present"]), (False, True))
        self.assertEqual((self.transfers, self.pulls, self.engine.created), ([], [], []))
        self.engine.identity = imagepin.Identity(True, IMAGE_ID, (), LAYERS)
        _c, r = await self.do("ensure_runtime_image", probe)
        self.assertEqual((r["verified"], r["present"], r["matched_by"], r["created"]), (True, True, "rootfs_digest", True))

    async def test_absent_or_other_build_loads_from_the_server(self) -> None:
        """
        Without source the pinned image comes from the llm-port server (expect_id and
        expect_rootfs in the query), never from a registry; absent and another build alike.
        """
        for before in (imagepin.Identity(False), imagepin.Identity(True, "sha256:" + "9" * 64, (), ("sha256:" + "2" * 64,))):
            self.engine.identity = before
            self.transfers.clear()
            ctx, r = await self.do("ensure_runtime_image", {"runtime_bundle": self.bundle(), "ensure_container": True})
            self.assertEqual((r["verified"], r["image_id"], r["running"]), (True, IMAGE_ID, True))
            (t,) = self.transfers
            self.assertEqual((t["ref"], t["expect_id"], t["expect_rootfs"]),
                             (RUNTIME_IMAGE, IMAGE_ID, imagepin.rootfs_digest(LAYERS)))
            self.assertTrue(t["load_as"].startswith(imagepin.PRIVATE_REPO + "/"), t["load_as"])
            self.assertIn("transfer_image", [f["phase"] for f in ctx.frames])
            # Only the bundle's name is left: the private one is gone.
            self.assertEqual(sorted(self.engine.api.names), [RUNTIME_IMAGE])
        self.assertEqual(self.pulls, [])

    async def test_a_foreign_build_never_takes_the_bundle_name(self) -> None:
        """
        The server (or a peer) sends another build: runtime_image_mismatch, and the bundle's
        name was never given to it, not even for a moment; the foreign image keeps no name.
        """
        foreign = ("sha256:" + "f" * 64, ("sha256:" + "e" * 64,))
        self.served = foreign
        self.engine.identity = imagepin.Identity(False)
        err = await self.fails("ensure_runtime_image", {"runtime_bundle": self.bundle(), "ensure_container": True})
        self.assertEqual(err.error_code, "runtime_image_mismatch")
        self.assertIn("was not given the bundle's name", err.error_message)
        self.assertNotIn(RUNTIME_IMAGE, self.engine.api.names)
        self.assertEqual([n for n, _id in self.engine.api.tagged if n == RUNTIME_IMAGE], [])
        self.assertEqual(self.engine.api.names, {})  # the private name went too
        self.assertEqual(self.engine.created, [])
        # A node that holds another build under the name keeps it as it was (nothing moved).
        old = imagepin.Identity(True, "sha256:" + "9" * 64, (), ("sha256:" + "2" * 64,))
        self.engine.identity = old
        err = await self.fails("ensure_runtime_image", {"runtime_bundle": self.bundle()})
        self.assertEqual(err.error_code, "runtime_image_mismatch")
        self.assertEqual(self.engine.api.names[RUNTIME_IMAGE][0], old.image_id)
        self.assertEqual(self.engine.api.tagged, [])

    async def test_server_failures_are_reported_with_their_codes(self) -> None:
        self.engine.identity = imagepin.Identity(False)
        for code in ("server_image_mismatch", "image_transfer_failed"):
            self.served = CommandFailed(code, f"the server said {code}")
            err = await self.fails("ensure_runtime_image", {"runtime_bundle": self.bundle(), "ensure_container": True})
            self.assertEqual(err.error_code, code)
        self.assertEqual(self.engine.api.names, {})
        self.assertEqual((self.pulls, self.engine.created), ([], []))

    async def test_ensure_runtime_image_and_container_reuse(self) -> None:
        _c, r = await self.do("ensure_runtime_image", {"runtime_bundle": self.bundle(), "ensure_container": True})
        self.assertEqual((r["verified"], r["matched_by"], r["created"]), (True, "rootfs_digest", True))
        _c, r = await self.do("ensure_runtime_image", {"runtime_bundle": self.bundle(), "ensure_container": True})
        self.assertFalse(r["created"])
        other = os.path.join(self.extra_root, "sub")
        bundle = self.bundle(mounts=[{"host_path": other, "container_path": "/models"}])
        _c, r = await self.do("ensure_runtime_image", {"runtime_bundle": bundle, "ensure_container": True})
        self.assertTrue(r["created"])
        self.assertEqual(self.engine.removed, 1)

    async def test_a_container_with_more_mounts_than_the_bundle_is_recreated(self) -> None:
        await self.do("ensure_runtime_image", {"runtime_bundle": self.bundle(), "ensure_container": True})
        assert self.engine.container is not None
        self.engine.container["mounts"].add(("/", "/host", False))
        _c, r = await self.do("ensure_runtime_image", {"runtime_bundle": self.bundle(), "ensure_container": True})
        self.assertTrue(r["created"])
        self.assertEqual(self.engine.removed, 1)
        self.assertNotIn(("/", "/host", False), self.engine.container["mounts"])

    async def test_a_stopped_runtime_container_is_created_afresh_never_started(self) -> None:
        """
        The engine resolves a bind source again at every start: a stopped runtime container is
        removed and created from the bundle with its host paths checked again, never started.
        """
        await self.do("ensure_runtime_image", {"runtime_bundle": self.bundle(), "ensure_container": True})
        assert self.engine.container is not None
        self.engine.container.update(running=False, status="exited")
        _c, r = await self.do("join_ray_cluster", {"head_address": "10.0.0.1:6379", "credential_ref": REF,
                                                   "runtime_bundle": self.bundle()})
        self.assertTrue(r["joined"])
        self.assertEqual((self.engine.removed, len(self.engine.created)), (1, 2))
        self.assertTrue(self.engine.container["running"])

    async def test_an_older_agents_restarting_container_stops_restarting_on_its_own(self) -> None:
        """A running container created with unless-stopped (an earlier agent) is updated in place, not killed."""
        await self.do("ensure_runtime_image", {"runtime_bundle": self.bundle(), "ensure_container": True})
        assert self.engine.container is not None
        self.engine.container["restart_policy"] = "unless-stopped"
        _c, r = await self.do("ensure_runtime_image", {"runtime_bundle": self.bundle(), "ensure_container": True})
        self.assertFalse(r["created"])
        self.assertEqual((self.engine.updated, self.engine.removed), (1, 0))
        self.assertEqual(self.engine.container["restart_policy"], "no")

    async def test_no_bundle_mount_from_inside_the_model_store(self) -> None:
        """
        Workloads write the model store (download_from_hf mounts it read-write); a directory in
        it could be swapped for a link to / before the engine resolves the source again: only
        the store itself is a mount source, and no read-write mount holds another source.
        """
        inside = os.path.join(self.store, "hub")
        os.makedirs(inside)
        for mounts, word in (
            ([{"host_path": inside, "container_path": "/models"}], "inside the model store"),
            ([{"host_path": self.extra_root, "container_path": "/data", "mode": "rw"},
              {"host_path": os.path.join(self.extra_root, "x"), "container_path": "/x"}], "read-write"),
        ):
            err = await self.fails("ensure_runtime_image", {"runtime_bundle": self.bundle(mounts=mounts),
                                                            "ensure_container": True})
            self.assertEqual(err.error_code, "policy_violation")
            self.assertIn(word, err.error_message)
        self.assertEqual(self.engine.created, [])

    async def test_container_mounts_the_session_dir(self) -> None:
        """The host's RAY_SESSION_DIR is made (0700) and mounted read-write at /tmp/ray."""
        _c, r = await self.do("ensure_runtime_image", {"runtime_bundle": self.bundle(), "ensure_container": True})
        self.assertTrue(r["created"])
        self.assertIn(f"{self.session_dir}:/tmp/ray:rw", self.engine.created[0]["binds"])
        self.assertIn((self.session_dir, self.session_dir), self.engine.created[0]["host_paths"])
        st = os.lstat(self.session_dir)
        self.assertTrue(stat.S_ISDIR(st.st_mode))
        self.assertEqual(stat.S_IMODE(st.st_mode), 0o700)

    async def test_container_without_the_session_mount_is_recreated(self) -> None:
        await self.do("ensure_runtime_image", {"runtime_bundle": self.bundle(), "ensure_container": True})
        assert self.engine.container is not None
        self.engine.container["mounts"].discard((self.session_dir, "/tmp/ray", False))
        _c, r = await self.do("ensure_runtime_image", {"runtime_bundle": self.bundle(), "ensure_container": True})
        self.assertTrue(r["created"])
        self.assertEqual(self.engine.removed, 1)
        self.assertTrue(any("does not mount the Ray session directory" in line for line in self.lines))

    async def test_no_bundle_mount_comes_from_the_session_dir(self) -> None:
        """
        The runtime container writes RAY_SESSION_DIR (its /tmp/ray); the engine resolves a bind
        source again at every start, so a directory there that it swapped for a link to / would
        mount the host's root at the next restart: no bundle mount is taken from it.
        """
        inside = os.path.join(self.session_dir, "models")
        os.makedirs(inside)
        for host, target in ((inside, "/models"), (self.session_dir, "/data")):
            err = await self.fails("ensure_runtime_image", {"runtime_bundle": self.bundle(
                mounts=[{"host_path": host, "container_path": target, "mode": "rw"}]), "ensure_container": True})
            self.assertEqual(err.error_code, "policy_violation")
            self.assertIn("RAY_SESSION_DIR", err.error_message)
        self.assertEqual(self.engine.created, [])

    async def test_bundle_mount_at_tmp_ray_is_left_out(self) -> None:
        """A bundle mount at /tmp/ray never replaces the agent's; one over or under it is refused."""
        other = os.path.join(self.store, "elsewhere")
        mounts = [{"host_path": self.store, "container_path": "/models"},
                  {"host_path": other, "container_path": "/tmp/ray", "mode": "rw"}]
        _c, r = await self.do("ensure_runtime_image",
                              {"runtime_bundle": self.bundle(mounts=mounts), "ensure_container": True})
        binds = self.engine.created[0]["binds"]
        self.assertEqual([b for b in binds if ":/tmp/ray:" in b], [f"{self.session_dir}:/tmp/ray:rw"])
        self.assertTrue(any("left out" in line and "/tmp/ray" in line for line in self.lines))
        for target in ("/tmp", "/tmp/ray/logs"):
            err = await self.fails("ensure_runtime_image", {"runtime_bundle": self.bundle(
                mounts=[{"host_path": other, "container_path": target}])})
            self.assertEqual(err.error_code, "policy_violation")

    async def test_session_dir_that_is_a_link_is_refused(self) -> None:
        target = os.path.abspath(self.mktemp())
        os.makedirs(target)
        os.symlink(target, self.session_dir)
        err = await self.fails("ensure_runtime_image", {"runtime_bundle": self.bundle(), "ensure_container": True})
        self.assertEqual(err.error_code, "policy_violation")
        self.assertIn("RAY_SESSION_DIR", err.error_message)
        self.assertEqual(self.engine.created, [])

    async def test_a_foreign_container_of_that_name_is_never_execd_into(self) -> None:
        """
        A running container named llm-port-ray-runtime that this agent did not create (no
        labels, or another agent's): no command execs into it, with or without a bundle.
        """
        for labels in ({}, {rc.LABEL_RAY: rc.RAY_VALUE, "io.llmport.agent-id": "agent-2"},
                       {rc.LABEL_RAY: "someone", "io.llmport.agent-id": "agent-1"}):
            self.engine.container = {"id": "f" * 64, "name": "llm-port-ray-runtime", "labels": labels,
                                     "running": True, "status": "running", "started_at": None, "image": "x",
                                     "image_id": IMAGE_ID, "mounts": set()}
            _c, r = await self.do("get_ray_status", {})
            self.assertEqual((r["alive"], r["nodes"]), (False, []))
            _c, r = await self.do("get_ray_serve_status", {})
            self.assertFalse(r["available"])
            _c, r = await self.do("describe_ray_cluster", {})
            self.assertFalse(r["running"])
            for kind, payload in (("get_ray_status", {"runtime_bundle": self.bundle()}),
                                  ("run_serve_app", {"app_name": "llmport-x", "llm_serving_args": {},
                                                     "runtime_bundle": self.bundle()}),
                                  ("delete_serve_app", {"app_name": "llmport-x", "runtime_bundle": self.bundle()})):
                err = await self.fails(kind, payload)
                self.assertIn("not this agent's", err.error_message)
        self.assertEqual(self.engine.execs, [])

    def test_find_takes_the_exact_name_only(self) -> None:
        """The engine's inspect also matches an id or id prefix: find() takes only the name."""
        class API:
            def __init__(self, name: str) -> None:
                self.name = name

            def inspect_container(self, ident: str) -> dict[str, Any]:
                return {"Id": "ab" * 32, "Name": "/" + self.name, "Config": {"Labels": {}}, "State": {}}

        class Client:
            def __init__(self, name: str) -> None:
                self.api = API(name)

        self.assertIsNone(rc.find(Client("some-workload"), "abab"))  # type: ignore[arg-type]
        self.assertIsNone(rc.find(Client("llm-port-ray-runtime-2"), "llm-port-ray-runtime"))  # type: ignore[arg-type]
        self.assertEqual(rc.find(Client("llm-port-ray-runtime"), "llm-port-ray-runtime")["id"],  # type: ignore[arg-type, index]
                         "ab" * 32)

    async def test_foreign_container_untouched(self) -> None:
        self.engine.container = {"id": "f" * 64, "name": "llm-port-ray-runtime", "labels": {}, "running": True,
                                 "status": "running", "started_at": None, "image": "x", "image_id": IMAGE_ID,
                                 "mounts": set()}
        err = await self.fails("ensure_runtime_image", {"runtime_bundle": self.bundle(), "ensure_container": True})
        self.assertIn("not created by this agent", err.error_message)
        err = await self.fails("stop_ray", {"runtime_bundle": self.bundle()})
        self.assertEqual(self.engine.removed, 0)

    async def test_policy_refusals_reach_nothing(self) -> None:
        err = await self.fails("ensure_runtime_image", {"runtime_bundle": self.bundle(
            mounts=[{"host_path": "/etc", "container_path": "/models"}])})
        self.assertEqual(err.error_code, "policy_violation")
        err = await self.fails("ensure_runtime_image", {"runtime_bundle": self.bundle(image="evil/ray:1")})
        self.assertEqual(err.error_code, "policy_violation")
        self.assertEqual(self.engine.execs, [])
        self.assertEqual(self.engine.created, [])

    def described_app(self, name: str = APP, configs: Any = (RUNNING,), **over: Any) -> dict[str, Any]:
        app = {"name": name, "route_prefix": f"/{name}", "status": "RUNNING", "message": "",
               "deployments": [{"name": "LLMServer:qwen", "status": "HEALTHY", "running_replicas": 1},
                               {"name": "OpenAiIngress", "status": "HEALTHY", "running_replicas": 1}],
               "llm_configs": list(configs), "defaults": [list(DEFAULTS)] * len(configs), "errors": []}
        app.update(over)
        return app

    def described(self, *apps: dict[str, Any], **over: Any) -> dict[str, Any]:
        doc = {"attached": True, "ray_version": "2.58.0", "gcs_address": "10.0.0.1:6379",
               "nodes": [{"node_id": "h", "ip": "10.0.0.1", "hostname": "head", "alive": True, "is_head": True,
                          "gpus": 1.0, "cpus": 4.0}],
               "serve": {"running": True, "http_options": {"host": "0.0.0.0", "port": 8000}},
               "apps": list(apps), "errors": []}
        doc.update(over)
        return doc

    async def test_describe_reads_the_running_configs_and_compares_them_here(self) -> None:
        await self.do("start_ray_head", self.head())
        self.engine.describe_doc = self.described(
            self.described_app(), self.described_app("someone-elses-app", configs=()))
        verify = {APP: {"llm_configs": [CANDIDATE]}, "someone-elses-app": {"llm_configs": [CANDIDATE]},
                  "llmport-gone": {"llm_configs": []}}
        ran: list[str] = []
        inline = self.ray._pool

        class Recording:
            def run(inner, fn: Any, *args: Any, **kw: Any) -> Deferred[Any]:  # noqa: N805
                ran.append(getattr(fn, "__name__", ""))
                return inline.run(fn, *args, **kw)

        self.ray._pool = Recording()  # type: ignore[assignment]
        before = len(self.engine.execs)
        _c, r = await self.do("describe_ray_cluster", {"verify": verify})
        # The program from the package's resource, on stdin, with a fresh nonce; nothing else runs.
        (stdin, env), = self.engine.programs
        self.assertEqual(stdin, describe.program())
        self.assertGreaterEqual(len(env["LLMPORT_DESCRIBE_NONCE"]), 16)
        self.assertEqual([a for a, _e in self.engine.execs[before:]], [["python3", "-"]])
        # The container's words are read, and compared, on the pool (never on the reactor).
        self.assertEqual([n for n in ran if n != "program"], ["parse_output", "compare", "without_secrets"])
        self.assertEqual((r["source"], r["attached"], r["ray_version"], r["gcs_address"]),
                         ("ray", True, "2.58.0", "10.0.0.1:6379"))
        self.assertEqual([(n["ip"], n["node_ip"], n["is_head"]) for n in r["nodes"]], [("10.0.0.1", "10.0.0.1", True)])
        self.assertEqual(r["serve"], {"running": True, "http_options": {"host": "0.0.0.0", "port": 8000}})
        apps = {a["name"]: a for a in r["apps"]}
        self.assertEqual(apps[APP]["llm_configs"], [RUNNING])
        self.assertEqual([d["name"] for d in apps[APP]["deployments"]], ["LLMServer:qwen", "OpenAiIngress"])
        self.assertEqual(apps[APP]["verify"], {"equal": True, "diff": []})
        self.assertEqual(apps["someone-elses-app"]["llm_configs"], [])
        self.assertIsNone(apps["someone-elses-app"]["verify"]["equal"])
        self.assertIn("not deployed by llm-port", apps["someone-elses-app"]["verify"]["explanation"])
        self.assertEqual(r["errors"], ["verify: no application named llmport-gone runs on this cluster"])
        self.assertNotIn("cluster_token", r)

        other = {**CANDIDATE, "engine_kwargs": {**CANDIDATE["engine_kwargs"], "tool_call_parser": "llama3_json"}}
        _c, r = await self.do("describe_ray_cluster", {"verify": {APP: {"llm_configs": [other]}}})
        self.assertEqual(r["apps"][0]["verify"], {"equal": False, "diff": [
            {"path": "llm_configs.0.engine_kwargs.tool_call_parser", "running": "hermes", "candidate": "llama3_json"}]})

    async def test_describe_never_takes_the_containers_word_for_equal(self) -> None:
        await self.do("start_ray_head", self.head())
        self.engine.describe_doc = self.described(self.described_app(verify={"equal": True, "diff": []}))
        _c, r = await self.do("describe_ray_cluster", {"verify": {APP: {"llm_configs": [{**CANDIDATE, "llm_engine": "x"}]}}})
        self.assertFalse(r["apps"][0]["verify"]["equal"])
        # An app whose configuration was not read completely is not compared at all.
        self.engine.describe_doc = self.described(self.described_app(errors=["deployment LLMServer:qwen: gone"]))
        _c, r = await self.do("describe_ray_cluster", {"verify": {APP: {"llm_configs": [CANDIDATE]}}})
        self.assertIsNone(r["apps"][0]["verify"]["equal"])
        self.assertIn("gone", r["apps"][0]["verify"]["explanation"])
        self.assertEqual(r["apps"][0]["errors"], ["deployment LLMServer:qwen: gone"])
        _c, r = await self.do("describe_ray_cluster", {"verify": {APP: {"llm_configs": "all of them"}}})
        self.assertIsNone(r["apps"][0]["verify"]["equal"])
        err = await self.fails("describe_ray_cluster", {"verify": [APP]})
        self.assertEqual(err.error_code, "invalid_command")

    async def test_describe_without_the_program_uses_the_helper_and_says_so(self) -> None:
        await self.do("start_ray_head", self.head())
        self.engine.helper_out = json.dumps({
            "alive": True, "version": "2.58.0", "num_nodes": 1, "nodes": [{"node_id": "h", "node_ip": "10.0.0.1"}],
            "available": True, "apps": {APP: {"status": "RUNNING", "deployments": {"d": {"num_replicas_ready": 1}}}}})
        for output, why in (
            (ExecResult(127, b'OCI runtime exec failed: exec: "python3": executable file not found in $PATH\r\n', b""),
             "exit 127"),
            (ExecResult(0, b"Traceback (most recent call last): ... SyntaxError\n", b""), "no begin marker"),
            (ExecResult(None, b"", b"", timed_out=True), "timed out"),
            (ExecResult(0, b"x" * 100, b"", truncated=True), "output cut at"),
            ({"ray_importable": False, "attached": False, "errors": ["import ray: ModuleNotFoundError: ray"]},
             "cannot import ray"),
        ):
            self.engine.describe_doc = output
            _c, r = await self.do("describe_ray_cluster", {"verify": {APP: {"llm_configs": [CANDIDATE]}}})
            self.assertEqual(r["source"], "helper")
            self.assertTrue(any(why in e and "helper" in e for e in r["errors"]), (why, r["errors"]))
            self.assertTrue(r["attached"])
            self.assertEqual([n["ip"] for n in r["nodes"]], ["10.0.0.1"])
            (app,) = r["apps"]
            self.assertIsNone(app["llm_configs"])
            self.assertEqual(app["deployments"][0]["name"], "d")
            self.assertEqual(app["verify"], {"equal": None, "diff": None, "explanation": VERIFY_UNAVAILABLE,
                                         "error": VERIFY_UNAVAILABLE})

    async def test_describe_clears_the_token_from_what_the_container_printed(self) -> None:
        """The container can read the token file; what it prints reaches the result without it."""
        await self.do("start_ray_head", self.head())
        leaky = self.described_app(message=f"token {TOKEN}", errors=[f"x{TOKEN}y"],
                                   configs=[{**RUNNING, "engine_kwargs": {"k": TOKEN, TOKEN: "v", f"a{TOKEN}": 1}}])
        self.engine.describe_doc = self.described(leaky, errors=[TOKEN], gcs_address=TOKEN)
        ctx = RecordingContext(make_command("describe_ray_cluster", {"hand_over_token": True}), self.clock)
        r = await self.specs["describe_ray_cluster"].handler(ctx)
        self.assertEqual(r.pop("cluster_token"), TOKEN)  # the sealed hand-over only
        self.assertFalse(TOKEN in json.dumps(r), "the token is in the result")
        self.assertEqual(r["apps"][0]["message"], "token ***")
        self.assertEqual(r["apps"][0]["errors"], ["x***y"])
        # Keys too: the container chooses them as freely as the values.
        self.assertEqual(r["apps"][0]["llm_configs"][0]["engine_kwargs"], {"k": "***", "***": "v", "a***": 1})
        self.engine.describe_doc = ExecResult(1, f"Traceback: {TOKEN}".encode(), b"")
        _c, r = await self.do("describe_ray_cluster", {})  # do() checks the result holds no token
        self.assertEqual(r["source"], "helper")
        self.assertIn("Traceback: ***", r["errors"][0])

    async def test_describe_when_the_program_file_is_missing(self) -> None:
        await self.do("start_ray_head", self.head())

        def missing() -> bytes:
            raise FileNotFoundError("describe_cluster.py")

        self.patch(describe, "program", missing)
        _c, r = await self.do("describe_ray_cluster", {})
        self.assertEqual(r["source"], "helper")
        self.assertIn("reinstall the agent", r["errors"][0])
        self.assertEqual(self.engine.programs, [])

    async def test_describe_of_a_cluster_ray_cannot_attach_to(self) -> None:
        await self.do("start_ray_head", self.head())
        self.engine.describe_doc = {"attached": False, "ray_version": "2.58.0",
                                    "errors": ["attach: ConnectionError: Could not find any running Ray instance."]}
        ctx = RecordingContext(make_command("describe_ray_cluster", {
            "hand_over_token": True, "verify": {APP: {"llm_configs": [CANDIDATE]}}}), self.clock)
        r = await self.specs["describe_ray_cluster"].handler(ctx)
        self.assertFalse(r["attached"])
        self.assertNotIn("cluster_token", r)  # no live cluster, no hand-over
        self.assertEqual(r["apps"], [])
        self.assertIn("Could not find any running Ray instance", r["errors"][0])
        self.assertIn(f"no application named {APP}", r["errors"][1])
        # The backend's takeover reads error (one line), not errors, for a machine it cannot use.
        self.assertIn("Could not find any running Ray instance", r["error"])

    async def test_describe_answers_the_fields_the_backends_takeover_reads(self) -> None:
        """
        The takeover (services/inference/takeover.py) shows doc["error"] for a machine whose
        cluster is not attached, and verify["error"] for an app that is not equal: a reason
        only in errors or explanation reached the operator as "did not answer"/"no answer".
        """
        _c, r = await self.do("describe_ray_cluster", {})
        self.assertEqual((r["running"], r["attached"]), (False, False))
        self.assertIn("No Ray runtime container", r["error"])
        await self.do("start_ray_head", self.head())
        self.engine.describe_doc = self.described(self.described_app(errors=["deployment LLMServer:qwen: gone"]))
        _c, r = await self.do("describe_ray_cluster", {"verify": {APP: {"llm_configs": [CANDIDATE]}}})
        verdict = r["apps"][0]["verify"]
        self.assertIsNone(verdict["equal"])
        self.assertEqual(verdict["error"], verdict["explanation"])
        self.assertIn("gone", verdict["error"])
        self.assertNotIn("error", r)  # attached: nothing to explain

    async def test_describe_hand_over(self) -> None:
        await self.do("start_ray_head", self.head())
        ctx = RecordingContext(make_command("describe_ray_cluster", {"hand_over_token": True}), self.clock)
        result = await self.specs["describe_ray_cluster"].handler(ctx)
        self.assertEqual(result["cluster_token"], TOKEN)  # the sealed hand-over, on request only
        self.assertFalse(self.specs["describe_ray_cluster"].keep_result)
        _c, plain = await self.do("describe_ray_cluster", {})
        self.assertNotIn("cluster_token", plain)

    async def test_one_container_for_concurrent_commands(self) -> None:
        from twisted.internet.defer import gatherResults

        self.engine.hold_create = Deferred()
        payload = {"runtime_bundle": self.bundle(), "ensure_container": True}
        first = Deferred.fromCoroutine(self.do("ensure_runtime_image", payload))
        second = Deferred.fromCoroutine(self.do("ensure_runtime_image", payload))
        hold, self.engine.hold_create = self.engine.hold_create, None
        hold.callback(None)
        results = await gatherResults([first, second])
        self.assertEqual(sorted(r["created"] for _c, r in results), [False, True])
        self.assertEqual(len(self.engine.created), 1)

    async def test_a_hostile_cluster_marker_is_not_believed(self) -> None:
        await self.do("start_ray_head", self.head())
        self.engine.cluster = "10.0.0.1:6379 <script>" + "x" * 5000
        _c, r = await self.do("start_ray_head", self.head())
        self.assertFalse(r["already_running"])  # not a head address: started (again) instead
        self.assertEqual(r["head_address"], "10.0.0.1:6379")

    async def test_nvidia_gpus_refused_on_podman(self) -> None:
        self.engine.kind = "podman"  # type: ignore[attr-defined]
        bundle = self.bundle(requirements={"gpus": "all"})
        err = await self.fails("ensure_runtime_image", {"runtime_bundle": bundle, "ensure_container": True})
        self.assertEqual(err.error_code, "gpu_unavailable")
        self.assertEqual(self.engine.created, [])
        _c, r = await self.do("ensure_runtime_image", {"runtime_bundle": self.bundle(), "ensure_container": True})
        self.assertTrue(r["created"])  # without GPUs Podman is fine
