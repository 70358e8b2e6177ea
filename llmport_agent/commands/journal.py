"""
The command journal: what the agent knows about every command it has received, on disk.

A command is recorded (durably) before it is acked, and every later change of its state is
appended. At start the journal is replayed: commands without a result are resolved (re-run or
failed with C{agent_restarted}), results not confirmed as delivered are sent again.

File: C{<state dir>/commands.jsonl}, JSON lines, each a partial record C{{"id": ..., <fields>}};
the latest value of each field wins. Compacted atomically when it grows past its live content.
Retention: at most C{max_records} records, finished ones older than C{max_age} are dropped; large
results are dropped from the journal once delivered.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from attrs import define, field
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from llmport_agent.storage import GroupCommitLog, ensure_private_dir, read_json_lines
from llmport_agent.threads import BlockingRunner

log = Logger()

# States
RECEIVED = "received"  # recorded; ack not yet sent or not known to be delivered
RUNNING = "running"  # acked, executing
FINISHED = "finished"  # result computed; delivery not yet confirmed
DELIVERED = "delivered"  # result confirmed delivered

#: Results larger than this (JSON characters, roughly) are dropped once delivered.
SMALL_RESULT = 4096


@define
class JournalRecord:
    id: str
    command_type: str = ""
    runtime_id: str | None = None
    correlation_id: str | None = None
    state: str = RECEIVED
    received_at: float = 0.0
    finished_at: float | None = None
    acked: bool = False
    result_frame: dict[str, Any] | None = None
    command: dict[str, Any] | None = None  # the raw command, kept until finished (for re-runs)

    @property
    def finished(self) -> bool:
        return self.state in (FINISHED, DELIVERED)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "command_type": self.command_type,
            "runtime_id": self.runtime_id,
            "correlation_id": self.correlation_id,
            "state": self.state,
            "received_at": self.received_at,
            "finished_at": self.finished_at,
            "acked": self.acked,
            "result_frame": self.result_frame,
            "command": self.command,
        }


def _opt(kind: type | tuple[type, ...]) -> Any:
    return lambda v: v is None or (isinstance(v, kind) and not isinstance(v, bool))


#: Replayed fields and the types they must have (a line with another type is damaged).
_FIELD_TYPES: dict[str, Any] = {
    "command_type": lambda v: isinstance(v, str),
    "runtime_id": _opt(str),
    "correlation_id": _opt(str),
    "state": lambda v: v in (RECEIVED, RUNNING, FINISHED, DELIVERED),
    "received_at": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "finished_at": _opt((int, float)),
    "acked": lambda v: isinstance(v, bool),
    "result_frame": _opt(dict),
    "command": _opt(dict),
}


def _size(obj: Any) -> int:
    import json

    try:
        return len(json.dumps(obj, default=str))
    except (TypeError, ValueError):
        return SMALL_RESULT + 1


@define
class CommandJournal:
    runner: BlockingRunner
    path: str
    clock: Callable[[], float]
    max_records: int = 5000
    max_age: float = 7 * 86400.0
    records: OrderedDict[str, JournalRecord] = field(factory=OrderedDict)
    damaged_lines: int = 0
    _log: GroupCommitLog | None = None

    def load(self) -> Deferred[None]:
        """Replay the file (off the reactor)."""

        def read() -> tuple[list[dict[str, Any]], int]:
            ensure_private_dir(os.path.dirname(os.path.abspath(self.path)))
            return read_json_lines(self.path)

        def replay(result: tuple[list[dict[str, Any]], int]) -> Deferred[None]:
            lines, damaged = result
            self.damaged_lines = damaged
            if damaged:
                log.warn(
                    "The command journal {path} had {n} damaged line(s) (a crash mid-write); skipped",
                    path=self.path,
                    n=damaged,
                )
            for line in lines:
                cid = line.get("id")
                if not isinstance(cid, str) or not all(
                    _FIELD_TYPES[k](v) for k, v in line.items() if k in _FIELD_TYPES
                ):
                    self.damaged_lines += 1
                    continue
                rec = self.records.get(cid)
                if rec is None:
                    rec = self.records[cid] = JournalRecord(id=cid)
                for key, value in line.items():
                    if key in _FIELD_TYPES:
                        setattr(rec, key, value)
            if self.damaged_lines > damaged:
                log.warn(
                    "The command journal {path} had {n} line(s) with wrong field types; skipped",
                    path=self.path,
                    n=self.damaged_lines - damaged,
                )
            self._log = GroupCommitLog(self.runner, self.path)
            self._prune()
            return self._log.rewrite(r.as_dict() for r in self.records.values())

        return self.runner.run(read).addCallback(replay)

    def get(self, command_id: str) -> JournalRecord | None:
        return self.records.get(command_id)

    def __contains__(self, command_id: str) -> bool:
        return command_id in self.records

    def add(self, rec: JournalRecord) -> Deferred[None]:
        """
        Record a new command; fires once it is durable. If the write fails, the record is
        forgotten again, so the command is handled afresh when the backend lists it again.
        """
        self.records[rec.id] = rec
        self._prune()

        def failed(f: Any) -> Any:
            if self.records.get(rec.id) is rec:
                del self.records[rec.id]
            return f

        return self._append(rec.as_dict()).addErrback(failed)

    def update(self, command_id: str, **changes: Any) -> Deferred[None]:
        rec = self.records.get(command_id)
        if rec is None:
            from twisted.internet.defer import succeed

            return succeed(None)
        for key, value in changes.items():
            setattr(rec, key, value)
        return self._append({"id": command_id, **changes})

    def note(self, command_id: str, **changes: Any) -> None:
        """L{update} without waiting: a failed write is logged (the in-memory state is kept)."""
        self.update(command_id, **changes).addErrback(
            lambda f: log.failure("Could not record a change of command {id}", failure=f, id=command_id)
        )

    def mark_delivered(self, command_id: str) -> Deferred[None]:
        rec = self.records.get(command_id)
        changes: dict[str, Any] = {"state": DELIVERED}
        if rec is not None and rec.result_frame is not None and _size(rec.result_frame) > SMALL_RESULT:
            # Large results (logs, diagnostics) are not kept once delivered.
            small = {k: v for k, v in rec.result_frame.items() if k != "result"}
            small["result"] = {"_dropped": "large result not kept after delivery"}
            changes["result_frame"] = small
        return self.update(command_id, **changes)

    def unfinished(self) -> list[JournalRecord]:
        return [r for r in self.records.values() if not r.finished]

    def undelivered(self) -> list[JournalRecord]:
        return [r for r in self.records.values() if r.state == FINISHED]

    def depth(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.records.values():
            counts[r.state] = counts.get(r.state, 0) + 1
        counts["total"] = len(self.records)
        return counts

    def _append(self, line: dict[str, Any]) -> Deferred[None]:
        assert self._log is not None, "journal not loaded"
        d = self._log.append(line)
        if self._log.lines_written > 4 * len(self.records) + 2000:
            self._compact()
        return d

    def _compact(self) -> None:
        assert self._log is not None
        self._prune()
        self._log.rewrite(r.as_dict() for r in self.records.values())

    def _prune(self) -> None:
        now = self.clock()
        for cid in list(self.records):
            rec = self.records[cid]
            if rec.state == DELIVERED and rec.finished_at and now - rec.finished_at > self.max_age:
                del self.records[cid]
        excess = len(self.records) - self.max_records
        if excess > 0:
            for cid in list(self.records):
                if excess <= 0:
                    break
                if self.records[cid].state == DELIVERED:
                    del self.records[cid]
                    excess -= 1

    def idle(self) -> bool:
        return self._log is None or self._log.idle
