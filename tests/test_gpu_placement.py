"""
GPU requests against the node's GPUs, their health and the engine (issue 13):
L{llmport_agent.workloads.gpus.place_gpus} and the rendered container, and AMD devices
reaching a real container (Docker here; tests.test_workloads_podman re-runs it on Podman).
"""

from __future__ import annotations

import os
import re
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.base import CommandFailed
from llmport_agent.inventory.gpu import GPUDevice, GPUSnapshot
from llmport_agent.inventory.health import DeviceHealth
from llmport_agent.workloads import gpus as gpus_module
from llmport_agent.workloads.gpus import GPU_UNAVAILABLE, GPU_UNHEALTHY, place_gpus
from llmport_agent.workloads.settings import WorkloadSettings
from llmport_agent.workloads.spec import build_spec, render

from .support.rig import WorkloadTestBase, httpd_payload

SETTINGS = WorkloadSettings(agent_id="n", network_mode="host")


def node(*unhealthy: int, vendor: str = "nvidia", count: int = 8) -> GPUSnapshot:
    devices = []
    for i in range(count):
        health = (
            DeviceHealth(index=i, state="unhealthy", reasons=("Xid 79 (GPU has fallen off the bus)",))
            if i in unhealthy
            else DeviceHealth(index=i)
        )
        devices.append(
            GPUDevice(
                index=i,
                vendor=vendor,
                uuid=f"GPU-{i:04d}",
                name="NVIDIA H100 80GB HBM3" if vendor == "nvidia" else "AMD Instinct MI300X",
                pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
                memory_total_bytes=80 << 30,
                render_node=f"/dev/dri/renderD{128 + i}" if vendor == "amd" else "",
                health=health,
            )
        )
    return GPUSnapshot(vendor=vendor, devices=tuple(devices))


def spec_for(gpu_request: str) -> Any:
    return build_spec(httpd_payload(gpu_request=gpu_request), SETTINGS, ())


class PlacementTests(SynchronousTestCase):
    def test_specific_unhealthy_gpu_is_refused_naming_it(self) -> None:
        with self.assertRaises(CommandFailed) as cm:
            place_gpus(spec_for("device=3"), node(3))
        exc = cm.exception
        self.assertEqual(exc.error_code, GPU_UNHEALTHY)
        self.assertIn("GPU 3 (GPU-0003, NVIDIA H100 80GB HBM3, 00000000:1B:00.0)", exc.error_message)
        self.assertIn("unhealthy: Xid 79", exc.error_message)

    def test_by_uuid_too(self) -> None:
        with self.assertRaises(CommandFailed):
            place_gpus(spec_for("device=GPU-0003"), node(3))
        placed = place_gpus(spec_for("device=GPU-0002,1"), node(3))
        self.assertEqual(placed.gpu.device_ids, ("GPU-0002", "1"))

    def test_unknown_gpu_is_refused(self) -> None:
        with self.assertRaises(CommandFailed) as cm:
            place_gpus(spec_for("device=9"), node())
        self.assertEqual(cm.exception.error_code, GPU_UNAVAILABLE)
        self.assertIn("its GPUs: 0, 1, 2", cm.exception.error_message)

    def test_all_and_counts_skip_the_unhealthy_gpu(self) -> None:
        placed = place_gpus(spec_for("all"), node(3))
        self.assertEqual(placed.gpu.device_ids, ("0", "1", "2", "4", "5", "6", "7"))
        args = render(placed, host_port=8000, command_id="c", agent_id="n")
        self.assertEqual(args["host_config"]["device_requests"][0]["DeviceIDs"], list(placed.gpu.device_ids))
        placed = place_gpus(spec_for("4"), node(0, 1))
        self.assertEqual(placed.gpu.device_ids, ("2", "3", "4", "5"))
        with self.assertRaises(CommandFailed) as cm:
            place_gpus(spec_for("8"), node(3))
        self.assertIn("7 healthy GPU(s) of 8", cm.exception.error_message)
        self.assertIn("GPU 3", cm.exception.error_message)

    def test_all_healthy_passes_the_request_as_it_is(self) -> None:
        spec = spec_for("all")
        self.assertIs(place_gpus(spec, node()), spec)
        self.assertIs(place_gpus(spec, None), spec)  # no GPU facts yet: the engine decides

    def test_amd_gets_kfd_and_render_nodes_not_device_requests(self) -> None:
        placed = place_gpus(spec_for("device=1,2"), node(vendor="amd"))
        self.assertEqual(placed.gpu_devices, ("/dev/kfd", "/dev/dri/renderD129", "/dev/dri/renderD130"))
        hc = render(placed, host_port=8000, command_id="c", agent_id="n")["host_config"]
        self.assertNotIn("device_requests", hc)
        self.assertEqual(hc["devices"][0], "/dev/kfd:/dev/kfd:rwm")
        placed = place_gpus(spec_for("all"), node(5, vendor="amd"))
        self.assertNotIn("/dev/dri/renderD133", placed.gpu_devices)
        self.assertEqual(len(placed.gpu_devices), 8)

    def test_amd_render_node_must_be_a_render_node(self) -> None:
        bad = node(vendor="amd", count=1)
        bad = GPUSnapshot(vendor="amd", devices=(GPUDevice(index=0, vendor="amd", render_node="/etc/shadow"),))
        with self.assertRaises(CommandFailed) as cm:
            place_gpus(spec_for("all"), bad)
        self.assertIn("not a ROCm render node", cm.exception.error_message)

    def test_payload_devices_stay_refused(self) -> None:
        with self.assertRaises(CommandFailed):
            build_spec(httpd_payload(gpu_request="all", provider_config={"devices": ["/dev/kfd"]}), SETTINGS, ())

    def test_podman_refuses_nvidia_and_apple_refuses_all(self) -> None:
        for snap in (node(), None):
            with self.assertRaises(CommandFailed) as cm:
                place_gpus(spec_for("all"), snap, engine="podman")
            self.assertIn("Podman", cm.exception.error_message)
        self.assertEqual(len(place_gpus(spec_for("all"), node(vendor="amd"), engine="podman").gpu_devices), 9)
        apple = GPUSnapshot(vendor="apple", devices=(GPUDevice(index=0, vendor="apple", name="Apple M3"),))
        with self.assertRaises(CommandFailed) as cm:
            place_gpus(spec_for("all"), apple)
        self.assertIn("Apple GPU", cm.exception.error_message)
        spec = spec_for("none")
        self.assertIs(place_gpus(spec, apple, engine="podman"), spec)


