"""
The C{llmport-agent} console script.

  llmport-agent [run] [options]   run the agent in the foreground (same service as twistd)
  llmport-agent demo              stand-in backend + agent on loopback, end to end, then exit
  llmport-agent devbackend        run the local stand-in backend
  llmport-agent config            show the resolved configuration (secrets masked)
  llmport-agent start|stop|status install and start / stop / inspect the systemd unit
  llmport-agent config --set NAME=VALUE / --unset NAME   edit /etc/llmport-agent.env
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from llmport_agent import VERSION
from llmport_agent.config import SETTINGS, AgentConfig, ConfigError, display_value, load_config

EX_USAGE = 2


def _add_setting_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("configuration (each also settable as LLM_PORT_NODE_AGENT_*)")
    for s in SETTINGS:
        group.add_argument(f"--{s.option}", dest=s.attr, default=None, metavar="VALUE",
                           help=f"{s.help} [{s.env}]")


def _config_from(args: argparse.Namespace) -> AgentConfig:
    overrides = {s.attr: getattr(args, s.attr, None) for s in SETTINGS}
    return load_config(overrides=overrides)


def run_agent(config: AgentConfig, json_logs: bool = False) -> int:
    """
    Run the agent in the foreground until SIGTERM/SIGINT (the first drains, a second stops at
    once). Returns the exit status.
    """
    from twisted.internet import reactor

    from llmport_agent.logsetup import SecretsHolder, begin_logging, want_json
    from llmport_agent.service import AgentService, install_stop_signals

    secrets = SecretsHolder()
    begin_logging(config.log_level, json=json_logs or want_json(config.log_format), secrets=secrets)
    status = {"code": 0}

    def fatal(code: int, message: str) -> None:
        status["code"] = code
        reactor.callLater(0, reactor.stop)  # type: ignore[attr-defined]

    agent = AgentService(reactor, config, fatal=fatal)
    secrets.provider = agent._secrets
    reactor.callWhenRunning(install_stop_signals, reactor, agent)  # type: ignore[attr-defined]
    reactor.callWhenRunning(agent.startService)  # type: ignore[attr-defined]
    reactor.addSystemEventTrigger("before", "shutdown", agent.stopService)  # type: ignore[attr-defined]
    reactor.run()  # type: ignore[attr-defined]
    return status["code"]


def _show_config(config: AgentConfig, as_json: bool) -> int:
    masked = config.masked()
    if as_json:
        print(json.dumps(masked, indent=2, default=str))
    else:
        width = max(len(k) for k in masked)
        for key, value in masked.items():
            print(f"{key.ljust(width)}  {display_value(value)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"run", "demo", "devbackend", "config", "start", "stop", "status"}
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv = ["run", *argv]
    if argv and argv[0] == "devbackend":
        from llmport_agent.devbackend.cli import main as devbackend_main

        return devbackend_main(argv[1:])
    if argv and argv[0] == "demo":
        from llmport_agent.demo import main as demo_main

        return demo_main(argv[1:])

    parser = argparse.ArgumentParser(prog="llmport-agent", description="llm-port node agent")
    parser.add_argument("--version", action="version", version=f"llmport-agent {VERSION}")
    sub = parser.add_subparsers(dest="command")
    p_run = sub.add_parser("run", help="run the agent in the foreground")
    p_run.add_argument("--json-logs", action="store_true",
                       help="log JSON lines (one flat object per line; the default when stdout is not a terminal)")
    _add_setting_options(p_run)
    p_cfg = sub.add_parser("config", help="show the resolved configuration (secrets masked)")
    p_cfg.add_argument("action", nargs="?", default="show", choices=["show"])
    p_cfg.add_argument("--json", action="store_true")
    p_cfg.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                       help="set a variable in /etc/llmport-agent.env (validated; repeatable)")
    p_cfg.add_argument("--unset", action="append", default=[], metavar="NAME",
                       help="remove a variable from /etc/llmport-agent.env (repeatable)")
    _add_setting_options(p_cfg)
    p_start = sub.add_parser("start", help="install (or update) and start the systemd unit (root)")
    p_start.add_argument("--user", default=None, metavar="NAME",
                         help="run as this dedicated user (in the docker group) instead of root")
    sub.add_parser("stop", help="stop and disable the systemd unit (root)")
    p_status = sub.add_parser("status", help="show enrollment and service status")
    _add_setting_options(p_status)
    sub.add_parser("demo", help="run the end-to-end demo against the stand-in backend")
    sub.add_parser("devbackend", help="run the local stand-in backend")
    args = parser.parse_args(argv)
    if args.command not in commands:
        parser.print_help()
        return EX_USAGE
    from llmport_agent.installer import Installer

    if args.command == "start":
        return Installer().start(user=args.user)
    if args.command == "stop":
        return Installer().stop()
    if args.command == "config" and (args.set or args.unset):
        return Installer().edit_config(args.set, args.unset)
    try:
        config = _config_from(args)
    except ConfigError as e:
        print(f"llmport-agent: configuration error: {e}", file=sys.stderr)
        return EX_USAGE
    if args.command == "config":
        return _show_config(config, args.json)
    if args.command == "status":
        return Installer().status(config)
    return run_agent(config, json_logs=getattr(args, "json_logs", False))


def entry() -> Any:  # pragma: no cover
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
