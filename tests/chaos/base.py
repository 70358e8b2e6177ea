"""The chaos tests' base: an agent in-process behind a L{ChaosProxy}, failures naming the seed."""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor
from twisted.logger import Logger

from tests.agentharness import AgentTestCase
from tests.chaos.invariants import LINK_ANOMALIES, CommandTally
from tests.chaos.scenarios import ChaosRun
from tests.support.chaosproxy import ChaosProxy

_log = Logger()


class ChaosTestCase(AgentTestCase):
    timeout = 120

    def allow_link_anomalies(self, extra: tuple[str, ...] = ()) -> None:
        """
        Declare to the shared zero-anomaly teardown (where it exists) what a damaged link
        provokes on purpose; L{tests.chaos.invariants.check_commands} checks the rest itself.
        """
        allow = getattr(self, "allow_anomalies", None)
        if allow is None:
            return
        for pattern in LINK_ANOMALIES + extra:
            allow(pattern, "the chaos proxy damages frames on purpose")
        # A repeat in the documented window is checked per command by check_commands.
        allow(r"^second command_result for ", "repeats in the documented window are checked by check_commands")

    async def proxy_to(self, port: int) -> ChaosProxy:
        proxy = ChaosProxy(reactor, port)
        await proxy.start()
        self.addCleanup(proxy.stop)
        return proxy

    def assertInvariants(self, tally: CommandTally, run: ChaosRun, proxy: ChaosProxy | None,
                         extra: list[str] | None = None) -> None:
        problems = run.stuck + tally.problems + (extra or [])
        if problems:
            self.fail(
                f"chaos invariants broken ({run.describe(proxy)}; {tally.line()}):\n  "
                + "\n  ".join(problems[:20])
            )
        self.assertEqual(tally.resolved, tally.issued)
        _log.info("chaos: {tally}; {run}", tally=tally.line(), run=run.describe(proxy))

    @staticmethod
    def proxied(proxy: ChaosProxy) -> str:
        return f"http://127.0.0.1:{proxy.listening_port}"

    @staticmethod
    def reactor() -> Any:
        return reactor
