"""
The Ray runtime container reaps what C{ray stop} ends (real engine, busybox for the image).

C{ray start} runs in a C{docker exec} that exits, leaving Ray's daemons to the container's PID 1.
Under a bare C{sleep infinity} as PID 1 nothing reaps them once C{ray stop} kills them: they stay
zombies, which C{ray stop} (psutil) counts as running, so it waits out its whole grace period,
16 s and more, at every C{stop_ray} and C{leave_ray_cluster}. The container runs under the
engine's init, which reaps them at once.
"""

from __future__ import annotations

import os
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, succeed
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from llmport_agent.ray import imagepin
from llmport_agent.ray.bundle import DEFAULT_CONTAINER_NAME
from llmport_agent.ray.handlers import RayManager, RaySettings
from llmport_agent.workloads.engine import DockerEngine
from llmport_agent.workloads.policy import parse_allowlist
from tests.support.docker_env import BUSYBOX, require_docker

#: A daemon left behind by an exec that has exited (as `ray start` leaves raylet), then killed
#: (as `ray stop` does); prints the state of its process: gone, or Z (a zombie).
ORPHAN_KILLED = (
    "pid=$(sh -c 'sleep 600 </dev/null >/dev/null 2>&1 & echo $!'); kill -9 $pid; i=0; "
    "st() { grep '^State:' /proc/$pid/status 2>/dev/null; }; "
    "while [ $i -lt 50 ] && [ -n \"$(st)\" ] && ! st | grep -q Z; do usleep 100000; i=$((i+1)); done; "
    "s=$(st); echo ${s:-gone}"
)


class Pool:
    def run(self, fn: Any, *args: Any, **kw: Any) -> Deferred[Any]:
        return succeed(fn(*args, **kw))


class RuntimeContainerInitTests(TestCase):
    timeout = 120

    async def setUp(self) -> None:  # type: ignore[override]
        self.env = require_docker()
        self.env.ensure_busybox()
        base = os.path.abspath(self.mktemp())
        store = os.path.join(base, "models")
        os.makedirs(store)
        engine = DockerEngine(reactor, environ={"DOCKER_HOST": self.env.host}, probe_max=1.0)
        engine.startService()
        self.addCleanup(engine.stopService)
        await engine.whenAvailable()
        settings = RaySettings("agent-init", parse_allowlist("llmport-test"), (store,), os.path.join(base, "token"),
                               model_store=store)
        self.ray = RayManager(reactor, engine, None, None, settings, Pool())  # type: ignore[arg-type]
        self.addCleanup(deferToThread, self._remove)

    def _remove(self) -> None:
        for c in self.env.client().containers.list(all=True, filters={"name": f"^/{DEFAULT_CONTAINER_NAME}$"}):
            c.remove(force=True)

    async def test_processes_ended_in_the_container_are_reaped(self) -> None:
        info = self.env.client().api.inspect_image(BUSYBOX)
        bundle = self.ray.bundle({"runtime_bundle": {
            "image": BUSYBOX, "digest": info["Id"], "rootfs_digest": imagepin.rootfs_digest(info["RootFS"]["Layers"]),
            "requirements": {"gpus": "none", "ipc_mode": "private"}, "mounts": []}}, required=True)
        assert bundle is not None
        await self.ray.ensure_container(bundle, info["Id"])

        def orphan() -> tuple[bool, str]:
            c = self.env.client().containers.get(DEFAULT_CONTAINER_NAME)
            code, out = c.exec_run(["sh", "-c", ORPHAN_KILLED])
            return bool(c.attrs["HostConfig"].get("Init")), out.decode(errors="replace").strip()

        init, state = await deferToThread(orphan)
        self.assertEqual(state, "gone")  # a zombie (State: Z) without an init
        self.assertTrue(init)
