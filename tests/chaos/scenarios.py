"""
The random-fault driver the chaos tests and C{bench/bench_chaos.py} share.

One step: wait until the agent is connected, issue a few commands, degrade the link at
random (nothing, a stall, a slow link, a flipped or garbled byte either way) for a random
dwell, then disrupt (by default: cut every connection; optionally refuse new ones for a
moment). After the last step the link is healed and the driver waits until every issued
command has its result; then the invariants of L{tests.chaos.invariants} are checked.
"""

from __future__ import annotations

import os
import random
from collections.abc import Awaitable, Callable
from typing import Any

from attrs import define, field

from tests.chaos.invariants import TERMINAL, CommandTally, check_commands, settle, sleep
from tests.support.chaosproxy import DOWN, UP, ChaosProxy

DEGRADE = ("none", "stall", "slow", "flip", "garble")


def chaos_seed() -> int:
    """C{LLMPORT_CHAOS_SEED} or a fresh random seed (printed by the tests on failure)."""
    raw = os.environ.get("LLMPORT_CHAOS_SEED")
    return int(raw) if raw else random.SystemRandom().randrange(1 << 32)


def chaos_cuts(default: int) -> int:
    """C{LLMPORT_CHAOS_CUTS} (bigger runs by hand) or C{default} (the CI size)."""
    raw = os.environ.get("LLMPORT_CHAOS_CUTS")
    return int(raw) if raw else default


def install_work_handler(agent: Any, reactor: Any, rng: random.Random) -> None:
    """A C{chaos_work} command type: progress, then a result after 0 to 0.4 s."""
    from llmport_agent.commands.base import CommandContext, HandlerSpec

    async def work(ctx: CommandContext) -> dict[str, Any]:
        ctx.progress("work", "working")
        await sleep(reactor, rng.uniform(0, 0.4))
        return {"done": ctx.command.id}

    agent.pipeline.registry["chaos_work"] = HandlerSpec(work, lane="runtime", idempotent=True, deadline=60)


def cheap_issuer(backend: Any, node_id: str, types: tuple[str, ...]) -> Callable[[random.Random], str]:
    """Issue one command of a type chosen from C{types}; return its id."""
    counter = [0]

    def issue(rng: random.Random) -> str:
        counter[0] += 1
        kind = rng.choice(types)
        payload: dict[str, Any] = {}
        if kind == "chaos_work":
            payload = {"runtime_id": f"lane-{rng.randrange(4)}"}
        return str(backend.issue_command(node_id, kind, payload)["id"])

    return issue


@define
class ChaosRun:
    seed: int
    steps: int
    commands: list[str] = field(factory=list)
    degraded: dict[str, int] = field(factory=dict)
    disruptions: int = 0
    stuck: list[str] = field(factory=list)
    seconds: float = 0.0

    def describe(self, proxy: ChaosProxy | None = None) -> str:
        tail = f"; proxy did {proxy.counts} (last: {proxy.log[-6:]})" if proxy is not None else ""
        return (f"seed {self.seed} (rerun with LLMPORT_CHAOS_SEED={self.seed}), {self.steps} steps, "
                f"{len(self.commands)} commands, degraded {self.degraded}{tail}")


async def run_random(
    reactor: Any,
    backend: Any,
    node_id: str,
    proxy: ChaosProxy,
    *,
    steps: int,
    seed: int,
    issue: Callable[[random.Random], str],
    connected: Callable[[], bool],
    disrupt: Callable[[random.Random], Awaitable[None]] | None = None,
    degrade: tuple[str, ...] = DEGRADE,
    max_dwell: float = 0.4,
    max_commands: int = 3,
    reconnect_timeout: float = 30.0,
    directions: tuple[str, ...] = (UP, DOWN),
    backend_link: bool = True,
) -> ChaosRun:
    """
    Run C{steps} random steps (module docstring); the result lists what was issued.
    C{backend_link}: C{proxy} carries the backend stream (a cut disconnects the agent).
    """
    rng = random.Random(seed)
    run = ChaosRun(seed=seed, steps=steps)
    started = reactor.seconds()

    async def cut(rng: random.Random) -> None:
        proxy.cut()
        if rng.random() < 0.15:  # the server "down" behind its gateway for a moment
            proxy.refuse()
            await sleep(reactor, rng.uniform(0.1, 0.8))

    act = disrupt or cut
    for _ in range(steps):
        if not await settle(reactor, connected, reconnect_timeout):
            run.stuck.append(f"not reconnected within {reconnect_timeout:.0f} s at step {run.disruptions}")
            break
        for _ in range(rng.randint(0, max_commands)):
            run.commands.append(issue(rng))
        kind = rng.choice(degrade)
        run.degraded[kind] = run.degraded.get(kind, 0) + 1
        if kind == "stall":
            proxy.stall()
        elif kind == "slow":
            proxy.slow(chunk=rng.choice((1, 16, 64, 512)), delay=rng.choice((0.001, 0.01, 0.03)))
        elif kind in ("flip", "garble"):
            proxy.rng = rng
            proxy.corrupt(rng.choice(directions), kind)
        await sleep(reactor, rng.uniform(0, max_dwell))
        before = set(proxy.fronts)
        await act(rng)
        run.disruptions += 1
        # The loss reaches both ends a reactor turn or more later: without this wait the next
        # step could start on the dying connection and its cut would find nothing to cut.
        await settle(reactor, _gone(proxy, before), 5, step=0.01)
        if backend_link:
            await settle(reactor, lambda: not connected(), 2, step=0.01)
        proxy.heal()
    proxy.heal()
    run.seconds = reactor.seconds() - started
    return run


def _gone(proxy: ChaosProxy, fronts: set[Any]) -> Callable[[], bool]:
    """True once none of C{fronts} (the proxy's connections at some moment) is open."""
    return lambda: not (fronts & proxy.fronts)


async def converge(
    reactor: Any, backend: Any, node_id: str, run: ChaosRun, connected: Callable[[], bool],
    timeout: float = 60.0,
) -> CommandTally:
    """Wait for the agent to reconnect and resolve everything, then check the invariants."""
    def done() -> bool:
        return connected() and all(backend.command(c)["status"] in TERMINAL for c in run.commands)

    if not await settle(reactor, done, timeout):
        run.stuck.append(f"not settled within {timeout:.0f} s after the last step")
    await sleep(reactor, 1.0)  # late repeats or regressions would show up now
    return check_commands(backend, node_id, run.commands)
