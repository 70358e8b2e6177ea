"""
Integration (issue 9): a real operator's first day, agent + stand-in backend reproducing
protocol 9, on the real Docker engine where workloads are involved.

 1. a CPU-only vLLM runtime created through the backend's runtime API deploys (ipc_mode host
    replaced by private IPC + shm), with an IMAGE_ALLOWLIST entry written with a slash (4);
 2. heartbeat on change, and never "degraded" across a restart with a healthy engine
    (the node's status watched at 100 ms);
 3. a deleted node, then a restart with a fresh token: enrolled again within 10 s;
 5. start/restart/update of a missing container whose image exists only on the node;
 6. the real exit code and log lines of a workload the restart policy already restarted;
 7. SIGTERM during a hanging enrollment: a real process exits 0 within 2 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from twisted.internet import reactor, threads
from twisted.internet.endpoints import TCP4ServerEndpoint, UNIXClientEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import LoopingCall, deferLater
from twisted.logger import formatEvent, globalLogPublisher

from tests.agentharness import AgentTestCase, agent_env
from tests.support.docker_env import BUSYBOX, free_port, require_docker

TERMINAL = ("succeeded", "failed")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: A /health server on the port the agent chose (any provider: LLM_PORT_LISTEN_PORT).
SERVE = "mkdir -p /www && echo ok > /www/health && exec httpd -f -p $LLM_PORT_LISTEN_PORT -h /www"


def progress(backend: Any, command_id: str) -> list[dict[str, Any]]:
    return [e["payload"] for e in backend.timeline(command_id) if e["event_type"] == "progress"]


class _Base(AgentTestCase):
    timeout = 120

    async def done(self, backend: Any, cid: str, timeout: float = 60) -> dict[str, Any]:
        await backend.wait_for(lambda: backend.command(cid)["status"] in TERMINAL, timeout)
        return backend.command(cid)

    async def docker_agent(self, **extra: str) -> tuple[Any, Any, Any, str]:
        env = require_docker()
        self.addCleanup(lambda: threads.deferToThread(env.remove_all_containers))
        backend = await self.start_backend()
        agent = self.start_agent(backend, docker_host=env.host, WORKLOAD_NETWORK="host",
                                 READINESS_TIMEOUT_SEC="30", STOP_GRACE_SEC="1", **extra)
        node_id = await self.wait_connected(backend, agent)
        await backend.wait_for(lambda: agent.engine.available, 20)
        return env, backend, agent, node_id

    def capture_log(self) -> list[str]:
        lines: list[str] = []

        def observer(event: dict[str, Any]) -> None:
            text = formatEvent(event)
            if text:
                lines.append(text)

        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        return lines


def _busybox_provider(ptype: str = "llamacpp", script: str = SERVE, **extra: Any) -> dict[str, Any]:
    return {"type": ptype, "image": BUSYBOX, "command": ["sh", "-c", script],
            "container_port": str(free_port()), **extra}


class CpuOnlyRuntimeTests(_Base):
    async def test_cpu_only_vllm_from_the_ui_deploys(self) -> None:
        """
        The UI's CPU-only vLLM runtime (gpu_request "none" -> the backend adds ipc_mode "host")
        deploys with private IPC and a 1 GiB /dev/shm, says so in its progress, and runs;
        IMAGE_ALLOWLIST=llmport-test/ (a trailing slash) admits llmport-test/busybox:1.
        """
        env, backend, agent, node_id = await self.docker_agent(IMAGE_ALLOWLIST="llmport-test/")
        cmd = backend.create_runtime(node_id, _busybox_provider("vllm", gpu_request="none"), name="cpu vllm")
        self.assertEqual((cmd["payload"]["ipc_mode"], cmd["payload"]["gpu_request"]), ("host", "none"))
        rec = await self.done(backend, cmd["id"])
        self.assertEqual(rec["status"], "succeeded", rec.get("error_message"))
        notes = [p["message"] for p in progress(backend, cmd["id"]) if "private IPC" in (p.get("message") or "")]
        self.assertEqual(len(notes), 1, progress(backend, cmd["id"]))
        rid = cmd["payload"]["runtime_id"]
        [container] = await threads.deferToThread(env.managed_containers, rid)
        host_config = container.attrs["HostConfig"]
        self.assertEqual(host_config["IpcMode"], "private")
        self.assertEqual(host_config["ShmSize"], 1024**3)
        await backend.wait_for(lambda: (backend.runtime(rid) or {}).get("status") == "running")

    async def test_allowlist_slash_refuses_other_namespaces(self) -> None:
        """The same slash entry refuses an image outside its namespace (policy_violation)."""
        _env, backend, _agent, node_id = await self.docker_agent(IMAGE_ALLOWLIST="llmport-test/")
        cmd = backend.create_runtime(node_id, _busybox_provider(image="llmport-evil/busybox:1"))
        rec = await self.done(backend, cmd["id"])
        self.assertEqual((rec["status"], rec["error_code"]), ("failed", "policy_violation"))
        self.assertIn("IMAGE_ALLOWLIST", rec["error_message"])


class MissingContainerTests(_Base):
    async def test_start_and_restart_use_the_local_image(self) -> None:
        """
        start/restart of a runtime whose container is gone: the backend sends
        image_source pull_from_registry (protocol 9); the image exists only on the node, so it
        is used as it is (said in progress) and nothing is pulled.
        """
        env, backend, _agent, node_id = await self.docker_agent()
        cmd = backend.create_runtime(node_id, _busybox_provider(), name="local only")
        rid = cmd["payload"]["runtime_id"]
        self.assertEqual((await self.done(backend, cmd["id"]))["status"], "succeeded")
        for action in ("start", "restart"):
            await threads.deferToThread(env.remove_all_containers)
            c = backend.runtime_action(rid, action)
            self.assertEqual(c["payload"]["image_source"], "pull_from_registry")
            rec = await self.done(backend, c["id"])
            self.assertEqual(rec["status"], "succeeded", f"{action}: {rec.get('error_message')}")
            messages = [p.get("message") or "" for p in progress(backend, c["id"])]
            self.assertTrue(any("Using the image already on this node" in m for m in messages), messages)
            self.assertFalse(any(m.startswith("Pulling") for m in messages), messages)
            self.assertTrue(rec["result"]["image_local"])

    async def test_update_falls_back_to_the_local_image(self) -> None:
        """
        update_workload pulls (it may want a newer image under the same tag); when the registry
        cannot provide the image but it is on the node, the local one is used, and said so.
        """
        env, backend, _agent, node_id = await self.docker_agent()
        ref = "127.0.0.1:1/llmport/busybox:1"  # a registry that is never there
        await threads.deferToThread(lambda: env.client().images.get(BUSYBOX).tag(ref))
        self.addCleanup(lambda: threads.deferToThread(env.remove_image, ref))
        cmd = backend.create_runtime(node_id, _busybox_provider(image=ref), name="upd")
        self.assertEqual((await self.done(backend, cmd["id"]))["status"], "succeeded")
        await threads.deferToThread(env.remove_all_containers)
        upd = backend.runtime_action(cmd["payload"]["runtime_id"], "update")
        rec = await self.done(backend, upd["id"])
        self.assertEqual(rec["status"], "succeeded", rec.get("error_message"))
        messages = [p.get("message") or "" for p in progress(backend, upd["id"])]
        self.assertTrue(any(m.startswith("Pulling") for m in messages), messages)
        self.assertTrue(any("using the local" in m for m in messages), messages)

    async def test_missing_image_still_fails(self) -> None:
        """Not in the registry and not on the node: the pull's error, nothing else."""
        _env, backend, _agent, node_id = await self.docker_agent()
        cmd = backend.create_runtime(node_id, _busybox_provider(image="127.0.0.1:1/nope/x:1"))
        rid = cmd["payload"]["runtime_id"]
        await self.done(backend, cmd["id"])
        start = backend.runtime_action(rid, "start")
        rec = await self.done(backend, start["id"])
        self.assertEqual((rec["status"], rec["error_code"]), ("failed", "pull_failed"))


