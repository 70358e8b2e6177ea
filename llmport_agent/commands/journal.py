"""
The command journal: what the agent knows about every command it has received, on disk.

A command is recorded (durably) before it is acked, and every later change of its state is
appended. At start the journal is replayed: commands without a result are resolved (re-run or
failed with C{agent_restarted}), results not confirmed as delivered are sent again.

File: C{<state dir>/commands.jsonl}, JSON lines, each a partial record C{{"id": ..., <fields>}};
the latest value of each field wins. Lines are serialised and written on the I/O pool.

Bounded cost:
 - an add, update or delivery is O(1) amortised: delivered records are kept in their own
   delivery-ordered index, so pruning never walks the records that must stay;
 - retention: delivered records beyond C{max_records}, beyond C{max_bytes} (their estimated
   size) or older than C{max_age} are dropped, oldest first. Records without a delivered
   result (received, running, finished but unconfirmed) are never dropped, whatever the bounds
   say: losing one would leave its command stuck in the backend for ever;
 - a command's payload is dropped from the journal when it finishes, a large result once it
   is delivered;
 - the file is compacted (rewritten with the live records, atomically) by bytes: when what
   was appended since the last compaction exceeds what it wrote plus L{COMPACT_SLACK}, so the
   file stays within about twice its live content and the start-up read stays short.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from attrs import field
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger

from llmport_agent.core.storage import GroupCommitLog, read_log
from llmport_agent.core.threads import BlockingRunner
from llmport_agent.core.values import define

log = Logger()

# States
RECEIVED = "received"  # recorded; ack not yet sent or not known to be delivered
RUNNING = "running"  # acked, executing
FINISHED = "finished"  # result computed; delivery not yet confirmed
DELIVERED = "delivered"  # result confirmed delivered

#: Results larger than this (JSON characters, roughly) are dropped once delivered.
SMALL_RESULT = 4096

#: The key of the stub that replaces a result not kept after delivery.
DROPPED = "_dropped"


def result_dropped(rec: JournalRecord) -> bool:
    """True when C{rec}'s result was delivered and then dropped from the journal."""
    frame = rec.result_frame
    result = frame.get("result") if isinstance(frame, dict) else None
    return isinstance(result, dict) and DROPPED in result


#: Result fields that hold a secret (the Ray cluster token of describe_ray_cluster's sealed
#: hand-over, protocol 10.4/10.6): sent to the backend from memory, never written to the file.
RESULT_SECRET_FIELDS = frozenset({"cluster_token"})


def _for_disk(line: dict[str, Any]) -> dict[str, Any]:
    """C{line} as written to the file: a result frame without its secret fields."""
    frame = line.get("result_frame")
    if not isinstance(frame, dict):
        return line
    result = frame.get("result")
    if not isinstance(result, dict) or not RESULT_SECRET_FIELDS.intersection(result):
        return line
    kept = {k: v for k, v in result.items() if k not in RESULT_SECRET_FIELDS}
    return dict(line, result_frame=dict(frame, result=kept))


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


#: Compact once this much more than the live content has been appended.
COMPACT_SLACK = 4 * 1024 * 1024
#: The estimated size of a record without payload or result (JSON).
_RECORD_BASE = 320


