"""
How the session stops: L{StopGate} owns what a stop must wait for or cut short. An enrollment
or rotation in flight gets C{CRITICAL_STOP_GRACE} to store its credential, then its request is
cancelled; retry pauses end at once. The session closes its stream after that (WebSocket close
1000).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, DeferredList, ensureDeferred, fail
from twisted.internet.task import deferLater

#: On stop, an enrollment or rotation request in flight gets this long to bring back its
#: reply (the backend may already have consumed the token / revoked the old credential);
#: then it is cancelled, so a stop always completes within about two seconds.
CRITICAL_STOP_GRACE = 0.5


class StopGate:
    """
    The session's requests, pauses and critical work, as a stop sees them.

    Inputs: L{start}, L{stop}; L{request}, L{sleep} and L{track_critical} for the
    collaborators whose work a stop must wait for or cancel. Output: L{stopping}.
    """

    def __init__(self, clock: Any) -> None:
        self._clock = clock
        self.stopping = False
        self._critical: set[Deferred[Any]] = set()
        self._requests: set[Deferred[Any]] = set()  # enroll/rotate/whoami HTTP requests in flight
        self._sleeping: Deferred[None] | None = None

    def start(self) -> None:
        self.stopping = False

    async def request(self, request: Any) -> Any:
        """Await an enroll/rotate request; L{stop} can cancel it (see CRITICAL_STOP_GRACE)."""
        d: Deferred[Any] = ensureDeferred(request)
        self._requests.add(d)
        try:
            return await d
        finally:
            self._requests.discard(d)

    def sleep(self, seconds: float) -> Deferred[None]:
        """A cancellable pause; L{stop} cancels it (and a stopping session never sleeps)."""
        if self.stopping:
            return fail(CancelledError())
        d = deferLater(self._clock, seconds, lambda: None)
        self._sleeping = d

        def done(result: Any) -> Any:
            self._sleeping = None
            return result

        return d.addBoth(done)

    def track_critical(self, d: Deferred[Any]) -> None:
        """Enrollment and rotation: a stop waits for them, or a credential could be lost."""
        self._critical.add(d)

        def done(result: object) -> object:
            self._critical.discard(d)
            return result

        d.addBoth(done)

    def stop(self, starting: Deferred[Any] | None, then: Callable[[], Deferred[None]]) -> Deferred[None]:
        """
        Mark stopping, end pauses, give critical work (and C{starting}) the grace, cancel the
        requests, then call C{then} (the session closes its connection).
        """
        self.stopping = True
        if self._sleeping is not None:
            self._sleeping.cancel()  # retry delays end at once
        pending = [d for d in self._critical if not d.called]
        if starting is not None and not starting.called:
            pending.append(starting)
        if pending:
            # An enrollment or rotation whose request is in flight gets a moment to bring back
            # its reply and store the credential (the backend may already have consumed the
            # token / revoked the old one), then it is cancelled: a stop takes at most ~2 s,
            # whatever REQUEST_TIMEOUT_SEC is.
            cancel = self._clock.callLater(CRITICAL_STOP_GRACE, self._cancel_requests)
            waiting: Deferred[Any] = DeferredList(pending, consumeErrors=True)
            waiting.addTimeout(CRITICAL_STOP_GRACE + 1.0, self._clock)
            waiting.addErrback(lambda _: None)

            def done(_: object) -> Deferred[None]:
                if cancel.active():
                    cancel.cancel()
                self._cancel_requests()
                return then()

            return waiting.addCallback(done)
        return then()

    def _cancel_requests(self) -> None:
        for d in list(self._requests):
            d.cancel()
