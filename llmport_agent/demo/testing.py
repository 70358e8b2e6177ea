"""
Fakes shipped with the package, for this project's tests and for anyone embedding the agent.
Each is faithful to the interface it stands in for (see tests/test_testing.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from twisted.internet.defer import Deferred, maybeDeferred

from llmport_agent.session.protocol import ConnectionGone

T = TypeVar("T")


class SynchronousRunner:
    """A L{BlockingRunner} that runs the callable at once, on the calling thread."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Deferred[T]:
        self.calls.append(getattr(fn, "__name__", repr(fn)))
        return maybeDeferred(fn, *args, **kwargs)


class FakeSession:
    """
    Stands in for L{SessionService} towards listeners: records frames, stamps C{seq}, and lets
    the test decide when deliveries are confirmed or lost.
    """

    def __init__(self, connected: bool = True) -> None:
        self.connected = connected
        self.frames: list[dict[str, Any]] = []
        self._seq = 0
        self._confirms: list[Deferred[None]] = []
        self.auto_confirm = True
        self.node_id = "node-1"

    def send(self, frame: dict[str, Any]) -> bool:
        if not self.connected:
            return False
        self._seq += 1
        frame = dict(frame, seq=self._seq)
        self.frames.append(frame)
        return True

    def confirm(self) -> Deferred[None] | None:
        if not self.connected:
            return None
        d: Deferred[None] = Deferred()
        if self.auto_confirm:
            d.callback(None)
        else:
            self._confirms.append(d)
        return d

    def confirm_all(self) -> None:
        pending, self._confirms = self._confirms, []
        for d in pending:
            d.callback(None)

    def disconnect(self) -> None:
        self.connected = False
        pending, self._confirms = self._confirms, []
        for d in pending:
            d.errback(ConnectionGone("test disconnect"))

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [f for f in self.frames if f.get("type") == kind]

    def credential(self) -> str:
        return "00000000-0000-0000-0000-000000000000.secret"
