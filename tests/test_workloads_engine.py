"""
The Docker executor without a Docker engine: error translation, availability tracking
with backoff and reconnection (fake client, synchronous pool, Clock), stream controls,
the health watcher's classification, and an engine address that does not exist.
"""

from __future__ import annotations

from typing import Any, cast

import requests
from docker.constants import MINIMUM_DOCKER_API_VERSION
from docker.errors import APIError, DockerException, NotFound
from twisted.internet import reactor as _global_reactor
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.task import Clock, deferLater
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmport_agent.commands.base import RUNTIME_ERROR, CommandFailed
from llmport_agent.workloads.engine import (
    DockerEngine,
    EngineError,
    StreamClosed,
    StreamControl,
    translate_error,
)
from llmport_agent.workloads.health import HealthWatcher
from llmport_agent.workloads.settings import WorkloadSettings

reactor: Any = _global_reactor

ADDR = "unix:///run/test/docker.sock"


class SyncPool:
    """A pool that runs calls at once on the calling thread."""

    def __init__(self) -> None:
        self.calls = 0

    def startService(self) -> None:
        pass

    def stopService(self, drainTimeout: float = 0) -> Deferred[None]:
        return succeed(None)

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Deferred[Any]:
        self.calls += 1
        return maybeDeferred(fn, *args, **kwargs)


class FakeAPI:
    """Just enough of docker-py's APIClient."""

    def __init__(self, owner: FakeDocker) -> None:
        self.owner = owner
        self.hooks: dict[str, list[Any]] = {"response": []}

    def _maybe_fail(self) -> None:
        if self.owner.down:
            raise requests.exceptions.ConnectionError(FileNotFoundError(2, "No such file or directory"))

    def ping(self) -> bool:
        self._maybe_fail()
        return True

    def version(self, api_version: bool = True) -> dict[str, Any]:
        self.owner.version_calls += 1
        self._maybe_fail()
        return {"Version": "20.10.24", "ApiVersion": "1.41"}

    def info(self) -> dict[str, Any]:
        self._maybe_fail()
        return {"Runtimes": {"runc": {}, "nvidia": {}}, "DefaultRuntime": "runc"}


class FakeDocker:
    """A DockerClient factory whose engine can be switched off and on."""

    def __init__(self) -> None:
        self.down = False
        self.created = 0
        self.versions: list[Any] = []
        self.version_calls = 0

    def __call__(self, **kwargs: Any) -> Any:
        self.created += 1
        self.versions.append(kwargs.get("version"))
        if self.down and kwargs.get("version") == "auto":
            # docker-py asks the engine for its version while making such a client.
            raise DockerException("Error while fetching server API version: connection refused")
        owner = self

        class Client:
            api = FakeAPI(owner)

            def close(self) -> None:
                pass

        return Client()


def make_engine(clock: Clock, fake: FakeDocker) -> DockerEngine:
    engine = DockerEngine(clock, environ={"DOCKER_HOST": ADDR}, client_factory=fake, socket_exists=lambda path: True)
    engine._short = SyncPool()  # type: ignore[assignment]
    engine._streams = SyncPool()  # type: ignore[assignment]
    return engine


class TranslateErrorTests(SynchronousTestCase):
    """docker-py / requests errors become messages naming the engine and the cause."""

    def test_unreachable(self) -> None:
        """Connection failures are 'unreachable' with a readable cause, no URL."""
        exc = requests.exceptions.ConnectionError("HTTPConnectionPool(host='localhost'): Max retries exceeded")
        exc.__context__ = FileNotFoundError(2, "No such file or directory")
        err = translate_error("starting container x", ADDR, exc, 60)
        self.assertTrue(err.unreachable)
        self.assertEqual(err.error_code, RUNTIME_ERROR)
        self.assertEqual(
            err.error_message,
            f"starting container x failed: Docker engine at {ADDR} is unreachable: "
            "the socket does not exist (is dockerd running?)",
        )

    def test_version_negotiation(self) -> None:
        """docker-py's 'fetching server API version' error counts as unreachable."""
        err = translate_error("ping", ADDR, DockerException("Error while fetching server API version: x"), 5)
        self.assertTrue(err.unreachable)

    def test_api_error(self) -> None:
        """An engine answer keeps its explanation and status, never the request URL."""
        response = requests.Response()
        response.status_code = 409
        response.url = "http+docker://localhost/v1.41/containers/create?name=secret-query"
        exc = APIError("409 Client Error", response=response, explanation="Conflict. The name is in use")
        err = translate_error("creating", ADDR, exc, 60)
        self.assertFalse(err.unreachable)
        self.assertEqual(err.status_code, 409)
        self.assertIn("answered: Conflict. The name is in use", err.error_message)
        self.assertNotIn("secret-query", err.error_message)

    def test_timeout(self) -> None:
        """A read timeout says how long was waited."""
        err = translate_error("stopping", ADDR, requests.exceptions.ReadTimeout("x"), 60)
        self.assertIn("did not answer within 60 s", err.error_message)
        self.assertFalse(err.unreachable)

    def test_not_found_is_api_error(self) -> None:
        """NotFound passes through as an engine answer with status 404."""
        response = requests.Response()
        response.status_code = 404
        err = translate_error("x", ADDR, NotFound("nf", response=response, explanation="No such container: y"), 1)
        self.assertEqual(err.status_code, 404)