@define(eq=False, repr=False)  # a component: identity, not value
class CommandJournal:
    runner: BlockingRunner
    path: str
    clock: Callable[[], float]
    max_records: int = 5000
    max_age: float = 7 * 86400.0
    max_bytes: int = 16 * 1024 * 1024
    records: OrderedDict[str, JournalRecord] = field(factory=OrderedDict)
    damaged_lines: int = 0
    #: Delivered records, oldest delivery first, with their estimated size.
    _delivered: OrderedDict[str, int] = field(factory=OrderedDict)
    delivered_bytes: int = 0
    compactions: int = 0
    _log: GroupCommitLog | None = None

    def load(self) -> Deferred[None]:
        """Replay the file (off the reactor)."""

        def replay(result: tuple[list[dict[str, Any]], int, bool]) -> Deferred[None]:
            lines, damaged, empty = result
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
            delivered = sorted(
                (r for r in self.records.values() if r.state == DELIVERED),
                key=lambda r: r.finished_at or 0.0,
            )
            for rec in delivered:
                self._index_delivered(rec)
            self._log = GroupCommitLog(self.runner, self.path)
            if empty and not self.records:
                # No file (or an empty regular one): nothing to compact (a first start: issue
                # 27). The first append makes the file. Anything else there (a link, say) is
                # replaced by the rewrite, as always.
                return succeed(None)
            self._prune()
            return self._compact()

        return self.runner.run(read_log, self.path).addCallback(replay)

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
        if rec.state == DELIVERED:
            self._index_delivered(rec)
        self._prune()

        def failed(f: Any) -> Any:
            if self.records.get(rec.id) is rec:
                del self.records[rec.id]
                self._unindex(rec.id)
            return f

        return self._append(rec.as_dict()).addErrback(failed)

    def update(self, command_id: str, **changes: Any) -> Deferred[None]:
        rec = self.records.get(command_id)
        if rec is None:
            from twisted.internet.defer import succeed

            return succeed(None)
        for key, value in changes.items():
            setattr(rec, key, value)
        if rec.state != DELIVERED:
            self._unindex(command_id)
        return self._append({"id": command_id, **changes})

    def note(self, command_id: str, **changes: Any) -> None:
        """L{update} without waiting: a failed write is logged (the in-memory state is kept)."""
        self.update(command_id, **changes).addErrback(
            lambda f: log.failure("Could not record a change of command {id}", failure=f, id=command_id)
        )

    def mark_delivered(self, command_id: str, keep: bool = True, rerunnable: bool = False) -> Deferred[None]:
        """
        The backend confirmed the result. A result that is not to be kept (C{keep} false: logs,
        statuses) or is large is dropped (L{result_dropped}). The record's copy of the command
        is kept only then, for a C{rerunnable} read and when it is small, so that a re-listing
        can run it again; otherwise it is dropped.
        """
        rec = self.records.get(command_id)
        changes: dict[str, Any] = {"state": DELIVERED}
        kept = 0
        command = None
        if rec is not None and rec.result_frame is not None:
            kept = _size(rec.result_frame)
            if not keep or kept > SMALL_RESULT:
                small = {k: v for k, v in rec.result_frame.items() if k != "result"}
                small["result"] = {DROPPED: "result not kept after delivery"}
                changes["result_frame"] = small
                kept = _size(small)
                if rerunnable and rec.command is not None and _size(rec.command) <= SMALL_RESULT:
                    command = rec.command
                    kept += _size(command)
        if rec is not None and rec.command is not None and command is None:
            changes["command"] = None
        d = self.update(command_id, **changes)
        if rec is not None:
            self._index_delivered(rec, kept)
            self._prune()
        return d

    def unfinished(self) -> list[JournalRecord]:
        return [r for r in self.records.values() if not r.finished]

    def undelivered(self) -> list[JournalRecord]:
        return [r for r in self.records.values() if r.state == FINISHED]

    def depth(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.records.values():
            counts[r.state] = counts.get(r.state, 0) + 1
        counts["total"] = len(self.records)
        counts["delivered_bytes"] = self.delivered_bytes
        if self._log is not None:
            counts["file_bytes"] = self._log.bytes_written
        return counts

    # -- bounds ------------------------------------------------------------------------

    def _index_delivered(self, rec: JournalRecord, result_size: int | None = None) -> None:
        """Put a delivered record at the young end of the delivery index (O(1))."""
        self._unindex(rec.id)
        if result_size is None:
            result_size = _size(rec.result_frame) if rec.result_frame is not None else 0
        size = _RECORD_BASE + len(rec.command_type) + len(rec.correlation_id or "") + result_size
        self._delivered[rec.id] = size
        self.delivered_bytes += size

    def _unindex(self, command_id: str) -> None:
        size = self._delivered.pop(command_id, None)
        if size is not None:
            self.delivered_bytes -= size

    def _prune(self) -> None:
        """
        Drop delivered records beyond the bounds, oldest delivery first. O(1) amortised: each
        record is dropped once, and only delivered records are ever looked at.
        """
        now = self.clock()
        while self._delivered:
            cid, size = next(iter(self._delivered.items()))
            rec = self.records.get(cid)
            if rec is None or rec.state != DELIVERED:
                # A stale index entry (re-opened or forgotten record): not ours to drop.
                self._unindex(cid)
                continue
            over = len(self.records) > self.max_records or self.delivered_bytes > self.max_bytes
            old = bool(rec.finished_at) and now - (rec.finished_at or 0.0) > self.max_age
            if not (over or old):
                break
            del self.records[cid]
            self._unindex(cid)

    # -- file ----------------------------------------------------------------------------

    def _append(self, line: dict[str, Any]) -> Deferred[None]:
        assert self._log is not None, "journal not loaded"
        d = self._log.append(_for_disk(line))
        log_ = self._log
        grown = log_.bytes_written - log_.rewritten_bytes
        if (grown > log_.rewritten_bytes + COMPACT_SLACK or log_.lines_written > 4 * len(self.records) + 20000) and (
            not log_.rewrite_pending
        ):
            self._compact()
        return d

    def _compact(self) -> Deferred[None]:
        assert self._log is not None
        self._prune()
        self.compactions += 1
        # Shallow snapshots; they are serialised on the I/O pool.
        return self._log.rewrite([_for_disk(r.as_dict()) for r in self.records.values()])

    def idle(self) -> bool:
        return self._log is None or self._log.idle