class ExitCodeTests(_Base):
    async def test_real_exit_code_after_the_restart_policy_restarted_it(self) -> None:
        """
        A workload that exits 3 and is restarted by the engine (then runs, State.ExitCode 0):
        the deploy fails naming exit code 3 and the first run's last lines, not the second's.
        """
        _env, backend, _agent, node_id = await self.docker_agent()
        script = ("if [ -f /tmp/ran ]; then echo second-run; exec sleep 60; fi; "
                  "touch /tmp/ran; echo first-run-failed; exit 3")
        cmd = backend.create_runtime(node_id, _busybox_provider(script=script), name="exit three")
        rec = await self.done(backend, cmd["id"])
        self.assertEqual((rec["status"], rec["error_code"]), ("failed", "container_exited"))
        self.assertIn("exit code 3", rec["error_message"])
        self.assertIn("first-run-failed", rec["error_message"])
        self.assertNotIn("second-run", rec["error_message"])
        self.assertEqual(rec["result"]["exit_code"], 3)


class _UnixForwarder(Protocol):
    """TCP on loopback -> the test engine's unix socket (so the engine can be 'cut')."""

    def __init__(self, path: str, live: set[Any]) -> None:
        self.path, self.live, self.peer, self.buffer = path, live, None, b""

    def connectionMade(self) -> None:
        self.live.add(self)
        outer = self

        class Back(Protocol):
            def dataReceived(self, data: bytes) -> None:
                outer.transport.write(data)  # type: ignore[union-attr]

            def connectionLost(self, reason: Any = None) -> None:
                outer.transport.loseConnection()  # type: ignore[union-attr]

        d = UNIXClientEndpoint(reactor, self.path).connect(Factory.forProtocol(Back))

        def up(proto: Any) -> None:
            self.peer = proto
            if self.buffer:
                proto.transport.write(self.buffer)
                self.buffer = b""

        d.addCallbacks(up, lambda _: self.transport.loseConnection())  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        if self.peer is None:
            self.buffer += data
        else:
            self.peer.transport.write(data)

    def connectionLost(self, reason: Any = None) -> None:
        self.live.discard(self)
        if self.peer is not None:
            self.peer.transport.loseConnection()


