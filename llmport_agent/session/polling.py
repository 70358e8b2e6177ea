"""
Command polling (protocol 3.2) and the dispatch mode (protocol 10.1): a poll frame carries no
C{seq} and leaves when nothing else was sent for the poll interval, fast while the node is
active, slow when idle; none at all once the backend has shown that it pushes commands.

L{Polling} owns the next poll, when a frame was last sent, when the node was last active, and
the L{DispatchDetector}. The session tells it what happens on the stream (L{Polling.opened},
L{Polling.closed}, L{Polling.frame_sent}, L{Polling.frame_received}, L{Polling.note_activity});
it sends a poll through C{send_poll}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.logger import Logger

from llmport_agent.core.config import AgentConfig
from llmport_agent.core.state import StateStore, token_fingerprint
from llmport_agent.session.dispatch import PUSH, DispatchDetector

#: Outbound frame types that mean a command is being worked on (activity for the poll rate).
COMMAND_FRAMES = frozenset({"command_ack", "command_progress", "command_result"})


class Polling:
    """
    @param busy: how many commands are running or have a result not yet confirmed; the node
        polls fast while it is above 0.
    @param send_poll: sends one poll frame (no C{seq}); False when it could not.
    @param connected: whether the stream is open.
    @param stopping: whether the session is stopping.
    @ivar dispatch: the L{DispatchDetector} (push or polling).
    @ivar last_sent_at: reactor time of the last frame sent (or of the open).
    """

    def __init__(
        self,
        *,
        clock: Any,
        config: AgentConfig,
        state: StateStore,
        wallclock: Callable[[], float],
        log: Logger,
        busy: Callable[[], int] | None,
        send_poll: Callable[[], bool],
        connected: Callable[[], bool],
        stopping: Callable[[], bool],
    ) -> None:
        self._clock = clock
        self._config = config
        self._state = state
        self._wallclock = wallclock
        self._log = log
        self._busy = busy
        self._send_poll = send_poll
        self._connected = connected
        self._stopping = stopping
        self._poll: Any = None  # IDelayedCall: the next poll frame, pushed back by every frame sent
        self.last_sent_at = 0.0
        #: Reactor time of the last connect or command activity (None: never).
        self._last_activity: float | None = None
        self._dispatch_said = False
        self.dispatch = DispatchDetector(clock.seconds, self._dispatch_changed)

    # -- what the session tells it -------------------------------------------------------

    def opened(self) -> None:
        """The stream opened: a connect counts as activity."""
        self.last_sent_at = self._clock.seconds()
        # A connect counts as activity: the first command after a node (re)connects is
        # picked up as fast as the next ones.
        self._last_activity = self.last_sent_at
        self.dispatch.connection_opened()
        self.schedule()

    def say_mode_once(self) -> None:
        """The dispatch mode, said once per run (at the first open, or when it changes)."""
        if not self._dispatch_said:
            self._dispatch_said = True
            self._say_mode()

    def closed(self) -> None:
        self.cancel()
        self.dispatch.connection_closed()

    def frame_sent(self, kind: str) -> None:
        self.last_sent_at = self._clock.seconds()
        self.dispatch.frame_sent()
        if kind in COMMAND_FRAMES:
            self._last_activity = self.last_sent_at
        self.schedule()

    def frame_received(self, kind: Any, items: Any) -> None:
        """A frame came in: C{items} are the commands it lists (hello_ack or commands), or None."""
        if isinstance(items, list):
            if kind == "hello_ack":
                self.dispatch.hello_received(items)
            else:
                self.dispatch.commands_received(items)
        if isinstance(items, list) and items:
            self.note_activity()

    def note_activity(self) -> None:
        """A command arrived or is being worked on: poll fast from now on (for the window)."""
        now = self._clock.seconds()
        was_active = self.poll_active(now)
        self._last_activity = now
        if not was_active and self._connected():
            self.schedule()

    def restore_mode(self, opens: int) -> None:
        """The mode remembered in the state file for this backend URL (loaded by now)."""
        remembered = self._state.get("dispatch")
        if (
            isinstance(remembered, dict)
            and remembered.get("backend") == token_fingerprint(self._config.backend_url)
            and remembered.get("mode") == PUSH
            and opens == 0
        ):
            self.dispatch.restore(
                PUSH, "remembered: the backend at this URL pushed commands before (polling resumes "
                "at the first sign that it answers frames instead)",
            )

    # -- the rate --------------------------------------------------------------------------

    def poll_active(self, now: float | None = None) -> bool:
        """True while polls go every COMMAND_POLL_INTERVAL_SEC (see the module docstring)."""
        if self._busy is not None:
            try:
                if self._busy() > 0:
                    return True
            except Exception:
                self._log.failure("Could not tell whether commands are running")
                return True
        last = self._last_activity
        if last is None:
            return False
        now = self._clock.seconds() if now is None else now
        return now - last < self._config.command_poll_active_window_sec

    def poll_interval(self) -> float:
        """Seconds from the last frame sent to the next poll, as things stand now."""
        if self.poll_active():
            return self._config.command_poll_interval_sec
        return self._config.poll_idle_interval

    # -- the timer -------------------------------------------------------------------------

    def schedule(self, since: float | None = None) -> None:
        """
        (Re)arm the poll: the next frame leaves at most one poll interval after the last one
        sent (or after C{since}).
        """
        if not self._connected() or self._stopping():
            return
        if self.dispatch.push:
            # The backend sends each command as it is queued: a poll would buy nothing.
            self.cancel()
            return
        now = self._clock.seconds()
        base = self.last_sent_at if since is None else since
        delay = max(0.0, base + self.poll_interval() - now)
        if self._poll is not None and self._poll.active():
            self._poll.reset(delay)
        else:
            self._poll = self._clock.callLater(delay, self._poll_now)

    def cancel(self) -> None:
        poll, self._poll = self._poll, None
        if poll is not None and poll.active():
            poll.cancel()

    def _poll_now(self) -> None:
        self._poll = None
        # No seq: a poll has no side effects, and a frame without seq spares the backend its
        # session-offset write (protocol 3.2).
        if self._connected() and not self._send_poll():
            self.schedule(since=self._clock.seconds())

    # -- the mode --------------------------------------------------------------------------

    def _say_mode(self) -> None:
        if self.dispatch.push:
            self._log.info("Command dispatch: push, no polling ({reason})", reason=self.dispatch.reason)
        else:
            self._log.info(
                "Command dispatch: polling, every {fast:g} s while active and {idle:g} s when idle "
                "({reason}); it stops if the backend shows that it pushes commands",
                fast=self._config.command_poll_interval_sec,
                idle=self._config.poll_idle_interval,
                reason=self.dispatch.reason,
            )

    def _dispatch_changed(self, mode: str, reason: str) -> None:
        self._dispatch_said = True
        if mode == PUSH:
            self._log.info("Command dispatch: push, polling stopped ({reason})", reason=reason)
            self.cancel()
        else:
            self._log.info("Command dispatch: back to polling ({reason})", reason=reason)
            self.schedule()
        self._state.note(
            dispatch={
                # A fingerprint: the URL may carry user info.
                "backend": token_fingerprint(self._config.backend_url),
                "mode": mode,
                "since": self._wallclock(),
            }
        )
