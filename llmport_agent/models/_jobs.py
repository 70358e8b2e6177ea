"""
The blocking jobs of one model sync, counted, so the sync's directory descriptors are
closed only once no worker thread can still be using them (closing a descriptor another
thread is about to use could let it act on whatever file gets that number next).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

from twisted.internet.defer import CancelledError, Deferred, DeferredList
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmport_agent.core.threads import BlockingRunner
from llmport_agent.models._http import SerialRunner

T = TypeVar("T")


class FileJobs:
    """
    A L{BlockingRunner} that counts its jobs. Cancelling a returned Deferred only detaches
    the caller (the thread cannot be stopped); L{quiesce} waits for the threads themselves.
    """

    log = Logger()

    def __init__(self, runner: BlockingRunner) -> None:
        self._runner = runner
        self._running = 0  # jobs on a thread, plus jobs queued in this run's serials
        self._idle: list[Deferred[None]] = []

    @property
    def running(self) -> int:
        return self._running

    def serial(self) -> SerialRunner:
        """A L{SerialRunner} on these jobs whose queued jobs count as running from the start."""
        return SerialRunner(self, tracker=self)

    def enter(self) -> None:
        self._running += 1

    def leave(self) -> None:
        self._running -= 1
        if self._running == 0:
            waiters, self._idle = self._idle, []
            for w in waiters:
                if not w.called:
                    w.callback(None)

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Deferred[T]:
        caller: Deferred[T] = Deferred()
        self.enter()
        inner = self._runner.run(fn, *args, **kwargs)

        def finished(result: object) -> None:
            if not caller.called:
                if isinstance(result, Failure):
                    caller.errback(result)
                else:
                    caller.callback(result)  # type: ignore[arg-type]
            elif isinstance(result, Failure) and not result.check(CancelledError):
                self.log.failure(
                    "file job {job} failed after its caller went away", result,
                    job=getattr(fn, "__name__", "?"),
                )
            self.leave()

        inner.addBoth(finished)
        return caller

    async def quiesce(self) -> None:
        """Return once no job is running (also when the wait itself gets cancelled)."""
        while self._running:
            d: Deferred[None] = Deferred()
            self._idle.append(d)
            try:
                await d
            except CancelledError:
                continue


async def run_together(workers: Iterable[Coroutine[Any, Any, None]]) -> None:
    """
    Run C{workers} at once. The first failure (other than a cancellation) cancels the
    others - their clean-up still runs - and is raised once all have stopped.
    """
    deferreds: list[Deferred[None]] = []
    first: list[Failure] = []

    def failed(f: Failure) -> Failure:
        if not first and not f.check(CancelledError):
            first.append(f)
            for w in deferreds:
                if not w.called:
                    w.cancel()
        return f

    for coro in workers:
        d = Deferred.fromCoroutine(coro)
        deferreds.append(d)
        d.addErrback(failed)
    results = await DeferredList(deferreds, consumeErrors=True)
    if first:
        first[0].raiseException()
    for ok, value in results:
        if not ok and isinstance(value, Failure):
            value.raiseException()
