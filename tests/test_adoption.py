"""
Replacing the original agent on a node that runs workloads (issue 20 #6): the REAL original
agent (0.1.8 and 0.1.13, each in its own virtualenv from the package index) enrolls against the
stand-in backend and deploys a real workload on the real Docker engine; then this agent starts
on the same state file, keeps the node's identity, adopts exactly the containers the original's
`workloads` mapping names (right name, right image), and the runtime is stopped, started, its
logs read and removed through the backend's commands. A container whose name matches the
mapping but whose image differs is refused and left alone. The original's keys stay, so the
original agent starts again on the state afterwards.

The original is installed once per machine under $TMPDIR (or /tmp); when it cannot be installed
(no package index) the tests skip with one line, and fail under CI=true.

The test engine runs with --bridge=none, so the original's published port leads nowhere: a
loopback HTTP server on the workload's host port plays the published port (both agents probe
127.0.0.1:<host port>/health), and this agent is told that port counts as free.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any

from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest
from twisted.web.resource import Resource
from twisted.web.server import Site

from llmport_agent.logs.testing import FakeLoki
from llmport_agent.workloads.ports import port_is_free
from llmport_agent.workloads.spec import LABEL_MANAGED, MANAGED_VALUE
from tests.agentharness import AgentTestCase
from tests.support.docker_env import BUSYBOX, free_port, require_docker
from tests.test_operator_texts import Captured

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENVS = os.path.join(os.environ.get("TMPDIR") or tempfile.gettempdir(), "llmport-original-agents")
OTHER_IMAGE = "llmport-test/other:1"
#: The workloads' image: on the node only; a pull (update_workload pulls) goes to a registry
#: that is never there (loopback), and the agent falls back to the local image.
IMAGE = "127.0.0.1:1/llmport/adopt:1"
SCRIPT = "echo adopted-hello; mkdir -p /www && echo ok > /www/health && exec httpd -f -p 8000 -h /www"


def install_original(version: str) -> str:
    """The original agent's console script in its own venv (installed once); SkipTest when it cannot be."""
    venv = os.path.join(VENVS, version)
    exe = os.path.join(venv, "bin", "llmport-agent")
    if os.access(exe, os.X_OK):
        return exe
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    try:
        subprocess.run([sys.executable, "-m", "venv", venv], check=True, capture_output=True, timeout=300,
                       env=clean)
        subprocess.run([os.path.join(venv, "bin", "pip"), "install", "-q", f"llmport-agent=={version}"],
                       check=True, capture_output=True, timeout=600, env=clean)
    except (OSError, subprocess.SubprocessError) as e:
        reason = f"the original agent {version} cannot be installed from the package index ({type(e).__name__})"
        if os.environ.get("CI") == "true":
            raise AssertionError(f"CI=true but {reason}") from None
        raise SkipTest(reason) from None
    return exe


class _Health(Resource):
    isLeaf = True

    def render_GET(self, request: Any) -> bytes:
        return b"ok"


