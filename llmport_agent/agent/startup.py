"""
How the agent starts (the start half of its lifecycle), as L{Startup}: the pools first, the
env file check, the instance lock, durable state loaded, then the backend session (its
enrollment or connect goes out first), then every other service in order; systemd hears
C{READY=1} last.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from attrs import field
from twisted.application.service import IServiceCollection, Service
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.logger import Logger

from llmport_agent import VERSION
from llmport_agent.core.config import mask_url
from llmport_agent.core.values import define
from llmport_agent.host.instance import AlreadyRunning


async def _all_of(log: Logger, *loads: Deferred[Any]) -> None:
    """
    Wait for every one of C{loads}; then raise the first failure (in argument order), as
    awaiting them in turn would have raised it. The others are logged: none is left unsaid or
    unhandled.
    """
    results = await DeferredList(list(loads), consumeErrors=True)
    failures = [result for ok, result in results if not ok]
    for later in failures[1:]:
        log.failure("Loading durable state failed as well", failure=later)
    if failures:
        failures[0].raiseException()


@define(eq=False, repr=False)  # a component: identity, not value
class Startup:
    """
    Starts the agent's services in order, once durable state is loaded (L{begin}); a start
    that cannot go on ends the process through C{fatal} with a line that says why.

    @ivar parent: the service collection every started service joins (the agent).
    @ivar pools: the thread pools, started first (the state loads on them).
    @ivar services: every other service, in start order: the session first, so that its
        enrollment or connect is on its way while the others start (the stop has its own order:
        L{llmport_agent.agent.drain.Teardown}, the session first).
    @ivar config: the agent's settings (what the start line and the config notes say).
    @ivar state_note: what resolving the state path had to say ("" when nothing).
    @ivar io_pool: the pool the lock and the state files are handled on.
    @ivar instance_lock: one agent per state file, taken before the state is touched.
    @ivar state: the state store; C{journal}, C{outbox}: the command journal and event outbox.
    @ivar env_file: the env file check (L{EnvFileCheck}).
    @ivar log_observer: the log shipping observer to add once the state is loaded, if any.
    @ivar adoption: the original agent's workloads to take over, or C{None}.
    @ivar notify: systemd's notifier (C{startService}, C{ready}).
    @ivar fatal: ends the process with an exit status and one line.
    @ivar log: where the start is said.
    """

    parent: IServiceCollection
    pools: Sequence[Service]
    services: Sequence[Service]
    config: Any
    state_note: str
    io_pool: Any
    instance_lock: Any
    state: Any
    journal: Any
    outbox: Any
    env_file: Any
    log_observer: Callable[[], Any]
    adoption: Any
    notify: Any
    fatal: Callable[[int, str], None]
    log: Logger
    _started: Deferred[None] | None = field(default=None, init=False)

    @property
    def started(self) -> Deferred[None]:
        """Fires once the start is over (done or failed); at once when it never began."""
        if self._started is None:
            return succeed(None)
        d: Deferred[None] = Deferred()

        def done(result: object) -> object:
            d.callback(None)
            return result

        self._started.addBoth(done)
        return d

    def begin(self) -> None:
        """Start: systemd's notifier now, the services once durable state is loaded."""
        self.notify.startService()
        self._started = Deferred.fromCoroutine(self._start())
        self._started.addErrback(self._failed)

    def _failed(self, f: Any) -> None:
        from llmport_agent.core.state import StateUnreadable
        from llmport_agent.session.shared import EXIT_NEEDS_OPERATOR

        if f.check(StateUnreadable):
            self.fatal(EXIT_NEEDS_OPERATOR, f.getErrorMessage())
            return
        if f.check(OSError) and not self.instance_lock.held:
            self.fatal(1, f"cannot create the lock file {self.instance_lock.path} ({f.getErrorMessage()}); "
                          "check that the state directory is writable by the agent")
            return
        self.log.failure("The agent could not start", failure=f)
        self.fatal(1, f"The agent could not start: {f.getErrorMessage()}")

    async def _start(self) -> None:
        if self.state_note:
            self.log.warn("{note}", note=self.state_note)
        for svc in self.pools:
            svc.setServiceParent(self.parent)
        self.env_file.check()
        from llmport_agent.core.state import TwoStates, adopt_old_state

        def lock_then_adopt() -> str | None:
            self.instance_lock.acquire()
            # One state location per user (run, start --user and join --user share it).
            return adopt_old_state(self.state.path)

        try:
            # In one hop to the pool: the lock first, then the state's one location.
            moved = await self.io_pool.run(lock_then_adopt)
        except AlreadyRunning as e:
            # Nothing else starts: this process must not touch the state, the journal or the
            # engine that the other agent is using.
            self.fatal(1, str(e))
            return
        except TwoStates as e:
            from llmport_agent.session.shared import EXIT_NEEDS_OPERATOR

            self.fatal(EXIT_NEEDS_OPERATOR, str(e))
            return
        if moved:
            self.log.warn("{note}", note=moved)
        # The state first: an unreadable one stops the start before the journal and the outbox
        # are touched (their loads compact them). Then those two side by side on the pool
        # (each is a hop or two between the reactor and a worker).
        await self.state.load()
        await _all_of(self.log, self.journal.load(), self.outbox.load())
        observer = self.log_observer()
        if observer is not None:
            from twisted.logger import globalLogPublisher

            globalLogPublisher.addObserver(observer)
        # Said before the services start, so that what they say (the session's "no credential
        # and no token", say) comes after it, not before.
        self.log.info(
            "llmport-agent {version} started (agent id {agent_id}, backend {url}, state {path})",
            version=VERSION,
            agent_id=self.config.agent_id,
            url=mask_url(self.config.backend_url),
            path=self.state.path,
        )
        for note in self.config.notes:
            self.log.warn("{note}", note=note)
        for svc in self.services:
            svc.setServiceParent(self.parent)
        if self.adoption is not None:
            self.adoption.start()
        self.notify.ready()
