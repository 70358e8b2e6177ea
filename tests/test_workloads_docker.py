"""
The workload handlers against a real Docker engine (started once per test process by
tests.support.docker_env): deploy, start, restart, update with rollback, stop, remove,
logs, readiness failures, port conflicts, policy refusals, engine outage mid-deploy.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from twisted.internet import reactor as _global_reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread

from llmport_agent.commands.base import (
    POLICY_VIOLATION,
    RUNTIME_ERROR,
    CommandFailed,
)
from llmport_agent.workloads.diagnostics import engine_diagnostics
from llmport_agent.workloads.handlers import workload_handler_specs
from llmport_agent.workloads.spec import LABEL_HOST_PORT, LABEL_RUNTIME_ID

from .support.docker_env import BUSYBOX, free_port
from .support.rig import SERVE, Rig, WorkloadTestBase, httpd_payload, ids_of

reactor: Any = _global_reactor

DEPLOY_PHASES = [
    "validate",
    "remove_stale",
    "sync_model",
    "pull_image",
    "start_container",
    "resolve_endpoint",
    "waiting_for_ready",
    "ready",
]


class DeployTests(WorkloadTestBase):
    """deploy_workload end to end."""

    async def test_deploy_ready(self) -> None:
        """A deploy reports every phase in order, labels the container and returns the real endpoint."""
        port = free_port()
        payload = httpd_payload(port=port)
        ctx, result = await self.rig.run("deploy_workload", payload)
        self.assertEqual(ctx.phases(), DEPLOY_PHASES)
        self.assertEqual(result["endpoint_url"], f"http://192.0.2.10:{port}")
        self.assertEqual(result["host_port"], port)
        code, body = await self.rig.get(f"http://127.0.0.1:{port}/health")
        self.assertEqual((code, body.strip()), (200, b"ok"))
        [container] = self.env.managed_containers(payload["runtime_id"])
        labels = container.labels
        self.assertEqual(labels[LABEL_RUNTIME_ID], payload["runtime_id"])
        self.assertEqual(labels[LABEL_HOST_PORT], str(port))
        self.assertEqual(labels["io.llmport.command-id"], ctx.command.id)
        self.assertEqual(labels["io.llmport.agent-id"], "test-node")
        self.assertEqual(labels["io.llmport.provider-type"], "llamacpp")
        self.assertEqual(labels["io.llmport.container-port"], str(port))
        self.assertEqual(container.name, f"llm-port-lpt-{payload['runtime_id'][:8]}")
        self.assertEqual(container.attrs["HostConfig"]["RestartPolicy"]["Name"], "unless-stopped")
        env = dict(e.split("=", 1) for e in container.attrs["Config"]["Env"])
        self.assertEqual(env["LLM_PORT_RUNTIME_ID"], payload["runtime_id"])
        self.assertEqual(env["LLM_PORT_PROVIDER_TYPE"], "llamacpp")
        self.assertEqual(ctx.event_types(), ["workload.deployed"])
        self.assertEqual(ctx.events[0]["payload"]["endpoint_url"], result["endpoint_url"])

    async def test_redeploy_replaces_stale(self) -> None:
        """A second deploy of the same runtime removes the first container (remove_stale)."""
        payload = httpd_payload()
        _, first = await self.rig.run("deploy_workload", payload)
        ctx, second = await self.rig.run("deploy_workload", payload)
        self.assertIn("Removed 1 stale", ctx.frames_of("remove_stale")[0]["message"])
        containers = self.env.managed_containers(payload["runtime_id"])
        self.assertEqual([c.id for c in containers], [second["container_id"]])
        self.assertNotEqual(first["container_id"], second["container_id"])

    async def test_never_ready(self) -> None:
        """A workload that never answers fails with readiness_timeout and is left running."""
        # 4 s: time for the 300 lines below to be written on a loaded machine.
        self.rig.manager.settings = self.rig.settings = _with(self.rig.settings, readiness_timeout_sec=4)
        # 300 numbered lines, the last one the "cause": the message ends with the newest
        # lines (protocol 10.4), at most 200 of them, in at most 2000 characters.
        payload = httpd_payload(
            script="i=0; while [ $i -lt 300 ]; do echo loading shard $i of 300; i=$((i+1)); done; "
            "echo CUDA out of memory; exec sleep 600"
        )
        ctx, exc = await self.failure("deploy_workload", payload)
        self.assertEqual(exc.error_code, "readiness_timeout")
        self.assertIn("did not become ready within 4 s", exc.error_message)
        self.assertIn("left running", exc.error_message)
        self.assertTrue(exc.error_message.endswith("loading shard 299 of 300\nCUDA out of memory"))
        self.assertLessEqual(len(exc.error_message), 2000)
        self.assertNotIn("loading shard 0 of", exc.error_message)
        [container] = self.env.managed_containers(payload["runtime_id"])
        self.assertEqual(container.status, "running")
        self.assertNotIn("ready", ctx.phases())

    async def test_exits_during_startup(self) -> None:
        """A workload that exits fails at once with its exit code and last log lines."""
        payload = httpd_payload(script="echo model file missing >&2; exit 3")
        start = reactor.seconds()
        _, exc = await self.failure("deploy_workload", payload)
        self.assertEqual(exc.error_code, "container_exited")
        self.assertIn("exit code 3", exc.error_message)
        self.assertIn("model file missing", exc.error_message)
        self.assertEqual(exc.result["exit_code"], 3)
        self.assertLess(reactor.seconds() - start, 15)
        [container] = self.env.managed_containers(payload["runtime_id"])
        container.reload()
        self.assertIn(container.status, ("exited", "stopped"))  # Podman says "stopped"

    async def test_explicit_port_conflict(self) -> None:
        """An explicit host_port held by another process fails before anything is created."""
        held = await self.hold_port()
        payload = httpd_payload(provider_config={"host_port": held})
        _, exc = await self.failure("deploy_workload", payload)
        self.assertEqual(exc.error_code, "port_conflict")
        self.assertIn(str(held), exc.error_message)
        self.assertEqual(self.env.managed_containers(payload["runtime_id"]), [])

    async def test_default_port_taken(self) -> None:
        """With the container port taken, a free port is chosen and endpoint_url names it."""
        held = await self.hold_port()
        payload = httpd_payload(port=held)
        _, result = await self.rig.run("deploy_workload", payload)
        self.assertNotEqual(result["host_port"], held)
        self.assertTrue(result["endpoint_url"].endswith(f":{result['host_port']}"))
        code, _ = await self.rig.get(f"http://127.0.0.1:{result['host_port']}/health")
        self.assertEqual(code, 200)

    async def test_gpu_request_without_nvidia(self) -> None:
        """A GPU request reaches the engine as a device request; without NVIDIA it fails clearly and leaves nothing."""
        payload = httpd_payload(gpu_request="1")
        _, exc = await self.failure("deploy_workload", payload)
        self.assertEqual(exc.error_code, RUNTIME_ERROR)
        self.assertIn("NVIDIA", exc.error_message)
        self.assertEqual(self.env.managed_containers(payload["runtime_id"]), [])

    async def test_deploy_with_model_sync(self) -> None:
        """sync_from_server runs the injected model sync (phase sync_model) and mounts the store offline."""
        store = os.path.abspath(self.mktemp())
        os.makedirs(store)
        calls: list[dict[str, Any]] = []

        async def sync_model(model_sync: dict[str, Any], progress: Any) -> dict[str, Any]:
            calls.append(model_sync)
            progress("sync_model", "Fetching blobs", bytes_done=5, bytes_total=10, progress_pct=50)
            with open(os.path.join(store, "marker"), "w") as f:
                f.write("synced")
            return {"fetched": 1}

        await self.rig.stop()
        self.rig = Rig(reactor, self.env, sync_model=sync_model, model_store=store)
        await self.rig.start()
        script = "test -f /data/hf-cache/marker || exit 9; " + SERVE
        payload = httpd_payload(
            script=script,
            model_sync={"source": "sync_from_server", "hf_repo_id": "org/model", "model_id": "m1", "blobs": []},
        )
        ctx, result = await self.rig.run("deploy_workload", payload)
        self.assertEqual(calls[0]["hf_repo_id"], "org/model")
        frames = ctx.frames_of("sync_model")
        self.assertIn({"phase": "sync_model", "message": "Fetching blobs", "bytes_done": 5, "bytes_total": 10, "progress_pct": 50}, frames)
        [c] = self.env.managed_containers(payload["runtime_id"])
        env = dict(e.split("=", 1) for e in c.attrs["Config"]["Env"])
        self.assertEqual((env["HF_HUB_CACHE"], env["HF_HUB_OFFLINE"], env["TRANSFORMERS_OFFLINE"]), ("/data/hf-cache", "1", "1"))
        self.assertEqual([m["Destination"] for m in c.attrs["Mounts"]], ["/data/hf-cache"])
        self.assertTrue(result["endpoint_url"])

    async def test_model_sync_failure(self) -> None:
        """A failing model sync fails the deploy with its own error code; nothing is started."""

        async def sync_model(model_sync: dict[str, Any], progress: Any) -> dict[str, Any]:
            raise CommandFailed("checksum_mismatch", "blob abc does not match its sha256")

        await self.rig.stop()
        self.rig = Rig(reactor, self.env, sync_model=sync_model, model_store=os.path.abspath(self.mktemp()))
        await self.rig.start()
        payload = httpd_payload(model_sync={"source": "sync_from_server", "hf_repo_id": "o/m", "blobs": []})
        _, exc = await self.failure("deploy_workload", payload)
        self.assertEqual(exc.error_code, "checksum_mismatch")
        self.assertEqual(self.env.managed_containers(payload["runtime_id"]), [])

    async def test_allowlist_refusal(self) -> None:
        """An image outside IMAGE_ALLOWLIST is refused and nothing is created."""
        self.rig.manager.allowlist = _allow("ghcr.io/llmport")
        payload = httpd_payload()
        _, exc = await self.failure("deploy_workload", payload)
        self.assertEqual(exc.error_code, POLICY_VIOLATION)
        self.assertIn(BUSYBOX, exc.error_message)
        self.assertEqual(self.env.managed_containers(payload["runtime_id"]), [])

    async def test_privileged_refusal(self) -> None:
        """A payload asking for privileged mode is refused; nothing is created."""
        payload = httpd_payload(provider_config={"privileged": True})
        _, exc = await self.failure("deploy_workload", payload)
        self.assertEqual(exc.error_code, POLICY_VIOLATION)
        self.assertEqual(self.env.managed_containers(payload["runtime_id"]), [])

    async def test_foreign_container_name(self) -> None:
        """A same-named container that is not this runtime's is not destroyed."""
        name = f"foreign-{uuid.uuid4().hex[:8]}"
        self.env.client().containers.create(BUSYBOX, ["sleep", "60"], name=name, network_mode="none")
        payload = httpd_payload(container_name=name)
        _, exc = await self.failure("deploy_workload", payload)
        self.assertEqual(exc.error_code, RUNTIME_ERROR)
        self.assertIn("does not belong", exc.error_message)
        self.assertEqual(self.env.client().containers.get(name).name, name)

    async def test_diagnostics(self) -> None:
        """Diagnostics list the engine, its runtimes, managed containers and their images as objects."""
        payload = httpd_payload()
        await self.rig.run("deploy_workload", payload)
        diag = await engine_diagnostics(self.rig.engine, self.rig.settings.agent_id)
        self.assertTrue(diag["available"])
        self.assertIn("runc", diag["runtimes"])
        self.assertFalse(diag["nvidia_runtime"])
        [row] = [c for c in diag["managed_containers"] if c["runtime_id"] == payload["runtime_id"]]
        self.assertEqual(row["state"], "running")
        self.assertEqual(row["restart_count"], 0)
        self.assertIsInstance(row["host_port"], int)
        # Podman names local images fully (docker.io/...).
        self.assertTrue(any({BUSYBOX, f"docker.io/{BUSYBOX}"} & set(img["tags"]) for img in diag["images_in_use"]))

    def test_handler_specs(self) -> None:
        """Specs: runtime lane, long deadlines, maintenance/draining blocks; logs on the read lane."""
        specs = workload_handler_specs(self.rig.manager)
        for name in ("deploy_workload", "start_workload", "restart_workload"):
            self.assertEqual(specs[name].lane, "runtime")
            self.assertTrue(specs[name].blocked_by_maintenance)
            self.assertTrue(specs[name].blocked_by_draining)
            self.assertEqual(specs[name].deadline, self.rig.settings.deploy_deadline_sec)
        self.assertTrue(specs["update_workload"].blocked_by_maintenance)
        self.assertFalse(specs["update_workload"].blocked_by_draining)
        self.assertFalse(specs["stop_workload"].blocked_by_maintenance)
        self.assertEqual(specs["fetch_container_logs"].lane, "read")
        self.assertFalse(specs["fetch_container_logs"].keep_result)


