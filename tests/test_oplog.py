"""
The log an operator follows (issue 22, point 0):

 - one line per command outcome, from the pipeline, INFO for a success and WARNING for a
   failure, naming the type, runtime, duration and the error code and message (in-process for
   every kind of outcome, and through a real `llmport-agent run`'s JSON output);
 - third-party lines that repeat the agent's own are dropped (ClientService's "Scheduling
   retry", Autobahn's "dropping connection"), and the agent's own retry line gives the delay
   rounded and the attempt counted across refused upgrades;
 - the pickup histogram (issued_at -> handler start).
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
from typing import Any

from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.core.logsetup import ThirdPartyRepeats, make_observer
from tests.agentharness import AgentTestCase
from tests.test_pipeline import Harness, command
from tests.test_process import _ProcessBase


class Events:
    """Every log event while the test runs."""

    def __init__(self, case: Any) -> None:
        self.events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(self.events.append)
        case.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def outcomes(self, cid: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("outcome") and e.get("id") == cid
                and str(e.get("log_namespace")).startswith("llmport_agent.commands.pipeline")]

    def about(self, cid: str) -> list[dict[str, Any]]:
        """Every pipeline line at INFO or above that names the command."""
        return [e for e in self.events if str(e.get("log_namespace")).startswith("llmport_agent.commands.pipeline")
                and e.get("id") == cid and e.get("log_level") in (LogLevel.info, LogLevel.warn, LogLevel.error)]


def text(event: dict[str, Any]) -> str:
    from twisted.logger import formatEvent

    return formatEvent(event)


class OutcomeLineTests(SynchronousTestCase):
    def one(self, events: Events, cid: str, level: LogLevel) -> str:
        lines = events.outcomes(cid)
        self.assertEqual(len(lines), 1, [text(e) for e in lines])
        self.assertEqual(lines[0]["log_level"], level)
        return text(lines[0])

    def test_success_is_one_info_line(self) -> None:
        """Type, runtime, duration and a short result summary; nothing else about the command."""
        events = Events(self)
        h = Harness(self)
        c = command("gated", {"runtime_id": "rt-1"})
        h.deliver(c)
        h.clock.advance(2.5)
        h.gates[c["id"]].callback({"container_id": "abc123", "status": "running", "logs": ["x"] * 100})
        line = self.one(events, c["id"], LogLevel.info)
        self.assertEqual(line, f"Command {c['id']} gated on runtime rt-1 succeeded in 2.50 s "
                               "(container_id=abc123, status=running)")
        self.assertEqual(len(events.about(c["id"])), 1)

    def test_command_failed_is_one_warning_with_code_and_message(self) -> None:
        events = Events(self)
        h = Harness(self)
        c = command("fails", {"runtime_id": "rt-2"})
        h.deliver(c)
        line = self.one(events, c["id"], LogLevel.warn)
        self.assertIn("fails on runtime rt-2 failed in 0.00 s: runtime_error: the thing failed", line)
        self.assertEqual(events.outcomes(c["id"])[0]["error_code"], "runtime_error")

    def test_every_failure_kind_logged_once_with_its_code(self) -> None:
        """Unknown type, malformed, refused by maintenance, timed out, handler crash: one WARNING each."""
        events = Events(self)
        h = Harness(self)
        unknown = command("no_such_type")
        malformed = command("noop", payload="not an object")
        crash = command("boom")
        slow = command("gated", {"runtime_id": "slow"})
        h.deliver(unknown, malformed, crash, slow)
        h.clock.advance(61)
        h.state.note(maintenance=True)
        blocked = command("deploy_workload", {"runtime_id": "r"})
        h.deliver(blocked)
        codes = {}
        for c in (unknown, malformed, crash, slow, blocked):
            self.one(events, c["id"], LogLevel.warn)
            codes[c["command_type"]] = events.outcomes(c["id"])[0]["error_code"]
            frame = h.frames_for(c["id"])[-1]
            self.assertEqual(frame["error_code"], codes[c["command_type"]])
            self.assertEqual(len(events.about(c["id"])), 1, [text(e) for e in events.about(c["id"])])
        self.assertEqual(codes["no_such_type"], "invalid_command")
        self.assertEqual(codes["boom"], "internal_error")
        self.assertEqual(codes["gated"], "timed_out")
        self.assertEqual(codes["deploy_workload"], "policy_violation")
        self.flushLoggedErrors(RuntimeError)

    def test_interrupted_unsafe_command_one_warning(self) -> None:
        """A command the last stop interrupted, not safe to repeat: one WARNING, agent_restarted."""
        h = Harness(self)
        c = command("gated_unsafe", {"runtime_id": "r"})
        h.deliver(c)
        h.pipeline.stopService()
        events = Events(self)
        Harness(self, directory=h.dir)
        line = self.one(events, c["id"], LogLevel.warn)
        self.assertIn("gated_unsafe on runtime r failed in 0.00 s: agent_restarted: The agent restarted", line)
        warnings = [e for e in events.about(c["id"]) if e["log_level"] != LogLevel.info]
        self.assertEqual(len(warnings), 1, [text(e) for e in warnings])

    def test_pickup_histogram(self) -> None:
        """issued_at 90 s before the handler starts: the 60-300 s bucket of the command's type."""
        h = Harness(self)
        h.clock.advance(1_700_000_000)
        c = command("noop", issued_at="2023-11-14T22:12:50+00:00")  # 1_699_999_970 + 60 s
        h.clock.advance(60)
        h.deliver(c)
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for m in h.pipeline.pickup.collect() for s in m.samples}
        count = samples[("llmport_agent_command_pickup_seconds_count", (("type", "noop"),))]
        self.assertEqual(count, 1)
        le60 = samples[("llmport_agent_command_pickup_seconds_bucket", (("le", "60.0"), ("type", "noop")))]
        le300 = samples[("llmport_agent_command_pickup_seconds_bucket", (("le", "300.0"), ("type", "noop")))]
        self.assertEqual((le60, le300), (0, 1))
        # A type outside the registry does not grow the label set.
        h.pipeline.pickup.observe("evil-" + "x" * 100, 1)
        labels = {s.labels.get("type") for m in h.pipeline.pickup.collect() for s in m.samples}
        self.assertEqual(labels, {"noop", "other"})


