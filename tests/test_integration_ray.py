"""
Integration: multi-node inference on Ray (protocol 10.6), end to end.

Two agents, each on its own private Docker engine, each running its runtime container from
the Ray test bundle image (Ray 2.58.0 from the package index, the helper CLI on Ray's SDK),
driven by the stand-in backend's Ray driver through the whole reconcile: image verified on
both (by rootfs digest on the node whose config id differs), head started on 127.0.0.2,
worker joined from 127.0.0.3, C{get_ray_status} shows 2 alive nodes, a trivial Serve app
deployed and answering on its route on 127.0.0.1, described from Ray itself
(C{describe_ray_cluster}: members, Serve, the app with no LLM configuration), deleted, worker leaves, head stops, both
containers gone. Along the way: the cluster token is in no result, progress frame, event,
journal line or log line.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import treq
from twisted.internet import reactor
from twisted.logger import formatEvent, globalLogPublisher
from twisted.web.client import HTTPConnectionPool

from llmport_agent.devbackend.rayenv import RayEnvironment, RayNode
from llmport_agent.ray.imagepin import rootfs_digest
from tests.agentharness import AgentTestCase
from tests.support.docker_env import free_port, require_docker
from tests.support.ray_env import IMAGE, import_ray_image, require_ray_image, require_second_docker

TERMINAL = ("succeeded", "failed")
#: A registry address on loopback where nothing listens: pulls from it fail at once, offline.
DEAD_REGISTRY = "127.0.0.1:1"


def bundle_for(info: dict[str, Any], model_store: str) -> dict[str, Any]:
    """The runtime bundle of the test image as the backend pins it (from one node's copy)."""
    return {
        "name": "llm-port-ray-runtime",
        "image": IMAGE,
        "digest": info["Id"],
        "rootfs_digest": rootfs_digest(info["RootFS"]["Layers"]),
        "repo_digest": None,
        "runtime_handler": "docker",
        "requirements": {"network_mode": "host", "ipc_mode": "host", "gpus": "none",
                         "capabilities": ["IPC_LOCK"], "shm_size": "256m", "ulimits": {"nofile": 4096}},
        "mounts": [{"host_path": model_store, "container_path": "/models", "mode": "ro"}],
        "env": {"RAY_DEDUP_LOGS": "0", "LD_PRELOAD": "/evil.so", "RAY_AUTH_MODE": "off"},
    }


class RayClusterTests(AgentTestCase):
    timeout = 900

    def setUp(self) -> None:
        self.tar = require_ray_image()
        self.env_a = require_docker()
        self.env_b = require_second_docker()
        self.lines: list[str] = []

        def observe(event: dict[str, Any]) -> None:
            text = formatEvent(event)
            if text:
                self.lines.append(text)
            failure = event.get("log_failure")
            if failure is not None:
                self.lines.append(failure.getTraceback())

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)

    def _cleanup_containers(self) -> None:
        # The test engines are private to this run: a leftover of that name from another test
        # (a stand-in) goes too.
        for env in (self.env_a, self.env_b):
            for c in env.client().containers.list(all=True, filters={"label": "io.llmport.ray-runtime"}):
                c.remove(force=True)
            for c in env.client().containers.list(all=True, filters={"name": "^/llm-port-ray-runtime$"}):
                c.remove(force=True)

    async def start_node(self, backend: Any, env: Any, name: str, store: str) -> tuple[Any, str, str]:
        state = os.path.abspath(self.mktemp())
        token_dir = os.path.join(state, "ray-token")
        agent = self.start_agent(
            backend, state_dir=state, docker_host=env.host, AGENT_ID=f"ray-{name}-{uuid.uuid4().hex[:6]}",
            RAY_TOKEN_DIR=token_dir, RAY_SESSION_DIR=os.path.join(state, "ray-session"),
            IMAGE_ALLOWLIST=f"llmport-test,{DEAD_REGISTRY}", MODEL_STORE=store,
        )
        node_id = await self.wait_connected(backend, agent)
        await backend.wait_for(lambda: agent.engine.available, 30)
        return agent, node_id, store

    async def command(self, backend: Any, node_id: str, kind: str, payload: dict[str, Any],
                      timeout: float = 120) -> dict[str, Any]:
        cmd = backend.issue_command(node_id, kind, payload)
        await backend.wait_for(lambda: backend.command(cmd["id"])["status"] in TERMINAL, timeout)
        return dict(backend.command(cmd["id"]))

    async def test_two_node_cluster_serve_app_and_teardown(self) -> None:
        self._cleanup_containers()
        info_a = await self._in_thread(import_ray_image, self.env_a, self.tar)
        await self._in_thread(import_ray_image, self.env_b, self.tar)
        self.addCleanup(self._cleanup_containers)
        backend = await self.start_backend()
        store = os.path.abspath(self.mktemp())  # one model store path on both "nodes", as on a cluster
        os.makedirs(os.path.join(store, "hub"))
        agent_a, node_a, _ = await self.start_node(backend, self.env_a, "head", store)
        agent_b, node_b, _ = await self.start_node(backend, self.env_b, "worker", store)

        # A node without Ray answers the status probe, alive false (not an unknown command).
        rec = await self.command(backend, node_a, "get_ray_status", {})
        self.assertEqual(rec["status"], "succeeded", rec.get("error_message"))
        self.assertEqual((rec["result"]["alive"], rec["result"]["num_nodes"], rec["result"]["nodes"]), (False, 0, []))

        # The backend pins the head's copy; the worker's copy has another config id but the
        # same layers: the rootfs digest decides.
        bundle = bundle_for(info_a, store)
        # The local policy, before anything reaches the engine: a host path outside the store,
        # an image outside IMAGE_ALLOWLIST, a bundle without its pin.
        for bad, code in (({**bundle, "mounts": [{"host_path": "/etc", "container_path": "/models"}]}, "policy_violation"),
                          ({**bundle, "image": "docker.io/someone/ray:2.58.0"}, "policy_violation"),
                          ({**bundle, "digest": None}, "invalid_command")):
            rec = await self.command(backend, node_a, "ensure_runtime_image", {"runtime_bundle": bad, "ensure_container": True})
            self.assertEqual((rec["status"], rec["error_code"]), ("failed", code), rec.get("error_message"))
        self.assertEqual(self.env_a.client().containers.list(all=True, filters={"label": "io.llmport.ray-runtime"}), [])

        # A different build under the pinned name: reported by fetch: false, refused otherwise
        # (after a pull that fails: the registry is a dead loopback port).
        pinned = f"{DEAD_REGISTRY}/llmport-test/ray-runtime:2.58.0"
        self.env_a.client().api.tag(IMAGE, f"{DEAD_REGISTRY}/llmport-test/ray-runtime", "2.58.0")
        other = {**bundle, "image": pinned, "digest": "sha256:" + "0" * 64, "rootfs_digest": "sha256:" + "1" * 64}
        rec = await self.command(backend, node_a, "ensure_runtime_image", {"runtime_bundle": other, "fetch": False})
        self.assertEqual((rec["result"]["verified"], rec["result"]["present"]), (False, True))
        rec = await self.command(backend, node_a, "ensure_runtime_image", {"runtime_bundle": other})
        self.assertEqual((rec["status"], rec["error_code"]), ("failed", "runtime_image_mismatch"), rec.get("error_message"))
        rec = await self.command(backend, node_a, "ensure_runtime_image",
                                 {"runtime_bundle": {**other, "image": f"{DEAD_REGISTRY}/llmport-test/absent:1"}})
        self.assertEqual((rec["status"], rec["error_code"]), ("failed", "runtime_image_missing"), rec.get("error_message"))
        self.env_a.remove_image(pinned)
        gcs_port, serve_port = free_port(), free_port()
        env = RayEnvironment(
            backend, "env-" + uuid.uuid4().hex[:8],
            head=RayNode(node_a, "127.0.0.2"), workers=[RayNode(node_b, "127.0.0.3")],
            bundle=bundle, port=gcs_port, num_cpus=1,
            env={"NCCL_SOCKET_IFNAME": "lo", "RAY_AUTH_TOKEN_PATH": "/tmp/other", "PATH": "/evil"},
        )
        status = await env.reconcile()
        self.assertEqual(status["num_nodes"], 2)
        self.assertEqual(sorted(n["node_ip"] for n in status["nodes"] if n["alive"]), ["127.0.0.2", "127.0.0.3"])
        self.assertEqual(status["version"], "2.58.0")
        steps = [s[0] for s in env.steps]
        self.assertEqual(steps[:6], ["ensure_runtime_image"] * 2 + ["ensure_ray_runtime"] * 2 + ["start_ray_head", "join_ray_cluster"])
        images = {n: backend.command(c)["result"] for (s, n, c, _st) in env.steps if s == "ensure_runtime_image"}
        self.assertEqual(images[node_a]["matched_by"], "rootfs_digest")
        self.assertEqual(images[node_b]["matched_by"], "rootfs_digest")
        self.assertNotEqual(images[node_a]["image_id"], images[node_b]["image_id"])
        keys = {backend.command(c)["idempotency_key"] for (_s, _n, c, _st) in env.steps}
        self.assertIn(f"inference-env:{env.env_id}:1:start_ray_head", keys)
        self.assertIn(f"inference-env:{env.env_id}:1:join_ray_cluster:{node_b}", keys)

        # The runtime container: host network and IPC, sleep infinity, the token dir read-only,
        # only what the bundle names (the filtered env, the capability, the shm and ulimit).
        c = self.env_a.client().api.inspect_container("llm-port-ray-runtime")
        host = c["HostConfig"]
        self.assertEqual((host["NetworkMode"], host["IpcMode"], host["RestartPolicy"]["Name"]),
                         ("host", "host", "no"))
        self.assertEqual(host["CapAdd"], ["IPC_LOCK"])
        self.assertFalse(host["Privileged"])
        self.assertEqual(host["ShmSize"], 256 * 1024 * 1024)
        self.assertEqual([c["Path"], *c["Args"]], ["sleep", "infinity"])
        env_vars = dict(e.split("=", 1) for e in c["Config"]["Env"])
        self.assertEqual(env_vars["RAY_AUTH_MODE"], "token")
        self.assertNotIn("LD_PRELOAD", env_vars)
        self.assertNotIn("NCCL_SOCKET_IFNAME", env_vars)  # start/join env goes to the exec only
        token_dir = agent_a.config.ray_token_dir
        self.assertIn(f"{token_dir}:{token_dir}:ro", host["Binds"])
        self.assertIn(f"{store}:/models:ro", host["Binds"])
        session_dir = agent_a.config.ray_session_dir
        self.assertIn(f"{session_dir}:/tmp/ray:rw", host["Binds"])
        self.assertEqual(len(host["Binds"]), 3)
        # Ray's session directory reaches the host side (where the Serve log reader looks).
        self.assertTrue(any(n.startswith("session_") for n in os.listdir(session_dir)), os.listdir(session_dir))
        self.assertEqual(os.stat(os.path.join(token_dir, "cluster.token")).st_mode & 0o777, 0o600)

        # A second start at the same address is a success that starts nothing.
        again = await self.command(backend, node_a, "start_ray_head", {
            "credential_ref": env.credential_ref, "port": gcs_port, "node_ip_address": "127.0.0.2",
            "include_dashboard": False, "runtime_bundle": bundle,
        }, timeout=300)
        self.assertEqual(again["status"], "succeeded", again.get("error_message"))
        self.assertTrue(again["result"]["already_running"])
        self.assertEqual(again["result"]["head_address"], f"127.0.0.2:{gcs_port}")

        # A trivial Serve app (not vLLM), answering on its route on 127.0.0.1.
        app = "llmport-" + uuid.uuid4().hex[:8]
        run = await env.run_app(app, {"llm_configs": [{"model_loading_config": {"model_id": "tiny-model"}}]},
                                {"host": "127.0.0.1", "port": serve_port})
        self.assertEqual(run["route_prefix"], f"/{app}")
        pool = HTTPConnectionPool(reactor, persistent=False)
        response = await treq.get(f"http://127.0.0.1:{serve_port}/{app}", timeout=30, pool=pool)
        self.assertEqual(response.code, 200)
        self.assertEqual(json.loads(await response.content())["models"], ["tiny-model"])
        # describe_ray_cluster from the real Ray (the inspection program, python3 in the image):
        # both members, Serve, and the app, whose echo deployment holds no LLM configuration, so
        # its llm_configs are [] and the backend's candidate differs by length.
        candidate = {"llm_configs": [{"model_loading_config": {"model_id": "tiny-model"}}]}
        rec = await self.command(backend, node_a, "describe_ray_cluster", {"verify": {app: candidate}})
        self.assertEqual(rec["status"], "succeeded", rec.get("error_message"))
        d = rec["result"]
        self.assertEqual((d["source"], d["attached"], d["ray_version"]), ("ray", True, "2.58.0"), d["errors"])
        self.assertEqual(d["errors"], [])
        self.assertEqual(d["gcs_address"], f"127.0.0.2:{gcs_port}")
        self.assertEqual(sorted((n["ip"], n["is_head"]) for n in d["nodes"] if n["alive"]),
                         [("127.0.0.2", True), ("127.0.0.3", False)])
        self.assertEqual((d["serve"]["running"], d["serve"]["http_options"]["port"]), (True, serve_port))
        (described,) = [a for a in d["apps"] if a["name"] == app]
        self.assertEqual((described["llm_configs"], described["route_prefix"]), ([], f"/{app}"))
        self.assertEqual([dep["name"] for dep in described["deployments"]], ["echo"])
        self.assertEqual(described["verify"], {"equal": False, "diff": [
            {"path": "llm_configs", "running": 0, "candidate": 1, "length": True}]})
        self.assertNotIn("cluster_token", d)
        deleted = await env.delete_app(app)
        self.assertTrue(deleted["deleted"])
        serve = await self.command(backend, node_a, "get_ray_serve_status", {"app_name": app, "runtime_bundle": bundle})
        self.assertEqual(serve["result"]["apps"], {})

        # Teardown: the worker leaves, the head stops; both containers and the token are gone.
        await env.teardown()
        for e in (self.env_a, self.env_b):
            self.assertEqual(e.client().containers.list(all=True, filters={"label": "io.llmport.ray-runtime"}), [])
        self.assertFalse(os.path.exists(os.path.join(token_dir, "cluster.token")))
        rec = await self.command(backend, node_a, "get_ray_status", {})
        self.assertFalse(rec["result"]["alive"])

        # The cluster token reached no result, progress frame, event, journal or log line.
        token = backend.cluster_secrets[env.credential_ref].token
        self.assertGreaterEqual(backend.cluster_secrets[env.credential_ref].fetches, 2)
        def absent(text: str, where: str) -> None:
            # Never assertNotIn: its failure message would print the token.
            self.assertFalse(token in text, f"the cluster token appears in {where}")

        for node in (node_a, node_b):
            for frame in backend.frames(node):
                absent(json.dumps(frame), f"a frame from node {node} ({frame.get('type')})")
            for event in backend.events(node):
                absent(json.dumps(event), f"an event of node {node}")
        for agent in (agent_a, agent_b):
            for name in ("commands.jsonl", "events.jsonl", "state.json"):
                path = os.path.join(agent.state_dir, name)
                if os.path.exists(path):
                    with open(path, encoding="utf-8", errors="replace") as f:
                        absent(f.read(), name)
        self.assertTrue(self.lines)
        for i, line in enumerate(self.lines):
            absent(line, f"log line {i}")

    def _in_thread(self, fn: Any, *args: Any) -> Any:
        from twisted.internet.threads import deferToThread

        return deferToThread(fn, *args)



class NoDockerTests(AgentTestCase):
    async def test_get_ray_status_without_the_docker_executor(self) -> None:
        """An agent without the Docker executor still answers the probe: no Ray, alive false."""
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        cmd = backend.issue_command(node_id, "get_ray_status", {})
        await backend.wait_for(lambda: backend.command(cmd["id"])["status"] in TERMINAL, 20)
        rec = backend.command(cmd["id"])
        self.assertEqual(rec["status"], "succeeded", rec.get("error_message"))
        self.assertEqual((rec["result"]["alive"], rec["result"]["num_nodes"], rec["result"]["nodes"]), (False, 0, []))
