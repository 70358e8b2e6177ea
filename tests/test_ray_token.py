"""
The cluster token endpoint end to end over loopback: the stand-in backend's
C{GET .../nodes/secrets/{credential_ref}} and the agent's client for it (BackendHTTP), with the
answers the real backend gives (200 {"token"}, 401 bad credential, 404 not a member).
"""

from __future__ import annotations

import os

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, HTTPConnectionPool

from llmport_agent.core.threads import PoolService
from llmport_agent.devbackend import DevBackend
from llmport_agent.ray.token import ClusterTokens
from llmport_agent.session.backend_http import SECRET_BODY_LIMIT, BackendHTTP, Rejected, Transient


class ClusterSecretTests(TestCase):
    async def setUp(self) -> None:  # type: ignore[override]
        self.backend = DevBackend(reactor)
        await self.backend.listen(0, "127.0.0.1")
        self.addCleanup(self.backend.stop)
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.http = BackendHTTP(reactor, HTTPClient(Agent(reactor, pool=pool)), self.backend.url, 5)
        self.member = self.backend.enroll_node("ray-head")
        self.other = self.backend.enroll_node("stranger")
        self.token = self.backend.add_cluster_secret("env-7", [self.member["node_id"]])

    async def test_member_gets_the_token(self) -> None:
        self.assertEqual(await self.http.cluster_secret("env-7", self.member["credential"], 5), self.token)
        self.assertEqual(self.backend.cluster_secrets["env-7"].fetches, 1)

    async def test_not_a_member_and_bad_credential(self) -> None:
        with self.assertRaises(Rejected) as cm:
            await self.http.cluster_secret("env-7", self.other["credential"], 5)
        self.assertEqual(cm.exception.status, 404)
        with self.assertRaises(Rejected) as cm:
            await self.http.cluster_secret("no-such", self.member["credential"], 5)
        self.assertEqual(cm.exception.status, 404)
        bad = self.member["credential"].split(".")[0] + ".wrong"
        with self.assertRaises(Rejected) as cm:
            await self.http.cluster_secret("env-7", bad, 5)
        self.assertEqual(cm.exception.status, 401)
        self.assertNotIn(bad, str(cm.exception))

    async def test_oversized_answer_refused(self) -> None:
        self.backend.add_cluster_secret("huge", [self.member["node_id"]], token="x" * (SECRET_BODY_LIMIT + 10))
        with self.assertRaises(Transient) as cm:
            await self.http.cluster_secret("huge", self.member["credential"], 5)
        self.assertIn("larger than", str(cm.exception))

    async def test_tokens_cached_then_refetched(self) -> None:
        pool = PoolService(reactor, "io", 1)
        pool.startService()
        self.addCleanup(pool.stopService)
        token_dir = os.path.abspath(self.mktemp())
        tokens = ClusterTokens(reactor, self.http, lambda: self.member["credential"], pool, token_dir, ttl=300)
        await tokens.ensure("env-7")
        await tokens.ensure("env-7")
        self.assertEqual(self.backend.cluster_secrets["env-7"].fetches, 1)
        with open(os.path.join(token_dir, "cluster.token")) as f:
            self.assertEqual(f.read(), self.token)
        self.assertEqual(os.stat(token_dir).st_mode & 0o777, 0o700)
        self.assertTrue(await tokens.delete())
        self.assertFalse(await tokens.delete())
