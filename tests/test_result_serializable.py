"""
A result that cannot be serialised to JSON is answered with C{result_not_serializable}
(protocol 10.4) instead of being lost (a lost result leaves the command stuck in the backend).
"""

from __future__ import annotations

import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.base import CommandFailed, HandlerSpec
from llmport_agent.commands.journal import CommandJournal
from llmport_agent.commands.jsonsafe import json_problem

from .test_pipeline import Harness, command


def circular() -> dict[str, Any]:
    d: dict[str, Any] = {"a": 1}
    d["self"] = d
    return d


class JsonProblemTests(SynchronousTestCase):
    def test_fine(self) -> None:
        shared = {"x": [1, 2.5, None, True, "s"]}
        for ok in ({}, {"a": shared, "b": shared}, {"n": float("nan"), "set": {1, 2}, "b": b"x", 3: "int key"}):
            self.assertIsNone(json_problem(ok))

    def test_problems(self) -> None:
        self.assertIn("circular", json_problem(circular()) or "")
        self.assertIn("key of type tuple", json_problem({"a": {(1, 2): "x"}}) or "")
        deep: Any = []
        for _ in range(100):
            deep = [deep]
        self.assertIn("nested more than 64", json_problem({"d": deep}) or "")
        wide: Any = [0] * 10
        for _ in range(10):
            wide = [wide] * 10  # 10^11 values if walked: the walk stops at its bound
        self.assertIn("more than", json_problem(wide, max_values=10_000) or "")


class PipelineTests(SynchronousTestCase):
    def harness(self, result: Any, *, fail: bool = False) -> Harness:
        h = Harness(self)

        async def handler(ctx: Any) -> Any:
            if fail:
                raise CommandFailed("runtime_error", "broke", result)
            return result

        h.pipeline.registry["odd"] = HandlerSpec(handler, lane="runtime", idempotent=True, deadline=60)
        return h

    def check(self, result: Any, *, fail: bool = False) -> dict[str, Any]:
        h = self.harness(result, fail=fail)
        c = command("odd")
        h.deliver(c)
        frame = h.frames_for(c["id"])[-1]
        self.assertEqual(frame["type"], "command_result")
        # What the session does with it: it must go out as JSON.
        json.dumps(frame, default=str, allow_nan=False)
        self.assertFalse(frame["success"])
        self.assertEqual(frame["error_code"], "result_not_serializable")
        self.assertIn("could not serialise the result of odd", frame["error_message"])
        self.assertEqual(frame["result"], {})
        # Journaled as finished, so a restart re-sends it rather than running it again.
        journal = CommandJournal(h.runner, h.journal.path, h.clock.seconds)
        self.successResultOf(journal.load())
        self.assertEqual(journal.records[c["id"]].result_frame["error_code"], "result_not_serializable")
        return frame

    def test_circular_result(self) -> None:
        self.check(circular())
        self.flushLoggedErrors()

    def test_bad_key(self) -> None:
        frame = self.check({"ports": {(8000, "tcp"): 1}})
        self.assertIn("key of type tuple", frame["error_message"])
        self.flushLoggedErrors()

    def test_failure_with_bad_result(self) -> None:
        self.check(circular(), fail=True)
        self.flushLoggedErrors()

    def test_fine_result_unchanged(self) -> None:
        h = self.harness({"ok": True, "n": 1})
        c = command("odd")
        h.deliver(c)
        frame = h.frames_for(c["id"])[-1]
        self.assertEqual((frame["success"], frame["result"]), (True, {"ok": True, "n": 1}))