class ThirdPartyFilterTests(SynchronousTestCase):
    def test_drops_only_the_repeats(self) -> None:
        f = ThirdPartyRepeats()
        from twisted.logger import PredicateResult

        retry = {"log_namespace": "twisted.application._client_service",
                 "log_format": "Scheduling retry {attempt} to connect {endpoint} in {delay} seconds."}
        drop = {"log_namespace": "autobahn.twisted.websocket.WebSocketClientProtocol",
                "log_format": "dropping connection to peer {peer} with abort={abort}: {reason}"}
        ours = {"log_namespace": "llmport_agent.session.service", "log_format": "Scheduling retry {n}"}
        other = {"log_namespace": "autobahn.x", "log_format": "something else"}
        self.assertEqual([f(e) for e in (retry, drop, ours, other)],
                         [PredicateResult.no, PredicateResult.no, PredicateResult.maybe, PredicateResult.maybe])


class RefusedUpgradeLogTests(AgentTestCase):
    async def test_one_line_per_refusal_with_rounded_delay_and_counted_attempts(self) -> None:
        """
        A credential the backend refuses (HTTP 401 on the upgrade), over real loopback: the JSON
        log has one agent line per attempt, with the delay to one decimal and attempts 1, 2, 3;
        no "Scheduling retry" and no "dropping connection" line.
        """
        out = io.StringIO()
        observer = make_observer("INFO", stream=out, json=True)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        backend = await self.start_backend()
        state_dir = os.path.abspath(self.mktemp())
        os.makedirs(state_dir)
        with open(os.path.join(state_dir, "state.json"), "w") as f:
            json.dump({"credential": "not-a-credential", "node_id": "n-1"}, f)
        self.allow_anomalies(".", "the stream is refused on purpose")
        agent = self.start_agent(backend, state_dir=state_dir, token=False, RECONNECT_MIN_SEC="0.3",
                                 RECONNECT_MAX_SEC="0.6")
        # whoami says the credential is unknown (a deleted node): retries slow down to this.
        agent.session.refusals.revoked_retry_seconds = 0.5

        def retry_lines() -> list[dict[str, Any]]:
            rows = [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]
            return [r for r in rows if "retrying in" in r["message"]]

        await backend.wait_for(lambda: len(retry_lines()) >= 3, 20)
        await self.stop_agent(agent)
        rows = [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]
        messages = [r["message"] for r in rows]
        self.assertEqual([m for m in messages if "Scheduling retry" in m or "dropping connection" in m], [])
        lines = retry_lines()
        attempts = [int(re.search(r"\(attempt (\d+)", r["message"]).group(1)) for r in lines]  # type: ignore[union-attr]
        self.assertEqual(attempts[:3], [1, 2, 3])
        for r in lines:
            self.assertRegex(r["message"], r"^The backend (refused|still refuses) the stream \(HTTP 40[13]\).*; "
                                           r"retrying in \d+\.\d s \(attempt \d+(, refusal \d+)?\)$")
            self.assertEqual(r["level"], "warn")
        # Nothing else said per refusal: one line per attempt from the session.
        per_attempt = [r["message"] for r in rows if "refuse" in r["message"].lower()
                       and r["logger"].startswith("llmport_agent.session") and r["level"] == "warn"]
        self.assertEqual(len(per_attempt), len(lines), per_attempt)


