"""
C{llmport-agent demo}: the stand-in backend and a real agent on loopback, end to end.

Starts the stand-in backend on 127.0.0.1 (free port), mints an enrollment token, starts an agent
with a temporary state directory, shows enrollment, the first heartbeat and inventory, issues
C{refresh_inventory} and C{collect_diagnostics}, prints each command's timeline, stops both
cleanly and exits 0 (non-zero if a step did not happen within its time).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import react

from llmport_agent import VERSION

STEP_TIMEOUT = 10.0


def _say(text: str) -> None:
    print(text, flush=True)


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
                if isinstance(result, dict) and result and len(str(result)) < 120:
                    detail += f" {result}"
        lines.append(f"    {str(entry.get('ts', ''))[11:23]:<12} {event:<10} {detail}".rstrip())
    return lines


async def _demo(reactor: Any, args: argparse.Namespace) -> int:
    from llmport_agent.config import load_config
    from llmport_agent.devbackend import DevBackend
    from llmport_agent.logsetup import begin_logging
    from llmport_agent.service import AgentService

    begin_logging("WARN" if not args.verbose else "INFO")
    started = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="llmport-demo-")
    backend = DevBackend(reactor)
    agent: AgentService | None = None
    try:
        await backend.listen(0, "127.0.0.1")
        _say(f"llmport-agent {VERSION} demo")
        _say(f"[backend] stand-in backend listening on {backend.url}")
        token = backend.mint_token("demo")
        _say(f"[backend] minted a one-time enrollment token (expires {token['expires_at']})")
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

        agent = AgentService(reactor, config, fatal=fatal, docker_enabled=args.docker)
        agent.startService()
        _say(f"[agent]   started with state in {workdir}")

        def node() -> dict[str, Any] | None:
            return backend.node_by_agent_id("demo-node")

        await backend.wait_for(lambda: node() is not None or bool(failures), STEP_TIMEOUT)
        if failures:
            _say(f"[agent]   could not enroll: {failures[0]}")
            return 1
        n = node()
        assert n is not None
        node_id = n["id"]
        _say(f"[backend] node enrolled: id {node_id}, agent id {n.get('agent_id')}")
        await backend.wait_for(lambda: (node() or {}).get("status") not in (None, "offline", ""), STEP_TIMEOUT)
        n = node() or {}
        _say(f"[backend] heartbeat: status {n.get('status')}, version {n.get('version')}, "
             f"host {n.get('host')}")
        await backend.wait_for(lambda: backend.latest_inventory(node_id) is not None, STEP_TIMEOUT)
        inv = backend.latest_inventory(node_id) or {}
        i = inv.get("inventory", inv)
        u = inv.get("utilization", {})
        caps = i.get("static_capabilities", {})
        _say(
            f"[backend] inventory: {caps.get('hostname', '?')} {caps.get('os', '?')}/{caps.get('machine', '?')}, "
            f"{i.get('cpu_count_logical', '?')} CPUs, memory {_fmt_bytes(i.get('memory_total_bytes'))}, "
            f"disk {_fmt_bytes(i.get('disk_total_bytes'))}, GPUs {i.get('gpu_count', 0)} "
            f"(vendor {caps.get('gpu_vendor', 'none')}), docker {'yes' if caps.get('docker_available') else 'no'}, "
            f"cpu {u.get('cpu_percent', '?')} %"
        )
        inventories_before = len(backend.inventories(node_id))
        issued = []
        for ctype in ("refresh_inventory", "collect_diagnostics", "set_maintenance_mode", "resume_node"):
            payload: dict[str, Any] = {"enabled": "false"} if ctype == "set_maintenance_mode" else {}
            cmd = backend.issue_command(node_id, ctype, payload)
            issued.append(cmd)
            _say(f"[backend] issued {ctype} ({cmd['id']})")
        await backend.wait_for(
            lambda: all(backend.command(c["id"])["status"] in ("succeeded", "failed") for c in issued),
            STEP_TIMEOUT * 2,
        )
        ok = True
        for c in issued:
            final = backend.command(c["id"])
            _say(f"[backend] {c['command_type']}: {final['status']}")
            for line in _timeline_lines(backend, c["id"]):
                _say(line)
            ok = ok and final["status"] == "succeeded"
        diag = backend.command(issued[1]["id"]).get("result") or {}
        if isinstance(diag, dict) and diag:
            _say(f"[backend] diagnostics sections: {', '.join(sorted(diag))}")
        _say(f"[backend] inventory frames received: {inventories_before} before refresh, "
             f"{len(backend.inventories(node_id))} after")
        await agent.stopService()
        agent = None
        await backend.wait_for(lambda: backend.connection_count(node_id) == 0, STEP_TIMEOUT)
        _say(f"[agent]   stopped cleanly; node is now {(node() or {}).get('status')}")
        _say(f"demo finished in {time.monotonic() - started:.1f} s: {'OK' if ok else 'FAILED'}")
        return 0 if ok else 1
    except Exception as e:  # a step timed out or broke: say which, exit non-zero
        _say(f"demo failed: {type(e).__name__}: {e}")
        return 1
    finally:
        if agent is not None:
            await agent.stopService()
        await backend.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmport-agent demo", description=__doc__)
    parser.add_argument("--verbose", action="store_true", help="show the agent's log at info level")
    parser.add_argument("--docker", action="store_true",
                        help="also start the Docker executor (needs a reachable engine)")
    args = parser.parse_args(sys.argv[2:] if argv is None else argv)
    status = {"code": 1}

    def run(reactor: Any) -> Deferred[None]:
        d = Deferred.fromCoroutine(_demo(reactor, args))
        return d.addCallback(lambda code: status.update(code=code))

    try:
        react(run)
    except SystemExit as e:
        if e.code not in (0, None):
            return int(e.code) if isinstance(e.code, int) else 1
    return status["code"]
