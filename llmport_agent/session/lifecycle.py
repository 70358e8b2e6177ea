"""
The connection lifecycle of the backend session as an explicit state machine (Automat's
L{TypeMachineBuilder}, as Twisted's own C{ClientService} does in C{_client_service.py}).

ClientService keeps its own machine for the mechanics (connect, wait, retry); this one is what
the node says about its link to the backend (diagnostics, metrics, C{llmport-agent status}):

    =============  ======================  ==========  ===========  ===========
    state          start                   opened      failed       stop
    =============  ======================  ==========  ===========  ===========
    Stopped        Connecting              Stopped     Stopped      Stopped
    Connecting     Connecting              Connected   BackingOff   Stopped
    Connected      Connected               Connected   BackingOff   Stopped
    BackingOff     BackingOff              Connected   BackingOff   Stopped
    =============  ======================  ==========  ===========  ===========

C{failed} is any attempt that did not leave the node connected: a connection that could not be
made, an upgrade refused, a stream closed, an enrollment that failed for now. The session adds
two conditions owned by its collaborators on top of a not-connected state (L{Link.phase}'s
caller): an enrollment running (C{enrolling}) and a credential held to be revoked (C{refused}).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from automat import TypeMachineBuilder

#: Every phase word the session reports (the metrics' label values).
PHASES = ("connected", "connecting", "backing_off", "enrolling", "refused", "stopped")


class LinkInputs(Protocol):
    """The inputs of the machine (what the session tells it) and its one output, L{phase}."""

    def start(self) -> None:
        """The session started."""

    def opened(self) -> None:
        """The stream opened (the upgrade was accepted)."""

    def failed(self) -> None:
        """An attempt ended without a connection, or the open stream closed."""

    def stop(self) -> None:
        """The session is stopping."""

    def phase(self) -> str:
        """C{stopped}, C{connecting}, C{connected} or C{backing_off}."""


@dataclass
class _Core:
    """The machine keeps no data beyond its state."""


def _build() -> type[LinkInputs]:
    builder = TypeMachineBuilder(LinkInputs, _Core)
    stopped = builder.state("Stopped")
    connecting = builder.state("Connecting")
    connected = builder.state("Connected")
    backing_off = builder.state("BackingOff")

    stopped.upon(LinkInputs.start).to(connecting).returns(None)
    for ignored in (LinkInputs.opened, LinkInputs.failed, LinkInputs.stop):
        stopped.upon(ignored).loop().returns(None)
    for state in (connecting, connected, backing_off):
        state.upon(LinkInputs.start).loop().returns(None)
        state.upon(LinkInputs.opened).to(connected).returns(None)
        state.upon(LinkInputs.failed).to(backing_off).returns(None)
        state.upon(LinkInputs.stop).to(stopped).returns(None)
    for state, word in (
        (stopped, "stopped"), (connecting, "connecting"), (connected, "connected"), (backing_off, "backing_off"),
    ):
        state.upon(LinkInputs.phase).loop().returns(word)
    return builder.build()  # type: ignore[return-value]


_Machine = _build()


def Link() -> LinkInputs:  # noqa: N802 (a factory that reads as a class)
    """A new lifecycle, in the C{Stopped} state."""
    return _Machine(_Core())  # type: ignore[call-arg]
