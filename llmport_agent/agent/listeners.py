"""
Small session listeners the composition root subscribes: workload states announced after
every connect, and the node profile carried by C{hello_ack}.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.logger import Logger

from llmport_agent.commands.node import PersistentModes


class _Announcer:
    """After every connect, report every managed workload's state (protocol 3.2, node offline)."""

    log = Logger()

    def __init__(self, health: Any) -> None:
        self.health = health

    def session_opened(self) -> None:
        d = Deferred.fromCoroutine(self.health.announce_all())

        def failed(f: Any) -> None:
            from llmport_agent.commands.base import CommandFailed

            if f.check(CommandFailed):
                self.log.warn("Could not announce workloads after connecting: {error}",
                              error=f.value.error_message)
            else:
                self.log.failure("Announcing workloads failed", failure=f)

        d.addErrback(failed)

    def session_closed(self) -> None:
        pass

    def frame_received(self, frame: dict[str, Any]) -> None:
        pass


class _ProfileFromHello:
    """C{hello_ack.profile} is the node's current profile: keep it like C{sync_node_profile}."""

    log = Logger()

    def __init__(self, modes: PersistentModes) -> None:
        self.modes = modes

    def session_opened(self) -> None:
        pass

    def session_closed(self) -> None:
        pass

    def frame_received(self, frame: dict[str, Any]) -> None:
        if frame.get("type") != "hello_ack":
            return
        if "profile" not in frame:
            return
        profile = frame.get("profile")
        if profile is not None and not isinstance(profile, dict):
            self.log.warn("Ignored a hello_ack profile that is not an object")
            return
        changed = (self.modes.profile is not None) if profile is None else profile != self.modes.live_profile
        if changed:
            # None clears it: no profile is assigned to this node any more.
            d = Deferred.fromCoroutine(self.modes.set(profile=profile))
            d.addErrback(lambda f: self.log.failure("Storing the profile failed", failure=f))
