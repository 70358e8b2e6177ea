"""
The stand-in backend's Ray driver through its dev admin API (C{/dev/ray-environments}):
reconcile in the backend's order with its idempotency keys, a failed step stops the reconcile
and says which, teardown workers first. Nodes are scripted here (results applied as frames);
tests/test_integration_ray.py drives real agents and a real Ray cluster.
"""

from __future__ import annotations

import json
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.task import LoopingCall
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

from llmport_agent.devbackend import DevBackend

ANSWERS: dict[str, dict[str, Any]] = {
    "ensure_runtime_image": {"verified": True, "present": True, "matched_by": "rootfs_digest"},
    "ensure_ray_runtime": {"installed": True, "version": "2.58.0"},
    "start_ray_head": {"head_address": "127.0.0.2:6379"},
    "join_ray_cluster": {"joined": True},
    "get_ray_status": {"alive": True, "num_nodes": 2, "nodes": []},
    "leave_ray_cluster": {"left": True},
    "stop_ray": {"stopped": True},
}


class RayEnvironmentApiTests(TestCase):
    async def setUp(self) -> None:  # type: ignore[override]
        self.backend = DevBackend(reactor)
        await self.backend.listen(0, "127.0.0.1")
        self.addCleanup(self.backend.stop)
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.head = self.backend.enroll_node("head")["node_id"]
        self.worker = self.backend.enroll_node("worker")["node_id"]
        self.answers = {k: dict(v) for k, v in ANSWERS.items()}
        self.fail_on: str | None = None
        self.answered: set[str] = set()
        loop = LoopingCall(self._answer)
        loop.start(0.02)
        self.addCleanup(loop.stop)

    def _answer(self) -> None:
        for cmd in self.backend.commands():
            if cmd["id"] in self.answered or cmd["status"] not in ("queued", "dispatched"):
                continue
            self.answered.add(cmd["id"])
            kind = cmd["command_type"]
            frame: dict[str, Any] = {"type": "command_result", "command_id": cmd["id"], "success": kind != self.fail_on,
                                     "result": self.answers.get(kind, {})}
            if kind == self.fail_on:
                frame.update(error_code="runtime_image_mismatch", error_message="a different build")
            self.backend.state.apply_frame(cmd["node_id"], frame)

    async def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        url = self.backend.url + "/dev/" + path
        if method == "POST":
            response = await treq.post(url, json=body or {}, pool=self.pool)
        else:
            response = await treq.get(url, pool=self.pool)
        return response.code, json.loads(await response.content())

    def body(self) -> dict[str, Any]:
        return {"id": "env-1", "head": {"node_id": self.head, "node_ip": "127.0.0.2"},
                "workers": [{"node_id": self.worker, "node_ip": "127.0.0.3"}],
                "runtime_bundle": {"image": "x/ray:1", "digest": "sha256:" + "a" * 64}, "port": 6379}

    async def wait_state(self, *states: str) -> dict[str, Any]:
        await self.backend.wait_for(lambda: (self.backend.ray_environment("env-1") or {}).get("state") in states, 20)
        code, view = await self.api("GET", "ray-environments/env-1")
        self.assertEqual(code, 200)
        return dict(view)

    async def test_reconcile_and_teardown(self) -> None:
        code, view = await self.api("POST", "ray-environments", self.body())
        self.assertEqual((code, view["state"]), (200, "reconciling"))
        view = await self.wait_state("ready", "failed")
        self.assertEqual(view["state"], "ready", view["error"])
        steps = [(s["step"], s["node_id"]) for s in view["steps"]]
        self.assertEqual(steps, [
            ("ensure_runtime_image", self.head), ("ensure_runtime_image", self.worker),
            ("ensure_ray_runtime", self.head), ("ensure_ray_runtime", self.worker),
            ("start_ray_head", self.head), ("join_ray_cluster", self.worker),
        ])
        keys = [self.backend.command(s["command_id"])["idempotency_key"] for s in view["steps"]]
        self.assertEqual(keys[0], f"inference-env:env-1:1:ensure_runtime_image:{self.head}")
        self.assertEqual(keys[4], "inference-env:env-1:1:start_ray_head")
        self.assertEqual(keys[5], f"inference-env:env-1:1:join_ray_cluster:{self.worker}")
        join = self.backend.command(view["steps"][5]["command_id"])
        self.assertEqual(join["payload"]["head_address"], "127.0.0.2:6379")
        self.assertEqual(join["payload"]["credential_ref"], view["credential_ref"])
        probes = [c for c in self.backend.commands(self.head) if c["command_type"] == "get_ray_status"]
        self.assertTrue(probes and probes[0]["idempotency_key"].startswith(f"inference-env:probe:{self.head}:"))
        code, view = await self.api("POST", "ray-environments/env-1/teardown")
        view = await self.wait_state("torn_down", "failed")
        self.assertEqual(view["state"], "torn_down", view["error"])
        self.assertEqual([s["step"] for s in view["steps"]][-2:], ["leave_ray_cluster", "stop_ray"])
        stop = self.backend.command(view["steps"][-1]["command_id"])
        self.assertEqual(stop["payload"]["force"], True)

    async def test_a_failed_step_stops_the_reconcile(self) -> None:
        self.fail_on = "ensure_runtime_image"
        await self.api("POST", "ray-environments", self.body())
        view = await self.wait_state("failed")
        self.assertIn("ensure_runtime_image", view["error"])
        self.assertIn("runtime_image_mismatch", view["error"])
        self.assertFalse([c for c in self.backend.commands() if c["command_type"] == "start_ray_head"])

    async def test_image_not_verified_fails(self) -> None:
        self.answers["ensure_runtime_image"] = {"verified": False}
        await self.api("POST", "ray-environments", self.body())
        view = await self.wait_state("failed")
        self.assertIn("not verified", view["error"])

    async def test_bad_requests(self) -> None:
        code, _ = await self.api("POST", "ray-environments", {**self.body(), "head": {"node_id": "nope", "node_ip": "1"}})
        self.assertEqual(code, 422)
        code, _ = await self.api("POST", "ray-environments", {**self.body(), "runtime_bundle": None})
        self.assertEqual(code, 422)
        code, _ = await self.api("GET", "ray-environments/none")
        self.assertEqual(code, 404)
        code, _ = await self.api("POST", "ray-environments/none/teardown")
        self.assertEqual(code, 404)
