"""
C{llmport-agent doctor [--json]}: every check at once, each on its own thread under its own
time limit, the whole run bounded (under 15 s); one line per finding; exit 0/1/2 by the worst.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from twisted.internet.defer import Deferred, DeferredList
from twisted.python.failure import Failure

from llmport_agent.core.config import ConfigError, load_config
from llmport_agent.doctor.checks import CHECKS, Context
from llmport_agent.doctor.result import Finding, exit_status, fail, worst

#: A check's limit (it may make a few network calls of Context.timeout each).
CHECK_LIMIT = 10.0
#: How long the running agent's /readyz may take.
READINESS_LIMIT = 2.0

Check = Callable[[Context], list[Finding]]


def read_env_file(path: str) -> dict[str, str]:
    """C{NAME=VALUE} lines (C{#} comments, optional quotes), as systemd's EnvironmentFile= reads them."""
    values: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read(1 << 20).splitlines()
    except OSError:
        return values
    for line in lines:
        line = line.strip()
        if not line or line.startswith(("#", ";")) or "=" not in line:
            continue
        name, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[name.strip()] = value
    return values


def make_context(env_file: str, environ: Mapping[str, str], **kw: Any) -> Context:
    """The agent's configuration as the unit sees it: the env file, then this shell's variables."""
    merged = dict(read_env_file(env_file))
    merged.update({k: v for k, v in environ.items() if k.startswith("LLM_PORT_NODE_AGENT_")})
    for name in ("DOCKER_HOST",):
        if name in environ:
            merged[name] = environ[name]
    try:
        config = load_config(environ=merged)
        error = ""
    except ConfigError as e:
        config, error = None, str(e)
    return Context(config=config, config_error=error, env_file=env_file, environ=merged, **kw)


def readiness(ctx: Context) -> dict[str, Any] | None:
    """
    The running agent's /readyz on loopback (read-only), or C{None} when none answers, or when
    what answers is not the agent (L{llmport_agent.ops.probe}: the holder of the state's lock
    must own the listening socket; a redirect is never followed). Sets C{ctx.ops_trusted} and,
    when something else answers, C{ctx.ops_note}.
    """
    if ctx.config is None or not ctx.config.ops_port:
        return None
    from llmport_agent.ops.probe import probe

    answer = probe(ctx.config.ops_port, ctx.config.state_path, timeout=READINESS_LIMIT)
    ctx.ops_trusted = answer.trusted
    if not answer.answered:
        return None
    if not answer.trusted and not answer.unverifiable:
        ctx.ops_note = answer.note
        return None
    body = answer.body
    return body if isinstance(body, dict) and "checks" in body else None


def _on_thread(reactor: Any, fn: Callable[[], Any]) -> Deferred[Any]:
    """
    C{fn} on a daemon thread of its own: a check stuck in a system call (a hung NVML call, a
    dead NFS mount) is left behind when its limit passes and never holds up the exit.
    """
    d: Deferred[Any] = Deferred()

    def deliver(outcome: Any) -> None:
        if not d.called:  # past its limit the Deferred was already failed by the timeout
            if isinstance(outcome, Failure):
                d.errback(outcome)
            else:
                d.callback(outcome)

    def work() -> None:
        try:
            outcome: Any = fn()
        except Exception:
            outcome = Failure()
        reactor.callFromThread(deliver, outcome)

    threading.Thread(target=work, name="doctor-check", daemon=True).start()
    return d


async def diagnose(reactor: Any, ctx: Context, checks: Sequence[tuple[str, Check]] = CHECKS,
                   limit: float = CHECK_LIMIT) -> list[Finding]:
    """Every check concurrently, each bounded by C{limit}; the findings in the checks' order."""
    if ctx.readiness is None:
        try:
            ctx.readiness = await _on_thread(reactor, lambda: readiness(ctx)).addTimeout(
                READINESS_LIMIT + 0.5, reactor)
        except Exception:
            ctx.readiness = None
    running: list[Deferred[Any]] = []
    for _name, check in checks:
        d = _on_thread(reactor, lambda check=check: check(ctx))  # type: ignore[misc]
        d.addTimeout(limit, reactor)
        running.append(d)
    results = await DeferredList(running, consumeErrors=True)
    findings: list[Finding] = []
    for (name, _check), (success, value) in zip(checks, results, strict=True):
        if success:
            findings.extend(value)
        elif value.check(Exception) and "TimeoutError" in type(value.value).__name__:
            findings.append(fail(name, f"did not finish within {limit:g} s",
                                 "something on the node hangs (a driver, a mount, the network): check it by hand"))
        else:
            findings.append(fail(name, f"the check itself failed ({type(value.value).__name__}: "
                                 f"{str(value.value)[:160]})", "report this with the line above"))
    return findings


def report(findings: Sequence[Finding], as_json: bool, out: IO[str]) -> int:
    status = exit_status(findings)
    if as_json:
        out.write(json.dumps({"status": worst(findings), "exit": status,
                              "checks": [f.as_dict() for f in findings]}, indent=2) + "\n")
    else:
        for f in findings:
            out.write(f.line() + "\n")
        counts = {s: sum(1 for f in findings if f.status == s) for s in ("ok", "warn", "fail")}
        out.write(f"{counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail\n")
    out.flush()
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmport-agent doctor",
                                     description="check this node and say what to fix (read-only)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    parser.add_argument("--env-file", default="/etc/llmport-agent.env",
                        help="the agent's env file (default /etc/llmport-agent.env)")
    return parser


def main(argv: list[str], environ: Mapping[str, str] | None = None, out: IO[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    ctx = make_context(args.env_file, dict(os.environ if environ is None else environ))
    from twisted.internet.task import react

    status: dict[str, int] = {}

    async def run(reactor: Any) -> None:
        findings = await diagnose(reactor, ctx)
        status["code"] = report(findings, args.json, out or sys.stdout)

    try:
        react(lambda reactor: Deferred.fromCoroutine(run(reactor)))
    except SystemExit:
        pass
    return status.get("code", 2)
