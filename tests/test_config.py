"""Configuration: defaults, environment, command-line precedence, one-line errors, masking."""

from __future__ import annotations

import os
import subprocess
import sys

from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.core.config import ConfigError, load_config

P = "LLM_PORT_NODE_AGENT_"


class DefaultsTests(SynchronousTestCase):
    def test_defaults_match_the_original_agent(self) -> None:
        """Names and defaults are those of today's llm-port agent."""
        c = load_config({}, {})
        self.assertEqual(c.backend_url, "http://127.0.0.1:8000")
        self.assertEqual(c.advertise_host, c.host)
        self.assertEqual(c.agent_id, c.host)
        self.assertEqual(c.advertise_scheme, "http")
        self.assertIsNone(c.enrollment_token)
        self.assertEqual(c.state_path, "/var/lib/llmport-agent/state.json")
        self.assertEqual((c.heartbeat_interval_sec, c.inventory_interval_sec), (15, 60))
        self.assertEqual((c.reconnect_min_sec, c.reconnect_max_sec), (2, 30))
        self.assertEqual(c.request_timeout_sec, 20)
        self.assertTrue(c.verify_tls)
        self.assertEqual(c.log_level, "INFO")
        self.assertEqual(c.command_poll_interval_sec, 2)
        self.assertEqual(c.model_store, "/srv/llm-port/models")
        self.assertEqual((c.log_batch_size, c.log_flush_interval_sec), (100, 5))
        self.assertEqual(c.image_allowlist, ())

    def test_environment_and_options(self) -> None:
        """The environment sets values; command-line options win over it."""
        env = {P + "BACKEND_URL": "https://b.example/llm/", P + "HOST": "10-node", P + "IMAGE_ALLOWLIST": "a/b, c"}
        c = load_config(env, {"host": "cli-host"})
        self.assertEqual(c.backend_url, "https://b.example/llm")
        self.assertEqual(c.host, "cli-host")
        self.assertEqual(c.advertise_host, "cli-host")
        self.assertEqual(c.image_allowlist, ("a/b", "c"))

    def test_token_masked(self) -> None:
        """The token never appears in the printable configuration."""
        c = load_config({P + "ENROLLMENT_TOKEN": "tok-SECRET-123"}, {})
        self.assertNotIn("SECRET", repr(c))
        self.assertNotIn("SECRET", str(c.masked()))


class ErrorTests(SynchronousTestCase):
    def assertError(self, env: dict[str, str], *fragments: str) -> None:
        with self.assertRaises(ConfigError) as ctx:
            load_config(env, {})
        text = str(ctx.exception)
        self.assertNotIn("\n", text)
        for fragment in fragments:
            self.assertIn(fragment, text)

    def test_errors(self) -> None:
        """Each bad value gives one line naming the variable, the problem and the expected form."""
        self.assertError({P + "HEARTBEAT_INTERVAL_SEC": "abc"}, P + "HEARTBEAT_INTERVAL_SEC", "not a number")
        self.assertError({P + "HEARTBEAT_INTERVAL_SEC": "0"}, "minimum")
        self.assertError({P + "RECONNECT_MIN_SEC": "40"}, "RECONNECT_MIN_SEC", "min <= max")
        self.assertError({P + "BACKEND_URL": "ftp://x"}, "BACKEND_URL", "http")
        self.assertError({P + "BACKEND_URL": "backend:8000"}, "BACKEND_URL")
        self.assertError({P + "CA_BUNDLE": "/nonexistent.pem"}, "CA_BUNDLE", "no such file")
        self.assertError({P + "ADVERTISE_SCHEME": "ftp"}, "http or https")
        self.assertError({P + "VERIFY_TLS": "maybe"}, "boolean")
        self.assertError({P + "COMMAND_DEADLINES": "deploy_workload"}, "command_type=seconds")

    def test_cli_exit_status(self) -> None:
        """The CLI prints one line, no traceback, and exits 2."""
        proc = subprocess.run(
            [sys.executable, "-m", "llmport_agent.cli", "run"],
            env={P + "INVENTORY_INTERVAL_SEC": "x", "PATH": "/usr/bin:/bin",
                 "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))},
            capture_output=True, text=True, timeout=60,
        )
        self.assertEqual(proc.returncode, 2)
        self.assertEqual(len(proc.stderr.strip().splitlines()), 1)
        self.assertNotIn("Traceback", proc.stderr)
