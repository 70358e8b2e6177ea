"""
Readiness: probe the workload's health path on C{127.0.0.1:<host port>} until it answers.

The advertised address may not be reachable from the host itself, so probes always go to
loopback. Success is an HTTP answer with a 2xx or 3xx status from the endpoint (llama.cpp
and TGI answer 503 while the model loads). If the container exits while we wait, the wait
fails at once with its exit code and last log lines; on timeout it fails with
C{readiness_timeout} and leaves the container for inspection.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import deferLater
from twisted.logger import Logger

from llmport_agent.core.httpbody import drop_body
from llmport_agent.core.values import frozen

from ..commands.base import CommandFailed

READINESS_TIMEOUT = "readiness_timeout"
CONTAINER_EXITED = "container_exited"

#: The backend keeps the first 2000 characters of a failed deploy's C{error_message} as the
#: runtime's message (protocol 10.4): a readiness failure says everything within them.
MESSAGE_LIMIT = 2000
#: At most this many of the container's last log lines end a readiness failure (10.4).
LOG_TAIL_LINES = 200
#: The sentence before the log lines keeps at most this much of the budget.
_HEAD_LIMIT = 700
_TAIL_HEADER = "\n--- last log lines of the container ---\n"

log = Logger()


@frozen
class ContainerExit:
    """A container that stopped (or is restarting) while we waited for it."""

    status: str
    exit_code: int
    restart_count: int
    logs_tail: str
    error: str = ""


def probe_url(host_port: int, path: str) -> str:
    """C{http://127.0.0.1:<port><path>}."""
    if not path.startswith("/"):
        path = "/" + path
    return f"http://127.0.0.1:{host_port}{path}"


def make_treq_probe(http: Any, timeout: float = 5.0) -> Callable[[str], Deferred[int]]:
    """
    A probe on a treq C{HTTPClient}: GET the URL, read (and drop) the body, fire with the
    status code. Redirects are not followed: a 3xx is an answer.
    """

    async def _probe(url: str) -> int:
        # Unbuffered, and the body is not read (the connection is closed): the endpoint is the
        # workload's, and an endless answer (or one that never comes) must cost the agent nothing.
        response = await http.get(url, timeout=timeout, allow_redirects=False, unbuffered=True)
        code = int(response.code)
        try:
            drop_body(response)
        except Exception:  # noqa: BLE001 - the status is what counts
            pass
        return code

    def probe(url: str) -> Deferred[int]:
        return Deferred.fromCoroutine(_probe(url))

    return probe


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(0, limit - 1)].rstrip() + "\u2026"


def with_log_tail(head: str, logs: str, *, limit: int = MESSAGE_LIMIT, lines: int = LOG_TAIL_LINES) -> str:
    """
    C{head} (one readable sentence, kept whole up to about a third of C{limit}), then the
    newest of the container's last C{lines} log lines that fit in C{limit} characters in all.
    Lines are dropped whole from the oldest end (a note says how many); a single line too
    long for what is left is cut at its end. Linear in the size of C{logs}.
    """
    head = _clip(head.rstrip(), min(_HEAD_LIMIT, limit))
    rows = [row.rstrip() for row in logs.replace("\r\n", "\n").split("\n")]
    while rows and not rows[-1]:
        rows.pop()
    while rows and not rows[0]:
        rows.pop(0)
    rows = rows[-lines:]
    if not rows:
        return head
    budget = limit - len(head) - len(_TAIL_HEADER)
    # Room for the note about dropped lines, written only when lines are dropped.
    note_room = len(f"[{len(rows)} earlier lines not shown]\n")
    kept: list[str] = []
    used = 0
    for row in reversed(rows):
        cost = len(row) + (1 if kept else 0)
        if used + cost > budget - (note_room if len(kept) + 1 < len(rows) else 0):
            break
        kept.append(row)
        used += cost
    if not kept:
        room = budget - note_room
        if room < 20:
            return head
        kept = [_clip(rows[-1], room)]
    kept.reverse()
    dropped = len(rows) - len(kept)
    body = "\n".join(kept)
    if dropped:
        body = f"[{dropped} earlier lines not shown]\n" + body
    return head + _TAIL_HEADER + body


