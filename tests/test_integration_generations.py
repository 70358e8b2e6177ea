"""
Issue 18 points 1-3 against BOTH generations of the stand-in backend (protocol 10):

 - over real loopback connections: a pushed command picked up while another runs; on the
   current generation the agent proves push and then sends no polls at all (an idle node sends
   only heartbeats and inventory), on the April one it keeps polling; a re-dispatched running
   command (an overdue in-flight command listed at the next C{hello_ack} with
   C{"redispatch": true}) is executed once, acked again and answered once;
 - on one simulated clock (the agent's real command pipeline wired to the stand-in's real
   backend state, no sockets): a 10-minute command that says nothing itself is never timed out
   by the current generation's silence reaper at its real 300 s.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.task import Clock, LoopingCall, deferLater
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.base import HandlerSpec
from llmport_agent.devbackend._state import (
    GENERATION_APRIL,
    GENERATION_CURRENT,
    REAPER_INTERVAL_SEC,
    BackendState,
)
from llmport_agent.session.dispatch import POLLING, PUSH
from tests.agentharness import AgentTestCase
from tests.test_pipeline import Harness

GENERATIONS = (GENERATION_APRIL, GENERATION_CURRENT)


class Blocker:
    """A command type whose executions the test counts and releases."""

    def __init__(self) -> None:
        self.runs: list[str] = []
        self.release: dict[str, Deferred[dict[str, Any]]] = {}

    async def handler(self, ctx: Any) -> dict[str, Any]:
        self.runs.append(ctx.command.id)
        d: Deferred[dict[str, Any]] = Deferred()
        self.release[ctx.command.id] = d
        ctx.progress("work", "working on it")
        return await d

    def spec(self) -> HandlerSpec:
        return HandlerSpec(self.handler, lane="runtime", idempotent=True, deadline=600)


class _Base(AgentTestCase):
    timeout = 90

    async def agent_for(self, generation: str, **env: str) -> tuple[Any, Any, str, Blocker]:
        backend = await self.start_backend(generation=generation)
        settings = {"COMMAND_POLL_ACTIVE_WINDOW_SEC": "0", "HEARTBEAT_INTERVAL_SEC": "5"}
        settings.update(env)
        agent = self.start_agent(backend, **settings)
        blocker = Blocker()
        agent.pipeline.registry["test_block"] = blocker.spec()
        node_id = await self.wait_connected(backend, agent)
        return backend, agent, node_id, blocker

    async def quiet(self, agent: Any, seconds: float) -> None:
        """Wait until the agent has sent nothing for C{seconds}."""
        deadline = reactor.seconds() + 30
        while reactor.seconds() - agent.session.polling.last_sent_at < seconds:
            if reactor.seconds() > deadline:
                self.fail("the agent never went quiet")
            await deferLater(reactor, 0.05, lambda: None)

    async def status(self, backend: Any, cid: str, *wanted: str, timeout: float = 20) -> None:
        await backend.wait_for(lambda: backend.command(cid)["status"] in wanted, timeout)

    @staticmethod
    def polls(backend: Any, node_id: str, since: int = 0) -> int:
        return sum(1 for f in backend.frames(node_id)[since:] if f.get("type") == "poll")


class PushWhileBusyTests(_Base):
    async def _picked_up_while_another_runs(self, generation: str) -> None:
        backend, agent, node_id, blocker = await self.agent_for(generation)
        await self.quiet(agent, 3.5)
        first = backend.issue_command(node_id, "test_block", {"runtime_id": "rt-a"})
        await self.status(backend, first["id"], "running")
        expected = PUSH if generation == GENERATION_CURRENT else POLLING
        self.assertEqual(agent.session.dispatch.mode, expected, agent.session.dispatch.reason)
        mark = len(backend.frames(node_id))
        # Mid-command: a second command for another runtime, and a read, both while the first runs.
        issued = reactor.seconds()
        second = backend.issue_command(node_id, "test_block", {"runtime_id": "rt-b"})
        logs = backend.issue_command(node_id, "refresh_inventory", {})
        await self.status(backend, second["id"], "running")
        await self.status(backend, logs["id"], "succeeded")
        picked = reactor.seconds() - issued
        self.assertEqual(backend.command(first["id"])["status"], "running")
        self.assertEqual(blocker.runs, [first["id"], second["id"]])
        if generation == GENERATION_CURRENT:
            self.assertEqual(self.polls(backend, node_id, mark), 0)
            self.assertLess(picked, 2.0)
        else:
            self.assertEqual(agent.session.dispatch.proofs, 0)
        for cid in (second["id"], first["id"]):
            blocker.release[cid].callback({"done": True})
            await self.status(backend, cid, "succeeded")
        self.assertEqual(agent.session.dispatch.mode, expected)
        # What collect_diagnostics reports about it.
        diagnostics = (await agent.diagnostics())["session"]["dispatch"]
        self.assertEqual(diagnostics["mode"], expected)
        self.assertEqual(diagnostics["push_proofs"], 1 if generation == GENERATION_CURRENT else 0)
        self.assertIn("reason", diagnostics)

    async def test_april(self) -> None:
        """April 2026: a command picked up (by a poll) while another runs; polling stays on."""
        await self._picked_up_while_another_runs(GENERATION_APRIL)

    async def test_current(self) -> None:
        """Current: push proven at the first command; the next ones are pushed and taken while it runs, no polls."""
        await self._picked_up_while_another_runs(GENERATION_CURRENT)


class IdleTests(_Base):
    async def _idle(self, generation: str) -> tuple[int, int, set[str]]:
        # Default heartbeat (15 s) and idle poll (8 s): one poll between two heartbeats.
        backend, agent, node_id, _ = await self.agent_for(generation, HEARTBEAT_INTERVAL_SEC="15")
        await self.quiet(agent, 3.5)
        cmd = backend.issue_command(node_id, "refresh_inventory", {})
        await self.status(backend, cmd["id"], "succeeded")
        await backend.wait_for(lambda: not agent.pipeline.busy and agent.outbox.depth == 0, 10)
        await deferLater(reactor, 0.5, lambda: None)
        mark = len(backend.frames(node_id))
        await deferLater(reactor, 17.0, lambda: None)
        frames = backend.frames(node_id)[mark:]
        return self.polls(backend, node_id, mark), len(frames), {f.get("type") for f in frames}

    async def test_current_idle_node_sends_no_polls(self) -> None:
        """Current, push proven: 17 s idle are heartbeats and inventory only."""
        polls, frames, kinds = await self._idle(GENERATION_CURRENT)
        self.assertEqual(polls, 0)
        self.assertIn("heartbeat", kinds)
        self.assertLessEqual(kinds, {"heartbeat", "inventory"})
        self.assertGreaterEqual(frames, 1)

    async def test_april_idle_node_keeps_polling(self) -> None:
        """April: the same 17 s carry polls at the idle interval, as before."""
        polls, _frames, kinds = await self._idle(GENERATION_APRIL)
        self.assertGreaterEqual(polls, 1)
        self.assertIn("poll", kinds)


class FastPollWindowTests(_Base):
    async def _between_two_polls(self, generation: str) -> Any:
        # The default active window after a connect: a poll every 2 s.
        backend, agent, node_id, _ = await self.agent_for(generation, COMMAND_POLL_ACTIVE_WINDOW_SEC="600",
                                                          COMMAND_POLL_INTERVAL_SEC="2",
                                                          HEARTBEAT_INTERVAL_SEC="15")
        window = agent.session.dispatch.window
        self.assertLess(window, 1.0, "the stand-in took too long to say hello_ack on this machine")
        await self.quiet(agent, window + 0.3)
        cmd = backend.issue_command(node_id, "refresh_inventory", {})
        await self.status(backend, cmd["id"], "succeeded")
        return agent

    async def test_current_push_proven_between_two_polls(self) -> None:
        """Current: a command issued between two 2 s polls of the active window is pushed and proves push."""
        agent = await self._between_two_polls(GENERATION_CURRENT)
        self.assertEqual(agent.session.dispatch.mode, PUSH, agent.session.dispatch.reason)

    async def test_april_never_proven_between_two_polls(self) -> None:
        """April: the same command waits for the next poll's reply; polling stays on."""
        agent = await self._between_two_polls(GENERATION_APRIL)
        self.assertEqual(agent.session.dispatch.mode, POLLING)
        self.assertEqual(agent.session.dispatch.proofs, 0)


