"""
The C{llmport-agent} console script.

  llmport-agent [run] [options]   run the agent in the foreground (same service as twistd)
  llmport-agent demo              stand-in backend + agent on loopback, end to end, then exit
  llmport-agent devbackend        run the local stand-in backend
  llmport-agent doctor [--json]   check this node and say what to fix (read-only)
  llmport-agent config            show the resolved configuration (secrets masked)
  llmport-agent start|stop|status install and start / stop / inspect the systemd unit
  llmport-agent join [URL] [--user] join the current llm-port with a code an administrator approves
  llmport-agent config --set NAME=VALUE / --unset NAME   edit /etc/llmport-agent.env
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

from llmport_agent import VERSION
from llmport_agent.core.config import SETTINGS, AgentConfig, ConfigError, display_value, load_config

if TYPE_CHECKING:
    import argparse

EX_USAGE = 2
#: Set once the agent's reactor ran in this process (L{leave} then ends it at once).
_AGENT_RAN = False


def _add_setting_options(parser: argparse.ArgumentParser, listed: bool = True) -> None:
    """
    One option per setting. C{listed=False}: accepted but left out of C{--help} (which then
    points at C{run --help} and the configuration reference), so a short command's own
    options are not buried under sixty settings.
    """
    import argparse

    group = parser.add_argument_group("configuration (each also settable as LLM_PORT_NODE_AGENT_*)")
    for s in SETTINGS:
        group.add_argument(f"--{s.option}", dest=s.attr, default=None, metavar="VALUE",
                           help=f"{s.help} [{s.env}]" if listed else argparse.SUPPRESS)


#: The epilog of a command whose setting options are accepted but not listed.
SETTINGS_EPILOG = ("Every setting option of `run` is accepted too (e.g. --state-path), as is its "
                   "LLM_PORT_NODE_AGENT_* variable: see `llmport-agent run --help` or the configuration "
                   "reference.")


def _config_from(args: argparse.Namespace) -> AgentConfig:
    overrides = {s.attr: getattr(args, s.attr, None) for s in SETTINGS}
    return load_config(overrides=overrides)


def run_agent(config: AgentConfig, json_logs: bool = False) -> int:
    """
    Run the agent in the foreground until SIGTERM/SIGINT (the first drains, a second stops at
    once). Returns the exit status.
    """
    from llmport_agent.core.startgc import StartGC

    # Before Twisted's and the agent's imports: they are most of the path to the first connect.
    start_gc = StartGC()
    start_gc.begin()
    from twisted.internet import reactor

    from llmport_agent.agent.drain import install_stop_signals
    from llmport_agent.agent.service import AgentService
    from llmport_agent.core.logsetup import SecretsHolder, begin_logging, choose_format
    from llmport_agent.host.fdlimit import raise_open_files_limit

    secrets = SecretsHolder()
    begin_logging(config.log_level, secrets=secrets,
                  format="json" if json_logs else choose_format(config.log_format))
    raise_open_files_limit()
    status = {"code": 0}

    def fatal(code: int, message: str) -> None:
        status["code"] = code
        reactor.callLater(0, reactor.stop)  # type: ignore[attr-defined]

    agent = AgentService(reactor, config, fatal=fatal)
    secrets.provider = agent.secrets.values
    start_gc.arm(reactor)
    agent.session.subscribe(start_gc)
    reactor.callWhenRunning(install_stop_signals, reactor, agent.drain.stop_requested)  # type: ignore[attr-defined]
    reactor.callWhenRunning(agent.startService)  # type: ignore[attr-defined]
    reactor.addSystemEventTrigger("before", "shutdown", agent.stopService)  # type: ignore[attr-defined]
    global _AGENT_RAN
    _AGENT_RAN = True
    reactor.run()  # type: ignore[attr-defined]
    return status["code"]


def join_command(url: str | None, user_mode: bool, insecure_http: bool = False, system: Any = None) -> int:
    """
    C{join}: what C{start} will need checked first (root or user mode, systemd, the executable,
    writable paths: L{Installer.preflight}), then the join dialog (L{llmport_agent.host.join}) on the
    reactor, then the same as C{start} (C{BACKEND_URL} from C{URL} written to the env file, an old
    enrollment token line dropped).

    @param insecure_http: the operator accepts plain http for C{URL} (C{--insecure-http}).
    """
    from attrs import evolve

    from llmport_agent.host.installer import Installer, System
    from llmport_agent.host.join import InsecureURL, normalise_url

    system = evolve(system or System.from_environment(), user_mode=user_mode)
    installer = Installer(system)
    if user_mode and system.geteuid() == 0:
        return system.fail("`join --user` installs a service of the user who runs it: run it as that user "
                           "(not root), or `sudo llmport-agent join URL` for a system service", EX_USAGE)
    # Before a request is filed: a node that `start` would refuse must not wait for an approval.
    problem = installer.preflight("join")
    if problem:
        return system.fail(problem)
    environ = dict(system.environ)
    try:
        file_values = installer.read_env().values()
    except OSError as e:
        return system.fail(f"cannot read {system.env_path} ({e.strerror}): run join as root (sudo)")
    prefix = "LLM_PORT_NODE_AGENT_"
    configured_url = file_values.get(prefix + "BACKEND_URL")
    merged = {**file_values, **{k: v for k, v in environ.items() if k.startswith(prefix)}}
    try:
        # Typed, or given in this shell (not the env file's): https unless said otherwise.
        given = url or merged.get(prefix + "BACKEND_URL", "")
        backend = normalise_url(given, insecure_http, (configured_url,)) if given else ""
    except InsecureURL as e:
        return system.fail(str(e), EX_USAGE)
    if not backend:
        return system.fail("where is llm-port? usage: llmport-agent join https://<backend-host>[:port]", EX_USAGE)
    if url and "://" not in url:
        system.say(f"(no scheme given: joining {backend})")
    merged[prefix + "BACKEND_URL"] = backend
    merged.pop(prefix + "ENROLLMENT_TOKEN", None)
    if user_mode:
        # The state the user service will use (~/.local/share/llmport-agent/state.json).
        merged.update({k: v for k, v in system.user_defaults(merged).items() if k.startswith(prefix)})
    try:
        config = load_config(environ=merged)
    except ConfigError as e:
        return system.fail(f"configuration error: {e}", EX_USAGE)
    state_path = system.place(config.state_path) if system.root else config.state_path
    if user_mode:
        from llmport_agent.core.state import TwoStates, adopt_old_state

        os.makedirs(os.path.dirname(state_path), mode=0o700, exist_ok=True)
        try:
            moved = adopt_old_state(state_path, dict(system.environ), system.geteuid())
        except TwoStates as e:
            return system.fail(str(e))
        if moved:
            system.say(moved)
    code = _run_join(config, state_path, system, configured_url)
    if code != 0:
        return code
    # What the service needs: the URL joined, no stale token (the credential is in the state).
    start_env = {k: v for k, v in environ.items() if k != prefix + "ENROLLMENT_TOKEN"}
    start_env[prefix + "BACKEND_URL"] = config.backend_url
    return Installer(evolve(system, environ=start_env)).start(drop=(prefix + "ENROLLMENT_TOKEN",))


def _run_join(config: AgentConfig, state_path: str, system: Any, configured_url: str | None = None) -> int:
    from twisted.internet import reactor
    from twisted.internet.defer import Deferred

    from llmport_agent.agent.service import make_http_client
    from llmport_agent.core.logsetup import begin_logging, want_json
    from llmport_agent.core.threads import PoolService
    from llmport_agent.host.join import Joiner
    from llmport_agent.inventory.collector import InventoryCollector
    from llmport_agent.inventory.select import make_gpu_source

    begin_logging(config.log_level, json=want_json(config.log_format, system.err))
    status = {"code": 1}
    pool = PoolService(reactor, "host", 1)
    http, http_pool = make_http_client(reactor, config)
    from llmport_agent.session.backend_http import BackendHTTP

    backend = BackendHTTP(reactor, http, config.backend_url, config.request_timeout_sec,
                          client_cert=config.tls_client_cert)
    collector = InventoryCollector(
        reactor, pool, make_gpu_source(config.gpu_source, call_timeout=config.gpu_call_timeout_sec,
                                       ignored_xids=config.gpu_ignored_xids),
        state_dir=os.path.dirname(os.path.abspath(state_path)), model_store=config.model_store,
    )
    joiner = Joiner(reactor, config, backend, state_path,
                    lambda: Deferred.fromCoroutine(collector.capabilities()), system.out, system.err,
                    configured_url=configured_url)

    async def main() -> None:
        pool.startService()
        try:
            status["code"] = await joiner.run()
        finally:
            await http_pool.closeCachedConnections()
            try:
                await collector.close()
            except Exception:  # noqa: BLE001 - closing NVML is best effort here
                pass
            await pool.stopService()

    def crashed(f: Any) -> None:
        system.fail(f"join failed: {f.getErrorMessage()}")

    def begin() -> None:
        d = Deferred.fromCoroutine(main()).addErrback(crashed)
        d.addBoth(lambda _: reactor.callLater(0, reactor.stop))  # type: ignore[attr-defined]

    reactor.callWhenRunning(begin)  # type: ignore[attr-defined]
    reactor.run()  # type: ignore[attr-defined]
    return status["code"]


def _user_system() -> Any:
    from attrs import evolve

    from llmport_agent.host.installer import System

    return evolve(System.from_environment(), user_mode=True)


def _show_config(config: AgentConfig, as_json: bool) -> int:
    masked = config.masked()
    if as_json:
        print(json.dumps(masked, indent=2, default=str))
    else:
        width = max(len(k) for k in masked)
        for key, value in masked.items():
            print(f"{key.ljust(width)}  {display_value(value)}")
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The main command line (run, config, start, join, stop, status); doctor, demo and devbackend
    have their own parsers (L{llmport_agent.doctor.run.build_parser}, L{llmport_agent.demo.run.build_parser},
    L{llmport_agent.devbackend.cli.build_parser}). The CLI reference in docs/ is generated from them.

    @param command: the subcommand being run: only its parser gets the setting options (some
        two hundred arguments for the three that take them, about 2.5 ms of every start).
        C{None}: every subcommand's (the whole command line, as the reference shows it).
    """

    import argparse  # here: `run` alone needs no parser (see main)

    def settings(name: str, subparser: argparse.ArgumentParser, listed: bool = True) -> None:
        if command is None or command == name:
            _add_setting_options(subparser, listed=listed)
    parser = argparse.ArgumentParser(prog="llmport-agent", description="llm-port node agent")
    parser.add_argument("--version", action="version", version=f"llmport-agent {VERSION}")
    sub = parser.add_subparsers(dest="command")
    p_run = sub.add_parser("run", help="run the agent in the foreground")
    p_run.add_argument("--json-logs", action="store_true",
                       help="log JSON lines on stdout (one flat object per line; the default when stdout is neither a "
                            "terminal nor the journal)")
    settings("run", p_run)
    p_cfg = sub.add_parser(
        "config", help="show the resolved configuration (secrets masked)",
        usage="llmport-agent config [show] [--json] [--set NAME=VALUE ...] [--unset NAME ...] [setting options]",
        description="Show the configuration resolved from the defaults, this shell's LLM_PORT_NODE_AGENT_* "
        "variables and the options, secrets masked; or edit /etc/llmport-agent.env (what the unit "
        "reads) with --set/--unset (root).",
        epilog=SETTINGS_EPILOG)
    p_cfg.add_argument("action", nargs="?", default="show", choices=["show"], metavar="show",
                       help="show the configuration (the default)")
    p_cfg.add_argument("--json", action="store_true",
                       help="one JSON object, variable name to value (unset: null)")
    p_cfg.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                       help="set a variable in /etc/llmport-agent.env (validated; repeatable)")
    p_cfg.add_argument("--unset", action="append", default=[], metavar="NAME",
                       help="remove a variable from /etc/llmport-agent.env (repeatable)")
    settings("config", p_cfg, listed=False)
    p_start = sub.add_parser(
        "start", help="install (or update) and start the systemd unit (root)",
        description="Install (or update) the llmport-agent systemd unit and /etc/llmport-agent.env from "
        "the LLM_PORT_NODE_AGENT_* variables given, enable it and start (or restart) it; an upgrade "
        "whose new build does not come up is rolled back. Needs root, or --user for a service of your "
        "own user.")
    p_start.add_argument("--user", nargs="?", const=True, default=None, metavar="NAME",
                         help="alone: a systemd --user service of the invoking user, no root "
                         "(~/.config/systemd/user); with NAME (root): run as that dedicated user "
                         "(in the docker group) instead of root")
    p_join = sub.add_parser("join", help="ask to join llm-port (an administrator approves the code shown), "
                            "then start as `start` does; an enrolled node is upgraded in place")
    p_join.add_argument("url", nargs="?", default=None, metavar="URL",
                        help="the llm-port backend, e.g. https://10.0.0.5:8000 (a bare HOST:PORT is https; "
                        "default: BACKEND_URL)")
    p_join.add_argument("--user", action="store_true", dest="user_mode",
                        help="run as a systemd --user service (no root)")
    p_join.add_argument("--insecure-http", action="store_true", dest="insecure_http",
                        help="accept a plain http:// URL (or make a bare HOST:PORT http): the request and the "
                        "credential cross the network in clear text")
    p_stop = sub.add_parser(
        "stop", help="stop and disable the systemd unit (root; --user: your user service)",
        description="Stop and disable the llmport-agent systemd unit (running commands are given their "
        "grace period). The unit, the env file and the state are kept; `start` starts it again.")
    p_stop.add_argument("--user", action="store_true", dest="user_mode",
                        help="your own systemd --user service (installed by `start --user`), no root")
    p_status = sub.add_parser(
        "status", help="show enrollment and service status (--user: your user service)",
        description="Show the unit's state, the agent's enrollment (state file, node id, modes) and its "
        "readiness as its ops endpoint reports it. Exit status 0: running and ready.",
        epilog=SETTINGS_EPILOG)
    p_status.add_argument("--user", action="store_true", dest="user_mode",
                          help="your own systemd --user service (installed by `start --user`)")
    settings("status", p_status, listed=False)
    sub.add_parser("doctor", help="check this node and say what to fix (read-only; --json)")
    sub.add_parser("demo", help="run the end-to-end demo against the stand-in backend")
    sub.add_parser("devbackend", help="run the local stand-in backend")
    return parser