class ReadinessFailed(CommandFailed):
    """
    C{readiness_timeout} or C{container_exited}: the message is L{with_log_tail} of a sentence
    and the container's last log lines, kept apart (C{summary}, C{logs}) so that a caller that
    says more (an update's rollback) can build a message of its own within the same bound.
    """

    def __init__(self, error_code: str, summary: str, logs: str, result: dict[str, Any]) -> None:
        super().__init__(error_code, with_log_tail(summary, logs), result)
        self.summary = summary
        self.logs = logs

    def reworded(self, summary: str) -> str:
        """C{summary} (which should include L{summary}) followed by the same log lines, bounded."""
        return with_log_tail(summary, self.logs)


def exit_summary(container_name: str, exit_info: ContainerExit) -> str:
    """The sentence for a container that exited during startup (without its log lines)."""
    code = str(exit_info.exit_code) if exit_info.exit_code >= 0 else "unknown"
    text = (
        f"Container {container_name} stopped while starting up "
        f"(status {exit_info.status}, exit code {code}"
    )
    if exit_info.restart_count:
        text += f", restarted {exit_info.restart_count} times"
    text += ")"
    if exit_info.error:
        text += f": {exit_info.error}"
    text += "."
    return text


def describe_exit(container_name: str, exit_info: ContainerExit) -> str:
    """One readable sentence, then the bounded log tail, for a container that exited during startup."""
    return with_log_tail(exit_summary(container_name, exit_info), exit_info.logs_tail)


async def wait_ready(
    reactor: Any,
    *,
    url: str,
    container_name: str,
    probe: Callable[[str], Deferred[int]],
    check_exit: Callable[[], Awaitable[ContainerExit | None]],
    progress: Callable[[float], None],
    timeout: float,
    interval: float = 1.0,
    progress_every: float = 15.0,
    read_logs: Callable[[], Awaitable[str]] | None = None,
    stopped: Callable[[], bool] | None = None,
) -> float:
    """
    Probe C{url} until it answers 2xx/3xx; return the seconds it took.

    @param check_exit: returns a L{ContainerExit} once the container has stopped.
    @param progress: called with the elapsed seconds about every C{progress_every}.
    @param read_logs: returns the container's last log lines (for the timeout's message).
    @param stopped: when it says so, the wait ends (C{CancelledError}) at its next step: a
        cancelled probe reads like a probe that got no answer, so cancelling alone could leave
        the loop probing until the timeout.
    @raise CommandFailed: C{container_exited} (exit code and last log lines) or
        C{readiness_timeout} (the last log lines too); either message is at most
        L{MESSAGE_LIMIT} characters.
    """
    start = reactor.seconds()
    last_progress = start
    last_problem = "no answer yet"
    def check_stopped() -> None:
        if stopped is not None and stopped():
            raise CancelledError()

    while True:
        check_stopped()
        try:
            status = await probe(url)
        except CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure to answer is "not ready"
            status = None
            last_problem = f"{type(exc).__name__}"
        if status is not None:
            if 200 <= status < 400:
                return reactor.seconds() - start
            last_problem = f"HTTP {status}"
        check_stopped()
        exited = await check_exit()
        check_stopped()
        if exited is not None:
            raise ReadinessFailed(
                CONTAINER_EXITED,
                exit_summary(container_name, exited),
                exited.logs_tail,
                {"exit_code": exited.exit_code, "status": exited.status},
            )
        now = reactor.seconds()
        elapsed = now - start
        if elapsed >= timeout:
            logs = ""
            if read_logs is not None:
                try:
                    logs = await read_logs()
                except CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the timeout is the failure to report
                    log.info("Could not read the logs of {name}: {why}", name=container_name, why=exc)
            raise ReadinessFailed(
                READINESS_TIMEOUT,
                f"Container {container_name} did not become ready within {timeout:g} s "
                f"({url} last gave: {last_problem}). The container was left running for "
                "inspection.",
                logs,
                {"elapsed_sec": round(elapsed, 1)},
            )
        if now - last_progress >= progress_every:
            last_progress = now
            progress(elapsed)
        await deferLater(reactor, min(interval, max(0.0, timeout - elapsed)), lambda: None)