class LifecycleTests(WorkloadTestBase):
    """start, restart, stop, remove."""

    async def test_stop_start_uses_labels(self) -> None:
        """stop then start: the stored host port is reused and the endpoint reported."""
        payload = httpd_payload()
        _, deployed = await self.rig.run("deploy_workload", payload)
        ctx, stopped = await self.rig.run("stop_workload", ids_of(payload))
        self.assertTrue(stopped["stopped"])
        self.assertTrue(stopped["was_running"])
        self.assertEqual(ctx.event_types(), ["workload.stopped"])
        [c] = self.env.managed_containers(payload["runtime_id"])
        self.assertEqual(c.status, "exited")
        ctx, started = await self.rig.run("start_workload", dict(payload, model_sync={}))
        self.assertEqual(started["endpoint_url"], deployed["endpoint_url"])
        self.assertEqual(started["container_id"], deployed["container_id"])
        self.assertEqual(ctx.event_types(), ["workload.started"])
        self.assertIn("ready", ctx.phases())

    async def test_stop_grace_then_kill(self) -> None:
        """A workload that ignores SIGTERM is killed after the grace period."""
        payload = httpd_payload(script="trap '' TERM; " + "mkdir -p /www && echo ok > /www/health && httpd -f -p $LLAMA_ARG_PORT -h /www")
        await self.rig.run("deploy_workload", payload)
        await self.rig.run("stop_workload", ids_of(payload))
        [c] = self.env.managed_containers(payload["runtime_id"])
        self.assertEqual(c.attrs["State"]["ExitCode"], 137)

    async def test_stop_missing_is_success(self) -> None:
        """Stopping a runtime without a container succeeds and says so."""
        _, result = await self.rig.run("stop_workload", ids_of(httpd_payload()))
        self.assertFalse(result["stopped"])
        self.assertIn("nothing to stop", result["message"])

    async def test_stop_after_container_gone(self) -> None:
        """
        protocol 10.4: stop_workload succeeds when the container is already gone (removed
        behind the agent's back, or an exited one), and so does remove_workload afterwards.
        """
        payload = httpd_payload()
        await self.rig.run("deploy_workload", payload)
        [c] = self.env.managed_containers(payload["runtime_id"])
        c.remove(force=True)
        _, result = await self.rig.run("stop_workload", ids_of(payload))
        self.assertFalse(result["stopped"])
        self.assertIn("nothing to stop", result["message"])
        _, removed = await self.rig.run("remove_workload", ids_of(payload))
        self.assertEqual(removed["removed"], 0)
        exited = httpd_payload(script="echo bye")
        _, exc = await self.failure("deploy_workload", exited)  # exits during startup
        _, result = await self.rig.run("stop_workload", ids_of(exited))
        self.assertEqual((result["stopped"], result["was_running"]), (True, False))

    async def test_start_port_taken(self) -> None:
        """Starting a stopped workload whose recorded port is now held fails with port_conflict."""
        payload = httpd_payload()
        _, deployed = await self.rig.run("deploy_workload", payload)
        await self.rig.run("stop_workload", ids_of(payload))
        await self.hold_port(deployed["host_port"])
        _, exc = await self.failure("start_workload", payload)
        self.assertEqual(exc.error_code, "port_conflict")
        self.assertIn(str(deployed["host_port"]), exc.error_message)

    async def test_start_missing_deploys(self) -> None:
        """start_workload of a runtime without a container falls back to a full deploy."""
        payload = httpd_payload()
        ctx, result = await self.rig.run("start_workload", payload)
        self.assertIn("deploying", ctx.frames[0]["message"])
        self.assertIn("ready", ctx.phases())
        self.assertEqual(len(self.env.managed_containers(payload["runtime_id"])), 1)
        self.assertTrue(result["endpoint_url"])

    async def test_restart(self) -> None:
        """restart_workload restarts the same container and waits until it is ready."""
        payload = httpd_payload()
        _, deployed = await self.rig.run("deploy_workload", payload)
        ctx, result = await self.rig.run("restart_workload", payload)
        self.assertEqual(result["container_id"], deployed["container_id"])
        self.assertEqual(result["endpoint_url"], deployed["endpoint_url"])
        self.assertEqual(ctx.event_types(), ["workload.restarted"])
        [c] = self.env.managed_containers(payload["runtime_id"])
        self.assertNotEqual(c.attrs["State"]["StartedAt"], "")

    async def test_restart_missing_deploys(self) -> None:
        """restart_workload of a runtime without a container deploys it."""
        payload = httpd_payload()
        _, result = await self.rig.run("restart_workload", payload)
        self.assertTrue(result["endpoint_url"])

    async def test_remove_idempotent(self) -> None:
        """remove_workload removes the container; removing again succeeds."""
        payload = httpd_payload()
        await self.rig.run("deploy_workload", payload)
        ctx, result = await self.rig.run("remove_workload", ids_of(payload))
        self.assertEqual(result["removed"], 1)
        self.assertEqual(ctx.event_types(), ["workload.removed"])
        self.assertEqual(self.env.managed_containers(payload["runtime_id"]), [])
        _, again = await self.rig.run("remove_workload", ids_of(payload))
        self.assertEqual(again["removed"], 0)
        self.assertIn("nothing to remove", again["message"])


