"""
The stand-in backend's Ray environment driver (llmport_agent/devbackend/rayenv.py), stage by
stage and transition by transition, on a task.Clock with scripted nodes (their results applied
as frames the moment a command is queued, or held back): the image probe, the server load, the
peers served at the same moment as the serve, the fallback to the server, 150 s waits resumed
by idempotency key, backoff and the hourly re-check of permanent failures, the minute health
check with its 20 s confirmation, recovery (at most 3 attempts), teardown, and the dev admin
API. tests/test_integration_ray_airgap.py drives real agents, engines and Ray.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

from llmport_agent.devbackend import DevBackend
from llmport_agent.devbackend.rayenv import (
    DEGRADED,
    FAILED,
    PREPARING,
    READY,
    STOPPED,
    RayEnvironment,
    RayNode,
)

BUNDLE = {"name": "llm-port-ray-runtime", "image": "x/ray:1", "digest": "sha256:" + "a" * 64,
          "rootfs_digest": "sha256:" + "b" * 64}


class Fleet:
    """
    Scripted nodes: each command is answered when it is queued, from the fleet's idea of each
    node (image or not, in the Ray cluster or not), unless its type is in C{hold} (answered
    later with L{answer}) or C{override} has an answer for it.
    """

    def __init__(self, backend: DevBackend, ips: dict[str, str]) -> None:
        self.backend = backend
        self.ips = ips  # node id -> Ray IP
        self.head = next(iter(ips))
        self.images: set[str] = set()
        self.members: set[str] = set()  # node ids live in Ray
        self.hold: set[str] = set()  # "command_type" or "command_type@node"
        self.override: dict[str, Any] = {}  # same keys -> (success, result, error_code)
        self.held: list[dict[str, Any]] = []
        self.seen: set[str] = set()
        self.order: list[tuple[str, str]] = []  # (command_type, node) as queued
        self.refuse_join = False
        backend.state.wake = self.on_wake

    def on_wake(self, node_id: str) -> None:
        for cmd in self.backend.commands(node_id):
            if cmd["id"] in self.seen or cmd["status"] != "queued":
                continue
            self.seen.add(cmd["id"])
            kind = cmd["command_type"]
            self.order.append((kind, node_id))
            if kind in self.hold or f"{kind}@{node_id}" in self.hold:
                self.held.append(cmd)
                continue
            self.respond(cmd)

    def answer(self, cmd: dict[str, Any], success: bool, result: dict[str, Any] | None = None,
               error_code: str | None = None) -> None:
        frame: dict[str, Any] = {"type": "command_result", "command_id": cmd["id"], "success": success,
                                 "result": result or {}}
        if error_code:
            frame.update(error_code=error_code, error_message=f"{error_code} on {cmd['node_id']}")
        self.backend.state.apply_frame(cmd["node_id"], frame)

    def release(self, kind: str) -> None:
        for cmd in [c for c in self.held if c["command_type"] == kind]:
            self.held.remove(cmd)
            self.respond(cmd)

    def status(self) -> dict[str, Any]:
        nodes = [{"node_id": n, "node_ip": self.ips[n], "alive": True, "state": "ALIVE"} for n in sorted(self.members)]
        return {"alive": bool(self.members) and self.head in self.members, "version": "2.58.0",
                "num_nodes": len(nodes), "nodes": nodes}

    def respond(self, cmd: dict[str, Any]) -> None:
        kind, node, payload = cmd["command_type"], cmd["node_id"], cmd["payload"]
        for key in (f"{kind}@{node}", kind):
            if key in self.override:
                success, result, code = self.override[key]
                self.answer(cmd, success, result, code)
                return
        if kind == "ensure_runtime_image":
            if payload.get("fetch") is False:
                if node in self.images:
                    self.answer(cmd, True, {"verified": True, "present": True, "matched_by": "rootfs_digest"})
                else:
                    self.answer(cmd, False, {}, "runtime_image_missing")
                return
            self.images.add(node)
            self.answer(cmd, True, {"verified": True, "present": True, "matched_by": "rootfs_digest"})
        elif kind == "serve_runtime_image":
            self.answer(cmd, True, {"served": payload["expected_peers"], "timed_out": False})
        elif kind == "ensure_ray_runtime":
            self.answer(cmd, True, {"installed": True, "version": "2.58.0"})
        elif kind == "start_ray_head":
            self.members.add(node)
            self.answer(cmd, True, {"head_address": payload["node_ip_address"]})
        elif kind == "join_ray_cluster":
            if not self.refuse_join:
                self.members.add(node)
            self.answer(cmd, True, {"joined": True})
        elif kind in ("leave_ray_cluster", "stop_ray"):
            self.members.discard(node)
            self.answer(cmd, True, {"left": True, "stopped": True})
        elif kind == "get_ray_status":
            self.answer(cmd, True, self.status())
        else:
            self.answer(cmd, True, {})


class DriverTestCase(TestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.backend = DevBackend(reactor, clock=self.clock)
        self.h = self.backend.enroll_node("head", host="10.0.0.1")["node_id"]
        self.w = self.backend.enroll_node("worker", host="10.0.0.2")["node_id"]
        self.ips = {self.h: "127.0.0.2", self.w: "127.0.0.3"}
        self.fleet = Fleet(self.backend, self.ips)
        self.env = self.make_env([self.w])
        self.addCleanup(self.env.stop)

    def make_env(self, workers: list[str]) -> RayEnvironment:
        return RayEnvironment(self.backend, "env-1", RayNode(self.h, self.ips[self.h]),
                              [RayNode(w, self.ips[w]) for w in workers], dict(BUNDLE), port=6379, seed_port=18271)

    def steps(self) -> list[str]:
        return [s.step for s in self.env.steps]

    def issued(self, kind: str) -> list[dict[str, Any]]:
        return [c for c in self.backend.commands() if c["command_type"] == kind]

    def pump(self, seconds: float, step: float = 1.0) -> None:
        """Advance the clock in steps (each runs what falls due)."""
        done = 0.0
        while done < seconds:
            self.clock.advance(min(step, seconds - done))
            done += step

    def up(self) -> None:
        self.env.start()
        self.clock.advance(0)
        self.assertEqual(self.env.status, READY, self.env.reason)


class ImageStageTests(DriverTestCase):
    def test_everyone_has_it_nothing_moves(self) -> None:
        """(a) Every member answers the probe verified: no load, no seeding, straight on."""
        self.fleet.images = {self.h, self.w}
        self.up()
        self.assertEqual(self.steps(), [
            f"image-probe:{self.h}", f"image-probe:{self.w}", f"ensure-runtime:{self.h}", f"ensure-runtime:{self.w}",
            "start-head", f"join-worker:{self.w}",
        ])
        probe = self.issued("ensure_runtime_image")[0]
        self.assertEqual(probe["payload"], {"runtime_bundle": BUNDLE, "ensure_container": True, "fetch": False})
        self.assertEqual(probe["idempotency_key"], f"inference-env:env-1:1:image-probe:{self.h}")
        self.assertEqual(probe["timeout_sec"], 300)
        self.assertEqual(self.issued("serve_runtime_image"), [])

    def test_nobody_has_it_server_once_then_peer_at_the_same_moment(self) -> None:
        """(b) one member loads from the server; (c) serve and receiver issued together."""
        self.fleet.hold = {"serve_runtime_image"}  # the holder is still exporting
        self.up()
        self.assertEqual(self.steps()[:5], [
            f"image-probe:{self.h}", f"image-probe:{self.w}", f"image-from-server:{self.h}",
            f"image-seed:{self.h}", f"image-from-peer:{self.w}",
        ])
        loads = [c for c in self.issued("ensure_runtime_image") if "fetch" not in c["payload"]]
        server = [c for c in loads if "source" not in c["payload"]]
        self.assertEqual([c["node_id"] for c in server], [self.h])
        self.assertEqual(server[0]["payload"], {"runtime_bundle": BUNDLE, "ensure_container": True})
        (serve,) = self.issued("serve_runtime_image")
        token = hmac.new(self.env.seed_key, f"image-seed:env-1:1:{self.h}".encode(), hashlib.sha256).hexdigest()
        self.assertEqual(serve["payload"], {"runtime_bundle": BUNDLE, "bind_ip": "127.0.0.2", "port": 18271,
                                            "token": token, "expected_peers": 1, "timeout_sec": 3600})
        (peer,) = [c for c in loads if "source" in c["payload"]]
        self.assertEqual(peer["payload"]["source"], {"peer_url": "http://127.0.0.2:18271/image", "token": token})
        self.assertEqual(peer["idempotency_key"], f"inference-env:env-1:1:image-from-peer:{self.w}")
        # The serve was never answered: nobody waited for it.
        self.assertEqual(self.backend.command(serve["id"])["status"], "queued")

    def test_serve_and_receiver_issued_before_any_result(self) -> None:
        """The receiver's fetch is queued while the serve has no answer and no ack."""
        self.fleet.hold = {"serve_runtime_image", f"ensure_runtime_image@{self.w}"}
        self.fleet.images = {self.h}
        self.env.start()
        self.clock.advance(0)
        self.assertEqual(self.env.status, "pending")
        # the worker's probe is held too; answer it: missing
        (probe,) = [c for c in self.fleet.held if c["command_type"] == "ensure_runtime_image"]
        self.fleet.held.remove(probe)
        self.fleet.answer(probe, False, {}, "runtime_image_missing")
        kinds = [(c["command_type"], c["node_id"], "source" in c["payload"]) for c in self.fleet.held]
        self.assertEqual(kinds, [("serve_runtime_image", self.h, False), ("ensure_runtime_image", self.w, True)])
        self.assertEqual(self.issued("ensure_runtime_image")[-1]["payload"]["source"]["peer_url"],
                         "http://127.0.0.2:18271/image")

    def test_one_holder_serves_every_receiver(self) -> None:
        """Two members lacking it are paired with the one holder: one serve, expected_peers 2."""
        w2 = self.backend.enroll_node("worker-2", host="10.0.0.3")["node_id"]
        self.ips[w2] = "127.0.0.4"
        self.env = self.make_env([self.w, w2])
        self.fleet.images = {self.w}
        self.up()
        (serve,) = self.issued("serve_runtime_image")
        self.assertEqual((serve["node_id"], serve["payload"]["expected_peers"], serve["payload"]["bind_ip"]),
                         (self.w, 2, "127.0.0.3"))
        peers = sorted(c["node_id"] for c in self.issued("ensure_runtime_image") if "source" in c["payload"])
        self.assertEqual(peers, sorted([self.h, w2]))
        self.assertFalse([c for c in self.issued("ensure_runtime_image")
                          if "fetch" not in c["payload"] and "source" not in c["payload"]])

    def test_peer_failure_falls_back_to_the_server(self) -> None:
        """(d) A receiver whose peer fetch failed gets the server fetch."""
        self.fleet.images = {self.h}
        original = self.fleet.respond

        def respond(cmd: dict[str, Any]) -> None:
            if cmd["command_type"] == "ensure_runtime_image" and "source" in cmd["payload"]:
                self.fleet.answer(cmd, False, {}, "image_seed_failed")
                return
            original(cmd)

        self.fleet.respond = respond  # type: ignore[method-assign]
        self.up()
        self.assertIn(f"image-from-server:{self.w}", self.steps())
        self.assertLess(self.steps().index(f"image-from-peer:{self.w}"), self.steps().index(f"image-from-server:{self.w}"))

    def test_peer_success_without_verified_falls_back(self) -> None:
        self.fleet.images = {self.h}
        self.fleet.override["ensure_runtime_image@" + self.w] = (True, {"verified": False}, None)
        # the worker's probe must still say missing
        original = self.fleet.respond

        def respond(cmd: dict[str, Any]) -> None:
            if cmd["payload"].get("fetch") is False:
                self.fleet.answer(cmd, cmd["node_id"] == self.h, {"verified": True} if cmd["node_id"] == self.h else {},
                                  None if cmd["node_id"] == self.h else "runtime_image_missing")
                return
            original(cmd)

        self.fleet.respond = respond  # type: ignore[method-assign]
        self.env.start()
        self.clock.advance(0)
        # The server fetch also answers verified false: the environment fails, saying so.
        self.assertIn(f"image-from-server:{self.w}", self.steps())
        self.assertEqual(self.env.status, FAILED)
        self.assertIn("not verified", self.env.reason or "")

    def test_probe_success_without_verified_stops_the_environment(self) -> None:
        """A probe that succeeds unverified is not an answer: failed: succeeded, then backoff."""
        self.fleet.override["ensure_runtime_image"] = (True, {"verified": False, "present": True}, None)
        self.env.start()
        self.clock.advance(0)
        self.assertEqual(self.env.status, FAILED)
        self.assertIn(f"image check on node {self.h} failed: succeeded", self.env.reason or "")
        self.assertEqual(self.issued("start_ray_head"), [])
        self.assertEqual(self.env.retry and (self.env.retry["attempts"], self.env.retry["permanent"]), (1, False))
        probes = len(self.issued("ensure_runtime_image"))
        self.pump(59)
        self.assertEqual(len(self.issued("ensure_runtime_image")), probes)
        self.pump(1)
        self.assertEqual(len(self.issued("ensure_runtime_image")), probes + 2)
        self.assertEqual(self.env.retry and self.env.retry["attempts"], 2)
        self.assertIn("about 2 minutes (attempt 2)", self.env.reason or "")
        self.pump(119)
        self.assertEqual(len(self.issued("ensure_runtime_image")), probes + 2)
        self.pump(1)
        self.assertEqual(len(self.issued("ensure_runtime_image")), probes + 4)

    def test_other_probe_failure_stops_the_environment(self) -> None:
        self.fleet.override[f"ensure_runtime_image@{self.w}"] = (False, {}, "policy_violation")
        self.fleet.images = {self.h}
        self.env.start()
        self.clock.advance(0)
        self.assertEqual(self.env.status, FAILED)
        self.assertIn(f"image check on node {self.w} failed", self.env.reason or "")
        self.assertEqual(self.issued("serve_runtime_image"), [])

    def test_permanent_failure_rechecked_hourly_and_at_once_when_inputs_change(self) -> None:
        original = self.fleet.respond

        def respond(cmd: dict[str, Any]) -> None:
            if cmd["command_type"] == "ensure_runtime_image" and cmd["payload"].get("fetch") is not False \
                    and "source" not in cmd["payload"]:
                self.fleet.answer(cmd, False, {}, "server_image_mismatch")
                return
            original(cmd)

        self.fleet.respond = respond  # type: ignore[method-assign]
        self.env.start()
        self.clock.advance(0)
        self.assertEqual(self.env.status, FAILED)
        self.assertTrue(self.env.retry and self.env.retry["permanent"])
        self.assertIn("every hour", self.env.reason or "")
        count = len(self.backend.commands())
        self.pump(3599, step=60)
        self.assertEqual(len(self.backend.commands()), count)
        self.pump(1)
        self.assertGreater(len(self.backend.commands()), count)
        self.assertEqual(self.env.retry and self.env.retry["attempts"], 2)
        # A new build pinned (the fingerprint changes): asked again at once.
        count = len(self.backend.commands())
        self.env.bundle = {**BUNDLE, "digest": "sha256:" + "c" * 64}
        self.env.kick()
        self.clock.advance(0)
        self.assertGreater(len(self.backend.commands()), count)
        self.assertEqual(self.env.retry and self.env.retry["attempts"], 1)

    def test_unanswered_step_waits_150_s_then_resumes_by_key(self) -> None:
        self.fleet.hold = {f"ensure_runtime_image@{self.w}"}
        self.env.start()
        self.clock.advance(0)
        self.pump(149)
        self.assertEqual(self.env.status, "pending")
        self.pump(1)
        self.assertEqual(self.env.status, PREPARING)
        self.assertIn("no result within 150 s", self.env.reason or "")
        # The next pass ran at once and is waiting on the same command (same key, same id).
        key = f"inference-env:env-1:1:image-probe:{self.w}"
        self.assertEqual(len([c for c in self.backend.commands() if c["idempotency_key"] == key]), 1)
        self.assertEqual(self.steps().count(f"image-probe:{self.w}"), 1)
        self.fleet.hold.clear()
        self.fleet.release("ensure_runtime_image")
        self.clock.advance(0)
        self.assertEqual(self.env.status, READY, self.env.reason)


