"""
The workload tests again, against a real Podman (C{podman system service}, Docker-compatible
API; tests.support.podman_env), plus what differs on Podman: the engine is reported as
C{podman}, NVIDIA GPU requests are refused with a clear message (Podman's compat API drops
device requests), and AMD GPUs go in as plain devices.

Every test class of tests.test_workloads_docker, tests.test_workloads_health and
tests.test_workloads_images is re-run here with the engine swapped (classes named
C{Podman<Name>}); tests that need a feature Podman's compat API does not have are listed in
L{PODMAN_SKIPS} with the reason.
"""

from __future__ import annotations

import uuid
from typing import Any

from twisted.internet import reactor as _global_reactor

from llmport_agent.commands.base import CommandFailed
from llmport_agent.inventory.gpu import GPUDevice, GPUSnapshot
from llmport_agent.workloads.gpus import GPU_UNAVAILABLE
from llmport_agent.workloads.policy import parse_image_ref

from . import (
    test_gpu_placement,
    test_workloads_docker,
    test_workloads_health,
    test_workloads_images,
)
from .support.docker_env import require_registry
from .support.podman_env import require_podman
from .support.rig import WorkloadTestBase, httpd_payload

reactor: Any = _global_reactor

#: test id (Class.method) -> why it does not run on Podman.
_NO_BYTES = (
    "Podman's compat pull stream carries no per-layer byte counts (progress frames have the phase "
    "and 100 % at the end, not bytes): PodmanPullDifferencesTests.test_pull_without_byte_counts"
)

PODMAN_SKIPS: dict[str, str] = {
    "PullTests.test_pull_progress_bytes": _NO_BYTES,
    "PullTests.test_deploy_pulls_with_progress": _NO_BYTES,
    "PullTests.test_pull_error_in_stream": (
        "Podman words a corrupt layer differently (Digest did not match): "
        "PodmanPullDifferencesTests.test_pull_error_in_stream"
    ),
    "HealthTests.test_failed_update_announces_running": (
        "Podman retries an unreachable registry silently for longer than the tests' 3 s stall "
        "limit (pull_stalled, not pull_failed): PodmanPullDifferencesTests.test_failed_update_announces_running"
    ),
    "HealthTests.test_unhealthy": (
        "Podman runs HEALTHCHECKs from systemd timers; a podman system service without systemd "
        "never runs them, so no container turns unhealthy"
    ),
    "DeployTests.test_gpu_request_without_nvidia": (
        "Podman refuses every NVIDIA GPU request before creating anything (its compat API ignores "
        "device requests): PodmanDifferencesTests.test_gpu_request_without_gpu_facts_refused"
    ),
}


def _podman_classes() -> dict[str, type]:
    out: dict[str, type] = {}
    for module in (test_workloads_docker, test_workloads_health, test_workloads_images, test_gpu_placement):
        for name, value in vars(module).items():
            if (
                isinstance(value, type)
                and issubclass(value, WorkloadTestBase)
                and value is not WorkloadTestBase
                and value.__module__ == module.__name__
            ):
                attrs: dict[str, Any] = {
                    "engine_env": staticmethod(require_podman),
                    "__module__": __name__,
                    "__doc__": f"{value.__doc__ or name} (on Podman)",
                }
                for test_id, reason in PODMAN_SKIPS.items():
                    cls_name, method = test_id.split(".")
                    if cls_name == name:
                        attrs[method] = _skipped(getattr(value, method), reason)
                out[f"Podman{name}"] = type(f"Podman{name}", (value,), attrs)
    return out


def _skipped(method: Any, reason: str) -> Any:
    def test(self: Any) -> None:
        raise self.skipTest(f"on Podman: {reason}")

    test.__name__ = method.__name__
    test.__doc__ = method.__doc__
    return test


globals().update(_podman_classes())


