"""
The ops endpoint: /metrics through prometheus_client, parsed by its own text parser, with 8
(fake NVML) GPUs and 20 workloads; /readyz per subsystem turning red and green as the stand-in
backend and the Docker engine go away and come back.
"""

from __future__ import annotations

import json
import os
from typing import Any

import treq
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import reactor
from twisted.internet.task import deferLater

from llmport_agent.agent.service import AgentService
from llmport_agent.core.config import load_config
from llmport_agent.inventory.fakes import FakeGPU, FakeNVML
from llmport_agent.inventory.nvml import NVMLGPUSource
from llmport_agent.ops.endpoint import OpsService
from tests.agentharness import AgentTestCase, agent_env
from tests.support.docker_env import require_docker


def fake_gpus(n: int = 8) -> FakeNVML:
    gpus = [
        FakeGPU(name="NVIDIA H100 80GB HBM3", uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000",
                pci_bus_id=f"00000000:{i + 10:02X}:00.0", memory_total=80 * 1024**3,
                memory_used=(i + 1) * 1024**3, utilization_gpu=10 * i, temperature=40 + i,
                power_usage_mw=100_000 + i * 1000,
                # Lifetime counts only: corrected ones and old uncorrected ones change no verdict.
                ecc_counts={(0, 0): 10 * i, (1, 1): i})
        for i in range(n)
    ]
    return FakeNVML(gpus)


class _Health:
    """Stands in for the health watcher's view: 20 managed workloads."""

    def __init__(self, n: int = 20) -> None:
        self._states = {f"rt-{i}": {"state": "running" if i % 4 else "stopped", "status": "running"}
                        for i in range(n)}

    def states(self) -> dict[str, dict[str, Any]]:
        return dict(self._states)