class AdoptionTests(AgentTestCase):
    timeout = 240

    def setUp(self) -> None:
        self.env = require_docker()
        self.client = self.env.client()
        self.client.images.get(BUSYBOX).tag(OTHER_IMAGE)
        self.client.images.get(BUSYBOX).tag(IMAGE)

    def published(self, port: int) -> None:
        """A loopback server on the workload's host port, standing in for the engine's publish."""
        listening = reactor.listenTCP(port, Site(_Health()), interface="127.0.0.1")  # type: ignore[attr-defined]
        self.addCleanup(listening.stopListening)

    def original(self, exe: str, env: dict[str, str], log: str) -> subprocess.Popen[bytes]:
        # The original runs from its own venv: none of this interpreter's import paths (trial -j
        # workers get PYTHONPATH = the parent's sys.path, whose older packages break its imports).
        full = {k: v for k, v in os.environ.items()
                if not k.startswith("LLM_PORT_NODE_AGENT_") and k not in ("PYTHONPATH", "PYTHONHOME")}
        full.update(env, DOCKER_HOST=self.env.host)
        out = open(log, "ab")
        self.addCleanup(out.close)
        proc = subprocess.Popen([exe, "run"], env=full, stdout=out, stderr=subprocess.STDOUT,
                                cwd=os.path.dirname(log))
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait()))
        return proc

    async def stop_original(self, b: Any, proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGTERM)
        await b.wait_for(lambda: proc.poll() is not None, 30)

    def container(self, name: str) -> Any:
        import docker

        try:
            return self.client.containers.get(name)
        except docker.errors.NotFound:
            return None

    async def done(self, b: Any, command: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
        cid = command["id"]
        await b.wait_for(lambda: b.command(cid)["status"] in ("succeeded", "failed"), timeout)
        return dict(b.command(cid))

    async def deploy_with_original(self, b: Any, node_id: str, name: str) -> tuple[str, int]:
        port = free_port()
        self.published(port)
        provider = {"type": "llamacpp", "image": IMAGE, "command": ["sh", "-c", SCRIPT],
                    "container_port": "8000", "host_port": port}
        command = b.create_runtime(node_id, provider, name=name)
        result = await self.done(b, command, 90)
        self.assertEqual(result["status"], "succeeded", result)
        return command["payload"]["runtime_id"], port

    async def run_version(self, version: str) -> None:
        exe = await deferToThread(install_original, version)
        captured = Captured(self)
        self.allow_anomalies(".", "the original agent's frames are its own business here")
        b = await self.start_backend()
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        agent_id = f"orig-{version.replace('.', '')}-{os.getpid()}"
        state_path = os.path.join(d, "state.json")
        env = {
            "LLM_PORT_NODE_AGENT_BACKEND_URL": b.url,
            "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN": b.mint_token("original")["token"],
            "LLM_PORT_NODE_AGENT_AGENT_ID": agent_id,
            "LLM_PORT_NODE_AGENT_HOST": "127.0.0.1",
            "LLM_PORT_NODE_AGENT_ADVERTISE_HOST": "127.0.0.1",
            "LLM_PORT_NODE_AGENT_STATE_PATH": state_path,
            "LLM_PORT_NODE_AGENT_MODEL_STORE": os.path.join(d, "models"),
            "LLM_PORT_NODE_AGENT_CONTAINER_RUNTIME": "docker",
            "LLM_PORT_NODE_AGENT_HEARTBEAT_INTERVAL_SEC": "2",
            "HOME": d,
        }
        log = os.path.join(d, "original.log")
        proc = self.original(exe, env, log)
        await b.wait_for(lambda: b.node_by_agent_id(agent_id) is not None
                         and b.connection_count(b.node_by_agent_id(agent_id)["id"]) == 1
                         or proc.poll() is not None, 180)
        self.assertIsNone(proc.poll(), open(log).read()[-3000:])
        node_id = b.node_by_agent_id(agent_id)["id"]

        # Two runtimes deployed by the original; the second one's container is then replaced by
        # a same-named one from another image (the mapping no longer describes it).
        rid, port = await self.deploy_with_original(b, node_id, "adopt me")
        rid2, _port2 = await self.deploy_with_original(b, node_id, "not mine")
        rid3, _port3 = await self.deploy_with_original(b, node_id, "remove me")
        await self.stop_original(b, proc)
        with open(state_path) as f:
            original_state = json.load(f)
        mapping = original_state["workloads"]
        name, name2, name3 = (mapping[r]["container_name"] for r in (rid, rid2, rid3))
        self.assertEqual(name, "llm-port-adopt-me")
        first = self.container(name)
        self.assertNotIn(LABEL_MANAGED, first.labels)
        stale = self.container(name2)
        stale.remove(force=True)
        impostor = self.client.containers.run(OTHER_IMAGE, ["sh", "-c", "echo impostor-line; exec sleep 600"],
                                              name=name2, detach=True)
        self.addCleanup(lambda: self.container(name2) and self.container(name2).remove(force=True))
        for n in (name, name3):
            self.addCleanup(lambda n=n: self.container(n) and self.container(n).remove(force=True))
        third = self.container(name3)

        # This agent on the same state: same node, no new enrollment; its logs to a stand-in Loki.
        loki = FakeLoki()
        loki_port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Site(loki))
        self.addCleanup(loki_port.stopListening)
        agent = self.start_agent(b, state_dir=d, token=False, docker_host=self.env.host, AGENT_ID=agent_id,
                                 ADVERTISE_HOST="127.0.0.1", LOKI_URL=f"http://127.0.0.1:{loki_port.getHost().port}",
                                 LOG_FLUSH_INTERVAL_SEC="0.2")
        agent.workloads._port_free = lambda p: p == port or port_is_free(p)
        self.assertEqual(await self.wait_connected(b, agent), node_id)
        await agent.adoption.ready()
        self.assertEqual(agent.adoption.snapshot(), {first.id: rid, third.id: rid3})
        lines = captured.lines()
        self.assertTrue(any(f"Adopted runtime {rid}" in t and name in t for t in lines), lines[-20:])
        refusal = [t for t in lines if f"Not adopting runtime {rid2}" in t]
        self.assertEqual(len(refusal), 1, lines[-20:])
        self.assertIn(OTHER_IMAGE, refusal[0])

        # Its output ships to Loki as a runtime's does (protocol 8 labels); the refused one's never.
        await b.wait_for(lambda: any("adopted-hello" in line for line in
                                     loki.lines(job="node-container", runtime_id=rid)), 30)
        entry = next(e for e in loki.entries(job="node-container") if e.labels.get("runtime_id") == rid)
        self.assertEqual((entry.labels["container"], entry.labels["host"]), (name, "127.0.0.1"))

        # Managed like its own, through the backend's commands.
        stopped = await self.done(b, b.runtime_action(rid, "stop"))
        self.assertEqual(stopped["status"], "succeeded", stopped)
        self.assertTrue(stopped["result"]["stopped"], stopped)
        first.reload()
        self.assertEqual(first.status, "exited")
        started = await self.done(b, b.runtime_action(rid, "start"))
        self.assertEqual(started["status"], "succeeded", started)
        self.assertEqual(started["result"]["container_id"], first.id)
        first.reload()
        self.assertEqual(first.status, "running")
        logs = await self.done(b, b.runtime_action(rid, "logs"))
        self.assertTrue(logs["result"]["found"], logs)
        self.assertIn("adopted-hello", logs["result"]["logs"])
        # The refused one is left alone: its stop touches nothing, its logs are not read.
        other_stop = await self.done(b, b.runtime_action(rid2, "stop"))
        self.assertFalse((other_stop.get("result") or {}).get("stopped"), other_stop)
        impostor.reload()
        self.assertEqual(impostor.status, "running")
        other_logs = await self.done(b, b.runtime_action(rid2, "logs"))
        self.assertFalse((other_logs.get("result") or {}).get("found"), other_logs)

        # Removed: the adopted container goes, and the runtime from both agents' keys.
        removed = await self.done(b, b.runtime_action(rid3, "remove"))
        self.assertEqual(removed["status"], "succeeded", removed)
        self.assertEqual(removed["result"]["removed"], 1, removed)
        self.assertIsNone(self.container(name3))
        # Replaced by a labelled container at its next update; the mapping names the new one.
        updated = await self.done(b, b.runtime_action(rid, "update"), 90)
        self.assertEqual(updated["status"], "succeeded", updated)
        new = self.container(name)
        self.assertNotEqual(new.id, first.id)
        self.assertEqual(new.labels.get(LABEL_MANAGED), MANAGED_VALUE)
        self.assertIsNone(self.container(first.id[:12]))
        self.assertEqual(agent.adoption.snapshot(), {})
        # The replaced container's shipping stopped; the labelled one ships under the same keys.
        await b.wait_for(lambda: first.id not in agent.container_logs._tracked, 30)
        await b.wait_for(lambda: sum("adopted-hello" in line for line in
                                     loki.lines(job="node-container", runtime_id=rid, container=name)) >= 3, 30)
        self.assertFalse([line for line in loki.lines(job="node-container") if "impostor-line" in line])
        await agent.state.flush()
        with open(state_path) as f:
            state = json.load(f)
        self.assertEqual(state["workloads"][rid]["container_id"], new.id)
        self.assertEqual(state["workloads"][rid]["container_name"], name)
        self.assertNotIn(rid3, state["workloads"])
        self.assertIsNone(state.get("adopted"))
        self.assertIn(rid2, state["workloads"])  # not ours to forget
        for key in ("node_id", "credential", "workloads"):
            self.assertEqual(type(state[key]), type(original_state[key]), key)
        await self.stop_agent(agent)

        # Going back: the original starts again on this state as the same node, and manages the
        # runtime this agent replaced (it finds it by the name in `workloads`).
        env.pop("LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN")
        nodes_before = len(b.nodes())
        again = self.original(exe, env, log)
        await b.wait_for(lambda: b.connection_count(node_id) == 1 or again.poll() is not None, 60)
        self.assertIsNone(again.poll(), open(log).read()[-3000:])
        self.assertEqual(len(b.nodes()), nodes_before)
        back = await self.done(b, b.runtime_action(rid, "stop"))
        self.assertEqual(back["status"], "succeeded", back)
        new.reload()
        self.assertEqual(new.status, "exited")
        await self.stop_original(b, again)
        await deferLater(reactor, 0, lambda: None)

    async def test_original_0_1_8(self) -> None:
        await self.run_version("0.1.8")

    async def test_original_0_1_13(self) -> None:
        await self.run_version("0.1.13")