class ResumeSeedingTests(DriverTestCase):
    def test_a_resumed_pass_rejoins_the_seeding_in_flight(self) -> None:
        """The receiver silent for 150 s: the next pass finds both commands under their keys."""
        self.fleet.hold = {"serve_runtime_image", f"ensure_runtime_image@{self.w}"}
        self.fleet.images = {self.h}
        self.env.start()
        self.clock.advance(0)
        (probe,) = [c for c in self.fleet.held if c["command_type"] == "ensure_runtime_image"]
        self.fleet.held.remove(probe)
        self.fleet.answer(probe, False, {}, "runtime_image_missing")
        self.pump(150)
        self.assertEqual(self.env.status, PREPARING)
        # The second pass probed again (new commands), then met the same seeding commands under
        # their keys: nothing issued twice.
        worker_probes = [c for c in self.issued("ensure_runtime_image")
                         if c["node_id"] == self.w and c["payload"].get("fetch") is False]
        self.assertEqual(len(worker_probes), 2)
        self.fleet.held = [c for c in self.fleet.held if c["id"] != worker_probes[1]["id"]]
        self.fleet.answer(worker_probes[1], False, {}, "runtime_image_missing")
        self.assertEqual(len(self.issued("serve_runtime_image")), 1)
        self.assertEqual(len([c for c in self.issued("ensure_runtime_image") if "source" in c["payload"]]), 1)
        self.assertEqual(self.steps().count(f"image-from-peer:{self.w}"), 1)
        self.fleet.hold.clear()
        self.fleet.release("ensure_runtime_image")
        self.clock.advance(0)
        self.assertEqual(self.env.status, READY, self.env.reason)
        self.assertEqual(self.backend.command(self.issued("serve_runtime_image")[0]["id"])["status"], "queued")


