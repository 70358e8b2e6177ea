"""
Log shipping end to end, built exactly as the agent builds it (L{build_log_shipping} from an
L{AgentConfig}), with the real Docker engine, real journal files and the fake Loki over loopback:

 - a Loki outage while a container prints about 5,000 lines/s, with an agent restart in the
   middle: zero lines lost, none twice (10 s here; C{LLMPORT_LONG_TESTS=1} runs the 60 s one);
 - a spool that fills up: the journal reader and the container streams pause, the journal
   cursor and the container positions stand, the counters say so, and once Loki is back every
   line arrives;
 - secrets (the enrollment token, a credential, the Loki password) absent from every pushed
   line and from the spool on disk.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import random
import time
from collections.abc import Callable
from typing import Any

from twisted.internet import reactor as _global_reactor
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.internet.utils import getProcessOutputAndValue
from twisted.logger import Logger, globalLogPublisher
from twisted.trial.unittest import TestCase
from twisted.web.server import Site

from llmport_agent.core.config import load_config
from llmport_agent.logs.containers import STATE_FILE
from llmport_agent.logs.journald import CURSOR_FILE
from llmport_agent.logs.spool import HEADER_BYTES, SPOOL_DIR
from llmport_agent.logs.testing import FakeLoki
from llmport_agent.logs.wiring import LogShipping, build_log_shipping
from tests.support.logs import CREDENTIAL, TOKEN, engine_lines, run_managed

reactor: Any = _global_reactor
JOURNAL_REMOTE = "/lib/systemd/systemd-journal-remote"
HOST = "10.0.0.9"
LOKI_PASSWORD = "loki-Pa55-" + "w" * 12
LONG = os.environ.get("LLMPORT_LONG_TESTS") == "1"


def export_entry(message: str, ts_us: int) -> str:
    return (
        f"__REALTIME_TIMESTAMP={ts_us}\n__MONOTONIC_TIMESTAMP={ts_us % 10**9}\n"
        f"_BOOT_ID=0123456789abcdef0123456789abcdef\n_HOSTNAME=node\n"
        f"MESSAGE={message}\nPRIORITY=6\n_SYSTEMD_UNIT=app.service\n\n"
    )


class Agent:
    """The agent's log shipping (pool, shipper, journal reader, engine, container reader)."""

    def __init__(self, case: ShippingTestCase, **env: str) -> None:
        from llmport_agent.workloads.engine import DockerEngine

        full = {
            "LLM_PORT_NODE_AGENT_AGENT_ID": "n1",
            "LLM_PORT_NODE_AGENT_HOST": "127.0.0.1",
            "LLM_PORT_NODE_AGENT_STATE_PATH": os.path.join(case.state_dir, "state.json"),
            "LLM_PORT_NODE_AGENT_LOKI_URL": case.url,
            "LLM_PORT_NODE_AGENT_LOG_LEVEL": "INFO",
        }
        full.update({"LLM_PORT_NODE_AGENT_" + k: v for k, v in env.items()})
        self.config = load_config(full, {})
        self.engine = DockerEngine(reactor, environ={"DOCKER_HOST": case.docker.host}, probe_max=1.0)
        self.shipping: LogShipping = build_log_shipping(
            reactor, self.config, state_dir=case.state_dir, host=lambda: HOST,
            secrets=lambda: [TOKEN, CREDENTIAL], engine=self.engine,
            docker_environ={"DOCKER_HOST": case.docker.host}, journal_directory=case.journal_dir,
        )
        s = self.shipping
        self.order = [s.pool, s.shipper, s.journald, self.engine, s.containers]

    async def start(self) -> None:
        for svc in self.order:
            svc.startService()
        globalLogPublisher.addObserver(self.shipping.observer)
        await self.engine.whenAvailable()

    async def stop(self) -> None:
        globalLogPublisher.removeObserver(self.shipping.observer)
        for svc in reversed(self.order):
            if svc.running:
                await svc.stopService()
        await self.shipping.http_pool.closeCachedConnections()


