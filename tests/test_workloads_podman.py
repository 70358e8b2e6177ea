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

import os
from typing import Any

from twisted.internet import reactor as _global_reactor

from llmport_agent.inventory.gpu import GPUDevice, GPUSnapshot
from llmport_agent.workloads.gpus import GPU_UNAVAILABLE

from . import test_workloads_docker, test_workloads_health, test_workloads_images
from .support.podman_env import require_podman
from .support.rig import WorkloadTestBase, httpd_payload

reactor: Any = _global_reactor

#: test id (Class.method) -> why it does not run on Podman.
PODMAN_SKIPS: dict[str, str] = {}


def _podman_classes() -> dict[str, type]:
    out: dict[str, type] = {}
    for module in (test_workloads_docker, test_workloads_health, test_workloads_images):
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

    async def test_amd_gpu_devices_reach_the_container(self) -> None:
        """AMD GPUs go in as plain devices (/dev/kfd, /dev/dri/renderD*), which Podman passes."""
        kfd, render = _fake_amd_nodes(self)
        gpus = GPUSnapshot(
            vendor="amd", devices=(GPUDevice(index=0, vendor="amd", render_node="/dev/dri/renderD128"),)
        )
        self.rig.manager._gpus = lambda: gpus
        self.patch(_gpus_module(), "KFD", kfd)
        self.patch(_gpus_module(), "_RENDER_RE", _any_render(render))
        gpus = GPUSnapshot(vendor="amd", devices=(GPUDevice(index=0, vendor="amd", render_node=render),))
        self.rig.manager._gpus = lambda: gpus
        script = f"ls -l {kfd} {render} > /www/devices; " + (
            "mkdir -p /www && echo ok > /www/health && exec httpd -f -p $LLAMA_ARG_PORT -h /www"
        )
        payload = httpd_payload(gpu_request="all", script="mkdir -p /www; " + script)
        _, result = await self.rig.run("deploy_workload", payload)
        code, body = await self.rig.get(f"http://127.0.0.1:{result['host_port']}/devices")
        self.assertEqual(code, 200)
        self.assertIn(render.encode(), body)
        self.assertIn(kfd.encode(), body)
        [container] = self.env.managed_containers(payload["runtime_id"])
        paths = {d["PathOnHost"] for d in container.attrs["HostConfig"]["Devices"]}
        self.assertEqual(paths, {kfd, render})


def _gpus_module() -> Any:
    from llmport_agent.workloads import gpus

    return gpus


def _any_render(path: str) -> Any:
    import re

    return re.compile("^" + re.escape(path) + "$")


def _fake_amd_nodes(case: Any) -> tuple[str, str]:
    """Character devices standing in for /dev/kfd and a render node (made with mknod)."""
    root = os.path.abspath(case.mktemp())
    os.makedirs(os.path.join(root, "dri"))
    kfd = os.path.join(root, "kfd")
    render = os.path.join(root, "dri", "renderD128")
    for path in (kfd, render):
        os.mknod(path, 0o666 | 0o020000, os.makedev(1, 3))  # the null device's numbers
    return kfd, render
