"""Tests for L{llmport_agent.logs.containers}: workload logs shipped to Loki."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Mapping
from typing import Any, cast

import docker.errors
import requests
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, LogEvent, Logger, LogLevel
from twisted.trial.unittest import SynchronousTestCase, TestCase
from zope.interface import implementer

from llmport_agent.logs.containers import (
    NEW_CONTAINER_TAIL,
    STATE_FILE,
    ContainerLogSource,
    parse_log_output,
    parse_timestamp,
)
from llmport_agent.logs.loki import ILogSink
from llmport_agent.workloads.engine import translate_error
from llmport_agent.workloads.spec import LABEL_MANAGED, LABEL_RUNTIME_ID, MANAGED_VALUE

BASE_NS = 1_700_000_000 * 1_000_000_000  # 2023-11-14T22:13:20Z
HOST = "192.0.2.7"


def rfc3339nano(ns: int) -> str:
    """Docker's timestamp format: RFC3339 with up to 9 fraction digits, trailing zeros trimmed."""
    seconds, nanos = divmod(ns, 1_000_000_000)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    frac = f"{nanos:09d}".rstrip("0")
    return f"{text}.{frac}Z" if frac else f"{text}Z"


class FakeAPI:
    """The low-level docker-py calls the source makes, answering like the engine does."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, Any]] = {}
        self.output: dict[str, list[tuple[int, str]]] = {}
        self.raw_extra: dict[str, bytes] = {}
        self.log_calls: list[dict[str, Any]] = []
        self.list_calls = 0
        self.list_error: Exception | None = None

    def add(self, cid: str, name: str, runtime_id: str, state: str = "running") -> None:
        self.rows[cid] = {
            "Id": cid,
            "Names": [f"/{name}"],
            "State": state,
            "Status": "Up 1 second" if state == "running" else "Exited (0) 1 second ago",
            "Labels": {LABEL_MANAGED: MANAGED_VALUE, LABEL_RUNTIME_ID: runtime_id},
        }
        self.output.setdefault(cid, [])

    def say(self, cid: str, ns: int, text: str) -> None:
        self.output[cid].append((ns, text))

    def containers(self, all: bool = False, filters: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        self.list_calls += 1
        if self.list_error is not None:
            raise self.list_error
        assert filters == {"label": f"{LABEL_MANAGED}={MANAGED_VALUE}"}
        return [dict(row) for row in self.rows.values()]

    def logs(
        self,
        container: str,
        stdout: bool = True,
        stderr: bool = True,
        stream: bool = False,
        timestamps: bool = False,
        tail: Any = "all",
        since: Any = None,
        follow: Any = None,
        until: Any = None,
    ) -> bytes:
        self.log_calls.append(
            {"id": container, "stdout": stdout, "stderr": stderr, "timestamps": timestamps,
             "tail": tail, "since": since}
        )
        if container not in self.output or container not in self.rows:
            response = requests.Response()
            response.status_code = 404
            raise docker.errors.NotFound("No such container", response=response,
                                         explanation=f"No such container: {container}")
        if since is not None:
            assert isinstance(since, (int, float)) and since > 0, since
        lines = self.output[container]
        if isinstance(tail, int):
            lines = lines[-tail:] if tail else []
        if since is not None:
            lines = [(ns, t) for ns, t in lines if ns >= int(since * 1_000_000_000)]
        body = b"".join(f"{rfc3339nano(ns)} {t}\n".encode() for ns, t in lines)
        return body + self.raw_extra.pop(container, b"")


class FakeClient:
    """A docker-py client stand-in exposing C{api}."""

    def __init__(self) -> None:
        self.api = FakeAPI()


class FakeEngine:
    """Runs C{fn(client, *args)} synchronously; docker errors become EngineErrors as for real."""

    def __init__(self, client: FakeClient) -> None:
        self.client = client
        self.available = True
        self.calls: list[str | None] = []
        self.hold: list[Deferred[Any]] | None = None
        self.cancelled = 0

    def call(self, fn: Any, *args: Any, what: str | None = None) -> Deferred[Any]:
        self.calls.append(what)
        if self.hold is not None:
            d: Deferred[Any] = Deferred(lambda _: setattr(self, "cancelled", self.cancelled + 1))
            self.hold.append(d)
            return d
        try:
            return succeed(fn(self.client, *args))
        except Exception as e:
            return fail(translate_error(what or "call", "unix:///fake.sock", e, 60.0))


@implementer(ILogSink)
class RecordingSink:
    """An ILogSink that records pushes; C{delivered} caps C{delivered_through}."""

    def __init__(self) -> None:
        self.pushed: list[tuple[dict[str, str], int, str]] = []
        self.level = 0.0
        self.seq = 0
        self.delivered: int | None = None

    def push(self, labels: Mapping[str, str], ts_ns: int, line: str) -> int:
        self.seq += 1
        self.pushed.append((dict(labels), ts_ns, line))
        return self.seq

    def pressure(self) -> float:
        return self.level

    def delivered_through(self) -> int:
        return self.seq if self.delivered is None else self.delivered

    def flush(self, timeout: float) -> Deferred[bool]:
        return succeed(self.delivered_through() >= self.seq)

    def lines(self) -> list[str]:
        return [line for _, _, line in self.pushed]


class TimestampTests(SynchronousTestCase):
    """Docker's RFC3339Nano prefixes become Unix nanoseconds."""

    def test_formats(self) -> None:
        """Full, trimmed and absent fractions, Z and numeric offsets all parse; junk does not."""
        self.assertEqual(parse_timestamp(b"2023-11-14T22:13:20.123456789Z hi"), (BASE_NS + 123456789, 31))
        self.assertEqual(parse_timestamp(b"2023-11-14T22:13:20.5Z x")[0], BASE_NS + 500_000_000)  # type: ignore[index]
        self.assertEqual(parse_timestamp(b"2023-11-14T22:13:20Z x"), (BASE_NS, 21))
        self.assertEqual(parse_timestamp(b"2023-11-15T00:13:20+02:00 x")[0], BASE_NS)  # type: ignore[index]
        self.assertEqual(parse_timestamp(b"2023-11-14T22:13:20Z"), (BASE_NS, 20))
        self.assertIsNone(parse_timestamp(b"hello world"))
        self.assertIsNone(parse_timestamp(b"2023-13-14T22:13:20Z x"))
        self.assertIsNone(parse_timestamp(b""))

    def test_output_parsing(self) -> None:
        """Lines after the floor are kept, CR endings and bad UTF-8 handled, unstamped lines follow."""
        raw = (
            f"{rfc3339nano(BASE_NS)} old\n"
            f"{rfc3339nano(BASE_NS + 5)} new\r\n"
            "continuation without stamp\n"
            f"{rfc3339nano(BASE_NS + 9)} bad \xff\n"
        ).encode("latin-1")
        out = parse_log_output(b"no stamp first\n" + raw, BASE_NS, lambda s: s.upper())
        self.assertEqual(
            out.lines,
            [(BASE_NS + 5, "NEW"), (BASE_NS + 5, "CONTINUATION WITHOUT STAMP"), (BASE_NS + 9, "BAD \ufffd")],
        )
        self.assertEqual((out.returned, out.duplicates, out.unparsed), (5, 1, 2))