class ProcessOutcomeLogTests(_ProcessBase):
    async def test_deploy_failure_names_its_code_in_the_output(self) -> None:
        """
        `llmport-agent run` (JSON lines, as under systemd): a deploy on a node whose engine is
        down is one WARNING line naming the result's error code; a node command that works is
        one INFO line; neither has a second line about its outcome.
        """
        b = await self.backend()
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        from tests.agentharness import agent_env

        env = agent_env(b, d, ENROLLMENT_TOKEN=b.mint_token()["token"], LOG_FORMAT="json")
        env["DOCKER_HOST"] = "unix://" + os.path.join(d, "no-docker.sock")
        proc = self.start([sys.executable, "-m", "llmport_agent.cli", "run"], env)
        agent_id = env["LLM_PORT_NODE_AGENT_AGENT_ID"]
        await b.wait_for(lambda: b.node_by_agent_id(agent_id) is not None, 30)
        node_id = b.node_by_agent_id(agent_id)["id"]
        await b.wait_for(lambda: b.connection_count(node_id) == 1, 10)
        deploy = b.issue_command(node_id, "deploy_workload", {
            "runtime_id": "rt-log", "provider": "vllm", "image": "vllm/vllm-openai:latest",
            "model": "m", "port": 8000})
        ok = b.issue_command(node_id, "refresh_inventory", {})
        await b.wait_for(lambda: b.command(deploy["id"])["status"] in ("failed", "succeeded")
                         and b.command(ok["id"])["status"] in ("failed", "succeeded"), 60)
        await deferLater(reactor, 0.5, lambda: None)
        code = b.command(deploy["id"])["error_code"]
        self.assertTrue(code)
        rows = []
        for line in self.output().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        mine = [r for r in rows if r.get("id") == deploy["id"] and r.get("outcome")]
        self.assertEqual(len(mine), 1, mine)
        self.assertEqual(mine[0]["level"], "warn")
        self.assertEqual(mine[0]["error_code"], code)
        self.assertIn("deploy_workload on runtime rt-log failed in ", mine[0]["message"])
        self.assertIn(f": {code}: ", mine[0]["message"])
        good = [r for r in rows if r.get("id") == ok["id"] and r.get("outcome")]
        self.assertEqual([r["level"] for r in good], ["info"])
        self.assertIn("refresh_inventory succeeded in", good[0]["message"])
        proc.terminate()
        await b.wait_for(lambda: proc.poll() is not None, 30)


class ProcessExitTests(_ProcessBase):
    async def test_gone_right_after_the_stopped_line(self) -> None:
        """
        After "llmport-agent stopped" the process ends at once, exit 0: the interpreter's
        teardown (what kept it alive for a while after the line) does not run, which an atexit
        handler in the child shows deterministically (bench/bench_stop_exit.py has the figures).
        """
        b = await self.backend()
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        from tests.agentharness import agent_env

        env = agent_env(b, d, ENROLLMENT_TOKEN=b.mint_token()["token"], LOG_FORMAT="json")
        child = ("import atexit, sys; atexit.register(lambda: print('ATEXIT-RAN', flush=True)); "
                 "from llmport_agent.cli import main; sys.exit(main(['run']))")
        proc = self.start([sys.executable, "-c", child], env)
        agent_id = env["LLM_PORT_NODE_AGENT_AGENT_ID"]
        await b.wait_for(lambda: b.node_by_agent_id(agent_id) is not None, 30)
        node_id = b.node_by_agent_id(agent_id)["id"]
        await b.wait_for(lambda: b.connection_count(node_id) == 1, 10)
        proc.terminate()
        await b.wait_for(lambda: proc.poll() is not None, 30)
        self.assertEqual(proc.returncode, 0, self.output()[-2000:])
        output = self.output()
        self.assertIn("llmport-agent stopped", output)
        self.assertNotIn("ATEXIT-RAN", output)
        after = [json.loads(line)["message"] for line in output.splitlines() if line.startswith("{")]
        after = after[after.index("llmport-agent stopped") + 1:]
        self.assertEqual(after, ["Main loop terminated."])
