# -*- test-case-name: tests.test_gpu_health -*-
"""
A bounded pool of daemon threads with a per-call deadline, for calls into C libraries that
may hang (NVML around an Xid 79, a wedged driver).

A thread stuck inside a C call cannot be killed or interrupted. So:

 - every job runs on a B{daemon} thread, which never keeps the process from exiting (a
   Twisted C{ThreadPool} joins its threads at stop, and would hang the agent's shutdown);
 - threads are kept and reused: a job goes to an idle worker when there is one, and a new
   worker starts only when every worker is busy (so a loop of calls, such as the GPU event
   wait, runs on the same thread each time instead of starting one per call); an idle
   worker sleeps on its queue and wakes for nothing else;
 - a job that runs past its deadline is I{stuck}: the caller stops waiting for it (and says
   which call hung), the thread is left alone, and it counts against the pool's bound until
   it returns by itself;
 - at most C{max_threads} jobs are alive at once, stuck ones included: beyond that
   L{WatchdogPool.submit} raises L{PoolSaturated} at once instead of queueing behind a hang.

C{synchronous=True} runs jobs inline on the caller's thread (deterministic unit tests).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from twisted.internet.defer import Deferred, fail, succeed
from twisted.python.failure import Failure

__all__ = ["CallTimedOut", "Job", "PoolSaturated", "WatchdogPool", "run_deferred"]

T = TypeVar("T")


class PoolSaturated(RuntimeError):
    """Too many calls are alive (most likely hung): no new call is started."""


class CallTimedOut(RuntimeError):
    """A call ran past its deadline; its thread is left running."""


class Job(Generic[T]):
    """One call on a L{WatchdogPool}: its future, when it started, what it is doing now."""

    def __init__(self, label: str, deadline: float, clock: Callable[[], float]) -> None:
        self.label = label
        self.deadline = deadline
        self.future: Future[T] = Future()
        self._clock = clock
        self.started = clock()
        #: What the job is doing now (set by the job itself, e.g. the NVML function name).
        self.current = ""

    @property
    def age(self) -> float:
        return self._clock() - self.started

    @property
    def done(self) -> bool:
        return self.future.done()

    @property
    def stuck(self) -> bool:
        """Running past its deadline."""
        return not self.future.done() and self.age > self.deadline

    def doing(self) -> str:
        """C{label} and, when known, the call in progress (for messages)."""
        return f"{self.label} ({self.current})" if self.current else self.label


class WatchdogPool:
    """
    Daemon threads with per-call deadlines and a bound on live (hung included) calls.

    @param max_threads: the most calls alive at once, stuck ones included.
    @param synchronous: run every job inline on the caller's thread (tests).
    """

    def __init__(
        self,
        name: str,
        max_threads: int = 16,
        *,
        synchronous: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.max_threads = max(1, max_threads)
        self.synchronous = synchronous
        self._clock = clock
        self._lock = threading.Lock()
        self._alive: set[Job[Any]] = set()
        #: The queues of idle workers (each worker thread owns one and blocks on it).
        self._idle: list[queue.SimpleQueue[Any]] = []
        self._counter = 0
        #: Worker threads started, ever (tests, diagnostics).
        self.threads_started = 0
        self._closed = False
        #: Calls that ran past their deadline, ever (for diagnostics and metrics).
        self.timed_out_total = 0

    # -- state

    @property
    def alive(self) -> int:
        with self._lock:
            return len(self._alive)

    def stuck_jobs(self) -> list[Job[Any]]:
        """The calls running past their deadline now."""
        with self._lock:
            return [j for j in self._alive if j.stuck]

    def note_timeout(self) -> None:
        """Count one call given up on by its caller."""
        with self._lock:
            self.timed_out_total += 1

    # -- submitting

    def submit(
        self,
        fn: Callable[..., T],
        *args: Any,
        deadline: float,
        label: str = "",
        job: Job[T] | None = None,
    ) -> Job[T]:
        """
        Start C{fn(*args)} on a daemon thread. The returned job's future carries the result
        or the exception.

        @param job: a job made by the caller (to hand it to C{fn} before it starts).
        @raise PoolSaturated: C{max_threads} calls are alive already.
        """
        if job is None:
            job = Job(label or getattr(fn, "__name__", "call"), deadline, self._clock)
        if self.synchronous:
            self._execute(job, fn, args)
            return job
        with self._lock:
            if len(self._alive) >= self.max_threads:
                stuck = sum(1 for j in self._alive if j.stuck)
                raise PoolSaturated(
                    f"{len(self._alive)} calls into the {self.name} library are still running "
                    f"({stuck} past their deadline); not starting {job.label} until they return"
                )
            self._alive.add(job)
            if self._idle:
                self._idle.pop().put((job, fn, args))
                return job
            self._counter += 1
            number = self._counter
        inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        inbox.put((job, fn, args))
        thread = threading.Thread(
            target=self._work, args=(inbox,), name=f"{self.name}-{number}", daemon=True
        )
        try:
            thread.start()
        except BaseException:
            with self._lock:
                self._alive.discard(job)
            raise
        self.threads_started += 1
        return job

    def _work(self, inbox: queue.SimpleQueue[Any]) -> None:
        """A worker: run what arrives on C{inbox}, then wait there again (C{None} ends it)."""
        while True:
            item = inbox.get()
            if item is None:
                return
            job, fn, args = item
            try:
                self._execute(job, fn, args)
            finally:
                with self._lock:
                    self._alive.discard(job)
                    keep = not self._closed
                    if keep:
                        self._idle.append(inbox)
            if not keep:
                return

    def close(self) -> None:
        """End the idle workers (busy ones, hung ones included, end when their job returns)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)

    @staticmethod
    def _execute(job: Job[T], fn: Callable[..., T], args: tuple[Any, ...]) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            job.future.set_exception(e)
        else:
            job.future.set_result(result)


def run_deferred(
    reactor: Any,
    pool: WatchdogPool,
    fn: Callable[..., T],
    *args: Any,
    deadline: float,
    label: str = "",
) -> Deferred[T]:
    """
    Run C{fn(*args)} on C{pool}; fire on the reactor thread with its result, or fail with
    L{CallTimedOut} once C{deadline} seconds pass (the call itself is left to finish or hang
    on its own thread), or with L{PoolSaturated}.
    """
    try:
        job = pool.submit(fn, *args, deadline=deadline, label=label)
    except PoolSaturated as e:
        return fail(e)
    if job.future.done():  # synchronous pool
        exc = job.future.exception()
        return fail(exc) if exc is not None else succeed(job.future.result())
    timer: Any = None

    def cancel(_: Deferred[T]) -> None:
        # The caller gives up (e.g. at shutdown); the call itself goes on on its thread.
        if timer is not None and timer.active():
            timer.cancel()

    d: Deferred[T] = Deferred(cancel)

    def timed_out() -> None:
        if not d.called:
            pool.note_timeout()
            d.errback(Failure(CallTimedOut(f"{job.doing()} did not return within {deadline:g} s")))

    timer = reactor.callLater(deadline, timed_out)

    def fire(f: Future[T]) -> None:
        if d.called:
            return
        if timer.active():
            timer.cancel()
        exc = f.exception()
        if exc is not None:
            d.errback(Failure(exc))
        else:
            d.callback(f.result())

    job.future.add_done_callback(lambda f: reactor.callFromThread(fire, f))
    return d