class OpsTests(AgentTestCase):
    timeout = 120

    async def start_ops(self, agent: Any) -> str:
        ops = OpsService(reactor, agent, 0)
        ops.startService()
        self.addCleanup(ops.stopService)
        await self.backend_wait(lambda: ops._listening is not None)
        return f"http://127.0.0.1:{ops._listening.getHost().port}"

    async def backend_wait(self, predicate: Any, timeout: float = 20) -> None:
        deadline = reactor.seconds() + timeout
        while not predicate():
            if reactor.seconds() > deadline:
                self.fail("timed out")
            await deferLater(reactor, 0.05, lambda: None)

    async def get(self, url: str) -> tuple[int, bytes]:
        response = await treq.get(url, persistent=False)
        return response.code, await response.content()

    async def test_metrics_with_8_gpus_and_20_workloads(self) -> None:
        backend = await self.start_backend()
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        config = load_config(agent_env(backend, d, ENROLLMENT_TOKEN=backend.mint_token()["token"],
                                       GPU_HEALTH_INTERVAL_SEC="1"), {})
        fake = fake_gpus(8)
        agent = AgentService(reactor, config, fatal=lambda *a: None,
                             gpu_source=NVMLGPUSource(fake), docker_enabled=False)
        agent.health = _Health(20)
        agent.startService()
        self.addCleanup(agent.stopService)
        node_id = await self.wait_connected(backend, agent)
        await self.backend_wait(lambda: agent.inventory.sent >= 1)
        cmd = backend.issue_command(node_id, "set_maintenance_mode", {"enabled": False})
        await backend.wait_for(lambda: backend.command(cmd["id"])["status"] == "succeeded", 20)
        base = await self.start_ops(agent)
        code, body = await self.get(base + "/metrics")
        self.assertEqual(code, 200)
        families = {f.name: f for f in text_string_to_metric_families(body.decode())}
        for name in ("llmport_agent_build_info", "llmport_agent_session_state", "llmport_agent_session_reconnects",
                     "llmport_agent_session_refused", "llmport_agent_frames", "llmport_agent_command_duration_seconds",
                     "llmport_agent_command_journal_depth", "llmport_agent_event_outbox_depth",
                     "llmport_agent_reactor_lateness_seconds", "llmport_agent_gpu_memory_used_bytes",
                     "llmport_agent_gpu_utilization_ratio", "llmport_agent_gpu_temperature_celsius",
                     "llmport_agent_gpu_power_watts", "llmport_agent_gpu_ecc_errors", "llmport_agent_nvml_errors",
                     "llmport_agent_workloads", "llmport_agent_model_sync_bytes", "llmport_agent_heartbeats"):
            self.assertIn(name, families)

        def samples(name: str, **labels: str) -> list[Any]:
            return [s for s in families[name].samples
                    if all(s.labels.get(k) == v for k, v in labels.items())]

        self.assertEqual(len(samples("llmport_agent_gpu_memory_used_bytes")), 8)
        gpu3 = samples("llmport_agent_gpu_temperature_celsius", gpu="3")
        self.assertEqual(gpu3[0].value, 43)
        self.assertEqual(samples("llmport_agent_gpu_utilization_ratio", gpu="5")[0].value, 0.5)
        self.assertEqual(sum(s.value for s in samples("llmport_agent_workloads")), 20)
        self.assertEqual(samples("llmport_agent_session_state", state="connected")[0].value, 1)
        modes = {s.labels["mode"]: s.value for s in samples("llmport_agent_dispatch_mode")}
        self.assertEqual(sorted(modes), ["polling", "push"])
        self.assertEqual(modes[agent.session.dispatch.mode], 1)
        self.assertEqual(sum(modes.values()), 1)
        done = samples("llmport_agent_command_duration_seconds", type="set_maintenance_mode", outcome="success")
        self.assertEqual([s.value for s in done if s.name.endswith("_count")], [1])
        out_frames = samples("llmport_agent_frames", direction="out", type="heartbeat")
        self.assertGreaterEqual(out_frames[0].value, 1)
        info = samples("llmport_agent_build_info")[0]
        self.assertEqual(info.labels["version"], agent.heartbeat._build()["version"])
        # No secret in any label or value.
        self.assertNotIn(agent.state.credential.split(".")[1], body.decode())
        # GPU health (issue 13), next to the per-GPU gauges: all 8 healthy so far.
        self.assertEqual(len(samples("llmport_agent_gpu_health")), 8 * 3)
        self.assertEqual(sum(s.value for s in samples("llmport_agent_gpu_health", state="healthy")), 8)
        self.assertEqual(samples("llmport_agent_gpu_unhealthy")[0].value, 0)
        self.assertEqual(samples("llmport_agent_gpus")[0].value, 8)

        # GPU 3 falls off the bus (Xid 79), GPU 5's uncorrectable ECC count rises.
        await self.backend_wait(lambda: fake.event_sets == 1)
        fake.inject_xid(3, 79)
        fake.gpus[3].lost = True
        fake.gpus[5].ecc_counts[(1, 0)] = 2
        await self.backend_wait(lambda: backend.node(node_id)["status"] == "degraded")
        await self.backend_wait(
            lambda: (backend.latest_inventory(node_id) or {}).get("inventory", {}).get("gpu_count") == 6
        )
        code, body = await self.get(base + "/metrics")
        self.assertEqual(code, 200)
        parsed = list(text_string_to_metric_families(body.decode()))
        names = [f.name for f in parsed]
        self.assertEqual(len(names), len(set(names)), "a metric family is exposed twice")
        families = {f.name: f for f in parsed}
        for name in ("llmport_agent_gpu_health", "llmport_agent_gpu_xid_errors", "llmport_agent_gpu_unresponsive",
                     "llmport_agent_gpu_unhealthy", "llmport_agent_gpu_driver_events",
                     "llmport_agent_gpu_calls_timed_out", "llmport_agent_gpu_calls_hung"):
            self.assertIn(name, families)
        self.assertEqual(families["llmport_agent_gpu_xid_errors"].type, "counter")
        unhealthy = sorted(s.labels["gpu"] for s in samples("llmport_agent_gpu_health", state="unhealthy")
                           if s.value == 1)
        self.assertEqual(unhealthy, ["3", "5"])
        self.assertEqual(sum(s.value for s in samples("llmport_agent_gpu_health", state="healthy")), 6)
        gpu3 = samples("llmport_agent_gpu_health", gpu="3", state="unhealthy")[0]
        self.assertEqual((gpu3.labels["uuid"], gpu3.labels["name"]), (fake.gpus[3].uuid, "NVIDIA H100 80GB HBM3"))
        xids = samples("llmport_agent_gpu_xid_errors", gpu="3", xid="79")
        self.assertEqual([s.value for s in xids], [1])
        self.assertEqual(samples("llmport_agent_gpu_unhealthy")[0].value, 2)
        self.assertEqual(samples("llmport_agent_gpus")[0].value, 8)  # still listed, left out of gpu_count
        self.assertGreaterEqual(samples("llmport_agent_gpu_driver_events")[0].value, 1)
        ecc5 = samples("llmport_agent_gpu_ecc_errors", gpu="5", counter="volatile", type="uncorrected")
        self.assertEqual([s.value for s in ecc5], [2])
        # /readyz: a GPU the driver reports bad is a hardware verdict, not an unready agent.
        code, body = await self.get(base + "/readyz")
        ready = json.loads(body)
        self.assertEqual((code, ready["ready"]), (200, True), ready)
        nvml = ready["checks"]["nvml"]
        self.assertEqual((nvml["gpus"], nvml["schedulable"]), (8, 6))
        self.assertEqual(nvml["health"], {"healthy": 6, "degraded": 0, "unhealthy": 2})
        self.assertIn("GPU 3 (GPU-00000003", nvml["detail"])
        self.assertIn("Xid 79", nvml["detail"])
        self.assertEqual(ready["agent"]["heartbeat_status"], "degraded")
        self.assertEqual(ready["checks"]["session"]["dispatch_mode"], agent.session.dispatch.mode)

    async def test_readyz_follows_backend_and_engine(self) -> None:
        """Red with a JSON body naming what is wrong when the backend or the engine goes, green when back."""
        docker = require_docker()
        backend = await self.start_backend()
        agent = self.start_agent(backend, docker_host=docker.host, RECONNECT_MAX_SEC="0.5")
        await self.wait_connected(backend, agent)
        agent.engine._probe_initial = agent.engine._probe_max = 0.2
        await self.backend_wait(lambda: agent.engine.available)
        base = await self.start_ops(agent)

        async def readyz() -> tuple[int, dict[str, Any]]:
            code, body = await self.get(base + "/readyz")
            return code, json.loads(body)

        code, body = await readyz()
        self.assertEqual((code, body["ready"]), (200, True), body)
        self.assertEqual(set(body["checks"]), {"session", "engine", "nvml", "loki"})
        port = int(backend.url.rsplit(":", 1)[1])
        await backend.stop()
        await self.backend_wait(lambda: not agent.session.connected)
        code, body = await readyz()
        self.assertEqual(code, 503)
        self.assertFalse(body["checks"]["session"]["ok"])
        self.assertTrue(body["checks"]["engine"]["ok"])
        await backend.listen(port, "127.0.0.1")
        await self.backend_wait(lambda: agent.session.connected)
        code, body = await readyz()
        self.assertEqual(code, 200, body)
        docker.stop()
        try:
            agent.engine.checkNow()
            await self.backend_wait(lambda: not agent.engine.available)
            code, body = await readyz()
            self.assertEqual(code, 503)
            self.assertFalse(body["checks"]["engine"]["ok"])
            self.assertIn("unreachable", body["checks"]["engine"]["detail"])
        finally:
            docker.start()
        await self.backend_wait(lambda: agent.engine.available, 60)
        code, body = await readyz()
        self.assertEqual((code, body["ready"]), (200, True), body)


