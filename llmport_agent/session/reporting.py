"""
Heartbeat and inventory reports (protocol 5.2, 5.3).

Both go out right after every connect; then the heartbeat every C{HEARTBEAT_INTERVAL_SEC} (and at
once when a field changes, see L{HeartbeatReporter.notify_changed}) and the inventory every
C{INVENTORY_INTERVAL_SEC}. The heartbeat's loop is also the connection's keep-alive tick
(L{llmport_agent.session.keepalive}): it ticks at least every C{KEEPALIVE_MAX_SEC}, a longer
heartbeat interval going out every n-th tick. Collection (psutil, NVML) runs off the reactor thread
in the inventory collector; an iteration never overlaps the previous one, and one still running
at a later tick after C{INVENTORY_TIMEOUT} (a hung NVML call, a stuck mount) is abandoned there,
so it cannot stop the loop. That check rides the loop's own tick: no timeout timer per round
(a cancelled timer stays in the reactor's heap and wakes it at its time all the same).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from llmport_agent.session.keepalive import KEEPALIVE_MAX_SEC

INVENTORY_TIMEOUT = 30.0


class _PerConnectionLoop(Service):
    """A loop that runs while the backend session is open: started at connect, stopped at close."""

    _reactor: Any
    interval: float
    _loop: LoopingCall | None = None

    def _tick(self) -> Any:
        raise NotImplementedError

    def _period(self) -> float:
        """Seconds between two ticks of the loop."""
        return self.interval

    def _start_loop(self) -> None:
        self._stop_loop()
        self._loop = LoopingCall(self._tick)
        self._loop.clock = self._reactor
        self._loop.start(self._period(), now=True)

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
    """
    Sends heartbeats: right after every connect, every C{interval}, and as soon as a field
    changes (L{notify_changed}). Lateness of each tick is recorded for benchmarks and
    diagnostics.

    Anything that changes what a heartbeat says (engine availability, node modes, GPU
    health, capabilities) calls L{notify_changed}; the reporter rebuilds the heartbeat and
    sends it when it differs from the last one sent on this connection, at most one such
    heartbeat per C{min_change_gap} seconds (a burst of changes becomes one frame; the last
    state always goes out).

    The loop is the connection's keep-alive tick too: C{on_tick} (the session's
    C{keepalive_tick}) runs first in each tick, so its ping leaves in the same reactor turn and
    write as the heartbeat. The loop ticks every C{interval / n}, n the smallest whole number
    that makes it at most C{tick_max}, and sends the heartbeat every n-th tick; nothing a tick
    calls can stop the loop.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        session: Any,
        interval: float,
        build: Callable[[], dict[str, Any]],
        *,
        min_change_gap: float = 1.0,
        on_lateness: Callable[[float], None] | None = None,
        on_tick: Callable[[], None] | None = None,
        tick_max: float = KEEPALIVE_MAX_SEC,
    ) -> None:
        self.setName("heartbeat")
        #: Called first in each tick of the loop (the session's keep-alive).
        self.on_tick = on_tick
        #: Ticks per heartbeat (the loop ticks at least every C{tick_max}).
        self.ticks_per_beat = max(1, math.ceil(interval / tick_max - 1e-9)) if tick_max > 0 else 1
        self._ticks = 0
        #: Told how late each tick ran (the reactor lateness probe measures these wake-ups).
        self.on_lateness = on_lateness
        self._reactor = reactor
        self.session = session
        self.interval = interval
        self.min_change_gap = min_change_gap
        self._build = build
        self._expected: float | None = None
        self._last_fields: dict[str, Any] | None = None
        self._last_sent_at: float | None = None
        self._change_call: Any = None
        self.sent = 0
        self.sent_on_change = 0
        #: Wall-clock time of the last heartbeat sent (status, ops endpoint).
        self.last_sent_at: float | None = None
        self.lateness: list[float] = []

    def session_opened(self) -> None:
        self._expected = None
        self._last_fields = None
        self._ticks = 0
        self._start_loop()

    def _period(self) -> float:
        return self.interval / self.ticks_per_beat

    def session_closed(self) -> None:
        self._cancel_change()
        self._last_fields = None
        super().session_closed()

    def _fields(self) -> dict[str, Any] | None:
        try:
            return dict(self._build())
        except Exception:
            self.log.failure("Could not build a heartbeat")
            return None

    def _send(self, fields: dict[str, Any]) -> bool:
        ok = self.session.send({"type": "heartbeat", **fields})
        if ok:
            self.sent += 1
            self._last_fields = fields
            self._last_sent_at = self._reactor.seconds()
            self.last_sent_at = time.time()
        return ok

    def send_now(self) -> bool:
        """Send one heartbeat now, changed or not."""
        fields = self._fields()
        return fields is not None and self._send(fields)

    def notify_changed(self) -> None:
        """
        Something a heartbeat reports may have changed: send a heartbeat now if it did, or,
        within C{min_change_gap} of the last heartbeat, once that gap is over.
        """
        if self._loop is None or not self.session.connected:
            return  # not connected: the heartbeat at the next connect carries it
        if self._change_call is not None and self._change_call.active():
            return  # one is already due; it will carry the newest fields
        now = self._reactor.seconds()
        wait = 0.0 if self._last_sent_at is None else self._last_sent_at + self.min_change_gap - now
        if wait > 0 and self._fields() == self._last_fields:
            return  # nothing changed (the inventory after a heartbeat of the same tick): no timer
        if wait > 0:
            self._change_call = self._reactor.callLater(wait, self._send_if_changed)
        else:
            self._send_if_changed()

    def _send_if_changed(self) -> None:
        self._change_call = None
        fields = self._fields()
        if fields is None or fields == self._last_fields:
            return
        if self._send(fields):
            self.sent_on_change += 1

    def _cancel_change(self) -> None:
        call, self._change_call = self._change_call, None
        if call is not None and call.active():
            call.cancel()

    def _tick(self) -> None:
        # Nothing raised here may reach the LoopingCall: it would stop the heartbeat and the
        # keep-alive with it.
        try:
            self._beat()
        except Exception:
            self.log.failure("A heartbeat tick failed")

    def _beat(self) -> None:
        now = self._reactor.seconds()
        if self._expected is not None:
            late = max(0.0, now - self._expected)
            self.lateness.append(late)
            if len(self.lateness) > 1000:
                del self.lateness[:500]
            if self.on_lateness is not None:
                try:
                    self.on_lateness(late)
                except Exception:
                    self.log.failure("The lateness listener failed")
        self._expected = now + self._period()
        if self.on_tick is not None:
            try:
                self.on_tick()
            except Exception:
                self.log.failure("The keep-alive tick failed")
        beat = self._ticks % self.ticks_per_beat == 0
        self._ticks += 1
        if beat:
            self.send_now()

    def stopService(self) -> Deferred[None]:
        super().stopService()
        self._cancel_change()
        self._stop_loop()
        return succeed(None)