class StartTests(DriverTestCase):
    def test_keys_payloads_and_membership(self) -> None:
        self.fleet.images = {self.h, self.w}
        self.up()
        start = self.issued("start_ray_head")[0]
        self.assertEqual(start["idempotency_key"], "inference-env:env-1:1:start-head")
        self.assertEqual(start["payload"]["credential_ref"], self.env.credential_ref)
        join = self.issued("join_ray_cluster")[0]
        self.assertEqual(join["idempotency_key"], f"inference-env:env-1:1:join-worker:{self.w}")
        self.assertEqual(join["payload"]["head_address"], "127.0.0.2:6379")
        self.assertEqual(self.env.converged_generation, 1)
        self.assertIn(self.env.credential_ref, self.backend.cluster_secrets)

    def test_runtime_not_installed_fails(self) -> None:
        self.fleet.images = {self.h, self.w}
        self.fleet.override["ensure_ray_runtime@" + self.w] = (True, {"installed": False, "error": "no ray"}, None)
        self.env.start()
        self.clock.advance(0)
        self.assertEqual(self.env.status, FAILED)
        self.assertIn("not installed", self.env.reason or "")

    def test_member_missing_after_the_start_is_degraded_not_converged(self) -> None:
        """
        As the backend's _verify_cluster: ONE probe after the joins (not a poll until every
        member shows), read by counting live records; short is DEGRADED, not converged, and
        the next pass runs the start sequence again.
        """
        self.fleet.images = {self.h, self.w}
        self.fleet.refuse_join = True
        self.env.start()
        self.clock.advance(0)
        self.assertEqual(self.env.status, DEGRADED)
        self.assertIn("worker did not show up", self.env.reason or "")
        self.assertIsNone(self.env.converged_generation)
        self.assertEqual(self.env.probes, 1)
        self.pump(30)
        self.assertEqual(self.env.probes, 1)  # nothing polled meanwhile
        self.fleet.refuse_join = False
        self.pump(30)
        self.assertEqual(self.env.status, READY, self.env.reason)
        self.assertEqual(len(self.issued("start_ray_head")), 2)
        self.assertEqual(self.env.probes, 2)

    def test_convergence_counts_live_records_as_the_backend_does(self) -> None:
        """
        map_cluster_to_environment_status: live records (dead ones ignored) counted against the
        members, whatever address they carry (the health check is what matches by name); no
        live record is PREPARING; an unanswered probe FAILED.
        """
        self.fleet.images = {self.h, self.w}
        ghost = {"node_id": "x", "node_ip": "10.9.9.9", "alive": False, "state": "DEAD"}
        two = [{"node_id": "a", "node_ip": "10.8.8.1", "state": "ALIVE"}, {"node_id": "b", "node_ip": "10.8.8.2"}]
        for nodes, num, want in (([*two, ghost], 3, READY), ([two[0], ghost], 2, DEGRADED), ([ghost], 1, PREPARING),
                                 ([], 2, READY), ([], 0, PREPARING)):
            self.assertEqual(self.env._status_of({"alive": True, "nodes": nodes, "num_nodes": num}), want, nodes)
        self.assertEqual(self.env._status_of(None), FAILED)
        self.assertEqual(self.env._status_of({"alive": False, "nodes": two}), FAILED)

    def test_start_and_join_payloads_as_the_backend_sends_them(self) -> None:
        """No env key when there is no env (the backend omits it); with one, on both."""
        self.fleet.images = {self.h, self.w}
        self.up()
        self.assertNotIn("env", self.issued("start_ray_head")[0]["payload"])
        self.assertNotIn("env", self.issued("join_ray_cluster")[0]["payload"])
        env = self.make_env([self.w])
        env.env = {"NCCL_SOCKET_IFNAME": "ib0"}
        env.generation = 2
        self.addCleanup(env.stop)
        env.start()
        self.clock.advance(0)
        self.assertEqual(self.issued("start_ray_head")[-1]["payload"]["env"], {"NCCL_SOCKET_IFNAME": "ib0"})
        self.assertEqual(self.issued("join_ray_cluster")[-1]["payload"]["env"], {"NCCL_SOCKET_IFNAME": "ib0"})


