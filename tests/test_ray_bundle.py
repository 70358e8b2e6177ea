"""The runtime bundle: parsing, the local policy, the image pin, the helper's answers, exec output."""

from __future__ import annotations

import json
import struct
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.base import CommandFailed
from llmport_agent.ray import container as rc
from llmport_agent.ray import helpercli, imagepin
from llmport_agent.ray.bundle import check_layout, filter_env, parse_bundle
from llmport_agent.ray.execs import _Reader
from llmport_agent.workloads.policy import parse_allowlist

DIGEST = "sha256:" + "a" * 64
ROOTFS = "sha256:" + "b" * 64
STORE = "/srv/llm-port/models"
TOKENS = "/var/run/llm-port/ray"


def bundle(**over: Any) -> dict[str, Any]:
    b: dict[str, Any] = {
        "name": "llm-port-ray-runtime",
        "image": "registry.local:5000/llm-port/ray-runtime:2.58.0",
        "digest": DIGEST,
        "rootfs_digest": ROOTFS,
        "requirements": {"network_mode": "host", "ipc_mode": "host", "gpus": "all",
                         "devices": ["/dev/infiniband"], "capabilities": ["IPC_LOCK"],
                         "shm_size": "16g", "ulimits": {"memlock": -1}},
        "mounts": [{"host_path": STORE, "container_path": "/models", "mode": "ro"}],
        "env": {"NCCL_DEBUG": "INFO"},
    }
    b.update(over)
    return b


def parse(raw: Any, allow: str = "registry.local:5000/llm-port", roots: tuple[str, ...] = (STORE,)) -> Any:
    return parse_bundle(raw, allowlist=parse_allowlist(allow), allowed_roots=roots, token_dir=TOKENS)