class InventoryReporter(_PerConnectionLoop):
    """Sends inventory frames; C{report_now()} serves C{refresh_inventory}."""

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        session: Any,
        interval: float,
        collector: Any,
        *,
        on_report: Callable[[], None] | None = None,
    ) -> None:
        self.setName("inventory")
        #: Called after each inventory sent (its collection may have changed capabilities).
        self.on_report = on_report
        self._reactor = reactor
        self.session = session
        self.interval = interval
        self.collector = collector
        self._inflight: Deferred[bool] | None = None
        self._inflight_since = 0.0
        #: Seconds the round being abandoned ran (set while it is cancelled).
        self._abandoning: float | None = None
        self.sent = 0
        self.abandoned = 0
        self.last_error: str = ""

    def _tick(self) -> None:
        # Not returned to the loop, which keeps its period: a round still running since
        # INVENTORY_TIMEOUT is abandoned here, at a tick that comes anyway; a younger one
        # (a refresh_inventory's) stands for this tick.
        self._abandon_if_hung()
        if self._inflight is None:
            self.report_now()

    def _abandon_if_hung(self, inflight: Deferred[bool] | None = None) -> None:
        """Abandon the round in flight (C{inflight}: only if it still is) once it ran
        INVENTORY_TIMEOUT."""
        current = self._inflight
        if current is None or (inflight is not None and current is not inflight):
            return
        age = self._reactor.seconds() - self._inflight_since
        if age < INVENTORY_TIMEOUT:
            return
        self._abandoning = age
        try:
            current.cancel()
        finally:
            self._abandoning = None

    def report_now(self) -> Deferred[bool]:
        """Collect and send one inventory frame. Fires True once it was sent."""
        self._abandon_if_hung()
        if self._inflight is not None:
            # Join the collection already running, then send a fresh one after it. A
            # refresh_inventory waits INVENTORY_TIMEOUT at most for a hung round (one timer,
            # only while a command waits: the idle loop abandons it at its next tick).
            prev = self._inflight
            left = INVENTORY_TIMEOUT - (self._reactor.seconds() - self._inflight_since)
            timer = self._reactor.callLater(max(0.0, left), self._abandon_if_hung, prev)

            def joined(_: object) -> Deferred[bool]:
                if timer.active():
                    timer.cancel()
                return self.report_now()

            return prev.addCallback(lambda _: None).addCallback(joined)
        d = Deferred.fromCoroutine(self._collect_and_send())
        self._inflight_since = self._reactor.seconds()

        def failed(f: Any) -> bool:
            if f.check(CancelledError) and self._abandoning is not None:
                self.abandoned += 1
                self.last_error = f"the collection did not finish in {self._abandoning:.0f} s"
                self.log.warn("Inventory collection did not finish in {seconds:.0f} s (a hung GPU or "
                              "disk reading?); abandoned, collecting again", seconds=self._abandoning)
                return False
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
            if self.on_report is not None:
                try:
                    self.on_report()
                except Exception:
                    self.log.failure("An inventory report listener failed")
        return ok

    def stopService(self) -> Deferred[None]:
        super().stopService()
        self._stop_loop()
        inflight = self._inflight
        if inflight is not None:
            inflight.cancel()
        return succeed(None)
