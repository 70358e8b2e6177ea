"""
Reconnect backoff: exponential, capped, with full jitter applied after the cap.

C{delay(n) = low + random() * (min(high, low * 2**n) - low)}: every delay lies in
C{[RECONNECT_MIN_SEC, RECONNECT_MAX_SEC]}, the ceiling doubles with each consecutive failure, and
the whole range below the ceiling is used so a fleet reconnecting after a backend restart spreads
out instead of arriving in waves.

L{FailureCounter} counts consecutive failed *sessions*, not TCP connects: plain ClientService
resets its own count whenever TCP connects, so a backend that accepts TCP and refuses the
WebSocket upgrade would be retried at the minimum delay forever (craft.md 3.2).
"""

from __future__ import annotations

import random as _random
from collections.abc import Callable

from llmport_agent.core.values import define


@define
class Backoff:
    low: float
    high: float
    random: Callable[[], float] = _random.random

    def ceiling(self, failures: int) -> float:
        n = max(0, failures)
        if n > 60:
            return self.high
        return min(self.high, self.low * (2.0**n))

    def delay(self, failures: int) -> float:
        top = self.ceiling(failures)
        return self.low + self.random() * (top - self.low)


@define
class FailureCounter:
    """
    Consecutive failed sessions. A session that stayed open at least C{stable_after} seconds
    resets the count; a refused upgrade or a session that closed early increments it.
    """

    stable_after: float = 30.0
    failures: int = 0

    def opened_for(self, seconds: float | None) -> None:
        """Record the end of an attempt: C{None} when the WebSocket never opened."""
        if seconds is not None and seconds >= self.stable_after:
            self.failures = 0
        else:
            self.failures += 1


def retry_policy(backoff: Backoff, counter: FailureCounter) -> Callable[[int], float]:
    """A ClientService C{retryPolicy} using the larger of its attempt count and ours."""

    def policy(attempt: int) -> float:
        return backoff.delay(max(attempt, counter.failures))

    return policy