class ReadinessRulesTests(AgentTestCase):
    """The NVML and Loki checks of /readyz, on a real agent whose GPU source and shipper are set."""

    async def test_nvml_and_loki_rules(self) -> None:
        from llmport_agent.inventory.gpu import GPUSnapshot
        from llmport_agent.ops.endpoint import readiness

        backend = await self.start_backend()
        agent = self.start_agent(backend)
        await self.wait_connected(backend, agent)
        self.assertTrue(readiness(agent)["ready"])
        # A host without GPUs (no driver): not unready.
        agent.collector._last_gpu = GPUSnapshot(vendor="none", gpu_error="NVML Shared Library Not Found")
        self.assertTrue(readiness(agent)["checks"]["nvml"]["ok"])
        # A GPU host whose NVML broke: unready, and it says why.
        agent.collector._last_gpu = GPUSnapshot(vendor="nvidia", gpu_error="NVML stopped answering: GPU is lost")
        body = readiness(agent)
        self.assertFalse(body["ready"])
        self.assertIn("GPU is lost", body["checks"]["nvml"]["detail"])
        # Unhealthy GPUs keep it ready (named in the detail); every GPU's calls hanging does not.
        from llmport_agent.inventory.gpu import GPUDevice
        from llmport_agent.inventory.health import DeviceHealth

        hung = DeviceHealth(index=0, state="unhealthy", reasons=("unresponsive: nvmlDeviceGetMemoryInfo hangs",),
                            unresponsive=True)
        lost = DeviceHealth(index=1, state="unhealthy", reasons=("Xid 79 (GPU has fallen off the bus)",))
        devices = (GPUDevice(index=0, uuid="GPU-0", health=hung), GPUDevice(index=1, uuid="GPU-1", health=lost))
        agent.collector._last_gpu = GPUSnapshot(vendor="nvidia", devices=devices)
        nvml = readiness(agent)["checks"]["nvml"]
        self.assertTrue(nvml["ok"], nvml)
        self.assertEqual((nvml["gpus"], nvml["schedulable"], nvml["health"]["unhealthy"]), (2, 0, 2))
        self.assertIn("GPU 1 (GPU-1) unhealthy: Xid 79", nvml["detail"])
        devices = (devices[0], GPUDevice(index=1, uuid="GPU-1", health=DeviceHealth(index=1, state="unhealthy",
                                                                                    unresponsive=True)))
        agent.collector._last_gpu = GPUSnapshot(vendor="nvidia", devices=devices)
        nvml = readiness(agent)["checks"]["nvml"]
        self.assertFalse(nvml["ok"])
        self.assertIn("every GPU's driver calls hang", nvml["detail"])
        agent.collector._last_gpu = GPUSnapshot()

        class Loki:
            failures = 0

            def describe(self) -> dict[str, object]:
                return {"consecutive_failures": self.failures, "last_error": "HTTP 502", "queue_depth": 7}

        # No LOKI_URL and no sink named yet: off, and it says why (not "(no LOKI_URL)").
        loki = readiness(agent)["checks"]["loki"]
        self.assertEqual((loki["ok"], loki["source"]), (True, "off"))
        self.assertIn("LOKI_URL unset and the backend named no log sink", loki["detail"])
        self.assertNotIn("(no LOKI_URL)", loki["detail"])
        # Shipping to the sink the backend named (LOKI_URL unset): named as such, failures count.
        agent.loki = Loki()
        agent.log_sink.url = "http://sink:pw-s3cret@127.0.0.1:3100"
        loki = readiness(agent)["checks"]["loki"]
        self.assertTrue(loki["ok"])
        self.assertEqual(loki["source"], "backend")
        self.assertIn("pushing to the backend's log sink http://sink:***@127.0.0.1:3100", loki["detail"])
        agent.loki.failures = 5
        body = readiness(agent)
        self.assertFalse(body["ready"])
        self.assertIn("5 failed pushes in a row to the backend's log sink", body["checks"]["loki"]["detail"])
        self.assertIn("HTTP 502", body["checks"]["loki"]["detail"])
        self.assertNotIn("s3cret", json.dumps(body))
        agent.log_sink.url = None
        agent.loki = None
        agent.drain.begin()
        self.assertEqual(readiness(agent)["status"], "stopping")
