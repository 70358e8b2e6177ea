"""
How the agent starts (the start half of L{AgentService}'s lifecycle): the pools first, the
env file check, the instance lock, durable state loaded, then every other service in order;
systemd hears C{READY=1} last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from twisted.internet.defer import Deferred, succeed

from llmport_agent import VERSION
from llmport_agent.core.config import mask_url
from llmport_agent.host.instance import AlreadyRunning

if TYPE_CHECKING:
    from llmport_agent.agent.service import AgentService


def start_service(agent: AgentService) -> None:
    # The children are started by _start, in order, once durable state is loaded.
    agent.running = 1
    agent.notify.startService()
    agent._started = Deferred.fromCoroutine(agent._start())
    agent._started.addErrback(agent._start_failed)


def start_failed(agent: AgentService, f: Any) -> None:
    from llmport_agent.core.state import StateUnreadable
    from llmport_agent.session.service import EXIT_NEEDS_OPERATOR

    if f.check(StateUnreadable):
        agent._fatal(EXIT_NEEDS_OPERATOR, f.getErrorMessage())
        return
    if f.check(OSError) and not agent.instance_lock.held:
        agent._fatal(1, f"cannot create the lock file {agent.instance_lock.path} ({f.getErrorMessage()}); "
                       "check that the state directory is writable by the agent")
        return
    agent.log.failure("The agent could not start", failure=f)
    agent._fatal(1, f"The agent could not start: {f.getErrorMessage()}")


async def start(agent: AgentService) -> None:
    if agent.state_note:
        agent.log.warn("{note}", note=agent.state_note)
    for svc in agent._ordered[:3]:
        svc.setServiceParent(agent)
    agent._check_env_file()
    try:
        await agent.io_pool.run(agent.instance_lock.acquire)
    except AlreadyRunning as e:
        # Nothing else starts: this process must not touch the state, the journal or the
        # engine that the other agent is using.
        agent._fatal(1, str(e))
        return
    from llmport_agent.core.state import TwoStates, adopt_old_state

    try:
        # One state location per user (run, start --user and join --user share it).
        moved = await agent.io_pool.run(adopt_old_state, agent.state.path)
    except TwoStates as e:
        from llmport_agent.session.service import EXIT_NEEDS_OPERATOR

        agent._fatal(EXIT_NEEDS_OPERATOR, str(e))
        return
    if moved:
        agent.log.warn("{note}", note=moved)
    await agent.state.load()
    await agent.journal.load()
    await agent.outbox.load()
    if agent.log_observer is not None:
        from twisted.logger import globalLogPublisher

        globalLogPublisher.addObserver(agent.log_observer)
    # Said before the services start, so that what they say (the session's "no credential
    # and no token", say) comes after it, not before.
    agent.log.info(
        "llmport-agent {version} started (agent id {agent_id}, backend {url}, state {path})",
        version=VERSION,
        agent_id=agent.config.agent_id,
        url=mask_url(agent.config.backend_url),
        path=agent.state.path,
    )
    for note in agent.config.notes:
        agent.log.warn("{note}", note=note)
    for svc in agent._ordered[3:]:
        svc.setServiceParent(agent)
    if agent.adoption is not None:
        agent.adoption.start()
    agent.notify.ready()


def when_started(agent: AgentService) -> Deferred[None]:
    if agent._started is None:
        return succeed(None)
    d: Deferred[None] = Deferred()

    def done(result: object) -> object:
        d.callback(None)
        return result

    agent._started.addBoth(done)
    return d
