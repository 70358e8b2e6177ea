"""A recording fake of L{llmport_agent.commands.base.CommandContext}."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any

from llmport_agent.commands.base import Command


def make_command(command_type: str, payload: dict[str, Any], command_id: str | None = None) -> Command:
    """A L{Command} as the pipeline would hand it to a handler."""
    cid = command_id or str(uuid.uuid4())
    return Command(
        id=cid,
        command_type=command_type,
        payload=payload,
        correlation_id=None,
        idempotency_key=f"{command_type}:{payload.get('runtime_id', '')}",
        timeout_sec=900,
    )


class RecordingContext:
    """
    Records every progress frame and event; C{on_progress} callbacks let a test act when
    a phase is reached (e.g. stop the engine during C{waiting_for_ready}).
    """

    def __init__(self, command: Command, reactor: Any) -> None:
        self.command = command
        self.reactor = reactor
        self.frames: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.on_progress: list[Callable[[dict[str, Any]], None]] = []
        #: after_result actions, run by L{delivered} (the pipeline runs them on confirmation).
        self.after: list[Callable[[], None]] = []

    def progress(self, phase: str, message: str, **extra: Any) -> None:
        frame = {"phase": phase, "message": message, **extra}
        self.frames.append(frame)
        for callback in list(self.on_progress):
            callback(frame)

    def emit_event(
        self,
        event_type: str,
        payload: Mapping[str, Any],
        severity: str = "info",
        correlation_id: str | None = None,
    ) -> None:
        self.events.append(
            {
                "event_type": event_type,
                "payload": dict(payload),
                "severity": severity,
                "correlation_id": correlation_id,
            }
        )

    def after_result(self, fn: Callable[[], None]) -> None:
        self.after.append(fn)

    def delivered(self) -> None:
        """The result reached the backend: run the after_result actions."""
        after, self.after = self.after, []
        for fn in after:
            fn()

    def phases(self) -> list[str]:
        """Phases in first-seen order."""
        out: list[str] = []
        for frame in self.frames:
            if frame["phase"] not in out:
                out.append(frame["phase"])
        return out

    def frames_of(self, phase: str) -> list[dict[str, Any]]:
        return [f for f in self.frames if f["phase"] == phase]

    def event_types(self) -> list[str]:
        return [e["event_type"] for e in self.events]