class UpdateTests(WorkloadTestBase):
    """update_workload, with rollback."""

    async def test_update_replaces(self) -> None:
        """A good update replaces the container, keeps the endpoint and removes the old one."""
        payload = httpd_payload()
        _, v1 = await self.rig.run("deploy_workload", payload)
        v2_script = "mkdir -p /www && echo v2 > /www/health && exec httpd -f -p $LLAMA_ARG_PORT -h /www"
        v2 = dict(payload, provider_config=dict(payload["provider_config"], command=["sh", "-c", v2_script]))
        ctx, result = await self.rig.run("update_workload", v2)
        self.assertEqual(result["endpoint_url"], v1["endpoint_url"])
        self.assertNotEqual(result["container_id"], v1["container_id"])
        self.assertEqual(result["replaced_container_id"], v1["container_id"])
        [c] = self.env.managed_containers(payload["runtime_id"])
        self.assertEqual(c.id, result["container_id"])
        _, body = await self.rig.get(f"http://127.0.0.1:{result['host_port']}/health")
        self.assertEqual(body.strip(), b"v2")
        self.assertEqual(ctx.event_types(), ["workload.updated"])

    async def test_update_rolls_back(self) -> None:
        """A new container that exits is removed and the old one brought back; the failure says so."""
        payload = httpd_payload()
        _, v1 = await self.rig.run("deploy_workload", payload)
        bad = dict(
            payload,
            provider_config=dict(
                payload["provider_config"],
                command=["sh", "-c", "i=0; while [ $i -lt 300 ]; do echo loading part $i of 300 >&2; "
                         "i=$((i+1)); done; echo broken >&2; exit 7"],
            ),
        )
        ctx, exc = await self.failure("update_workload", bad)
        self.assertEqual(exc.error_code, "container_exited")
        self.assertIn("rolled back", exc.error_message)
        self.assertIn("exit code 7", exc.error_message)
        # The log lines end the message, within the backend's 2000 characters (protocol 10.4).
        self.assertTrue(exc.error_message.startswith(f"Update of {v1['container_name']} failed and was rolled back"))
        # Under load the engine may restart the container before its logs are read: the first
        # run's last lines must still be in the tail (a restarted run's first lines may follow).
        self.assertIn("loading part 299 of 300\nbroken", exc.error_message[-600:], exc.error_message[-200:])
        self.assertLessEqual(len(exc.error_message), 2000)
        self.assertTrue(exc.result["rolled_back"])
        self.assertEqual(exc.result["endpoint_url"], v1["endpoint_url"])
        [c] = self.env.managed_containers(payload["runtime_id"])
        self.assertEqual(c.id, v1["container_id"])
        self.assertEqual(c.name, v1["container_name"])
        self.assertEqual(c.status, "running")
        code, _ = await self.rig.get(f"http://127.0.0.1:{v1['host_port']}/health")
        self.assertEqual(code, 200)
        self.assertIn("rollback", ctx.phases())

    async def test_update_without_container_deploys(self) -> None:
        """Updating a runtime that has no container deploys it."""
        payload = httpd_payload()
        _, result = await self.rig.run("update_workload", payload)
        self.assertEqual(len(self.env.managed_containers(payload["runtime_id"])), 1)
        self.assertTrue(result["endpoint_url"])


