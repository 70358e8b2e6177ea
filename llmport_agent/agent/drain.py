"""
How the agent stops: stop signals, the drain and the stop in reverse start order.

A stop (SIGTERM) drains first: systemd hears C{STOPPING=1}, no new command is taken, heartbeats
go on with status C{draining}, running commands get up to C{SHUTDOWN_GRACE_SEC} to reach their
result (a second SIGTERM cuts that short), queued events are flushed. Then the rest stops in
reverse order: the session closes cleanly (WebSocket close 1000), timers stop, commands still
running are cancelled (their journal entries stay, to be resolved at the next start), logs and
files are flushed, then the pools stop.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

from twisted.internet.defer import Deferred, DeferredList, succeed

if TYPE_CHECKING:
    from llmport_agent.agent.service import AgentService

#: After the drain, how long a stop waits for queued events to reach the backend.
EVENT_FLUSH_SEC = 3.0


def install_stop_signals(reactor: Any, agent: AgentService) -> None:
    """
    SIGTERM/SIGINT: the first begins a graceful stop (drain), a second ends the drain at once.
    Installed once the reactor runs (it installs its own handlers first).
    """

    def handler(signum: int, frame: Any) -> None:
        reactor.callFromThread(agent.stop_requested, signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def stop_service(agent: AgentService) -> Deferred[None]:
    agent.running = 0
    agent.stopping = True
    # A stop signal from now on ends the drain at once.
    agent._stop_signals = max(agent._stop_signals, 1)
    started = agent._started if agent._started is not None else succeed(None)
    return started.addBoth(lambda _: Deferred.fromCoroutine(agent._stop()))


def stop_requested(agent: AgentService, signum: int = signal.SIGTERM) -> None:
    """A stop signal: the first stops the reactor (which drains), a second ends the drain."""
    agent._stop_signals += 1
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = str(signum)
    if agent._stop_signals == 1:
        agent.log.info(
            "Received {signal}: stopping; running commands get up to {grace:g} s to finish "
            "(send it again to stop at once)",
            signal=name,
            grace=agent.config.shutdown_grace_sec,
        )
        from twisted.internet.error import ReactorNotRunning

        try:
            agent.reactor.stop()
        except ReactorNotRunning:
            pass
        return
    agent.log.warn("Received {signal} again: stopping now; commands still running are "
                  "checkpointed in the journal", signal=name)
    agent.force_stop()


def force_stop(agent: AgentService) -> None:
    """End the drain now (a second SIGTERM)."""
    force, agent._force_stop = agent._force_stop, None
    if force is not None and not force.called:
        force.callback(None)


async def drain(agent: AgentService) -> None:
    """Let running commands reach their result, within SHUTDOWN_GRACE_SEC; keep heartbeating."""
    grace = agent.config.shutdown_grace_sec
    started = agent.reactor.seconds()
    pipeline = agent.pipeline
    if not pipeline.running:
        return
    pipeline.begin_drain()
    busy = pipeline.busy
    agent.notify.stopping(f"stopping: draining, {busy} command(s) running")
    agent.heartbeat.send_now()
    if busy and grace > 0:
        agent.log.info("Draining: waiting up to {grace:g} s for {n} running command(s)",
                      grace=grace, n=busy)
        idle = pipeline.wait_idle()
        agent._force_stop = Deferred()
        from twisted.internet.defer import DeferredList

        first: Deferred[Any] = DeferredList([idle, agent._force_stop], fireOnOneCallback=True,
                                            consumeErrors=True)
        first.addTimeout(grace, agent.reactor)
        try:
            await first
        except Exception:
            pass
        finally:
            agent._force_stop = None
            if not idle.called:
                idle.cancel()
    left = pipeline.busy
    agent.drain_report = {"waited_sec": round(agent.reactor.seconds() - started, 3), "left": left}
    if left:
        agent.log.warn(
            "Stopping with {n} command(s) still running after {sec:.1f} s: they stay in the "
            "journal and are resolved at the next start",
            n=left,
            sec=agent.reactor.seconds() - started,
        )
    # Events of the commands that just finished (command.finished, health) reach the backend.
    if agent.session.connected and agent.outbox.depth:
        from twisted.internet.task import deferLater

        agent.outbox.flush()
        deadline = agent.reactor.seconds() + EVENT_FLUSH_SEC
        while agent.outbox.depth and agent.session.connected and agent.reactor.seconds() < deadline:
            await deferLater(agent.reactor, 0.05, lambda: None)


async def stop(agent: AgentService) -> None:
    try:
        await agent._drain()
    except Exception:
        agent.log.failure("Draining before the stop failed")
    if agent._gpu_inventory_call is not None and agent._gpu_inventory_call.active():
        agent._gpu_inventory_call.cancel()
    if agent.adoption is not None:
        agent.adoption.stop()
    agent.notify.stopping("stopping: closing the backend session")
    pools = (agent.io_pool, agent.host_pool, agent.hash_pool)
    for svc in reversed(list(agent)):
        if svc in pools or not getattr(svc, "running", False):
            continue
        await agent._stop_one(svc)
    if agent.log_observer is not None:
        from twisted.logger import globalLogPublisher

        globalLogPublisher.removeObserver(agent.log_observer)
    if agent.loki_pool is not None:
        try:
            await agent.loki_pool.closeCachedConnections()
        except Exception:
            agent.log.failure("Closing Loki connections failed")
    await agent.state.flush()
    try:
        await agent.collector.close()  # nvmlShutdown, on the host pool
    except Exception:
        agent.log.failure("Closing the GPU source failed")
    try:
        await agent.http_pool.closeCachedConnections()
    except Exception:
        agent.log.failure("Closing HTTP connections failed")
    if agent.instance_lock.held:
        try:
            await agent.io_pool.run(agent.instance_lock.release)
        except Exception:
            agent.log.failure("Releasing {path} failed", path=agent.instance_lock.path)
    for svc in reversed(pools):
        if getattr(svc, "running", False):
            await agent._stop_one(svc)
    agent.log.info("llmport-agent stopped")
    agent.notify.stopService()


async def stop_one(agent: AgentService, svc: Any) -> None:
    try:
        result = svc.stopService()
        if isinstance(result, Deferred):
            result.addTimeout(15, agent.reactor)
            await DeferredList([result], consumeErrors=True)
    except Exception:
        agent.log.failure("Stopping {name} failed", name=svc.name)
