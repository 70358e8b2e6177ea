"""
The Docker executor: docker-py on bounded thread pools, never on the reactor thread.

L{DockerEngine} owns two docker-py clients and two L{PoolService}s:

 - the I{short} pool runs ordinary API calls (inspect, create, start, stop, logs...) with a
   socket timeout so a hung daemon cannot pin a thread for ever;
 - the I{stream} pool runs calls that hold a connection open for long (image pull and
   load, the event stream), so they cannot starve short calls.

It tracks whether the engine answers (C{available}, C{last_error}, C{address}): a ping at
start, and while the engine is down a ping with exponential backoff until it answers again.
While it is up nothing polls it; a call that fails to connect marks it down. The pings go
through one client made once (with a fixed API version, so making it needs no engine); the
clients for calls are made once the engine's API version is known, and kept.

Every failure leaves as a L{EngineError} (a L{CommandFailed} with code C{runtime_error})
whose message names what was attempted, the engine address and the cause.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.logger import Logger

from llmport_agent.core.config import mask_url
from llmport_agent.core.threads import PoolService

from ..commands.base import RUNTIME_ERROR, CommandFailed

if TYPE_CHECKING:
    import docker

T = TypeVar("T")

DEFAULT_ADDRESS = "unix:///var/run/docker.sock"
#: Where rootful Podman's Docker-compatible socket lives (C{podman.socket}).
PODMAN_ADDRESS = "unix:///run/podman/podman.sock"
#: The probe's longest back-off while the missing socket file is watched (inotify tells when
#: it appears; the probe is only a safety net then).
WATCHED_PROBE_MAX = 600.0


def default_address(exists: Callable[[str], bool] = os.path.exists) -> str:
    """
    The engine address without C{DOCKER_HOST}: Docker's socket, or Podman's when only that
    one exists (a host that runs Podman instead of Docker).
    """
    if not exists(DEFAULT_ADDRESS[len("unix://") :]) and exists(PODMAN_ADDRESS[len("unix://") :]):
        return PODMAN_ADDRESS
    return DEFAULT_ADDRESS


class EngineError(CommandFailed):
    """
    A Docker engine call failed.

    @ivar unreachable: the engine did not answer at all (connection refused, socket gone).
    @ivar status_code: the HTTP status the engine answered with, when it answered.
    @ivar explanation: the engine's own words, when it answered.
    """

    def __init__(
        self,
        message: str,
        *,
        unreachable: bool = False,
        status_code: int | None = None,
        explanation: str = "",
        error_code: str = RUNTIME_ERROR,
    ) -> None:
        super().__init__(error_code, message)
        self.unreachable = unreachable
        self.status_code = status_code
        self.explanation = explanation


class StreamClosed(Exception):
    """The stream was closed from the reactor side (cancel, stall, stop)."""


class StreamControl:
    """
    A thread-safe handle on a streaming engine call.

    The thread running the stream L{attach}es the docker-py stream (anything with a
    C{close()} that unblocks a reader in another thread, such as
    L{docker.types.CancellableStream}); the reactor side calls L{close} to end it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Any] = []
        self.closed = False
        self.reason = ""

    def attach(self, closeable: Any) -> None:
        """
        Register C{closeable}; close it at once (and raise L{StreamClosed}) when this
        control is already closed. Called from the stream's thread.
        """
        with self._lock:
            if not self.closed:
                self._items.append(closeable)
                return
        _close_quietly(closeable)
        raise StreamClosed(self.reason)

    def close(self, reason: str = "closed") -> None:
        """Close everything attached, now and later. Safe from any thread; idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.reason = reason
            items, self._items = self._items, []
        for item in items:
            _close_quietly(item)

    def check(self) -> None:
        """Raise L{StreamClosed} when closed (for loops in the stream's thread)."""
        if self.closed:
            raise StreamClosed(self.reason)


def _close_quietly(closeable: Any) -> None:
    try:
        closeable.close()
    except Exception:  # noqa: BLE001 - closing a dead stream may fail in many ways
        pass


def _tls_configured(env: Mapping[str, str]) -> bool:
    """Whether C{DOCKER_CERT_PATH} or C{DOCKER_TLS_VERIFY} asks for TLS (as docker-py reads them)."""
    verify = env.get("DOCKER_TLS_VERIFY")
    return bool(env.get("DOCKER_CERT_PATH")) or (verify is not None and verify != "")


def _kwargs_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """docker-py's client arguments from the environment (imports docker-py)."""
    import docker.utils

    return dict(docker.utils.kwargs_from_env(environment=env))


def _docker_client(**kwargs: Any) -> docker.DockerClient:
    """A docker-py client; docker-py (with requests, ~7 MiB) is imported at the first one."""
    import docker

    return docker.DockerClient(**kwargs)


class _NotLoaded(Exception):
    """Stands for an exception class of a module not imported: nothing is an instance of it."""


def _loaded_errors() -> tuple[Any, Any, Any, Any]:
    """
    docker-py's C{APIError} and C{DockerException}, requests' C{Timeout} and
    C{ConnectionError}; L{_NotLoaded} for those of a module not imported yet (then no
    exception can be one of them: translating an error never imports docker-py).
    """
    errors = sys.modules.get("docker.errors")
    rexc = sys.modules.get("requests.exceptions")
    return (
        getattr(errors, "APIError", _NotLoaded),
        getattr(errors, "DockerException", _NotLoaded),
        getattr(rexc, "Timeout", _NotLoaded),
        getattr(rexc, "ConnectionError", _NotLoaded),
    )


def _find_cause(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, kinds):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def _short_cause(exc: BaseException) -> str:
    """A one-line cause without URLs (which may carry query strings) or tracebacks."""
    APIError = _loaded_errors()[0]  # noqa: N806
    if isinstance(exc, APIError):
        text = str(exc.explanation or "") or f"HTTP {exc.status_code}"
    else:
        # requests wraps urllib3 errors whose text repeats the pool; keep the innermost.
        inner: BaseException = exc
        while True:
            nxt = inner.__cause__ or inner.__context__
            if nxt is None or nxt is inner:
                break
            inner = nxt
        text = str(inner) or type(inner).__name__
        if isinstance(inner, FileNotFoundError):
            text = "the socket does not exist (is dockerd running?)"
        elif isinstance(inner, ConnectionRefusedError):
            text = "connection refused (is dockerd running?)"
        elif "Max retries exceeded" in text or "HTTPConnectionPool" in text:
            text = type(inner).__name__
    text = " ".join(text.split())
    return text[:500]


def translate_error(what: str, address: str, exc: BaseException, timeout: float | None) -> EngineError:
    """Turn a docker-py / requests exception into an L{EngineError} a person can read."""
    APIError, DockerException, Timeout, RequestsConnectionError = _loaded_errors()  # noqa: N806
    if isinstance(exc, APIError):
        explanation = " ".join(str(exc.explanation or "").split())[:1000]
        return EngineError(
            f"{what} failed: Docker engine at {address} answered: "
            f"{explanation or f'HTTP {exc.status_code}'}",
            status_code=exc.status_code,
            explanation=explanation,
        )
    if _find_cause(exc, (Timeout,)):
        return EngineError(
            f"{what} failed: Docker engine at {address} did not answer within "
            f"{timeout if timeout is not None else '?'} s"
        )
    if _find_cause(
        exc, (RequestsConnectionError, ConnectionError, FileNotFoundError)
    ) or (isinstance(exc, DockerException) and "fetching server API version" in str(exc)):
        return EngineError(
            f"{what} failed: Docker engine at {address} is unreachable: {_short_cause(exc)}",
            unreachable=True,
        )
    if isinstance(exc, DockerException):
        return EngineError(f"{what} failed: Docker engine at {address}: {_short_cause(exc)}")
    return EngineError(
        f"{what} failed: unexpected error talking to the Docker engine at {address}: "
        f"{type(exc).__name__}: {_short_cause(exc)}"
    )


class DockerEngine(Service):
    """
    The docker-py executor service.

    @ivar available: the engine answered the last call or ping.
    @ivar last_error: why the engine is unavailable ("" when it is available).
    @ivar address: the engine address (C{DOCKER_HOST} or the default socket).
    @ivar calls: the number of HTTP requests made to the engine (for benchmarks).
    @ivar version: the engine version once known ("" before).
    @ivar runtimes: the container runtimes the engine offers (names).
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        *,
        environ: Mapping[str, str] | None = None,
        call_timeout: float = 60.0,
        stream_timeout: float = 600.0,
        max_threads: int = 8,
        stream_threads: int = 6,
        probe_initial: float = 1.0,
        probe_max: float = 30.0,
        client_factory: Callable[..., docker.DockerClient] | None = None,
        socket_exists: Callable[[str], bool] = os.path.exists,
        watch_socket: Callable[[str, Callable[[], None], Callable[[str], None]], Any] | None = None,
        watched_probe_max: float = WATCHED_PROBE_MAX,
    ) -> None:
        self.setName("docker-engine")
        self._reactor = reactor
        env = dict(os.environ if environ is None else environ)
        if not env:
            env = dict(os.environ)  # docker-py reads an empty environment as os.environ
        # docker-py (with requests, ~7 MiB and ~0.1 s of imports) is imported when the first
        # client is made, on a pool thread: a node without an engine never imports it. TLS
        # settings are read now (a wrong one is said at start, as before).
        self._env = env
        self._client_kwargs: dict[str, Any] | None = _kwargs_from_env(env) if _tls_configured(env) else None
        self._host = str(env.get("DOCKER_HOST") or "")
        # For messages and diagnostics: a password in DOCKER_HOST is masked (the client gets
        # the address as configured). Without DOCKER_HOST: Docker's socket, or Podman's when
        # only that one exists.
        self.address: str = mask_url(self._host or default_address(socket_exists))
        self._socket_exists = socket_exists
        self.call_timeout = call_timeout
        self.stream_timeout = stream_timeout
        self._max_threads = max(1, min(max_threads, 10))
        self._stream_threads = max(2, min(stream_threads, 10))
        self._short = PoolService(reactor, "docker", self._max_threads)
        self._streams = PoolService(reactor, "docker-stream", self._stream_threads)
        self._clients: dict[str, docker.DockerClient] = {}
        self._client_lock = threading.Lock()
        self._client_factory = client_factory or _docker_client
        self._controls: set[StreamControl] = set()
        self._counter = itertools.count(1)
        self._calls = 0
        self._listeners: list[Callable[[bool], None]] = []
        self._probe_initial = probe_initial
        self._probe_max = probe_max
        self._probe_delay = probe_initial
        self._probe_call: Any = None
        self._probing: Deferred[Any] | None = None
        #: Watches for the missing socket file to appear (None: not watching, or no inotify).
        self._watch_socket = watch_socket if watch_socket is not None else self._inotify_watch
        self._watched_probe_max = max(probe_max, watched_probe_max)
        self._watch: Any = None
        self.available = False
        #: Whether the engine was ever probed (or called): before that, "not available"
        #: means "not known yet", not "down".
        self.checked = False
        self.last_error = "not checked yet"
        self.version = ""
        self.api_version = ""
        self.runtimes: tuple[str, ...] = ()
        self.default_runtime = ""
        self.info: dict[str, Any] = {}
        from llmport_agent.ops.timing import engine_calls

        #: Durations of calls by operation (the function's name) and outcome (metrics).
        self.call_stats = engine_calls()
        #: C{docker} or C{podman} (from the engine's version answer).
        self.kind = "docker"

    # -- lifecycle ------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._short.startService()
        self._streams.startService()
        self._probe_delay = self._probe_initial
        self._scheduleProbe(0)

    def stopService(self) -> Deferred[None]:
        super().stopService()
        if self._probe_call is not None and self._probe_call.active():
            self._probe_call.cancel()
        self._probe_call = None
        self._unwatch()
        for control in list(self._controls):
            control.close("agent stopping")
        self._controls.clear()
        d1 = self._streams.stopService(drainTimeout=5.0)
        d2 = self._short.stopService(drainTimeout=10.0)

        def _closeClients(_: object) -> None:
            with self._client_lock:
                clients, self._clients = list(self._clients.values()), {}
            for client in clients:
                _close_quietly(client)

        from twisted.internet.defer import gatherResults

        return gatherResults([d1, d2], consumeErrors=True).addBoth(_closeClients)

    # -- availability -----------------------------------------------------------------

    def onAvailability(self, listener: Callable[[bool], None]) -> None:
        """Call C{listener(available)} on every change of availability (reactor thread)."""
        self._listeners.append(listener)

    def _setAvailable(self, available: bool, error: str = "") -> None:
        # The first answer (or its absence) is a change too: from "not known yet".
        changed = available != self.available or not self.checked
        self.checked = True
        self.available = available
        self.last_error = "" if available else error
        if not changed:
            return
        if available:
            self.log.info(
                "Docker engine at {address} is available (version {version})",
                address=self.address,
                version=self.version,
            )
        else:
            self.log.warn(
                "{error}. Workload commands fail and the node reports degraded until it "
                "answers; start dockerd or point DOCKER_HOST at the engine (checked again "
                "{when}every {every:g} s at most, said here when it answers)",
                error=error,
                when="as soon as its socket appears, and " if self._watch is not None else "",
                every=self._recheck_max(),
            )
        for listener in list(self._listeners):
            try:
                listener(available)
            except Exception:
                self.log.failure("availability listener failed")

    def _scheduleProbe(self, delay: float) -> None:
        if not self.running:
            return
        if self._probe_call is not None and self._probe_call.active():
            if delay >= self._probe_call.getTime() - self._reactor.seconds():
                return
            self._probe_call.cancel()
        self._probe_call = self._reactor.callLater(delay, self._probe)

    def _probe(self) -> None:
        self._probe_call = None
        if self._probing is not None or not self.running:
            return
        try:
            # No socket, no engine: said without a thread (the probe of a node without
            # dockerd wakes nothing but this timer).
            self._checkSocket()
        except FileNotFoundError as exc:
            d: Deferred[dict[str, Any]] = fail(exc)
        else:
            d = self._short.run(self._probeFacts)
        self._probing = d

        def _ok(facts: dict[str, Any]) -> None:
            self._probing = None
            self.version = str(facts.get("version", ""))
            self.api_version = str(facts.get("api_version", ""))
            self.runtimes = tuple(facts.get("runtimes", ()))
            self.default_runtime = str(facts.get("default_runtime", ""))
            self.info = facts
            kind = str(facts.get("engine") or "docker")
            if kind != self.kind or not self.version:
                if kind == "podman":
                    self.log.info(
                        "The container engine at {address} is Podman {version} (Docker-compatible "
                        "API): NVIDIA GPU requests are refused there (the API ignores them), and "
                        "workloads restart after a reboot only with podman-restart.service enabled",
                        address=self.address,
                        version=facts.get("version", ""),
                    )
            self.kind = kind
            self._probe_delay = self._probe_initial
            self._unwatch()
            self._setAvailable(True)

        def _bad(failure: Any) -> None:
            self._probing = None
            if failure.check(CancelledError):
                return
            # The socket file is missing: told when it appears (inotify) instead of probing
            # every probe_max; the probe goes on at a slow back-off as a safety net.
            watched = failure.check(FileNotFoundError) is not None and self._watchForSocket()
            if not watched:
                self._unwatch()
            err = translate_error("ping", self.address, failure.value, self.call_timeout)
            self._setAvailable(False, err.error_message.removeprefix("ping failed: "))
            if watched:
                # Told when the socket appears: the probe is only a safety net (slow at once).
                self._probe_delay = self._recheck_max()
            delay = self._probe_delay
            self._probe_delay = min(self._probe_delay * 2, self._recheck_max())
            self._scheduleProbe(delay)

        d.addCallbacks(_ok, _bad)

    def _recheck_max(self) -> float:
        """The longest probe back-off now: slow while the missing socket is watched."""
        return self._watched_probe_max if self._watch is not None else self._probe_max

    def _inotify_watch(self, path: str, appeared: Callable[[], None], lost: Callable[[str], None]) -> Any:
        from llmport_agent.workloads.socketwatch import watch_socket

        return watch_socket(self._reactor, path, appeared, lost)

    def _watchForSocket(self) -> bool:
        """Watch for the missing socket file (once); False where that cannot be done."""
        if self._watch is not None:
            return True
        path = self._socket_path()
        if not path or not self.running:
            return False
        watch = self._watch_socket(path, self._socketAppeared, self._watchLost)
        if watch is None or not getattr(watch, "active", True):
            # No inotify here (probe on the back-off), or it is there already (probed at once).
            return False
        # Said in the "unreachable" warning that follows ("checked again as soon as its socket
        # appears"): no line of its own.
        self._watch = watch
        return True

    def _unwatch(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()

    def _watchLost(self, why: str) -> None:
        """
        The socket watch ended without the socket appearing (its directory went away, no
        inotify watch left): back to the usual back-off at once, and a new watch at the next
        probe that finds the socket missing.
        """
        if self._watch is None:
            return
        self._watch = None
        if not self.running:
            return
        self._probe_delay = min(self._probe_delay, self._probe_max)
        self.log.info(
            "Stopped watching for the Docker engine's socket {path} ({why}): checked again every "
            "{every:g} s at most",
            path=self._socket_path(),
            why=why,
            every=self._probe_max,
        )
        self._scheduleProbe(self._probe_delay)

    def _socketAppeared(self) -> None:
        """The engine's socket file appeared: probe now, on the short back-off again."""
        self._watch = None
        if not self.running:
            return
        self._probe_delay = self._probe_initial
        self._scheduleProbe(0)

    def _socket_path(self) -> str:
        """The engine's socket file for a C{unix://} address, else ""."""
        base = self._host or self.address
        return base[len("unix://"):] if base.startswith("unix://") else ""

    def _checkSocket(self, label: str = "") -> None:
        """
        Raise an unreachable L{EngineError} (C{FileNotFoundError} for the probe, no C{label})
        when the engine's socket file is missing: a call then fails as docker-py's would,
        without a pool thread or importing docker-py. The node's engine error reads as the
        probe's would (no call named in it).
        """
        path = self._socket_path()
        if not path or self._socket_exists(path):
            return
        exc = FileNotFoundError(2, "No such file or directory", path)
        if not label:
            raise exc
        err = translate_error(label, self.address, exc, self.call_timeout)
        # Watched before it is said: the warning names how the engine is checked again.
        self._watchForSocket()
        self._setAvailable(False, err.error_message.removeprefix(f"{label} failed: "))
        self._scheduleProbe(self._probe_delay)
        raise err

    def checkNow(self) -> None:
        """Ping the engine soon (e.g. after a call failed to connect)."""
        self._scheduleProbe(0)

    # -- facts ------------------------------------------------------------------------

    @property
    def calls(self) -> int:
        """HTTP requests made to the engine so far."""
        return self._calls

    @property
    def nvidia_runtime(self) -> bool:
        """Whether the engine lists an C{nvidia} runtime."""
        return any("nvidia" in name for name in self.runtimes)

    def facts(self) -> dict[str, Any]:
        """Cheap static facts for heartbeat and inventory (no engine call)."""
        return {
            "docker_available": self.available,
            "container_runtime": self.kind,
            "container_runtime_version": self.version,
            "docker_nvidia_runtime": self.nvidia_runtime,
            "docker_address": self.address,
            "docker_error": self.last_error,
        }

    # -- calls --------------------------------------------------------------------------

    def _countRequest(self, response: Any, *args: Any, **kwargs: Any) -> Any:
        # Runs in pool threads; the GIL makes the increment safe enough for a counter.
        self._calls += 1
        return response

    def _client(self, kind: str, api_version: str = "") -> docker.DockerClient:
        with self._client_lock:
            client = self._clients.get(kind)
            if client is not None:
                return client
        if self._client_kwargs is None:
            self._client_kwargs = _kwargs_from_env(self._env)
        kwargs = dict(self._client_kwargs)
        kwargs.setdefault("base_url", self.address)
        if kind == "probe":
            from docker.constants import MINIMUM_DOCKER_API_VERSION

            # Made once, even while the engine is down: a fixed version needs no answer (a
            # version of "auto" asks the engine, and fails, at every attempt). It only makes
            # the unversioned version call, which every engine answers.
            kwargs["version"] = MINIMUM_DOCKER_API_VERSION
            kwargs["timeout"] = self.call_timeout
            kwargs["max_pool_size"] = 1
        else:
            # The version the probe read (the engine's), else negotiated by docker-py.
            api_version = api_version or self.api_version
            kwargs["version"] = api_version or "auto"
            if not api_version:
                self._calls += 1  # version negotiation
            kwargs["timeout"] = self.call_timeout if kind == "short" else self.stream_timeout
            kwargs["max_pool_size"] = self._max_threads if kind == "short" else self._stream_threads
        client = self._client_factory(**kwargs)
        try:
            client.api.hooks["response"].append(self._countRequest)
        except (AttributeError, KeyError, TypeError):
            pass
        if str(kwargs["base_url"]).startswith(("unix://", "npipe://")):
            # requests would read ~/.netrc (and the proxy variables) again at every request:
            # neither applies to a local socket.
            try:
                client.api.trust_env = False
            except AttributeError:
                pass
        with self._client_lock:
            existing = self._clients.get(kind)
            if existing is not None:
                _close_quietly(client)
                return existing
            self._clients[kind] = client
        return client

    def _probeFacts(self) -> dict[str, Any]:
        """
        Thread function: the engine's version (unversioned call, on the probe client: this is
        the ping), then its info on the call client, made with that version.
        """
        version = self._client("probe").api.version(api_version=False)
        api_version = str(version.get("ApiVersion", ""))
        return _probe_engine(self._client("short", api_version), version)

    def _invoke(self, kind: str, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        return fn(self._client(kind), *args)

    def _failed(self, what: str, exc: BaseException, timeout: float) -> EngineError:
        if isinstance(exc, EngineError):
            return exc
        err = translate_error(what, self.address, exc, timeout)
        if err.unreachable:
            self._setAvailable(False, err.error_message)
            self._scheduleProbe(self._probe_delay)
        return err

    async def call(self, fn: Callable[..., T], *args: Any, what: str | None = None) -> T:
        """
        Run C{fn(client, *args)} on the short pool and return its (plain data) result.

        @raise EngineError: the engine failed or could not be reached.
        @raise CommandFailed: raised by C{fn} itself, passed through.
        """
        label = str(what or getattr(fn, "__name__", "docker call"))
        if not self.running:
            raise EngineError(f"{label} failed: the Docker executor is not running")
        operation = getattr(fn, "__name__", "call")
        started = self._reactor.seconds()
        try:
            self._checkSocket(label)
            result = await self._short.run(self._invoke, "short", fn, args)
        except CancelledError:
            raise
        except CommandFailed:
            self.call_stats.observe(operation, "error", self._reactor.seconds() - started)
            raise
        except Exception as exc:
            self.call_stats.observe(operation, "error", self._reactor.seconds() - started)
            raise self._failed(label, exc, self.call_timeout) from None
        self.call_stats.observe(operation, "ok", self._reactor.seconds() - started)
        if not self.available and self._probing is None:
            self.checkNow()
        return result

    async def stream(
        self,
        fn: Callable[..., T],
        control: StreamControl,
        *args: Any,
        what: str | None = None,
    ) -> T:
        """
        Run C{fn(client, control, *args)} on the stream pool. C{fn} attaches its docker
        stream to C{control}; cancelling the caller (or C{control.close()}) ends it.

        @raise StreamClosed: the stream was closed from the reactor side.
        @raise EngineError: the engine failed or could not be reached.
        """
        label = str(what or getattr(fn, "__name__", "docker stream"))
        if not self.running:
            raise EngineError(f"{label} failed: the Docker executor is not running")
        self._controls.add(control)
        try:
            self._checkSocket(label)
            return await self._streams.run(self._invoke, "stream", fn, (control, *args))
        except CancelledError:
            control.close("cancelled")
            raise
        except (StreamClosed, CommandFailed):
            raise
        except Exception as exc:
            if control.closed:
                raise StreamClosed(control.reason) from None
            raise self._failed(label, exc, self.stream_timeout) from None
        finally:
            self._controls.discard(control)

    def callFromThread(self, fn: Callable[..., Any], *args: Any) -> None:
        """For thread functions: run C{fn(*args)} on the reactor thread."""
        self._reactor.callFromThread(fn, *args)

    def whenAvailable(self) -> Deferred[None]:
        """A Deferred that fires once the engine is available (now if it is)."""
        if self.available:
            return succeed(None)
        d: Deferred[None] = Deferred()

        def _once(up: bool) -> None:
            if up and _once in self._listeners:
                self._listeners.remove(_once)
                if not d.called:
                    d.callback(None)

        self._listeners.append(_once)
        return d


def _probe_engine(client: docker.DockerClient, version: Mapping[str, Any]) -> dict[str, Any]:
    """Thread function: the engine's facts from its C{version} answer and its info."""
    info = client.api.info()
    runtimes = sorted((info.get("Runtimes") or {}).keys())
    return {
        "engine": engine_kind(version),
        "version": str(version.get("Version", "")),
        "api_version": str(version.get("ApiVersion", "")),
        "os": str(info.get("OperatingSystem", "")),
        "kernel": str(info.get("KernelVersion", "")),
        "runtimes": runtimes,
        "default_runtime": str(info.get("DefaultRuntime", "")),
        "storage_driver": str(info.get("Driver", "")),
        "cgroup_driver": str(info.get("CgroupDriver", "")),
        "containers_running": int(info.get("ContainersRunning") or 0),
        "images": int(info.get("Images") or 0),
    }


def engine_kind(version: Mapping[str, Any]) -> str:
    """C{podman} when the engine's version answer names Podman, else C{docker}."""
    names = [str((c or {}).get("Name", "")) for c in (version.get("Components") or []) if isinstance(c, Mapping)]
    platform = version.get("Platform") or {}
    names.append(str(platform.get("Name", "")) if isinstance(platform, Mapping) else "")
    return "podman" if any("podman" in n.lower() for n in names) else "docker"