class HeartbeatTests(_Base):
    async def test_restart_never_reports_degraded(self) -> None:
        """
        Restart an agent whose engine is healthy: the node's status, sampled every 100 ms from
        the backend (and its full status history), is never "degraded".
        """
        env = require_docker()
        backend = await self.start_backend()
        state_dir = self.mktemp()
        agent = self.start_agent(backend, state_dir=state_dir, docker_host=env.host)
        node_id = await self.wait_connected(backend, agent)
        samples: list[str] = []
        sampler = LoopingCall(lambda: samples.append(str((backend.node(node_id) or {}).get("status"))))
        sampler.clock = reactor
        sampler.start(0.1)
        self.addCleanup(lambda: sampler.running and sampler.stop())
        await backend.wait_for(lambda: agent.engine.available, 20)
        await agent.stopService()
        agent2 = self.start_agent(backend, state_dir=state_dir, docker_host=env.host,
                                  AGENT_ID=agent.config.agent_id)
        await self.wait_connected(backend, agent2)
        await backend.wait_for(lambda: agent2.engine.checked and agent2.heartbeat.sent >= 1, 20)
        await deferLater(reactor, 2.0, lambda: None)
        sampler.stop()
        self.assertTrue(agent2.engine.available)
        self.assertGreater(len(samples), 20)
        self.assertIn("offline", backend.node_status_history(node_id))  # the restart happened
        self.assertEqual(samples[-1], "healthy")
        self.assertNotIn("degraded", samples)
        self.assertNotIn("degraded", backend.node_status_history(node_id))

    async def test_engine_changes_reach_the_backend_at_once(self) -> None:
        """
        With a 60 s heartbeat interval, the engine going away and coming back is reported
        within a second each time (a heartbeat on change), not at the next interval.
        """
        env = require_docker()
        port = free_port()
        live: set[Any] = set()
        backend = await self.start_backend()
        agent = self.start_agent(backend, docker_host=f"tcp://127.0.0.1:{port}", HEARTBEAT_INTERVAL_SEC="60")
        node_id = await self.wait_connected(backend, agent)
        # No engine at that address yet: degraded once the first probe failed.
        await backend.wait_for(lambda: agent.engine.checked, 10)
        await backend.wait_for(lambda: backend.node(node_id)["status"] == "degraded", 3)
        factory = Factory.forProtocol(lambda: _UnixForwarder(env.socket, live))
        listening = await TCP4ServerEndpoint(reactor, port, interface="127.0.0.1").listen(factory)
        self.addCleanup(lambda: listening.stopListening())
        await backend.wait_for(lambda: agent.engine.available, 40)
        up_at = reactor.seconds()
        await backend.wait_for(lambda: backend.node(node_id)["status"] == "healthy", 3)
        self.assertLess(reactor.seconds() - up_at, 1.5)
        # Cut the engine: the event stream breaks, the engine is re-checked, degraded at once.
        await listening.stopListening()
        for proto in list(live):
            proto.transport.abortConnection()
        await backend.wait_for(lambda: not agent.engine.available, 20)
        down_at = reactor.seconds()
        await backend.wait_for(lambda: backend.node(node_id)["status"] == "degraded", 3)
        self.assertLess(reactor.seconds() - down_at, 1.5)


