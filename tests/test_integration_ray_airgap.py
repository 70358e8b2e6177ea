"""
Integration: a two-node Ray environment brought up on an air-gapped site by the stand-in
backend's reconcile (protocol 10.6, the newest backend's order), end to end.

Two agents, each on its own private Docker engine (two dockerd, --bridge=none), with NO copy of
the runtime image on either engine at the start and no registry reachable (and nothing pulled:
the engines' event logs are read). The stand-in probes both (each answers
C{runtime_image_missing}), has the head load the image from the backend's image-save route
(the backend serves the tar once, to that node alone), then has the head serve it to the worker
(C{serve_runtime_image}) while the worker is asked, at the same moment, to fetch it from that
peer. Ray forms a two-node cluster (head 127.0.0.2, worker 127.0.0.3, host networking). The
worker's runtime container is then removed behind its agent's back (C{docker rm -f} on its
engine): the health check (every 5 s here, every minute by default) sees the worker gone,
looks again 20 s later, and recovers it (leave, fresh join). Teardown leaves no container, no
seeding or download file, no listening seed port, and the loaded images are removed.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from typing import Any

from twisted.internet import reactor
from twisted.internet.threads import deferToThread

from llmport_agent.devbackend.rayenv import READY, STOPPED, RayEnvironment, RayNode
from tests.agentharness import AgentTestCase
from tests.support.docker_env import free_port, require_docker
from tests.support.ray_airgap import AIRGAP_IMAGE, save_tar
from tests.support.ray_env import IMAGE, require_ray_image, require_second_docker

HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"
LABEL = "io.llmport.ray-runtime"
#: Ray's GCS marks a node dead after this many missed 1 s health checks (default: 5 of 3 s).
RAY_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}


def _remove_images(env: Any) -> None:
    """Both test names (and so every tag of their ids) gone from the engine."""
    import docker

    api = env.client().api
    for ref in (AIRGAP_IMAGE, IMAGE):
        try:
            image_id = api.inspect_image(ref)["Id"]
        except docker.errors.NotFound:
            continue
        api.remove_image(image_id, force=True)


def _containers(env: Any) -> list[Any]:
    return list(env.client().containers.list(all=True, filters={"label": LABEL}))


def _pulls(env: Any, since: float) -> list[dict[str, Any]]:
    events = env.client().api.events(since=int(since) - 1, until=int(time.time()) + 1, decode=True,
                                     filters={"type": "image", "event": "pull"})
    return list(events)


def _listening(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((ip, port)) == 0


class AirGappedEnvironmentTests(AgentTestCase):
    timeout = 600

    def setUp(self) -> None:
        self.rootfs = require_ray_image()
        self.engine_a = require_docker()
        self.engine_b = require_second_docker()

    def _clean_engines(self) -> None:
        for env in (self.engine_a, self.engine_b):
            for c in _containers(env):
                c.remove(force=True)
            for c in env.client().containers.list(all=True, filters={"name": "^/llm-port-ray-runtime$"}):
                c.remove(force=True)
            _remove_images(env)

    async def start_node(self, backend: Any, engine: Any, role: str, store: str) -> tuple[Any, str, str]:
        state = os.path.abspath(self.mktemp())
        downloads = os.path.join(state, "image-downloads")
        os.makedirs(downloads)
        agent = self.start_agent(
            backend, state_dir=state, docker_host=engine.host, AGENT_ID=f"airgap-{role}-{uuid.uuid4().hex[:6]}",
            RAY_TOKEN_DIR=os.path.join(state, "ray-token"), RAY_SESSION_DIR=os.path.join(state, "ray-session"),
            IMAGE_ALLOWLIST="llmport-test", IMAGE_DOWNLOAD_DIR=downloads, MODEL_STORE=store,
        )
        node_id = await self.wait_connected(backend, agent)
        await backend.wait_for(lambda: agent.engine.available, 30)
        return agent, node_id, downloads

    async def test_image_from_the_server_once_then_a_peer_cluster_recovery_and_teardown(self) -> None:
        tar, image_id, rootfs = await deferToThread(save_tar, self.rootfs)
        await deferToThread(self._clean_engines)
        self.addCleanup(deferToThread, self._clean_engines)
        for engine in (self.engine_a, self.engine_b):
            self.assertEqual(engine.client().images.list(name=AIRGAP_IMAGE.rsplit(":", 1)[0]), [])
        started = time.time()

        backend = await self.start_backend()
        repo, tag = AIRGAP_IMAGE.rsplit(":", 1)
        backend.add_image(repo, tag, tar, os.path.getsize(tar), image_id=image_id, rootfs_digest=rootfs)
        store = os.path.abspath(self.mktemp())
        os.makedirs(os.path.join(store, "hub"))
        head_agent, head, head_dl = await self.start_node(backend, self.engine_a, "head", store)
        worker_agent, worker, worker_dl = await self.start_node(backend, self.engine_b, "worker", store)

        bundle = {
            "name": "llm-port-ray-runtime", "image": AIRGAP_IMAGE, "digest": image_id, "rootfs_digest": rootfs,
            "repo_digest": None, "runtime_handler": "docker",
            "requirements": {"network_mode": "host", "ipc_mode": "host", "gpus": "none"},
            "mounts": [{"host_path": store, "container_path": "/models", "mode": "ro"}],
        }
        seed_port = free_port()
        env = RayEnvironment(backend, "airgap-" + uuid.uuid4().hex[:6], RayNode(head, HEAD_IP), [RayNode(worker, WORKER_IP)],
                             bundle, port=free_port(), num_cpus=1, seed_port=seed_port, env=dict(RAY_HEALTH),
                             check_every=5.0)
        self.addCleanup(env.stop)

        status = await env.up(timeout=400)
        self.assertEqual(status, READY, f"{env.reason}; history: {env.history}")
        steps = [s.step for s in env.steps]
        self.assertEqual(steps[:5], [f"image-probe:{head}", f"image-probe:{worker}", f"image-from-server:{head}",
                                     f"image-seed:{head}", f"image-from-peer:{worker}"], steps)
        self.assertNotIn(f"image-from-server:{worker}", steps)
        for step in env.steps[:2]:
            probe = backend.command(step.command_id)
            self.assertEqual((probe["status"], probe["error_code"]), ("failed", "runtime_image_missing"), probe)
        # The backend served the image once: one complete download, by the head alone.
        self.assertEqual({f.node_id for f in backend.image_fetches}, {head}, backend.image_fetches)
        self.assertEqual([f.bytes_sent for f in backend.image_fetches if f.complete], [os.path.getsize(tar)])
        # The head served the worker over the fabric: one peer, then it stopped serving.
        serve = next(s for s in env.steps if s.step == f"image-seed:{head}")
        await backend.wait_for(lambda: backend.command(serve.command_id)["status"] == "succeeded", 60)
        self.assertEqual(backend.command(serve.command_id)["result"]["served"], 1)
        peer = backend.command(next(s for s in env.steps if s.step == f"image-from-peer:{worker}").command_id)
        self.assertTrue(peer["result"]["verified"], peer)
        # Both engines hold the pinned build now (the same rootfs), and nothing was pulled.
        for engine in (self.engine_a, self.engine_b):
            self.assertEqual(engine.client().api.inspect_image(AIRGAP_IMAGE)["Id"], image_id)
            self.assertEqual(await deferToThread(_pulls, engine, started), [])
        self.assertEqual(sorted(n["node_ip"] for n in (env.cluster or {}).get("nodes", []) if n.get("alive")), [HEAD_IP, WORKER_IP])

        # The worker's runtime container removed behind its agent's back: recovered by the check.
        (before,) = await deferToThread(_containers, self.engine_b)
        await deferToThread(before.remove, force=True)
        t0 = reactor.seconds()
        await backend.wait_for(lambda: env.recovery is not None, 90)
        self.assertEqual((env.recovery or {}).get("kind"), "members")
        await backend.wait_for(lambda: env.last_recovery is not None, 120)
        self.assertGreaterEqual(reactor.seconds() - t0, 20)  # the 20 s confirmation came first
        self.assertEqual(env.status, READY, env.reason)
        last = env.last_recovery or {}
        self.assertEqual((last.get("kind"), last.get("attempts")), ("members", 1))
        recovered = [s.step for s in env.steps if s.step.startswith("recover")]
        self.assertEqual(recovered, [f"recover1:leave:{worker}", f"recover1:join:{worker}"])
        (after,) = await deferToThread(_containers, self.engine_b)
        self.assertNotEqual(after.id, before.id)
        self.assertEqual(sorted(n["node_ip"] for n in (env.cluster or {}).get("nodes", []) if n.get("alive")), [HEAD_IP, WORKER_IP])

        # Teardown: the worker leaves, the head stops; nothing is left behind.
        self.assertEqual(await env.down(timeout=120), STOPPED, env.reason)
        env.stop()
        for engine in (self.engine_a, self.engine_b):
            self.assertEqual(await deferToThread(_containers, engine), [])
        self.assertEqual(os.listdir(head_dl) + os.listdir(worker_dl), [])
        self.assertFalse(_listening(HEAD_IP, seed_port))
        self.assertFalse(_listening(HEAD_IP, env.port))  # no GCS left
        for agent in (head_agent, worker_agent):
            self.assertFalse(os.path.exists(os.path.join(agent.config.ray_token_dir, "cluster.token")))
        self.assertEqual([c for c in reactor.getDelayedCalls() if getattr(getattr(c, "func", None), "__self__", None) is env], [])
