"""
Containers the agent does not manage: a database next to the workloads, another agent's
workloads on a shared host, a container someone labelled to look like ours. Every workload
command acts only on containers that carry this agent's labels (C{io.llmport.managed} and
C{io.llmport.agent-id}); names are matched exactly, never as id prefixes; a foreign container
is answered like a missing one and is never stopped, removed, started or read.

All on the real engine.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.base import CONTAINER_NOT_OWNED, RUNTIME_ERROR
from llmport_agent.workloads.spec import (
    LABEL_AGENT_ID,
    LABEL_MANAGED,
    LABEL_NAME,
    LABEL_RUNTIME_ID,
    MANAGED_VALUE,
)
from tests.support.docker_env import BUSYBOX
from tests.support.rig import WorkloadTestBase, httpd_payload, ids_of

SECRET = "PASSWORD=hunter2-" + uuid.uuid4().hex[:8]


class _ForeignBase(WorkloadTestBase):
    timeout = 120

    def foreign(self, *, labels: dict[str, str] | None = None, start: bool = True, name: str | None = None) -> Any:
        """A container this agent does not manage, printing a secret."""
        name = name or f"db-{uuid.uuid4().hex[:8]}"
        container = self.env.client().containers.create(
            BUSYBOX, ["sh", "-c", f"echo {SECRET}; exec sleep 600"], name=name,
            network_mode="none", labels=labels or {},
        )
        if start:
            container.start()
            deadline = time.monotonic() + 10
            while SECRET.encode() not in container.logs() and time.monotonic() < deadline:
                time.sleep(0.05)
        return container

    def lookalike_labels(self, runtime_id: str, name: str, agent_id: str = "another-node") -> dict[str, str]:
        """Everything an llmport container carries, but another agent's id."""
        return {LABEL_MANAGED: MANAGED_VALUE, LABEL_RUNTIME_ID: runtime_id, LABEL_AGENT_ID: agent_id,
                LABEL_NAME: name}

    def state(self, container: Any) -> tuple[str, str]:
        container.reload()
        return container.id, container.status

    async def logs(self, runtime_id: str, name: str) -> dict[str, Any]:
        _, result = await self.rig.run(
            "fetch_container_logs", {"runtime_id": runtime_id, "runtime_name": "x", "container_name": name, "tail": 50}
        )
        return result

    def assertNoLogs(self, result: dict[str, Any]) -> None:
        self.assertNotIn(SECRET, repr(result))
        self.assertFalse(result["found"])
        self.assertIn("No managed container", result["logs"])


class ForeignContainerTests(_ForeignBase):
    async def test_logs_of_an_unmanaged_container_by_name(self) -> None:
        """fetch_container_logs naming a database container must not return its output."""
        db = self.foreign()
        self.assertNoLogs(await self.logs(str(uuid.uuid4()), db.name))

    async def test_logs_of_an_unmanaged_container_by_id_prefix(self) -> None:
        """A container name that is an id prefix of another container is not that container."""
        db = self.foreign()
        self.assertNoLogs(await self.logs(str(uuid.uuid4()), db.id[:12]))

    async def test_logs_of_another_agents_workload(self) -> None:
        """
        A container labelled as an llmport workload of this runtime, but by another agent (or
        someone forging our labels): not ours, no logs.
        """
        rid = str(uuid.uuid4())
        name = f"llm-port-{uuid.uuid4().hex[:8]}"
        self.foreign(labels=self.lookalike_labels(rid, name), name=name)
        self.assertNoLogs(await self.logs(rid, name))

    async def test_stop_remove_start_leave_a_lookalike_alone(self) -> None:
        """
        stop, remove and start of a runtime whose name and labels a foreign container carries
        (all but this agent's id): each succeeds or fails as for a missing container, and the
        foreign container is neither stopped, removed nor started.
        """
        rid = str(uuid.uuid4())
        name = f"llm-port-{uuid.uuid4().hex[:8]}"
        running = self.foreign(labels=self.lookalike_labels(rid, name), name=name)
        before = self.state(running)
        ids = {"runtime_id": rid, "runtime_name": "x", "container_name": name}
        await self.assertNotOwned(ids, name)
        self.assertEqual(self.state(running), before)

        # A stopped look-alike: start must not start it (the name is taken, so it fails).
        rid2 = str(uuid.uuid4())
        name2 = f"llm-port-{uuid.uuid4().hex[:8]}"
        created = self.foreign(labels=self.lookalike_labels(rid2, name2), name=name2, start=False)
        before2 = self.state(created)
        _, exc = await self.failure("start_workload", httpd_payload(runtime_id=rid2, container_name=name2))
        self.assertEqual(exc.error_code, RUNTIME_ERROR)
        self.assertIn("does not belong", exc.error_message)
        self.assertEqual(self.state(created), before2)
        self.assertEqual(self.state(running), before)

    async def test_plain_foreign_name(self) -> None:
        """An unlabelled container with the runtime's name: stop and remove do not touch it."""
        db = self.foreign()
        before = self.state(db)
        ids = {"runtime_id": str(uuid.uuid4()), "runtime_name": "x", "container_name": db.name}
        await self.assertNotOwned(ids, db.name)
        self.assertEqual(self.state(db), before)

    async def assertNotOwned(self, ids: dict[str, str], name: str) -> None:
        """
        stop and remove of a runtime whose named container runs but is not this agent's fail,
        saying so (issue 21: both answered succeeded, and the backend showed the runtime
        stopped or removed while the container kept serving).
        """
        for command in ("stop_workload", "remove_workload"):
            _, exc = await self.failure(command, ids)
            self.assertEqual(exc.error_code, CONTAINER_NOT_OWNED, command)
            self.assertIn(f"The container {name} on this node is not managed by this agent", exc.error_message)
            self.assertIn("running", exc.error_message)

    async def test_own_workload_still_served(self) -> None:
        """The agent's own workload: logs, stop and remove work; remove again succeeds when it is gone."""
        payload = httpd_payload(script=f"echo own-{SECRET}; " + "mkdir -p /www && echo ok > /www/health && "
                                "exec httpd -f -p $LLAMA_ARG_PORT -h /www")
        await self.rig.run("deploy_workload", payload)
        ids = ids_of(payload)
        _, result = await self.rig.run("fetch_container_logs", dict(ids, tail=50))
        self.assertTrue(result["found"])
        self.assertIn(f"own-{SECRET}", result["logs"])
        _, stopped = await self.rig.run("stop_workload", ids)
        self.assertTrue(stopped["stopped"])
        _, removed = await self.rig.run("remove_workload", ids)
        self.assertEqual(removed["removed"], 1)
        _, again = await self.rig.run("remove_workload", ids)
        self.assertEqual(again["removed"], 0)
        self.assertEqual(self.env.managed_containers(payload["runtime_id"]), [])


