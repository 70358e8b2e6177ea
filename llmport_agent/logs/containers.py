# -*- test-case-name: tests.test_logs_containers -*-
"""
Workload (container) logs as Loki lines (protocol section 8, "container logs"): every managed
container's stdout and stderr followed as a stream, labelled C{{job: "node-container", host,
container: <container name>, runtime_id}}.

B{Streams.} For each managed container one engine C{logs} stream (follow, timestamps, C{since}
the container's position) runs in a thread of this source's own pool (see
L{llmport_agent.logs.docker_logs} for what the thread does). The engine ends the stream when the
container stops, after its last line: the container is then I{drained}. Its C{die} event (from
this source's own engine event stream) makes sure a container that stopped without a stream
open, such as one that printed and exited within a second, is read to its end once; its
C{start} event opens a stream again. A list of the managed containers at start, whenever the
engine comes back, and every C{reconcile_interval} seconds catches what events missed.

B{Bounded threads.} At most C{streams} containers (C{LOKI_CONTAINER_STREAMS}, 16 by default) are
followed at once, each holding one pool thread; one more thread follows the events. With more
containers than that, they take turns: when some wait, a stream open longer than
C{slice_seconds} is closed (its position kept) and the container goes to the back of the
queue, so every container is read at least once per C{ceil(containers / streams) *
slice_seconds} seconds and none loses a line.

B{Positions.} Each container's L{Position} (newest line time shipped, plus which lines carry
exactly that time) advances only as far as the shipper is done with its lines (accepted by
Loki, spooled or dropped), and is saved in C{<state dir>/container-logs.json} (atomically, at
most every C{save_interval} seconds, after a container was drained, and at stop). A restart of
the agent, of a container or of the engine resumes exactly behind the last line shipped. A
container seen for the first time is read from its first line (from C{replay_window} ago for
one created long before).

B{Back-pressure.} While the shipper is full (Loki away, spool full or off), lines are not
taken from the threads; they stop reading, the engine keeps the lines in its log file, and the
positions stand.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol

from attrs import field
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, DeferredList
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmport_agent.core.backoff import Backoff
from llmport_agent.core.storage import atomic_write
from llmport_agent.core.threads import BlockingRunner, PoolService
from llmport_agent.core.values import define
from llmport_agent.logs.docker_logs import (
    FollowResult,
    Inbox,
    Position,
    follow_logs,
    format_since,
)
from llmport_agent.logs.encoding import label_key
from llmport_agent.logs.loki import ILogSink, RoomWaiter
from llmport_agent.logs.redact import Redactor
from llmport_agent.workloads.containers import is_owned, list_owned_rows
from llmport_agent.workloads.engine import StreamClosed, StreamControl
from llmport_agent.workloads.labels import LABEL_RUNTIME_ID

__all__ = [
    "CONTAINER_JOB",
    "ContainerLogSource",
    "STATE_FILE",
    "parse_state",
]

CONTAINER_JOB = "node-container"
STATE_FILE = "container-logs.json"
_STATE_VERSION = 2

#: Positions not yet known delivered, remembered per container (oldest merged first).
_MAX_CHECKPOINTS = 256

_START_EVENTS = frozenset({"start", "restart", "unpause"})
_STOP_EVENTS = frozenset({"die", "stop", "kill", "oom"})


class _Engine(Protocol):
    """The part of L{llmport_agent.workloads.engine.DockerEngine} used here."""

    available: bool

    def call(self, fn: Callable[..., Any], *args: Any, what: str | None = None) -> Awaitable[Any]:
        """Run C{fn(client, *args)} off the reactor thread."""

    def onAvailability(self, listener: Callable[[bool], None]) -> None:
        """Call C{listener(available)} on every change."""

    def checkNow(self) -> None:
        """Ping the engine soon."""


def _default_client_factory(environ: Mapping[str, str] | None, pool_size: int) -> Callable[[], Any]:
    def make() -> Any:
        import docker

        kwargs: dict[str, Any] = docker.utils.kwargs_from_env(
            environment=dict(os.environ if environ is None else environ)
        )
        # The timeout covers connecting and the answer's headers; a following stream turns
        # its socket timeout off (a quiet log is normal).
        return docker.DockerClient(version="auto", timeout=15, max_pool_size=pool_size, **kwargs)

    return make


@define(eq=False)
class _Stream:
    control: StreamControl
    inbox: Inbox
    started: float
    d: Deferred[Any] | None = None


@define(eq=False)
class _Container:
    """What is known about one container's logs."""

    cid: str
    name: str
    runtime_id: str
    position: Position | None = None  # read (and pushed) this far
    saved: Position | None = None  # the shipper is done this far (what is persisted)
    checkpoints: deque[tuple[int, Position]] = field(factory=deque)
    running: bool = False
    drained: bool = False
    created: float | None = None
    stream: _Stream | None = None
    queued: bool = False
    failures: int = 0
    #: One of the original agent's containers, owned through the adoption (it has no labels).
    adopted: bool = False
    retry_call: Any = None
    gone: bool = False
    die_check: Any = None


