"""
The C{llmport-agent} console script.

  llmport-agent [run] [options]   run the agent in the foreground (same service as twistd)
  llmport-agent demo              stand-in backend + agent on loopback, end to end, then exit
  llmport-agent devbackend        run the local stand-in backend
  llmport-agent config            show the resolved configuration (secrets masked)
  llmport-agent start|stop|status install/remove/inspect the systemd unit
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import Any

from llmport_agent import VERSION
from llmport_agent.config import SETTINGS, AgentConfig, ConfigError, display_value, load_config

EX_USAGE = 2
UNIT_NAME = "llmport-agent.service"
UNIT_PATH = "/etc/systemd/system/" + UNIT_NAME
ENV_FILE = "/etc/llmport-agent.env"


def _add_setting_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("configuration (each also settable as LLM_PORT_NODE_AGENT_*)")
    for s in SETTINGS:
        group.add_argument(f"--{s.option}", dest=s.attr, default=None, metavar="VALUE",
                           help=f"{s.help} [{s.env}]")


def _config_from(args: argparse.Namespace) -> AgentConfig:
    overrides = {s.attr: getattr(args, s.attr, None) for s in SETTINGS}
    return load_config(overrides=overrides)


def run_agent(config: AgentConfig, json_logs: bool = False) -> int:
    """Run the agent in the foreground until SIGTERM/SIGINT. Returns the exit status."""
    from twisted.internet import reactor

    from llmport_agent.logsetup import begin_logging
    from llmport_agent.service import AgentService

    begin_logging(config.log_level, json=json_logs)
    status = {"code": 0}

    def fatal(code: int, message: str) -> None:
        status["code"] = code
        reactor.callLater(0, reactor.stop)  # type: ignore[attr-defined]

    agent = AgentService(reactor, config, fatal=fatal)
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


def _systemctl(*args: str) -> int:
    if shutil.which("systemctl") is None:
        print("systemctl not found: this command needs systemd", file=sys.stderr)
        return 1
    return subprocess.call(["systemctl", *args])


def _unit_text() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (
        os.path.join(here, "data", UNIT_NAME),
        os.path.join(os.path.dirname(here), "deploy", "systemd", UNIT_NAME),
    ):
        if os.path.exists(candidate):
            with open(candidate) as f:
                text = f.read()
            break
    else:
        raise FileNotFoundError(UNIT_NAME)
    twistd = shutil.which("twistd") or os.path.join(os.path.dirname(sys.executable), "twistd")
    return text.replace("/usr/local/bin/twistd", twistd)


def _start() -> int:
    if os.geteuid() != 0:
        print("installing the systemd unit needs root (sudo llmport-agent start)", file=sys.stderr)
        return 1
    with open(UNIT_PATH, "w") as f:
        f.write(_unit_text())
    if not os.path.exists(ENV_FILE):
        lines = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("LLM_PORT_NODE_AGENT_")]
        fd = os.open(ENV_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + ("\n" if lines else ""))
        print(f"wrote {ENV_FILE} (mode 0600) from the current LLM_PORT_NODE_AGENT_* variables")
    rc = _systemctl("daemon-reload") or _systemctl("enable", "--now", UNIT_NAME)
    if rc == 0:
        print(f"{UNIT_NAME} installed and started")
    return rc


def _stop() -> int:
    rc = _systemctl("disable", "--now", UNIT_NAME)
    if rc == 0 and os.path.exists(UNIT_PATH) and os.geteuid() == 0:
        os.unlink(UNIT_PATH)
        _systemctl("daemon-reload")
        print(f"{UNIT_NAME} stopped and removed (state and {ENV_FILE} kept)")
    return rc


def _status(config: AgentConfig) -> int:
    from llmport_agent.state import load_state, resolve_state_path

    path, _ = resolve_state_path(config.state_path)
    result = load_state(path) if os.path.exists(path) else None
    data = result.data if result else {}
    print(f"state file:   {path} ({'present' if result else 'absent'})")
    print(f"enrolled:     {'yes' if data.get('credential') else 'no'}")
    print(f"node id:      {data.get('node_id', '-')}")
    print(f"maintenance:  {bool(data.get('maintenance'))}  draining: {bool(data.get('draining'))}")
    if shutil.which("systemctl"):
        subprocess.call(["systemctl", "--no-pager", "status", UNIT_NAME])
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
    p_run.add_argument("--json-logs", action="store_true", help="log JSON lines instead of text")
    _add_setting_options(p_run)
    p_cfg = sub.add_parser("config", help="show the resolved configuration (secrets masked)")
    p_cfg.add_argument("action", nargs="?", default="show", choices=["show"])
    p_cfg.add_argument("--json", action="store_true")
    _add_setting_options(p_cfg)
    sub.add_parser("start", help="install and start the systemd unit")
    sub.add_parser("stop", help="stop and remove the systemd unit")
    p_status = sub.add_parser("status", help="show enrollment and service status")
    _add_setting_options(p_status)
    sub.add_parser("demo", help="run the end-to-end demo against the stand-in backend")
    sub.add_parser("devbackend", help="run the local stand-in backend")
    args = parser.parse_args(argv)
    if args.command not in commands:
        parser.print_help()
        return EX_USAGE
    try:
        if args.command == "start":
            return _start()
        if args.command == "stop":
            return _stop()
        config = _config_from(args)
    except ConfigError as e:
        print(f"llmport-agent: configuration error: {e}", file=sys.stderr)
        return EX_USAGE
    if args.command == "config":
        return _show_config(config, args.json)
    if args.command == "status":
        return _status(config)
    return run_agent(config, json_logs=getattr(args, "json_logs", False))


def entry() -> Any:  # pragma: no cover
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
