"""
A readiness failure's C{error_message} (protocol 10.4): it ends with the container's last log
lines (up to 200), and the whole message is at most 2000 characters (what the backend keeps as
the runtime's message), with the sentence that says what happened kept whole at its head.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.base import CommandFailed
from llmport_agent.workloads.readiness import (
    CONTAINER_EXITED,
    LOG_TAIL_LINES,
    MESSAGE_LIMIT,
    READINESS_TIMEOUT,
    ContainerExit,
    describe_exit,
    wait_ready,
    with_log_tail,
)

HEAD = "Container llm-port-x did not become ready within 600 s (http://127.0.0.1:8000/health last gave: HTTP 503)."


def lines(n: int, width: int = 10) -> str:
    return "\n".join(f"line {i:04d} " + "x" * width for i in range(n))


class WithLogTailTests(SynchronousTestCase):
    def test_short_logs_kept_whole(self) -> None:
        """Short logs: the head, a separator, every line, in order, nothing cut."""
        text = with_log_tail(HEAD, "loading weights\nCUDA out of memory\n")
        self.assertTrue(text.startswith(HEAD))
        self.assertTrue(text.endswith("loading weights\nCUDA out of memory"))
        self.assertNotIn("not shown", text)

    def test_bounded_newest_lines_kept(self) -> None:
        """Long logs: at most 2000 characters; the newest lines kept whole, a note for the rest."""
        text = with_log_tail(HEAD, lines(150, 40))
        self.assertLessEqual(len(text), MESSAGE_LIMIT)
        self.assertGreater(len(text), MESSAGE_LIMIT - 80)  # the budget is used, not wasted
        self.assertTrue(text.startswith(HEAD))
        self.assertTrue(text.endswith("line 0149 " + "x" * 40))
        body = text.split("--- last log lines of the container ---\n", 1)[1]
        first, *kept = body.split("\n")
        self.assertRegex(first, r"^\[\d+ earlier lines not shown\]$")
        self.assertEqual(int(first[1:].split()[0]) + len(kept), 150)
        for row in kept:  # whole lines only
            self.assertRegex(row, r"^line \d{4} x{40}$")

    def test_at_most_200_lines(self) -> None:
        """Never more than 200 log lines, however short."""
        text = with_log_tail("x", lines(400, 0), limit=100_000)
        body = text.split("--- last log lines of the container ---\n", 1)[1]
        self.assertEqual(len(body.split("\n")), LOG_TAIL_LINES)
        self.assertTrue(body.endswith("line 0399"))

    def test_one_huge_line_is_cut_not_dropped(self) -> None:
        """A single line longer than what is left is cut; the message stays bounded."""
        text = with_log_tail(HEAD, "Traceback: " + "y" * 10_000)
        self.assertLessEqual(len(text), MESSAGE_LIMIT)
        self.assertIn("Traceback: yyy", text)
        self.assertTrue(text.startswith(HEAD))

    def test_huge_head_cut_but_logs_still_shown(self) -> None:
        """A very long head is cut to leave room for the logs."""
        text = with_log_tail("H" * 5000, "the crash line")
        self.assertLessEqual(len(text), MESSAGE_LIMIT)
        self.assertTrue(text.endswith("the crash line"))
        self.assertTrue(text.startswith("HHHH"))

    def test_no_logs(self) -> None:
        self.assertEqual(with_log_tail(HEAD, "\n\n"), HEAD)

    def test_exit_description_bounded(self) -> None:
        """container_exited: the exit sentence, then the bounded log tail."""
        text = describe_exit("llm-port-x", ContainerExit("exited", 1, 0, lines(300, 30)))
        self.assertLessEqual(len(text), MESSAGE_LIMIT)
        self.assertTrue(text.startswith("Container llm-port-x stopped while starting up (status exited, exit code 1)."))
        self.assertTrue(text.endswith("line 0299 " + "x" * 30))


class WaitReadyTimeoutTests(SynchronousTestCase):
    def run_until_timeout(self, read_logs: Any) -> CommandFailed:
        clock = Clock()

        def probe(url: str) -> Deferred[int]:
            return succeed(503)

        d = Deferred.fromCoroutine(
            wait_ready(
                clock,
                url="http://127.0.0.1:8000/health",
                container_name="llm-port-x",
                probe=probe,
                check_exit=lambda: succeed(None),  # type: ignore[arg-type,return-value]
                progress=lambda _e: None,
                timeout=600,
                interval=5,
                read_logs=read_logs,
            )
        )
        for _ in range(130):
            clock.advance(5)
        return self.failureResultOf(d, CommandFailed).value

    def test_timeout_ends_with_log_tail(self) -> None:
        """Not ready within the budget: readiness_timeout, the message ends with the log tail."""
        calls: list[int] = []

        def read_logs() -> Deferred[str]:
            calls.append(1)
            return succeed(lines(500, 30))

        exc = self.run_until_timeout(read_logs)
        self.assertEqual(exc.error_code, READINESS_TIMEOUT)
        self.assertEqual(len(calls), 1)
        self.assertTrue(exc.error_message.startswith("Container llm-port-x did not become ready within 600 s"))
        self.assertIn("HTTP 503", exc.error_message)
        self.assertTrue(exc.error_message.endswith("line 0499 " + "x" * 30))
        self.assertLessEqual(len(exc.error_message), MESSAGE_LIMIT)

    def test_logs_unreadable_still_fails_clearly(self) -> None:
        """A log read that fails does not hide the timeout."""
        exc = self.run_until_timeout(lambda: fail(RuntimeError("engine gone")))
        self.assertEqual(exc.error_code, READINESS_TIMEOUT)
        self.assertIn("did not become ready", exc.error_message)

    def test_exit_uses_same_bound(self) -> None:
        clock = Clock()
        d = Deferred.fromCoroutine(
            wait_ready(
                clock,
                url="http://127.0.0.1:8000/health",
                container_name="llm-port-x",
                probe=lambda url: succeed(503),
                check_exit=lambda: succeed(ContainerExit("exited", 2, 0, lines(400, 50))),  # type: ignore[arg-type,return-value]
                progress=lambda _e: None,
                timeout=600,
            )
        )
        exc = self.failureResultOf(d, CommandFailed).value
        self.assertEqual(exc.error_code, CONTAINER_EXITED)
        self.assertLessEqual(len(exc.error_message), MESSAGE_LIMIT)
        self.assertTrue(exc.error_message.endswith("line 0399 " + "x" * 50))