def parse_state(raw: bytes) -> dict[str, tuple[str, Position]]:
    """C{{container id: (name, position)}} from the state file. @raise ValueError: bad content."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(doc, Mapping):
        raise ValueError("the document is not an object")
    version = doc.get("version")
    if version not in (1, _STATE_VERSION):
        raise ValueError(f"field 'version' is {version!r}, not {_STATE_VERSION}")
    containers = doc.get("containers")
    if not isinstance(containers, Mapping):
        raise ValueError("field 'containers' is not an object")
    out: dict[str, tuple[str, Position]] = {}
    for cid, entry in containers.items():
        if not isinstance(entry, Mapping):
            raise ValueError(f"field 'containers.{cid}' is not an object")
        name = entry.get("name", "")
        if not isinstance(name, str):
            raise ValueError(f"field 'containers.{cid}.name' is not a string")
        if version == 1:
            # Written by the polling reader: the ns of the last line shipped.
            ns = entry.get("ns")
            if not isinstance(ns, int) or isinstance(ns, bool) or ns < 0:
                raise ValueError(f"field 'containers.{cid}.ns' is not a non-negative integer")
            # Everything up to and including that time was shipped: resume just after it.
            out[str(cid)] = (name, Position(ns + 1, {}) if ns else Position())
            continue
        try:
            position = Position.from_json(entry.get("position"))
        except ValueError as e:
            raise ValueError(f"field 'containers.{cid}.position': {e}") from None
        out[str(cid)] = (name, position)
    return out


def list_for_logs(client: Any, agent_id: str, adopted: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """
    Thread function: the containers this agent owns (another agent's are left out), the
    original agent's adopted ones included (C{adopted}: full id -> runtime id; they carry the
    runtime id as a label here, and C{adopted: True}): id, name, state, labels, created.
    """
    out = []
    for row in list_owned_rows(client, agent_id, adopted):
        created = row.get("Created")
        out.append({
            "id": str(row["Id"]),
            "name": str((row.get("Names") or ["/"])[0]).lstrip("/"),
            "state": str(row.get("State", "")),
            "labels": dict(row.get("Labels") or {}),
            "created": float(created) if isinstance(created, (int, float)) else None,
            "adopted": bool(row.get("_adopted")),
        })
    return out


def _read_state(path: str) -> bytes | None:
    """Thread function: the state file's bytes, C{None} when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        chunks = []
        while True:
            data = os.read(fd, 1 << 20)
            if not data:
                break
            chunks.append(data)
            if sum(len(c) for c in chunks) > 16 << 20:
                raise ValueError("larger than 16 MiB")
        return b"".join(chunks)
    finally:
        os.close(fd)


