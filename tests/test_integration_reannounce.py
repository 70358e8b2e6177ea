"""
Integration (issue 18 point 3): after a reconnect, runtimes the backend demoted to C{error} when
the node's stream dropped return to their true state within 10 s of the reconnect, also with a
backlog of events queued while the node was away (they go first, in order).
"""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor

from tests.support.rig import httpd_payload
from tests.test_integration_workloads import Missing, _WorkloadBase

#: Protocol claim (issue 18): a demoted runtime is back within this long of the reconnect.
BACK_WITHIN_SEC = 10.0


class ReannounceTests(_WorkloadBase):
    async def _running_workload(self) -> tuple[Any, Any, str, str]:
        backend, agent, node_id = await self.setup_agent()
        payload = httpd_payload()
        rid = payload["runtime_id"]
        self.addCleanup(self._remove, backend, node_id, payload)
        deploy = backend.issue_command(node_id, "deploy_workload", payload)
        rec = await self.done(backend, deploy["id"])
        self.assertEqual(rec["status"], "succeeded", rec.get("error_message"))
        await backend.wait_for(lambda: (backend.runtime(rid) or {}).get("status") == "running")
        await backend.wait_for(lambda: (agent.journal.get(deploy["id"]) or Missing).state == "delivered", 10)
        await backend.wait_for(lambda: not agent.health._timers and not agent.health._busy, 10)
        await backend.wait_for(lambda: agent.outbox.depth == 0, 10)
        return backend, agent, node_id, rid

    async def _measure(self, backend: Any, agent: Any, node_id: str, rid: str) -> float:
        opens = agent.session.stats.opens
        backend.drop_connections(node_id)
        await backend.wait_for(lambda: (backend.runtime(rid) or {}).get("status") == "error", 10)
        await backend.wait_for(lambda: agent.session.stats.opens > opens, 20)
        reconnected = reactor.seconds()
        await backend.wait_for(lambda: (backend.runtime(rid) or {}).get("status") == "running", 30)
        return reactor.seconds() - reconnected

    async def test_back_within_10_s_of_the_reconnect(self) -> None:
        """The stream drops, the backend marks the runtime error; the reconnect's announcement brings it back in time."""
        backend, agent, node_id, rid = await self._running_workload()
        took = await self._measure(backend, agent, node_id, rid)
        self.assertLess(took, BACK_WITHIN_SEC)

    async def test_back_in_time_behind_a_backlog_of_events(self) -> None:
        """5000 events queued while the node was away go first, and the runtime is still back in time."""
        backend, agent, node_id, rid = await self._running_workload()
        backend.drop_connections(node_id)
        await backend.wait_for(lambda: not agent.session.connected, 10)
        for i in range(5000):
            agent.outbox.emit("test.backlog", {"n": i})
        took = await self._measure_after_drop(backend, agent, node_id, rid)
        self.assertLess(took, BACK_WITHIN_SEC)
        self.assertEqual(agent.outbox.depth, 0)

    async def _measure_after_drop(self, backend: Any, agent: Any, node_id: str, rid: str) -> float:
        await backend.wait_for(lambda: (backend.runtime(rid) or {}).get("status") == "error", 10)
        await backend.wait_for(lambda: agent.session.connected, 20)
        reconnected = reactor.seconds()
        await backend.wait_for(lambda: (backend.runtime(rid) or {}).get("status") == "running", 30)
        took = reactor.seconds() - reconnected
        await backend.wait_for(lambda: agent.outbox.depth == 0, 30)
        return took
