"""
When the node's inventory is sent out of its interval: a GPU's health verdict changed (an
event, a heartbeat at once, a fresh inventory soon), or the backend asked (C{refresh_inventory}).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attrs import field
from twisted.internet.interfaces import IDelayedCall

from llmport_agent.core.values import define


@define(eq=False, repr=False)  # a component: identity, not value
class InventoryRefresh:
    """
    @ivar reactor: the clock of the coalescing delay and of the retries.
    @ivar outbox: the event outbox (C{gpu.health.*} events).
    @ivar heartbeat: the heartbeat reporter (C{notify_changed}).
    @ivar inventory: the inventory reporter (C{report_now}).
    @ivar session: the backend session (C{connected}).
    @ivar running: whether the agent runs (no inventory once it stops).
    """

    reactor: Any
    outbox: Any
    heartbeat: Any
    inventory: Any
    session: Any
    running: Callable[[], bool]
    _call: IDelayedCall | None = field(default=None, init=False)

    def gpu_transition(self, t: Any) -> None:
        """
        A GPU's verdict changed: an event, a heartbeat as soon as its status/status_reason
        differ (heartbeat.notify_changed, rate-limited), a fresh inventory soon.
        """
        self.outbox.emit(t.event_type, t.payload(), t.severity)
        self.heartbeat.notify_changed()
        if self._call is None or not self._call.active():
            # Coalesced: one inventory (gpu_count, free VRAM) for a burst of transitions.
            self._call = self.reactor.callLater(1.0, self._gpu_inventory)

    def _gpu_inventory(self) -> None:
        self._call = None
        if self.session.connected and self.running():
            self.inventory.report_now()

    def cancel(self) -> None:
        """The agent stops: no inventory is pending any more."""
        if self._call is not None and self._call.active():
            self._call.cancel()

    async def refresh(self) -> bool:
        """Send a fresh inventory; if the link is down, send it once it is back (within ~50 s)."""
        from twisted.internet.task import deferLater

        for _ in range(100):
            if self.session.connected and await self.inventory.report_now():
                return True
            await deferLater(self.reactor, 0.5, lambda: None)
        return False
