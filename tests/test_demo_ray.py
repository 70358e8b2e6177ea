"""`llmport-agent demo --ray` says clearly what is missing: an engine, or the Ray runtime image."""

from __future__ import annotations

import argparse

from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from llmport_agent.demo.ray_env import demo_ray
from llmport_agent.inventory.gpu import NoGPUSource
from tests.support.docker_env import require_docker


class DemoRayTests(TestCase):
    timeout = 90

    async def run_demo(self, environ: dict[str, str], image: str) -> tuple[int, list[str]]:
        args = argparse.Namespace(verbose=False, ray=True, ray_image=image)
        lines: list[str] = []
        code = await demo_ray(reactor, args, lines.append, environ, gpu_source=NoGPUSource())
        return code, lines

    async def test_without_the_image(self) -> None:
        env = require_docker()
        code, lines = await self.run_demo({"DOCKER_HOST": env.host}, "llmport-test/ray-runtime-absent:0")
        self.assertEqual(code, 1)
        said = "\n".join(lines)
        self.assertIn("The Ray runtime image llmport-test/ray-runtime-absent:0 is not on the engine", said)
        self.assertIn("tests/support/rayimage/build.sh", said)
        self.assertIn("docker import", said)

    async def test_without_an_engine(self) -> None:
        code, lines = await self.run_demo({"DOCKER_HOST": "unix:///nonexistent/llmport-demo/d.sock"}, "x:1")
        self.assertEqual(code, 1)
        self.assertIn("demo --ray needs a Docker engine", "\n".join(lines))
