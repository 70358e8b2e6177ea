"""
Values and narrow interfaces shared by the session's collaborators (L{SessionService} composes
them; none of them imports it): the counters, the listener interface, the exit status and help
line for "an operator must act", and the one-line retry note.
"""

from __future__ import annotations

from typing import Any, Protocol

from attrs import field
from twisted.logger import LogLevel

from llmport_agent.core.values import define

TOKEN_HELP = "mint a new one with POST /api/admin/system/nodes/enrollment-tokens"

#: Exit status reserved for "an operator must act" (EX_CONFIG); the systemd unit does not
#: restart on it.
EXIT_NEEDS_OPERATOR = 78

#: Inbound frame types counted by name (anything else the backend sends counts as "other").
INBOUND_TYPES = frozenset({"hello_ack", "commands", "command", "error", "ping", "pong"})


class SessionListener(Protocol):
    def session_opened(self) -> None: ...
    def session_closed(self) -> None: ...
    def frame_received(self, frame: dict[str, Any]) -> None: ...


class NoteRetry(Protocol):
    """
    What went wrong with a failed attempt, said with the retry delay in one line (the session's
    C{note_retry}); C{None} as the level: already said in a line of its own.
    """

    def __call__(self, level: LogLevel | None, fmt: str, **fields: Any) -> None: ...


@define
class SessionStats:
    connects: int = 0
    opens: int = 0
    refused: int = 0
    closes: int = 0
    frames_sent: int = 0
    frames_received: int = 0
    last_open_at: float | None = None
    last_close: dict[str, Any] = field(factory=dict)
    enrollments: int = 0
    rotations: int = 0
    rotation_errors: int = 0
    #: Frames by type (metrics); inbound types outside INBOUND_TYPES count as "other".
    frames_out: dict[str, int] = field(factory=dict)
    frames_in: dict[str, int] = field(factory=dict)
    last_error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "connects": self.connects,
            "opens": self.opens,
            "refused_upgrades": self.refused,
            "closes": self.closes,
            "frames_sent": self.frames_sent,
            "frames_received": self.frames_received,
            "last_open_at": self.last_open_at or 0,
            "last_close": dict(self.last_close),
            "enrollments": self.enrollments,
            "rotations": self.rotations,
            "rotation_errors": self.rotation_errors,
        }