class LogsTests(WorkloadTestBase):
    """fetch_container_logs."""

    async def test_logs(self) -> None:
        """Logs come back with timestamps, stdout and stderr merged, tail honoured."""
        script = "echo out-1; sleep 0.2; echo err-1 >&2; sleep 0.2; echo out-2; " + "mkdir -p /www && echo ok > /www/health && exec httpd -f -p $LLAMA_ARG_PORT -h /www"
        payload = httpd_payload(script=script)
        await self.rig.run("deploy_workload", payload)
        _, result = await self.rig.run("fetch_container_logs", dict(ids_of(payload), tail=300))
        self.assertTrue(result["found"])
        lines = result["logs"].splitlines()
        self.assertEqual([line.split(" ", 1)[1] for line in lines], ["out-1", "err-1", "out-2"])
        self.assertRegex(lines[0], r"^\d{4}-\d\d-\d\dT")
        _, tail = await self.rig.run("fetch_container_logs", dict(ids_of(payload), tail="1"))
        self.assertEqual(tail["lines"], 3)  # tail is at least 10 (protocol 10.4)

    async def test_logs_missing_container(self) -> None:
        """A missing container is a successful result whose text says so."""
        _, result = await self.rig.run("fetch_container_logs", ids_of(httpd_payload()))
        self.assertFalse(result["found"])
        self.assertIn("No managed container", result["logs"])

    async def test_logs_bad_tail(self) -> None:
        """A tail that is not an integer is replaced by the default and said so: logs never fail."""
        _, result = await self.rig.run("fetch_container_logs", dict(ids_of(httpd_payload()), tail="lots"))
        self.assertIn("tail must be an integer, not 'lots'; showing the last 200 lines", result["logs"])

    async def test_logs_during_deploy(self) -> None:
        """Logs of a runtime whose deploy is waiting for readiness come back within 2 s."""
        script = "echo starting-up; sleep 4; " + "mkdir -p /www && echo ok > /www/health && exec httpd -f -p $LLAMA_ARG_PORT -h /www"
        payload = httpd_payload(script=script)
        ctx = self.rig.ctx("deploy_workload", payload)
        reached: Deferred[None] = Deferred()

        def watch(frame: dict[str, Any]) -> None:
            if frame["phase"] == "waiting_for_ready" and not reached.called:
                reached.callback(None)

        ctx.on_progress.append(watch)
        deploy = ensureDeferred(self.rig.manager.deploy(ctx))
        await reached
        await deferLater(reactor, 0.3, lambda: None)  # let the container print
        start = reactor.seconds()
        _, logs = await self.rig.run("fetch_container_logs", ids_of(payload))
        elapsed = reactor.seconds() - start
        self.assertLess(elapsed, 2.0)
        self.assertIn("starting-up", logs["logs"])
        self.assertFalse(deploy.called)
        result = await deploy
        self.assertTrue(result["endpoint_url"])


