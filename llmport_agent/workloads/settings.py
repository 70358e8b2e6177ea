"""The operator's settings for workloads, as one value."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from attrs import field, validators

from llmport_agent.core.values import frozen

NetworkMode = Literal["bridge", "host"]


def _absolute_or_none(_: object, attribute: object, value: str | None) -> None:
    if value is not None and not value.startswith("/"):
        raise ValueError(f"model_store must be an absolute path, not {value!r}")


def _positive(_: object, attribute: object, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{getattr(attribute, 'name', '?')} must be > 0, not {value!r}")


def _as_tuple(value: Iterable[str]) -> tuple[str, ...]:
    # A function, not the tuple type: attrs reads a converter's signature when the class is
    # made, and a builtin type's costs about 1.5 ms of the agent's start (issue 27).
    return tuple(value)


@frozen
class WorkloadSettings:
    """
    How this node runs workloads. Owned by the operator; the backend cannot override it.

    @ivar agent_id: this node's agent id (put on every managed container as a label).
    @ivar advertise_scheme: scheme of C{endpoint_url} (C{ADVERTISE_SCHEME}).
    @ivar advertise_host: host of C{endpoint_url} (C{ADVERTISE_HOST}).
    @ivar model_store: host directory mounted at C{/data/hf-cache} (C{MODEL_STORE}), or
        C{None} for none.
    @ivar model_store_read_only: mount it read-only into every workload
        (C{MODEL_STORE_READ_ONLY}); otherwise only C{download_from_hf} workloads, which
        download into it themselves, get it read-write.
    @ivar image_allowlist: C{IMAGE_ALLOWLIST} entries; empty admits every image.
    @ivar network_mode: C{bridge} publishes ports from the engine's default bridge
        (llm-port's default); C{host} runs workloads in the host's network namespace and
        makes the server listen on the host port itself.
    @ivar publish_host_ip: host address ports are published on in bridge mode ("" = all).
    @ivar stop_grace_sec: seconds between SIGTERM and SIGKILL on stop.
    @ivar readiness_timeout_sec: how long a workload may take to answer its health path.
    @ivar readiness_interval_sec: seconds between readiness probes.
    @ivar readiness_progress_sec: seconds between C{waiting_for_ready} progress frames.
    @ivar pull_stall_sec: an image pull or transfer with no progress for this long is
        abandoned (C{pull_stalled}).
    @ivar deploy_deadline_sec: deadline of deploy-type commands (multi-GB pulls and model
        loads fit inside).
    @ivar logs_max_bytes: cap on C{fetch_container_logs} output.
    @ivar allow_host_ipc: give workloads that request GPUs host IPC when asked
        (C{ALLOW_HOST_IPC}); otherwise, and always without GPUs, host IPC is replaced by
        private IPC and a C{/dev/shm} (see L{policy.resolve_ipc}).
    @ivar settle_announce_sec: delay before re-announcing a runtime's health after a command
        that needs it (update, rollback), so the event follows the command's result.
    """

    agent_id: str = field(validator=validators.instance_of(str))
    advertise_scheme: str = "http"
    advertise_host: str = "127.0.0.1"
    model_store: str | None = field(default=None, validator=_absolute_or_none)
    model_store_read_only: bool = False
    image_allowlist: tuple[str, ...] = field(default=(), converter=_as_tuple)
    network_mode: NetworkMode = field(
        default="bridge", validator=validators.in_(("bridge", "host"))
    )
    publish_host_ip: str = ""
    stop_grace_sec: float = field(default=30.0, validator=_positive)
    readiness_timeout_sec: float = field(default=1800.0, validator=_positive)
    readiness_interval_sec: float = field(default=1.0, validator=_positive)
    readiness_progress_sec: float = field(default=15.0, validator=_positive)
    pull_stall_sec: float = field(default=300.0, validator=_positive)
    deploy_deadline_sec: float = field(default=6 * 3600.0, validator=_positive)
    logs_max_bytes: int = 1024 * 1024
    settle_announce_sec: float = 2.0
    allow_host_ipc: bool = True