class JudgeTests(AgentTestCase):
    """Each rule of adoption against the real engine, one container at a time."""

    def setUp(self) -> None:
        from tests.support.docker_env import require_docker

        self.env = require_docker()
        self.client = self.env.client()
        self.client.images.get(BUSYBOX).tag(OTHER_IMAGE)

    def make(self, name: str, image: str = BUSYBOX, labels: dict[str, str] | None = None) -> Any:
        c = self.client.containers.create(image, ["sh", "-c", "exec sleep 60"], name=name, labels=labels or {})
        self.addCleanup(lambda: c.remove(force=True))
        return c

    def judge(self, name: str, image: str, container_id: str | None = None) -> Any:
        from llmport_agent.workloads.adoption import Candidate, judge

        return judge(self.client, Candidate("rt-1", name, image, container_id), "me")

    def test_the_rules(self) -> None:
        from llmport_agent.workloads.spec import LABEL_AGENT_ID, MANAGED_VALUE

        suffix = os.urandom(3).hex()
        right = self.make(f"llm-port-right-{suffix}")
        self.assertEqual(self.judge(right.name, BUSYBOX).container_id, right.id)
        self.assertEqual(self.judge(right.name, BUSYBOX, right.id[:12]).container_id, right.id)
        # Name matches, image differs (no id recorded: the image alone must refuse it).
        other = self.make(f"llm-port-other-{suffix}", OTHER_IMAGE)
        v = self.judge(other.name, BUSYBOX)
        self.assertIsNone(v.container_id)
        self.assertIn(OTHER_IMAGE, v.refused)
        # Another container now holds the name.
        self.assertIn("not the container the mapping names", self.judge(right.name, BUSYBOX, "0" * 12).refused)
        plain = self.make(f"someone-{suffix}")
        self.assertIn("does not start with llm-port-", self.judge(plain.name, BUSYBOX).refused)
        self.assertIn("no container", self.judge(f"llm-port-absent-{suffix}", BUSYBOX).refused)
        theirs = self.make(f"llm-port-theirs-{suffix}", labels={LABEL_MANAGED: MANAGED_VALUE, LABEL_AGENT_ID: "x"})
        self.assertIn("managed by agent 'x'", self.judge(theirs.name, BUSYBOX).refused)
        mine = self.make(f"llm-port-mine-{suffix}", labels={LABEL_MANAGED: MANAGED_VALUE, LABEL_AGENT_ID: "me"})
        self.assertIn("already this agent's own", self.judge(mine.name, BUSYBOX).refused)

    def test_a_bind_source_inside_a_container_written_directory_is_refused(self) -> None:
        """
        The engine resolves a bind source again at every start, and this agent starts and
        restarts what it adopts: a container binding a path inside the model store (workloads
        write it) is not adopted; one binding the store itself (as the original does) is.
        """
        from llmport_agent.workloads.adoption import Candidate, judge

        store = os.path.abspath(self.mktemp())
        os.makedirs(os.path.join(store, "hub"))
        suffix = os.urandom(3).hex()
        for source, adopted in ((store, True), (os.path.join(store, "hub"), False)):
            c = self.client.containers.create(BUSYBOX, ["sleep", "60"], name=f"llm-port-bind-{adopted}-{suffix}",
                                              volumes={source: {"bind": "/data", "mode": "rw"}})
            self.addCleanup(c.remove, force=True)
            v = judge(self.client, Candidate("rt-1", c.name, BUSYBOX, None), "me", (store, "/var/lib/llm-port/ray"))
            self.assertEqual(v.container_id == c.id, adopted, v.refused)
            if not adopted:
                self.assertIn("which containers write", v.refused)

    def test_recorded_id_must_be_a_real_short_id(self) -> None:
        right = self.make(f"llm-port-idcheck-{os.urandom(3).hex()}")
        self.assertEqual(self.judge(right.name, BUSYBOX, right.id.upper()).container_id, right.id)
        # A true prefix of the id, but too short (or not hex) to name one container: refused.
        for recorded in [right.id[:1], right.id[:11], right.id[:11] + "g", right.id[:12] + " x"]:
            v = self.judge(right.name, BUSYBOX, recorded)
            self.assertIsNone(v.container_id, recorded)
            self.assertIn("is not 12 to 64 hex characters", v.refused)

    def test_malformed_mapping_entries_are_never_candidates(self) -> None:
        from llmport_agent.workloads.adoption import candidates

        found, bad = candidates({"workloads": {
            "rt-ok": {"container_name": "llm-port-a", "image": "busybox"},
            "rt-bad-name": {"container_name": "../../etc", "image": "busybox"},
            "rt-no-image": {"container_name": "llm-port-b"},
            "bad id with spaces": {"container_name": "llm-port-c", "image": "busybox"},
            "rt-list": ["not", "an", "object"],
        }})
        self.assertEqual([c.runtime_id for c in found], ["rt-ok"])
        self.assertEqual(len(bad), 4)
        self.assertEqual(candidates({"workloads": "nonsense"}), ([], []))
