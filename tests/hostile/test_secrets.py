"""
Secrets, exactly: a password in a URL (backend, Loki, Docker engine) never reaches a log line, an
event, the configuration display or diagnostics; error texts lose the secret values only
(passwords, tokens, identity tokens) and keep what says which registry and account failed (the
address and the user name are not secrets).
"""

from __future__ import annotations

import json
import uuid
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.internet.task import Clock, deferLater
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.base import CommandFailed
from llmport_agent.core.config import load_config, mask_url
from llmport_agent.workloads.engine import EngineError, StreamControl
from llmport_agent.workloads.images import ImageManager
from llmport_agent.workloads.policy import parse_image_ref
from tests.agentharness import AgentTestCase
from tests.hostile.test_agent import LogCapture
from tests.support.docker_env import require_registry
from tests.support.rig import WorkloadTestBase, httpd_payload

TERMINAL = ("succeeded", "failed")


def with_userinfo(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, f"{user}:{password}@{parts.netloc}", parts.path, "", ""))


class BackendUrlPasswordTests(AgentTestCase):
    async def test_password_in_backend_url_at_debug_level(self) -> None:
        """
        BACKEND_URL=http://bot:<password>@host at LOG_LEVEL=DEBUG: the agent still connects
        (the user info is never sent), and the password is in no log line or field, in no
        frame, not in the configuration display and not in diagnostics. The user name is
        shown, so the operator sees which URL was meant.
        """
        logs = LogCapture(self)
        backend = await self.start_backend()
        password = "B4ckend-Passw0rd-" + uuid.uuid4().hex[:8]
        agent = self.start_agent(backend, BACKEND_URL=with_userinfo(backend.url, "bot", password),
                                 LOG_LEVEL="DEBUG")
        node_id = await self.wait_connected(backend, agent, timeout=15)
        cmd = backend.issue_command(node_id, "collect_diagnostics", {})
        await backend.wait_for(lambda: backend.command(cmd["id"])["status"] in TERMINAL, 15)
        diagnostics = json.dumps(backend.command(cmd["id"])["result"])
        masked = json.dumps(agent.config.masked())
        await agent.stopService()
        places = {"logs": logs.text(), "frames": json.dumps(backend.frames(node_id)),
                  "diagnostics": diagnostics, "config": masked}
        for label, text in places.items():
            self.assertNotIn(password, text, label)
        self.assertIn("bot:***@", logs.text())
        self.assertEqual(backend.command(cmd["id"])["status"], "succeeded")


class FakeEngine:
    """Just enough engine for ImageManager.pull: the stream fails with the engine's words."""

    def __init__(self, clock: Clock, explanation: str) -> None:
        self.clock = clock
        self.explanation = explanation

    async def stream(self, fn: Any, control: StreamControl, *args: Any, what: str = "") -> Any:
        await deferLater(self.clock, 0.1, lambda: None)  # the engine answers later, as engines do
        raise EngineError(f"{what} failed: Docker engine answered: {self.explanation}",
                          status_code=500, explanation=self.explanation)

    def callFromThread(self, fn: Any, *args: Any) -> None:
        fn(*args)


class PullErrorTests(SynchronousTestCase):
    def test_pull_error_keeps_address_and_user(self) -> None:
        """
        The engine's error names the registry, the account and (a careless registry) the
        password and the token: only the password and the token are masked.
        """
        password = "Regi5try-pw-" + uuid.uuid4().hex[:6]
        token = "idtok-" + uuid.uuid4().hex
        explanation = (f"Head \"https://registry.example.internal:5000/v2/org/app/manifests/1\": "
                       f"unauthorized: user robot-7 with password {password} (token {token}) denied")
        clock = Clock()
        images = ImageManager(clock, FakeEngine(clock, explanation), stall_sec=30)  # type: ignore[arg-type]
        auth = {"username": "robot-7", "password": password, "identitytoken": token,
                "serveraddress": "registry.example.internal:5000"}
        d = ensureDeferred(images.pull(parse_image_ref("registry.example.internal:5000/org/app:1"),
                                       lambda *a, **k: None, auth))
        clock.advance(1)
        failure = self.failureResultOf(d, CommandFailed)
        message = failure.value.error_message
        self.assertNotIn(password, message)
        self.assertNotIn(token, message)
        self.assertIn("registry.example.internal:5000", message)
        self.assertIn("robot-7", message)
        self.assertIn("check the registry credentials", message)


class RealRegistryPullTests(WorkloadTestBase):
    async def test_missing_image_with_credentials_names_the_registry(self) -> None:
        """A pull_failed from the real registry still says which registry failed."""
        registry = require_registry()
        secret = "pw-" + uuid.uuid4().hex
        payload = httpd_payload(image=registry.ref(f"llmport/absent-{uuid.uuid4().hex[:6]}:1"),
                                image_source="pull_from_registry",
                                provider_config={"registry_auth": {"username": "robot", "password": secret}})
        _, exc = await self.failure("deploy_workload", payload)
        self.assertEqual(exc.error_code, "pull_failed")
        self.assertIn(registry.address, exc.error_message)
        self.assertNotIn(secret, exc.error_message)


class MaskTests(SynchronousTestCase):
    def test_mask_url(self) -> None:
        self.assertEqual(mask_url("http://bot:pw@h:1/x"), "http://bot:***@h:1/x")
        self.assertEqual(mask_url("https://tok3n@h/x"), "https://***@h/x")
        self.assertEqual(mask_url("http://h:1/x"), "http://h:1/x")
        self.assertEqual(mask_url("tcp://u:p%40ss@10.1.1.1:2376"), "tcp://u:***@10.1.1.1:2376")

    def test_config_error_and_display(self) -> None:
        """Neither a configuration error nor the configuration display shows the password."""
        config = load_config({"LLM_PORT_NODE_AGENT_BACKEND_URL": "https://bot:S3cr3t-pw@b.example:8443/llm"}, {})
        self.assertEqual(config.backend_url, "https://b.example:8443/llm")
        self.assertNotIn("S3cr3t-pw", json.dumps(config.masked()))
        self.assertTrue(any("bot:***@" in n for n in config.notes))
        self.assertFalse(any("S3cr3t-pw" in n for n in config.notes))
        from llmport_agent.core.config import ConfigError

        with self.assertRaises(ConfigError) as cm:
            load_config({"LLM_PORT_NODE_AGENT_BACKEND_URL": "https://bot:S3cr3t-pw@b.example:99999"}, {})
        self.assertNotIn("S3cr3t-pw", str(cm.exception))
        self.assertIn("bot:***@", str(cm.exception))

    def test_docker_host_password(self) -> None:
        """A password in DOCKER_HOST never appears in the engine's address (messages, diagnostics)."""
        from llmport_agent.workloads.engine import DockerEngine

        engine = DockerEngine(reactor, environ={"DOCKER_HOST": "tcp://ops:D0cker-pw@127.0.0.1:1"})
        self.assertNotIn("D0cker-pw", engine.address)
        self.assertIn("ops:***@127.0.0.1:1", engine.address)
