"""
L{StartGC}: Python's cyclic garbage collector held off from the process start to the first
connect to the backend (issue 27: start to connected). Light on purpose: imported before
Twisted and the agent's modules, whose imports it is there for.
"""

from __future__ import annotations

import gc as _gc
from typing import Any

from attrs import define, field

__all__ = ["StartGC"]


@define
class StartGC:
    """
    The cyclic garbage collector held off from the process start until the first connect to
    the backend (or C{window} seconds after L{arm}, whichever comes first), then one full
    collection and the collector back on.

    A start builds some hundred thousand objects that live as long as the process (modules,
    classes, the services); while it runs, Python's collector scans them again and again
    (about 170 collections, one of them over everything: some 40 ms of the path to the first
    connect on the bench machine). The start's cyclic garbage (about 1 MiB) is collected once,
    right after the connect's listeners ran. A collector already off (someone wanted it so)
    is left alone.

    L{begin} before the imports, L{arm} once the reactor is there; subscribed to the session
    as a listener (L{session_opened}).

    @ivar window: seconds after L{arm} at most (a backend that does not answer).
    @ivar gc: the C{gc} module (a stand-in in tests).
    """

    window: float = 10.0
    gc: Any = _gc
    _reactor: Any = field(default=None, init=False)
    _timer: Any = field(default=None, init=False)
    _held: bool = field(default=False, init=False)

    @property
    def held(self) -> bool:
        """Whether the collector is held off now."""
        return self._held

    def begin(self) -> None:
        """Hold the collector off (at the process start, before the agent's imports)."""
        if self._held or not self.gc.isenabled():
            return
        self.gc.disable()
        self._held = True

    def arm(self, reactor: Any) -> None:
        """The window's end: C{window} seconds from now on C{reactor} at most."""
        self._reactor = reactor
        if self._held and self._timer is None:
            self._timer = reactor.callLater(self.window, self.end)

    def end(self) -> None:
        """Collect once and turn the collector back on (once; later calls do nothing)."""
        if not self._held:
            return
        self._held = False
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self.gc.collect()
        self.gc.enable()

    def session_opened(self) -> None:
        if self._held and self._reactor is not None:
            # After the other listeners of this connect (heartbeat first): not in their way.
            self._reactor.callLater(0, self.end)

    def session_closed(self) -> None:
        pass

    def frame_received(self, frame: dict[str, Any]) -> None:
        pass
