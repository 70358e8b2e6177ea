"""
A stop or remove of a runtime whose start or deploy is still waiting for readiness ends that
wait (issue 26): the start answers at once with a FAILED result (error code C{superseded}) that
names the stop or remove, and the stop or remove goes ahead at once instead of waiting behind
the start's readiness timeout (up to 1800 s). Adopted runtimes (the original agent's
containers) alike.

Unit tests on a Clock, through the real command pipeline (its per-runtime lanes) and the real
workload handlers over a fake engine; tests/test_integration_supersede.py does it on the real
engine.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.workloads.handlers import SUPERSEDED, WorkloadManager, workload_handler_specs
from llmport_agent.workloads.settings import WorkloadSettings
from tests.support.rig import httpd_payload
from tests.test_pipeline import Harness, command

TIMEOUT = 1800.0
CID = "c" * 64


def snap(runtime_id: str, *, running: bool = False, adopted: bool = False, name: str = "llm-port-r1") -> dict[str, Any]:
    labels = {} if adopted else {"io.llmport.runtime-id": runtime_id, "io.llmport.container-port": "8000"}
    return {
        "id": CID, "name": name, "image": "busybox:1", "labels": labels, "running": running,
        "restarting": False, "foreign": False, "canonical": True, "status": "running" if running else "exited",
        "ports": {8000: 18000}, "requested_ports": {8000: 18000},
    }


class FakeEngine:
    """The engine calls the workload handlers make, answered from a table; each can be held."""

    kind = "docker"
    available = True

    def __init__(self) -> None:
        self.containers: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []
        self.gates: dict[str, Deferred[None]] = {}
        self.adopted_seen: list[dict[str, str]] = []
        self.created = 0

    async def call(self, fn: Any, *args: Any, what: str | None = None) -> Any:
        name = fn.__name__
        self.calls.append(name)
        gate = self.gates.pop(name, None)
        if gate is not None:
            await gate
        if name == "find_runtime":
            self.adopted_seen.append(dict(args[3]))
            return [dict(c) for key, c in self.containers.items() if key in (args[0], f"new-{args[0]}")]
        if name == "list_managed":
            return []
        if name in ("start", "restart"):
            for c in self.containers.values():
                if c["id"] == args[0]:
                    c["running"] = True
            return None
        if name == "stop":
            for c in self.containers.values():
                if c["id"] == args[0]:
                    c["running"] = False
            return True
        if name == "remove":
            for key, c in list(self.containers.items()):
                if c["id"] == args[0]:
                    del self.containers[key]
            return True
        if name == "exit_info":
            return None  # still running, never answering
        if name == "_inspect_image":
            return {"id": "sha256:" + "1" * 64, "repo_tags": [args[0]], "repo_digests": [], "size": 1,
                    "rootfs_digest": None}
        if name == "create_and_start":
            labels = dict(args[0]["create"].get("labels") or {})
            runtime_id = labels.get("io.llmport.runtime-id", "r1")
            self.created += 1
            new = snap(runtime_id, running=True, name=args[0]["create"]["name"])
            new["id"] = f"{self.created:064x}"
            new["labels"] = labels
            self.containers[f"new-{runtime_id}"] = new
            return {"id": new["id"]}
        if name == "inspect":
            return next((dict(c) for c in self.containers.values() if c["id"] == args[0]), None)
        if name == "by_exact_name":
            return next((dict(c) for c in self.containers.values() if c["name"] == args[0]), None)
        if name == "rename":
            for c in self.containers.values():
                if c["id"] == args[0]:
                    c["name"] = args[1]
            return None
        if name == "log_tail":
            return ""
        raise AssertionError(f"unexpected engine call {name}")


class FakeAdoption:
    def __init__(self, mapping: dict[str, str]) -> None:
        self.mapping = mapping
        self.gone: list[str] = []

    def ready(self) -> Deferred[None]:
        return succeed(None)

    def snapshot(self) -> dict[str, str]:
        return dict(self.mapping)

    def removed(self, runtime_id: str) -> None:
        self.gone.append(runtime_id)
        self.mapping = {c: r for c, r in self.mapping.items() if r != runtime_id}

    def deployed(self, *args: Any) -> None:
        pass


class SupersedeTests(SynchronousTestCase):
    def rig(self, adoption: Any = None, hanging: bool = False) -> tuple[Harness, FakeEngine, WorkloadManager]:
        h = Harness(self)
        engine = FakeEngine()
        probes: list[str] = []

        def probe(url: str) -> Deferred[int]:
            probes.append(url)
            if hanging:
                # A connection that never answers; cancelled, it fails as an HTTP client does
                # (ResponseNeverReceived, not CancelledError): "no answer yet" to the loop.
                return Deferred(lambda d: d.errback(RuntimeError("response never received")))
            return succeed(503)  # loading, for ever

        settings = WorkloadSettings(agent_id="a", readiness_timeout_sec=TIMEOUT, readiness_interval_sec=1.0,
                                    readiness_progress_sec=15.0, stop_grace_sec=2.0)
        manager = WorkloadManager(h.clock, engine, settings, probe=probe,  # type: ignore[arg-type]
                                  port_free=lambda port: True, adoption=adoption)
        h.pipeline.registry.update(workload_handler_specs(manager))
        self.probes = probes
        return h, engine, manager

    def result(self, h: Harness, cid: str) -> dict[str, Any] | None:
        found = [f for f in h.frames_for(cid) if f["type"] == "command_result"]
        self.assertLessEqual(len(found), 1)
        return found[0] if found else None

    def payload(self, runtime_id: str = "r1") -> dict[str, Any]:
        return {"runtime_id": runtime_id, "runtime_name": "r1", "container_name": "llm-port-r1"}

    def waiting(self, h: Harness, ctype: str = "start_workload", runtime_id: str = "r1",
                probes: int = 100) -> dict[str, Any]:
        """A start of the runtime, three minutes into its readiness wait."""
        start = command(ctype, self.payload(runtime_id))
        h.deliver(start)
        for _ in range(180):
            h.clock.advance(1)
        self.assertIsNone(self.result(h, start["id"]))
        self.assertGreaterEqual(len(self.probes), probes)
        return start

    def assertSuperseded(self, h: Harness, start: dict[str, Any], by: dict[str, Any]) -> None:
        result = self.result(h, start["id"])
        assert result is not None, h.kinds_for(start["id"])
        self.assertFalse(result["success"])
        self.assertEqual(result["error_code"], SUPERSEDED)
        self.assertIn(f"superseded by {by['command_type']} {by['id']}", result["error_message"])
        self.assertIn("waiting for the container to become ready", result["error_message"])
        self.assertEqual(result["result"]["superseded_by"], by["id"])

    def test_stop_ends_the_readiness_wait_of_a_start(self) -> None:
        h, engine, _m = self.rig()
        engine.containers["r1"] = snap("r1")
        start = self.waiting(h)
        stop = command("stop_workload", self.payload())
        h.deliver(stop)
        h.clock.advance(0)
        # No time passed: the start answered, then the stop ran.
        self.assertSuperseded(h, start, stop)
        result = self.result(h, stop["id"])
        assert result is not None
        self.assertTrue(result["success"], result)
        self.assertTrue(result["result"]["was_running"])
        self.assertFalse(engine.containers["r1"]["running"])
        # In the runtime's order: the start's result before the stop's.
        results = [f["command_id"] for f in h.session.frames if f.get("type") == "command_result"]
        self.assertLess(results.index(start["id"]), results.index(stop["id"]))
        # The wait is over: no probe after the stop.
        probes = len(self.probes)
        h.clock.advance(60)
        self.assertEqual(len(self.probes), probes)

    def test_a_probe_that_hangs_is_ended_too(self) -> None:
        """The probe in flight never answers: the stop still goes ahead at once, and no probe follows."""
        h, engine, _m = self.rig(hanging=True)
        engine.containers["r1"] = snap("r1")
        start = self.waiting(h, probes=1)
        stop = command("stop_workload", self.payload())
        h.deliver(stop)
        h.clock.advance(0)
        self.assertSuperseded(h, start, stop)
        self.assertTrue(self.result(h, stop["id"])["success"])  # type: ignore[index]
        probes = len(self.probes)
        for _ in range(120):
            h.clock.advance(1)
        self.assertEqual(len(self.probes), probes)
        self.assertEqual(len([c for c in engine.calls if c == "exit_info"]), 0)

    def test_remove_ends_the_readiness_wait_of_a_start_or_restart(self) -> None:
        """A remove ends a restart's wait, and a start's, the same way."""
        for ctype in ("restart_workload", "start_workload"):
            h, engine, _m = self.rig()
            engine.containers["r1"] = snap("r1", running=ctype == "restart_workload")
            start = self.waiting(h, ctype)
            remove = command("remove_workload", self.payload())
            h.deliver(remove)
            h.clock.advance(0)
            self.assertSuperseded(h, start, remove)
            self.assertIn("the removal goes ahead", self.result(h, start["id"])["error_message"])  # type: ignore[index]
            result = self.result(h, remove["id"])
            assert result is not None
            self.assertTrue(result["success"], result)
            self.assertEqual(result["result"]["removed"], 1)
            self.assertEqual(engine.containers, {})

    def test_adopted_runtime(self) -> None:
        """An adopted container (the original agent's, no labels of ours): its start is ended the same way."""
        adoption = FakeAdoption({CID: "r1"})
        h, engine, _m = self.rig(adoption)
        engine.containers["r1"] = snap("r1", adopted=True)
        start = self.waiting(h)
        self.assertEqual(engine.adopted_seen[0], {CID: "r1"})
        remove = command("remove_workload", self.payload())
        h.deliver(remove)
        h.clock.advance(0)
        self.assertSuperseded(h, start, remove)
        self.assertTrue(self.result(h, remove["id"])["success"])  # type: ignore[index]
        self.assertEqual(adoption.gone, ["r1"])

    def test_stop_before_the_wait_ends_it_as_it_begins(self) -> None:
        """A stop taken while the start is still starting the container: no readiness wait at all."""
        h, engine, _m = self.rig()
        engine.containers["r1"] = snap("r1")
        gate: Deferred[None] = Deferred()
        engine.gates["start"] = gate
        start = command("start_workload", self.payload())
        h.deliver(start)
        stop = command("stop_workload", self.payload())
        h.deliver(stop)
        self.assertIsNone(self.result(h, start["id"]))
        gate.callback(None)  # the engine started the container
        h.clock.advance(0)
        self.assertSuperseded(h, start, stop)
        self.assertEqual(self.probes, [])
        self.assertTrue(self.result(h, stop["id"])["success"])  # type: ignore[index]

    def test_only_its_own_runtime_and_only_until_it_ran(self) -> None:
        """A stop of another runtime ends nothing; a start issued after the stop waits as usual."""
        h, engine, _m = self.rig()
        engine.containers["r1"] = snap("r1")
        start = self.waiting(h)
        other = command("stop_workload", self.payload("r2"))
        h.deliver(other)
        h.clock.advance(1)
        self.assertTrue(self.result(h, other["id"])["success"])  # type: ignore[index]
        self.assertIsNone(self.result(h, start["id"]))
        stop = command("stop_workload", self.payload())
        h.deliver(stop)
        h.clock.advance(0)
        self.assertSuperseded(h, start, stop)
        again = command("start_workload", self.payload())
        h.deliver(again)
        for _ in range(30):
            h.clock.advance(1)
        self.assertIsNone(self.result(h, again["id"]))  # waiting for readiness, not superseded

    def test_remove_ends_a_deploy_waiting_for_readiness(self) -> None:
        h, engine, _m = self.rig()
        payload = httpd_payload(runtime_id="r1", name="r1", image="busybox:1")
        deploy = command("deploy_workload", payload)
        h.deliver(deploy)
        for _ in range(60):
            h.clock.advance(1)
        self.assertIn("create_and_start", engine.calls)
        self.assertIsNone(self.result(h, deploy["id"]))
        remove = command("remove_workload", self.payload())
        h.deliver(remove)
        h.clock.advance(0)
        self.assertSuperseded(h, deploy, remove)
        self.assertEqual(self.result(h, remove["id"])["result"]["removed"], 1)  # type: ignore[index]
        self.assertEqual(engine.containers, {})

    def test_an_update_superseded_puts_the_previous_container_back_without_waiting(self) -> None:
        h, engine, _m = self.rig()
        old = snap("r1", running=True)
        old["labels"]["io.llmport.image"] = "busybox:1"
        engine.containers["r1"] = old
        payload = httpd_payload(runtime_id="r1", name="r1", image="busybox:1")
        update = command("update_workload", payload)
        h.deliver(update)
        for _ in range(60):
            h.clock.advance(1)
        self.assertIsNone(self.result(h, update["id"]))
        stop = command("stop_workload", self.payload())
        h.deliver(stop)
        h.clock.advance(0)
        result = self.result(h, update["id"])
        assert result is not None
        self.assertEqual(result["error_code"], SUPERSEDED)
        self.assertTrue(result["result"]["rolled_back"], result)
        self.assertIn("not waited for", result["error_message"])
        self.assertIn(f"superseded by stop_workload {stop['id']}", result["error_message"])
        # The new container is gone, the previous one is back under its name, then stopped.
        self.assertEqual(list(engine.containers), ["r1"])
        self.assertEqual(engine.containers["r1"]["name"], "llm-port-r1")
        self.assertFalse(engine.containers["r1"]["running"])
        self.assertTrue(self.result(h, stop["id"])["success"])  # type: ignore[index]

    def test_deadline_is_still_a_timeout(self) -> None:
        """Without a stop, the wait ends only at the readiness timeout (never 'superseded')."""
        h, engine, _m = self.rig()
        engine.containers["r1"] = snap("r1")
        start = self.waiting(h)
        for _ in range(int(TIMEOUT)):
            h.clock.advance(1)
        result = self.result(h, start["id"])
        assert result is not None
        self.assertNotEqual(result["error_code"], SUPERSEDED)
        self.assertIn(result["error_code"], ("readiness_timeout", "timed_out"))
