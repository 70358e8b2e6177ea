"""
Command polling (protocol 3.2) and the dispatch mode (protocol 10.1): a poll frame carries no
C{seq} and leaves when nothing else was sent for the poll interval, fast while the node is
active, slow when idle; none at all once the backend has shown that it pushes commands.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmport_agent.core.state import token_fingerprint
from llmport_agent.session.dispatch import PUSH

if TYPE_CHECKING:
    from llmport_agent.session.service import SessionService


def note_activity(session: SessionService) -> None:
    """A command arrived or is being worked on: poll fast from now on (for the window)."""
    now = session._reactor.seconds()
    was_active = session.poll_active(now)
    session._last_activity = now
    if not was_active and session.proto is not None:
        session._schedule_poll()


def poll_active(session: SessionService, now: float | None = None) -> bool:
    """True while polls go every COMMAND_POLL_INTERVAL_SEC (see the module docstring)."""
    if session._busy is not None:
        try:
            if session._busy() > 0:
                return True
        except Exception:
            session.log.failure("Could not tell whether commands are running")
            return True
    last = session._last_activity
    if last is None:
        return False
    now = session._reactor.seconds() if now is None else now
    return now - last < session.config.command_poll_active_window_sec


def poll_interval(session: SessionService) -> float:
    """Seconds from the last frame sent to the next poll, as things stand now."""
    if session.poll_active():
        return session.config.command_poll_interval_sec
    return session.config.poll_idle_interval


def schedule_poll(session: SessionService, since: float | None = None) -> None:
    """
    (Re)arm the poll: the next frame leaves at most one poll interval after the last one
    sent (or after C{since}).
    """
    if session.proto is None or session._stopping:
        return
    if session.dispatch.push:
        # The backend sends each command as it is queued: a poll would buy nothing.
        session._cancel_poll()
        return
    now = session._reactor.seconds()
    base = session._last_sent_at if since is None else since
    delay = max(0.0, base + session.poll_interval() - now)
    if session._poll is not None and session._poll.active():
        session._poll.reset(delay)
    else:
        session._poll = session._reactor.callLater(delay, session._poll_now)


def cancel_poll(session: SessionService) -> None:
    poll, session._poll = session._poll, None
    if poll is not None and poll.active():
        poll.cancel()


def poll_now(session: SessionService) -> None:
    session._poll = None
    # No seq: a poll has no side effects, and a frame without seq spares the backend its
    # session-offset write (protocol 3.2).
    if session.proto is not None and not session._send({"type": "poll"}, seq=False):
        session._schedule_poll(since=session._reactor.seconds())


def restore_dispatch_mode(session: SessionService) -> None:
    """The mode remembered in the state file for this backend URL (loaded by now)."""
    remembered = session.state.get("dispatch")
    if (
        isinstance(remembered, dict)
        and remembered.get("backend") == token_fingerprint(session.config.backend_url)
        and remembered.get("mode") == PUSH
        and session.stats.opens == 0
    ):
        session.dispatch.restore(
            PUSH, "remembered: the backend at this URL pushed commands before (polling resumes "
            "at the first sign that it answers frames instead)",
        )


def say_dispatch_mode(session: SessionService) -> None:
    if session.dispatch.push:
        session.log.info("Command dispatch: push, no polling ({reason})", reason=session.dispatch.reason)
    else:
        session.log.info(
            "Command dispatch: polling, every {fast:g} s while active and {idle:g} s when idle "
            "({reason}); it stops if the backend shows that it pushes commands",
            fast=session.config.command_poll_interval_sec,
            idle=session.config.poll_idle_interval,
            reason=session.dispatch.reason,
        )


def dispatch_changed(session: SessionService, mode: str, reason: str) -> None:
    session._dispatch_said = True
    if mode == PUSH:
        session.log.info("Command dispatch: push, polling stopped ({reason})", reason=reason)
        session._cancel_poll()
    else:
        session.log.info("Command dispatch: back to polling ({reason})", reason=reason)
        session._schedule_poll()
    session.state.note(
        dispatch={
            # A fingerprint: the URL may carry user info.
            "backend": token_fingerprint(session.config.backend_url),
            "mode": mode,
            "since": session._wallclock(),
        }
    )