class EngineOutageTests(WorkloadTestBase):
    """The engine stopped and restarted mid-deploy."""

    health = True
    timeout = 180

    async def test_engine_restart_mid_deploy(self) -> None:
        """Stopping dockerd fails the deploy with runtime_error naming the engine; the agent reconnects."""
        script = "sleep 30; " + "mkdir -p /www && echo ok > /www/health && exec httpd -f -p $LLAMA_ARG_PORT -h /www"
        payload = httpd_payload(script=script)
        ctx = self.rig.ctx("deploy_workload", payload)
        reached: Deferred[None] = Deferred()
        ctx.on_progress.append(
            lambda f: reached.callback(None) if f["phase"] == "waiting_for_ready" and not reached.called else None
        )
        deploy = ensureDeferred(self.rig.manager.deploy(ctx))
        await reached
        try:
            await deferToThread(self.env.stop)
            try:
                await deploy
            except CommandFailed as exc:
                self.assertEqual(exc.error_code, RUNTIME_ERROR)
                self.assertIn(self.env.host, exc.error_message)
                self.assertIn("unreachable", exc.error_message)
            else:
                self.fail("deploy succeeded with the engine stopped")
            # With dockerd gone, any call fails and marks the engine unavailable; a logs fetch
            # still succeeds, with text that names the engine (a failure would mark the
            # runtime error in the backend).
            _, logs = await self.rig.run("fetch_container_logs", ids_of(payload))
            self.assertFalse(logs["found"])
            self.assertIn(self.env.host, logs["logs"])
            self.assertFalse(self.rig.engine.available)
            self.assertFalse(self.rig.engine.facts()["docker_available"])
            self.assertIn(self.env.host, self.rig.engine.last_error)
        finally:
            if not self.env.running:
                await deferToThread(self.env.start)
        back = self.rig.engine.whenAvailable()
        back.addTimeout(60, reactor)
        await back
        self.assertTrue(self.rig.engine.facts()["docker_available"])
        good = httpd_payload()
        _, result = await self.rig.run("deploy_workload", good)
        self.assertTrue(result["endpoint_url"])
        # The health watcher's event stream came back too.
        for _ in range(100):
            if self.rig.watcher is not None and self.rig.watcher.stream_open:
                break
            await deferLater(reactor, 0.1, lambda: None)
        self.assertTrue(self.rig.watcher is not None and self.rig.watcher.stream_open)


