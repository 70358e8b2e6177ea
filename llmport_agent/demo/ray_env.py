"""
C{llmport-agent demo --ray}: a two-node Ray cluster on loopback, driven by the stand-in backend.

Two agents on one Docker engine (C{DOCKER_HOST}, else the default socket), each with its own
runtime container (the second one named C{llm-port-ray-runtime-worker}: one engine cannot hold
two containers of one name), from a local Ray runtime image (C{--ray-image}, default
L{DEFAULT_IMAGE}, which C{tests/support/rayimage/build.sh} builds). The stand-in backend pins
the image it finds and reconciles the environment as the newest llm-port backend does
(L{llmport_agent.devbackend.rayenv}): the image probed on both nodes (both share the engine, so
both already hold it and nothing moves), the Ray runtime checked, the head started on
127.0.0.2, the worker joined from 127.0.0.3, the head's status until both are live, then one
health check. It deploys a trivial Serve app of the test image on 127.0.0.1, reads it, deletes
it and tears the cluster down.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import tempfile
import time
import uuid
from typing import Any

from llmport_agent.demo.steps import STEP_TIMEOUT, Say

DEFAULT_IMAGE = "llmport-test/ray-runtime:2.58.0"

HOW_TO_BUILD = (
    "build it as root with `bash tests/support/rayimage/build.sh` (debootstrap, ray[serve]==2.58.0 "
    "from the package index and the helper CLI; a few minutes, cached) and load the tar it prints "
    "with `docker import <tar> " + DEFAULT_IMAGE + "`, or pass --ray-image with a local image that "
    "holds ray 2.58.0 and the llm-port-ray-runtime helper"
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def demo_ray(
    reactor: Any, args: argparse.Namespace, say: Say, docker_environ: dict[str, str] | None, gpu_source: Any = None
) -> int:
    import treq
    from twisted.web.client import HTTPConnectionPool

    from llmport_agent.agent.service import AgentService
    from llmport_agent.core.config import load_config
    from llmport_agent.devbackend import DevBackend
    from llmport_agent.devbackend.rayenv import (
        READY,
        STOPPED,
        EnvironmentFailed,
        RayEnvironment,
        RayNode,
    )
    from llmport_agent.ray.imagepin import image_identity

    started = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="llmport-demo-ray-")
    backend = DevBackend(reactor)
    agents: list[AgentService] = []
    env: RayEnvironment | None = None
    image = args.ray_image
    try:
        await backend.listen(0, "127.0.0.1")
        say(f"[backend] stand-in backend listening on {backend.url}")
        node_ids = []
        for role in ("head", "worker"):
            token = backend.mint_token(f"demo-ray-{role}")
            config = load_config({
                "LLM_PORT_NODE_AGENT_BACKEND_URL": backend.url,
                "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN": token["token"],
                "LLM_PORT_NODE_AGENT_AGENT_ID": f"demo-ray-{role}",
                "LLM_PORT_NODE_AGENT_HOST": "127.0.0.1",
                "LLM_PORT_NODE_AGENT_STATE_PATH": f"{workdir}/{role}/state.json",
                "LLM_PORT_NODE_AGENT_MODEL_STORE": f"{workdir}/{role}/models",
                "LLM_PORT_NODE_AGENT_RAY_TOKEN_DIR": f"{workdir}/{role}/ray-token",
                "LLM_PORT_NODE_AGENT_RAY_SESSION_DIR": f"{workdir}/{role}/ray-session",
                "LLM_PORT_NODE_AGENT_OPS_PORT": "0",
            }, {})
            agent = AgentService(reactor, config, fatal=lambda code, msg: say(f"[agent]   {msg}"),
                                 docker_enabled=True, docker_environ=docker_environ, gpu_source=gpu_source)
            agent.startService()
            agents.append(agent)
            await backend.wait_for(lambda a=agent: a.session.node_id is not None, STEP_TIMEOUT)  # type: ignore[misc]
            node_ids.append(str(agent.session.node_id))
            say(f"[agent]   {role} enrolled as node {agent.session.node_id}")
        engine = agents[0].engine
        await backend.wait_for(lambda: engine.checked, STEP_TIMEOUT)
        if not engine.available:
            say(f"[agent]   {engine.last_error}")
            say("demo --ray needs a Docker engine: start dockerd or point DOCKER_HOST at one")
            return 1
        identity = await engine.call(image_identity, image, what=f"inspecting image {image}")
        if not identity.present:
            say(f"The Ray runtime image {image} is not on the engine at {engine.address}: {HOW_TO_BUILD}.")
            return 1
        bundle = {
            "name": "llm-port-ray-runtime", "image": image, "digest": identity.image_id,
            "rootfs_digest": identity.rootfs_digest, "runtime_handler": "docker",
            "requirements": {"network_mode": "host", "ipc_mode": "host", "gpus": "none"},
            "mounts": [],
        }
        say(f"[backend] runtime bundle pins {image} (config id {identity.image_id[:19]}, "
            f"rootfs {str(identity.rootfs_digest)[:19]})")
        env = RayEnvironment(
            backend, "demo-" + uuid.uuid4().hex[:6],
            head=RayNode(node_ids[0], "127.0.0.2"),
            workers=[RayNode(node_ids[1], "127.0.0.3", container_name="llm-port-ray-runtime-worker")],
            bundle=bundle, port=_free_port(), num_cpus=1, seed_port=_free_port(),
        )
        t0 = reactor.seconds()
        outcome = await env.up(timeout=600)

        def who(node_id: str) -> str:
            return "head" if node_id == node_ids[0] else "worker"

        for step in env.steps:
            rec = backend.command(step.command_id)
            why = f" {rec.get('error_code')}" if rec.get("error_code") else ""
            say(f"[backend] {rec['command_type']:<22} {who(step.node_id):<6} {rec['status']}{why}"
                f"  ({rec.get('idempotency_key')})")
        if outcome != READY:
            say(f"demo --ray failed: the environment is {outcome}: {env.reason}")
            return 1
        status = env.cluster or {}
        say(f"[backend] cluster up in {reactor.seconds() - t0:.1f} s: Ray {status.get('version')}, "
            f"{status.get('num_nodes')} nodes: "
            + ", ".join(f"{n.get('node_ip')}{' (head)' if n.get('is_head') else ''}"
                        for n in status.get("nodes", []) if n.get("alive")))
        probes = env.probes
        await env.check()
        say(f"[backend] health check (get_ray_status with include_metrics on the head, every minute): "
            f"{env.status}, {env.probes - probes} probe")
        serve_port = _free_port()
        app = "llmport-demo"
        run = await env.run_app(app, {"llm_configs": [{"model_loading_config": {"model_id": "demo-model"}}]},
                                {"host": "127.0.0.1", "port": serve_port})
        url = f"http://127.0.0.1:{serve_port}{run.get('route_prefix', '/' + app)}"
        pool = HTTPConnectionPool(reactor, persistent=False)
        response = await treq.get(url, timeout=30, pool=pool)
        body = await response.content()
        say(f"[backend] Serve app {app} at {url}: HTTP {response.code} {json.loads(body) if response.code == 200 else body[:200]!r}")
        await env.delete_app(app)
        say(f"[backend] Serve app {app} deleted")
        torn = await env.down(timeout=300)
        env.stop()
        env = None
        if torn != STOPPED:
            say(f"demo --ray failed: teardown did not finish: {torn}")
            return 1
        say("[backend] worker left, head stopped, both runtime containers removed")
        say(f"demo --ray finished in {time.monotonic() - started:.1f} s: OK")
        return 0
    except EnvironmentFailed as e:
        say(f"demo --ray failed: {e}")
        return 1
    except Exception as e:  # a step timed out or broke: say which, exit non-zero
        say(f"demo --ray failed: {type(e).__name__}: {e}")
        return 1
    finally:
        if env is not None:
            try:
                await env.down(timeout=300)
                env.stop()
            except Exception as e:  # noqa: BLE001 - best effort, said
                say(f"[backend] teardown after the failure did not finish: {e}")
        for agent in agents:
            await agent.stopService()
        await backend.stop()
        shutil.rmtree(workdir, ignore_errors=True)
