"""
Workload health: the engine's event stream plus a periodic reconcile, turned into
C{workload.health.*} events (protocol 6) on transitions only.

States and their events:

 - C{running} {runtime_id, container_name, endpoint_url, restart_count}
 - C{stopped} {runtime_id, container_name, status, exit_code, restart_count}
 - C{missing} {runtime_id, container_name}
 - C{crash_loop} {runtime_id, container_name, restart_count, status}: the real restart
   count grew by C{crash_loop_restarts} or more within C{crash_loop_window} seconds
 - C{unhealthy} {runtime_id, container_name, health_status}: from Docker health checks

While a command works on a runtime it is I{held}: its changes are not reported, and when
the command ends the watcher re-reads the runtime silently (after an update or its rollback,
the handler has it announced once the backend confirmed the command's result, L{announce}).

The event stream runs on the engine's streaming budget and is restarted with backoff
when it breaks; at idle the only engine call is the reconcile's one listing per period.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from attrs import field
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from llmport_agent.core.lazyimport import LazyModule
from llmport_agent.core.values import define

from . import containers as ops
from .engine import DockerEngine, EngineError, StreamClosed, StreamControl
from .labels import LABEL_MANAGED, LABEL_NAME, LABEL_RUNTIME_ID, MANAGED_VALUE
from .settings import WorkloadSettings

if TYPE_CHECKING:
    import docker
else:
    docker = LazyModule("docker")  # docker-py: imported at its first use

#: emit(event_type, payload, severity)
Emit = Callable[[str, dict[str, Any], str], None]

_SEVERITY = {
    "running": "info",
    "stopped": "warning",
    "missing": "error",
    "crash_loop": "error",
    "unhealthy": "warning",
}
_INTERESTING = (
    "start",
    "restart",
    "die",
    "stop",
    "kill",
    "destroy",
    "oom",
    "pause",
    "unpause",
    "health_status",
)


@define
class _Tracked:
    container_name: str
    kind: str = ""
    key: tuple[Any, ...] = ()
    container_id: str = ""
    history: list[tuple[float, int]] = field(factory=list)
    state: dict[str, Any] = field(factory=dict)


def _events_thread(
    client: docker.DockerClient,
    control: StreamControl,
    since: int | None,
    on_event: Callable[[dict[str, Any]], None],
    on_open: Callable[[], None],
    labelled_only: bool = True,
) -> str:
    """
    Thread function: the engine's container events, of containers with the managed label, or
    (C{labelled_only=False}: adopted containers carry no label) of every container; the caller
    keeps what it owns.
    """
    filters = {"type": "container"}
    if labelled_only:
        filters["label"] = f"{LABEL_MANAGED}={MANAGED_VALUE}"
    stream = client.api.events(since=since, decode=True, filters=filters)
    control.attach(stream)
    on_open()
    for event in stream:
        if isinstance(event, dict):
            on_event(event)
    control.check()
    return "ended"


class HealthWatcher(Service):
    """
    Reports workload health transitions through C{emit}.

    @param emit: C{emit(event_type, payload, severity)} (the durable event outbox).
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        engine: DockerEngine,
        settings: WorkloadSettings,
        emit: Emit,
        *,
        reconcile_interval: float = 60.0,
        crash_loop_restarts: int = 3,
        crash_loop_window: float = 300.0,
        backoff_initial: float = 1.0,
        backoff_max: float = 30.0,
        coalesce: float = 0.05,
        adoption: Any = None,
    ) -> None:
        self.setName("workload-health")
        self._reactor = reactor
        #: The original agent's containers taken over (watched like the agent's own).
        self.adoption = adoption
        self._engine = engine
        self._settings = settings
        self._emit = emit
        self.reconcile_interval = reconcile_interval
        self.crash_loop_restarts = crash_loop_restarts
        self.crash_loop_window = crash_loop_window
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._backoff = backoff_initial
        self._coalesce = coalesce
        self._tracked: dict[str, _Tracked] = {}
        self._held: dict[str, int] = {}
        self._pending: dict[str, Any] = {}
        self._timers: set[Any] = set()
        self._loop: LoopingCall | None = None
        self._control: StreamControl | None = None
        self._stream_task: Deferred[Any] | None = None
        self._restart_call: Any = None
        self._last_event_time: int | None = None
        self._busy: set[Deferred[Any]] = set()
        self.stream_open = False
        #: Whether the open event stream has every container's events (adopted ones exist).
        self._stream_all = False
        self._subscribed = False
        self._stream_failures = 0
        self.events_seen = 0
        self._announce_pending = False

    # -- lifecycle ------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._engine.onAvailability(self._engineChanged)
        if self.adoption is not None and not self._subscribed:
            self._subscribed = True
            self.adoption.subscribe(self._adoptionChanged)
        if self._engine.available:
            self._startLoop()
        self._startStream()

    def _startLoop(self) -> None:
        """
        Reconcile now, then every C{reconcile_interval}; only while the engine answers (without
        one there is nothing to reconcile, and the timer would wake the agent for nothing).
        """
        if self._loop is not None and self._loop.running:
            return
        self._loop = LoopingCall(self._periodic)
        self._loop.clock = self._reactor
        self._loop.start(self.reconcile_interval, now=True).addErrback(
            lambda f: self.log.failure("reconcile loop died", f)
        )

    def _stopLoop(self) -> None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None

    def stopService(self) -> Deferred[None]:
        super().stopService()
        self._stopLoop()
        for timer in list(self._timers) + list(self._pending.values()):
            if timer.active():
                timer.cancel()
        self._timers.clear()
        self._pending.clear()
        if self._restart_call is not None and self._restart_call.active():
            self._restart_call.cancel()
        self._restart_call = None
        if self._control is not None:
            self._control.close("agent stopping")
        tasks = list(self._busy)
        if self._stream_task is not None:
            tasks.append(self._stream_task)
        for task in tasks:
            task.cancel()
        from twisted.internet.defer import DeferredList

        return DeferredList(tasks, consumeErrors=True).addBoth(lambda _: None)

    def _later(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        call: Any = None

        def run() -> None:
            self._timers.discard(call)
            fn(*args)

        call = self._reactor.callLater(delay, run)
        self._timers.add(call)

    def _track(self, coro: Any) -> Deferred[Any]:
        d = Deferred.fromCoroutine(coro)
        self._busy.add(d)

        def done(result: Any) -> Any:
            self._busy.discard(d)
            return result

        d.addBoth(done)
        d.addErrback(self._logFailure)
        return d

    def _logFailure(self, failure: Any) -> None:
        if failure.check(CancelledError):
            return
        if failure.check(EngineError):
            self.log.warn("health check failed: {error}", error=failure.value.error_message)
            return
        self.log.failure("health check failed", failure)

    # -- event stream ---------------------------------------------------------------

    def _engineChanged(self, available: bool) -> None:
        if not self.running:
            return
        if not available:
            self._stopLoop()
        if available:
            self._startLoop()
            self._backoff = self._backoff_initial
            if self._announce_pending:
                self._track(self.announce_all())
            if self._stream_task is None:
                if self._restart_call is not None and self._restart_call.active():
                    self._restart_call.cancel()
                self._restart_call = None
                self._startStream()

    def _startStream(self) -> None:
        if not self.running or self._stream_task is not None:
            return
        control = StreamControl()
        self._control = control
        since = self._last_event_time
        self._stream_all = bool(self._adopted())

        def on_event(event: dict[str, Any]) -> None:
            self._engine.callFromThread(self._onEvent, event)

        def on_open() -> None:
            self._engine.callFromThread(self._streamOpened)

        d = Deferred.fromCoroutine(
            self._engine.stream(
                _events_thread, control, since, on_event, on_open, not self._stream_all,
                what="watching engine events",
            )
        )
        self._stream_task = d
        d.addBoth(self._streamEnded, control)

    def _streamOpened(self) -> None:
        self.stream_open = True
        self._backoff = self._backoff_initial
        self._stream_failures = 0
        # Catch up with whatever changed while the stream was down.
        self._track(self.reconcile())

    def _adoptionChanged(self) -> None:
        """
        The adopted containers changed: they carry no label, so while there are any the event
        stream takes every container's events (reopened when that changes), and they are read now.
        """
        if not self.running:
            return
        control = self._control
        if self._stream_task is not None and control is not None and self._stream_all != bool(self._adopted()):
            self._stream_task = None
            self._control = None
            self.stream_open = False
            control.close("the adopted containers changed")
            self._startStream()
        self._track(self.reconcile())

    def _streamEnded(self, result: Any, control: StreamControl) -> None:
        if self._control is not None and self._control is not control:
            return  # a stream replaced by _adoptionChanged
        self._stream_task = None
        self.stream_open = False
        if not self.running or control.closed:
            return
        if hasattr(result, "check"):
            if result.check(CancelledError, StreamClosed):
                return
            reason = (
                result.value.error_message
                if result.check(EngineError)
                else f"{type(result.value).__name__}: {result.value}"
            )
        else:
            reason = "the engine closed the stream"
        # A broken event stream often means the engine went away: let it re-check now.
        self._engine.checkNow()
        if not self._engine.available:
            # The engine's own line says it is down (once); the stream restarts when the
            # engine answers again (_engineChanged), not on a timer that would log forever.
            return
        delay = self._backoff
        self._backoff = min(self._backoff * 2, self._backoff_max)
        self._stream_failures += 1
        # One line per outage, not one per retry (a retry every 30 s forever otherwise).
        log = self.log.info if self._stream_failures == 1 else self.log.debug
        log(
            "Engine event stream ended ({reason}); reconnecting in {delay} s",
            reason=reason,
            delay=delay,
        )
        self._restart_call = self._reactor.callLater(delay, self._restartStream)

    def _restartStream(self) -> None:
        self._restart_call = None
        self._startStream()

    def _onEvent(self, event: dict[str, Any]) -> None:
        self.events_seen += 1
        stamp = event.get("time")
        if isinstance(stamp, int):
            self._last_event_time = stamp
        action = str(event.get("Action") or event.get("status") or "")
        if not action.startswith(_INTERESTING):
            return
        attributes = (event.get("Actor") or {}).get("Attributes") or {}
        runtime_id = attributes.get(LABEL_RUNTIME_ID)
        if not runtime_id or not ops.is_owned(attributes, self._settings.agent_id):
            # An adopted container (no labels of its own): known by its id.
            cid = event.get("id") or (event.get("Actor") or {}).get("ID")
            runtime_id = (self.adoption.runtime_of(cid)
                          if self.adoption is not None and isinstance(cid, str) else None)
            if runtime_id:
                self._schedule(runtime_id)
            return
        canonical = attributes.get(LABEL_NAME)
        if canonical and attributes.get("name") and attributes.get("name") != canonical:
            return  # a rollback copy, not the workload
        self._schedule(runtime_id)

    def _schedule(self, runtime_id: str) -> None:
        if runtime_id in self._pending or not self.running:
            return

        def run() -> None:
            self._pending.pop(runtime_id, None)
            self._track(self.check(runtime_id))

        self._pending[runtime_id] = self._reactor.callLater(self._coalesce, run)

    # -- holds ----------------------------------------------------------------------

    def hold(self, runtime_id: str) -> None:
        """A command works on C{runtime_id}: report nothing about it until L{release}."""
        self._held[runtime_id] = self._held.get(runtime_id, 0) + 1

    def release(
        self, runtime_id: str, *, announce: bool = False, expect: str | None = None
    ) -> None:
        """
        The command is over. Re-read the runtime silently, or (C{announce}) report its
        current state after C{settle_announce_sec} whatever it was before.

        @param expect: the state the command's result told the backend (C{running} after
            a successful deploy, C{stopped} after a stop). If the re-read finds another
            state (the container died meanwhile), that is reported rather than swallowed.
        """
        count = self._held.get(runtime_id, 0) - 1
        if count > 0:
            self._held[runtime_id] = count
            return
        self._held.pop(runtime_id, None)
        if not self.running:
            return
        if announce:
            self._later(
                self._settings.settle_announce_sec,
                lambda: self._track(self.check(runtime_id, force=True)),
            )
        else:
            self._track(self.check(runtime_id, silent=True, expect=expect))

    def announce(self, runtime_id: str) -> None:
        """Report the runtime's current state now, whatever was reported before."""
        if self.running:
            self._track(self.check(runtime_id, force=True))

    def forget(self, runtime_id: str) -> None:
        """The runtime was removed on purpose: stop tracking it (no C{missing} event)."""
        self._tracked.pop(runtime_id, None)

    def held(self, runtime_id: str) -> bool:
        """Whether a command holds C{runtime_id}."""
        return runtime_id in self._held

    # -- classification -------------------------------------------------------------

    def _classify(self, runtime_id: str, snap: dict[str, Any], tracked: _Tracked) -> tuple[str, dict[str, Any], tuple[Any, ...]]:
        now = self._reactor.seconds()
        count = int(snap["restart_count"])
        if tracked.container_id != snap["id"]:
            tracked.container_id = snap["id"]
            tracked.history = []
        if not tracked.history or tracked.history[-1][1] != count:
            tracked.history.append((now, count))
        window_start = now - self.crash_loop_window
        before = [c for t, c in tracked.history if t < window_start]
        inside = [c for t, c in tracked.history if t >= window_start]
        baseline = before[-1] if before else (min(inside) if inside else count)
        if len(tracked.history) == 1 and snap["restarting"]:
            baseline = 0
        tracked.history = [(t, c) for t, c in tracked.history if t >= window_start] or [(now, count)]
        if before:
            tracked.history.insert(0, (window_start, before[-1]))
        name = snap["name"]
        looping = snap["restarting"] or snap["running"]
        if not looping and tracked.kind == "crash_loop" and getattr(self._engine, "kind", "") == "podman":
            # Podman has no "restarting" state: between two restarts of a crash loop the
            # container reads as stopped. It is still the same crash loop.
            looping = True
        if count - baseline >= self.crash_loop_restarts and looping:
            return (
                "crash_loop",
                {
                    "runtime_id": runtime_id,
                    "container_name": name,
                    "restart_count": count,
                    "status": snap["status"],
                },
                ("crash_loop",),
            )
        if snap["running"] and not snap["restarting"]:
            if snap.get("health") == "unhealthy":
                return (
                    "unhealthy",
                    {"runtime_id": runtime_id, "container_name": name, "health_status": "unhealthy"},
                    ("unhealthy",),
                )
            port = ops.host_port_of(snap)
            url = _endpoint_url(self._settings, port) if port else ""
            return (
                "running",
                {
                    "runtime_id": runtime_id,
                    "container_name": name,
                    "endpoint_url": url,
                    "restart_count": count,
                },
                ("running", url),
            )
        status = snap["status"] or "exited"
        return (
            "stopped",
            {
                "runtime_id": runtime_id,
                "container_name": name,
                "status": status,
                "exit_code": int(snap["exit_code"]),
                "restart_count": count,
            },
            ("stopped", status, int(snap["exit_code"])),
        )

    def _apply(
        self,
        runtime_id: str,
        snap: dict[str, Any] | None,
        *,
        force: bool = False,
        silent: bool = False,
        quiet_first_sight: bool = False,
        expect: str | None = None,
    ) -> dict[str, Any] | None:
        """
        Fold one observation in and report it when it is a transition (or C{force}).
        C{quiet_first_sight}: a workload seen for the first time by a sweep is recorded
        without an event (the backend learns it from L{announce_all} after connecting).
        """
        tracked = self._tracked.get(runtime_id)
        if snap is None:
            if tracked is None:
                return None
            del self._tracked[runtime_id]
            if silent or tracked.kind == "missing":
                return None
            payload = {"runtime_id": runtime_id, "container_name": tracked.container_name}
            self._send("missing", payload)
            return payload
        first_sight = tracked is None
        if tracked is None:
            tracked = _Tracked(container_name=snap["name"])
            self._tracked[runtime_id] = tracked
        tracked.container_name = snap["name"]
        kind, payload, key = self._classify(runtime_id, snap, tracked)
        tracked.state = {
            "state": kind,
            "status": snap["status"],
            "restart_count": snap["restart_count"],
            "health": snap.get("health"),
            "container_name": snap["name"],
        }
        changed = key != tracked.key
        tracked.kind, tracked.key = kind, key
        if silent and expect is not None and kind != expect:
            silent, force = False, True
        if quiet_first_sight and first_sight and kind not in ("crash_loop",):
            return None
        if silent or not (changed or force):
            return None
        self._send(kind, payload)
        return payload

    def _send(self, kind: str, payload: dict[str, Any]) -> None:
        self.log.info(
            "Workload {runtime_id} is {kind}", runtime_id=payload.get("runtime_id"), kind=kind
        )
        try:
            self._emit(f"workload.health.{kind}", payload, _SEVERITY[kind])
        except Exception:
            self.log.failure("emitting a health event failed")

    # -- checks ---------------------------------------------------------------------

    @staticmethod
    def _canonical(snaps: list[dict[str, Any]]) -> dict[str, Any] | None:
        for snap in snaps:
            if snap.get("canonical") and not snap.get("foreign") and snap.get("managed"):
                return snap
        return None

    def _adopted(self) -> dict[str, str]:
        snapshot: dict[str, str] = self.adoption.snapshot() if self.adoption is not None else {}
        return snapshot

    async def check(
        self,
        runtime_id: str,
        *,
        force: bool = False,
        silent: bool = False,
        expect: str | None = None,
    ) -> dict[str, Any] | None:
        """Re-read one runtime from the engine and report a transition (or, C{force}, its state)."""
        if runtime_id in self._held:
            return None
        snaps = await self._engine.call(
            ops.find_runtime, runtime_id, None, self._settings.agent_id, self._adopted(),
            what="checking workload health",
        )
        if runtime_id in self._held:
            return None
        return self._apply(
            runtime_id, self._canonical(snaps), force=force, silent=silent, expect=expect
        )

    async def reconcile(self) -> list[dict[str, Any]]:
        """Compare every managed workload with what was last reported; report changes."""
        return await self._sweep(force=False)

    async def announce_all(self) -> list[dict[str, Any]]:
        """
        Report every managed workload's current state (call after every connect to the
        backend, so runtimes marked C{error} while the node was away come back). While the
        engine is unavailable the announcement is deferred until it answers again.
        """
        if not self._engine.available:
            self._announce_pending = True
            return []
        self._announce_pending = False
        try:
            return await self._sweep(force=True)
        except EngineError:
            self._announce_pending = True
            raise

    async def _sweep(self, *, force: bool) -> list[dict[str, Any]]:
        rows = await self._engine.call(ops.list_managed, self._settings.agent_id, self._adopted(),
                                       what="listing managed workloads")
        sent: list[dict[str, Any]] = []
        seen: set[str] = set()
        for row in rows:
            labels = row["labels"]
            runtime_id = labels.get(LABEL_RUNTIME_ID)
            if not runtime_id or labels.get(LABEL_NAME, row["name"]) != row["name"]:
                continue
            seen.add(runtime_id)
            if runtime_id in self._held:
                continue
            tracked = self._tracked.get(runtime_id)
            cheap = (
                not force
                and tracked is not None
                and tracked.kind == "running"
                and tracked.container_id == row["id"]
                and row["state"] == "running"
                and row["health"] != "unhealthy"
            )
            if cheap:
                continue
            snap = await self._engine.call(ops.inspect, row["id"], what="inspecting a workload")
            if runtime_id in self._held:
                continue
            if snap is None:
                continue
            snap["canonical"] = True
            result = self._apply(runtime_id, snap, force=force, quiet_first_sight=not force)
            if result is not None:
                sent.append(result)
        for runtime_id in list(self._tracked):
            if runtime_id not in seen and runtime_id not in self._held:
                result = self._apply(runtime_id, None)
                if result is not None:
                    sent.append(result)
        return sent

    def _periodic(self) -> Deferred[Any] | None:
        if not self._engine.available:
            return None
        return self._track(self.reconcile())

    # -- views ----------------------------------------------------------------------

    def states(self) -> dict[str, dict[str, Any]]:
        """What was last observed per runtime (for diagnostics)."""
        return {rid: dict(t.state) for rid, t in self._tracked.items()}


def _endpoint_url(settings: WorkloadSettings, port: int) -> str:
    """The runtime's endpoint URL (the spec module, with its parser, imported at the first one)."""
    from .spec import endpoint_url

    return endpoint_url(settings, port)
