"""
C{llmport-agent demo}: the stand-in backend and a real agent on loopback, end to end.

Starts the stand-in backend on 127.0.0.1 (free port), mints an enrollment token, starts an agent
with a temporary state directory, shows enrollment, the first heartbeat and inventory, issues
C{refresh_inventory} and C{collect_diagnostics}, switches maintenance on (the node's status
shows it) and off again, prints each command's timeline, stops both cleanly and exits 0
(non-zero if a step did not happen within its time, or, with C{--docker}, when the engine
is unreachable).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import react
from twisted.logger import ILogFilterPredicate, LogLevel, PredicateResult
from zope.interface import implementer

from llmport_agent import VERSION
from llmport_agent.demo.steps import STEP_TIMEOUT, Say
from llmport_agent.demo.steps import say as _say

#: What C{demo --help} says (plain text: the module docstring is epytext).
DESCRIPTION = (
    "Run the stand-in backend and a real agent on loopback, end to end: the backend starts on a "
    "free port of 127.0.0.1 and mints an enrollment token, the agent (temporary state) enrolls and "
    "reports its first heartbeat and inventory; refresh_inventory, collect_diagnostics and "
    "set_maintenance_mode (on, then off) are issued and each command's timeline is printed; both "
    "stop cleanly. Exits 0 when every step happened, 1 otherwise."
)

def _fmt_bytes(n: Any) -> str:
    try:
        value = float(n)
    except (TypeError, ValueError):
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _timeline_lines(backend: Any, command_id: str) -> list[str]:
    lines = []
    for entry in backend.timeline(command_id):
        event = str(entry.get("event_type") or "?")
        frame = entry.get("payload") or {}
        detail = ""
        if isinstance(frame, dict):
            if frame.get("phase"):
                detail = f"[{frame['phase']}] "
            if frame.get("message") and event != "result":
                detail += str(frame["message"])
            if event == "result":
                detail += "success" if frame.get("success") else (
                    f"failed {frame.get('error_code')}: {frame.get('error_message')}"
                )
                result = frame.get("result")
                shown = json.dumps(result, default=str) if isinstance(result, dict) and result else ""
                if shown and len(shown) < 120:
                    detail += f" {shown}"
        lines.append(f"    {str(entry.get('ts', ''))[11:23]:<12} {event:<10} {detail}".rstrip())
    return lines


async def _wait_status(backend: Any, node: Any, wanted: tuple[str, ...]) -> str:
    await backend.wait_for(lambda: (node() or {}).get("status") in wanted, STEP_TIMEOUT)
    return str((node() or {}).get("status"))


def _show_command(backend: Any, command: dict[str, Any], say: Say) -> bool:
    final = backend.command(command["id"])
    say(f"[backend] {command['command_type']}: {final['status']}")
    for line in _timeline_lines(backend, command["id"]):
        say(line)
    return bool(final["status"] == "succeeded")


async def _run_commands(backend: Any, node_id: str, specs: list[tuple[str, dict[str, Any]]], say: Say) -> tuple[bool, list[dict[str, Any]]]:
    issued = []
    for ctype, payload in specs:
        cmd = backend.issue_command(node_id, ctype, payload)
        issued.append(cmd)
        shown = f" {json.dumps(payload)}" if payload else ""
        say(f"[backend] issued {ctype}{shown} ({cmd['id']})")
    await backend.wait_for(
        lambda: all(backend.command(c["id"])["status"] in ("succeeded", "failed") for c in issued),
        STEP_TIMEOUT * 2,
    )
    ok = True
    for c in issued:
        ok = _show_command(backend, c, say) and ok
    return ok, issued


#: Namespaces whose warnings are about this host's hardware, not the demo's story: on a machine
#: without a GPU (most machines the demo runs on) NVML's "No GPU facts ... retrying" would
#: interrupt the narrative; the inventory line already says "GPUs 0". Shown with --verbose.
HARDWARE_NAMESPACES = ("llmport_agent.inventory.nvml",)


@implementer(ILogFilterPredicate)
class HardwareQuiet:
    """Drop the hardware warnings (below error) of L{HARDWARE_NAMESPACES} unless C{verbose}."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose

    def __call__(self, event: dict[str, Any]) -> PredicateResult:
        if self.verbose:
            return PredicateResult.maybe
        namespace = str(event.get("log_namespace", ""))
        level = event.get("log_level")
        quiet = level is None or level < LogLevel.error
        if quiet and namespace.startswith(HARDWARE_NAMESPACES):
            return PredicateResult.no
        return PredicateResult.maybe


