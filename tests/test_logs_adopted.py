"""
The original agent's adopted containers (no labels of their own) ship their logs like the
agent's own: found by the list and by their events (the event stream takes every container's
events while there are adopted ones, and is reopened when that changes), labelled with the
runtime id the adoption recorded and the container's name; their shipping stops when a
labelled container replaces them or they are removed. An unlabelled container that was not
adopted (an `llm-port-` name is not enough) is never read. Also: the health watcher's events
and the engine diagnostics include the adopted containers.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.logs.containers import ContainerLogSource
from llmport_agent.workloads.engine import StreamClosed
from tests import test_logs_containers as base
from tests.test_logs_containers import HOST, FakeEngine


class FakeAdoption:
    """The part of L{llmport_agent.workloads.adoption.Adoption} the readers use."""

    def __init__(self, by_container: dict[str, str] | None = None) -> None:
        self.by_container = dict(by_container or {})
        self.listeners: list[Callable[[], None]] = []

    def snapshot(self) -> dict[str, str]:
        return dict(self.by_container)

    def runtime_of(self, container_id: str) -> str | None:
        return self.by_container.get(container_id)

    def subscribe(self, listener: Callable[[], None]) -> None:
        self.listeners.append(listener)

    def change(self, by_container: dict[str, str]) -> None:
        self.by_container = dict(by_container)
        for listener in self.listeners:
            listener()


def add_unlabelled(engine: FakeEngine, name: str, state: str = "running") -> str:
    """A container as the original agent creates it: its name, no labels."""
    cid = uuid.uuid4().hex * 2
    engine.api.rows.append({"Id": cid, "Names": [f"/{name}"], "State": state, "Status": "",
                            "Created": 1_700_000_000, "Labels": {}})
    return cid


class AdoptedLogsTests(SynchronousTestCase):
    """L{ContainerLogSource} with the fakes of L{base.SchedulerTests}."""

    make = base.SchedulerTests.make
    stop = base.SchedulerTests.stop
    lines_for = base.SchedulerTests.lines_for

    def make_adopted(self, **kw: Any) -> tuple[ContainerLogSource, str, str]:
        self.engine = FakeEngine()
        adopted = add_unlabelled(self.engine, "llm-port-chat")
        own = self.engine.add("web")
        self.adoption = FakeAdoption({adopted: "rt-orig-1"})
        return self.make(adoption=self.adoption, **kw), adopted, own

    def test_an_adopted_container_is_shipped_with_the_runtime_labels(self) -> None:
        _, adopted, own = self.make_adopted()
        self.assertEqual(sorted(a[2] for a, _ in self.streams.follows()), sorted([adopted, own]))
        self.lines_for(adopted, (1_700_000_000_000_000_000, "from the original's runtime"))
        self.assertEqual(self.sink.pushed[0][0], {"job": "node-container", "host": HOST,
                                                  "container": "llm-port-chat", "runtime_id": "rt-orig-1"})
        self.assertEqual(self.sink.lines(), ["from the original's runtime"])

    def test_the_event_stream_takes_every_containers_events_while_some_are_adopted(self) -> None:
        self.make_adopted()
        (args, _), = self.streams.events()
        self.assertFalse(args[4])  # labelled_only: no, adopted ones carry no label

    def test_without_adopted_containers_only_labelled_events_then_reopened(self) -> None:
        self.engine = FakeEngine()
        adoption = FakeAdoption()
        source = self.make(adoption=adoption)
        (args, first), = self.streams.events()
        self.assertTrue(args[4])
        adopted = add_unlabelled(self.engine, "llm-port-late")
        adoption.change({adopted: "rt-late"})  # the adoption pass ended after the reader started
        self.assertTrue(args[0].closed)
        first.errback(Failure(StreamClosed("the adopted containers changed")))
        (args2, _), = self.streams.events()
        self.assertFalse(args2[4])
        self.assertIs(source._events, args2[0])  # the old one's end did not forget the new one
        self.assertIsNotNone(source._events_d)
        self.assertEqual([a[2] for a, _ in self.streams.follows()], [adopted])

    def test_a_start_event_of_an_adopted_container_opens_its_stream(self) -> None:
        self.engine = FakeEngine()
        cid = uuid.uuid4().hex * 2
        self.make(adoption=FakeAdoption({cid: "rt-ev"}))
        (args, _), = self.streams.events()
        args[2]({"Action": "start", "id": cid, "Actor": {"ID": cid, "Attributes": {"name": "llm-port-ev"}}})
        self.lines_for(cid, (1_700_000_000_000_000_000, "after a restart"))
        self.assertEqual(self.sink.pushed[0][0]["runtime_id"], "rt-ev")
        self.assertEqual(self.sink.pushed[0][0]["container"], "llm-port-ev")

    def test_an_unadopted_unlabelled_container_is_never_read(self) -> None:
        """A name like the original's is not ownership: only what the adoption recorded."""
        _, adopted, own = self.make_adopted()
        stranger = add_unlabelled(self.engine, "llm-port-stranger")
        (args, _), = self.streams.events()
        args[2]({"Action": "start", "id": stranger,
                 "Actor": {"ID": stranger, "Attributes": {"name": "llm-port-stranger"}}})
        self.clock.advance(60)  # and the periodic list
        self.assertEqual(sorted(a[2] for a, _ in self.streams.follows()), sorted([adopted, own]))

    def test_replaced_by_a_labelled_container_its_shipping_stops(self) -> None:
        source, adopted, own = self.make_adopted()
        args, stream_d = self.streams.follow_of(adopted)
        control = args[0]
        self.adoption.change({})  # Adoption.deployed(): a labelled container replaced it
        self.assertTrue(control.closed)
        stream_d.errback(Failure(StreamClosed("container removed")))
        self.assertNotIn(adopted, source._tracked)
        self.assertEqual([a[2] for a, _ in self.streams.follows()], [own])
        self.clock.advance(120)
        self.assertEqual([a[2] for a, _ in self.streams.follows()], [own])  # not opened again

    def test_a_destroyed_adopted_container_is_forgotten(self) -> None:
        source, adopted, _ = self.make_adopted()
        (args, _), = self.streams.events()
        args[2]({"Action": "destroy", "id": adopted, "Actor": {"ID": adopted, "Attributes": {}}})
        self.assertNotIn(adopted, source._tracked)


