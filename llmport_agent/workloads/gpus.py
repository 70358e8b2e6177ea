# -*- test-case-name: tests.test_gpu_placement -*-
"""
Turning a workload's C{gpu_request} into what the container engine gets, against the GPUs
this node really has and their health.

 - B{NVIDIA on Docker}: a device request (C{docker --gpus}); C{device=<index|UUID>} must
   name GPUs the node has, and none of them may be unhealthy (the refusal names the GPU and
   why). C{all} or a count with an unhealthy GPU present become explicit healthy device
   ids, so the engine cannot hand the bad GPU to the container.
 - B{AMD}: no device request (the ROCm convention): the container gets C{/dev/kfd} and the
   C{/dev/dri/renderD*} node of each GPU it may use, as plain devices. These are the only
   devices the agent ever adds (local policy: GPU devices only), checked by pattern.
 - B{Podman}: its Docker-compatible API ignores device requests (a container would start
   without its GPUs), so an NVIDIA GPU request on Podman is refused with a message that says
   so; AMD devices work there as plain devices.
 - B{Apple}: a container cannot use the GPU of a Mac; a GPU request is refused.
 - Without GPU facts (no snapshot yet, or the GPU source fails) the request is passed on as
   it is, and the engine decides.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from attrs import evolve

from ..commands.base import CommandFailed
from ..inventory.gpu import GPUDevice, GPUSnapshot
from .spec import GpuRequest, WorkloadSpec

__all__ = ["GPU_UNAVAILABLE", "GPU_UNHEALTHY", "place_gpus"]

GPU_UNHEALTHY = "gpu_unhealthy"
GPU_UNAVAILABLE = "gpu_unavailable"

KFD = "/dev/kfd"
_RENDER_RE = re.compile(r"^/dev/dri/renderD[0-9]{1,4}$")


def _why(d: GPUDevice) -> str:
    reasons = d.health.reasons if d.health is not None else ()
    return "; ".join(reasons) or d.state


def _find(ident: str, devices: Sequence[GPUDevice]) -> GPUDevice | None:
    if ident.isdigit():
        return next((d for d in devices if d.index == int(ident)), None)
    low = ident.lower()
    for d in devices:
        if d.uuid and d.uuid.lower() == low:
            return d
        if any(m.uuid and m.uuid.lower() == low for m in d.mig_instances):
            return d
    return None


def _unhealthy(d: GPUDevice, request: GpuRequest) -> CommandFailed:
    return CommandFailed(
        GPU_UNHEALTHY,
        f"gpu_request {request.describe()} asks for {d.describe()}, which is {d.state}: "
        f"{_why(d)}. Choose another GPU; this one is offered again once the agent sees it "
        "recovered (after a reset).",
    )


def _choose(request: GpuRequest, gpus: GPUSnapshot) -> tuple[GpuRequest, tuple[GPUDevice, ...]]:
    """The request to pass on and the devices it covers."""
    devices = gpus.devices
    if request.device_ids:
        chosen: list[GPUDevice] = []
        for ident in request.device_ids:
            d = _find(ident, devices)
            if d is None:
                if ident.isdigit() or ident.upper().startswith("GPU-"):
                    have = ", ".join(str(x.index) for x in devices) or "none"
                    raise CommandFailed(
                        GPU_UNAVAILABLE,
                        f"gpu_request {request.describe()} names GPU {ident}, which this node "
                        f"does not have (its GPUs: {have}).",
                    )
                return request, ()  # an id the agent cannot check: the engine decides
            if not d.schedulable:
                raise _unhealthy(d, request)
            chosen.append(d)
        return request, tuple(chosen)
    healthy = tuple(d for d in devices if d.schedulable)
    bad = [d for d in devices if not d.schedulable]
    wanted = len(healthy) if request.count < 0 else request.count
    if not healthy or wanted > len(healthy):
        detail = "".join(f"; {d.describe()} is {d.state}: {_why(d)}" for d in bad[:3])
        asked = "all" if request.count < 0 else str(request.count)
        raise CommandFailed(
            GPU_UNHEALTHY if bad else GPU_UNAVAILABLE,
            f"gpu_request {request.describe()} asks for {asked} GPU(s) but this node has "
            f"{len(healthy)} healthy GPU(s) of {len(devices)}{detail}.",
        )
    picked = healthy[:wanted]
    if not bad:
        return request, picked
    # Name the healthy GPUs: a count or "all" would let the engine hand out the bad one.
    return GpuRequest(0, tuple(str(d.index) for d in picked)), picked


def place_gpus(spec: WorkloadSpec, gpus: GPUSnapshot | None, engine: str = "docker") -> WorkloadSpec:
    """
    C{spec} with its GPU request resolved for this node and engine.

    @raise CommandFailed: C{gpu_unhealthy} (a requested GPU is unhealthy, or too few healthy
        GPUs are left) or C{gpu_unavailable} (no such GPU; GPUs this engine cannot give).
    """
    request = spec.gpu
    if request is None:
        return spec
    vendor = gpus.vendor if gpus is not None and gpus.devices else ""
    if engine == "podman" and vendor in ("", "nvidia"):
        raise CommandFailed(
            GPU_UNAVAILABLE,
            f"gpu_request {request.describe()} cannot be met on this node's Podman engine: its "
            "Docker-compatible API ignores GPU device requests, so the container would start "
            "without GPUs. Run GPU workloads on Docker with the NVIDIA Container Toolkit.",
        )
    if gpus is None or not vendor:
        return spec
    if vendor == "apple":
        raise CommandFailed(
            GPU_UNAVAILABLE,
            f"gpu_request {request.describe()} cannot be met: this node's GPU is an Apple GPU, "
            "which containers cannot use; deploy this workload without a GPU (gpu_request none).",
        )
    resolved, chosen = _choose(request, gpus)
    if vendor != "amd":
        return spec if resolved is request else evolve(spec, gpu=resolved)
    nodes = [d.render_node for d in (chosen or gpus.schedulable) if d.render_node]
    paths = [KFD, *sorted(set(nodes))]
    for path in paths:
        if path != KFD and not _RENDER_RE.match(path):
            raise CommandFailed(
                GPU_UNAVAILABLE,
                f"GPU device {path!r} is not a ROCm render node; refusing to pass it to a container.",
            )
    if len(paths) == 1:
        raise CommandFailed(
            GPU_UNAVAILABLE,
            f"gpu_request {request.describe()} cannot be met: no /dev/dri/renderD* node was found "
            "for this node's AMD GPUs (is the amdgpu driver loaded?).",
        )
    return evolve(spec, gpu=resolved, gpu_devices=tuple(paths))
