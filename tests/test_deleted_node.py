"""
A deleted node says so (issue 20 #7): at the first HTTP 403 on the stream upgrade the agent asks
the current backend's whoami; a 401 there is said at once, in one line, with what to do (join, or
a new token). Against the April generation (whoami's route is absent: 404 Not Found) the agent
keeps counting refusals as before and says nothing of the kind.
"""

from __future__ import annotations

from twisted.internet import reactor
from twisted.internet.task import deferLater

from llmport_agent.devbackend import DevBackend
from tests.agentharness import AgentTestCase
from tests.test_operator_texts import Captured


class DeletedNodeTests(AgentTestCase):
    timeout = 60

    async def deleted(self, april: bool) -> tuple[Captured, DevBackend, object]:
        captured = Captured(self)
        self.allow_anomalies("node no longer exists", "the node is deleted while its session is open")
        from llmport_agent.devbackend._state import GENERATION_APRIL, GENERATION_CURRENT

        backend = await self.start_backend(generation=GENERATION_APRIL if april else GENERATION_CURRENT)
        self.assertEqual(backend.onboarding.enabled, not april)
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        backend.delete_node(node_id)
        await backend.wait_for(lambda: agent.session.stats.refused >= 2, 20)
        await deferLater(reactor, 0.3, lambda: None)
        return captured, backend, agent

    async def test_current_generation_says_deleted_at_once(self) -> None:
        captured, backend, agent = await self.deleted(april=False)
        lines = [t for t in captured.lines() if "deleted in llm-port or its credential revoked" in t]
        self.assertEqual(len(lines), 1, captured.lines()[-10:])
        line = lines[0]
        self.assertIn("whoami HTTP 401", line)
        self.assertIn(f"llmport-agent join {backend.url}", line)
        self.assertIn("LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN", line)
        self.assertNotIn("\n", line)
        credential = agent.state.credential  # type: ignore[attr-defined]
        self.assertNotIn(credential.split(".")[1], "\n".join(captured.lines()))
        self.assertEqual(agent.session.phase, "refused")  # type: ignore[attr-defined]
        # Said once: later refusals do not repeat the whole line.
        self.assertLess(agent.session.stats.refused, 5)  # type: ignore[attr-defined]

    async def test_april_generation_keeps_counting(self) -> None:
        captured, _backend, agent = await self.deleted(april=True)
        self.assertEqual([t for t in captured.lines() if "deleted in llm-port" in t], [])
        self.assertTrue(any("refused the stream (HTTP 403)" in t for t in captured.lines()))
        self.assertIsNone(agent.session.deleted_detail)  # type: ignore[attr-defined]
