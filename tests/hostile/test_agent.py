"""
Hostile tests: the agent against a flaky network, a buggy or malicious backend, and an unlucky
operator. Each test states the attack in its docstring. A failing test here is a real bug.

Unit-style tests use the pipeline L{Harness} (Clock, synchronous runner, no sleeps);
integration tests run a real agent against the stand-in backend (or a small hostile HTTP
server) on loopback only.
"""

from __future__ import annotations

import errno
import glob
import json
import math
import os
import time
import uuid
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, fail
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.task import Clock, deferLater
from twisted.logger import eventAsJSON, formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from llmport_agent.commands.base import CommandContext, HandlerSpec
from llmport_agent.commands.journal import CommandJournal
from llmport_agent.core.config import ConfigError, load_config
from llmport_agent.core.state import StateStore
from llmport_agent.core.storage import append_records, encode_line
from llmport_agent.demo.testing import FakeSession, SynchronousRunner
from llmport_agent.devbackend import _http as dev_http
from llmport_agent.devbackend import _stream as dev_stream
from llmport_agent.devbackend._state import GENERATION_APRIL, GENERATION_CURRENT
from llmport_agent.events.outbox import EventOutbox
from llmport_agent.session import keepalive as keepalive_module
from llmport_agent.session.rotation import ROTATION_INTERVAL
from llmport_agent.session.service import SessionService
from llmport_agent.session.stop import CRITICAL_STOP_GRACE
from tests.agentharness import AgentTestCase
from tests.test_pipeline import Harness, command

TERMINAL = ("succeeded", "failed")


