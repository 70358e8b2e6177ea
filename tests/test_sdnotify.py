"""
sd_notify on real Unix datagram sockets: READY, STATUS, the watchdog cadence (and its silence
while the reactor is blocked), STOPPING; path and abstract addresses; the environment handling.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock, deferLater
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmport_agent.host.sdnotify import Notifier, NotifyService, status_line, watchdog_interval


class Receiver:
    """A bound datagram socket; a thread records (monotonic time, message) for each datagram."""

    def __init__(self, abstract: bool = False) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"llmport-test-{os.getpid()}-{id(self)}"
            self.sock.bind("\0" + name)
            self.address = "@" + name
        else:
            self.dir = tempfile.mkdtemp(prefix="sdn-")
            self.address = os.path.join(self.dir, "notify")
            self.sock.bind(self.address)
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, str]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode()))

    def texts(self) -> list[str]:
        return [m for _, m in self.messages]

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()


class EnvironmentTests(SynchronousTestCase):
    def test_reads_and_removes_variables(self) -> None:
        """NOTIFY_SOCKET and WATCHDOG_* are read once and not inherited by children."""
        env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "42", "KEEP": "1"}
        n = Notifier(env, pid=42)
        self.assertEqual(n.address, "/run/x")
        self.assertEqual(n.watchdog_sec, 15.0)
        self.assertEqual(env, {"KEEP": "1"})

    def test_abstract_address(self) -> None:
        n = Notifier({"NOTIFY_SOCKET": "@sd-notify"}, pid=1)
        self.assertEqual(n.address, b"\0sd-notify")

    def test_watchdog_for_another_process(self) -> None:
        """WATCHDOG_PID of another process: no pings (unless it is the one-file bootloader)."""
        self.assertIsNone(watchdog_interval({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "7"}, 8))
        self.assertEqual(watchdog_interval({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "7"}, 8, ppid=7), 0.5)
        self.assertIsNone(watchdog_interval({"WATCHDOG_USEC": "x"}, 8))
        self.assertIsNone(watchdog_interval({}, 8))

    def test_without_socket_everything_is_a_noop(self) -> None:
        n = Notifier({}, pid=1)
        self.assertFalse(n.enabled)
        self.assertFalse(n.notify("READY=1"))
        svc = NotifyService(Clock(), n, lambda: "x")
        svc.startService()
        svc.ready()
        svc.stopping("bye")
        svc.stopService()
        self.assertEqual(n.sent, [])

    def test_status_is_one_bounded_line(self) -> None:
        self.assertEqual(status_line("a\nb   c"), "a b c")
        self.assertEqual(len(status_line("x" * 5000)), 400)

    def test_send_failure_does_not_raise(self) -> None:
        n = Notifier({"NOTIFY_SOCKET": "/nonexistent/notify"}, pid=1)
        self.assertFalse(n.notify("READY=1"))


class SocketTests(TestCase):
    def receiver(self, abstract: bool = False) -> Receiver:
        r = Receiver(abstract)
        self.addCleanup(r.close)
        return r

    async def wait_for(self, predicate: Any, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                self.fail("timed out")
            await deferLater(reactor, 0.02, lambda: None)

    async def test_ready_status_watchdog_stopping_on_a_real_socket(self) -> None:
        """READY=1 with STATUS, STATUS on change only, WATCHDOG=1 every interval, STOPPING=1."""
        r = self.receiver()
        clock = Clock()
        status = {"text": "connecting, node -"}
        n = Notifier({"NOTIFY_SOCKET": r.address, "WATCHDOG_USEC": "2000000"}, pid=os.getpid())
        svc = NotifyService(clock, n, lambda: status["text"])
        svc.startService()
        svc.ready()
        for _ in range(4):
            clock.advance(1.0)  # watchdog every WATCHDOG_USEC / 2 = 1 s
        svc.update_status()  # unchanged: nothing sent
        status["text"] = "connected, node n-1, 3 workloads"
        for _ in range(5):
            clock.advance(1.0)  # the status loop (every 5 s) notices the change
        svc.stopping("stopping: draining, 1 command(s) running")
        svc.stopService()
        await self.wait_for(lambda: any("STOPPING=1" in m for m in r.texts()))
        texts = r.texts()
        self.assertEqual(texts[0], "WATCHDOG=1")
        self.assertIn("READY=1\nSTATUS=connecting, node -", texts)
        self.assertEqual(texts.count("WATCHDOG=1"), 10)  # at start, 4 advances, then 5 more
        self.assertEqual([t for t in texts if t.startswith("STATUS=")],
                         ["STATUS=connected, node n-1, 3 workloads"])
        self.assertEqual(texts[-1], "STOPPING=1\nSTATUS=stopping: draining, 1 command(s) running")

    async def test_abstract_socket(self) -> None:
        r = self.receiver(abstract=True)
        n = Notifier({"NOTIFY_SOCKET": r.address}, pid=1)
        self.assertTrue(n.notify("READY=1"))
        await self.wait_for(lambda: r.texts() == ["READY=1"])
        n.close()

    async def test_watchdog_stops_while_the_reactor_is_blocked(self) -> None:
        """A blocked reactor sends no WATCHDOG=1 (so systemd restarts it); pings resume after."""
        r = self.receiver()
        n = Notifier({"NOTIFY_SOCKET": r.address, "WATCHDOG_USEC": "100000"}, pid=os.getpid())
        svc = NotifyService(reactor, n, lambda: "ok")
        svc.startService()
        self.addCleanup(svc.stopService)
        await self.wait_for(lambda: len(r.messages) >= 3)
        blocked: dict[str, float] = {}

        def block() -> None:
            blocked["start"] = time.monotonic()
            time.sleep(0.8)  # the reactor is stalled on purpose
            blocked["end"] = time.monotonic()

        done: Deferred[None] = deferLater(reactor, 0, block)
        await done
        count = len(r.messages)
        await self.wait_for(lambda: len(r.messages) >= count + 3)
        pings = [t for t, m in r.messages if m == "WATCHDOG=1"]
        during = [t for t in pings if blocked["start"] + 0.06 < t < blocked["end"] - 0.02]
        self.assertEqual(during, [])
        self.assertTrue([t for t in pings if t > blocked["end"]])
        # The cadence outside the block: about one ping per 50 ms, generous bounds.
        before = [t for t in pings if t < blocked["start"]]
        gaps = [b - a for a, b in zip(before, before[1:], strict=False)]
        self.assertTrue(gaps and max(gaps) < 0.5, gaps)
