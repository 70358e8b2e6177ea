"""
A secret in a command result (describe_ray_cluster's sealed C{cluster_token} hand-over,
protocol 10.4/10.6) reaches the backend and nothing else: not the journal file, not the
command's outcome line.
"""

from __future__ import annotations

import os
from typing import Any

from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.base import HandlerSpec
from llmport_agent.commands.journal import DELIVERED, CommandJournal
from llmport_agent.commands.pipeline import result_summary
from tests.test_pipeline import Harness, command

TOKEN = "rayTok-9f8e7d6c5b4a"


class ResultSecretTests(SynchronousTestCase):
    def _harness(self) -> Harness:
        h = Harness(self)

        async def describe(ctx: Any) -> dict[str, Any]:
            return {"running": True, "attached": True, "ray_version": "2.58.0", "cluster_token": TOKEN}

        async def small(ctx: Any) -> dict[str, Any]:
            return {"alive": True, "nodes": [1, 2]}

        h.pipeline.registry["describe_ray_cluster"] = HandlerSpec(describe, "read", True, 60, keep_result=False)
        h.pipeline.registry["get_ray_status"] = HandlerSpec(small, "read", True, 60, keep_result=False)
        return h

    def _file(self, h: Harness) -> str:
        with open(os.path.join(h.dir, "commands.jsonl")) as f:
            return f.read()

    def test_token_sent_but_never_on_disk(self) -> None:
        """The backend gets the token; the journal file never holds it, before or after delivery."""
        h = self._harness()
        h.session.auto_confirm = False
        c = command("describe_ray_cluster", {"hand_over_token": True})
        h.deliver(c)
        sent = h.frames_for(c["id"])[-1]
        self.assertEqual(sent["result"]["cluster_token"], TOKEN)
        self.assertNotIn(TOKEN, self._file(h))
        h.session.confirm_all()
        self.assertEqual(h.journal.get(c["id"]).state, DELIVERED)
        self.assertNotIn(TOKEN, self._file(h))
        h.journal._compact()
        self.assertNotIn(TOKEN, self._file(h))

    def test_undelivered_result_after_restart_has_no_token(self) -> None:
        """A result replayed from the file after a restart is sent without the token."""
        h = self._harness()
        h.session.auto_confirm = False
        c = command("describe_ray_cluster", {"hand_over_token": True})
        h.deliver(c)
        again = CommandJournal(h.runner, os.path.join(h.dir, "commands.jsonl"), h.clock.seconds)
        self.successResultOf(again.load())
        rec = again.get(c["id"])
        self.assertEqual(rec.result_frame["result"]["ray_version"], "2.58.0")
        self.assertNotIn("cluster_token", rec.result_frame["result"])

    def test_token_not_in_outcome_line(self) -> None:
        """The command's outcome line summarises the result without the token."""
        logged: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(logged.append)
        self.addCleanup(globalLogPublisher.removeObserver, logged.append)
        h = self._harness()
        c = command("describe_ray_cluster", {"hand_over_token": True})
        h.deliver(c)
        lines = [str(e.get("summary", "")) for e in logged if e.get("outcome") == "success"]
        self.assertTrue(lines and "ray_version=2.58.0" in lines[-1], lines)
        self.assertNotIn(TOKEN, " ".join(lines))
        self.assertEqual(result_summary({"api_token": "abc", "Password": "x", "credential": "y"}), "")


class TokenReadScrubTests(SynchronousTestCase):
    def test_token_read_from_disk_is_known_to_the_scrubber(self) -> None:
        """
        A token file written before a restart, read for the hand-over, is given to the log
        scrubber (L{ClusterTokens.secrets}); deleting it forgets it.
        """
        from twisted.internet.task import Clock

        from llmport_agent.demo.testing import SynchronousRunner
        from llmport_agent.ray.token import TOKEN_FILE, ClusterTokens

        token_dir = os.path.abspath(self.mktemp())
        os.makedirs(token_dir, mode=0o700)
        with open(os.path.join(token_dir, TOKEN_FILE), "w") as f:
            f.write(TOKEN)
        tokens = ClusterTokens(Clock(), None, lambda: None, SynchronousRunner(), token_dir)  # type: ignore[arg-type]
        self.assertEqual(tokens.secrets(), [])
        from twisted.internet.defer import ensureDeferred

        self.assertEqual(self.successResultOf(ensureDeferred(tokens.read())), TOKEN)
        self.assertEqual(tokens.secrets(), [TOKEN])
        self.successResultOf(ensureDeferred(tokens.delete()))
        self.assertEqual(tokens.secrets(), [])
