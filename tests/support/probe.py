"""A reactor-lateness probe: a LoopingCall on the real reactor recording how late each tick is."""

from __future__ import annotations

import time

from twisted.internet.task import LoopingCall


class LatenessProbe:
    """Ticks every C{interval} seconds; C{late} holds how late each tick was (seconds)."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.late: list[float] = []
        self._last = 0.0
        self._loop = LoopingCall(self._tick)

    def _tick(self) -> None:
        now = time.perf_counter()
        if self._last:
            self.late.append(max(0.0, now - self._last - self.interval))
        self._last = now

    def start(self) -> None:
        self.late.clear()
        self._last = 0.0
        self._loop.start(self.interval)

    def stop(self) -> None:
        if self._loop.running:
            self._loop.stop()

    @property
    def worst(self) -> float:
        return max(self.late or [0.0])

    def percentile(self, q: float) -> float:
        ordered = sorted(self.late)
        if not ordered:
            return 0.0
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    def summary(self) -> str:
        if not self.late:
            return "n/a"
        return (f"p99 {self.percentile(0.99) * 1000:.1f} ms, max {self.worst * 1000:.1f} ms "
                f"(n={len(self.late)})")
