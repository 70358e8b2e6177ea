"""
The command pipeline: receipt, journal, de-duplication, ack, lanes, deadlines, results, delivery.

Rules (docs/protocol.md, "Commands: the rules", repeats them for operators):

 1. A command is written to the journal (durably) before it is acked; de-duplication is by id
    over everything in the journal, running or finished.
 2. Ack at once; progress while running; exactly one result. No ack or progress for a command
    once its result exists.
 3. A result is written to the journal before it is sent, and stays "undelivered" until a
    WebSocket ping sent after it is answered. Undelivered results are sent again right after
    the next connect, before anything else about that command.
 4. At start, commands without a result are resolved: re-run when their type is idempotent,
    otherwise failed with C{agent_restarted}.
 5. Never silent for long: from its ack to its result a command sends C{command_progress} at
    least every C{keepalive} seconds (its last phase again when nothing else was reported).
 6. Lanes: C{runtime} commands for the same runtime id run one at a time in arrival order;
    C{node} commands run one at a time in arrival order; C{read} commands never wait behind them.
    At most C{max_concurrent} runtime/node commands run at once.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from twisted.application.service import Service
from twisted.internet.defer import (
    CancelledError,
    Deferred,
    DeferredLock,
    DeferredSemaphore,
    TimeoutError,
    succeed,
)
from twisted.logger import Logger

from llmport_agent.commands.base import (
    AGENT_RESTARTED,
    COMMAND_EXPIRED,
    INTERNAL_ERROR,
    INVALID_COMMAND,
    POLICY_VIOLATION,
    RESULT_NOT_SERIALIZABLE,
    SIGNATURE_INVALID,
    TIMED_OUT,
    Command,
    CommandFailed,
    HandlerSpec,
)
from llmport_agent.commands.journal import (
    DELIVERED,
    FINISHED,
    RECEIVED,
    RUNNING,
    CommandJournal,
    JournalRecord,
    result_dropped,
)
from llmport_agent.commands.jsonsafe import json_problem
from llmport_agent.commands.keepalive import ProgressKeepalive
from llmport_agent.commands.parse import (
    MAX_COMMAND_BYTES,
    MAX_COMMAND_DEPTH,
    Malformed,
    TooDeep,
    json_size,
    parse_command,
    parse_iso8601,
    scrub_for_journal,
    signature_ok,
)
from llmport_agent.session.framesplit import UnparsedItem
from llmport_agent.session.protocol import ConnectionGone

READ_CONCURRENCY = 16
#: Commands received per reactor turn (the rest of a big frame follows in the next turns).
INTAKE_BATCH = 64
#: Commands being recorded, run or answered at once, at most (more wait in the intake).
MAX_ADMITTED = 512
#: Commands waiting to be received, at most (more are left for the backend to list again).
MAX_INTAKE = 100_000


#: Unknown inbound frame types warned about (once each); further new ones are ignored quietly.
MAX_UNKNOWN_FRAME_TYPES = 64
#: Commands with actions waiting for their result's delivery (L{CommandPipeline.after_delivery}).
MAX_AFTER_DELIVERY = 1024

class NodeModes(Protocol):
    """What the pipeline needs to know about node modes (maintenance, draining)."""

    @property
    def maintenance(self) -> bool: ...

    @property
    def draining(self) -> bool: ...


class _Context:
    """The L{CommandContext} given to handlers."""

    def __init__(self, pipeline: CommandPipeline, command: Command, rec: JournalRecord) -> None:
        self.command = command
        self.reactor = pipeline.reactor
        self._pipeline = pipeline
        self._rec = rec

    def progress(self, phase: str, message: str, **extra: Any) -> None:
        self._pipeline.send_progress(self._rec, phase, message, extra)

    def emit_event(
        self,
        event_type: str,
        payload: Mapping[str, Any],
        severity: str = "info",
        correlation_id: str | None = None,
    ) -> None:
        self._pipeline.outbox.emit(
            event_type, payload, severity, correlation_id or self.command.reply_correlation_id
        )

    def after_result(self, fn: Callable[[], None]) -> None:
        self._pipeline.after_delivery(self._rec.id, fn)


class CommandPipeline(Service):
    log = Logger()

    def __init__(
        self,
        reactor: Any,
        session: Any,
        journal: CommandJournal,
        registry: Mapping[str, HandlerSpec],
        modes: NodeModes,
        outbox: Any,
        *,
        credential: Callable[[], str],
        max_concurrent: int = 8,
        max_age: float = 0.0,
        deadlines: Mapping[str, float] | None = None,
        wallclock: Callable[[], float] = time.time,
        calls: Any = None,
        keepalive: float = 30.0,
        pickup: Any = None,
    ) -> None:
        self.setName("commands")
        self.reactor = reactor
        self.session = session
        self.journal = journal
        self.registry = dict(registry)
        self.modes = modes
        self.outbox = outbox
        self._credential = credential
        self.max_age = max_age
        self.deadlines = dict(deadlines or {})
        self._wallclock = wallclock
        self._global = DeferredSemaphore(max_concurrent)
        self._reads = DeferredSemaphore(READ_CONCURRENCY)
        self._locks: dict[str, DeferredLock] = {}
        self._running: dict[str, Deferred[Any]] = {}
        self._tasks: set[Deferred[Any]] = set()
        self._delivering: set[str] = set()
        #: Actions to run once the backend confirmed a command's result, by command id.
        self._after_delivery: dict[str, list[Callable[[], None]]] = {}
        self._receiving: set[str] = set()
        # Acks sent on the current connection: the backend's lists can be stale for a few
        # frames after an ack, so a listed command is re-acked only after a reconnect.
        self._acked_here: set[str] = set()
        self._stopping = False
        # A stop in progress (SIGTERM): running commands finish, nothing new starts.
        self._draining = False
        self._deferred_ids: set[str] = set()
        self.keepalive = keepalive
        #: Commands from their ack to their result, each with its progress keepalive.
        self._keepalives: dict[str, ProgressKeepalive] = {}
        self._finishing = 0
        self._unknown_frame_types: set[str] = set()
        # Commands of arrived frames not yet received: a frame of 10 000 commands is taken in
        # over many reactor turns, in order, so the reactor never stalls on one frame.
        self._intake: deque[tuple[Any, bool]] = deque()
        self._intake_call: Any = None
        self.stats = {"received": 0, "duplicates": 0, "malformed": 0, "succeeded": 0, "failed": 0,
                      "timed_out": 0, "results_resent": 0, "deferred_by_stop": 0, "redispatched": 0,
                      "replayed": 0, "rerun": 0}
        if calls is None:
            from llmport_agent.ops.timing import command_calls

            calls = command_calls(lambda: self.registry)
        #: Durations by command type and outcome (metrics).
        self.calls = calls
        if pickup is None:
            from llmport_agent.ops.timing import CommandPickup

            pickup = CommandPickup(lambda: self.registry)
        #: Waits from the backend issuing a command to its start (metrics).
        self.pickup = pickup

    # -- lifecycle -------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._stopping = False
        self.recover()

    def recover(self) -> None:
        """Resolve commands left without a result by the previous run of the agent."""
        for rec in self.journal.unfinished():
            raw = rec.command
            parsed = parse_command(raw) if raw is not None else None
            spec = self.registry.get(rec.command_type)
            never_started = rec.state == RECEIVED
            if isinstance(parsed, Command) and spec is not None and (spec.idempotent or never_started):
                self.log.info(
                    "Re-running command {id} ({type}) interrupted by the last agent stop",
                    id=rec.id,
                    type=rec.command_type,
                )
                self._track(Deferred.fromCoroutine(self._run(rec, parsed, resumed=True)))
            else:
                self.log.info(
                    "Command {id} ({type}) was interrupted by the last agent stop and is not safe "
                    "to repeat; reporting it as failed",
                    id=rec.id,
                    type=rec.command_type,
                )
                self._track(
                    Deferred.fromCoroutine(
                        self._finish(
                            rec,
                            False,
                            {},
                            AGENT_RESTARTED,
                            f"The agent restarted (stop, crash or power loss) while this "
                            f"{rec.command_type or 'command'} was in progress. It was not re-run "
                            "because it is not safe to repeat: check the runtime's state and "
                            "issue the command again if needed.",
                        )
                    )
                )

    def stopService(self) -> Deferred[None]:
        """Cancel running handlers; their commands stay unfinished and are resolved next start."""
        super().stopService()
        self._stopping = True
        if self._intake_call is not None and self._intake_call.active():
            self._intake_call.cancel()
        self._intake_call = None
        # Not journaled, so not acked: the backend lists them again after the restart.
        self._intake.clear()
        for ka in list(self._keepalives.values()):
            ka.stop()
        self._keepalives.clear()
        self._after_delivery.clear()
        for d in list(self._running.values()):
            d.cancel()
        pending = list(self._tasks)
        if not pending:
            return succeed(None)
        from twisted.internet.defer import DeferredList

        done: Deferred[Any] = DeferredList(pending, consumeErrors=True)
        done.addTimeout(5, self.reactor)
        return done.addBoth(lambda _: None)

    # -- drain (graceful stop) ---------------------------------------------------------------

    def begin_drain(self) -> None:
        """
        Stop taking commands: new ones are neither journaled nor acked (the backend offers them
        again after the restart), queued ones do not start (they stay in the journal and run at
        the next start). Running ones go on to their result.
        """
        self._draining = True

    @property
    def running_count(self) -> int:
        """How many commands are running now (their handlers have not returned)."""
        return len(self._running)

    @property
    def busy(self) -> int:
        """Commands running or whose result is being written or confirmed."""
        return len(self._running) + self._finishing + len(self._delivering)

    def wait_idle(self, interval: float = 0.05) -> Deferred[None]:
        """Fires once nothing is L{busy} (checked every C{interval} seconds)."""
        from twisted.internet.task import LoopingCall

        done: Deferred[None] = Deferred()

        def check() -> None:
            if not self.busy and not done.called:
                loop.stop()
                done.callback(None)

        loop = LoopingCall(check)
        loop.clock = self.reactor
        loop.start(interval, now=True).addErrback(lambda f: None)

        def cancelled(d: Deferred[None]) -> None:
            if loop.running:
                loop.stop()

        result: Deferred[None] = Deferred(cancelled)
        done.chainDeferred(result)
        return result

    def _track(self, d: Deferred[Any]) -> None:
        self._tasks.add(d)

        def done(result: Any) -> None:
            self._tasks.discard(d)
            if hasattr(result, "trap"):
                self.log.failure("Command task failed", failure=result)
            self._schedule_intake()

        d.addBoth(done)

    # -- session listener ------------------------------------------------------------------

    def session_opened(self) -> None:
        # Results in doubt first, then acks the backend may not have seen.
        for rec in self.journal.undelivered():
            self.stats["results_resent"] += 1
            self._send_result(rec)
        for rec in self.journal.unfinished():
            if not rec.acked and rec.id not in self._receiving:
                self._send_ack(rec)
        # Then where each command in the works is: the current backend failed them when the
        # stream dropped (node_stream_lost); this says they go on (their result settles it).
        for ka in list(self._keepalives.values()):
            ka.send_now()

    def session_closed(self) -> None:
        self._delivering.clear()
        self._acked_here.clear()

    def frame_received(self, frame: dict[str, Any]) -> None:
        kind = frame.get("type")
        if kind == "hello_ack":
            items = frame.get("commands", [])
        elif kind == "commands":
            items = frame.get("items", [])
        elif kind == "command":
            items = [frame.get("command")]
        else:
            key = str(kind)[:64]
            if key not in self._unknown_frame_types and len(self._unknown_frame_types) < MAX_UNKNOWN_FRAME_TYPES:
                # Warned once per type, and for at most MAX_UNKNOWN_FRAME_TYPES types: the names
                # come from the backend, so the set that remembers them is bounded.
                self._unknown_frame_types.add(key)
                self.log.warn("Ignored a frame of unknown type {type!r} from the backend", type=key)
            return
        if items is None:
            return
        if not isinstance(items, list):
            self.log.warn(
                "Ignored a {type} frame whose command list is not a list ({kind})",
                type=kind,
                kind=type(items).__name__,
            )
            return
        fresh = kind == "hello_ack"
        if len(self._intake) + len(items) > MAX_INTAKE:
            self.log.warn(
                "{n} commands arrived while {queued} are still being received; the newest are "
                "left for the backend to list again",
                n=len(items),
                queued=len(self._intake),
            )
            items = items[: max(0, MAX_INTAKE - len(self._intake))]
        self._intake.extend((obj, fresh) for obj in items)
        if self._intake_call is None:
            self._drain_intake()

    def _drain_intake(self) -> None:
        """
        Receive at most L{INTAKE_BATCH} commands now, the rest in later reactor turns; while
        L{MAX_ADMITTED} commands are in the works, wait for some to finish (the heap, and with
        it every garbage collection, stays small however many arrive at once).
        """
        self._intake_call = None
        for _ in range(min(INTAKE_BATCH, len(self._intake))):
            if len(self._tasks) >= MAX_ADMITTED:
                break
            obj, fresh = self._intake.popleft()
            try:
                self.receive(obj, fresh=fresh)
            except Exception:
                self.log.failure("Could not receive a command")
        self._schedule_intake()

    def _schedule_intake(self) -> None:
        if (
            self._intake
            and self._intake_call is None
            and not self._stopping
            and len(self._tasks) < MAX_ADMITTED
        ):
            self._intake_call = self.reactor.callLater(0, self._drain_intake)

    # -- receipt ---------------------------------------------------------------------------

    def receive(self, obj: Any, fresh: bool = False) -> None:  # noqa: C901
        """
        Take one command object. C{fresh} is true for the list in C{hello_ack}, which the
        backend computes after our previous connection's frames: a command listed there has
        had neither ack nor result processed, whatever we believed.
        """
        parsed = parse_command(obj)
        journal_copy: dict[str, Any] | None = None
        if isinstance(parsed, Command):
            size = json_size(obj)
            problem = None
            if size > MAX_COMMAND_BYTES:
                problem = "the command is larger than 1 MiB; it was not run"
            else:
                try:
                    if size < 0:
                        raise TooDeep("too deep to serialise")
                    # Kept for a re-run after a restart; registry credentials never reach the disk.
                    journal_copy = scrub_for_journal(dict(parsed.raw, id=parsed.id))
                except TooDeep:
                    problem = f"the command is nested more than {MAX_COMMAND_DEPTH} levels deep; it was not run"
            if problem is not None:
                parsed = Malformed(parsed.id, problem, parsed.correlation_id)
        cid = parsed.command_id if isinstance(parsed, Malformed) else parsed.id
        if cid is None:
            assert isinstance(parsed, Malformed)
            self.stats["malformed"] += 1
            self.log.warn("Ignored a command with no usable id: {problem}", problem=parsed.message)
            return
        if cid in self._receiving:
            self.stats["duplicates"] += 1
            return
        known = self.journal.get(cid)
        if known is not None:
            self._listed_again(known, fresh, _redispatched(obj))
            return
        if self._draining:
            # Not journaled, not acked: still pending in the backend, offered again later.
            if cid not in self._deferred_ids and len(self._deferred_ids) < 10000:
                self._deferred_ids.add(cid)
                self.stats["deferred_by_stop"] += 1
                self.log.info("Command {id} arrived while the agent is stopping; leaving it to "
                              "the next start", id=cid)
            return
        self.stats["received"] += 1
        if isinstance(parsed, Malformed):
            self.stats["malformed"] += 1
            ctype = obj.get("command_type") if isinstance(obj, dict | UnparsedItem) else None
            rec = JournalRecord(
                id=cid,
                command_type=ctype if isinstance(ctype, str) else "",
                correlation_id=parsed.correlation_id,
                received_at=self._wallclock(),
            )
            self._track(Deferred.fromCoroutine(self._reject(rec, INVALID_COMMAND, parsed.message)))
            return
        rec = JournalRecord(
            id=cid,
            command_type=parsed.command_type,
            runtime_id=parsed.runtime_id,
            correlation_id=parsed.correlation_id,
            received_at=self._wallclock(),
            command=journal_copy,
        )
        self._track(Deferred.fromCoroutine(self._accept(rec, parsed)))

    def _listed_again(self, known: JournalRecord, fresh: bool, redispatched: bool) -> None:
        """
        A command the journal knows, listed again: de-duplicated by id, never run twice.

         - finished and confirmed delivered: answered from the journal with its stored result,
           marked C{"replayed": true}, when the backend lists it as not done (in C{hello_ack},
           or re-dispatched, protocol 10.2); on the same connection a listing that only lags
           behind our result gets nothing new. Finished but unconfirmed: the result is sent
           (again) plain, unless it is on its way. Never an ack: an ack after a result would
           move the command back in the backend.
         - received or running: joined (the one execution goes on to the one result); acked again
           when the backend has not seen our ack or asks again (C{redispatch: true}), and told
           the phase it is in.
        """
        self.stats["duplicates"] += 1
        if redispatched:
            self.stats["redispatched"] += 1
        if known.finished:
            if known.result_frame is None:
                return
            if known.state == DELIVERED and (fresh or redispatched) and result_dropped(known):
                parsed = parse_command(known.command) if known.command is not None else None
                spec = self.registry.get(known.command_type)
                if isinstance(parsed, Command) and spec is not None and _rerunnable(spec):
                    # Its result was delivered, then dropped (logs, statuses): a read is run
                    # again rather than answered with a stub that would replace the backend's
                    # copy of the result.
                    self._rerun(known, parsed)
                    return
            if known.state == DELIVERED and (fresh or redispatched):
                known.state = FINISHED
                self.journal.note(known.id, state=FINISHED)
                self.stats["results_resent"] += 1
                self._send_result(known, replayed=True)
            elif known.state == FINISHED:
                # Not confirmed yet: maybe the first the backend sees, so sent plain (a result
                # marked replayed does not correct a failure the backend set itself, such as
                # node_stream_lost).
                self._send_result(known)
            return
        first_here = known.id not in self._acked_here
        if redispatched or not known.acked:
            self._send_ack(known)
        if redispatched and first_here:
            # Once per connection: a frame listing the same id many times is answered once.
            ka = self._keepalives.get(known.id)
            if ka is not None:
                ka.send_now()
            self.log.info(
                "Command {id} ({type}) was re-dispatched by the backend while it is {state} here; "
                "joined it (one execution, one result)",
                id=known.id,
                type=known.command_type,
                state="running" if known.state == RUNNING else "queued",
            )

    def _rerun(self, rec: JournalRecord, command: Command) -> None:
        """Run a delivered read again for a backend that lists it as not done."""
        self.stats["rerun"] += 1
        self.log.info(
            "Command {id} ({type}) was listed again after its result was delivered and no longer "
            "kept; running it again",
            id=rec.id,
            type=rec.command_type,
        )
        rec.state = RECEIVED
        rec.result_frame = None
        rec.finished_at = None
        self.journal.note(rec.id, state=RECEIVED, result_frame=None, finished_at=None)
        self._send_ack(rec)
        self._track(Deferred.fromCoroutine(self._run(rec, command, resumed=True)))

    async def _record(self, rec: JournalRecord) -> bool:
        """Journal a new command before anything else. False (and no ack) if that failed."""
        self._receiving.add(rec.id)
        try:
            await self.journal.add(rec)
        except Exception as e:
            self.log.error(
                "Could not record command {id} in the journal ({error}); not acknowledging it, "
                "so the backend offers it again",
                id=rec.id,
                error=f"{type(e).__name__}: {e}",
            )
            return False
        finally:
            self._receiving.discard(rec.id)
        return True

    async def _reject(self, rec: JournalRecord, code: str, message: str) -> None:
        if await self._record(rec):
            self._send_ack(rec)
            await self._finish(rec, False, {}, code, message)

    async def _accept(self, rec: JournalRecord, command: Command) -> None:
        if await self._record(rec):
            self._send_ack(rec)
            await self._run(rec, command)

    # -- execution -------------------------------------------------------------------------

    def _refusal(
        self, command: Command, spec: HandlerSpec | None, resumed: bool = False
    ) -> tuple[str, str] | None:
        # A resumed command was verified when it first arrived (its journal copy is scrubbed).
        if not resumed and command.raw.get("signature") not in (None, "") and not signature_ok(
            command.raw, self._credential()
        ):
            return SIGNATURE_INVALID, "The command's signature does not match; it was not run."
        if spec is None:
            return INVALID_COMMAND, f"unsupported command type: {command.command_type}"
        if self.max_age > 0 and command.issued_at and not _redispatched(command.raw):
            # A re-dispatched command (protocol 10.2) is old by definition: never expired.
            issued = parse_iso8601(command.issued_at)
            if issued is not None and self._wallclock() - issued > self.max_age:
                return COMMAND_EXPIRED, (
                    f"The command was issued {int(self._wallclock() - issued)} s ago, longer than "
                    f"this node's LLM_PORT_NODE_AGENT_COMMAND_MAX_AGE_SEC ({self.max_age:g} s); "
                    "issue it again."
                )
        if spec.blocked_by_maintenance and self.modes.maintenance:
            return POLICY_VIOLATION, (
                f"This node is in maintenance mode: {command.command_type} is not allowed. "
                "Turn maintenance mode off (set_maintenance_mode enabled=false) first."
            )
        if spec.blocked_by_draining and self.modes.draining:
            return POLICY_VIOLATION, (
                f"This node is draining: {command.command_type} is not allowed. "
                "Resume the node (resume_node) first."
            )
        return None

    def _lane_key(self, command: Command, spec: HandlerSpec) -> str | None:
        if spec.lane == "read":
            return None
        if spec.lane == "node":
            return "node"
        return "runtime:" + (command.runtime_id or command.id)

    async def _run(self, rec: JournalRecord, command: Command, resumed: bool = False) -> None:
        ka = self._start_keepalive(rec)
        try:
            await self._run_unguarded(rec, command, resumed)
        except Exception as e:
            # Whatever went wrong, an acked command gets its one result.
            self.log.failure("Command {id} ({type}) broke the pipeline", id=rec.id,
                             type=command.command_type)
            await self._finish(
                rec, False, {}, INTERNAL_ERROR,
                f"The agent hit an internal error handling {command.command_type}: "
                f"{type(e).__name__}. See the agent's log on the node.",
            )
        finally:
            ka.stop()
            if self._keepalives.get(rec.id) is ka:
                del self._keepalives[rec.id]

    def _start_keepalive(self, rec: JournalRecord) -> ProgressKeepalive:
        def send(phase: str, message: str, extra: dict[str, Any]) -> bool:
            return self._send_progress_frame(rec, phase, message, extra)

        previous = self._keepalives.pop(rec.id, None)
        if previous is not None:
            previous.stop()
        ka = ProgressKeepalive(self.reactor, self.keepalive, send, "queued",
                               "waiting for its turn behind other commands")
        self._keepalives[rec.id] = ka
        return ka

    async def _run_unguarded(self, rec: JournalRecord, command: Command, resumed: bool) -> None:
        spec = self.registry.get(command.command_type)
        refusal = self._refusal(command, spec, resumed)
        if refusal is not None:
            await self._finish(rec, False, {}, refusal[0], refusal[1])
            return
        assert spec is not None
        if spec.on_arrival is not None:
            try:
                spec.on_arrival(command)
            except Exception:
                self.log.failure("Command {id} ({type}): its arrival hook failed", id=rec.id,
                                 type=command.command_type)
        key = self._lane_key(command, spec)
        lock = self._locks.setdefault(key, DeferredLock()) if key is not None else None
        # Reads and node-state commands never wait for deploy slots (the node lane is
        # serialized by its own lock).
        semaphore = self._global if spec.lane == "runtime" else self._reads
        if lock is not None:
            await lock.acquire()
        try:
            await semaphore.acquire()
            try:
                if self._stopping or self._draining:
                    # Acked, never started: journaled as received, run at the next start.
                    return
                await self._execute(rec, command, spec, resumed)
            finally:
                semaphore.release()
        finally:
            if lock is not None:
                lock.release()
                if key is not None and not lock.locked and not lock.waiting:
                    self._locks.pop(key, None)

    async def _execute(
        self, rec: JournalRecord, command: Command, spec: HandlerSpec, resumed: bool
    ) -> None:
        rec.state = RUNNING
        # Durable before the handler starts: at the next start, "running" means the command may
        # have had effects; "received" means it never started and can always be run.
        try:
            await self.journal.update(rec.id, state=RUNNING)
        except Exception as e:
            self.log.error("Could not record that command {id} started ({error}); running it anyway",
                           id=rec.id, error=f"{type(e).__name__}: {e}")
        ctx = _Context(self, command, rec)
        ka = self._keepalives.get(rec.id)
        if ka is not None:
            ka.set_phase("running", f"{command.command_type} is running")
        issued = parse_iso8601(command.issued_at) if command.issued_at and not resumed else None
        if issued is not None:
            try:
                self.pickup.observe(command.command_type, self._wallclock() - issued)
            except Exception:
                self.log.failure("Could not record the pickup time of command {id}", id=rec.id)
        if resumed:
            ctx.progress("resumed", "Re-running after an agent restart interrupted this command")
        deadline = self.deadlines.get(command.command_type, spec.deadline)
        started = self.reactor.seconds()
        d: Deferred[dict[str, Any]] = Deferred.fromCoroutine(_call(spec, ctx))
        timed_out = []

        def on_timeout(result: Any, timeout: float) -> Any:
            timed_out.append(True)
            return result

        d.addTimeout(deadline, self.reactor, onTimeoutCancel=on_timeout)
        self._running[rec.id] = d
        try:
            result = await d
        except (TimeoutError, CancelledError):
            if self._stopping and not timed_out:
                # Left unfinished on purpose: resolved at the next start.
                return
            self.stats["timed_out"] += 1
            await self._finish(
                rec,
                False,
                {},
                TIMED_OUT,
                f"{command.command_type} did not finish within its deadline of {deadline:g} s and "
                "was cancelled. Check the node (image size, engine health) and try again; the "
                "deadline is set with LLM_PORT_NODE_AGENT_COMMAND_DEADLINES.",
                started,
            )
            return
        except CommandFailed as e:
            await self._finish(rec, False, e.result, e.error_code, e.error_message, started)
            return
        except Exception as e:
            self.log.failure("Command {id} ({type}) failed unexpectedly", id=rec.id,
                             type=command.command_type)
            await self._finish(
                rec,
                False,
                {},
                INTERNAL_ERROR,
                f"The agent hit an internal error running {command.command_type}: "
                f"{type(e).__name__}. See the agent's log on the node.",
                started,
            )
            return
        finally:
            self._running.pop(rec.id, None)
        if not isinstance(result, dict):
            result = {"value": result}
        await self._finish(rec, True, result, None, None, started)

    # -- frames ----------------------------------------------------------------------------

    def _send_ack(self, rec: JournalRecord) -> None:
        if rec.finished or rec.id in self._acked_here:
            return
        frame = {
            "type": "command_ack",
            "command_id": rec.id,
            "correlation_id": rec.correlation_id or rec.id,
            "message": "received",
        }
        if not self.session.send(frame):
            return
        self._acked_here.add(rec.id)
        confirm = self.session.confirm()
        if confirm is None:
            return

        def acked(_: object) -> None:
            if not rec.acked:
                rec.acked = True
                self.journal.note(rec.id, acked=True)

        confirm.addCallbacks(acked, lambda f: f.trap(ConnectionGone))

    def send_progress(self, rec: JournalRecord, phase: str, message: str, extra: Mapping[str, Any]) -> None:
        if rec.finished:
            return
        sent = self._send_progress_frame(rec, phase, message, extra)
        ka = self._keepalives.get(rec.id)
        if ka is not None:
            ka.reported(str(phase), str(message), extra, sent)

    def _send_progress_frame(
        self, rec: JournalRecord, phase: str, message: str, extra: Mapping[str, Any]
    ) -> bool:
        if rec.finished:
            return False
        frame: dict[str, Any] = {
            "type": "command_progress",
            "command_id": rec.id,
            "correlation_id": rec.correlation_id or rec.id,
            "phase": str(phase),
            "message": str(message),
        }
        for key, value in extra.items():
            if key not in frame and key not in ("type", "seq"):
                frame[key] = value
        return bool(self.session.send(frame))

    async def _finish(
        self,
        rec: JournalRecord,
        success: bool,
        result: Mapping[str, Any],
        error_code: str | None,
        error_message: str | None,
        started: float | None = None,
    ) -> None:
        if rec.finished:
            return
        self._finishing += 1
        try:
            await self._finish_unguarded(rec, success, result, error_code, error_message, started)
        finally:
            self._finishing -= 1

    async def _finish_unguarded(
        self,
        rec: JournalRecord,
        success: bool,
        result: Mapping[str, Any],
        error_code: str | None,
        error_message: str | None,
        started: float | None,
    ) -> None:
        problem = json_problem(result)
        if problem is None and not isinstance(error_message, str | None):
            problem = f"its error_message is a {type(error_message).__name__}"
        if problem is not None:
            # Answered with a code instead of lost: a frame that cannot be sent would leave
            # the command stuck in the backend (protocol 10.4).
            self.log.error(
                "The result of command {id} ({type}) cannot be serialised to JSON: {problem}",
                id=rec.id, type=rec.command_type, problem=problem,
            )
            success, result, error_code = False, {}, RESULT_NOT_SERIALIZABLE
            error_message = (
                f"The agent could not serialise the result of {rec.command_type} to JSON "
                f"({problem}); the work may have been done on the node. This is a bug in the "
                "agent: its log on the node has the details."
            )
        frame = {
            "type": "command_result",
            "command_id": rec.id,
            "correlation_id": rec.correlation_id or rec.id,
            "success": bool(success),
            "result": dict(result),
            "error_code": error_code,
            "error_message": error_message,
        }
        ka = self._keepalives.pop(rec.id, None)
        if ka is not None:
            ka.stop()
        rec.state = FINISHED
        rec.result_frame = frame
        rec.finished_at = self._wallclock()
        spec = self.registry.get(rec.command_type)
        if spec is None or not _rerunnable(spec):
            # A read is kept until delivered: if its result is then dropped, a re-listing runs
            # it again (_listed_again).
            rec.command = None
        # A finished command is never acked again (_send_ack): forget it, or a session that
        # stays up for months holds the id of every command it ever acked.
        self._acked_here.discard(rec.id)
        self.stats["succeeded" if success else "failed"] += 1
        try:
            await self.journal.update(
                rec.id, state=FINISHED, result_frame=frame, finished_at=rec.finished_at, command=rec.command
            )
        except Exception as e:
            # Sending beats waiting for a disk that may never recover; it stays undelivered in
            # memory until confirmed, like any result.
            self.log.error("Could not record the result of command {id} ({error}); sending it anyway",
                           id=rec.id, error=f"{type(e).__name__}: {e}")
        duration = 0.0 if started is None else self.reactor.seconds() - started
        try:
            self.calls.observe(rec.command_type or "unknown", "success" if success else (error_code or "failed"),
                               duration)
        except Exception:
            self.log.failure("Could not record the duration of command {id}", id=rec.id)
        self._log_outcome(rec, success, result, error_code, error_message, duration)
        payload: dict[str, Any] = {
            "command_id": rec.id,
            "command_type": rec.command_type,
            "success": bool(success),
            "duration_sec": round(duration, 3),
        }
        if rec.runtime_id:
            payload["runtime_id"] = rec.runtime_id
        if error_code:
            payload["error_code"] = error_code
        self.outbox.emit(
            "command.finished", payload, "info" if success else "warning", rec.correlation_id or rec.id
        )
        self._send_result(rec)

    def _log_outcome(
        self,
        rec: JournalRecord,
        success: bool,
        result: Mapping[str, Any],
        error_code: str | None,
        error_message: str | None,
        duration: float,
    ) -> None:
        """
        The one line per command outcome an operator reads in the journal: INFO for a success
        (with a short summary of the result), WARNING for a failure (its error code and message).
        """
        ctype = rec.command_type or "command"
        on = f" on runtime {rec.runtime_id}" if rec.runtime_id else ""
        if success:
            self.log.info(
                "Command {id} {type}{on} succeeded in {duration:.2f} s{summary}",
                id=rec.id, type=ctype, on=on, runtime_id=rec.runtime_id or "",
                duration=round(duration, 3), outcome="success",
                summary=result_summary(result),
            )
        else:
            self.log.warn(
                "Command {id} {type}{on} failed in {duration:.2f} s: {error_code}: {error_message}",
                id=rec.id, type=ctype, on=on, runtime_id=rec.runtime_id or "",
                duration=round(duration, 3), outcome="failure",
                error_code=error_code or "failed",
                error_message=(error_message or "no message")[:MAX_LOGGED_MESSAGE],
            )

    def after_delivery(self, command_id: str, fn: Callable[[], None]) -> None:
        """Call C{fn} when the backend confirms the result of C{command_id} (L{_send_result})."""
        if len(self._after_delivery) >= MAX_AFTER_DELIVERY and command_id not in self._after_delivery:
            # Bounded: the oldest waiting actions are dropped (announce_all after a connect
            # reports every runtime anyway).
            self._after_delivery.pop(next(iter(self._after_delivery)))
        self._after_delivery.setdefault(command_id, []).append(fn)

    def _send_result(self, rec: JournalRecord, replayed: bool = False) -> None:
        """
        Send the stored result (again). C{replayed}: an answer from the journal to a command
        listed again, marked C{"replayed": true} in C{result} (protocol 10.2).
        """
        if rec.state != FINISHED or rec.result_frame is None or rec.id in self._delivering:
            return
        frame = dict(rec.result_frame)
        if replayed:
            stored = frame.get("result")
            frame["result"] = dict(stored if isinstance(stored, dict) else {}, replayed=True)
            self.stats["replayed"] += 1
        if not self.session.send(frame):
            return
        confirm = self.session.confirm()
        if confirm is None:
            return
        self._delivering.add(rec.id)

        def delivered(_: object) -> None:
            self._delivering.discard(rec.id)
            for fn in self._after_delivery.pop(rec.id, ()):
                try:
                    fn()
                except Exception:
                    self.log.failure("An after-result action of command {id} failed", id=rec.id)
            if rec.state == FINISHED:
                rec.state = DELIVERED
                spec = self.registry.get(rec.command_type)
                keep = spec is None or spec.keep_result
                rerun = spec is not None and _rerunnable(spec)
                self.journal.mark_delivered(rec.id, keep=keep, rerunnable=rerun).addErrback(
                    lambda f: self.log.failure("Could not record the delivery of {id}", failure=f, id=rec.id)
                )

        def lost(f: Any) -> None:
            self._delivering.discard(rec.id)
            f.trap(ConnectionGone)

        confirm.addCallbacks(delivered, lost)

    # -- introspection ---------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        return {
            "running": sorted(self._running),
            "running_count": len(self._running),
            "journal": self.journal.depth(),
            "stats": dict(self.stats),
            "lanes_busy": sorted(k for k in self._locks),
        }


def _rerunnable(spec: HandlerSpec) -> bool:
    """A read safe to run again: one whose result, once dropped, is answered by a new run."""
    return spec.lane == "read" and spec.idempotent


def _redispatched(obj: Any) -> bool:
    """The backend re-sent an in-flight command (C{"redispatch": true}, protocol 10.2)."""
    getter = getattr(obj, "get", None)
    return callable(getter) and getter("redispatch") is True


#: Longest error message and result value written to the outcome line.
MAX_LOGGED_MESSAGE = 500
MAX_SUMMARY_VALUE = 80
MAX_SUMMARY_FIELDS = 6
_SECRET_KEY = re.compile(r"token|secret|password|credential", re.IGNORECASE)


def result_summary(result: Mapping[str, Any]) -> str:
    """
    C{" (key=value, ...)"} from a result's short scalar fields (numbers, booleans, strings of at
    most L{MAX_SUMMARY_VALUE} characters; at most L{MAX_SUMMARY_FIELDS}); C{""} when none.
    Bulk values (lists, logs, nested objects) stay out of the log line: they are in the result.
    """
    parts: list[str] = []
    for key, value in list(result.items())[:64]:
        if len(parts) >= MAX_SUMMARY_FIELDS:
            break
        if _SECRET_KEY.search(str(key)):
            continue  # a secret in a result (describe_ray_cluster's cluster_token) is never logged
        if isinstance(value, bool | int | float) or (
            isinstance(value, str) and value and len(value) <= MAX_SUMMARY_VALUE and "\n" not in value
        ):
            parts.append(f"{str(key)[:40]}={value}")
    return f" ({', '.join(parts)})" if parts else ""


async def _call(spec: HandlerSpec, ctx: _Context) -> dict[str, Any]:
    return await spec.handler(ctx)


__all__ = ["CommandPipeline", "NodeModes",]
