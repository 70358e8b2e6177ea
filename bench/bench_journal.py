"""
The command journal and intake under load (issue 8): prints figures, asserts nothing.

 1. reactor lateness (a 10 ms probe) while one frame of N commands (default 10 000) arrives and
    is acked, run and answered; baseline: the same probe with nothing arriving, same run;
 2. journal bytes and start-up read time after M commands (default 5 000) of 300 KB payload
    each, all finished and delivered; baseline: what was appended in all (the file size
    without compaction by bytes) and the start-up read of a journal of M small commands.

The pipeline, journal and outbox are the agent's own, on the real reactor with the real I/O
pool (2 threads, fsync); the session serialises every frame as the WebSocket protocol does and
confirms deliveries a reactor turn later, as a pong would.

Usage: python3 bench/bench_journal.py [--commands 10000] [--big 5000] [--payload-kb 300]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twisted.internet.defer import Deferred, ensureDeferred  # noqa: E402
from twisted.internet.task import deferLater, react  # noqa: E402

from llmport_agent.commands.base import HandlerSpec  # noqa: E402
from llmport_agent.commands.journal import CommandJournal  # noqa: E402
from llmport_agent.commands.node import PersistentModes  # noqa: E402
from llmport_agent.commands.pipeline import CommandPipeline  # noqa: E402
from llmport_agent.core.state import StateStore
from llmport_agent.core.threads import PoolService
from llmport_agent.events.outbox import EventOutbox  # noqa: E402
from llmport_agent.session.protocol import fire_in_slices  # noqa: E402
from tests.support.probe import LatenessProbe  # noqa: E402


class SerializingSession:
    """
    Frames are serialised as AgentClientProtocol.send_frame does; confirmations work as its
    pings do: one ping outstanding, answered 1 ms later, confirming everything sent before it
    (released in slices, as the protocol does).
    """

    def __init__(self, reactor: Any) -> None:
        self.reactor = reactor
        self.connected = True
        self.seq = 0
        self.bytes = 0
        self.node_id = "bench"
        self._unconfirmed: list[Deferred[None]] = []
        self._ping: list[Deferred[None]] | None = None

    def send(self, frame: dict[str, Any]) -> bool:
        self.seq += 1
        self.bytes += len(json.dumps(dict(frame, seq=self.seq), separators=(",", ":"), default=str))
        return True

    def confirm(self) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        self._unconfirmed.append(d)
        if self._ping is None:
            self._send_ping()
        return d

    def _send_ping(self) -> None:
        self._ping, self._unconfirmed = self._unconfirmed, []
        self.reactor.callLater(0.001, self._pong)

    def _pong(self) -> None:
        waiters, self._ping = self._ping or [], None
        fire_in_slices(self.reactor, waiters)
        if self._unconfirmed:
            self._send_ping()


def command(payload: dict[str, Any]) -> dict[str, Any]:
    cid = str(uuid.uuid4())
    return {"id": cid, "node_id": "n", "command_type": "noop", "status": "dispatched", "correlation_id": None,
            "idempotency_key": cid, "payload": payload, "result": None, "timeout_sec": None, "error_code": None,
            "error_message": None, "issued_at": "2024-01-01T00:00:00+00:00",
            "dispatched_at": "2024-01-01T00:00:01+00:00", "acked_at": None, "started_at": None,
            "completed_at": None}


async def make_pipeline(reactor: Any, pool: PoolService, d: str) -> tuple[CommandPipeline, CommandJournal]:
    session = SerializingSession(reactor)
    journal = CommandJournal(pool, os.path.join(d, "commands.jsonl"), time.time)
    await journal.load()
    outbox = EventOutbox(reactor, pool, os.path.join(d, "events.jsonl"), session)
    await outbox.load()
    state = StateStore(pool, os.path.join(d, "state.json"))
    await state.load()

    async def noop(ctx: Any) -> dict[str, Any]:
        return {"ok": True}

    pipeline = CommandPipeline(reactor, session, journal,
                               {"noop": HandlerSpec(noop, lane="read", idempotent=True, deadline=3600)},
                               PersistentModes(state), outbox, credential=lambda: "c")
    pipeline.startService()
    return pipeline, journal


async def settle(reactor: Any, pipeline: CommandPipeline, journal: CommandJournal, n: int) -> None:
    while pipeline.stats["succeeded"] < n or not journal.idle():
        await deferLater(reactor, 0.05, lambda: None)


async def load_time(reactor: Any, pool: PoolService, path: str) -> tuple[float, int]:
    started = time.perf_counter()
    j = CommandJournal(pool, path, time.time)
    await j.load()
    return time.perf_counter() - started, len(j.records)


async def main(reactor: Any, n: int, big: int, payload_kb: int) -> None:
    pool = PoolService(reactor, "io", 2)
    pool.startService()
    probe = LatenessProbe()
    root = tempfile.mkdtemp(prefix="llmport-bench-journal-", dir="/var/tmp")
    try:
        print(f"== reactor lateness while one frame of {n} commands arrives ==")
        probe.start()
        await deferLater(reactor, 3.0, lambda: None)
        probe.stop()
        print(f"baseline, nothing arriving (3 s)  : {probe.summary()}")
        d1 = os.path.join(root, "one-frame")
        os.makedirs(d1)
        pipeline, journal = await make_pipeline(reactor, pool, d1)
        cs = [command({"runtime_id": f"r{i}"}) for i in range(n)]
        probe.start()
        started = time.perf_counter()
        pipeline.frame_received({"type": "commands", "items": cs})
        await settle(reactor, pipeline, journal, n)
        elapsed = time.perf_counter() - started
        probe.stop()
        print(f"{n} commands, all acked and answered: {elapsed:.1f} s ({n / elapsed:.0f} commands/s)")
        print(f"probe during it                  : {probe.summary()}  (target: p99 and max <= 50 ms)")
        pipeline.stopService()

        print(f"\n== journal after {big} commands of {payload_kb} KB (all finished and delivered) ==")
        d2 = os.path.join(root, "big")
        os.makedirs(d2)
        pipeline, journal = await make_pipeline(reactor, pool, d2)
        blob = "x" * (payload_kb * 1024)
        sent = 0
        probe.start()
        started = time.perf_counter()
        while sent < big:
            frame = [command({"blob": blob, "i": sent + i}) for i in range(min(50, big - sent))]
            sent += len(frame)
            pipeline.frame_received({"type": "commands", "items": frame})
            await settle(reactor, pipeline, journal, sent)
        elapsed = time.perf_counter() - started
        probe.stop()
        assert journal._log is not None
        appended = sent * (payload_kb * 1024 + 600)
        path = os.path.join(d2, "commands.jsonl")
        size = os.path.getsize(path)
        pipeline.stopService()
        read, records = await load_time(reactor, pool, path)
        print(f"{big} commands in frames of 50: {elapsed:.1f} s; probe meanwhile: {probe.summary()}")
        print(f"journal file                     : {size / 1e6:.2f} MB, {records} records, "
              f"{journal.compactions} compactions")
        print(f"appended in all (file without compaction by bytes): about {appended / 1e9:.2f} GB")
        print(f"start-up read of that journal    : {read * 1000:.0f} ms")
        d3 = os.path.join(root, "small")
        os.makedirs(d3)
        pipeline, journal = await make_pipeline(reactor, pool, d3)
        pipeline.frame_received({"type": "commands", "items": [command({}) for _ in range(big)]})
        await settle(reactor, pipeline, journal, big)
        pipeline.stopService()
        small_path = os.path.join(d3, "commands.jsonl")
        read_small, _ = await load_time(reactor, pool, small_path)
        print(f"baseline: start-up read of {big} small commands: {read_small * 1000:.0f} ms "
              f"({os.path.getsize(small_path) / 1e6:.2f} MB)")
    finally:
        probe.stop()
        await pool.stopService()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--commands", type=int, default=10_000)
    parser.add_argument("--big", type=int, default=5_000)
    parser.add_argument("--payload-kb", type=int, default=300)
    args = parser.parse_args()
    if os.environ.get("BENCH_GC") == "off":
        import gc

        gc.disable()
    elif os.environ.get("BENCH_GC") == "freeze":
        import gc

        gc.freeze()
    react(lambda reactor: ensureDeferred(main(reactor, args.commands, args.big, args.payload_kb)))