class PodmanDifferencesTests(WorkloadTestBase):
    """What the agent does differently on Podman."""

    engine_env = staticmethod(require_podman)

    async def test_engine_reported_as_podman(self) -> None:
        facts = self.rig.engine.facts()
        self.assertEqual(facts["container_runtime"], "podman")
        self.assertTrue(facts["container_runtime_version"].startswith("4."))
        self.assertEqual(self.rig.engine.kind, "podman")

    async def test_nvidia_gpu_request_refused_with_reason(self) -> None:
        """Podman's compat API drops device requests: refused before anything is created."""
        gpus = GPUSnapshot(vendor="nvidia", devices=(GPUDevice(index=0, name="NVIDIA L4", memory_total_bytes=1),))
        self.rig.manager._gpus = lambda: gpus
        payload = httpd_payload(gpu_request="all")
        ctx, exc = await self.failure("deploy_workload", payload)
        self.assertEqual(exc.error_code, GPU_UNAVAILABLE)
        self.assertIn("Podman", exc.error_message)
        self.assertIn("ignores GPU device requests", exc.error_message)
        self.assertEqual(self.env.managed_containers(payload["runtime_id"]), [])

    async def test_gpu_request_without_gpu_facts_refused(self) -> None:
        """Without GPU facts too: Podman would drop the device request, so it is refused."""
        payload = httpd_payload(gpu_request="1")
        _, exc = await self.failure("deploy_workload", payload)
        self.assertEqual(exc.error_code, GPU_UNAVAILABLE)
        self.assertIn("NVIDIA", exc.error_message)
        self.assertEqual(self.env.managed_containers(payload["runtime_id"]), [])


class PodmanPullDifferencesTests(WorkloadTestBase):
    """Image pulls on Podman: the same outcomes, other words and no byte counts."""

    engine_env = staticmethod(require_podman)
    health = True
    timeout = 180

    async def setUp(self) -> None:  # type: ignore[override]
        await super().setUp()
        self.registry = require_registry()

    async def test_pull_without_byte_counts(self) -> None:
        ref = test_workloads_images.big_image(self.registry)
        self.env.remove_image(ref)
        payload = httpd_payload(image=ref, image_source="pull_from_registry")
        ctx, result = await self.rig.run("deploy_workload", payload)
        frames = ctx.frames_of("pull_image")
        self.assertTrue(frames)
        self.assertEqual(frames[-1]["progress_pct"], 100)
        self.assertTrue(result["image_id"].startswith("sha256:"))

    async def test_pull_error_in_stream(self) -> None:
        before = set(self.registry.blob_paths(400_000))
        ref = self.registry.make_layered_image(f"llmport/broken-{uuid.uuid4().hex[:6]}:1", 500_000)
        self.env.remove_image(ref)
        for path in set(self.registry.blob_paths(400_000)) - before:
            data = bytearray(open(path, "rb").read())
            data[len(data) // 2] ^= 0xFF
            open(path, "wb").write(bytes(data))
        with self.assertRaises(CommandFailed) as cm:
            await self.rig.manager.images.pull(parse_image_ref(ref), test_workloads_images.Recorder())
        self.assertEqual(cm.exception.error_code, "pull_failed")
        self.assertIn("Digest did not match", cm.exception.error_message)

    async def test_failed_update_announces_running(self) -> None:
        payload = httpd_payload()
        _, v1 = await self.rig.run("deploy_workload", payload)
        bad = dict(payload, image_source="pull_from_registry")
        bad["provider_config"] = dict(payload["provider_config"], image="127.0.0.1:1/llmport/nowhere:1")
        ctx = self.rig.ctx("update_workload", bad)
        with self.assertRaises(CommandFailed) as cm:
            await self.rig.manager.update(ctx)
        self.assertIn(cm.exception.error_code, ("pull_failed", "pull_stalled"))
        self.assertIn("left running unchanged", cm.exception.error_message)
        # The running announcement follows the backend's confirmation of the result (the
        # current backend ignores it while the update is in flight).
        ctx.delivered()
        event = await self.rig.wait_event("workload.health.running", payload["runtime_id"])
        self.assertEqual(event["payload"]["endpoint_url"], v1["endpoint_url"])
