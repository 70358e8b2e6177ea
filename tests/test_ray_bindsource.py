"""
Integration, on the real engine: no start of the Ray runtime container resolves a bind source
through a path that a container can write (the hostile review's HIGH finding).

The engine resolves a bind mount's source path again at every start of a container. A workload
that writes the model store (C{download_from_hf} mounts it read-write) swaps a directory there
for a link to a marker directory outside every allowed root (standing in for C{/}); then the
runtime container is started again by the agent (a stopped container: C{ensure_container}) and
by the engine (C{docker restart}, a daemon restart). The marker is never visible inside. A
control shows the engine does follow such a link at a restart: the finding is real, and the
test would see it.
"""

from __future__ import annotations

import os
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, succeed
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from llmport_agent.commands.base import CommandFailed
from llmport_agent.ray import imagepin
from llmport_agent.ray.bundle import DEFAULT_CONTAINER_NAME
from llmport_agent.ray.handlers import RayManager, RaySettings
from llmport_agent.workloads.engine import DockerEngine
from llmport_agent.workloads.policy import parse_allowlist
from tests.support.docker_env import BUSYBOX, require_docker

MARKER = "host-root-marker"


class Pool:
    """Runs the small file functions inline."""

    def run(self, fn: Any, *args: Any, **kw: Any) -> Deferred[Any]:
        return succeed(fn(*args, **kw))


class BindSourceTests(TestCase):
    timeout = 300

    async def setUp(self) -> None:
        self.env = require_docker()
        self.env.ensure_busybox()
        base = os.path.abspath(self.mktemp())
        self.store = os.path.join(base, "models")
        os.makedirs(os.path.join(self.store, "hub"))
        self.outside = os.path.join(base, "host-root")  # stands in for /: outside every allowed root
        os.makedirs(self.outside)
        with open(os.path.join(self.outside, MARKER), "w") as f:
            f.write("the host's root\n")
        self.engine = await self._engine()
        settings = RaySettings("agent-bind", parse_allowlist("llmport-test"), (self.store,),
                               os.path.join(base, "token"), session_dir=os.path.join(base, "session"),
                               model_store=self.store)
        self.ray = RayManager(reactor, self.engine, None, None, settings, Pool())  # type: ignore[arg-type]
        self.addCleanup(self._remove, DEFAULT_CONTAINER_NAME)
        self.addCleanup(self._remove, "bindsource-control")

    async def _engine(self) -> DockerEngine:
        engine = DockerEngine(reactor, environ={"DOCKER_HOST": self.env.host}, probe_max=1.0)
        engine.startService()
        self.addCleanup(engine.stopService)
        await engine.whenAvailable()
        return engine

    def _remove(self, name: str) -> Deferred[None]:
        def remove() -> None:
            for c in self.env.client().containers.list(all=True, filters={"name": f"^/{name}$"}):
                c.remove(force=True)

        return deferToThread(remove)

    def bundle(self, mounts: list[dict[str, Any]]) -> dict[str, Any]:
        info = self.env.client().api.inspect_image(BUSYBOX)
        return {"image": BUSYBOX, "digest": info["Id"], "rootfs_digest": imagepin.rootfs_digest(info["RootFS"]["Layers"]),
                "requirements": {"gpus": "none", "ipc_mode": "private"}, "mounts": mounts}

    def swap_for_link(self, path: str) -> None:
        """What a workload writing the store does: the directory becomes a link out of it."""
        os.rename(path, path + ".old")
        os.symlink(self.outside, path)

    async def sees_marker(self, name: str, path: str) -> bool:
        """Whether the marker file is readable at C{path} inside the running container C{name}."""
        def look() -> bool:
            c = self.env.client().containers.get(name)
            code, out = c.exec_run(["cat", f"{path}/{MARKER}"])
            return code == 0 and b"host's root" in out

        return await deferToThread(look)

    async def state(self, name: str) -> dict[str, Any]:
        info = await deferToThread(self.env.client().api.inspect_container, name)
        return {"running": info["State"]["Running"], "restart": info["HostConfig"]["RestartPolicy"]["Name"],
                "id": info["Id"]}

    async def test_no_start_follows_a_link_a_workload_swapped_in(self) -> None:
        name = DEFAULT_CONTAINER_NAME
        # A mount from inside the store is refused before anything reaches the engine.
        with self.assertRaises(CommandFailed) as cm:
            self.ray.bundle({"runtime_bundle": self.bundle(
                [{"host_path": os.path.join(self.store, "hub"), "container_path": "/models"}])})
        self.assertEqual(cm.exception.error_code, "policy_violation")
        # The store itself is mounted.
        bundle = self.ray.bundle({"runtime_bundle": self.bundle([{"host_path": self.store, "container_path": "/models",
                                                                   "mode": "ro"}])})
        assert bundle is not None
        report = await self.ray.identify(bundle)
        self.assertIsNotNone(report.matched_by)
        await self.ray.ensure_container(bundle, report.identity.image_id)
        first = await self.state(name)
        self.assertEqual((first["running"], first["restart"]), (True, "no"))

        # One an earlier agent made with unless-stopped: switched to no in place, still running.
        await deferToThread(self.env.client().api.update_container, name,
                            restart_policy={"Name": "unless-stopped"})
        await self.ray.ensure_container(bundle, report.identity.image_id)
        self.assertEqual(await self.state(name), first)

        # A workload writing the store swaps hub for a link out of it.
        self.swap_for_link(os.path.join(self.store, "hub"))

        # The agent: a stopped container is created afresh (never started), checked again.
        await deferToThread(self.env.client().api.stop, name, timeout=1)
        await self.ray.ensure_container(bundle, report.identity.image_id)
        again = await self.state(name)
        self.assertNotEqual(again["id"], first["id"])
        self.assertFalse(await self.sees_marker(name, "/models/hub"))

        # The engine: docker restart resolves the sources again; the store's own name is not
        # the workload's to swap, so the link stays a link inside the container's root.
        await deferToThread(self.env.client().api.restart, name, timeout=1)
        self.assertTrue((await self.state(name))["running"])
        self.assertFalse(await self.sees_marker(name, "/models/hub"))

        # A daemon restart (a reboot): the engine does not start it on its own.
        await deferToThread(self.env.restart)
        self.assertFalse((await self.state(name))["running"])
        engine = await self._engine()
        ray = RayManager(reactor, engine, None, None, self.ray.settings, Pool())  # type: ignore[arg-type]
        await ray.ensure_container(bundle, report.identity.image_id)
        self.assertTrue((await self.state(name))["running"])
        self.assertFalse(await self.sees_marker(name, "/models/hub"))

    async def test_control_the_engine_follows_a_swapped_source_at_a_restart(self) -> None:
        """
        Without the rule (a source inside the store, created here behind the policy's back), a
        restart by the engine mounts whatever the link points to: the reproduction is real.
        """
        inside = os.path.join(self.store, "hub")

        def create() -> None:
            api = self.env.client().api
            host_config = api.create_host_config(binds=[f"{inside}:/models:ro"], network_mode="none")
            created = api.create_container(BUSYBOX, ["sleep", "infinity"], name="bindsource-control",
                                           host_config=host_config)
            api.start(created["Id"])

        await deferToThread(create)
        self.assertFalse(await self.sees_marker("bindsource-control", "/models"))
        self.swap_for_link(inside)
        await deferToThread(self.env.client().api.restart, "bindsource-control", timeout=1)
        self.assertTrue(await self.sees_marker("bindsource-control", "/models"))
