"""fetch_container_logs never fails (a failure would put a running runtime in error)."""

from __future__ import annotations

import uuid
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.trial.unittest import TestCase

from llmport_agent.workloads.engine import DockerEngine
from llmport_agent.workloads.handlers import WorkloadManager
from llmport_agent.workloads.settings import WorkloadSettings
from tests.support.context import RecordingContext, make_command


class LogsNeverFailTests(TestCase):
    timeout = 30

    async def manager(self) -> WorkloadManager:
        engine = DockerEngine(reactor, environ={"DOCKER_HOST": f"unix:///tmp/nowhere-{uuid.uuid4().hex}.sock"},
                              probe_initial=60)
        engine.startService()
        self.addCleanup(engine.stopService)

        def probe(url: str) -> Deferred[int]:
            return Deferred()

        return WorkloadManager(reactor, engine, WorkloadSettings(agent_id="a", model_store="/tmp/m"), probe=probe)

    async def logs(self, payload: dict[str, Any]) -> dict[str, Any]:
        m = await self.manager()
        ctx = RecordingContext(make_command("fetch_container_logs", payload), reactor)
        return await m.logs(ctx)  # type: ignore[arg-type]

    async def test_engine_unreachable_is_text(self) -> None:
        """With the engine unreachable the result succeeds and its text names the engine and the cause."""
        result = await self.logs({"runtime_id": str(uuid.uuid4()), "runtime_name": "r", "tail": 10})
        self.assertFalse(result["found"])
        self.assertIn("nowhere", result["logs"])

    async def test_bad_tail_is_text(self) -> None:
        """A tail that is not an integer is replaced by the default (clamped to 200) and said so, not refused."""
        result = await self.logs({"runtime_id": str(uuid.uuid4()), "runtime_name": "r", "tail": "lots"})
        self.assertIn("showing the last 200 lines", result["logs"])
        self.assertIn("No logs", result["logs"])

    async def test_out_of_range_tail_is_clamped_not_refused(self) -> None:
        """A negative tail is an integer: clamped to 10 (protocol 10.4), no note, not refused."""
        result = await self.logs({"runtime_id": str(uuid.uuid4()), "runtime_name": "r", "tail": -5})
        self.assertNotIn("llmport-agent:", result["logs"])
        self.assertIn("No logs", result["logs"])