class RememberTests(_Base):
    async def test_push_remembered_across_an_agent_restart(self) -> None:
        """Push proven, the agent restarts on the same state: push from its first connect, no poll at all."""
        backend, agent, node_id, _ = await self.agent_for(GENERATION_CURRENT)
        await self.quiet(agent, 3.5)
        cmd = backend.issue_command(node_id, "refresh_inventory", {})
        await self.status(backend, cmd["id"], "succeeded")
        self.assertEqual(agent.session.dispatch.mode, PUSH)
        await backend.wait_for(lambda: agent.state.get("dispatch", {}).get("mode") == PUSH, 10)
        await agent.stopService()
        mark = len(backend.frames(node_id))
        again = self.start_agent(backend, state_dir=agent.state_dir, token=False,  # type: ignore[attr-defined]
                                 COMMAND_POLL_ACTIVE_WINDOW_SEC="600", HEARTBEAT_INTERVAL_SEC="1")
        await self.wait_connected(backend, again)
        self.assertEqual(again.session.dispatch.mode, PUSH)
        self.assertIn("remembered", again.session.dispatch.reason)
        await deferLater(reactor, 3.0, lambda: None)  # would be 2 s polls in the active window
        self.assertEqual(self.polls(backend, node_id, mark), 0)
        issued = reactor.seconds()
        cmd = backend.issue_command(node_id, "refresh_inventory", {})
        await self.status(backend, cmd["id"], "succeeded")
        self.assertLess(reactor.seconds() - issued, 2.0)


