"""
The contract between the command pipeline and the code that executes commands.

A handler is an C{async def handler(ctx: CommandContext) -> dict} coroutine function:

 - it returns the C{result} object of a successful C{command_result};
 - it raises L{CommandFailed} for a failure the user should read (C{error_code},
   C{error_message}, optional partial C{result});
 - it reports progress with C{ctx.progress(phase, message, progress_pct=..., ...)};
 - it must tolerate cancellation (the pipeline cancels it at its deadline or at stop):
   C{CancelledError} is raised at its current C{await}; clean up in C{finally}.

Handlers never see WebSocket frames, sequence numbers or the journal.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal, Protocol

from attrs import field

from llmport_agent.core.values import frozen

#: Lanes decide ordering. C{runtime}: commands for the same runtime id run one at a time in
#: arrival order. C{read}: never waits behind anything. C{node}: node-state commands, one at a
#: time in arrival order.
Lane = Literal["runtime", "read", "node"]

# Error codes in use (protocol 4, plus the agent's own).
INVALID_COMMAND = "invalid_command"
POLICY_VIOLATION = "policy_violation"
RUNTIME_ERROR = "runtime_error"
INTERNAL_ERROR = "internal_error"
SIGNATURE_INVALID = "signature_invalid"
COMMAND_EXPIRED = "command_expired"
TIMED_OUT = "timed_out"
AGENT_RESTARTED = "agent_restarted"
#: A handler's result could not be serialised to JSON; answered instead of losing it (10.4).
RESULT_NOT_SERIALIZABLE = "result_not_serializable"
#: stop/remove of a runtime whose named container exists but is not this agent's (issue 21).
CONTAINER_NOT_OWNED = "container_not_owned"


class CommandFailed(Exception):
    """
    A command failed in a way the user should be told about.

    @ivar error_code: a short machine code (<= 128 chars), e.g. C{runtime_error}.
    @ivar error_message: one human sentence saying what happened and what to do.
    @ivar result: an optional partial result object.
    """

    def __init__(
        self, error_code: str, error_message: str, result: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(error_message)
        self.error_code = error_code[:128]
        self.error_message = error_message
        self.result: dict[str, Any] = dict(result or {})


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except (ValueError, AttributeError, TypeError):
        return False
    return True


@frozen
class Command:
    """One command as the backend sent it, already validated for shape."""

    id: str
    command_type: str
    payload: dict[str, Any]
    correlation_id: str | None = None
    idempotency_key: str | None = None
    timeout_sec: int | None = None
    issued_at: str | None = None
    raw: dict[str, Any] = field(factory=dict, eq=False, repr=False)

    @property
    def runtime_id(self) -> str | None:
        """The payload's C{runtime_id} when it is a non-empty string."""
        rid = self.payload.get("runtime_id")
        return rid if isinstance(rid, str) and rid else None

    @property
    def reply_correlation_id(self) -> str:
        """The C{correlation_id} to put on frames: the command's, or its id when null."""
        return self.correlation_id or self.id


class CommandContext(Protocol):
    """What a running handler may use."""

    command: Command
    reactor: Any

    def progress(self, phase: str, message: str, **extra: Any) -> None:
        """
        Send one C{command_progress} frame (C{phase}, C{message}, plus C{extra} keys such as
        C{progress_pct}, C{bytes_done}, C{bytes_total}). Never sent after the result.
        """

    def emit_event(
        self,
        event_type: str,
        payload: Mapping[str, Any],
        severity: str = "info",
        correlation_id: str | None = None,
    ) -> None:
        """Queue one event for the next C{event_batch} (durable outbox)."""

    def after_result(self, fn: Callable[[], None]) -> None:
        """
        Call C{fn} once the backend confirmed it has this command's result (an event that
        must follow the result, such as C{workload.health.running} after an update).
        """


Handler = Callable[[CommandContext], Awaitable[dict[str, Any]]]


@frozen
class HandlerSpec:
    """
    How the pipeline runs one command type.

    @ivar idempotent: safe to run again after an agent restart interrupted it; otherwise the
        interrupted command gets a failed result C{agent_restarted}.
    @ivar deadline: seconds before the command is cancelled with C{timed_out}.
    @ivar blocked_by_maintenance: refused with C{policy_violation} in maintenance mode.
    @ivar blocked_by_draining: refused with C{policy_violation} while draining.
    @ivar keep_result: keep the full result in the journal after delivery (small results
        only; logs and diagnostics are dropped once delivered).
    @ivar on_arrival: called with the command when the pipeline takes it to run, before it
        waits for its lane (a stop or remove ends the readiness wait of a start of the same
        runtime that holds the lane: L{WorkloadManager.superseding}). Must not block or raise.
    """

    handler: Handler
    lane: Lane
    idempotent: bool
    deadline: float
    blocked_by_maintenance: bool = False
    blocked_by_draining: bool = False
    keep_result: bool = True
    on_arrival: Callable[[Command], None] | None = None


def is_uuid(value: object) -> bool:
    """True when C{value} is a string that parses as a UUID."""
    return isinstance(value, str) and _is_uuid(value)
