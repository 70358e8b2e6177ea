"""
L{StartGC}: Python's collections of older generations held off from the process start to the
first connect to the backend (issue 27: start to connected). Light on purpose: imported before
Twisted and the agent's modules, whose imports it is there for.
"""

from __future__ import annotations

import gc as _gc
from typing import Any

from attrs import define, field

__all__ = ["OUT_OF_REACH", "StartGC"]

#: A collection count the middle and oldest generations never reach during a start.
OUT_OF_REACH = 1_000_000_000


@define
class StartGC:
    """
    Python's collections of its older generations held off from the process start until the
    first connect to the backend (or C{window} seconds after L{arm}, whichever comes first),
    then one full collection and the collector's thresholds back as they were.

    A start builds some hundred thousand objects that live as long as the process (modules,
    classes, the services); while it runs, the collector scans them again and again (on the
    bench machine: 156 young collections, 10 ms; 15 of the middle generation, 12 ms; one over
    everything, 19 ms). The young collections stay: they are cheap and free the start's
    short-lived cycles at once (with the whole collector off, the agent at idle kept 1 MiB
    more RSS, its arenas fragmented by the garbage left until the end). The older
    generations wait for the one collection right after the connect's listeners ran. A
    collector already off (someone wanted it so) is left alone.

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
    _thresholds: tuple[int, ...] = field(default=(), init=False)

    @property
    def held(self) -> bool:
        """Whether the collector is held off now."""
        return self._held

    def begin(self) -> None:
        """Hold the older generations' collections off (at the process start, before the
        agent's imports): their thresholds out of reach, the young one as it was."""
        if self._held or not self.gc.isenabled():
            return
        self._thresholds = tuple(self.gc.get_threshold())
        self.gc.set_threshold(self._thresholds[0], OUT_OF_REACH, OUT_OF_REACH)
        self._held = True

    def arm(self, reactor: Any) -> None:
        """The window's end: C{window} seconds from now on C{reactor} at most."""
        self._reactor = reactor
        if self._held and self._timer is None:
            self._timer = reactor.callLater(self.window, self.end)

    def end(self) -> None:
        """Collect once and put the thresholds back (once; later calls do nothing)."""
        if not self._held:
            return
        self._held = False
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self.gc.collect()
        self.gc.set_threshold(*self._thresholds)

    def session_opened(self) -> None:
        if self._held and self._reactor is not None:
            # After the other listeners of this connect (heartbeat first): not in their way.
            self._reactor.callLater(0, self.end)

    def session_closed(self) -> None:
        pass

    def frame_received(self, frame: dict[str, Any]) -> None:
        pass