class EngineGPUDeviceTests(WorkloadTestBase):
    """AMD GPUs go into a real container as plain devices (on Docker; on Podman via the re-run)."""

    async def test_amd_gpu_devices_reach_the_container(self) -> None:
        kfd, render_node = _fake_amd_nodes(self)
        self.patch(gpus_module, "KFD", kfd)
        self.patch(gpus_module, "_RENDER_RE", re.compile("^" + re.escape(render_node) + "$"))
        snap = GPUSnapshot(vendor="amd", devices=(GPUDevice(index=0, vendor="amd", render_node=render_node),))
        self.rig.manager._gpus = lambda: snap
        script = (
            f"mkdir -p /www && ls -l {kfd} {render_node} > /www/devices && echo ok > /www/health && "
            "exec httpd -f -p $LLAMA_ARG_PORT -h /www"
        )
        payload = httpd_payload(gpu_request="all", script=script)
        _, result = await self.rig.run("deploy_workload", payload)
        code, body = await self.rig.get(f"http://127.0.0.1:{result['host_port']}/devices")
        self.assertEqual(code, 200)
        self.assertIn(render_node.encode(), body)
        self.assertIn(kfd.encode(), body)
        [container] = self.env.managed_containers(payload["runtime_id"])
        self.assertEqual(len(container.attrs["HostConfig"]["Devices"]), 2)
        self.assertFalse(container.attrs["HostConfig"].get("DeviceRequests"))


def _fake_amd_nodes(case: Any) -> tuple[str, str]:
    """Character devices standing in for /dev/kfd and a render node (the null device's numbers)."""
    root = os.path.abspath(case.mktemp())
    os.makedirs(os.path.join(root, "dri"))
    kfd = os.path.join(root, "kfd")
    render_node = os.path.join(root, "dri", "renderD128")
    for path in (kfd, render_node):
        os.mknod(path, 0o666 | 0o020000, os.makedev(1, 3))
    return kfd, render_node
