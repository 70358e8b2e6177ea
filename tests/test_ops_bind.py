"""
The ops endpoint as an operator meets it (issue 22, point 0): a bind that fails is retried with
backoff and the agent says when it listens; scrapes leave no INFO access-log line.
"""

from __future__ import annotations

from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.error import CannotListenError
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import LogLevel, formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmport_agent.ops.endpoint import OpsService


class BusyPortReactor(MemoryReactorClock):
    """listenTCP fails while C{busy} is true, as when another process holds the port."""

    busy = True
    attempts = 0

    def listenTCP(self, port: int, factory: Any, backlog: int = 50, interface: str = "") -> Any:
        self.attempts += 1
        if self.busy:
            raise CannotListenError(interface, port, OSError(98, "Address already in use"))
        return super().listenTCP(port, factory, backlog, interface)


class Captured:
    def __init__(self, case: Any) -> None:
        self.events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(self.events.append)
        case.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def lines(self, level: LogLevel) -> list[str]:
        return [formatEvent(e) for e in self.events if e.get("log_level") == level]


class BindRetryTests(SynchronousTestCase):
    def test_retries_with_backoff_and_says_when_listening(self) -> None:
        captured = Captured(self)
        clock = BusyPortReactor()
        ops = OpsService(clock, agent=object(), port=9464)
        ops.startService()
        self.addCleanup(ops.stopService)
        self.assertEqual(clock.attempts, 1)
        warnings = captured.lines(LogLevel.warn)
        self.assertEqual(len(warnings), 1)
        self.assertIn("could not listen on 127.0.0.1:9464", warnings[0])
        self.assertIn("retrying", warnings[0])
        self.assertIn("LLM_PORT_NODE_AGENT_OPS_PORT", warnings[0])
        # 1 s, 2 s, 4 s, ... capped at 60 s.
        gaps = []
        for _ in range(8):
            before = clock.attempts
            waited = 0.0
            while clock.attempts == before and waited < 120:
                clock.advance(0.5)
                waited += 0.5
            gaps.append(waited)
        self.assertEqual(gaps, [1, 2, 4, 8, 16, 32, 60, 60])
        self.assertEqual(len(captured.lines(LogLevel.warn)), 1)  # said once, not every minute
        self.assertIsNone(ops.listening_port)
        clock.busy = False
        clock.advance(60)
        self.assertEqual(ops.listening_port, 9464)
        infos = [t for t in captured.lines(LogLevel.info) if "Ops endpoint listening" in t]
        self.assertEqual(infos, ["Ops endpoint listening on http://127.0.0.1:9464/ (healthz, readyz, metrics) "
                                 "(after 9 failed attempts)"])
        # Listening: no more attempts.
        attempts = clock.attempts
        clock.advance(600)
        self.assertEqual(clock.attempts, attempts)

    def test_stop_cancels_the_pending_retry(self) -> None:
        clock = BusyPortReactor()
        ops = OpsService(clock, agent=object(), port=9464)
        ops.startService()
        ops.stopService()
        self.assertEqual(clock.getDelayedCalls(), [])
        clock.busy = False
        clock.advance(120)
        self.assertEqual(clock.attempts, 1)
        self.assertIsNone(ops.listening_port)


class AccessLogTests(TestCase):
    async def test_scrape_logs_only_at_debug(self) -> None:
        """A real request to /healthz: its access line is a DEBUG event, nothing at INFO."""
        captured = Captured(self)
        ops = OpsService(reactor, agent=object(), port=0)
        ops.startService()
        self.addCleanup(ops.stopService)
        port = ops.listening_port
        assert port is not None
        response = await treq.get(f"http://127.0.0.1:{port}/healthz", persistent=False)
        self.assertEqual(await response.text(), '{"status":"ok"}')
        from twisted.internet.task import deferLater

        await deferLater(reactor, 0.05, lambda: None)
        access = [e for e in captured.events if e.get("log_namespace") == "llmport_agent.ops.endpoint.access"]
        self.assertEqual(len(access), 1)
        self.assertEqual(access[0]["log_level"], LogLevel.debug)
        self.assertEqual(formatEvent(access[0]), "GET /healthz 200 15")
        self.assertEqual([formatEvent(e) for e in captured.events
                          if e.get("log_level") == LogLevel.info and "GET" in formatEvent(e)], [])