class BundlePolicyTests(SynchronousTestCase):
    def refused(self, raw: Any, code: str = "policy_violation", **kw: Any) -> str:
        with self.assertRaises(CommandFailed) as cm:
            parse(raw, **kw)
        self.assertEqual(cm.exception.error_code, code, cm.exception.error_message)
        return cm.exception.error_message

    def test_valid_bundle(self) -> None:
        b = parse(bundle())
        self.assertEqual((b.digest, b.rootfs_digest, b.name), (DIGEST, ROOTFS, "llm-port-ray-runtime"))
        self.assertEqual(b.mounts[0].host_path, STORE)
        self.assertEqual(b.shm_size, 16 * 1024**3)
        self.assertEqual(b.ulimits, (("memlock", -1, -1),))
        self.assertEqual(b.devices, ("/dev/infiniband",))

    def test_no_image_or_digest_refused(self) -> None:
        self.assertIn("image is required", self.refused(bundle(image=""), "invalid_command"))
        self.assertIn("unpinned", self.refused(bundle(digest=None), "invalid_command"))
        self.refused(bundle(digest="sha256:short"), "invalid_command")

    def test_image_outside_allowlist_refused(self) -> None:
        text = self.refused(bundle(image="registry.local:5000/llm-port-evil/ray:1"))
        self.assertIn("IMAGE_ALLOWLIST", text)
        self.refused(bundle(image="docker.io/someone/ray:1"))

    def test_host_path_outside_store_refused(self) -> None:
        for host in ("/etc", "/", "/srv/llm-port/models-other", "/srv/llm-port/models/../../etc", "/root/.ssh"):
            raw = bundle(mounts=[{"host_path": host, "container_path": "/models", "mode": "ro"}])
            code = "invalid_command" if ".." in host else "policy_violation"
            self.refused(raw, code)
        # under the store, and under what the operator allows, is fine
        parse(bundle(mounts=[{"host_path": STORE + "/hub", "container_path": "/models"}]))
        parse(bundle(mounts=[{"host_path": "/data/ray", "container_path": "/tmp/ray", "mode": "rw"}]),
              roots=(STORE, "/data/ray"))

    def test_mount_over_token_dir_refused(self) -> None:
        self.refused(bundle(mounts=[{"host_path": STORE, "container_path": TOKENS}]))
        self.refused(bundle(mounts=[{"host_path": STORE, "container_path": "/var/run"}]))
        self.refused(bundle(mounts=[{"host_path": STORE, "container_path": "/"}]))

    def test_privileged_devices_capabilities_namespaces_refused(self) -> None:
        self.refused(bundle(requirements={"privileged": True}))
        self.refused(bundle(privileged=True))
        self.refused(bundle(requirements={"devices": ["/dev/sda"]}))
        self.refused(bundle(requirements={"devices": ["/dev/mem"]}))
        self.refused(bundle(requirements={"capabilities": ["SYS_ADMIN"]}))
        self.refused(bundle(requirements={"pid_mode": "host"}))
        self.refused(bundle(requirements={"network_mode": "bridge"}))
        self.refused(bundle(requirements={"ulimits": {"rtprio": 99}}))
        self.refused(bundle(requirements={"security_opt": ["seccomp=unconfined"]}))

    def test_no_source_where_a_container_writes(self) -> None:
        """
        The engine resolves a bind source again at every start: no bundle mount lies inside the
        model store (workloads write it), and no read-write mount holds another mount's source.
        """
        def strict(raw: Any) -> Any:
            return parse_bundle(raw, allowlist=parse_allowlist("registry.local:5000/llm-port"),
                                allowed_roots=(STORE, "/data"), token_dir=TOKENS, workload_written=(STORE,),
                                agent_sources=(STORE, "/var/lib/llm-port/ray"))

        self.assertEqual(strict(bundle()).mounts[0].host_path, STORE)  # the store itself: fine
        for mounts in (
            [{"host_path": STORE + "/hub", "container_path": "/models"}],
            [{"host_path": STORE + "/hub/x", "container_path": "/models", "mode": "rw"}],
            [{"host_path": "/data", "container_path": "/d", "mode": "rw"},
             {"host_path": "/data/x", "container_path": "/x"}],
        ):
            with self.assertRaises(CommandFailed) as cm:
                strict(bundle(mounts=mounts))
            self.assertEqual(cm.exception.error_code, "policy_violation")
        # A read-write mount holding an agent's source (the store, the session or token directory).
        for roots, host in (((STORE, "/srv"), "/srv"), (("/var",), "/var"), (("/var/run",), "/var/run")):
            with self.assertRaises(CommandFailed):
                parse_bundle(bundle(mounts=[{"host_path": host, "container_path": "/h", "mode": "rw"}]),
                             allowlist=parse_allowlist("registry.local:5000/llm-port"), allowed_roots=roots,
                             token_dir=TOKENS, agent_sources=(STORE, "/var/lib/llm-port/ray"))
        # Read-only, the same mounts are fine; /data/x beside a read-only /data too.
        strict(bundle(mounts=[{"host_path": "/data", "container_path": "/d"}, {"host_path": "/data/x",
                                                                             "container_path": "/x"}]))

    def test_the_agents_own_sources_lie_outside_container_written_directories(self) -> None:
        check_layout(STORE, "/var/lib/llm-port/ray", TOKENS)
        for store, session, tokens, word in ((STORE, STORE + "/ray", TOKENS, "RAY_SESSION_DIR"),
                                             (STORE, "/var/lib/llm-port/ray", STORE + "/.tok", "RAY_TOKEN_DIR"),
                                             ("/var/lib/llm-port/ray/models", "/var/lib/llm-port/ray", TOKENS,
                                              "MODEL_STORE")):
            with self.assertRaises(CommandFailed) as cm:
                check_layout(store, session, tokens)
            self.assertEqual(cm.exception.error_code, "policy_violation")
            self.assertIn(word, cm.exception.error_message)

    def test_env_filtered(self) -> None:
        env = filter_env({"NCCL_IB_HCA": "mlx5_0", "VLLM_HOST_IP": "10.0.0.1", "LD_PRELOAD": "/x.so",
                          "PATH": "/evil", "RAY_AUTH_MODE": "off", "RAY_AUTH_TOKEN_PATH": "/tmp/t",
                          "CUDA_VISIBLE_DEVICES": "0", "RAY_memory_monitor_refresh_ms": 0, "UCX_NET_DEVICES": "mlx5_0:1",
                          "HF_HOME": {"nested": 1}})
        self.assertEqual(env, {"NCCL_IB_HCA": "mlx5_0", "VLLM_HOST_IP": "10.0.0.1",
                               "RAY_memory_monitor_refresh_ms": "0", "UCX_NET_DEVICES": "mlx5_0:1"})
        b = parse(bundle(env={"LD_PRELOAD": "/x.so", "RAY_DEDUP_LOGS": "0", "RAY_AUTH_MODE": "off"}))
        self.assertEqual(dict(b.env), {"RAY_DEDUP_LOGS": "0"})

    def test_cluster_token_is_not_an_env_name(self) -> None:
        """
        Ray reads RAY_AUTH_TOKEN before RAY_AUTH_TOKEN_PATH: a bundle's env carrying it would
        replace the cluster token in the container; it never passes (nor any RAY_AUTH_ name).
        """
        self.assertEqual(filter_env({"RAY_AUTH_TOKEN": "attacker", "RAY_AUTH_SOMETHING_NEW": "x", "RAY_X": "1"}),
                         {"RAY_X": "1"})
        b = parse(bundle(env={"RAY_AUTH_TOKEN": "attacker"}))
        self.assertEqual(dict(b.env), {})
        args = rc.create_args(b, DIGEST, TOKENS, "agent-1")
        self.assertNotIn("RAY_AUTH_TOKEN", args["env"])
        self.assertEqual(args["env"]["RAY_AUTH_TOKEN_PATH"], TOKENS + "/cluster.token")

    def test_only_the_bundle_reaches_the_engine(self) -> None:
        b = parse(bundle(requirements={"gpus": "none", "capabilities": ["IPC_LOCK"], "devices": ["/dev/infiniband"],
                                       "shm_size": "1g"}))
        args = rc.create_args(b, DIGEST, TOKENS, "agent-1")
        self.assertEqual(args["image_id"], DIGEST)
        self.assertEqual(args["cap_add"], ["IPC_LOCK"])
        self.assertEqual(args["devices"], ["/dev/infiniband:/dev/infiniband:rwm"])
        self.assertEqual(args["device_requests"], [])
        self.assertEqual(sorted(args["binds"]), sorted([f"{STORE}:/models:ro", f"{TOKENS}:{TOKENS}:ro"]))
        self.assertEqual(args["env"]["RAY_AUTH_MODE"], "token")
        self.assertEqual(args["env"]["RAY_AUTH_TOKEN_PATH"], TOKENS + "/cluster.token")
        nv = rc.create_args(parse(bundle()), DIGEST, TOKENS, "a")
        self.assertEqual(nv["device_requests"][0]["Count"], -1)
        amd = rc.create_args(parse(bundle(target_architecture={"accelerator_vendor": "amd"})), DIGEST, TOKENS, "a")
        self.assertEqual(amd["device_requests"], [])
        self.assertIn("/dev/kfd:/dev/kfd:rwm", amd["devices"])

    def test_reuse_when_image_mounts_token_match(self) -> None:
        b = parse(bundle())
        snap = {"image_id": DIGEST, "labels": {rc.LABEL_TOKEN_DIR: TOKENS},
                "mounts": rc.wanted_mounts(b, TOKENS)}
        self.assertIsNone(rc.drift(snap, b, DIGEST, TOKENS))
        self.assertIn("image", rc.drift(snap, b, "sha256:" + "c" * 64, TOKENS) or "")
        self.assertIn("token", rc.drift(snap, b, DIGEST, "/other") or "")
        moved = parse(bundle(mounts=[{"host_path": STORE, "container_path": "/weights"}]))
        self.assertIn("mounts", rc.drift(snap, moved, DIGEST, TOKENS) or "")