def sleep(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


def wire_command(node_id: str, ctype: str, payload: Any, **extra: Any) -> dict[str, Any]:
    cid = str(uuid.uuid4())
    obj = {
        "id": cid, "node_id": node_id, "command_type": ctype, "status": "dispatched",
        "correlation_id": None, "idempotency_key": cid, "payload": payload, "result": None,
        "timeout_sec": None, "error_code": None, "error_message": None,
        "issued_at": "2020-01-01T00:00:00+00:00", "dispatched_at": "2020-01-01T00:00:01+00:00",
        "acked_at": None, "started_at": None, "completed_at": None,
    }
    obj.update(extra)
    return obj


class DiskFullRunner(SynchronousRunner):
    """A synchronous runner whose journal appends fail with ENOSPC while C{full(lines)} says so."""

    def __init__(self) -> None:
        super().__init__()
        self.full = lambda lines: False

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Deferred[Any]:
        if fn is append_records and self.full(b"".join(encode_line(r) for r in args[1])):
            return fail(OSError(errno.ENOSPC, "No space left on device"))
        return super().run(fn, *args, **kwargs)


def disk_full_harness(case: SynchronousTestCase) -> tuple[Harness, DiskFullRunner]:
    h = Harness(case)
    runner = DiskFullRunner()
    h.runner = runner
    h.journal.runner = runner
    assert h.journal._log is not None
    h.journal._log._runner = runner
    return h, runner


class LogCapture:
    """
    Every log event as a JSON log observer (--json-logs) and a text observer would write it;
    the stand-in backend's own events (it runs in the same process) are not the agent's.
    """

    def __init__(self, case: Any) -> None:
        self.texts: list[str] = []
        globalLogPublisher.addObserver(self)  # type: ignore[arg-type]
        case.addCleanup(globalLogPublisher.removeObserver, self)

    def __call__(self, event: dict[str, Any]) -> None:
        if str(event.get("log_namespace", "")).startswith("llmport_agent.devbackend"):
            return
        parts = []
        try:
            parts.append(formatEvent(event))
        except Exception:
            pass
        failure = event.get("log_failure")
        if failure is not None:
            parts.append(failure.getTraceback())
        try:
            parts.append(eventAsJSON(event))
        except Exception:
            pass
        self.texts.append("\n".join(parts))

    def text(self) -> str:
        return "\n".join(self.texts)


# --------------------------------------------------------------------------------------------
# Unit-style attacks on the command pipeline, the journal, the outbox, the config
# --------------------------------------------------------------------------------------------


class PipelineAttacks(SynchronousTestCase):
    def test_non_ascii_signature_still_gets_a_result(self) -> None:
        """
        A backend (future or malicious) sends a command whose C{signature} holds non-ASCII
        characters. It must be refused with a failed C{signature_invalid} result after the
        ack, never acked and left without a result.
        """
        h = Harness(self)
        c = command("noop")
        c["signature"] = "\u00e9" * 64
        h.deliver(c)
        self.flushLoggedErrors()
        self.assertEqual(h.kinds_for(c["id"]), ["command_ack", "command_result"])
        self.assertEqual(h.frames_for(c["id"])[-1]["error_code"], "signature_invalid")
        self.assertEqual(h.calls, [])

    def test_disk_full_on_receipt_never_acks_an_unrecorded_command(self) -> None:
        """
        The disk is full (ENOSPC) when a command arrives: it cannot be journaled, so it must
        not be acked. When the backend lists it again after the disk has room, it must run and
        get its result, not be acked from memory and then forgotten.
        """
        h, runner = disk_full_harness(self)
        runner.full = lambda lines: True
        c = command("noop")
        h.deliver(c)
        self.flushLoggedErrors(OSError)
        self.assertEqual(h.kinds_for(c["id"]), [])
        runner.full = lambda lines: False
        h.deliver(c)  # the backend lists it again: it was never acked
        self.flushLoggedErrors(OSError)
        kinds = h.kinds_for(c["id"])
        self.assertEqual(h.calls, [("noop", c["id"])], kinds)
        self.assertEqual(kinds.count("command_result"), 1, kinds)

    def test_disk_full_while_recording_result_still_delivers_it(self) -> None:
        """
        ENOSPC hits exactly the journal write of a command's result (the command was acked).
        Once the disk has room again the backend must get exactly one result on the same
        connection (the backend never re-sends an acked command; silence = stuck forever).
        """
        h, runner = disk_full_harness(self)
        runner.full = lambda lines: b'"state":"finished"' in lines
        c = command("noop")
        h.deliver(c)
        self.flushLoggedErrors(OSError)
        self.assertIn("command_ack", h.kinds_for(c["id"]))
        runner.full = lambda lines: False
        h.clock.advance(600)
        h.deliver(command("noop"))  # life goes on: more frames, more journal writes
        h.clock.advance(600)
        self.flushLoggedErrors(OSError)
        self.assertEqual(h.kinds_for(c["id"]).count("command_result"), 1, h.kinds_for(c["id"]))

    def test_same_uuid_in_another_spelling_runs_once(self) -> None:
        """
        A buggy backend re-sends a command with its UUID in upper case (the same UUID value:
        the backend parses C{command_id} as a UUID, so both spellings are one command). The
        agent must not run it a second time.
        """
        h = Harness(self)
        c = command("noop")
        h.deliver(c)
        again = dict(c, id=c["id"].upper())
        h.deliver(again)
        self.assertEqual(len(h.calls), 1, h.calls)

    def test_colliding_id_with_different_content_is_ignored(self) -> None:
        """A finished command id re-sent with another type and payload runs nothing more."""
        h = Harness(self)
        c = command("noop")
        h.deliver(c)
        evil = dict(c, command_type="boom", payload={"runtime_id": "x" * 10000})
        h.deliver(evil)
        h.pipeline.frame_received({"type": "hello_ack", "commands": [evil], "profile": None})
        self.assertEqual(h.calls, [("noop", c["id"])])
        results = [f for f in h.frames_for(c["id"]) if f["type"] == "command_result"]
        self.assertTrue(results)
        # The first result is the run's; every later one replays it (protocol 10.2), never
        # the colliding command's outcome.
        self.assertEqual(results[0]["result"], {"ok": True})
        for r in results[1:]:
            self.assertTrue(r["success"])
            self.assertEqual(r["result"], {"ok": True, "replayed": True})
        self.assertEqual(self.flushLoggedErrors(), [])

    def test_three_thousand_commands_in_one_frame(self) -> None:
        """One commands frame with 3000 commands: each gets exactly one ack and one result."""
        h = Harness(self, max_concurrent=8)
        cs = [command("noop", {"runtime_id": f"r{i % 50}"}) for i in range(3000)]
        started = time.monotonic()
        h.deliver(*cs)
        self.assertLess(time.monotonic() - started, 90)  # generous: fsync-bound on a shared disk
        per_id: dict[str, list[str]] = {}
        for f in h.session.frames:
            per_id.setdefault(f.get("command_id", ""), []).append(f["type"])
        for c in cs:
            kinds = per_id.get(c["id"], [])
            self.assertEqual((kinds.count("command_ack"), kinds.count("command_result")), (1, 1))
        self.assertEqual(len(h.calls), 3000)

    def test_huge_correlation_id_and_type_respect_event_limits(self) -> None:
        """A 100 000-character correlation_id never reaches an event beyond 128 characters."""
        h = Harness(self)
        c = command("noop", correlation_id="c" * 100000)
        h.deliver(c)
        h.outbox.flush()
        for batch in h.session.of_type("event_batch"):
            for e in batch["events"]:
                self.assertLessEqual(len(e["event_type"]), 128)
                self.assertLessEqual(len(e["correlation_id"] or ""), 128)
                self.assertLessEqual(len(e["severity"]), 32)
        self.assertTrue(h.session.of_type("event_batch"))
        long_type = command("x" * 129)
        h.deliver(long_type)
        self.assertEqual(h.frames_for(long_type["id"])[-1]["error_code"], "invalid_command")

    def test_registry_password_never_written_to_the_journal(self) -> None:
        """
        A deploy payload carries registry credentials. The README promises they are "kept in
        memory only": the command journal on disk (commands.jsonl) must not hold them.
        """
        h = Harness(self)
        secret = "R3gistry-S3cret-Passw0rd"
        c = command("deploy_workload", {
            "runtime_id": "r1", "provider_type": "vllm",
            "provider_config": {"image": "registry.example/org/vllm:1",
                                "registry_auth": {"username": "bot", "password": secret}},
        })
        h.deliver(c)
        h.gates[c["id"]].callback({"endpoint_url": "http://h:8000"})
        with open(os.path.join(h.dir, "commands.jsonl")) as f:
            self.assertNotIn(secret, f.read())

    def test_stop_then_commands_arrive(self) -> None:
        """
        Commands arrive after the pipeline was told to stop: nothing runs now, and at the next
        start each is run and gets exactly one result.
        """
        h = Harness(self)
        h.pipeline.stopService()
        c = command("noop")
        h.deliver(c)
        self.assertEqual(h.calls, [])
        self.assertNotIn("command_result", h.kinds_for(c["id"]))
        h2 = Harness(self, directory=h.dir)
        self.assertEqual(h2.calls, [("noop", c["id"])])
        self.assertEqual(h2.kinds_for(c["id"]).count("command_result"), 1)


class DurableFileAttacks(SynchronousTestCase):
    def _dir(self) -> str:
        d = self.mktemp()
        os.makedirs(d)
        return d

    def test_journal_with_garbage_lines_still_loads(self) -> None:
        """
        commands.jsonl holds torn lines, non-objects and objects with fields of the wrong
        type (a hand edit, a downgrade). Loading must skip what it cannot use and keep the
        good records; it must never stop the agent from starting.
        """
        d = self._dir()
        path = os.path.join(d, "commands.jsonl")
        good = str(uuid.uuid4())
        lines = [
            json.dumps({"id": str(uuid.uuid4()), "state": "delivered", "finished_at": "yesterday"}),
            json.dumps({"id": str(uuid.uuid4()), "state": "finished", "result_frame": "oops"}),
            '{"id": 5}', "garbage", "[1, 2]", '{"id": "torn", "sta',
            json.dumps({"id": good, "state": "delivered", "command_type": "noop", "finished_at": 1}),
        ]
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        journal = CommandJournal(SynchronousRunner(), path, lambda: 2.0)
        self.successResultOf(journal.load())
        self.assertIsNotNone(journal.get(good))

    def test_outbox_with_garbage_lines_still_loads(self) -> None:
        """events.jsonl with an ack marker of the wrong type must not stop the agent from starting."""
        d = self._dir()
        path = os.path.join(d, "events.jsonl")
        with open(path, "w") as f:
            f.write('{"ack": "x"}\n{"n": 1, "event": {"event_type": "a"}}\n{"dropped": "many", "ack": 0}\n')
        outbox = EventOutbox(Clock(), SynchronousRunner(), path, FakeSession())
        self.successResultOf(outbox.load())

    def test_loki_password_never_shown(self) -> None:
        """
        LOKI_URL=http://user:password@host: the README says the password "is never logged".
        Neither the configuration error text nor the masked configuration (shown by
        `llmport-agent config` and in collect_diagnostics) may contain it.
        """
        pw = "L0ki-Passw0rd-xyz"
        with self.assertRaises(ConfigError) as cm:
            load_config({"LLM_PORT_NODE_AGENT_LOKI_URL": f"http://bot:{pw}@127.0.0.1:3100/?x=1"}, {})
        self.assertNotIn(pw, str(cm.exception))
        config = load_config({"LLM_PORT_NODE_AGENT_LOKI_URL": f"http://bot:{pw}@127.0.0.1:3100"}, {})
        self.assertNotIn(pw, json.dumps(config.masked()))


class FakeRotateBackend:
    def __init__(self) -> None:
        self.rotations = 0

    async def rotate(self, credential: str, timeout: float) -> tuple[str, str]:
        self.rotations += 1
        return "node", f"{uuid.uuid4()}.{'n' * 43}"


class ClockJumpTests(SynchronousTestCase):
    def test_rotation_survives_wall_clock_jumping_back(self) -> None:
        """
        The host booted with its clock years ahead (dead RTC), enrolled, then NTP set the
        clock back. Rotation must still happen about every 12 h, not be postponed for years.
        """
        d = self.mktemp()
        os.makedirs(d)
        now = [1_700_000_000.0]
        clock = Clock()
        state = StateStore(SynchronousRunner(), os.path.join(d, "state.json"))
        self.successResultOf(state.load())
        self.successResultOf(state.update(credential=f"{uuid.uuid4()}.{'o' * 43}",
                                          last_rotation_at=now[0] + 10 * 365 * 86400))
        config = load_config({"LLM_PORT_NODE_AGENT_STATE_PATH": state.path}, {})
        backend = FakeRotateBackend()
        session = SessionService(clock, config, state, backend, Deferred,  # type: ignore[arg-type]
                                 lambda *a: None, version="x", wallclock=lambda: now[0])

        class Proto:
            opened_at = 0.0

        session.proto = Proto()  # type: ignore[assignment]
        clock.advance(3600)
        for _ in range(3):
            session.rotation.tick()
            now[0] += ROTATION_INTERVAL + 600
            clock.advance(600)
        session.rotation.tick()
        self.assertGreaterEqual(backend.rotations, 1)


# --------------------------------------------------------------------------------------------
# Integration: a real agent, hostile backends
# --------------------------------------------------------------------------------------------


class HostileStream(dev_stream.StreamProtocol):
    """Sends garbage hello_acks and the pending commands before the real hello_ack."""

    def onOpen(self) -> None:
        for junk in (
            {"type": "hello_ack", "session_id": 5, "node_id": ["x"], "commands": {"a": 1}, "profile": "nope"},
            {"type": "hello_ack", "session_id": None, "node_id": 42, "commands": None, "profile": [1]},
            {"type": "hello_ack"},
        ):
            self.sendMessage(json.dumps(junk).encode())
        node_id = self.node_id
        if node_id is not None and node_id in self.backend.state.nodes:
            items = self.backend.state.take_dispatch(node_id)
            self.sendMessage(json.dumps({"type": "commands", "items": items}).encode())
        super().onOpen()


class DeafStream(dev_stream.StreamProtocol):
    """Never answers WebSocket pings while C{deaf} is set."""

    deaf = True

    def onPing(self, payload: bytes) -> None:
        if not self.deaf:
            super().onPing(payload)


class _BlackHole:
    """
    A TCP proxy on loopback to the stand-in backend. Once C{swallow()} is called, the
    connections open at that moment stay open and are read, but nothing is forwarded either
    way (a middlebox that lost its state, a backend host gone silently): TCP stays healthy,
    only the keep-alive can tell. Connections opened later are forwarded again.
    """

    def __init__(self, target_port: int) -> None:
        from twisted.internet.protocol import ClientFactory, Factory, Protocol

        self.swallowing: set[Any] = set()
        self.pairs: list[tuple[Any, Any]] = []
        hole = self

        class Outbound(Protocol):
            def connectionMade(self) -> None:
                self.inbound = self.factory.inbound  # type: ignore[attr-defined]
                self.inbound.outbound = self
                hole.pairs.append((self.inbound, self))
                self.inbound.transport.resumeProducing()
                for data in self.inbound.pending:
                    self.transport.write(data)
                self.inbound.pending = []

            def dataReceived(self, data: bytes) -> None:
                if self.inbound not in hole.swallowing:
                    self.inbound.transport.write(data)

            def connectionLost(self, reason: Any = None) -> None:
                self.inbound.transport.loseConnection()

        class Inbound(Protocol):
            outbound: Any = None

            def connectionMade(self) -> None:
                self.pending: list[bytes] = []
                self.transport.pauseProducing()
                factory = ClientFactory()
                factory.protocol = Outbound
                factory.inbound = self  # type: ignore[attr-defined]
                reactor.connectTCP("127.0.0.1", target_port, factory)  # type: ignore[attr-defined]

            def dataReceived(self, data: bytes) -> None:
                if self in hole.swallowing:
                    return
                if self.outbound is None:
                    self.pending.append(data)
                else:
                    self.outbound.transport.write(data)

            def connectionLost(self, reason: Any = None) -> None:
                hole.swallowing.discard(self)
                if self.outbound is not None:
                    self.outbound.transport.loseConnection()

        self.factory = Factory.forProtocol(Inbound)

    def swallow(self) -> None:
        self.swallowing = {inbound for inbound, _ in self.pairs if inbound.transport.connected}

    def close_all(self) -> None:
        for inbound, outbound in self.pairs:
            inbound.transport.abortConnection()
            outbound.transport.abortConnection()


class HostileBackendTests(AgentTestCase):
    async def test_garbage_hello_and_commands_before_hello(self) -> None:
        """
        The backend sends garbage hello_acks (wrong types everywhere) and the pending commands
        before the real hello_ack, on every connection: the session stays up, the node id and
        profile are not corrupted, each command gets exactly one ack and one result.
        """
        self.patch(dev_stream.StreamFactory, "protocol", HostileStream)
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        cmd = backend.issue_command(node_id, "refresh_inventory", {})
        backend.drop_connections(node_id)
        await backend.wait_for(lambda: backend.command(cmd["id"])["status"] in TERMINAL)
        await sleep(0.5)
        self.assertEqual(agent.session.node_id, node_id)
        self.assertIsNone(agent.modes.profile)
        kinds = [e["event_type"] for e in backend.timeline(cmd["id"])]
        self.assertEqual((kinds.count("acked"), kinds.count("result")), (1, 1), kinds)
        self.assertEqual(backend.command(cmd["id"])["status"], "succeeded")
        self.assertEqual(backend.connection_count(node_id), 1)

    async def test_deeply_nested_frame_does_not_cost_the_session(self) -> None:
        """
        The backend relays a command whose payload (free-form for host_op) is nested 1200
        levels deep: valid JSON of 2.4 KB. The README promises that a bad inbound frame gets
        one log line and changes nothing else; it must not drop the connection (the backend
        would list the same command in every reply, forever).
        """
        self.allow_anomalies(r"^command_(ack|result) for unknown command .* ignored$",
                             "the poison command is written on the stream by the test, not issued "
                             "by the backend, so the agent's answers to it are for an unknown id")
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        opens = agent.session.stats.opens
        proto = backend.streams(node_id)[0]
        poison = wire_command(node_id, "host_op", {"deep": "DEEP"})
        text = json.dumps({"type": "commands", "items": [poison]})
        proto.sendMessage(text.replace('"DEEP"', "[" * 1200 + "]" * 1200).encode())
        await sleep(1.0)
        self.flushLoggedErrors(RecursionError)
        self.assertEqual(agent.session.stats.opens, opens)
        self.assertIs(agent.session.proto and agent.session.proto.factory.session, agent.session)
        cmd = backend.issue_command(node_id, "refresh_inventory", {})
        await backend.wait_for(lambda: backend.command(cmd["id"])["status"] == "succeeded")
        self.assertEqual(agent.session.stats.opens, opens)

    async def test_one_oversized_command_does_not_block_the_queue(self) -> None:
        """
        An admin issues a command with a 9 MB payload (an inline manifest of many files, a
        big free-form host_op). The backend lists it, oldest first, in every commands reply.
        It must get a failed result, and a small command issued after it must still run:
        ignoring the whole frame would block every later command of the node forever.
        """
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        big = backend.issue_command(node_id, "host_op", {"blob": "x" * (9 * 1024 * 1024)})
        small = backend.issue_command(node_id, "collect_diagnostics", {})
        try:
            await backend.wait_for(lambda: backend.command(small["id"])["status"] in TERMINAL, 6)
        except TimeoutError:
            pass
        finally:
            backend.faults.hold_commands = True
        self.assertEqual(backend.command(small["id"])["status"], "succeeded")
        self.assertEqual(backend.command(big["id"])["status"], "failed")

    async def test_nan_in_results_progress_and_events(self) -> None:
        """
        A handler returns NaN and infinities (GPU readings do) in its result, progress and an
        event: the backend gets valid JSON (nulls), the connection is not dropped, and the
        journal still loads after a restart.
        """
        backend = await self.start_backend()
        agent = self.start_agent(backend)

        async def nan(ctx: CommandContext) -> dict[str, Any]:
            ctx.progress("measure", "reading", progress_pct=math.nan)
            ctx.emit_event("gpu.reading", {"temp": math.inf})
            return {"ratio": math.nan, "list": [math.inf, 1.0], "nested": {"x": -math.inf}}

        agent.pipeline.registry["nan_result"] = HandlerSpec(nan, lane="read", idempotent=True, deadline=10)
        node_id = await self.wait_connected(backend, agent)
        opens = agent.session.stats.opens
        cmd = backend.issue_command(node_id, "nan_result", {})
        await backend.wait_for(lambda: backend.command(cmd["id"])["status"] in TERMINAL)
        await backend.wait_for(lambda: any(e.get("event_type") == "gpu.reading" for e in backend.events(node_id)))
        rec = backend.command(cmd["id"])
        self.assertEqual(rec["status"], "succeeded")
        self.assertEqual(rec["result"], {"ratio": None, "list": [None, 1.0], "nested": {"x": None}})
        self.assertEqual(agent.session.stats.opens, opens)
        state_dir = agent.state_dir  # type: ignore[attr-defined]
        await agent.stopService()
        agent2 = self.start_agent(backend, state_dir=state_dir, AGENT_ID=agent.config.agent_id)
        await self.wait_connected(backend, agent2)
        self.assertIsNotNone(agent2.journal.get(cmd["id"]))

    async def test_backend_never_answers_pings(self) -> None:
        """
        The backend never answers WebSocket pings (a broken proxy): the agent notices the dead
        link, reconnects, and every result is delivered without ever sending an ack or progress
        after it (which would regress the command).
        """
        self.allow_anomalies(r"^second command_result for ",
                             "no pong ever confirms the delivery: the result is sent again after each "
                             "reconnect (the documented at-least-once window)")
        self.patch(dev_stream.StreamFactory, "protocol", DeafStream)
        backend = await self.start_backend()
        # The keep-alive pings on each heartbeat tick: a 1 s heartbeat (and a ping given 0.5 s
        # to be answered instead of 10) finds the link dead in 2 s.
        self.patch(keepalive_module, "KEEPALIVE_MIN_WAIT_SEC", 0.5)
        agent = self.start_agent(backend, HEARTBEAT_INTERVAL_SEC="1")
        node_id = await self.wait_connected(backend, agent)
        cmd = backend.issue_command(node_id, "collect_diagnostics", {})
        await backend.wait_for(lambda: backend.command(cmd["id"])["status"] == "succeeded", 15)
        await backend.wait_for(lambda: agent.session.stats.opens >= 3, 15)
        history = backend.status_history(cmd["id"])
        first = history.index("succeeded")
        self.assertTrue(all(s in TERMINAL for s in history[first:]), history)
        # Heal the link so that the agent stops on a quiet connection.
        self.patch(DeafStream, "deaf", False)
        before = agent.session.stats.opens
        backend.drop_connections(node_id)
        await backend.wait_for(lambda: agent.session.stats.opens > before and agent.session.connected)
        opens = agent.session.stats.opens
        await sleep(2.5)
        self.assertEqual(agent.session.stats.opens, opens)

    async def test_black_holed_link_is_dropped(self) -> None:
        """
        The link goes silent with TCP still healthy (a proxy that stops forwarding, the backend
        host gone without a reset): the agent's keep-alive, riding its heartbeat tick, drops
        the connection within two ticks and the agent reconnects through a fresh connection.
        """
        await self._black_holed_link_is_dropped(GENERATION_CURRENT)

    async def test_black_holed_link_is_dropped_april_backend(self) -> None:
        """The same with the April 2026 backend (it answers frames only; its pongs still count)."""
        await self._black_holed_link_is_dropped(GENERATION_APRIL)

    async def _black_holed_link_is_dropped(self, generation: str) -> None:
        self.patch(keepalive_module, "KEEPALIVE_MIN_WAIT_SEC", 0.5)  # a ping per 1 s tick
        backend = await self.start_backend(generation=generation)
        hole = _BlackHole(int(backend.url.rsplit(":", 1)[1]))
        port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(hole.factory)
        self.addCleanup(port.stopListening)
        self.addCleanup(hole.close_all)
        agent = self.start_agent(backend, BACKEND_URL=f"http://127.0.0.1:{port.getHost().port}",
                                 HEARTBEAT_INTERVAL_SEC="1")
        await backend.wait_for(lambda: agent.session.connected and agent.session.node_id is not None, 15)
        await sleep(1.5)  # pings answered through the proxy: nothing dropped
        self.assertEqual((agent.session.keepalive.dropped, agent.session.stats.opens), (0, 1))
        self.assertGreaterEqual(agent.session.keepalive.pings, 2)
        hole.swallow()
        await backend.wait_for(lambda: agent.session.keepalive.dropped == 1, 10)
        await backend.wait_for(lambda: agent.session.connected and agent.session.stats.opens == 2, 10)
        self.assertIn("keep-alive ping not answered", agent.session.stats.last_close["reason"])

    async def test_manifest_traversal_through_sync_model(self) -> None:
        """
        sync_model commands whose manifests try to escape MODEL_STORE (.., absolute paths,
        backslashes, NUL, a file turned into a directory) each fail with invalid_command and
        nothing appears outside the store.
        """
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        store = agent.config.model_store
        outside = os.path.dirname(store)
        before = set(os.listdir(outside))
        blob = "a" * 64
        commit = "b" * 40
        base = {"model_id": "m", "hf_repo_id": "org/m", "source": "sync_from_server",
                "model_dir_name": "models--org--m", "blobs": [{"hash": blob, "size": 1}],
                "refs": [{"name": "main", "commit": commit}],
                "snapshots": [{"commit": commit, "links": [{"path": "config.json", "blob_hash": blob}]}]}
        evil: list[dict[str, Any]] = [
            {"model_dir_name": "../../escape"},
            {"model_dir_name": "models--org--m/../../x"},
            {"blobs": [{"hash": "../../../etc/x", "size": 1}]},
            {"refs": [{"name": "../../../../escape", "commit": commit}]},
            {"refs": [{"name": "/abs", "commit": commit}]},
            {"snapshots": [{"commit": "../../" + "b" * 34, "links": []}]},
            {"snapshots": [{"commit": commit, "links": [{"path": "../../../../escape", "blob_hash": blob}]}]},
            {"snapshots": [{"commit": commit, "links": [{"path": "/etc/passwd", "blob_hash": blob}]}]},
            {"snapshots": [{"commit": commit, "links": [{"path": "a\\..\\..\\x", "blob_hash": blob}]}]},
            {"snapshots": [{"commit": commit, "links": [{"path": "a\u0000b", "blob_hash": blob}]}]},
            {"snapshots": [{"commit": commit, "links": [{"path": "a", "blob_hash": blob},
                                                        {"path": "a/b", "blob_hash": blob}]}]},
        ]
        cmds = [backend.issue_command(node_id, "sync_model", {"model_sync": dict(base, **e)}) for e in evil]
        await backend.wait_for(lambda: all(backend.command(c["id"])["status"] in TERMINAL for c in cmds), 20)
        for c, e in zip(cmds, evil, strict=True):
            rec = backend.command(c["id"])
            self.assertEqual((rec["status"], rec["error_code"]), ("failed", "invalid_command"), e)
        # The agent's own journal and outbox are made at their first record (the commands).
        own = {"commands.jsonl", "events.jsonl"}
        self.assertEqual(set(os.listdir(outside)) - own, before - own)
        self.assertEqual(glob.glob(os.path.join(store, "**", "escape*"), recursive=True), [])


class EnrollRefuser(Resource):
    """An enroll endpoint answering 422 exactly as FastAPI/pydantic does: the input is echoed."""

    isLeaf = True

    def render_POST(self, request: Any) -> bytes:
        body = json.loads(request.content.read())
        request.setResponseCode(422)
        request.setHeader(b"content-type", b"application/json")
        return json.dumps({"detail": [{"type": "missing", "loc": ["body", "labels"],
                                       "msg": "Field required", "input": body}]}).encode()


class HoldingEnroll(Resource):
    """An enroll endpoint that holds every request until the test answers it."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Any] = []

    def render_POST(self, request: Any) -> int:
        self.held.append(request)
        return NOT_DONE_YET


class SecretTests(AgentTestCase):
    async def _site(self, resource: Resource) -> str:
        site = Site(resource)
        site.noisy = False
        port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(site)
        self.addCleanup(port.stopListening)
        return f"http://127.0.0.1:{port.getHost().port}"

    def _agent_on(self, url: str, token: str, fatal: list[Any], **extra: str) -> Any:
        from llmport_agent.agent.service import AgentService
        from llmport_agent.inventory.gpu import NoGPUSource

        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        env = {"BACKEND_URL": url, "AGENT_ID": "hostile-" + uuid.uuid4().hex[:6], "HOST": "127.0.0.1",
               "STATE_PATH": os.path.join(d, "state.json"), "MODEL_STORE": os.path.join(d, "models"),
               "OPS_PORT": "0", "ENROLLMENT_TOKEN": token, "RECONNECT_MIN_SEC": "0.2",
               "RECONNECT_MAX_SEC": "1", "REQUEST_TIMEOUT_SEC": "3"}
        env.update(extra)
        config = load_config({"LLM_PORT_NODE_AGENT_" + k: v for k, v in env.items()}, {})
        agent = AgentService(reactor, config, fatal=lambda c, m: fatal.append((c, m)),
                             gpu_source=NoGPUSource(), docker_enabled=False)
        agent.state_dir = d  # type: ignore[attr-defined]
        agent.startService()
        self.addCleanup(self.stop_agent, agent)
        return agent

    async def test_enrollment_422_echo_does_not_leak_token(self) -> None:
        """
        The real backend answers a malformed enroll body with FastAPI's 422, which echoes the
        request body (enrollment_token included) in C{detail[].input}. The token must not reach
        the fatal message, a log line or a log field.
        """
        logs = LogCapture(self)
        url = await self._site(EnrollRefuser())
        token = "Tok" + uuid.uuid4().hex[:29]
        fatal: list[Any] = []
        self._agent_on(url, token, fatal)
        await deferLater(reactor, 0, lambda: None)
        deadline = reactor.seconds() + 10
        while not fatal and reactor.seconds() < deadline:
            await sleep(0.05)
        self.assertTrue(fatal)
        self.assertNotIn(token, fatal[0][1])
        self.assertNotIn(token, logs.text())

    async def test_stop_during_enrollment_keeps_the_credential(self) -> None:
        """
        The operator stops the agent (SIGTERM, systemctl restart) while the enroll request is
        in flight and the backend has already consumed the single-use token. If the backend's
        reply can still arrive after the stop began, the credential must end up on disk;
        otherwise the node is left with a used token and no credential. (A stop gives the
        request CRITICAL_STOP_GRACE to answer, then cancels it: issue 9, exit within 2 s.)
        """
        hold = HoldingEnroll()
        url = await self._site(hold)
        fatal: list[Any] = []
        agent = self._agent_on(url, "Tok" + uuid.uuid4().hex[:29], fatal)
        deadline = reactor.seconds() + 10
        while not hold.held and reactor.seconds() < deadline:
            await sleep(0.02)
        request = hold.held[0]
        credential = f"{uuid.uuid4()}.{'e' * 43}"

        def answer() -> None:
            if request._disconnected or request.finished:
                return
            request.setResponseCode(200)
            request.setHeader(b"content-type", b"application/json")
            request.write(json.dumps({"node_id": str(uuid.uuid4()), "agent_id": "a", "credential": credential,
                                      "status": "healthy", "host": "127.0.0.1"}).encode())
            request.finish()

        stopping = agent.stopService()
        timer = reactor.callLater(CRITICAL_STOP_GRACE / 2, answer)
        await stopping
        if timer.active():
            timer.cancel()
            answer()
        await sleep(0.5)
        self.flushLoggedErrors(RuntimeError)
        await agent.http_pool.closeCachedConnections()
        channel = getattr(request, "channel", None)
        if not request._disconnected and channel is not None and channel.transport is not None:
            channel.transport.abortConnection()
        if request._disconnected and not agent.state.credential:
            return  # the request was cancelled: acceptable, nothing was issued to this agent
        stored = {}
        if os.path.exists(agent.state.path):
            with open(agent.state.path) as f:
                stored = json.load(f)
        self.assertEqual(stored.get("credential"), credential)

    async def test_stop_during_rotation_keeps_the_new_credential(self) -> None:
        """
        The agent is stopped while a credential rotation is in flight. The backend revokes
        the old credential at once; when its reply arrives during the stop, the new
        credential must be on disk, or the restarted node is locked out for good. (The reply
        has CRITICAL_STOP_GRACE to arrive; a stop never waits longer: issue 9.)
        """
        held: list[tuple[Any, Any]] = []
        original = dev_http.RotateResource.render_POST

        def slow(resource: Any, request: Any) -> Any:
            body = original(resource, request)
            held.append((request, body))
            return NOT_DONE_YET

        self.patch(dev_http.RotateResource, "render_POST", slow)
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        rotating = agent.session.rotate()
        rotating.addErrback(lambda f: None)
        await backend.wait_for(lambda: bool(held))
        request, body = held[0]
        new = json.loads(body)["credential"]

        def answer() -> None:
            if not request._disconnected and not request.finished:
                request.write(body)
                request.finish()

        stopping = agent.stopService()
        timer = reactor.callLater(CRITICAL_STOP_GRACE / 2, answer)
        await stopping
        if timer.active():
            timer.cancel()
            answer()
        await sleep(0.5)
        self.flushLoggedErrors(RuntimeError)
        await agent.http_pool.closeCachedConnections()
        with open(agent.state.path) as f:
            self.assertEqual(json.load(f).get("credential"), new)
        self.assertIsNotNone(node_id)

    async def test_rotation_racing_a_reconnect(self) -> None:
        """
        A rotation and a connection cut happen in the same instant: the reconnect may be tried
        with the just-revoked credential, but the agent must end up connected with the new one
        stored, without exiting or giving up.
        """
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        old = agent.state.credential
        opens = agent.session.stats.opens
        rotating = agent.session.rotate()
        backend.drop_connections(node_id)
        self.assertTrue(await rotating)
        await backend.wait_for(lambda: agent.session.stats.opens > opens and agent.session.connected, 15)
        self.assertNotEqual(agent.state.credential, old)
        with open(agent.state.path) as f:
            self.assertEqual(json.load(f)["credential"], agent.state.credential)
        self.assertIsNone(agent.exit_status)

    async def test_no_secret_anywhere(self) -> None:
        """
        Sweep for the enrollment token and every credential (before and after a rotation) in
        log lines and fields (debug level), Loki lines, diagnostics, metrics, every frame the
        backend received and every file in the state directory but state.json.
        """
        from prometheus_client import CollectorRegistry, generate_latest

        from llmport_agent.logs.testing import FakeLoki
        from llmport_agent.ops.metrics import AgentCollector as _AgentCollector

        logs = LogCapture(self)
        loki = FakeLoki()
        loki_url = await self._site(loki)
        backend = await self.start_backend()
        token = backend.mint_token("sweep")["token"]
        agent = self.start_agent(backend, ENROLLMENT_TOKEN=token, LOKI_URL=loki_url,
                                 LOG_FLUSH_INTERVAL_SEC="0.2", LOG_LEVEL="DEBUG")
        node_id = await self.wait_connected(backend, agent)
        first = agent.state.credential
        self.assertTrue(await agent.session.rotate())
        second = agent.state.credential
        backend.drop_connections(node_id)
        await backend.wait_for(lambda: agent.session.connected)
        cmds = [
            backend.issue_command(node_id, "collect_diagnostics", {}),
            backend.issue_command(node_id, "refresh_inventory", {}),
            backend.issue_command(node_id, "noop", {}, raw_override={"signature": "ab" * 32}),
            backend.issue_command(node_id, "set_maintenance_mode", {"enabled": "perhaps"}),
        ]
        await backend.wait_for(lambda: all(backend.command(c["id"])["status"] in TERMINAL for c in cmds), 15)
        diagnostics = json.dumps(backend.command(cmds[0]["id"])["result"])
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_AgentCollector(agent))  # type: ignore[arg-type]
        metrics = generate_latest(registry).decode()
        await backend.wait_for(lambda: bool(loki.lines()), 10)
        await agent.stopService()
        files = ""
        for path in glob.glob(os.path.join(agent.state_dir, "**"), recursive=True):  # type: ignore[attr-defined]
            if os.path.isfile(path) and os.path.basename(path) != "state.json":
                with open(path, "rb") as f:
                    files += f.read().decode("utf-8", "replace")
        places = {"logs": logs.text(), "loki": "\n".join(loki.lines()), "diagnostics": diagnostics,
                  "metrics": metrics, "frames": json.dumps(backend.frames(node_id)), "files": files}
        for label, text in places.items():
            for name, secret in (("token", token), ("credential", first), ("rotated", second)):
                assert secret is not None
                self.assertNotIn(secret, text, f"{name} in {label}")
                self.assertNotIn(secret.split(".")[-1], text, f"{name} secret part in {label}")


class OperatorAccidentTests(AgentTestCase):
    async def test_state_path_is_a_directory(self) -> None:
        """
        The operator made STATE_PATH a directory: it is moved aside (kept), the agent enrolls
        with its token and stores the credential in a real file.
        """
        backend = await self.start_backend()
        state_dir = os.path.abspath(self.mktemp())
        os.makedirs(os.path.join(state_dir, "state.json", "inner"))
        agent = self.start_agent(backend, state_dir=state_dir)
        await self.wait_connected(backend, agent)
        await agent.state.flush()
        self.assertTrue(os.path.isfile(os.path.join(state_dir, "state.json")))
        self.assertEqual(len(glob.glob(os.path.join(state_dir, "state.json.corrupt-*", "inner"))), 1)

    async def test_unreadable_state_file_is_not_thrown_away(self) -> None:
        """
        state.json exists but cannot be read (EACCES after a wrong chown or an SELinux label,
        EIO): unlike a corrupt file, it holds a good credential. The agent must not rename it
        away (which forces a re-enrollment with a new token once the permission is fixed).
        """
        import llmport_agent.core.state as state_module

        backend = await self.start_backend()
        agent = self.start_agent(backend)
        await self.wait_connected(backend, agent)
        await agent.stopService()
        path = agent.state.path
        real_open = open

        def refusing_open(file: Any, *args: Any, **kwargs: Any) -> Any:
            if os.path.abspath(str(file)) == os.path.abspath(path):
                raise PermissionError(errno.EACCES, "Permission denied", str(file))
            return real_open(file, *args, **kwargs)

        state_module.open = refusing_open  # type: ignore[attr-defined]
        self.addCleanup(delattr, state_module, "open")
        fatal: list[Any] = []
        agent2 = self.start_agent(backend, state_dir=agent.state_dir, token=False,  # type: ignore[attr-defined]
                                  fatal=fatal, AGENT_ID=agent.config.agent_id)
        await agent2.whenStarted()
        await sleep(0.3)
        self.assertTrue(os.path.isfile(path), os.listdir(os.path.dirname(path)))

    async def test_garbage_journal_does_not_stop_the_agent(self) -> None:
        """
        commands.jsonl has one valid-JSON line with a wrong field type next to a real
        credential: the agent must still start and connect (a crash loop under systemd
        otherwise).
        """
        backend = await self.start_backend()
        state_dir = self.mktemp()
        agent = self.start_agent(backend, state_dir=state_dir)
        await self.wait_connected(backend, agent)
        await agent.stopService()
        with open(os.path.join(agent.state_dir, "commands.jsonl"), "a") as f:  # type: ignore[attr-defined]
            f.write(json.dumps({"id": str(uuid.uuid4()), "state": "delivered", "finished_at": "yesterday"}) + "\n")
        fatal: list[Any] = []
        agent2 = self.start_agent(backend, state_dir=state_dir, fatal=fatal, AGENT_ID=agent.config.agent_id)
        deadline = reactor.seconds() + 5
        while not fatal and not agent2.session.connected and reactor.seconds() < deadline:
            await sleep(0.05)
        self.flushLoggedErrors(TypeError)
        self.assertEqual(fatal, [])
        self.assertTrue(agent2.session.connected)

    async def test_sigterm_during_deploy_then_restart(self) -> None:
        """
        The agent is stopped (SIGTERM path) while a deploy runs; after the restart the deploy
        is re-run and the backend sees exactly one result and no regression.
        """
        gate: dict[str, Deferred[dict[str, Any]]] = {}
        runs: list[str] = []

        async def deploy(ctx: CommandContext) -> dict[str, Any]:
            runs.append(ctx.command.id)
            d: Deferred[dict[str, Any]] = Deferred()
            gate[ctx.command.id] = d
            ctx.progress("pull_image", "pulling")
            return await d

        spec = HandlerSpec(deploy, lane="runtime", idempotent=True, deadline=60,
                           blocked_by_maintenance=True, blocked_by_draining=True)
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        agent.pipeline.registry["deploy_workload"] = spec
        node_id = await self.wait_connected(backend, agent)
        cmd = backend.issue_command(node_id, "deploy_workload", {"runtime_id": "rt-1"})
        await backend.wait_for(lambda: cmd["id"] in gate)
        await agent.stopService()
        self.assertNotIn("result", [e["event_type"] for e in backend.timeline(cmd["id"])])
        gate.clear()
        agent2 = self.start_agent(backend, state_dir=agent.state_dir,  # type: ignore[attr-defined]
                                  AGENT_ID=agent.config.agent_id)
        agent2.pipeline.registry["deploy_workload"] = spec
        await backend.wait_for(lambda: cmd["id"] in gate, 15)
        gate[cmd["id"]].callback({"endpoint_url": "http://127.0.0.1:8000"})
        await backend.wait_for(lambda: backend.command(cmd["id"])["status"] in TERMINAL)
        await sleep(0.5)
        kinds = [e["event_type"] for e in backend.timeline(cmd["id"])]
        self.assertEqual(kinds.count("result"), 1, kinds)
        self.assertEqual(backend.command(cmd["id"])["status"], "succeeded")
        self.assertEqual(runs, [cmd["id"], cmd["id"]])