def run_defaults() -> Any:
    """What C{build_parser("run").parse_args(["run"])} gives, without building the parser (nor
    importing argparse)."""
    from types import SimpleNamespace

    return SimpleNamespace(command="run", json_logs=False, **{s.attr: None for s in SETTINGS})


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"run", "demo", "devbackend", "config", "start", "stop", "status", "join"}
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv = ["run", *argv]
    if argv and argv[0] == "devbackend":
        from llmport_agent.devbackend.cli import main as devbackend_main

        return devbackend_main(argv[1:])
    if argv and argv[0] == "doctor":
        from llmport_agent.doctor import main as doctor_main

        return doctor_main(argv[1:])
    if argv and argv[0] == "demo":
        from llmport_agent.demo.run import main as demo_main

        return demo_main(argv[1:])

    if argv == ["run"]:
        # How the unit and a bare `llmport-agent` start it: nothing to parse, and argparse's
        # first parser (its translations, its help formatter) is a few ms of every start.
        args = run_defaults()
    else:
        # Only the subcommand given gets its setting options ("-h" and the like: every one).
        parser = build_parser(argv[0] if argv and argv[0] in commands else None)
        args = parser.parse_args(argv)
        if args.command not in commands:
            parser.print_help()
            return EX_USAGE
    if args.command != "run":  # the running agent never needs the installer (~2 MiB)
        from llmport_agent.host.installer import Installer

    if args.command == "join":
        return join_command(args.url, args.user_mode, args.insecure_http)
    if args.command == "start":
        if args.user is True:
            return Installer(_user_system()).start()
        return Installer().start(user=args.user)
    if args.command == "stop":
        return Installer(_user_system() if args.user_mode else None).stop()
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
        return Installer(_user_system() if args.user_mode else None).status(config)
    code = run_agent(config, json_logs=getattr(args, "json_logs", False))
    leave(code)  # ends the process at once when the agent ran (the console script calls main)
    return code


def leave(status: int) -> None:
    """
    After the agent ran in this process, end it with C{status} at once (C{os._exit}), once the
    output is flushed: its stop already wrote the state, closed the session and joined every
    thread pool of its own, and the interpreter's own teardown (freeing every object of a
    long-running heap, joining the reactor's threads) would keep a stopped agent alive for
    seconds after its "stopped" line, holding up a restart.
    """
    if not _AGENT_RAN:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def entry() -> Any:  # pragma: no cover
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