class AnotherAgentsContainerTests(_ForeignBase):
    """
    Every place that selects containers checks this agent's id (issue 21: the Loki follow
    streams shipped another agent's containers): the health sweep, the host-port reservation,
    diagnostics, the managed list.
    """

    health = True

    async def test_not_reported_reserved_or_listed(self) -> None:
        from llmport_agent.workloads import containers as ops
        from llmport_agent.workloads.diagnostics import engine_diagnostics
        from llmport_agent.workloads.spec import LABEL_HOST_PORT

        rid = str(uuid.uuid4())
        name = f"llm-port-{uuid.uuid4().hex[:8]}"
        labels = dict(self.lookalike_labels(rid, name), **{LABEL_HOST_PORT: "18123"})
        self.foreign(labels=labels, name=name)
        agent_id = self.rig.settings.agent_id
        rows = await self.rig.engine.call(ops.list_managed, agent_id)
        self.assertNotIn(name, [r["name"] for r in rows])
        diag = await engine_diagnostics(self.rig.engine, agent_id)
        self.assertNotIn(name, [c["name"] for c in diag["managed_containers"]])
        self.assertNotIn(18123, await self.rig.manager._reserved_ports(str(uuid.uuid4())))
        assert self.rig.watcher is not None
        announced = await self.rig.watcher.announce_all()
        self.assertNotIn(rid, [e.get("runtime_id") for e in announced])
        self.assertNotIn(rid, [e["payload"].get("runtime_id") for e in self.rig.health_events])


class BoundedLogReadTests(SynchronousTestCase):
    """
    Logs are read from the engine as a stream with a bound (a container's `tail` can be one
    line of gigabytes on a log driver that does not split lines): at most the newest
    `max_bytes` are held, and reading stops at LOG_READ_CAP.
    """

    def test_an_endless_log_is_read_with_a_bound(self) -> None:
        from llmport_agent.workloads import containers as ops

        consumed = [0]
        closed = []

        class Stream:
            def __iter__(self) -> Any:
                while True:
                    consumed[0] += 1
                    yield b"x" * (1 << 20)

            def close(self) -> None:
                closed.append(True)

        class API:
            def logs(self, ident: str, **kwargs: Any) -> Stream:
                self.kwargs = kwargs
                return Stream()

        client = type("Client", (), {"api": API()})()
        out = ops.read_logs(client, "c", 4096, stdout=True, tail=200)
        self.assertEqual(out, b"x" * 4096)
        self.assertLessEqual(consumed[0], ops.LOG_READ_CAP // (1 << 20) + 1)
        self.assertEqual(closed, [True])
        self.assertEqual(client.api.kwargs["stream"], True)
        self.assertLessEqual(len(ops.logs(client, "c", 200) or b""), ops.RAW_LOGS_MAX)