class ContainerLogSource(Service):
    """
    Ships managed containers' logs to a L{ILogSink}. See the module docstring.

    @param reactor: provides C{IReactorTime} and C{IReactorThreads}.
    @param engine: the L{DockerEngine}: availability, and short calls (the container list).
    @param sink: the shipper.
    @param host: returns the C{host} label (what the backend stores as the node host).
    @param runner: runs file reads and writes (the state file) off the reactor.
    @param streams: the most containers followed at the same time.
    @param environ: where C{DOCKER_HOST} and friends come from (the process's by default).
    @param client_factory: makes the docker client of the stream threads (blocking).
    @param stream_pool: runs the stream threads (default: a pool of C{streams + 1} threads).
    @param secrets: returns the exact secret values to mask in every line.
    @param state_dir: where C{container-logs.json} is kept; positions only in memory if C{None}.
    @param adoption: the original agent's containers taken over (L{Adoption}: C{snapshot()},
        C{subscribe()}), shipped like the agent's own until a labelled container replaces them.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        engine: _Engine,
        sink: ILogSink,
        host: Callable[[], str],
        *,
        agent_id: str,
        runner: BlockingRunner,
        streams: int = 16,
        environ: Mapping[str, str] | None = None,
        client_factory: Callable[[], Any] | None = None,
        stream_pool: Any = None,
        secrets: Callable[[], Iterable[str | None]] | None = None,
        state_dir: str | None = None,
        save_interval: float = 2.0,
        slice_seconds: float = 5.0,
        reconcile_interval: float = 60.0,
        replay_window: float = 6 * 3600.0,
        stop_timeout: float = 5.0,
        inbox_bytes: int = 512 * 1024,
        drain_timeout: float = 10.0,
        pause_at: float = 0.8,
        backoff: Backoff | None = None,
        wallclock: Callable[[], float] = time.time,
        adoption: Any = None,
    ) -> None:
        if streams < 1:
            raise ValueError(f"streams must be >= 1, not {streams!r}")
        self.setName("container-logs")
        self._reactor = reactor
        self._engine = engine
        self._agent_id = agent_id
        self._sink = sink
        self._host = host
        self._runner = runner
        self.max_streams = int(streams)
        self._pool = stream_pool if stream_pool is not None else PoolService(
            reactor, "container-logs", self.max_streams + 1
        )
        self._own_pool = stream_pool is None
        self._client_factory = client_factory or _default_client_factory(environ, self.max_streams + 2)
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._redactor = Redactor(secrets)
        self._path = os.path.join(state_dir, STATE_FILE) if state_dir else None
        self._save_interval = float(save_interval)
        self._slice = float(slice_seconds)
        self._reconcile_interval = float(reconcile_interval)
        self._replay_window = float(replay_window)
        self._stop_timeout = float(stop_timeout)
        self._inbox_bytes = int(inbox_bytes)
        self._drain_timeout = float(drain_timeout)
        self._pause_at = pause_at
        self._backoff = backoff if backoff is not None else Backoff(1.0, 30.0)
        self._wallclock = wallclock
        self._adoption = adoption
        #: Whether the open event stream has every container's events (adopted ones exist).
        self._events_all = False
        self._reconcile_more = False

        self._tracked: dict[str, _Container] = {}
        self._queue: deque[_Container] = deque()
        self._active: set[_Container] = set()
        self._room_waiter = RoomWaiter(sink, self._room)
        self._ready: set[_Container] = set()  # inboxes with lines to take
        self._loaded = self._path is None
        self._saved_text: bytes | None = None
        self._save_call: Any = None
        self._saving: Deferred[None] | None = None
        self._last_save = -math.inf
        self._events: StreamControl | None = None
        self._events_d: Deferred[Any] | None = None
        self._events_failures = 0
        self._events_call: Any = None
        self._slice_call: Any = None
        self._reconcile_call: Any = None
        self._reconciling: Deferred[None] | None = None
        self._stopping = False
        self._listening = False
        self._shutdown_trigger: Any = None
        self._started: Deferred[None] | None = None
        self._error: str | None = None

        # Counters.
        self.lines_shipped = 0
        self.lines_duplicate = 0
        self.inbox_waits = 0
        self.drain_stalls = 0
        self.streams_opened = 0
        self.streams_failed = 0
        self.slices = 0
        self.drains = 0
        self.events_seen = 0
        self.reconciles = 0
        self.state_saves = 0
        self.state_save_failures = 0
        self.containers_forgotten = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._stopping = False
        if self._own_pool:
            self._pool.startService()
            # A backstop: the pool's own shutdown trigger joins its threads, which a stream
            # blocked in a read would hold for ever; closing the streams first unblocks them.
            self._shutdown_trigger = self._reactor.addSystemEventTrigger(
                "before", "shutdown", self._close_streams, "reactor shutting down"
            )
        if not self._listening:
            self._listening = True
            self._engine.onAvailability(self._engine_changed)
            if self._adoption is not None:
                self._adoption.subscribe(self._adoption_changed)
        d = Deferred.fromCoroutine(self._start())
        d.addErrback(lambda f: self.log.failure("Starting the container log reader failed", failure=f))
        self._started = d

    async def _start(self) -> None:
        if not self._loaded:
            await self._load()
        if self._stopping:
            return
        if self._engine.available:
            self._engine_changed(True)
        self._schedule_reconcile()

    def stopService(self) -> Deferred[None]:
        super().stopService()
        return Deferred.fromCoroutine(self._stop())

    def _close_streams(self, reason: str) -> None:
        """Close every stream (and the events) so their threads end; safe to repeat."""
        if self._events is not None:
            self._events.close(reason)
        for c in list(self._active):
            stream = c.stream
            if stream is not None:
                stream.control.close(reason)
                stream.inbox.close()

    async def _stop(self) -> None:
        self._stopping = True
        if self._shutdown_trigger is not None:
            try:
                self._reactor.removeSystemEventTrigger(self._shutdown_trigger)
            except (ValueError, KeyError, TypeError):
                pass
            self._shutdown_trigger = None
        if self._started is not None and not self._started.called:
            self._started.cancel()
        for name in ("_slice_call", "_reconcile_call", "_events_call", "_save_call"):
            call = getattr(self, name)
            if call is not None and call.active():
                call.cancel()
            setattr(self, name, None)
        for c in self._tracked.values():
            for name in ("retry_call", "die_check"):
                call = getattr(c, name)
                if call is not None and call.active():
                    call.cancel()
                setattr(c, name, None)
        self._queue.clear()
        self._close_streams("agent stopping")
        pending: list[Deferred[Any]] = [
            c.stream.d for c in self._active if c.stream is not None and c.stream.d is not None
        ]
        if self._events_d is not None:
            pending.append(self._events_d)
        if pending:
            waiting: Deferred[Any] = DeferredList(pending, consumeErrors=True)
            waiting.addTimeout(self._stop_timeout, self._reactor)
            try:
                await waiting
            except Exception:
                self.log.warn("Some container log streams did not end within {timeout} s",
                              timeout=self._stop_timeout)
        for c in list(self._tracked.values()):
            self._take(c, force=True)
        if any(c.checkpoints for c in self._tracked.values()):
            # Let the shipper deliver (or spool) what was read, so the saved positions are exact.
            try:
                await self._sink.flush(self._stop_timeout)
            except Exception:
                self.log.failure("Waiting for the log shipper at stop failed")
        if self._saving is not None:
            await self._saving
        if self._loaded:
            await self._save()
        if self._own_pool:
            if self._client is not None:
                try:
                    await self._pool.run(self._close_client)
                except Exception:
                    pass
            await self._pool.stopService()

    def _close_client(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def describe(self) -> dict[str, Any]:
        """Counters for diagnostics and metrics."""
        return {
            "containers": len(self._tracked),
            "streams_open": len(self._active),
            "streams_max": self.max_streams,
            "waiting_for_a_stream": len(self._queue),
            "streams_opened": self.streams_opened,
            "streams_failed": self.streams_failed,
            "slices": self.slices,
            "drains": self.drains,
            "lines_shipped": self.lines_shipped,
            "lines_duplicate": self.lines_duplicate,
            "inbox_waits": self.inbox_waits,
            "drain_stalls": self.drain_stalls,
            "events_seen": self.events_seen,
            "reconciles": self.reconciles,
            "paused": self._room_waiter.waiting,
            "containers_forgotten": self.containers_forgotten,
            "state_saves": self.state_saves,
            "state_save_failures": self.state_save_failures,
            "last_error": self._error,
        }

    # -- the engine: availability, events, the list --------------------------------------------

    def _engine_changed(self, available: bool) -> None:
        if not available or self._stopping or not self.running or not self._loaded:
            return
        # The list (re)opens what needs a stream, with names and labels as the engine has them.
        for c in self._tracked.values():
            c.failures = 0
        self._start_events()
        # Containers queued while the engine was away wait in the queue (a pump without the
        # engine opens nothing, and the list's _want skips a queued container): open them now.
        self._pump()
        self._reconcile_soon()

    def _adopted(self) -> dict[str, str]:
        """Adopted container id -> runtime id (a copy: it goes to a thread)."""
        if self._adoption is None:
            return {}
        snapshot: dict[str, str] = self._adoption.snapshot()
        return snapshot

    def _adoption_changed(self) -> None:
        """Adopted containers came or went (replaced by labelled ones, removed): list again."""
        if self.running and not self._stopping and self._loaded and self._engine.available:
            self._reconcile_soon()

    def _refilter_events(self) -> None:
        """Adopted containers carry no label: while there are any, the events of every container."""
        control = self._events
        if control is None or self._events_all == bool(self._adopted()):
            return
        self._events = None
        self._events_d = None
        control.close("the adopted containers changed")
        self._start_events()

    def _client_now(self) -> Any:
        """Thread side: the stream threads' docker client (made on first use)."""
        with self._client_lock:
            if self._client is None:
                self._client = self._client_factory()
            return self._client

    def _start_events(self) -> None:
        if self._events_d is not None or self._stopping:
            return
        control = StreamControl()
        self._events = control
        since = int(self._wallclock())
        self._events_all = bool(self._adopted())

        def on_event(event: dict[str, Any]) -> None:
            self._reactor.callFromThread(self._on_event, event)

        def on_open() -> None:
            self._reactor.callFromThread(self._events_opened)

        d = self._pool.run(self._events_thread, control, since, on_event, on_open, not self._events_all)
        self._events_d = d
        d.addBoth(self._events_ended, control)

    def _events_thread(self, control: StreamControl, since: int,
                       on_event: Callable[[dict[str, Any]], None], on_open: Callable[[], None],
                       labelled_only: bool = True) -> str:
        """Thread function: the engine's events for managed containers (as the health watcher reads them)."""
        from llmport_agent.workloads.health import _events_thread

        return _events_thread(self._client_now(), control, since, on_event, on_open, labelled_only)

    def _events_opened(self) -> None:
        self._events_failures = 0
        # Whatever happened while the stream was down.
        self._reconcile_soon()

    def _events_ended(self, result: Any, control: StreamControl) -> None:
        if self._events is not None and self._events is not control:
            return  # replaced by _refilter_events
        self._events_d = None
        self._events = None
        if self._stopping or control.closed:
            return
        self._events_failures += 1
        delay = self._backoff.delay(self._events_failures)
        if isinstance(result, Failure):
            self._engine.checkNow()
        self._events_call = self._reactor.callLater(delay, self._restart_events)

    def _restart_events(self) -> None:
        self._events_call = None
        if self._engine.available:
            self._start_events()
        # else: the availability listener starts it again.

    def _on_event(self, event: dict[str, Any]) -> None:
        if self._stopping:
            return
        self.events_seen += 1
        action = str(event.get("Action") or event.get("status") or "")
        raw_actor = event.get("Actor")
        actor: dict[str, Any] = raw_actor if isinstance(raw_actor, dict) else {}
        cid = str(event.get("id") or actor.get("ID") or "")
        raw_attrs = actor.get("Attributes")
        attrs: dict[str, Any] = raw_attrs if isinstance(raw_attrs, dict) else {}
        if not cid:
            return
        c = self._tracked.get(cid)
        if action == "destroy":
            if c is not None:
                self._forget(c)
            return
        if c is None:
            if action not in _START_EVENTS and action != "create":
                return
            name = str(attrs.get("name") or cid[:12])
            if is_owned(attrs, self._agent_id):
                c = _Container(cid, name, str(attrs.get(LABEL_RUNTIME_ID) or ""))
            elif self._adoption is not None and (adopted := self._adoption.runtime_of(cid)):
                c = _Container(cid, name, str(adopted), adopted=True)
            else:
                return  # another agent's container (or one forging the managed label)
            c.created = self._wallclock()
            self._tracked[cid] = c
        if action in _START_EVENTS:
            c.running = True
            c.drained = False
            self._want(c)
        elif action in _STOP_EVENTS:
            c.running = False
            # It ran since we last read it to its end (even if its start went unseen): a stream
            # open now ends by itself after the last line; without one, it is read once more.
            c.drained = False
            self._want(c)
            stream = c.stream
            if stream is not None and c.die_check is None:
                c.die_check = self._reactor.callLater(self._drain_timeout, self._check_drained, c, stream)

    def _check_drained(self, c: _Container, stream: _Stream) -> None:
        """The container stopped a while ago and its stream has not ended: read it afresh."""
        c.die_check = None
        if c.stream is stream and not c.running and not self._stopping:
            self.drain_stalls += 1
            self.log.warn(
                "The engine did not end the log stream of {name} {seconds:.0f} s after it stopped; "
                "reading its last lines again from where shipping stands",
                name=c.name,
                seconds=self._drain_timeout,
            )
            stream.control.close("no end after the container stopped")

    def _schedule_reconcile(self) -> None:
        if self._stopping:
            return
        self._reconcile_call = self._reactor.callLater(self._reconcile_interval, self._periodic)

    def _periodic(self) -> None:
        self._reconcile_call = None
        self._reconcile_soon()
        self._schedule_reconcile()

    def _reconcile_soon(self) -> None:
        if self._reconciling is not None:
            self._reconcile_more = True  # a change during a list: list once more after it
            return
        self._reconcile_more = False
        if self._stopping or not self._engine.available:
            return
        d = Deferred.fromCoroutine(self._reconcile())
        self._reconciling = d

        def done(result: object) -> None:
            self._reconciling = None
            if isinstance(result, Failure) and not result.check(CancelledError):
                self.log.failure("Listing containers for their logs failed", failure=result)
            if self._reconcile_more:
                self._reconcile_soon()

        d.addBoth(done)

    async def _reconcile(self) -> None:
        try:
            rows = await self._engine.call(list_for_logs, self._agent_id, self._adopted(),
                                           what="list managed containers for logs")
        except Exception as e:
            message = str(getattr(e, "error_message", None) or e)
            if self._error is None:
                self.log.warn("Listing containers for their logs failed: {error}", error=message)
            self._error = message
            return
        self._error = None
        self.reconciles += 1
        seen: set[str] = set()
        now = self._wallclock()
        for row in rows if isinstance(rows, list) else []:
            try:
                cid = str(row["id"])
                name = str(row.get("name") or cid[:12])
                runtime_id = str((row.get("labels") or {}).get(LABEL_RUNTIME_ID) or "")
                running = row.get("state") in ("running", "restarting")
                adopted = bool(row.get("adopted"))
            except (KeyError, TypeError, AttributeError):
                continue
            seen.add(cid)
            c = self._tracked.get(cid)
            if c is None:
                c = _Container(cid, name, runtime_id)
                self._tracked[cid] = c
            c.adopted = adopted
            created = row.get("created")
            c.created = created if isinstance(created, float) else (c.created or now)
            c.name, c.runtime_id = name, runtime_id
            if running and not c.running:
                c.drained = False
            c.running = running
            self._want(c)
        for c in [c for cid, c in self._tracked.items() if cid not in seen]:
            if c.stream is None or c.adopted:
                # An adopted container no longer listed is no longer this agent's (a labelled
                # one replaced it, or it was removed): its stream is closed, its lines stop.
                self._forget(c)
        self._refilter_events()

    def _forget(self, c: _Container) -> None:
        c.gone = True
        self._tracked.pop(c.cid, None)
        for call in (c.retry_call, c.die_check):
            if call is not None and call.active():
                call.cancel()
        if c.stream is not None:
            c.stream.control.close("container removed")
        self.containers_forgotten += 1
        self._save_soon()

    # -- streams ---------------------------------------------------------------------------

    def _want(self, c: _Container) -> None:
        """Make sure C{c} gets a stream (unless it has one, waits for one, or is read out)."""
        if self._stopping or c.gone or c.stream is not None or c.queued:
            return
        if c.drained and not c.running:
            return
        if c.retry_call is not None and c.retry_call.active():
            return
        c.queued = True
        self._queue.append(c)
        self._pump()

    def _pump(self) -> None:
        if not self._engine.available:
            return
        while self._queue and len(self._active) < self.max_streams:
            c = self._queue.popleft()
            c.queued = False
            if c.gone or c.stream is not None:
                continue
            self._open(c)
        if self._queue and self._slice_call is None and not self._stopping:
            self._slice_call = self._reactor.callLater(self._slice, self._rotate)

    def _rotate(self) -> None:
        """Containers wait for a stream: close the longest-open streams (they queue again)."""
        self._slice_call = None
        if not self._queue or self._stopping:
            return
        now = self._reactor.seconds()
        old = sorted(
            (c for c in self._active if c.stream is not None and now - c.stream.started >= self._slice),
            key=lambda c: c.stream.started if c.stream is not None else now,
        )
        for c in old[: len(self._queue)]:
            assert c.stream is not None
            self.slices += 1
            c.stream.control.close("slice")
        self._pump()

    def _since(self, c: _Container) -> str | None:
        if c.position is not None and c.position.ts > 0:
            return c.position.since()
        created = c.created
        if created is not None and created < self._wallclock() - self._replay_window:
            return format_since(int((self._wallclock() - self._replay_window) * 1e9))
        return None

    def _open(self, c: _Container) -> None:
        control = StreamControl()
        inbox = Inbox(self._reactor.callFromThread, lambda: self._deliver(c), self._inbox_bytes)
        stream = _Stream(control, inbox, self._reactor.seconds())
        c.stream = stream
        self._active.add(c)
        self.streams_opened += 1
        position = c.position.copy() if c.position is not None else None
        d = self._pool.run(self._follow_thread, control, inbox, c.cid, position, self._since(c))
        stream.d = d
        d.addBoth(self._stream_ended, c, stream)

    def _follow_thread(self, control: StreamControl, inbox: Inbox, cid: str,
                       position: Position | None, since: str | None) -> FollowResult:
        """Thread function: follow one container's log (see L{follow_logs})."""
        return follow_logs(self._client_now(), control, inbox, cid, position, since,
                           self._redactor.snapshot)

    def _stream_ended(self, result: Any, c: _Container, stream: _Stream) -> None:
        stream.d = None
        self.inbox_waits += stream.inbox.waits
        if c.die_check is not None and c.die_check.active():
            c.die_check.cancel()
        c.die_check = None
        if c.stream is stream:
            self._take(c, force=True)
            c.stream = None
        self._active.discard(c)
        self._ready.discard(c)
        if isinstance(result, FollowResult):
            c.failures = 0
            self.lines_duplicate += result.skipped
            if result.running:
                c.running = True
            else:
                c.running = False
                c.drained = True
                self.drains += 1
                self._save_soon(now=True)
            self._want(c)
        elif isinstance(result, Failure) and result.check(StreamClosed, CancelledError):
            if not self._stopping:
                self._want(c)  # a slice ended (or the container went): the next turn
        elif isinstance(result, Failure):
            self._stream_failed(c, result)
        self._pump()

    def _stream_failed(self, c: _Container, failure: Failure) -> None:
        if self._stopping or c.gone:
            return
        status = getattr(failure.value, "status_code", None)
        if status == 404:
            self._forget(c)
            return
        self.streams_failed += 1
        c.failures += 1
        message = f"{type(failure.value).__name__}: {failure.value}"[:300]
        if c.failures == 1:
            self.log.warn(
                "Following the logs of container {name} failed ({error}); retrying",
                name=c.name,
                error=message,
            )
        self._error = message
        self._engine.checkNow()
        delay = self._backoff.delay(c.failures)

        def retry() -> None:
            c.retry_call = None
            self._want(c)

        c.retry_call = self._reactor.callLater(delay, retry)

    # -- lines ---------------------------------------------------------------------------------

    def _deliver(self, c: _Container) -> None:
        """The reactor is told a stream thread has lines for C{c}."""
        self._ready.add(c)
        self._take(c)

    def _take(self, c: _Container, force: bool = False) -> None:
        stream = c.stream
        if stream is None:
            self._ready.discard(c)
            return
        if not force:
            try:
                full = float(self._sink.pressure()) >= self._pause_at
            except Exception:
                full = False
            if full:
                self._wait_for_room()
                return
        items, position, size = stream.inbox.take()
        self._ready.discard(c)
        if not items or position is None:
            if position is not None:
                c.position = position
            return
        key = label_key({
            "job": CONTAINER_JOB,
            "host": str(self._host()),
            "container": c.name,
            "runtime_id": c.runtime_id,
        })
        seq = self._sink.push_many([(key, ts, line) for ts, line in items], size)
        self.lines_shipped += len(items)
        c.position = position
        c.checkpoints.append((seq, position))
        while len(c.checkpoints) > _MAX_CHECKPOINTS:
            c.checkpoints.popleft()  # the next one covers it
        self._save_soon()

    def _room(self) -> None:
        for c in list(self._ready):
            self._take(c)

    def _wait_for_room(self) -> None:
        self._room_waiter.wait()

    # -- position ------------------------------------------------------------------------------

    def _advance(self) -> None:
        """Move each container's saved position up to what the shipper is done with."""
        through = int(self._sink.delivered_through())
        for c in self._tracked.values():
            while c.checkpoints and c.checkpoints[0][0] <= through:
                c.saved = c.checkpoints.popleft()[1]
            if not c.checkpoints and c.position is not None and c.stream is None:
                # Nothing in flight: what was read (even with no new lines) is the position.
                c.saved = c.position

    def _save_soon(self, now: bool = False) -> None:
        if self._path is None or self._stopping or not self._loaded:
            return
        if self._save_call is not None and self._save_call.active():
            if not now:
                return
            self._save_call.cancel()
        delay = 0.0 if now else max(0.0, self._last_save + self._save_interval - self._reactor.seconds())
        self._save_call = self._reactor.callLater(delay, self._save_due)

    def _save_due(self) -> None:
        self._save_call = None
        if self._saving is not None:
            self._save_soon()
            return
        d = Deferred.fromCoroutine(self._save())
        self._saving = d

        def done(result: object) -> None:
            self._saving = None
            if isinstance(result, Failure):
                self.log.failure("Saving container log positions failed", failure=result)
            if any(c.checkpoints for c in self._tracked.values()):
                self._save_soon()

        d.addBoth(done)

    def _state_bytes(self) -> bytes:
        containers = {
            c.cid: {"name": c.name, "position": c.saved.to_json()}
            for c in self._tracked.values()
            if c.saved is not None and c.saved.ts > 0
        }
        doc = {"version": _STATE_VERSION, "containers": containers}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    async def _save(self) -> None:
        if self._path is None:
            return
        self._advance()
        data = self._state_bytes()
        if data == self._saved_text:
            return
        self._last_save = self._reactor.seconds()
        try:
            await self._runner.run(atomic_write, self._path, data, 0o600)
        except OSError as e:
            self.state_save_failures += 1
            if self.state_save_failures == 1 or self.state_save_failures % 100 == 0:
                self.log.warn(
                    "Saving container log positions to {path} failed: {error}",
                    path=self._path,
                    error=e.strerror or str(e),
                )
            return
        self._saved_text = data
        self.state_saves += 1

    async def _load(self) -> None:
        assert self._path is not None
        try:
            raw = await self._runner.run(_read_state, self._path)
        except (OSError, ValueError) as e:
            self.log.warn(
                "Cannot read container log positions from {path}: {error}; containers are read "
                "from their first line (at most {window:.0f} s back)",
                path=self._path,
                error=str(e),
                window=self._replay_window,
            )
            raw = None
        self._loaded = True
        if raw is None:
            return
        try:
            positions = parse_state(raw)
        except ValueError as e:
            self.log.warn(
                "Ignoring unreadable container log positions in {path}: {error}",
                path=self._path,
                error=str(e),
            )
            return
        for cid, (name, position) in positions.items():
            if cid not in self._tracked:
                self._tracked[cid] = _Container(cid, name, "", position=position, saved=position)
        self._saved_text = raw