class ImagePinTests(SynchronousTestCase):
    def test_rootfs_digest(self) -> None:
        layers = ["sha256:" + "1" * 64, "sha256:" + "2" * 64]
        import hashlib

        self.assertEqual(imagepin.rootfs_digest(layers),
                         "sha256:" + hashlib.sha256("\n".join(layers).encode()).hexdigest())

    def test_match_order(self) -> None:
        layers = ("sha256:" + "1" * 64,)
        rootfs = imagepin.rootfs_digest(layers)
        ident = imagepin.Identity(True, DIGEST, ("reg/x@sha256:" + "d" * 64,), layers)
        self.assertEqual(imagepin.match(ident, DIGEST, rootfs, None), "rootfs_digest")
        self.assertEqual(imagepin.match(ident, DIGEST, None, None), "image_id")
        self.assertEqual(imagepin.match(ident, DIGEST, ROOTFS, None), "image_id")
        other = imagepin.Identity(True, "sha256:" + "9" * 64, ident.repo_digests, layers)
        self.assertEqual(imagepin.match(other, DIGEST, rootfs, None), "rootfs_digest")
        self.assertEqual(imagepin.match(other, DIGEST, None, "sha256:" + "d" * 64), "repo_digest")
        self.assertIsNone(imagepin.match(other, DIGEST, ROOTFS, "sha256:" + "e" * 64))
        self.assertIsNone(imagepin.match(imagepin.Identity(False), DIGEST, rootfs, None))

    def test_missing_and_mismatch_codes(self) -> None:
        missing = imagepin.check(imagepin.Identity(False), DIGEST, ROOTFS, None)
        with self.assertRaises(CommandFailed) as cm:
            imagepin.require_match(missing, "x:1", DIGEST, ROOTFS)
        self.assertEqual(cm.exception.error_code, "runtime_image_missing")
        other = imagepin.check(imagepin.Identity(True, "sha256:" + "9" * 64, (), ("sha256:" + "1" * 64,)), DIGEST, ROOTFS, None)
        with self.assertRaises(CommandFailed) as cm:
            imagepin.require_match(other, "x:1", DIGEST, ROOTFS)
        self.assertEqual(cm.exception.error_code, "runtime_image_mismatch")
        self.assertFalse(cm.exception.result["verified"])


