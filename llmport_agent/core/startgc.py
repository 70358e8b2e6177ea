"""
L{StartGC}: Python's garbage collections held off from the process start to the
first connect to the backend (issue 27: start to connected). Light on purpose: imported before
Twisted and the agent's modules, whose imports it is there for.
"""

from __future__ import annotations

import gc as _gc
from typing import Any

from attrs import field

from llmport_agent.core.values import define

__all__ = ["OUT_OF_REACH", "StartGC"]

#: An allocation or collection count no generation reaches during a start.
OUT_OF_REACH = 1_000_000_000


@define(eq=False, repr=False)  # a component: identity, not value
class StartGC:
    """
    Python's garbage collector held off from the process start until the first connect to the
    backend (or C{window} seconds after L{arm}, whichever comes first), then one full
    collection and the collector's thresholds back as they were.

    A start builds some hundred thousand objects that live as long as the process (modules,
    classes, the services); while it runs, the collector scans them again and again (on the
    bench machine: 156 young collections, 10 ms; 15 of the middle generation, 12 ms; one over
    everything, 19 ms). All three generations wait for the one collection right after the
    connect's listeners ran. The price: the start's short-lived cycles are freed only then,
    and the arenas they leave behind cost about 0.7 MiB of RSS at idle (56.8 against 56.1 MiB
    with the young collections left running; the start about 7 ms and 10 ms of CPU shorter:
    BENCHMARKS.md, issue 27). A collector already off (someone wanted it so) is left alone.

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
        """Hold the collector off (at the process start, before the agent's imports): every
        generation's threshold out of reach."""
        if self._held or not self.gc.isenabled():
            return
        self._thresholds = tuple(self.gc.get_threshold())
        self.gc.set_threshold(OUT_OF_REACH, OUT_OF_REACH, OUT_OF_REACH)
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
