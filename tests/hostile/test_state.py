"""
Big state from the backend: a node profile of 10 MB in every hello_ack. Serialising and writing
state runs on the I/O pool, never on the reactor; the profile kept in the state file is bounded
(a bigger one is kept in memory only, and the log says why), so neither a connect nor a
maintenance toggle stalls the agent (the issue measured 3.1 s and 1.8 s).
"""

from __future__ import annotations

import json
import os
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.node import MAX_STORED_PROFILE, PersistentModes
from llmport_agent.core.state import StateStore
from llmport_agent.demo.testing import SynchronousRunner
from tests.agentharness import AgentTestCase
from tests.hostile.test_agent import LogCapture
from tests.support.probe import LatenessProbe

TERMINAL = ("succeeded", "failed")


def sleep(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


def big_profile(items: int = 250_000) -> dict[str, Any]:
    """About 10 MB of JSON in many small values (what makes serialisation slow)."""
    return {
        "id": "p-big", "name": "big", "description": "", "is_default": False,
        "runtime_config": {"env": [{"name": f"V{i}", "value": str(i)} for i in range(items)]},
        "gpu_config": {}, "storage_config": {}, "network_config": {}, "logging_config": {},
        "security_config": {}, "update_config": {},
        "registry_auth": {"username": "bot", "password": "s3cret-registry-pw"},
        "created_at": "2024-01-01T00:00:00Z", "updated_at": "2024-01-01T00:00:00Z",
    }


class BigProfileTests(AgentTestCase):
    timeout = 120

    async def test_ten_megabyte_profile_in_hello_ack(self) -> None:
        """
        The backend assigns a 10 MB profile: at the next connect (hello_ack) and at two
        maintenance toggles the reactor keeps ticking; the profile is used from memory and the
        state file stays small.
        """
        logs = LogCapture(self)
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        profile = big_profile()
        self.assertGreater(len(json.dumps(profile)), 9_000_000)
        backend.set_profile(node_id, profile)
        opens = agent.session.stats.opens
        probe = LatenessProbe()
        probe.start()
        self.addCleanup(probe.stop)
        backend.drop_connections(node_id)
        await backend.wait_for(lambda: agent.session.stats.opens > opens and agent.modes.profile is not None, 30)
        # Scrubbed and measured on the I/O pool, then found too big to store.
        await backend.wait_for(lambda: "kept in memory only" in logs.text(), 30)
        await agent.state.flush()
        for enabled in (True, False):
            cmd = backend.issue_command(node_id, "set_maintenance_mode", {"enabled": enabled})
            await backend.wait_for(lambda c=cmd: backend.command(c["id"])["status"] in TERMINAL, 30)
            await agent.state.flush()
        await sleep(0.2)
        probe.stop()
        self.assertEqual(agent.modes.profile["name"], "big")  # type: ignore[index]
        self.assertEqual(len(agent.modes.profile["runtime_config"]["env"]), 250_000)  # type: ignore[index]
        self.assertFalse(agent.modes.maintenance)
        size = os.path.getsize(agent.state.path)
        self.assertLess(size, 64 * 1024, f"state file {size} bytes")
        worst = probe.worst
        # Generous (the stand-in backend serialises the 10 MB on the same reactor, and the
        # frame is parsed there); serialising the state on the reactor took seconds.
        self.assertLess(worst, 1.0, f"the reactor stalled {worst:.2f} s")


class StoredProfileTests(SynchronousTestCase):
    def modes(self) -> tuple[PersistentModes, StateStore]:
        d = self.mktemp()
        os.makedirs(d)
        state = StateStore(SynchronousRunner(), os.path.join(d, "state.json"))
        self.successResultOf(state.load())
        return PersistentModes(state), state

    def stored(self, state: StateStore) -> dict[str, Any]:
        with open(state.path) as f:
            return dict(json.load(f))

    def test_small_profile_is_stored_without_credentials(self) -> None:
        modes, state = self.modes()
        profile = big_profile(10)
        self.successResultOf(__import__("twisted").internet.defer.ensureDeferred(modes.set(profile=profile)))
        on_disk = self.stored(state)["profile"]
        self.assertEqual(on_disk["name"], "big")
        self.assertNotIn("s3cret-registry-pw", json.dumps(on_disk))
        self.assertEqual(modes.profile, profile)  # credentials kept in memory

    def test_big_profile_is_kept_in_memory_only(self) -> None:
        """A profile over the bound: not in the state file (an older stored one is removed)."""
        from twisted.internet.defer import ensureDeferred

        modes, state = self.modes()
        self.successResultOf(ensureDeferred(modes.set(profile=big_profile(10))))
        huge = big_profile(MAX_STORED_PROFILE // 20)
        self.successResultOf(ensureDeferred(modes.set(profile=huge)))
        self.assertNotIn("profile", self.stored(state))
        self.assertIs(modes.profile, huge)
        self.flushLoggedErrors()