class AvailabilityTests(SynchronousTestCase):
    """Availability: ping at start, backoff while down, reconnect when back."""

    def test_up_at_start(self) -> None:
        """A reachable engine is available after the first ping, with its facts."""
        clock, fake = Clock(), FakeDocker()
        engine = make_engine(clock, fake)
        engine.startService()
        clock.advance(0)
        self.assertTrue(engine.available)
        facts = engine.facts()
        self.assertEqual(facts["container_runtime"], "docker")
        self.assertEqual(facts["container_runtime_version"], "20.10.24")
        self.assertTrue(facts["docker_nvidia_runtime"])
        self.assertTrue(facts["docker_available"])
        self.successResultOf(engine.stopService())
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_backoff_and_reconnect(self) -> None:
        """While down, pings back off 1, 2, 4 s; when the engine returns, listeners hear it."""
        clock, fake = Clock(), FakeDocker()
        fake.down = True
        engine = make_engine(clock, fake)
        seen: list[bool] = []
        engine.onAvailability(seen.append)
        self.assertFalse(engine.checked)
        engine.startService()
        clock.advance(0)
        self.assertFalse(engine.available)
        self.assertTrue(engine.checked)
        self.assertIn(ADDR, engine.last_error)
        # The first probe's outcome is a change too (from "not known yet"): listeners hear it.
        self.assertEqual(seen, [False])
        attempts = fake.version_calls
        clock.advance(1)
        clock.advance(2)
        self.assertEqual(fake.version_calls, attempts + 2)
        # One client for every ping while the engine is down, made without asking the engine
        # (issue 27: not a new client, with its config reads, every attempt).
        self.assertEqual(fake.created, 1)
        [call] = clock.getDelayedCalls()
        call = cast(Any, call)
        self.assertAlmostEqual(call.getTime() - clock.seconds(), 4)
        fake.down = False
        waiting = engine.whenAvailable()
        clock.advance(4)
        self.assertTrue(engine.available)
        self.assertEqual(engine.last_error, "")
        self.assertEqual(seen, [False, True])
        # The client for calls is made once the engine answered, with the version it named.
        self.assertEqual(fake.versions, [MINIMUM_DOCKER_API_VERSION, "1.41"])
        self.successResultOf(waiting)
        self.assertEqual(clock.getDelayedCalls(), [])
        self.successResultOf(engine.stopService())

    def test_call_marks_down(self) -> None:
        """A call that cannot connect fails with runtime_error and marks the engine down."""
        clock, fake = Clock(), FakeDocker()
        engine = make_engine(clock, fake)
        seen: list[bool] = []
        engine.onAvailability(seen.append)
        engine.startService()
        clock.advance(0)
        fake.down = True
        failure = self.failureResultOf(
            Deferred.fromCoroutine(engine.call(lambda client: client.api.ping(), what="pinging"))
        )
        self.assertIsInstance(failure.value, EngineError)
        self.assertIn(f"pinging failed: Docker engine at {ADDR} is unreachable", failure.value.error_message)
        self.assertFalse(engine.available)
        self.assertEqual(seen, [True, False])
        fake.down = False
        clock.advance(1)
        self.assertTrue(engine.available)
        self.successResultOf(engine.stopService())

    def test_handler_errors_pass_through(self) -> None:
        """A CommandFailed raised by the thread function reaches the caller unchanged."""
        clock, fake = Clock(), FakeDocker()
        engine = make_engine(clock, fake)
        engine.startService()

        def boom(client: Any) -> None:
            raise CommandFailed("custom", "custom failure")

        failure = self.failureResultOf(Deferred.fromCoroutine(engine.call(boom)))
        self.assertEqual(failure.value.error_code, "custom")
        self.successResultOf(engine.stopService())

    def test_not_running(self) -> None:
        """Calls on a stopped executor fail clearly."""
        engine = make_engine(Clock(), FakeDocker())
        failure = self.failureResultOf(Deferred.fromCoroutine(engine.call(lambda c: 1, what="x")))
        self.assertIn("not running", failure.value.error_message)


class StreamControlTests(SynchronousTestCase):
    """Stream controls close what is attached, now or later."""

    def test_close_then_attach(self) -> None:
        """Attaching after close closes the stream at once and raises StreamClosed."""
        closed: list[str] = []

        class S:
            def close(self) -> None:
                closed.append("x")

        control = StreamControl()
        control.attach(S())
        control.close("stalled")
        self.assertEqual(closed, ["x"])
        self.assertRaises(StreamClosed, control.attach, S())
        self.assertEqual(closed, ["x", "x"])
        self.assertRaises(StreamClosed, control.check)
        self.assertEqual(control.reason, "stalled")


