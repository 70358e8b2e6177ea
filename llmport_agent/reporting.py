"""
Heartbeat and inventory reports (protocol 5.2, 5.3).

Both go out right after every connect; then the heartbeat every C{HEARTBEAT_INTERVAL_SEC} and the
inventory every C{INVENTORY_INTERVAL_SEC}. Collection (psutil, NVML) runs off the reactor thread
in the inventory collector; an iteration never overlaps the previous one and is bounded by a
timeout, so a hung NVML call cannot stop the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

INVENTORY_TIMEOUT = 30.0


class _PerConnectionLoop(Service):
    """A loop that runs while the backend session is open: started at connect, stopped at close."""

    _reactor: Any
    interval: float
    _loop: LoopingCall | None = None

    def _tick(self) -> Any:
        raise NotImplementedError

    def _start_loop(self) -> None:
        self._stop_loop()
        self._loop = LoopingCall(self._tick)
        self._loop.clock = self._reactor
        self._loop.start(self.interval, now=True)

    def _stop_loop(self) -> None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None

    def session_opened(self) -> None:
        self._start_loop()

    def session_closed(self) -> None:
        self._stop_loop()

    def frame_received(self, frame: dict[str, Any]) -> None:
        pass


class HeartbeatReporter(_PerConnectionLoop):
    """Sends heartbeats; lateness of each tick is recorded for benchmarks and diagnostics."""

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        session: Any,
        interval: float,
        build: Callable[[], dict[str, Any]],
    ) -> None:
        self.setName("heartbeat")
        self._reactor = reactor
        self.session = session
        self.interval = interval
        self._build = build
        self._expected: float | None = None
        self.sent = 0
        #: Wall-clock time of the last heartbeat sent (status, ops endpoint).
        self.last_sent_at: float | None = None
        self.lateness: list[float] = []

    def session_opened(self) -> None:
        self._expected = None
        self._start_loop()

    def send_now(self) -> bool:
        """Send one heartbeat now (e.g. after a mode change)."""
        try:
            frame = {"type": "heartbeat", **self._build()}
        except Exception:
            self.log.failure("Could not build a heartbeat")
            return False
        ok = self.session.send(frame)
        if ok:
            self.sent += 1
            import time

            self.last_sent_at = time.time()
        return ok

    def _tick(self) -> None:
        now = self._reactor.seconds()
        if self._expected is not None:
            self.lateness.append(max(0.0, now - self._expected))
            if len(self.lateness) > 1000:
                del self.lateness[:500]
        self._expected = now + self.interval
        self.send_now()

    def stopService(self) -> Deferred[None]:
        super().stopService()
        self._stop_loop()
        return succeed(None)


class InventoryReporter(_PerConnectionLoop):
    """Sends inventory frames; C{report_now()} serves C{refresh_inventory}."""

    log = Logger()

    def __init__(self, reactor: Any, session: Any, interval: float, collector: Any) -> None:
        self.setName("inventory")
        self._reactor = reactor
        self.session = session
        self.interval = interval
        self.collector = collector
        self._inflight: Deferred[bool] | None = None
        self.sent = 0
        self.last_error: str = ""

    def _tick(self) -> Deferred[None]:
        # Returned so iterations never overlap; never fails (a failure would stop the loop).
        return self.report_now().addCallback(lambda _: None)

    def report_now(self) -> Deferred[bool]:
        """Collect and send one inventory frame. Fires True once it was sent."""
        if self._inflight is not None:
            # Join the collection already running, then send a fresh one after it.
            prev = self._inflight
            return prev.addCallback(lambda _: None).addCallback(lambda _: self.report_now())
        d = Deferred.fromCoroutine(self._collect_and_send())
        d.addTimeout(INVENTORY_TIMEOUT, self._reactor)

        def failed(f: Any) -> bool:
            if f.check(CancelledError) and not self.running:
                return False
            self.last_error = f.getErrorMessage() or f.type.__name__
            self.log.failure("Inventory collection failed", failure=f)
            return False

        d.addErrback(failed)
        self._inflight = d
        out: Deferred[bool] = Deferred()

        def done(result: bool) -> bool:
            self._inflight = None
            out.callback(result)
            return result

        d.addCallback(done)
        return out

    async def _collect_and_send(self) -> bool:
        report = await self.collector.collect()
        frame = {"type": "inventory", "inventory": report.inventory, "utilization": report.utilization}
        ok = bool(self.session.send(frame))
        if ok:
            self.sent += 1
            self.last_error = ""
        return ok

    def stopService(self) -> Deferred[None]:
        super().stopService()
        self._stop_loop()
        inflight = self._inflight
        if inflight is not None:
            inflight.cancel()
        return succeed(None)