class ShippingTestCase(TestCase):
    timeout = 240

    def setUp(self) -> None:
        from tests.support.docker_env import require_docker
        from tests.support.packages import require_package

        require_package("systemd-journal-remote", JOURNAL_REMOTE)
        require_package("systemd", "journalctl")
        self.docker = require_docker()
        self.loki = FakeLoki(check_labels=True, require_gzip=True)
        port = reactor.listenTCP(0, Site(self.loki), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.url = f"http://127.0.0.1:{port.getHost().port}"
        self.state_dir = os.path.abspath(self.mktemp())
        self.journal_dir = os.path.abspath(self.mktemp())
        os.makedirs(self.state_dir)
        os.makedirs(self.journal_dir)
        self.agents: list[Agent] = []
        self.journal_count = 0

    async def tearDown(self) -> None:
        for agent in self.agents:
            await agent.stop()

    async def agent(self, **env: str) -> Agent:
        agent = Agent(self, **env)
        self.agents.append(agent)
        await agent.start()
        return agent

    async def restart(self, agent: Agent, **env: str) -> Agent:
        await agent.stop()
        self.agents.remove(agent)
        return await self.agent(**env)

    def container(self, script: str) -> Any:
        c = run_managed(self.docker.client(), script, prefix="e2e", agent_id="n1")
        self.addCleanup(lambda: self.docker.client().containers.get(c.id).remove(force=True))
        return c

    def engine_lines(self, container: Any) -> list[str]:
        return engine_lines(self.docker.client(), container.id)

    async def journal(self, messages: list[str], ahead: float = 5.0) -> None:
        """
        Journal entries stamped C{ahead} s from now, written before the reader starts (journalctl
        --follow misses entries systemd-journal-remote appends under it; journald does not).
        """
        self.journal_count += 1
        path = os.path.join(self.journal_dir, f"export-{self.journal_count}.txt")
        now = time.time_ns() // 1000 + int(ahead * 1_000_000)
        with open(path, "w") as f:
            for i, message in enumerate(messages):
                f.write(export_entry(message, now + i))
        out, err, code = await getProcessOutputAndValue(
            JOURNAL_REMOTE, [f"--output={self.journal_dir}/remote.journal", path], env={})
        self.assertEqual(code, 0, err)
        os.unlink(path)

    async def until(self, predicate: Callable[[], bool], timeout: float, what: str,
                    detail: Callable[[], str] | None = None) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                self.fail(f"timed out waiting for {what}" + (f": {detail()}" if detail else ""))
            await deferLater(reactor, 0.2, lambda: None)

    def count(self, **labels: str) -> int:
        return len(self.loki.lines(**labels))


class OutageTests(ShippingTestCase):
    """A Loki outage under load with an agent restart in the middle loses nothing."""

    async def outage_with_restart(self, outage_seconds: float) -> None:
        agent = await self.agent(LOKI_SPOOL_MAX_MB="64")
        container = self.container(
            "i=0; while true; do j=0; while [ $j -lt 60 ]; do echo \"seq $i\"; i=$((i+1)); j=$((j+1)); "
            "done; usleep 10000; done")
        await self.until(lambda: self.count(container=container.name) >= 2000, 60, "lines before the outage")
        self.loki.outage(503, retry_after="1")
        before = self.count(container=container.name)
        started = time.monotonic()
        await deferLater(reactor, outage_seconds / 2, lambda: None)
        spooled = agent.shipping.shipper.stats()["spool_lines"]
        self.assertGreater(spooled, 0)
        agent = await self.restart(agent, LOKI_SPOOL_MAX_MB="64")  # a clean stop and start
        await deferLater(reactor, max(0.0, outage_seconds - (time.monotonic() - started)), lambda: None)
        self.assertEqual(self.count(container=container.name), before)  # nothing got through
        self.loki.recover()
        await deferToThread(lambda: self.docker.client().containers.get(container.id).stop(timeout=0))
        truth = self.engine_lines(container)
        await self.until(lambda: self.count(container=container.name) >= len(truth), 120, "the replay")
        await deferLater(reactor, 0.5, lambda: None)
        shipped = self.loki.lines(container=container.name)
        self.assertEqual(len(shipped), len(truth), "lines lost or doubled")
        self.assertEqual(shipped, truth)
        self.assertEqual((self.loki.violations, self.loki.duplicates), ([], 0))
        stats = agent.shipping.shipper.stats()
        self.assertEqual((stats["spool_lines"], stats["dropped_by_reason"]["stopped"]), (0, 0))
        rate = (len(truth) - before) / max(1.0, time.monotonic() - started)
        self.assertGreater(rate, 1000)  # about 5,000 lines/s were printed through the outage

    async def test_outage_with_an_agent_restart_loses_nothing(self) -> None:
        """10 s of Loki answering 503 at ~5,000 lines/s, the agent restarted halfway: zero loss."""
        await self.outage_with_restart(10.0)

    async def test_sixty_second_outage_with_an_agent_restart_loses_nothing(self) -> None:
        """The same for 60 s (about 300,000 lines through the spool)."""
        if not LONG:
            raise self.skipTest("the 60 s outage runs with LLMPORT_LONG_TESTS=1 (and in bench/bench_loki.py)")
        await self.outage_with_restart(60.0)

    test_sixty_second_outage_with_an_agent_restart_loses_nothing.timeout = 400  # type: ignore[attr-defined]


class SpoolFullTests(ShippingTestCase):
    """A full spool pauses the readers instead of dropping; Loki's return brings everything."""

    async def test_full_spool_pauses_readers_and_loses_nothing(self) -> None:
        """Readers pause, their positions stand, the counters say so; afterwards all lines arrive."""
        rng = random.Random(7)
        messages = [f"entry {i:05d} {rng.getrandbits(240):060x}" for i in range(60_000)]
        await self.journal(messages)
        self.loki.outage(500)
        agent = await self.agent(LOKI_SPOOL_MAX_MB="1", LOKI_BATCH_BYTES="65536")
        container = self.container(
            "i=0; while true; do j=0; while [ $j -lt 40 ]; do echo \"burst $i $((i * 7919 % 1000003))\"; "
            "i=$((i+1)); j=$((j+1)); done; usleep 10000; done")
        shipping = agent.shipping
        def full_and_paused() -> bool:
            # Full: the next batch (at most 64 KiB of lines, compressed) would not fit.
            spooled = shipping.shipper.stats()["spool_bytes"]
            return (spooled > (1 << 20) - 2 * 65536 and shipping.journald.paused
                    and shipping.containers.describe()["paused"])

        await self.until(full_and_paused, 60, "the spool to fill and both readers to pause",
                         lambda: f"{shipping.shipper.stats()} {shipping.journald.describe()} "
                                 f"{shipping.containers.describe()}")
        stats = shipping.shipper.stats()
        self.assertLessEqual(stats["spool_bytes"], 1 << 20)
        self.assertGreater(stats["pressure"], 0.5)  # paused at 80 %, resumed only under 50 %
        self.assertEqual(stats["dropped_by_reason"]["stopped"], 0)
        # What was spooled before the pause is saved within a save period (5 s for the journal,
        # 2 s for containers); from then on, paused, the positions must not move.
        await deferLater(reactor, 5.5, lambda: None)
        cursor = self.read(CURSOR_FILE)
        positions = self.read(STATE_FILE)
        through = shipping.shipper.delivered_through()
        await deferLater(reactor, 5.5, lambda: None)
        self.assertEqual(self.read(CURSOR_FILE), cursor)
        self.assertEqual(self.read(STATE_FILE), positions)
        self.assertEqual(shipping.shipper.delivered_through(), through)
        self.assertTrue(shipping.journald.paused)
        self.loki.recover()
        await deferToThread(lambda: self.docker.client().containers.get(container.id).stop(timeout=0))
        truth = self.engine_lines(container)
        def journal_lines() -> list[str]:
            return [line for line in self.loki.lines(job="node-agent") if line.startswith("app.service: ")]

        await self.until(lambda: self.loki.accepted >= len(messages) + len(truth)
                         and len(journal_lines()) >= len(messages)
                         and self.count(container=container.name) >= len(truth), 120, "everything")
        await deferLater(reactor, 0.5, lambda: None)
        journal = journal_lines()
        self.assertEqual(journal, [f"app.service: {m}" for m in messages])
        self.assertEqual(self.loki.lines(container=container.name), truth)
        self.assertEqual((self.loki.violations, self.loki.duplicates), ([], 0))
        stats = shipping.shipper.stats()
        self.assertEqual(stats["spool_lines"], 0)
        for reason in ("stopped", "spool_corrupt", "rejected", "too_large"):
            self.assertEqual(stats["dropped_by_reason"][reason], 0, reason)
        self.assertFalse(shipping.journald.paused)


    def read(self, name: str) -> str:
        path = os.path.join(self.state_dir, name)
        if not os.path.exists(path):
            return ""
        with open(path) as f:
            return f.read()


class SecretTests(ShippingTestCase):
    """No secret reaches Loki or the spool, whichever way it was written."""

    async def test_secrets_absent_from_every_pushed_line_and_the_spool(self) -> None:
        """Token, credential and Loki password printed by a container, the journal and the agent."""
        password_file = os.path.join(self.state_dir, "loki-password")
        with open(password_file, "w") as f:
            f.write(LOKI_PASSWORD + "\n")
        secrets = {"token": TOKEN, "credential": CREDENTIAL, "loki password": LOKI_PASSWORD}
        text = " ".join(f"{name}={value}" for name, value in secrets.items())
        await self.journal([f"journal {text}", f"url https://u:{LOKI_PASSWORD}@h/x"])
        self.loki.outage(503)  # so the lines also pass through the spool
        agent = await self.agent(LOKI_USERNAME="shipper", LOKI_PASSWORD_FILE=password_file,
                                 LOKI_TENANT="tenant-1")
        container = self.container(f"echo 'plain {text}'; echo 'Authorization: Bearer {CREDENTIAL}' >&2")
        Logger(namespace="llmport_agent.session").info("agent {text}", text=text)
        await self.until(lambda: agent.shipping.shipper.stats()["spool_lines"] >= 5, 30, "the spool")
        spooled = b""
        for path in glob.glob(os.path.join(self.state_dir, SPOOL_DIR, "*.seg")):
            data = open(path, "rb").read()
            offset = 0
            while offset + HEADER_BYTES <= len(data):
                length = int.from_bytes(data[offset + 4: offset + 8], "big")
                spooled += gzip.decompress(data[offset + HEADER_BYTES: offset + HEADER_BYTES + length])
                offset += HEADER_BYTES + length
        self.assertIn(b"plain token=***", spooled)
        self.loki.recover()
        await self.until(lambda: self.count(container=container.name) >= 2
                         and any("journal " in line for line in self.loki.lines()), 30, "the lines")
        pushed = json.dumps([p.body for p in self.loki.pushes])
        for name, value in secrets.items():
            self.assertNotIn(value, pushed, name)
            self.assertNotIn(value.encode(), spooled, name)
        self.assertIn("Bearer ***", pushed)
        headers = self.loki.pushes[-1].headers
        self.assertEqual(headers["x-scope-orgid"], "tenant-1")
        self.assertTrue(headers["authorization"].startswith("Basic "))
        described = json.dumps(agent.shipping.describe())
        for value in secrets.values():
            self.assertNotIn(value, described)