def _snap(**over: Any) -> dict[str, Any]:
    base = {
        "id": "c1",
        "name": "llm-port-x",
        "status": "running",
        "running": True,
        "restarting": False,
        "exit_code": 0,
        "restart_count": 0,
        "health": None,
        "labels": {"io.llmport.host-port": "8000", "io.llmport.container-port": "8000"},
        "ports": {},
        "managed": True,
        "canonical": True,
        "foreign": False,
    }
    base.update(over)
    return base


class ClassifyTests(SynchronousTestCase):
    """The watcher's state machine, fed observations directly."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.events: list[tuple[str, dict[str, Any], str]] = []
        settings = WorkloadSettings(agent_id="n", advertise_host="10.1.1.1")
        self.watcher = HealthWatcher(
            self.clock, make_engine(self.clock, FakeDocker()), settings,
            lambda t, p, s: self.events.append((t, p, s)),
            crash_loop_restarts=3, crash_loop_window=300,
        )

    def kinds(self) -> list[str]:
        return [e[0].rsplit(".", 1)[1] for e in self.events]

    def test_transitions_only(self) -> None:
        """Repeated observations of the same state emit once."""
        self.watcher._apply("r1", _snap())
        self.watcher._apply("r1", _snap())
        self.assertEqual(self.kinds(), ["running"])
        self.assertEqual(self.events[0][1]["endpoint_url"], "http://10.1.1.1:8000")
        self.watcher._apply("r1", _snap(running=False, status="exited", exit_code=1))
        self.watcher._apply("r1", _snap(running=False, status="exited", exit_code=1))
        self.assertEqual(self.kinds(), ["running", "stopped"])

    def test_crash_loop_from_restart_count(self) -> None:
        """Three restarts inside the window is crash_loop; quiet for a window is running again."""
        self.watcher._apply("r1", _snap(restart_count=0))
        for n in (1, 2, 3, 4):
            self.clock.advance(5)
            self.watcher._apply("r1", _snap(restart_count=n, restarting=True, running=True, status="restarting"))
        self.assertEqual(self.kinds().count("crash_loop"), 1)
        self.assertEqual(self.kinds()[-1], "crash_loop")
        self.clock.advance(400)
        self.watcher._apply("r1", _snap(restart_count=4))
        self.assertEqual(self.kinds()[-1], "running")

    def test_first_sight_crash_loop(self) -> None:
        """A container first seen restarting with a high restart count is a crash loop."""
        self.watcher._apply("r1", _snap(restart_count=7, restarting=True, status="restarting"), quiet_first_sight=True)
        self.assertEqual(self.kinds(), ["crash_loop"])

    def test_quiet_first_sight(self) -> None:
        """A sweep records a healthy workload seen for the first time without an event."""
        self.watcher._apply("r1", _snap(), quiet_first_sight=True)
        self.assertEqual(self.events, [])
        self.watcher._apply("r1", _snap(running=False, status="exited", exit_code=137))
        self.assertEqual(self.kinds(), ["stopped"])

    def test_missing_once(self) -> None:
        """A tracked runtime that disappears is missing, once; an unknown one is nothing."""
        self.watcher._apply("r1", _snap())
        self.watcher._apply("r1", None)
        self.watcher._apply("r1", None)
        self.watcher._apply("r2", None)
        self.assertEqual(self.kinds(), ["running", "missing"])
        self.assertEqual(self.events[-1][1], {"runtime_id": "r1", "container_name": "llm-port-x"})
        self.assertEqual(self.events[-1][2], "error")

    def test_unhealthy(self) -> None:
        """A failing Docker health check is unhealthy; recovery is running."""
        self.watcher._apply("r1", _snap(health="unhealthy"))
        self.watcher._apply("r1", _snap(health="healthy"))
        self.assertEqual(self.kinds(), ["unhealthy", "running"])
        self.assertEqual(self.events[0][1], {"runtime_id": "r1", "container_name": "llm-port-x", "health_status": "unhealthy"})


class UnreachableEngineTests(TestCase):
    """A real executor pointed at a socket that does not exist."""

    timeout = 30

    async def test_unreachable(self) -> None:
        """The executor reports the address and cause; calls fail with runtime_error; stop is clean."""
        address = "unix:///tmp/llmport-no-such-dir/docker.sock"
        engine = DockerEngine(reactor, environ={"DOCKER_HOST": address}, call_timeout=2)
        engine.startService()
        self.addCleanup(engine.stopService)
        for _ in range(100):
            if engine.last_error != "not checked yet":
                break
            await deferLater(reactor, 0.05, lambda: None)
        self.assertFalse(engine.available)
        self.assertIn(address, engine.last_error)
        self.assertFalse(engine.facts()["docker_available"])
        self.assertEqual(engine.facts()["docker_address"], address)
        with self.assertRaises(EngineError) as cm:
            await engine.call(lambda client: client.api.ping(), what="listing containers")
        self.assertEqual(cm.exception.error_code, RUNTIME_ERROR)
        self.assertIn(f"listing containers failed: Docker engine at {address} is unreachable", cm.exception.error_message)
