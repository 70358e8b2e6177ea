# -*- test-case-name: tests.test_gpu_health -*-
"""
L{GPUHealthMonitor}: the service that keeps GPU verdicts current.

 - B{Events.} With a source that has them (NVML), a loop waits for driver events
   (C{wait_events}) on the source's own watchdog threads, a short timeout at a time, and
   goes around again at once: an Xid reaches the tracker within milliseconds. One wait
   goes around C{wait_rounds} times on its thread before it comes back empty (about 30 s),
   so a quiet GPU host does not wake the reactor twice a second; a stop ends it within one
   short timeout. Each wait
   takes at most C{max_batch} events, and the reactor gets control back between two waits,
   so a burst of thousands is worked off in bounded steps without stalling anything.
 - B{Checks.} Every C{interval} seconds (and at once when an event asks for it) the
   source reads its health figures (C{check_health}) through the blocking runner. While the
   source cannot be used (no NVML library or driver: C{failing}), the next check waits for
   the source's own next initialisation attempt (C{retry_in}: backing off to 30 minutes)
   instead of waking every C{interval} for nothing.
 - B{No library, no waits.} A wait that finds NVML unusable (C{unavailable}) is not
   repeated: the first check that initialises NVML starts the waits again.
 - B{Transitions.} Verdict changes are drained from the tracker on the reactor thread and
   handed to C{on_transition} (events, heartbeat, inventory), logged once each.
 - B{Stopping.} C{stopService} stops the loop and waits for the wait in flight to return
   (it does within its timeout unless the driver hangs); a wait that hangs past that is
   left on its daemon thread and the stop goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmport_agent.core.threads import BlockingRunner
from llmport_agent.inventory.gpu import GPUSource
from llmport_agent.inventory.health import HEALTHY, Transition
from llmport_agent.inventory.watchdog import CallTimedOut, PoolSaturated, WatchdogPool, run_deferred

__all__ = ["GPUHealthMonitor"]


class GPUHealthMonitor(Service):
    """
    @param source: the GPU source (its C{tracker} holds the verdicts).
    @param runner: runs C{check_health} off the reactor thread.
    @param interval: seconds between health checks.
    @param wait_timeout_ms: how long one event wait may block (also bounds the stop).
    @param wait_rounds: short waits one call makes on its thread before it returns empty.
    @param max_batch: the most events taken per wait.
    @param on_transition: called on the reactor thread for every verdict change.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        source: GPUSource,
        runner: BlockingRunner,
        *,
        interval: float = 10.0,
        wait_timeout_ms: int = 500,
        wait_rounds: int = 60,
        max_batch: int = 100,
        on_transition: Callable[[Transition], None] | None = None,
    ) -> None:
        self.setName("gpu-health")
        self._reactor = reactor
        self.source = source
        self._runner = runner
        self.interval = interval
        self.wait_timeout_ms = wait_timeout_ms
        self.wait_rounds = max(1, wait_rounds)
        #: Set at stop: the wait in flight returns after its current short wait.
        self._stopping = threading.Event()
        self.max_batch = max(1, max_batch)
        self.on_transition = on_transition
        self._check_call: Any = None
        self._next: Any = None
        self._waiting: Deferred[Any] | None = None
        self._checking: Deferred[Any] | None = None
        self._check_again = False
        self._stop_waiters: list[Deferred[None]] = []
        self._wait_delay = 1.0
        self._wait_started = 0.0
        self._wait_error = ""
        self._events_state = ""
        #: Counters for diagnostics, metrics and benchmarks.
        self.events_handled = 0
        self.event_batches = 0
        self.largest_batch = 0
        self.checks = 0
        self.transitions_seen = 0

    # -- what the rest of the agent reads

    @property
    def events_enabled(self) -> bool:
        return callable(getattr(self.source, "wait_events", None))

    def status_reasons(self) -> list[str]:
        """One line per GPU that is not healthy (for the heartbeat); empty when all are."""
        out: list[str] = []
        tracker = getattr(self.source, "tracker", None)
        for index, h in sorted(self.source.health().items()):
            if h.state == HEALTHY:
                continue
            ident = tracker.identity(index) if tracker is not None else {}
            who = f"GPU {index}" + (f" ({ident['uuid']})" if ident.get("uuid") else "")
            out.append(f"{who} {h.state}: {'; '.join(h.reasons)}")
        return out

    def metrics(self) -> dict[str, Any]:
        """
        A small, stable view for /metrics and diagnostics: C{devices} (index, uuid, name,
        state, xid_total, xid_counts, unresponsive) and loop counters.
        """
        tracker = getattr(self.source, "tracker", None)
        devices = []
        for index, h in sorted(self.source.health().items()):
            ident = tracker.identity(index) if tracker is not None else {}
            devices.append(
                {
                    "index": index,
                    "uuid": str(ident.get("uuid", "")),
                    "name": str(ident.get("name", "")),
                    "state": h.state,
                    "reasons": list(h.reasons),
                    "xid_total": h.xid_total,
                    "xid_counts": dict(h.xid_counts),
                    "unresponsive": h.unresponsive,
                }
            )
        pool = getattr(self.source, "pool", None)
        return {
            "vendor": self.source.vendor,
            "devices": devices,
            "events_handled": self.events_handled,
            "event_batches": self.event_batches,
            "largest_batch": self.largest_batch,
            "checks": self.checks,
            "transitions": self.transitions_seen,
            "events": self._events_state or ("off" if not self.events_enabled else "starting"),
            "event_error": self._wait_error,
            "calls_timed_out": getattr(pool, "timed_out_total", 0),
            "calls_hung_now": len(pool.stuck_jobs()) if isinstance(pool, WatchdogPool) else 0,
        }

    # -- lifecycle

    def startService(self) -> None:
        super().startService()
        self._stopping = threading.Event()
        tracker = getattr(self.source, "tracker", None)
        if tracker is not None and hasattr(self._reactor, "callFromThread"):
            # Verdicts also change in snapshots taken by the inventory collector.
            tracker.notify = lambda: self._reactor.callFromThread(self.drain)
        self.check_now()
        if self.events_enabled:
            self._schedule_wait(0)

    def stopService(self) -> Deferred[None]:
        super().stopService()
        self._stopping.set()
        tracker = getattr(self.source, "tracker", None)
        if tracker is not None:
            tracker.notify = None
        self._cancel_check()
        if self._next is not None and self._next.active():
            self._next.cancel()
        self._next = None
        if self._waiting is None:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._stop_waiters.append(d)
        limit = self.wait_timeout_ms / 1000.0 + 2.0

        def give_up() -> None:
            if not d.called:
                self.log.warn(
                    "The GPU event wait did not return within {limit:g} s of the stop; "
                    "leaving it on its thread",
                    limit=limit,
                )
                waiting = self._waiting
                if waiting is not None:
                    waiting.cancel()  # fires _wait_finished, which fires d
                if not d.called:
                    d.callback(None)

        timer = self._reactor.callLater(limit, give_up)
        d.addBoth(lambda r: (timer.cancel() if timer.active() else None, r)[1])
        return d

    # -- checks

    def check_now(self) -> None:
        """Run a health check now (joined with one in flight, then run once more)."""
        if not self.running:
            return
        if self._checking is not None:
            self._check_again = True
            return
        self._cancel_check()
        self._check_again = False
        d = self._runner.run(self.source.check_health)
        self._checking = d

        def done(result: object) -> None:
            self._checking = None
            self.checks += 1
            if isinstance(result, Failure):
                self.log.failure("GPU health check failed", failure=result)
            self.drain()
            if self._check_again:
                self.check_now()
                return
            self._schedule_check()
            if self._events_state == "unavailable" and not getattr(self.source, "failing", False):
                self._schedule_wait(0)  # NVML works now: listen for events again

        d.addBoth(done)

    def _schedule_check(self) -> None:
        """The next periodic check: C{interval} from now, or when the source tries again."""
        if not self.running:
            return
        delay = self.interval
        retry_in = getattr(self.source, "retry_in", None)
        if getattr(self.source, "failing", False) and isinstance(retry_in, (int, float)):
            delay = max(delay, float(retry_in))
        self._check_call = self._reactor.callLater(delay, self._check_due)

    def _check_due(self) -> None:
        self._check_call = None
        self.check_now()

    def _cancel_check(self) -> None:
        call, self._check_call = self._check_call, None
        if call is not None and call.active():
            call.cancel()

    # -- events

    def _schedule_wait(self, delay: float) -> None:
        if not self.running or self._next is not None:
            return
        self._next = self._reactor.callLater(delay, self._wait)

    def _wait(self) -> None:
        self._next = None
        if not self.running:
            return
        pool = getattr(self.source, "pool", None)
        wait: Callable[..., Any] = getattr(self.source, "wait_events")  # noqa: B009 - optional in the protocol
        rounds, stopping = self.wait_rounds, self._stopping
        if isinstance(pool, WatchdogPool):
            deadline = (
                rounds * self.wait_timeout_ms / 1000.0 + float(getattr(self.source, "call_timeout", 10.0))
            )
            d = run_deferred(
                self._reactor, pool, wait, self.wait_timeout_ms, self.max_batch, rounds, stopping,
                deadline=deadline, label="nvmlEventSetWait",
            )
        else:
            d = self._runner.run(wait, self.wait_timeout_ms, self.max_batch, rounds, stopping)
        self._waiting = d
        self._wait_started = self._reactor.seconds()
        d.addCallbacks(self._waited, self._wait_failed)
        d.addBoth(self._wait_finished)

    def _waited(self, batch: Any) -> None:
        self._wait_error = ""
        state = getattr(batch, "state", "ok")
        if state != self._events_state:
            if state == "ok" and self._events_state:
                self.log.info("Listening to GPU driver events again")
            self._events_state = state
        count = int(getattr(batch, "count", 0))
        if count:
            self.events_handled += count
            self.event_batches += 1
            self.largest_batch = max(self.largest_batch, count)
        self.drain()
        if getattr(batch, "check", False):
            self.check_now()
        if state == "unavailable":
            pass  # nothing to wait for: the check that initialises NVML starts the waits
        elif state == "unsupported":
            self._schedule_wait(300.0)  # look again later (GPUs may come back)
        elif state == "not_ready":
            self._schedule_wait(2.0)  # until the first check initialises the library
        elif getattr(batch, "lost", False):
            self._schedule_wait(1.0)
        else:
            self._wait_delay = 1.0
            timeout = self.wait_timeout_ms / 1000.0
            quick = self._reactor.seconds() - self._wait_started < timeout / 2
            # Around again at once; but a wait that came back empty long before its timeout
            # (a driver that does not block) must not turn this into a busy loop.
            self._schedule_wait(timeout if count == 0 and quick else 0)

    def _wait_failed(self, f: Failure) -> None:
        if f.check(CancelledError) and not self.running:
            return
        if f.check(CallTimedOut, PoolSaturated):
            text = f.getErrorMessage()
            delay = 30.0
        else:
            text = f"{type(f.value).__name__}: {f.getErrorMessage()}"
            delay = self._wait_delay
            self._wait_delay = min(self._wait_delay * 2, 30.0)
        if text != self._wait_error:
            self.log.warn(
                "Waiting for GPU driver events failed ({error}); retrying in {delay:g} s",
                error=text,
                delay=delay,
            )
            self._wait_error = text
        self._events_state = "failing"
        self.drain()
        self._schedule_wait(delay)

    def _wait_finished(self, result: object) -> None:
        self._waiting = None
        waiters, self._stop_waiters = self._stop_waiters, []
        for w in waiters:
            if not w.called:
                w.callback(None)

    # -- transitions

    def drain(self) -> list[Transition]:
        """Hand the transitions waiting in the tracker to C{on_transition} (reactor thread)."""
        tracker = getattr(self.source, "tracker", None)
        if tracker is None:
            return []
        transitions = tracker.drain()
        for t in transitions:
            self.transitions_seen += 1
            if t.state == HEALTHY:
                self.log.info("{what}", what=t.describe(), gpu_index=t.index, health=t.state)
            else:
                self.log.warn("{what}", what=t.describe(), gpu_index=t.index, health=t.state)
            if self.on_transition is not None:
                try:
                    self.on_transition(t)
                except Exception:
                    self.log.failure("Handling a GPU health change failed")
        return transitions