class RedispatchTests(_Base):
    async def test_redispatched_running_command_executed_once(self) -> None:
        """
        Current: a command runs past twice its timeout; the agent's stream drops while a second
        session of the node still looks open (a half-open link), so the backend does not fail
        it; at the reconnect it comes back in hello_ack with redispatch: true. The agent acks it
        again, does not start it again, and answers it once when it ends.
        """
        from tests.test_devbackend import _ClientFactory

        backend, agent, node_id, blocker = await self.agent_for(GENERATION_CURRENT)
        cmd = backend.issue_command(node_id, "test_block", {"runtime_id": "rt-r"}, timeout_sec=1)
        await self.status(backend, cmd["id"], "running")
        # The half-open session: a second stream of the node that the backend still counts.
        factory = _ClientFactory(backend.stream_url, headers={"Authorization": f"Bearer {agent.state.credential}"},
                                 reactor=reactor)
        factory.setProtocolOptions(openHandshakeTimeout=0, closeHandshakeTimeout=0, serverConnectionDropTimeout=0)
        ghost = await TCP4ClientEndpoint(reactor, "127.0.0.1", backend.port).connect(factory)
        await factory.opened
        self.addCleanup(lambda: ghost.lost)
        self.addCleanup(lambda: ghost.sendClose(1000) if ghost.state == ghost.STATE_OPEN else None)
        await backend.wait_for(lambda: backend.connection_count(node_id) == 2)
        await deferLater(reactor, 2.5, lambda: None)  # overdue: running for more than 2 x 1 s
        opens = agent.session.stats.opens
        acks_before = sum(1 for f in backend.frames(node_id) if f.get("type") == "command_ack"
                          and f.get("command_id") == cmd["id"])
        for proto in backend.streams(node_id):
            if proto.session_id != ghost_session(backend, node_id, ghost):
                proto.dropConnection(abort=True)
        await backend.wait_for(lambda: agent.session.stats.opens > opens, 20)
        await backend.wait_for(
            lambda: "re-dispatched" in [e["event_type"] for e in backend.timeline(cmd["id"])], 10)
        await backend.wait_for(lambda: sum(1 for f in backend.frames(node_id) if f.get("type") == "command_ack"
                                           and f.get("command_id") == cmd["id"]) > acks_before, 10)
        await deferLater(reactor, 0.5, lambda: None)
        self.assertEqual(blocker.runs, [cmd["id"]])  # joined, not started again
        self.assertEqual(agent.pipeline.stats["redispatched"], 1)
        self.assertIn(backend.command(cmd["id"])["status"], ("acked", "running"))
        blocker.release[cmd["id"]].callback({"done": True})
        await self.status(backend, cmd["id"], "succeeded")
        await deferLater(reactor, 0.5, lambda: None)
        results = [f for f in backend.frames(node_id) if f.get("type") == "command_result"
                   and f.get("command_id") == cmd["id"]]
        self.assertEqual(len(results), 1)
        self.assertEqual(blocker.runs, [cmd["id"]])
        self.assertEqual(backend.command(cmd["id"])["result"], {"done": True})