class HelperAnswerTests(SynchronousTestCase):
    def test_first_json_object(self) -> None:
        text = 'INFO starting {not json\n2026 ray log\n  {"alive": true, "num_nodes": 2}\n{"second": 1}\n'
        self.assertEqual(helpercli.first_json_object(text), {"alive": True, "num_nodes": 2})
        self.assertIsNone(helpercli.first_json_object("no json here\n[1, 2]\n"))
        # hostile output: many lines of '{' are tried a bounded number of times
        self.assertIsNone(helpercli.first_json_object("{\n" * 100000))

    def test_cluster_status_shape(self) -> None:
        doc = {"alive": True, "version": "2.58.0", "num_nodes": 2, "total_gpus": 16,
               "nodes": [{"node_id": "n1", "node_ip": "10.0.0.1", "alive": True, "is_head": True, "gpus": 8},
                         "junk", {"node_id": "n2", "alive": False}]}
        out = helpercli.cluster_status(doc, "2.59.0")
        self.assertEqual(out["num_nodes"], 2)
        self.assertEqual([n["state"] for n in out["nodes"]], ["ALIVE", "DEAD"])
        self.assertEqual(out["available_gpus"], 16.0)
        self.assertEqual(out["version_mismatch"], {"expected": "2.59.0", "observed": "2.58.0"})
        stopped = helpercli.cluster_status({"alive": False, "version": "2.58.0", "nodes": [{"node_id": "x"}],
                                            "error": "ConnectionError: no cluster"}, None)
        self.assertEqual((stopped["alive"], stopped["version"], stopped["num_nodes"], stopped["nodes"]),
                         (False, None, 0, []))
        self.assertIn("no cluster", stopped["detail"])
        dead = helpercli.cluster_status(None, None)
        self.assertEqual((dead["alive"], dead["version"], dead["num_nodes"], dead["nodes"]), (False, None, 0, []))

    def test_node_records_pass_through(self) -> None:
        """
        Every key of Ray's node record reaches the backend (it matches members by node_ip,
        node_manager_address or node_name and reads resources and metrics_export_port), with
        the keys it reads typed.
        """
        record = {"node_id": "n1", "node_ip": "10.0.0.2", "node_manager_address": "10.0.0.2",
                  "node_manager_port": 40123, "node_name": "gpu-b", "alive": True, "is_head": False,
                  "gpus": 8, "cpus": 64.0, "metrics_export_port": 8089, "ray_version": "2.58.0",
                  "resources": {"GPU": 8.0, "CPU": 64.0, "accelerator_type:H100": 1.0},
                  "labels": {"ray.io/node-id": "n1"}, "object_store_memory": None}
        out = helpercli.cluster_status({"alive": True, "version": "2.58.0", "num_nodes": 1, "nodes": [record]}, None)
        node = out["nodes"][0]
        for key, value in record.items():
            self.assertEqual(node[key], float(value) if key in ("gpus", "cpus") else value, key)
        self.assertEqual(node["state"], "ALIVE")
        # A record that names only its IP (the test image's helper, older helpers): the backend's
        # second key is filled in; a node name the helper gave is kept.
        bare = helpercli.node_record({"node_id": "n2", "node_ip": "10.0.0.3", "alive": False})
        self.assertEqual((bare["node_manager_address"], bare["node_name"], bare["state"]), ("10.0.0.3", None, "DEAD"))
        # The state Ray reports is kept (the backend also takes UP/ACTIVE as live).
        up = helpercli.node_record({"node_id": "n3", "state": "up"})
        self.assertEqual((up["state"], up["alive"]), ("UP", True))
        self.assertEqual(json.loads(json.dumps(out)), out)

    def test_node_records_are_bounded(self) -> None:
        """A container's node records are copied within bounds; what is not JSON is left out."""
        hostile = {"node_id": "n1", "node_ip": "10.0.0.2", "alive": True, "gpus": float("nan"),
                   "cpus": float("inf"), "huge": "x" * 100000, "deep": {"a": {"b": {"c": {"d": {"e": 1}}}}},
                   "many": list(range(10000)), "nan": float("nan"), "big": 10**40,
                   **{f"k{i}": i for i in range(500)}}
        node = helpercli.node_record(hostile)
        text = json.dumps(node, allow_nan=False)  # raises on NaN/inf
        self.assertLess(len(text), 20 * 1024)
        self.assertEqual((node["gpus"], node["cpus"]), (0.0, 0.0))
        self.assertNotIn("nan", node)
        self.assertNotIn("big", node)
        self.assertLessEqual(len(node.get("huge", "")), 1024)
        self.assertNotIn("e", json.dumps(node.get("deep", {})))
        self.assertLessEqual(len(node.get("many", [])), 256)
        self.assertEqual((node["node_id"], node["node_ip"], node["alive"]), ("n1", "10.0.0.2", True))
        many = helpercli.cluster_status({"alive": True, "nodes": [{"node_id": str(i)} for i in range(5000)]}, None)
        self.assertEqual(len(many["nodes"]), helpercli.MAX_NODES)

    def test_serve_status_active(self) -> None:
        """active: at least one app, every app RUNNING and every deployment healthy (the original's rule)."""
        def doc(*apps: tuple[str, str]) -> dict[str, Any]:
            return {"available": True, "applications": {
                f"a{i}": {"status": s, "deployments": {"d": {"status": d}}} for i, (s, d) in enumerate(apps)}}

        self.assertTrue(helpercli.serve_status(doc(("RUNNING", "HEALTHY"), ("RUNNING", "UP")), None)["active"])
        self.assertFalse(helpercli.serve_status(doc(("RUNNING", "HEALTHY"), ("DEPLOYING", "UPDATING")), None)["active"])
        self.assertFalse(helpercli.serve_status(doc(("RUNNING", "UNHEALTHY")), None)["active"])
        self.assertFalse(helpercli.serve_status(doc(), None)["active"])
        self.assertFalse(helpercli.serve_status({"available": False, "applications": {}}, None)["active"])
        self.assertFalse(helpercli.serve_status(None, None)["active"])

    def test_serve_status_shape(self) -> None:
        doc = {"available": True, "applications": {"a": {"status": "RUNNING", "deployments": {
            "LLMServer:m": {"status": "HEALTHY", "num_replicas_ready": 1}}}, "b": {"status": "DEPLOYING"}}}
        out = helpercli.serve_status(doc, "a")
        self.assertEqual(list(out["apps"]), ["a"])
        self.assertEqual(out["apps"]["a"]["deployments"]["LLMServer:m"]["num_replicas_ready"], 1)
        none = helpercli.serve_status({"available": False, "error": "There is no Serve instance running"}, None)
        self.assertIn("no serve instance", none["detail"].lower())


