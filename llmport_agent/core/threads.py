"""
Bounded, named thread pools owned by services.

Everything that blocks (docker-py, NVML, psutil, hashing, file writes) runs through a
L{PoolService}: a L{ThreadPool} with a fixed maximum size that is started in
C{startService} and stopped, after its in-flight work, in C{stopService}. A
"during shutdown" trigger is a backstop so a forgotten pool never keeps the process alive.

Tests inject L{SynchronousPool} (see L{llmport_agent.demo.testing}) where determinism matters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.interfaces import IReactorCore, IReactorThreads, IReactorTime
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.threadpool import ThreadPool

T = TypeVar("T")


class IPoolReactor(IReactorThreads, IReactorTime, IReactorCore):  # type: ignore[misc]
    """The reactor facets a pool needs."""


class BlockingRunner(Protocol):
    """Anything that can run a blocking callable off the reactor thread."""

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Deferred[T]:
        """Run C{fn(*args, **kwargs)} in a worker thread; fire with its result."""


class PoolService(Service):
    """
    A service owning one bounded L{ThreadPool}.

    @ivar name: the pool's name (shown in thread names and diagnostics).
    @ivar maxthreads: the bound on concurrent blocking calls.
    """

    log = Logger()

    def __init__(self, reactor: Any, name: str, maxthreads: int) -> None:
        self.setName(f"pool-{name}")
        self._reactor = reactor
        self.poolName = name
        self.maxthreads = maxthreads
        self._pool: ThreadPool | None = None
        self._inflight: set[Deferred[Any]] = set()
        self._trigger: Any = None

    @property
    def busy(self) -> int:
        """How many calls are running or queued now."""
        return len(self._inflight)

    def startService(self) -> None:
        super().startService()
        self._pool = ThreadPool(minthreads=0, maxthreads=self.maxthreads, name=self.poolName)
        self._pool.start()
        self._trigger = self._reactor.addSystemEventTrigger(
            "during", "shutdown", self._stopPool
        )

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Deferred[T]:
        """
        Run C{fn} on this pool. Must be called on the reactor thread.

        @raise RuntimeError: (as a failed Deferred) when the pool is not running.
        """
        if self._pool is None:
            from twisted.internet.defer import fail

            return fail(RuntimeError(f"thread pool {self.poolName!r} is not running"))
        d: Deferred[T] = deferToThreadPool(self._reactor, self._pool, fn, *args, **kwargs)
        self._inflight.add(d)

        def _done(result: Any) -> Any:
            self._inflight.discard(d)
            return result

        d.addBoth(_done)
        return d

    def stopService(self, drainTimeout: float = 10.0) -> Deferred[None]:
        """
        Wait (bounded) for in-flight calls, then stop the pool's threads.
        """
        super().stopService()
        if self._pool is None:
            return succeed(None)
        pending = list(self._inflight)
        if not pending:
            self._stopPool()
            return succeed(None)
        waiting: Deferred[Any] = DeferredList(pending, consumeErrors=True)
        waiting.addTimeout(drainTimeout, self._reactor)

        def _stop(_: object) -> None:
            self._stopPool()

        return waiting.addBoth(_stop)

    def _stopPool(self) -> None:
        if self._trigger is not None:
            try:
                self._reactor.removeSystemEventTrigger(self._trigger)
            except (ValueError, KeyError, TypeError):
                pass
            self._trigger = None
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