class HealthCheckTests(DriverTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.fleet.images = {self.h, self.w}
        self.up()
        self.base = len(self.backend.commands())

    def test_quiet_until_the_minute_check(self) -> None:
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)
        probes = self.env.probes
        self.pump(59)
        self.assertEqual(self.env.probes, probes)
        self.pump(1)
        self.assertEqual(self.env.probes, probes + 1)
        probe = self.issued("get_ray_status")[-1]
        self.assertEqual(probe["payload"], {"runtime_bundle": BUNDLE, "include_metrics": True})
        self.assertEqual(self.env.status, READY)
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)

    def test_lost_worker_confirmed_20_s_later_then_rejoined(self) -> None:
        self.fleet.members.discard(self.w)
        self.pump(60)
        self.assertEqual(self.env.status, DEGRADED)
        self.assertIn("worker has dropped out of the cluster", self.env.reason or "")
        self.assertEqual(self.issued("leave_ray_cluster"), [])
        self.pump(19)
        self.assertEqual(self.issued("leave_ray_cluster"), [])
        self.pump(1)
        self.assertEqual(self.env.status, READY, self.env.reason)
        (leave,) = self.issued("leave_ray_cluster")
        self.assertEqual(leave["idempotency_key"], f"inference-env:env-1:1:recover1:leave:{self.w}")
        joins = self.issued("join_ray_cluster")
        self.assertEqual(joins[-1]["idempotency_key"], f"inference-env:env-1:1:recover1:join:{self.w}")
        self.assertEqual(self.issued("stop_ray"), [])
        self.assertEqual(self.env.last_recovery and self.env.last_recovery["attempts"], 1)
        self.assertIsNone(self.env.recovery)

    def test_a_second_look_that_finds_it_whole_restarts_nothing(self) -> None:
        self.fleet.members.discard(self.w)
        self.pump(60)
        self.assertEqual(self.env.status, DEGRADED)
        self.fleet.members.add(self.w)
        self.pump(20)
        self.assertEqual(self.env.status, READY)
        self.assertEqual(self.issued("leave_ray_cluster"), [])
        self.assertIsNone(self.env.recovery)
        self.assertIsNone(self.env.last_recovery)

    def test_lost_head_is_reformed(self) -> None:
        self.fleet.members.discard(self.h)
        self.pump(80)
        self.assertEqual(self.env.status, READY, self.env.reason)
        keys = [c["idempotency_key"] for c in self.backend.commands()[self.base:] if c["command_type"] != "get_ray_status"]
        self.assertEqual(keys, [
            f"inference-env:env-1:1:recover1:leave:{self.w}", f"inference-env:env-1:1:recover1:stop:{self.h}",
            f"inference-env:env-1:1:recover1:start-head:{self.h}", f"inference-env:env-1:1:recover1:join:{self.w}",
        ])
        (stop,) = self.issued("stop_ray")
        self.assertTrue(stop["payload"]["force"])
        self.assertEqual(self.env.last_recovery and self.env.last_recovery["kind"], "head")

    def test_a_failed_probe_restarts_nothing(self) -> None:
        self.fleet.override["get_ray_status"] = (False, {}, "ray_helper_failed")
        self.fleet.members.clear()
        self.pump(200)
        self.assertEqual(self.env.status, READY)
        self.assertIsNone(self.env.recovery)
        self.assertEqual(self.issued("leave_ray_cluster") + self.issued("stop_ray"), [])

    def test_an_unanswered_probe_restarts_nothing(self) -> None:
        self.fleet.hold = {"get_ray_status"}
        self.fleet.members.clear()
        self.pump(200, step=10)
        self.assertEqual(self.env.status, READY)
        self.assertEqual(self.issued("leave_ray_cluster") + self.issued("stop_ray"), [])

    def test_members_matched_by_any_name_dead_records_ignored(self) -> None:
        def status() -> dict[str, Any]:
            return {"alive": True, "num_nodes": 3, "nodes": [
                {"node_manager_address": "127.0.0.2", "state": "ALIVE"},
                {"node_name": "10.0.0.2", "alive": True},  # the worker by its host
                {"node_ip": "127.0.0.3", "alive": False, "state": "DEAD"},
            ]}

        self.fleet.status = status  # type: ignore[method-assign]
        self.pump(60)
        self.assertEqual(self.env.status, READY)
        self.fleet.status = lambda: {"alive": True, "num_nodes": 2, "nodes": [  # type: ignore[method-assign]
            {"node_ip": "127.0.0.2", "state": "ALIVE"}, {"node_ip": "127.0.0.3", "state": "DEAD"}]}
        self.pump(60)
        self.assertEqual(self.env.status, DEGRADED)
        self.assertEqual(self.env.recovery and self.env.recovery["kind"], "members")

    def test_at_most_3_attempts_then_a_look_every_15_minutes(self) -> None:
        self.fleet.refuse_join = True
        self.fleet.members.discard(self.w)
        self.pump(80)  # suspected at 60, attempt 1 at 80
        self.assertIn("rejoining (attempt 1 of 3)", self.env.reason or "")
        self.pump(30)  # given 30 s to show the worker: it does not
        self.assertEqual(self.env.recovery and self.env.recovery["attempt"], 1)
        self.assertIn("restart 1 of 3 did not bring it back", self.env.reason or "")
        self.assertIn("trying again in 30 s", self.env.reason or "")
        self.assertEqual(len(self.issued("leave_ray_cluster")), 1)
        self.pump(29)
        self.assertEqual(len(self.issued("leave_ray_cluster")), 1)
        self.pump(1)  # 140: attempt 2
        self.assertEqual(len(self.issued("leave_ray_cluster")), 2)
        self.pump(30)
        self.assertIn("trying again in 60 s", self.env.reason or "")
        self.pump(60)  # 230: attempt 3
        self.assertEqual(len(self.issued("leave_ray_cluster")), 3)
        self.pump(30)
        self.assertEqual(self.env.status, FAILED)
        self.assertTrue(self.env.recovery and self.env.recovery["gave_up"])
        self.assertIn("restarted 3 times", self.env.reason or "")
        self.pump(15 * 60 - 10, step=30)
        self.assertEqual(len(self.issued("leave_ray_cluster")), 3)
        self.fleet.refuse_join = False
        self.pump(20, step=5)
        self.assertEqual(len(self.issued("leave_ray_cluster")), 4)
        self.assertEqual(self.env.status, READY, self.env.reason)
        self.assertEqual(self.issued("join_ray_cluster")[-1]["idempotency_key"],
                         f"inference-env:env-1:1:recover4:join:{self.w}")