class HealthEventsTests(SynchronousTestCase):
    """The health watcher: an adopted container's event is checked like a labelled one's."""

    def watcher(self, adoption: FakeAdoption) -> Any:
        from twisted.internet.task import Clock

        from llmport_agent.workloads.health import HealthWatcher

        class Engine:
            available = False

            def onAvailability(self, listener: Any) -> None:
                pass

        w = HealthWatcher(Clock(), Engine(), type("S", (), {"agent_id": "node-a"})(),  # type: ignore[arg-type]
                          lambda *a: None, adoption=adoption)
        scheduled: list[str] = []
        w._schedule = scheduled.append  # type: ignore[method-assign]
        return w, scheduled

    def test_an_adopted_containers_event_is_scheduled(self) -> None:
        cid = uuid.uuid4().hex * 2
        w, scheduled = self.watcher(FakeAdoption({cid: "rt-a"}))
        w._onEvent({"Action": "die", "id": cid, "Actor": {"ID": cid, "Attributes": {"name": "llm-port-a"}}})
        other = uuid.uuid4().hex * 2
        w._onEvent({"Action": "die", "id": other, "Actor": {"ID": other, "Attributes": {"name": "llm-port-b"}}})
        self.assertEqual(scheduled, ["rt-a"])


class HealthStreamTests(SynchronousTestCase):
    """The health watcher's event stream: labelled only until containers are adopted, then every container's."""

    def test_the_stream_is_reopened_for_every_container_when_some_are_adopted(self) -> None:
        from twisted.internet.defer import Deferred, succeed
        from twisted.internet.task import Clock

        from llmport_agent.workloads.health import HealthWatcher

        streams: list[tuple[Any, tuple[Any, ...], Deferred[Any]]] = []

        class Engine:
            available = True

            def onAvailability(self, listener: Any) -> None:
                pass

            def call(self, fn: Any, *args: Any, what: str | None = None) -> Deferred[Any]:
                return succeed([])

            async def stream(self, fn: Any, control: Any, *args: Any, what: str | None = None) -> Any:
                d: Deferred[Any] = Deferred()
                streams.append((control, args, d))
                return await d

        adoption = FakeAdoption()
        w = HealthWatcher(Clock(), Engine(), type("S", (), {"agent_id": "node-a"})(),  # type: ignore[arg-type]
                          lambda *a: None, adoption=adoption)
        w.startService()
        self.addCleanup(w.stopService)
        (control, args, d), = streams
        self.assertTrue(args[3])  # labelled_only
        adoption.change({uuid.uuid4().hex * 2: "rt-a"})
        self.assertTrue(control.closed)
        d.errback(Failure(StreamClosed("the adopted containers changed")))  # the old thread ends
        self.assertEqual(len(streams), 2)
        control2, args2, _ = streams[1]
        self.assertFalse(args2[3])
        self.assertFalse(control2.closed)
        self.assertIs(w._control, control2)
        self.assertIsNotNone(w._stream_task)  # the old one's end did not forget the new one


class DiagnosticsTests(SynchronousTestCase):
    def test_adopted_containers_are_listed_with_their_runtime(self) -> None:
        from llmport_agent.workloads import diagnostics

        cid = uuid.uuid4().hex * 2

        class API:
            def version(self) -> dict[str, Any]:
                return {"Version": "20.10"}

            def info(self) -> dict[str, Any]:
                return {}

            def containers(self, all: bool = False, filters: Any = None) -> list[dict[str, Any]]:
                return [{"Id": cid, "Names": ["/llm-port-chat"], "State": "running", "Labels": {}}]

            def inspect_container(self, ref: str) -> dict[str, Any]:
                return {"Id": cid, "Name": "/llm-port-chat", "Config": {"Image": "busybox", "Labels": None},
                        "State": {"Status": "running", "Running": True}, "HostConfig": {}, "Image": "sha256:1",
                        "RestartCount": 0}

            def inspect_image(self, ref: str) -> dict[str, Any]:
                return {}

        client = type("C", (), {"api": API()})()
        self.assertEqual(diagnostics._collect(client, "node-a")["managed_containers"], [])  # type: ignore[arg-type]
        (row,) = diagnostics._collect(client, "node-a", {cid: "rt-orig"})["managed_containers"]  # type: ignore[arg-type]
        self.assertEqual((row["runtime_id"], row["name"], row["adopted"]), ("rt-orig", "llm-port-chat", True))
