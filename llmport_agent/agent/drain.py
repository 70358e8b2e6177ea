"""
How the agent stops: stop signals and the drain (L{Drain}), then the stop in reverse dependency
order (L{Teardown}: the session first, the pools last).

A stop (SIGTERM) drains first: systemd hears C{STOPPING=1}, no new command is taken, heartbeats
go on with status C{draining}, running commands get up to C{SHUTDOWN_GRACE_SEC} to reach their
result (a second SIGTERM cuts that short), queued events are flushed. Then the rest stops in
reverse order: the session closes cleanly (WebSocket close 1000), timers stop, commands still
running are cancelled (their journal entries stay, to be resolved at the next start), logs and
files are flushed, then the pools stop.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from attrs import field
from twisted.internet.defer import Deferred, DeferredList
from twisted.logger import Logger

from llmport_agent.core.values import define

#: After the drain, how long a stop waits for queued events to reach the backend.
EVENT_FLUSH_SEC = 3.0


def install_stop_signals(reactor: Any, stop_requested: Callable[[int], None]) -> None:
    """
    SIGTERM/SIGINT: the first begins a graceful stop (drain), a second ends the drain at once.
    Installed once the reactor runs (it installs its own handlers first).

    @param stop_requested: called in the reactor thread with the signal's number
        (L{Drain.stop_requested}).
    """

    def handler(signum: int, frame: Any) -> None:
        reactor.callFromThread(stop_requested, signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


@define(eq=False, repr=False)  # a component: identity, not value
class Drain:
    """
    Stop requests and the drain: running commands reach their result within the grace while
    heartbeats say C{draining}; a second request ends the drain at once.

    @ivar reactor: the reactor (its clock; C{stop()} on a first stop signal).
    @ivar grace: C{SHUTDOWN_GRACE_SEC}.
    @ivar pipeline: the command pipeline (C{begin_drain}, C{busy}, C{wait_idle}).
    @ivar notify: systemd's notifier (C{STOPPING=1} with a status line).
    @ivar heartbeat: the heartbeat reporter (one C{draining} heartbeat at once).
    @ivar session: the backend session (C{connected}).
    @ivar outbox: the event outbox, flushed after the drain.
    @ivar log: where the stop is said.
    @ivar stopping: True from the first stop request on (heartbeats say C{draining}).
    @ivar report: what the last drain did: seconds waited, commands left running.
    """

    reactor: Any
    grace: float
    pipeline: Any
    notify: Any
    heartbeat: Any
    session: Any
    outbox: Any
    log: Logger
    stopping: bool = field(default=False, init=False)
    report: dict[str, Any] = field(factory=dict, init=False)
    _signals: int = field(default=0, init=False)
    _force: Deferred[None] | None = field(default=None, init=False)

    def begin(self) -> None:
        """The stop has begun (the services stop): a stop signal from now on ends the drain."""
        self.stopping = True
        self._signals = max(self._signals, 1)

    def stop_requested(self, signum: int = signal.SIGTERM) -> None:
        """A stop signal: the first stops the reactor (which drains), a second ends the drain."""
        self._signals += 1
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = str(signum)
        if self._signals == 1:
            self.log.info(
                "Received {signal}: stopping; running commands get up to {grace:g} s to finish "
                "(send it again to stop at once)",
                signal=name,
                grace=self.grace,
            )
            from twisted.internet.error import ReactorNotRunning

            try:
                self.reactor.stop()
            except ReactorNotRunning:
                pass
            return
        self.log.warn("Received {signal} again: stopping now; commands still running are "
                      "checkpointed in the journal", signal=name)
        self.force_stop()

    def force_stop(self) -> None:
        """End the drain now (a second SIGTERM)."""
        force, self._force = self._force, None
        if force is not None and not force.called:
            force.callback(None)

    async def drain(self) -> None:
        """Let running commands reach their result, within the grace; keep heartbeating."""
        grace = self.grace
        clock = self.reactor
        started = clock.seconds()
        pipeline = self.pipeline
        if not pipeline.running:
            return
        pipeline.begin_drain()
        busy = pipeline.busy
        self.notify.stopping(f"stopping: draining, {busy} command(s) running")
        self.heartbeat.send_now()
        if busy and grace > 0:
            self.log.info("Draining: waiting up to {grace:g} s for {n} running command(s)",
                          grace=grace, n=busy)
            idle = pipeline.wait_idle()
            self._force = Deferred()
            first: Deferred[Any] = DeferredList([idle, self._force], fireOnOneCallback=True,
                                                consumeErrors=True)
            first.addTimeout(grace, clock)
            try:
                await first
            except Exception:
                pass
            finally:
                self._force = None
                if not idle.called:
                    idle.cancel()
        left = pipeline.busy
        self.report = {"waited_sec": round(clock.seconds() - started, 3), "left": left}
        if left:
            self.log.warn(
                "Stopping with {n} command(s) still running after {sec:.1f} s: they stay in the "
                "journal and are resolved at the next start",
                n=left,
                sec=clock.seconds() - started,
            )
        # Events of the commands that just finished (command.finished, health) reach the backend.
        if self.session.connected and self.outbox.depth:
            from twisted.internet.task import deferLater

            self.outbox.flush()
            deadline = clock.seconds() + EVENT_FLUSH_SEC
            while self.outbox.depth and self.session.connected and clock.seconds() < deadline:
                await deferLater(clock, 0.05, lambda: None)


@define(eq=False, repr=False)  # a component: identity, not value
class Teardown:
    """
    The stop after the drain: every running service in reverse order (each bounded), the
    log observer removed, connections closed, the state flushed, the instance lock released,
    the pools last; systemd's notifier stops at the very end.

    @ivar reactor: the clock that bounds each service's stop.
    @ivar drain: the drain, run first.
    @ivar services: the agent's services in their order (the pools, then the rest; the session
        last): they stop in the reverse of it, the session first. Not their start order: the
        session starts first (L{llmport_agent.agent.startup.Startup}).
    @ivar pools: the thread pools, stopped last.
    @ivar cancel_timers: cancels the agent's own pending calls.
    @ivar adoption: the adoption of the original agent's workloads, or C{None}.
    @ivar notify: systemd's notifier.
    @ivar log_observer: the log shipping observer now, if any.
    @ivar loki_pool: the Loki connection pool now, if any.
    @ivar state: the state store (flushed).
    @ivar collector: the inventory collector (closes the GPU source).
    @ivar http_pool: the backend's connection pool.
    @ivar instance_lock: released after the state is flushed.
    @ivar io_pool: the pool the lock is released on.
    @ivar log: where the stop is said.
    """

    reactor: Any
    drain: Drain
    services: Iterable[Any]
    pools: Sequence[Any]
    cancel_timers: Callable[[], None]
    adoption: Any
    notify: Any
    log_observer: Callable[[], Any]
    loki_pool: Callable[[], Any]
    state: Any
    collector: Any
    http_pool: Any
    instance_lock: Any
    io_pool: Any
    log: Logger

    async def stop(self) -> None:
        """Drain, then stop everything in reverse order."""
        try:
            await self.drain.drain()
        except Exception:
            self.log.failure("Draining before the stop failed")
        self.cancel_timers()
        if self.adoption is not None:
            self.adoption.stop()
        self.notify.stopping("stopping: closing the backend session")
        pools = tuple(self.pools)
        for svc in reversed(list(self.services)):
            if svc in pools or not getattr(svc, "running", False):
                continue
            await self.stop_one(svc)
        observer = self.log_observer()
        if observer is not None:
            from twisted.logger import globalLogPublisher

            globalLogPublisher.removeObserver(observer)
        loki_pool = self.loki_pool()
        if loki_pool is not None:
            try:
                await loki_pool.closeCachedConnections()
            except Exception:
                self.log.failure("Closing Loki connections failed")
        await self.state.flush()
        try:
            await self.collector.close()  # nvmlShutdown, on the host pool
        except Exception:
            self.log.failure("Closing the GPU source failed")
        try:
            await self.http_pool.closeCachedConnections()
        except Exception:
            self.log.failure("Closing HTTP connections failed")
        if self.instance_lock.held:
            try:
                await self.io_pool.run(self.instance_lock.release)
            except Exception:
                self.log.failure("Releasing {path} failed", path=self.instance_lock.path)
        for svc in reversed(pools):
            if getattr(svc, "running", False):
                await self.stop_one(svc)
        self.log.info("llmport-agent stopped")
        self.notify.stopService()

    async def stop_one(self, svc: Any) -> None:
        """Stop one service, waiting at most 15 s for it; a failure is logged, not raised."""
        try:
            result = svc.stopService()
            if isinstance(result, Deferred):
                result.addTimeout(15, self.reactor)
                await DeferredList([result], consumeErrors=True)
        except Exception:
            self.log.failure("Stopping {name} failed", name=svc.name)