def demo_log_predicate(verbose: bool) -> HardwareQuiet:
    return HardwareQuiet(verbose)


def begin_demo_logging(verbose: bool) -> None:
    """The agent's log during the demo: warnings and errors (info with --verbose), NVML's quiet."""
    from twisted.logger import FilteringLogObserver, globalLogBeginner

    from llmport_agent.core.logsetup import make_observer

    observer = FilteringLogObserver(make_observer("INFO" if verbose else "WARN"), [demo_log_predicate(verbose)])
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)


async def _demo(
    reactor: Any,
    args: argparse.Namespace,
    say: Say = _say,
    *,
    docker_environ: dict[str, str] | None = None,
    gpu_source: Any = None,
) -> int:
    from llmport_agent.agent.service import AgentService
    from llmport_agent.core.config import load_config
    from llmport_agent.devbackend import DevBackend

    if say is _say:
        begin_demo_logging(args.verbose)
    started = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="llmport-demo-")
    # The current generation (protocol 10): commands are pushed, overdue ones re-dispatched.
    backend = DevBackend(reactor, generation="current")
    agent: AgentService | None = None
    problems: list[str] = []
    try:
        await backend.listen(0, "127.0.0.1")
        say(f"llmport-agent {VERSION} demo")
        say(f"[backend] stand-in backend ({backend.generation} generation) listening on {backend.url}")
        token = backend.mint_token("demo")
        say(f"[backend] minted a one-time enrollment token (expires {token['expires_at']})")
        config = load_config(
            {
                "LLM_PORT_NODE_AGENT_BACKEND_URL": backend.url,
                "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN": token["token"],
                "LLM_PORT_NODE_AGENT_AGENT_ID": "demo-node",
                "LLM_PORT_NODE_AGENT_HOST": "127.0.0.1",
                "LLM_PORT_NODE_AGENT_STATE_PATH": f"{workdir}/state.json",
                "LLM_PORT_NODE_AGENT_MODEL_STORE": f"{workdir}/models",
                "LLM_PORT_NODE_AGENT_OPS_PORT": "0",
            },
            {},
        )
        failures: list[str] = []

        def fatal(code: int, message: str) -> None:
            failures.append(message)

        agent = AgentService(
            reactor, config, fatal=fatal, docker_enabled=args.docker,
            docker_environ=docker_environ, gpu_source=gpu_source,
        )
        agent.startService()
        say(f"[agent]   started with state in {workdir}")

        def node() -> dict[str, Any] | None:
            return backend.node_by_agent_id("demo-node")

        await backend.wait_for(lambda: node() is not None or bool(failures), STEP_TIMEOUT)
        if failures:
            say(f"[agent]   could not enroll: {failures[0]}")
            return 1
        n = node()
        assert n is not None
        node_id = n["id"]
        say(f"[backend] node enrolled: id {node_id}, agent id {n.get('agent_id')}")
        engine = agent.engine
        if engine is not None:
            # The heartbeat says "degraded" only once the engine was found unreachable: wait for
            # the first probe, and for the heartbeat that reports its outcome.
            await backend.wait_for(lambda: engine.checked, STEP_TIMEOUT)
            expected = ("healthy",) if engine.available else ("degraded",)
            await _wait_status(backend, node, expected)
            if engine.available:
                say(f"[agent]   Docker engine at {engine.address}: docker {engine.version}, available")
            else:
                say(f"[agent]   {engine.last_error}")
                problems.append(
                    f"the Docker engine at {engine.address} is unreachable (start dockerd or point "
                    "DOCKER_HOST at it, or run the demo without --docker)"
                )
        else:
            await _wait_status(backend, node, ("healthy", "degraded", "maintenance", "draining"))
        n = node() or {}
        say(f"[backend] heartbeat: status {n.get('status')}, version {n.get('version')}, "
            f"host {n.get('host')}")
        await backend.wait_for(lambda: backend.latest_inventory(node_id) is not None, STEP_TIMEOUT)
        inv = backend.latest_inventory(node_id) or {}
        i = inv.get("inventory", inv)
        u = inv.get("utilization", {})
        caps = i.get("static_capabilities", {})
        say(
            f"[backend] inventory: {caps.get('hostname', '?')} {caps.get('os', '?')}/{caps.get('machine', '?')}, "
            f"{i.get('cpu_count_logical', '?')} CPUs, memory {_fmt_bytes(i.get('memory_total_bytes'))}, "
            f"disk {_fmt_bytes(i.get('disk_total_bytes'))}, GPUs {i.get('gpu_count', 0)} "
            f"(vendor {caps.get('gpu_vendor', 'none')}), docker {'yes' if caps.get('docker_available') else 'no'}, "
            f"cpu {u.get('cpu_percent', '?')} %"
        )
        inventories_before = len(backend.inventories(node_id))
        ok, issued = await _run_commands(
            backend, node_id, [("refresh_inventory", {}), ("collect_diagnostics", {})], say
        )
        diag = backend.command(issued[1]["id"]).get("result") or {}
        if isinstance(diag, dict) and diag:
            say(f"[backend] diagnostics sections: {', '.join(sorted(diag))}")
        say(f"[backend] inventory frames received: {inventories_before} before refresh, "
            f"{len(backend.inventories(node_id))} after")
        # Maintenance on, visibly: the node's status changes with the next heartbeat (at once).
        step, _ = await _run_commands(backend, node_id, [("set_maintenance_mode", {"enabled": True})], say)
        ok = ok and step
        say(f"[backend] node status is now {await _wait_status(backend, node, ('maintenance',))}")
        step, _ = await _run_commands(backend, node_id, [("set_maintenance_mode", {"enabled": False})], say)
        ok = ok and step
        say(f"[backend] node status is now "
            f"{await _wait_status(backend, node, ('healthy', 'degraded'))}")
        await agent.stopService()
        agent = None
        await backend.wait_for(lambda: backend.connection_count(node_id) == 0, STEP_TIMEOUT)
        say(f"[agent]   stopped cleanly; node is now {(node() or {}).get('status')}")
        if not ok:
            problems.insert(0, "a command did not succeed (see its timeline above)")
        verdict = "OK" if not problems else "FAILED: " + "; ".join(problems)
        say(f"demo finished in {time.monotonic() - started:.1f} s: {verdict}")
        return 0 if not problems else 1
    except Exception as e:  # a step timed out or broke: say which, exit non-zero
        say(f"demo failed: {type(e).__name__}: {e}")
        return 1
    finally:
        if agent is not None:
            await agent.stopService()
        await backend.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmport-agent demo", description=DESCRIPTION)
    parser.add_argument("--verbose", action="store_true", help="show the agent's log at info level")
    parser.add_argument("--docker", action="store_true",
                        help="also start the Docker executor (needs a reachable engine)")
    parser.add_argument("--ray", action="store_true",
                        help="instead: a two-node Ray cluster on loopback (two agents, one engine, "
                             "the Ray runtime image; see --ray-image)")
    parser.add_argument("--ray-image", default="llmport-test/ray-runtime:2.58.0",
                        help="the local Ray runtime image for --ray (built by tests/support/rayimage/build.sh)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[2:] if argv is None else argv)
    status = {"code": 1}

    def run(reactor: Any) -> Deferred[None]:
        if args.ray:
            from llmport_agent.demo.ray_env import demo_ray

            begin_demo_logging(args.verbose)
            d = Deferred.fromCoroutine(demo_ray(reactor, args, _say, None))
            return d.addCallback(lambda code: status.update(code=code))
        d = Deferred.fromCoroutine(_demo(reactor, args))
        return d.addCallback(lambda code: status.update(code=code))

    try:
        react(run)
    except SystemExit as e:
        if e.code not in (0, None):
            return int(e.code) if isinstance(e.code, int) else 1
    return status["code"]