class MetricsTargetTests(SynchronousTestCase):
    def test_discovery_file(self) -> None:
        text = json.dumps([{"labels": {"job": "ray"}, "targets": ["127.0.0.2:44217", "127.0.0.3:8089"]},
                           {"targets": ["evil host:1", "x:99999", 7, "a" * 400 + ":1"]}, "junk"])
        out = helpercli.metrics_targets(text)
        self.assertTrue(out["enabled"])
        self.assertEqual([t["url"] for t in out["targets"]],
                         ["http://127.0.0.2:44217/metrics", "http://127.0.0.3:8089/metrics"])
        self.assertEqual(helpercli.metrics_targets("not json"), {"enabled": False, "targets": []})
        self.assertEqual(helpercli.metrics_targets(""), {"enabled": False, "targets": []})


class ExecReaderTests(SynchronousTestCase):
    def frame(self, kind: int, data: bytes) -> bytes:
        return struct.pack(">BxxxL", kind, len(data)) + data

    def test_demux_split_anywhere_and_bounded(self) -> None:
        stream = self.frame(1, b"hello ") + self.frame(2, b"oops") + self.frame(1, b"world" * 10)
        for cut in range(1, len(stream)):
            r = _Reader(20)
            r.feed(stream[:cut])
            r.feed(stream[cut:])
            self.assertEqual(bytes(r.out), (b"hello " + b"world" * 10)[:20])
            self.assertEqual(bytes(r.err), b"oops")
            self.assertTrue(r.truncated)

    def test_json_roundtrip_of_result(self) -> None:
        r = _Reader(1 << 20)
        r.feed(self.frame(1, json.dumps({"deployed": True}).encode()))
        self.assertEqual(helpercli.first_json_object(bytes(r.out).decode()), {"deployed": True})