class ReEnrollmentTests(_Base):
    async def test_deleted_node_restart_with_fresh_token(self) -> None:
        """
        The node is deleted while connected (drop, then 403s); the operator follows the agent's
        advice (mint a token, set it, restart): enrolled again within 10 s of the restart, as a
        new node; "can be removed" is said only once the new credential was accepted.
        """
        self.allow_anomalies(r"^connection dropped: node no longer exists$",
                             "the node is deleted while connected (protocol 9: the stream handler fails)")
        backend = await self.start_backend()
        state_dir = self.mktemp()
        agent = self.start_agent(backend, state_dir=state_dir)
        node_id = await self.wait_connected(backend, agent)
        backend.delete_node(node_id)
        await backend.wait_for(lambda: agent.session.stats.refused >= 2, 20)
        self.assertEqual(agent.state.get("refusals")["count"], agent.session.refusals.count)
        await agent.stopService()
        with open(os.path.join(state_dir, "state.json")) as f:
            self.assertGreaterEqual(json.load(f)["refusals"]["count"], 2)
        lines = self.capture_log()
        fresh = backend.mint_token("re-enroll")["token"]
        restarted = reactor.seconds()
        agent2 = self.start_agent(backend, state_dir=state_dir, ENROLLMENT_TOKEN=fresh,
                                  AGENT_ID=agent.config.agent_id)
        await backend.wait_for(lambda: agent2.session.connected, 10)
        self.assertLess(reactor.seconds() - restarted, 10.0)
        new_node = backend.node_by_agent_id(agent.config.agent_id)
        assert new_node is not None
        self.assertNotEqual(new_node["id"], node_id)
        self.assertEqual(agent2.session.node_id, new_node["id"])
        said = [i for i, line in enumerate(lines) if "can be removed" in line]
        enrolled = [i for i, line in enumerate(lines) if line.startswith("Enrolled as node")]
        self.assertEqual(len(said), 1, lines)
        self.assertLess(enrolled[0], said[0])
        self.assertIsNone(agent2.state.get("refusals"))


class StopDuringEnrollmentTests(_Base):
    async def test_sigterm_during_a_hanging_enrollment(self) -> None:
        """
        A real agent process whose enrollment request hangs (REQUEST_TIMEOUT_SEC=120) gets
        SIGTERM: it exits with status 0 within 2 s.
        """
        backend = await self.start_backend()
        backend.faults.hang_enroll = True
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        env = agent_env(backend, d, ENROLLMENT_TOKEN=backend.mint_token()["token"],
                        REQUEST_TIMEOUT_SEC="120")
        full = dict(os.environ, PYTHONPATH=ROOT, DOCKER_HOST="unix:///nonexistent/docker.sock", **env)
        log_path = os.path.join(d, "agent.log")
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "llmport_agent.cli", "run"], cwd=ROOT,
                                    env=full, stdout=log, stderr=subprocess.STDOUT)
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait()))
        await backend.wait_for(lambda: backend.enroll_requests >= 1, 30)
        await deferLater(reactor, 0.2, lambda: None)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        while proc.poll() is None and time.monotonic() - sent < 10:
            await deferLater(reactor, 0.02, lambda: None)
        took = time.monotonic() - sent
        with open(log_path, "rb") as f:
            tail = f.read()[-3000:].decode("utf-8", "replace")
        self.assertEqual(proc.returncode, 0, tail)
        self.assertLess(took, 2.0, tail)