def _with(settings: Any, **changes: Any) -> Any:
    from attrs import evolve

    return evolve(settings, **changes)


def _allow(text: str) -> Any:
    from llmport_agent.workloads.policy import parse_allowlist

    return parse_allowlist(text)


class EarlyPortConflictTests(WorkloadTestBase):
    async def test_redeploy_port_conflict_keeps_old_container(self) -> None:
        """A redeploy asking for a host port another process holds fails before the old container is touched."""
        import socket

        first = httpd_payload()
        await self.rig.run("deploy_workload", first)
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        self.addCleanup(holder.close)
        taken = holder.getsockname()[1]
        second = dict(first, provider_config=dict(first["provider_config"], host_port=str(taken)))
        ctx, exc = await self.failure("deploy_workload", second)
        self.assertEqual(exc.error_code, "port_conflict")
        self.assertNotIn("remove_stale", [f["phase"] for f in ctx.frames])
        _, logs = await self.rig.run("fetch_container_logs", ids_of(first))
        self.assertTrue(logs["found"])


class RestartedExitLogsTests(WorkloadTestBase):
    """The log lines of a container's real last exit, after its restart policy restarted it."""

    async def test_lines_before_the_exit_after_a_chatty_restart(self) -> None:
        """
        The first run writes 300 lines and exits 7; the restarted run writes 300 more and stays
        up. The exit's lines are the first run's last ones (the engine's own tail-then-until
        would give none), at most 200.
        """
        from llmport_agent.workloads import exits

        script = (
            "if [ -f /tmp/ran ]; then i=0; while [ $i -lt 300 ]; do echo second $i; i=$((i+1)); done; "
            "exec sleep 600; fi; touch /tmp/ran; i=0; while [ $i -lt 300 ]; do echo first $i; "
            "i=$((i+1)); done; exit 7"
        )

        def run() -> Any:
            return self.env.client().containers.run(
                BUSYBOX, ["sh", "-c", script], detach=True, network_mode="none",
                restart_policy={"Name": "unless-stopped"},
            )

        container = await deferToThread(run)

        def second_run_done() -> bool:
            container.reload()
            return (container.attrs["RestartCount"] >= 1 and container.status == "running"
                    and b"second 299" in container.logs())

        for _ in range(200):
            if await deferToThread(second_run_done):
                break
            await deferLater(reactor, 0.05, lambda: None)
        else:
            self.fail("the container did not restart and write its second run")
        info = await self.rig.engine.call(exits.exit_info, container.id, 200)
        assert info is not None
        self.assertEqual(info["exit_code"], 7)
        lines = info["logs"].splitlines()
        self.assertEqual(lines, [f"first {i}" for i in range(100, 300)])