class OfflineTests(DriverTestCase):
    def test_a_member_away_is_not_sent_commands_and_reported_gone_after_30_s(self) -> None:
        self.fleet.images = {self.h, self.w}
        self.up()
        self.pump(50)
        node = self.backend.state.nodes[self.w]
        node.status, node.last_seen = "offline", self.backend.state.now_iso()
        count = len(self.backend.commands())
        self.pump(10)  # the minute's pass: away 10 s, an agent restart
        self.assertEqual((self.env.status, len(self.backend.commands())), (READY, count))
        self.pump(60)
        self.assertEqual(self.env.status, DEGRADED)
        self.assertIn("worker is offline", self.env.reason or "")
        self.assertEqual(len(self.backend.commands()), count)
        node.status = "healthy"
        self.pump(60)
        self.assertEqual(self.env.status, READY)

    def test_the_head_away_fails_the_environment(self) -> None:
        self.fleet.images = {self.h, self.w}
        self.up()
        node = self.backend.state.nodes[self.h]
        node.status, node.last_seen = "offline", self.backend.state.now_iso()
        self.pump(60)
        self.assertEqual(self.env.status, FAILED)
        self.assertIn("head is offline", self.env.reason or "")


class TeardownTests(DriverTestCase):
    def test_workers_leave_then_the_head_stops_and_nothing_is_left_scheduled(self) -> None:
        self.fleet.images = {self.h, self.w}
        self.up()
        self.env.want("stopped")
        self.clock.advance(0)
        self.assertEqual(self.env.status, STOPPED, self.env.reason)
        self.assertEqual(self.steps()[-2:], [f"teardown-leave:{self.w}", f"teardown-stop:{self.h}"])
        self.assertTrue(self.issued("stop_ray")[0]["payload"]["force"])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_teardown_cancels_a_pass_in_flight(self) -> None:
        self.fleet.hold = {"ensure_runtime_image"}
        self.env.start()
        self.clock.advance(0)
        self.env.want("stopped")
        self.clock.advance(0)
        self.assertEqual(self.env.status, STOPPED, self.env.reason)
        self.assertEqual(self.clock.getDelayedCalls(), [])


