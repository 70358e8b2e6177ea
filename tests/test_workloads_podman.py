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

from typing import Any

from twisted.internet import reactor as _global_reactor

from llmport_agent.inventory.gpu import GPUDevice, GPUSnapshot
from llmport_agent.workloads.gpus import GPU_UNAVAILABLE

from . import (
    test_gpu_placement,
    test_workloads_docker,
    test_workloads_health,
    test_workloads_images,
)
from .support.podman_env import require_podman
from .support.rig import WorkloadTestBase, httpd_payload

reactor: Any = _global_reactor

#: test id (Class.method) -> why it does not run on Podman.
PODMAN_SKIPS: dict[str, str] = {
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
