"""
Host port choice.

An explicit host port that something already holds is a C{port_conflict} before anything
is created. Without one, the container port is used (as llm-port expects) unless it is
taken, in which case a free port is chosen. Ports of other managed workloads count as
taken even while those are stopped, so a later start of theirs does not collide.

Checking is a non-blocking C{bind()} on the wildcard address (it fails while any socket,
on any local address, listens on the port).
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable, Collection

from ..commands.base import CommandFailed

PORT_CONFLICT = "port_conflict"


def port_is_free(port: int) -> bool:
    """Whether a TCP listener could bind C{port} on all IPv4 (and IPv6) addresses now."""
    families: list[tuple[int, str]] = [(socket.AF_INET, "0.0.0.0")]
    if socket.has_ipv6:
        families.append((socket.AF_INET6, "::"))
    for family, address in families:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((address, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            if family == socket.AF_INET6:
                continue  # no usable IPv6 here; IPv4 decided
            return False
        finally:
            sock.close()
    return True


def choose_host_port(
    container_port: int,
    requested: int | None,
    reserved: Collection[int] = (),
    *,
    is_free: Callable[[int], bool] = port_is_free,
    scan: int = 2000,
) -> int:
    """
    Pick the host port for a workload.

    @param reserved: ports other managed workloads use (taken even when they are stopped).
    @raise CommandFailed: C{port_conflict} when C{requested} is held, or nothing is free.
    """
    if requested is not None:
        if requested in reserved:
            raise CommandFailed(
                PORT_CONFLICT,
                f"Host port {requested} is already assigned to another workload on this node; "
                "choose another host_port or leave it empty to get a free one.",
            )
        if not is_free(requested):
            raise CommandFailed(
                PORT_CONFLICT,
                f"Host port {requested} is already in use by another process on this node; "
                "choose another host_port or leave it empty to get a free one.",
            )
        return requested
    if container_port not in reserved and is_free(container_port):
        return container_port
    candidates = [p for p in range(container_port + 1, min(65536, container_port + 1 + scan))]
    if len(candidates) < scan:
        candidates += list(range(1024, 1024 + scan - len(candidates)))
    for port in candidates:
        if port not in reserved and is_free(port):
            return port
    raise CommandFailed(
        PORT_CONFLICT,
        f"No free host port found near {container_port} on this node.",
    )