class HostPathLinkTests(SynchronousTestCase):
    def test_links_below_the_root_refused_the_root_may_be_one(self) -> None:
        import os

        base = os.path.abspath(self.mktemp())
        disk = os.path.join(base, "disk")
        os.makedirs(os.path.join(disk, "hub"))
        os.makedirs(os.path.join(base, "elsewhere"))
        store = os.path.join(base, "store")
        os.symlink(disk, store)  # the operator's store on another disk: allowed
        rc._check_host_paths([(store, store), (os.path.join(store, "hub"), store)])
        os.symlink(os.path.join(base, "elsewhere"), os.path.join(disk, "escape"))
        with self.assertRaises(CommandFailed) as cm:
            rc._check_host_paths([(os.path.join(store, "escape"), store)])
        self.assertEqual(cm.exception.error_code, "policy_violation")
        self.assertIn("symbolic link", cm.exception.error_message)

    def test_a_link_below_the_root_is_refused_even_pointing_inside_it(self) -> None:
        """
        A link below the root is refused even when it points inside the root today: the engine
        follows it again at every start, and what it points to can change.
        """
        import os

        store = os.path.abspath(self.mktemp())
        os.makedirs(os.path.join(store, "real"))
        os.symlink(os.path.join(store, "real"), os.path.join(store, "alias"))
        os.symlink("real", os.path.join(store, "relative"))
        for name in ("alias", "relative"):
            with self.assertRaises(CommandFailed) as cm:
                rc._check_host_paths([(os.path.join(store, name), store)])
            self.assertEqual(cm.exception.error_code, "policy_violation")
