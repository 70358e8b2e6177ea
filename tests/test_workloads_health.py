"""
Health transitions on the real engine: killed, crash-looping, missing, unhealthy
(Docker health check), re-announcement after a backend reconnect, holds during commands.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor as _global_reactor
from twisted.internet.defer import ensureDeferred
from twisted.internet.task import deferLater

from llmport_agent.commands.base import CommandFailed
from llmport_agent.workloads import containers as ops
from llmport_agent.workloads.spec import build_spec, render

from .support.rig import WorkloadTestBase, httpd_payload, ids_of

reactor: Any = _global_reactor


class HealthTests(WorkloadTestBase):
    """workload.health.* events, on transitions only."""

    health = True

    async def deployed(self, **kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        payload = httpd_payload(**kw)
        _, result = await self.rig.run("deploy_workload", payload)
        await self.settle()
        return payload, result

    async def settle(self) -> None:
        """Let the watcher's post-command re-read finish."""
        await deferLater(reactor, 0.3, lambda: None)

    def events_for(self, runtime_id: str) -> list[str]:
        return [
            e["event_type"] for e in self.rig.health_events if e["payload"].get("runtime_id") == runtime_id
        ]

    async def test_no_events_for_own_commands(self) -> None:
        """Deploy, stop and start by command produce no health events (the results say it)."""
        payload, _ = await self.deployed()
        await self.rig.run("stop_workload", ids_of(payload))
        await self.rig.run("start_workload", payload)
        await self.settle()
        self.assertEqual(self.events_for(payload["runtime_id"]), [])

    async def test_killed(self) -> None:
        """A container killed outside the agent gives workload.health.stopped with exit code 137."""
        payload, result = await self.deployed()
        self.env.client().containers.get(result["container_id"]).kill()
        event = await self.rig.wait_event("workload.health.stopped", payload["runtime_id"])
        self.assertEqual(
            event["payload"],
            {
                "runtime_id": payload["runtime_id"],
                "container_name": result["container_name"],
                "status": "exited",
                "exit_code": 137,
                "restart_count": 0,
            },
        )
        self.assertEqual(event["severity"], "warning")
        # Started again from outside: running, with the endpoint.
        self.env.client().containers.get(result["container_id"]).start()
        running = await self.rig.wait_event("workload.health.running", payload["runtime_id"])
        self.assertEqual(running["payload"]["endpoint_url"], result["endpoint_url"])
        self.assertEqual(set(running["payload"]), {"runtime_id", "container_name", "endpoint_url", "restart_count"})

    async def test_crash_loop(self) -> None:
        """A managed container that keeps dying is reported as crash_loop from its restart count."""
        payload = httpd_payload(script="sleep 0.2; exit 2")
        spec = build_spec(payload, self.rig.settings, ())
        args = render(spec, host_port=1, command_id="test", agent_id="test-node")
        await self.rig.engine.call(ops.create_and_start, args)
        event = await self.rig.wait_event("workload.health.crash_loop", payload["runtime_id"], timeout=60)
        self.assertGreaterEqual(event["payload"]["restart_count"], 3)
        self.assertEqual(set(event["payload"]), {"runtime_id", "container_name", "restart_count", "status"})
        self.assertEqual(event["severity"], "error")
        await deferLater(reactor, 1.5, lambda: None)
        self.assertEqual(self.events_for(payload["runtime_id"]).count("workload.health.crash_loop"), 1)

    async def test_missing(self) -> None:
        """A container removed outside the agent gives workload.health.missing, once."""
        payload, result = await self.deployed()
        self.env.client().containers.get(result["container_id"]).remove(force=True)
        event = await self.rig.wait_event("workload.health.missing", payload["runtime_id"])
        self.assertEqual(
            event["payload"],
            {"runtime_id": payload["runtime_id"], "container_name": result["container_name"]},
        )
        assert self.rig.watcher is not None
        await self.rig.watcher.reconcile()
        self.assertEqual(self.events_for(payload["runtime_id"]).count("workload.health.missing"), 1)

    async def test_remove_is_not_missing(self) -> None:
        """remove_workload does not produce workload.health.missing."""
        payload, _ = await self.deployed()
        await self.rig.run("remove_workload", ids_of(payload))
        await self.settle()
        assert self.rig.watcher is not None
        await self.rig.watcher.reconcile()
        self.assertEqual(self.events_for(payload["runtime_id"]), [])

    async def test_unhealthy(self) -> None:
        """A Docker health check that fails gives workload.health.unhealthy."""
        payload = httpd_payload()
        spec = build_spec(payload, self.rig.settings, ())
        args = render(spec, host_port=spec.container_port, command_id="t", agent_id="test-node")
        args["create"]["healthcheck"] = {
            "test": ["CMD", "false"],
            "interval": 200_000_000,
            "timeout": 1_000_000_000,
            "retries": 1,
            "start_period": 0,
        }
        await self.rig.engine.call(ops.create_and_start, args)
        event = await self.rig.wait_event("workload.health.unhealthy", payload["runtime_id"])
        self.assertEqual(event["payload"]["health_status"], "unhealthy")

    async def test_announce_all(self) -> None:
        """announce_all reports every managed workload's current state, even without transitions."""
        p1, r1 = await self.deployed()
        p2, r2 = await self.deployed()
        await self.rig.run("stop_workload", ids_of(p2))
        await self.settle()
        self.rig.health_events.clear()
        assert self.rig.watcher is not None
        sent = await self.rig.watcher.announce_all()
        by_runtime = {e["payload"]["runtime_id"]: e for e in self.rig.health_events}
        self.assertEqual(by_runtime[p1["runtime_id"]]["event_type"], "workload.health.running")
        self.assertEqual(by_runtime[p1["runtime_id"]]["payload"]["endpoint_url"], r1["endpoint_url"])
        self.assertEqual(by_runtime[p2["runtime_id"]]["event_type"], "workload.health.stopped")
        self.assertEqual(len(sent), 2)
        # A reconcile right after reports nothing new.
        self.rig.health_events.clear()
        await self.rig.watcher.reconcile()
        self.assertEqual(self.rig.health_events, [])
        self.assertNotEqual(r2["endpoint_url"], "")

    async def test_update_announces_running(self) -> None:
        """After a successful update the watcher announces workload.health.running."""
        payload, v1 = await self.deployed()
        script = "mkdir -p /www && echo v2 > /www/health && exec httpd -f -p $LLAMA_ARG_PORT -h /www"
        v2 = dict(payload, provider_config=dict(payload["provider_config"], command=["sh", "-c", script]))
        ctx = self.rig.ctx("update_workload", v2)
        await self.rig.manager.update(ctx)
        event = await self.running_after_delivery(ctx, payload["runtime_id"])
        self.assertEqual(event["payload"]["endpoint_url"], v1["endpoint_url"])

    async def running_after_delivery(self, ctx: Any, runtime_id: str) -> dict[str, Any]:
        """
        No workload.health.running for the runtime until its result was delivered (the current
        backend ignores it while the update is in flight: protocol 4, 10.4), then one.
        """
        def running() -> list[dict[str, Any]]:
            return [e for e in self.rig.health_events if e["event_type"] == "workload.health.running"
                    and e["payload"].get("runtime_id") == runtime_id]

        before = len(running())
        # Longer than the rig's settle delay (0.2 s): an announcement on a timer would be here.
        await deferLater(_global_reactor, 1.0, lambda: None)
        self.assertEqual(len(running()), before)
        ctx.delivered()
        for _ in range(300):
            if len(running()) > before:
                return running()[-1]
            await deferLater(_global_reactor, 0.1, lambda: None)
        self.fail("no workload.health.running after the result was delivered")

    async def test_failed_update_announces_running(self) -> None:
        """An update whose image cannot be had leaves the old container running and says so with an event."""
        payload, v1 = await self.deployed()
        bad = dict(payload, image_source="pull_from_registry")
        bad["provider_config"] = dict(payload["provider_config"], image="127.0.0.1:1/llmport/nowhere:1")
        ctx = self.rig.ctx("update_workload", bad)
        with self.assertRaises(CommandFailed) as cm:
            await self.rig.manager.update(ctx)
        self.assertEqual(cm.exception.error_code, "pull_failed")
        self.assertIn("left running unchanged", cm.exception.error_message)
        event = await self.running_after_delivery(ctx, payload["runtime_id"])
        self.assertEqual(event["payload"]["endpoint_url"], v1["endpoint_url"])

    async def test_rollback_announces_running(self) -> None:
        """After a rolled-back update the restored container is announced as running."""
        payload, v1 = await self.deployed()
        bad = dict(payload, provider_config=dict(payload["provider_config"], command=["sh", "-c", "exit 4"]))
        ctx = self.rig.ctx("update_workload", bad)
        with self.assertRaises(CommandFailed) as cm:
            await self.rig.manager.update(ctx)
        self.assertTrue(cm.exception.result["rolled_back"])
        event = await self.running_after_delivery(ctx, payload["runtime_id"])
        self.assertEqual(event["payload"]["endpoint_url"], v1["endpoint_url"])

    async def test_died_right_after_deploy_is_reported(self) -> None:
        """A container that dies while its deploy command still holds it is reported at release."""
        payload = httpd_payload()
        ctx = self.rig.ctx("deploy_workload", payload)

        def kill_at_ready(frame: dict[str, Any]) -> None:
            if frame["phase"] == "ready":
                self.env.client().containers.get(self.container_of(payload)).kill()

        ctx.on_progress.append(kill_at_ready)
        await self.rig.manager.deploy(ctx)
        event = await self.rig.wait_event("workload.health.stopped", payload["runtime_id"])
        self.assertEqual(event["payload"]["exit_code"], 137)

    def container_of(self, payload: dict[str, Any]) -> str:
        [c] = self.env.managed_containers(payload["runtime_id"])
        return str(c.id)

    async def test_rebuilds_view_at_start(self) -> None:
        """A fresh watcher learns existing workloads from labels without emitting events."""
        payload, _ = await self.deployed()
        assert self.rig.watcher is not None
        await self.rig.watcher.stopService()
        from llmport_agent.workloads.health import HealthWatcher

        events: list[Any] = []
        fresh = HealthWatcher(reactor, self.rig.engine, self.rig.settings, lambda *a: events.append(a))
        fresh.startService()
        self.addCleanup(lambda: ensureDeferred(_stop(fresh)))
        await fresh.reconcile()
        self.assertIn(payload["runtime_id"], fresh.states())
        self.assertEqual(fresh.states()[payload["runtime_id"]]["state"], "running")
        self.assertEqual(events, [])


async def _stop(service: Any) -> None:
    if service.running:
        await service.stopService()