def ghost_session(backend: Any, node_id: str, ghost: Any) -> str | None:
    """The backend session id of the test's extra stream (the one whose peer port is the ghost's)."""
    port = ghost.transport.getHost().port
    for proto in backend.streams(node_id):
        if proto.transport.getPeer().port == port:
            return str(proto.session_id)
    return None


class BackendBridge:
    """
    The agent's command pipeline on one simulated clock with the stand-in backend's state, as
    the stand-in's stream would wire them (seq check left out: frames here are in order):
    every frame is applied and answered with the pending commands; the current generation also
    pushes; heartbeats keep the session fresh; the reapers sweep every 60 s.
    """

    def __init__(self, case: SynchronousTestCase, generation: str) -> None:
        self.h = Harness(case)
        self.clock: Clock = self.h.clock
        self.clock.advance(1_700_000_000)
        self.state = BackendState(self.clock, generation=generation)
        token = self.state.mint_token()["token"]
        self.node_id = self.state.enroll(token, "node-a", "127.0.0.1", {}, "1.0", "127.0.0.1")["node_id"]
        self.state.wake = lambda node_id: self.clock.callLater(0, self.dispatch)
        self.session = self.h.session
        original = self.session.send

        def send(frame: dict[str, Any]) -> bool:
            if not original(frame):
                return False
            self.state.session_offset_accepted(self.session_id)
            self.state.apply_frame(self.node_id, frame)
            self.clock.callLater(0, self.dispatch)
            return True

        self.session.send = send  # type: ignore[method-assign]
        self.session_id = self.state.session_opened(self.node_id)
        self.h.pipeline.session_opened()
        self.h.pipeline.frame_received({"type": "hello_ack", "commands": self.state.hello_commands(self.node_id)})
        self.loops = [LoopingCall(send, {"type": "heartbeat"}), LoopingCall(self.state.sweep)]
        for loop, every in zip(self.loops, (15.0, REAPER_INTERVAL_SEC), strict=True):
            loop.clock = self.clock
            loop.start(every, now=False)
        case.addCleanup(lambda: [loop.stop() for loop in self.loops if loop.running])

    def dispatch(self) -> None:
        items = self.state.take_dispatch(self.node_id)
        if items:
            self.h.pipeline.frame_received({"type": "commands", "items": items})

    def run_for(self, seconds: float) -> None:
        end = self.clock.seconds() + seconds
        while self.clock.seconds() < end:
            self.clock.advance(1.0)


class ReaperTests(SynchronousTestCase):
    def _ten_minutes(self, generation: str) -> tuple[BackendBridge, str, list[str]]:
        bridge = BackendBridge(self, generation)
        runs: list[str] = []

        async def silent(ctx: Any) -> dict[str, Any]:
            """Ten minutes of work that reports nothing after its first phase."""
            runs.append(ctx.command.id)
            ctx.progress("transfer", "copying")
            d: Deferred[None] = Deferred()
            bridge.clock.callLater(600, d.callback, None)
            await d
            return {"copied": True}

        bridge.h.pipeline.registry["test_silent"] = HandlerSpec(silent, lane="runtime", idempotent=True,
                                                                deadline=3600)
        cmd = bridge.state.issue_command(bridge.node_id, "test_silent", {"runtime_id": "rt-1"}, timeout_sec=60)
        bridge.run_for(640)  # April: picked up by the first heartbeat's reply, 15 s in
        return bridge, cmd["id"], runs

    def test_current_reaper_at_300_s_never_times_it_out(self) -> None:
        """Current generation, real constants (300 s silence, 60 s sweeps): the keepalive keeps a 10-minute command alive."""
        bridge, cid, runs = self._ten_minutes(GENERATION_CURRENT)
        record = bridge.state.commands[cid]
        self.assertEqual((record.status, record.error_code), ("succeeded", None), record.timeline[-3:])
        self.assertNotIn("timed_out", record.history)
        self.assertEqual(runs, [cid])
        progress = [e for e in record.timeline if e["event_type"] == "progress"]
        self.assertGreaterEqual(len(progress), 600 // 30)
        self.assertEqual(bridge.state.anomalies, {})

    def test_april_has_nothing_to_time_it_out(self) -> None:
        """April generation: the same command simply succeeds (no reaper), with the same progress cadence."""
        bridge, cid, runs = self._ten_minutes(GENERATION_APRIL)
        record = bridge.state.commands[cid]
        self.assertEqual(record.status, "succeeded")
        self.assertEqual(runs, [cid])
        self.assertEqual(bridge.state.anomalies, {})
