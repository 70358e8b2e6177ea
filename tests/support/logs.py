"""Helpers shared by the log shipping tests (tests/test_logs*.py)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any, cast

from twisted.internet.defer import Deferred, succeed
from twisted.logger import ILogObserver, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from llmport_agent.logs.encoding import Entry
from llmport_agent.logs.loki import ILogSink

#: The agent id the log tests run their sources with (containers of others are not read).
TEST_AGENT_ID = "logs-test-agent"


def run_managed(client: Any, script: str, prefix: str = "logs", agent_id: str = TEST_AGENT_ID, **kw: Any) -> Any:
    """A busybox container running C{script}, labelled as one the agent C{agent_id} manages."""
    from llmport_agent.workloads.spec import (
        LABEL_AGENT_ID,
        LABEL_MANAGED,
        LABEL_RUNTIME_ID,
        MANAGED_VALUE,
    )
    from tests.support.docker_env import BUSYBOX

    runtime_id = str(uuid.uuid4())
    return client.containers.run(
        BUSYBOX, ["sh", "-c", script], name=f"{prefix}-{runtime_id[:8]}",
        labels={LABEL_MANAGED: MANAGED_VALUE, LABEL_RUNTIME_ID: runtime_id, LABEL_AGENT_ID: agent_id},
        network_mode="none", detach=True, **kw,
    )


def engine_lines(client: Any, container_id: str) -> list[str]:
    """What the engine recorded for a container, in time order (the truth to compare with)."""
    from llmport_agent.logs.docker_logs import parse_timestamp

    raw = client.api.logs(container_id, stdout=True, stderr=True, timestamps=True)
    lines = []
    for line in raw.decode("utf-8", "replace").split("\n"):
        if line:
            ts, _, text = line.partition(" ")
            parsed = parse_timestamp(ts.encode() + b" ")
            lines.append((parsed[0] if parsed else 0, text))
    return [text for _, text in sorted(lines, key=lambda x: x[0])]


CREDENTIAL = f"{uuid.UUID(int=0x1234)}.{'A' * 20}-_{'b' * 21}"
TOKEN = "Zx9_" + "q" * 24 + "-K3w"  # 32 url-safe characters, like an enrollment token
LABELS = {"job": "node-agent", "host": "10.0.0.5", "container": "node-n1", "agent_id": "n1", "level": "info"}


def labels(**extra: str) -> dict[str, str]:
    return dict(LABELS, **extra)


def capture_events(case: SynchronousTestCase) -> list[dict[str, Any]]:
    """Record every log event published while the test runs."""
    events: list[dict[str, Any]] = []
    observer = cast(ILogObserver, events.append)
    globalLogPublisher.addObserver(observer)
    case.addCleanup(globalLogPublisher.removeObserver, observer)
    return events


@implementer(ILogSink)
class RecordingSink:
    """An ILogSink that records pushes; the test decides what is delivered and how full it is."""

    def __init__(self) -> None:
        self.pushed: list[tuple[dict[str, str], int, str]] = []
        self.delivered = 0
        self.level = 0.0
        self.flushes: list[float] = []
        self.flush_result: Deferred[bool] | None = None
        self.room: list[Deferred[None]] = []

    def push(self, labels: Mapping[str, str], ts_ns: int, line: str) -> int:
        self.pushed.append((dict(labels), ts_ns, line))
        return len(self.pushed)

    def push_many(self, entries: Sequence[Entry], size: int | None = None) -> int:
        for key, ts, line in entries:
            self.pushed.append((dict(key), ts, line))
        return len(self.pushed)

    def delivered_through(self) -> int:
        return self.delivered

    def flush(self, timeout: float) -> Deferred[bool]:
        self.flushes.append(timeout)
        if self.flush_result is not None:
            return self.flush_result
        self.delivered = len(self.pushed)
        return succeed(True)

    def pressure(self) -> float:
        return self.level

    def when_room(self) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        if self.level <= 0.5:
            d.callback(None)
        else:
            self.room.append(d)
        return d

    def set_level(self, level: float) -> None:
        """Change the pressure; at or below 0.5 the room waiters fire."""
        self.level = level
        if level <= 0.5:
            waiters, self.room = self.room, []
            for d in waiters:
                d.callback(None)

    def lines(self) -> list[str]:
        return [p[2] for p in self.pushed]
