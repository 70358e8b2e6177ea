"""
C{join} prints what the backend says about the node (whoami's C{agent_id} and C{node_id}, an
approval's C{node_id}) on the operator's terminal: a hostile or broken backend's terminal escape
sequences never get there, and an approval naming a node id that cannot be shown stores nothing.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

from twisted.internet.defer import succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from llmport_agent.core.config import load_config
from llmport_agent.host.join import EX_FAIL, MEMBER, Joiner

ESC = "\x1b]2;owned\x07\x1b[2J"


class Backend:
    """A backend whose answers carry terminal escape sequences."""

    def __init__(self) -> None:
        self.collects = 0

    def whoami(self, credential: str) -> Any:
        return succeed({"agent_id": "gpu-07" + ESC, "node_id": "n-1" + ESC})

    def request_join(self, agent_id: str, host: str, capabilities: Any, version: str) -> Any:
        return succeed({"id": "r1", "code": "ABCD-1234", "poll_secret": "s3cret"})

    def collect_join(self, request_id: str, secret: str) -> Any:
        self.collects += 1
        return succeed({"status": "approved", "credential": "c.redential", "node_id": "n-1" + ESC})


class JoinWordsTests(TestCase):
    def joiner(self, state: dict[str, Any] | None = None) -> Joiner:
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        path = os.path.join(d, "state.json")
        if state is not None:
            with open(path, "w") as f:
                json.dump(state, f)
        config = load_config({"LLM_PORT_NODE_AGENT_BACKEND_URL": "http://127.0.0.1:9",
                              "LLM_PORT_NODE_AGENT_STATE_PATH": path, "LLM_PORT_NODE_AGENT_AGENT_ID": "gpu-07"}, {})
        j = Joiner(Clock(), config, Backend(), path, lambda: succeed({}), io.StringIO(), io.StringIO(),  # type: ignore[arg-type]
                   poll_sec=1.0, wait_sec=10.0)
        return j

    def text(self, j: Joiner) -> str:
        return j.out.getvalue() + j.err.getvalue()  # type: ignore[attr-defined]

    async def test_whoami_words_are_shown_without_escapes(self) -> None:
        """The agent id is shown cleaned; a node id that is not one is refused (issue 29 #4)."""
        j = self.joiner({"version": 1, "credential": "old.credential", "backend_url": "http://127.0.0.1:9"})
        self.assertEqual(await j.run(), EX_FAIL)
        self.assertIn("the backend sent a node id in the whoami reply that is not one", self.text(j))
        self.assertNotIn("\x1b", self.text(j))
        j = self.joiner({"version": 1, "credential": "old.credential", "backend_url": "http://127.0.0.1:9"})
        j.backend.whoami = lambda credential: succeed({"agent_id": "gpu-07" + ESC, "node_id": "n-1"})  # type: ignore[method-assign]
        self.assertEqual(await j.run(), MEMBER)
        self.assertIn("Already a member: this node is gpu-07?]2;owned??[2J (node n-1)", self.text(j))
        self.assertNotIn("\x1b", self.text(j))

    async def test_an_approval_with_an_unshowable_node_id_stores_nothing(self) -> None:
        j = self.joiner({"version": 1, "pending_join": {"id": "r1"}})
        reply = await Backend().collect_join("r1", "s3cret")
        self.assertEqual(await j._approved(reply), EX_FAIL)
        self.assertNotIn("\x1b", self.text(j))
        self.assertIn("that is not one", self.text(j))
        with open(j.state_path) as f:
            state = json.load(f)
        self.assertNotIn("credential", state)
        self.assertNotIn("pending_join", state)
