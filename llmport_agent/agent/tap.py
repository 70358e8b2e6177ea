"""
The twistd plugin's options and service maker: C{twistd -n llmport-agent [options]}.

Every configuration variable has a command-line option of the same meaning (e.g.
C{--backend-url} for C{LLM_PORT_NODE_AGENT_BACKEND_URL}); options win over the environment.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from twisted.python import usage

from llmport_agent.core.config import SETTINGS, AgentConfig, ConfigError, load_config


class Options(usage.Options):
    synopsis = "[options]"
    longdesc = "Runs the llm-port node agent. Every option can also be set with its LLM_PORT_NODE_AGENT_* variable."
    optParameters = [[s.option, None, None, f"{s.help} [{s.env}]"] for s in SETTINGS]

    config: AgentConfig

    def postOptions(self) -> None:
        overrides = {s.attr: self[s.option] for s in SETTINGS}
        try:
            self.config = load_config(overrides=overrides)
        except ConfigError as e:
            # One line and exit 2, as under `llmport-agent run` (twistd would print its whole
            # usage and exit 1, and the unit's RestartPreventExitStatus=2 would never apply).
            print(f"llmport-agent: configuration error: {e}", file=sys.stderr)
            raise SystemExit(2) from None


def makeService(options: Options) -> Any:
    from twisted.internet import reactor

    from llmport_agent.agent.drain import install_stop_signals
    from llmport_agent.agent.service import AgentService
    from llmport_agent.core.twistedapi import forget_exit_signal
    from llmport_agent.host.fdlimit import raise_open_files_limit

    raise_open_files_limit()

    def fatal(status: int, message: str) -> None:
        # twistd has no exit status of its own: stop cleanly, then leave with ours.
        reactor.addSystemEventTrigger("after", "shutdown", os._exit, status)
        reactor.callLater(0, reactor.stop)

    def clean_exit() -> None:
        # twistd re-raises SIGTERM/SIGINT at exit (status -15/-2); a clean stop of the agent
        # exits 0 instead, as `llmport-agent run` does.
        forget_exit_signal(reactor, (signal.SIGTERM, signal.SIGINT))

    reactor.addSystemEventTrigger("after", "shutdown", clean_exit)
    agent = AgentService(reactor, options.config, fatal=fatal)
    # SIGTERM drains (running commands finish within SHUTDOWN_GRACE_SEC); a second one forces.
    reactor.callWhenRunning(install_stop_signals, reactor, agent.drain.stop_requested)
    return agent