class WaitingTests(DriverTestCase):
    def test_until_is_told_on_the_next_turn_and_may_stop_the_environment(self) -> None:
        self.fleet.images = {self.h, self.w}
        told: list[str] = []
        def ready(status: str) -> None:
            told.append(status)
            self.env.stop()

        self.env.until(READY).addCallback(ready)
        self.env.start()
        self.clock.advance(0)
        self.assertEqual((self.env.status, told), (READY, [READY]))
        self.assertEqual(self.clock.getDelayedCalls(), [])  # stopped: no health check scheduled

    def test_until_times_out(self) -> None:
        self.fleet.hold = {"ensure_runtime_image"}
        d = self.env.up(timeout=10)
        failures: list[Any] = []
        Deferred.fromCoroutine(d).addErrback(failures.append)
        self.pump(10)
        self.assertEqual(len(failures), 1)
        self.assertRaises(ValueError, self.env.want, "sideways")


class DevApiTests(TestCase):
    """The dev admin API over HTTP (real reactor), nodes scripted as above."""

    async def setUp(self) -> None:  # type: ignore[override]
        self.backend = DevBackend(reactor)
        await self.backend.listen(0, "127.0.0.1")
        self.addCleanup(self.backend.stop)
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.head = self.backend.enroll_node("head")["node_id"]
        self.worker = self.backend.enroll_node("worker")["node_id"]
        self.fleet = Fleet(self.backend, {self.head: "127.0.0.2", self.worker: "127.0.0.3"})

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
                "runtime_bundle": dict(BUNDLE), "port": 6379, "seed_port": 18271}

    async def test_reconcile_retry_and_teardown(self) -> None:
        code, view = await self.api("POST", "ray-environments", self.body())
        self.assertEqual(code, 200)
        await self.backend.ray_environments["env-1"].until(READY, FAILED, timeout=10)
        code, view = await self.api("GET", "ray-environments/env-1")
        self.assertEqual((code, view["status"]), (200, READY))
        self.assertEqual([s["step"] for s in view["steps"]][:5], [
            f"image-probe:{self.head}", f"image-probe:{self.worker}", f"image-from-server:{self.head}",
            f"image-seed:{self.head}", f"image-from-peer:{self.worker}"])
        self.assertEqual(view["cluster"]["num_nodes"], 2)
        code, view = await self.api("POST", "ray-environments/env-1/retry")
        self.assertEqual(code, 200)
        code, view = await self.api("POST", "ray-environments/env-1/teardown")
        self.assertEqual(code, 200)
        await self.backend.ray_environments["env-1"].until(STOPPED, timeout=10)
        code, view = await self.api("GET", "ray-environments/env-1")
        self.assertEqual(view["status"], STOPPED)
        self.assertEqual([s["step"] for s in view["steps"]][-2:], [f"teardown-leave:{self.worker}", f"teardown-stop:{self.head}"])

    async def test_bad_requests(self) -> None:
        code, _ = await self.api("POST", "ray-environments", {**self.body(), "head": {"node_id": "nope", "node_ip": "1"}})
        self.assertEqual(code, 422)
        code, _ = await self.api("POST", "ray-environments", {**self.body(), "runtime_bundle": None})
        self.assertEqual(code, 422)
        code, _ = await self.api("GET", "ray-environments/none")
        self.assertEqual(code, 404)
        code, _ = await self.api("POST", "ray-environments/none/teardown")
        self.assertEqual(code, 404)
        code, _ = await self.api("POST", "ray-environments/none/retry")
        self.assertEqual(code, 404)