class SourceTests(SynchronousTestCase):
    """ContainerLogSource with a Clock, a synchronous fake engine and a recording sink."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.client = FakeClient()
        self.api = self.client.api
        self.engine = FakeEngine(self.client)
        self.sink = RecordingSink()
        self.state_dir = self.mktemp()
        os.makedirs(self.state_dir)
        self.events: list[LogEvent] = []
        self.secret = "s3cr3t-enrollment-token"

    def source(self, **kw: Any) -> ContainerLogSource:
        kw.setdefault("state_dir", self.state_dir)
        src = ContainerLogSource(
            self.clock, self.engine, self.sink, lambda: HOST, interval=5.0,
            secrets=lambda: [self.secret, None], **kw,
        )
        src.log = Logger(namespace="test", observer=cast(ILogObserver, self.events.append))
        return src

    def run_source(self, **kw: Any) -> ContainerLogSource:
        src = self.source(**kw)
        src.startService()
        self.addCleanup(self.stop, src)
        return src

    def stop(self, src: ContainerLogSource) -> None:
        if src.running:
            self.successResultOf(src.stopService())

    def state(self) -> dict[str, Any]:
        with open(os.path.join(self.state_dir, STATE_FILE)) as f:
            return dict(json.load(f))

    def test_labels_and_first_fetch(self) -> None:
        """A new running container is read from its start (tail capped) and shipped with its labels."""
        self.api.add("c1", "llm-a", "rt-1")
        self.api.say("c1", BASE_NS + 1, "hello")
        self.api.say("c1", BASE_NS + 2, "world")
        self.api.add("c2", "stopped-one", "rt-2", state="exited")
        self.api.say("c2", BASE_NS + 1, "never")
        self.run_source()
        self.assertEqual(
            self.sink.pushed,
            [
                ({"job": "node-container", "host": HOST, "container": "llm-a", "runtime_id": "rt-1"},
                 BASE_NS + 1, "hello"),
                ({"job": "node-container", "host": HOST, "container": "llm-a", "runtime_id": "rt-1"},
                 BASE_NS + 2, "world"),
            ],
        )
        self.assertEqual(
            self.api.log_calls,
            [{"id": "c1", "stdout": True, "stderr": True, "timestamps": True,
              "tail": NEW_CONTAINER_TAIL, "since": None}],
        )

    def test_dedupe_across_polls_with_since(self) -> None:
        """Later polls ask since the last shipped second and ship only lines after the last shipped ns."""
        self.api.add("c1", "llm-a", "rt-1")
        self.api.say("c1", BASE_NS + 100, "one")
        src = self.run_source(max_lines_per_poll=50)
        self.api.say("c1", BASE_NS + 200, "two")
        self.api.say("c1", BASE_NS + 1_000_000_300, "three")
        self.clock.advance(5)
        self.assertEqual(self.sink.lines(), ["one", "two", "three"])
        self.assertEqual(self.api.log_calls[-1]["since"], float(BASE_NS // 1_000_000_000))
        self.assertEqual(self.api.log_calls[-1]["tail"], 50)
        self.clock.advance(5)
        self.assertEqual(self.sink.lines(), ["one", "two", "three"])
        self.assertEqual(self.api.log_calls[-1]["since"], float(BASE_NS // 1_000_000_000 + 1))
        self.assertEqual(src.describe()["lines_shipped"], 3)
        self.assertEqual(src.describe()["lines_duplicate"], 2)  # "one" once, "three" once

    def test_redaction(self) -> None:
        """Configured secrets and secret-shaped values never reach the sink."""
        self.api.add("c1", "llm-a", "rt-1")
        self.api.say("c1", BASE_NS + 1, f"token is {self.secret} ok")
        self.api.say("c1", BASE_NS + 2, "db password=hunter22 url=http://u:pw123@h/")
        self.run_source()
        text = "\n".join(self.sink.lines())
        self.assertNotIn(self.secret, text)
        self.assertNotIn("hunter22", text)
        self.assertNotIn("pw123", text)
        self.assertIn("token is *** ok", text)

    def test_skip_while_unavailable(self) -> None:
        """No engine call while the engine is unavailable; the next poll after it returns ships."""
        self.api.add("c1", "llm-a", "rt-1")
        self.api.say("c1", BASE_NS + 1, "hello")
        self.engine.available = False
        src = self.run_source()
        self.clock.advance(5)
        self.assertEqual(self.engine.calls, [])
        self.assertEqual(src.describe()["skipped_unavailable"], 2)
        self.engine.available = True
        self.clock.advance(5)
        self.assertEqual(self.sink.lines(), ["hello"])

    def test_skip_under_pressure(self) -> None:
        """While the sink's queue is nearly full nothing is fetched; lines come once it drains."""
        self.api.add("c1", "llm-a", "rt-1")
        self.api.say("c1", BASE_NS + 1, "hello")
        self.sink.level = 0.9
        src = self.run_source()
        self.assertEqual((self.engine.calls, self.sink.pushed), ([], []))
        self.assertEqual(src.describe()["skipped_pressure"], 1)
        self.sink.level = 0.1
        self.clock.advance(5)
        self.assertEqual(self.sink.lines(), ["hello"])

    def test_restart_resumes_from_persisted_position(self) -> None:
        """A new source with the same state dir neither repeats delivered lines nor loses new ones."""
        self.api.add("c1", "llm-a", "rt-1")
        self.api.say("c1", BASE_NS + 1_500_000_000, "one")
        first = self.run_source()
        self.stop(first)
        self.assertEqual(self.state()["containers"], {"c1": {"ns": BASE_NS + 1_500_000_000, "name": "llm-a"}})
        self.api.say("c1", BASE_NS + 1_600_000_000, "two")
        self.run_source()
        self.assertEqual(self.sink.lines(), ["one", "two"])
        self.assertEqual(self.api.log_calls[-1]["since"], float(BASE_NS // 1_000_000_000 + 1))

    def test_saved_position_follows_delivery(self) -> None:
        """Lines the sink has not delivered are not counted as shipped in the state file."""
        self.api.add("c1", "llm-a", "rt-1")
        self.api.say("c1", BASE_NS + 1, "one")
        first = self.run_source()
        self.sink.delivered = self.sink.seq  # "one" delivered
        self.api.say("c1", BASE_NS + 2, "two")
        self.clock.advance(5)  # "two" queued, not delivered
        self.stop(first)
        self.assertEqual(self.state()["containers"]["c1"]["ns"], BASE_NS + 1)
        self.sink.delivered = None
        self.run_source()
        self.assertEqual(self.sink.lines(), ["one", "two", "two"])  # re-sent; Loki stores it once

    def test_throttled_saves(self) -> None:
        """The state file is written at most once per save_interval while polling, and at stop."""
        self.api.add("c1", "llm-a", "rt-1")
        self.api.say("c1", BASE_NS + 1, "one")
        src = self.run_source(save_interval=30.0)
        self.assertEqual(src.describe()["state_saves"], 1)
        self.api.say("c1", BASE_NS + 2, "two")
        self.clock.advance(5)
        self.assertEqual(src.describe()["state_saves"], 1)
        self.assertEqual(self.state()["containers"]["c1"]["ns"], BASE_NS + 1)
        self.stop(src)
        self.assertEqual(self.state()["containers"]["c1"]["ns"], BASE_NS + 2)

    def test_bad_state_file_ignored(self) -> None:
        """An unreadable state file is logged once (naming the field) and the source starts fresh."""
        with open(os.path.join(self.state_dir, STATE_FILE), "w") as f:
            json.dump({"version": 1, "containers": {"c1": {"ns": "x"}}}, f)
        self.api.add("c1", "llm-a", "rt-1")
        self.api.say("c1", BASE_NS + 1, "one")
        self.run_source()
        self.assertEqual(self.sink.lines(), ["one"])
        warnings = [e for e in self.events if e["log_level"] == LogLevel.warn]
        self.assertEqual(len(warnings), 1)
        self.assertIn("containers.c1.ns", warnings[0]["error"])

    def test_disappearing_container_forgotten(self) -> None:
        """A container gone from the list is dropped from memory and from the state file."""
        self.api.add("c1", "llm-a", "rt-1")
        self.api.add("c2", "llm-b", "rt-2")
        self.api.say("c1", BASE_NS + 1, "a")
        self.api.say("c2", BASE_NS + 1, "b")
        src = self.run_source(save_interval=0.0)
        self.assertEqual(set(self.state()["containers"]), {"c1", "c2"})
        del self.api.rows["c2"]
        self.clock.advance(5)
        self.assertEqual(src.describe()["containers"], 1)
        self.assertEqual(src.describe()["containers_forgotten"], 1)
        self.assertEqual(set(self.state()["containers"]), {"c1"})
        self.assertEqual([c["id"] for c in self.api.log_calls[-1:]], ["c1"])

    def test_removed_between_list_and_fetch(self) -> None:
        """A 404 on the logs of a container that just went away is not a failure."""
        self.api.add("c1", "llm-a", "rt-1")
        del self.api.output["c1"]
        src = self.run_source()
        self.assertEqual(src.describe()["polls_failed"], 0)
        self.assertIsNone(src.describe()["last_error"])

    def test_stopped_container_read_once_more(self) -> None:
        """A container that stopped gets one last fetch for its final lines, then is not polled."""
        self.api.add("c1", "llm-a", "rt-1")
        self.api.say("c1", BASE_NS + 1, "start")
        self.run_source()
        self.api.say("c1", BASE_NS + 2, "dying words")
        self.api.rows["c1"]["State"] = "exited"
        self.clock.advance(5)
        self.assertEqual(self.sink.lines(), ["start", "dying words"])
        calls = len(self.api.log_calls)
        self.clock.advance(5)
        self.assertEqual(len(self.api.log_calls), calls)

    def test_failure_logged_once_per_state_change(self) -> None:
        """Engine failures are logged once, the loop keeps going, and recovery is logged once."""
        self.api.add("c1", "llm-a", "rt-1")
        self.api.list_error = requests.exceptions.ConnectionError("refused")
        src = self.run_source()
        self.clock.advance(5)
        self.clock.advance(5)
        self.assertEqual(self.api.list_calls, 3)
        self.assertEqual(src.describe()["polls_failed"], 3)
        self.assertIn("unreachable", src.describe()["last_error"])
        self.assertEqual([e["log_level"] for e in self.events], [LogLevel.warn])
        self.api.list_error = None
        self.api.say("c1", BASE_NS + 1, "back")
        self.clock.advance(5)
        self.clock.advance(5)
        self.assertEqual(self.sink.lines(), ["back"])
        self.assertEqual([e["log_level"] for e in self.events], [LogLevel.warn, LogLevel.info])
        self.assertIsNone(src.describe()["last_error"])

    def test_iterations_never_overlap_and_stop_cancels(self) -> None:
        """A hung engine call holds the loop: no second list call; stopping cancels and finishes."""
        self.engine.hold = []
        src = self.source(state_dir=None)
        src.startService()
        self.clock.advance(5)
        self.clock.advance(5)
        self.assertEqual(len(self.engine.hold), 1)
        d = src.stopService()
        self.successResultOf(d)
        self.assertEqual(self.engine.cancelled, 1)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_invalid_arguments(self) -> None:
        """Nonsensical settings are refused at construction with the parameter named."""
        with self.assertRaisesRegex(ValueError, "interval"):
            ContainerLogSource(self.clock, self.engine, self.sink, lambda: HOST, interval=0)
        with self.assertRaisesRegex(ValueError, "max_lines_per_poll"):
            ContainerLogSource(self.clock, self.engine, self.sink, lambda: HOST, max_lines_per_poll=0)


class _WaitingSink(RecordingSink):
    """A recording sink that fires a Deferred once a line containing a text arrives."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.arrived: Deferred[None] = Deferred()

    def push(self, labels: Mapping[str, str], ts_ns: int, line: str) -> int:
        seq = super().push(labels, ts_ns, line)
        if self.text in line and not self.arrived.called:
            self.arrived.callback(None)
        return seq


class RealEngineTests(TestCase):
    """One end-to-end run against the real test Docker engine."""

    timeout = 120

    async def test_ships_real_container_logs(self) -> None:
        """A managed busybox container's output reaches the sink with its labels, secrets masked."""
        from twisted.internet import reactor

        from llmport_agent.workloads.engine import DockerEngine
        from tests.support.docker_env import BUSYBOX, require_docker

        env = require_docker()
        runtime_id = str(uuid.uuid4())
        name = f"clogs-{runtime_id[:8]}"
        container = env.client().containers.run(
            BUSYBOX,
            ["sh", "-c", "echo hello; echo password=hunter22; echo done; sleep 60"],
            name=name,
            labels={LABEL_MANAGED: MANAGED_VALUE, LABEL_RUNTIME_ID: runtime_id},
            network_mode="none",
            detach=True,
        )
        self.addCleanup(container.remove, force=True)
        engine = DockerEngine(reactor, environ={"DOCKER_HOST": env.host})
        engine.startService()
        self.addCleanup(engine.stopService)
        await engine.whenAvailable()
        sink = _WaitingSink("done")
        source = ContainerLogSource(reactor, engine, sink, lambda: HOST, interval=0.2,
                                    state_dir=self.mktemp())
        source.startService()
        self.addCleanup(lambda: source.stopService() if source.running else None)
        arrived = sink.arrived
        arrived.addTimeout(60, reactor)
        await arrived
        await source.stopService()
        mine = [(labels, line) for labels, _, line in sink.pushed if labels["container"] == name]
        self.assertEqual([line for _, line in mine], ["hello", "password=***", "done"])
        self.assertEqual(
            mine[0][0],
            {"job": "node-container", "host": HOST, "container": name, "runtime_id": runtime_id},
        )
