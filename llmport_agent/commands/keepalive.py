"""
Never silent for long (protocol 10.3): the current backend times out a command that stays silent
(no ack, progress or result) for 300 s on a connected node, however busy the agent really is.
So every command, from its ack to its result, sends C{command_progress} at least every
C{COMMAND_KEEPALIVE_SEC} (30 s): when nothing else was reported for that long, its last phase
again, marked C{"keepalive": true}, whatever the work underneath reports (a pull whose layers
stall, a readiness wait, a lane wait behind another deploy, a system update).

Handlers do nothing for it: the pipeline owns one L{ProgressKeepalive} per command in the works.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

#: Extra keys of a handler's progress frame repeated by a keepalive (the rest is the handler's).
REPEATED_KEYS = ("progress_pct", "progress", "bytes_done", "bytes_total", "layer", "image", "model_id")


class ProgressKeepalive:
    """
    Repeats a command's last progress once it has been silent for C{interval} seconds.

    @param send: sends one progress frame C{(phase, message, extra)}; False when it could not
        (disconnected: tried again an interval later).
    """

    def __init__(
        self,
        clock: Any,
        interval: float,
        send: Callable[[str, str, dict[str, Any]], bool],
        phase: str,
        message: str,
    ) -> None:
        self._clock = clock
        self.interval = interval
        self._send = send
        self.phase = phase
        self.message = message
        self.extra: dict[str, Any] = {}
        self.last_sent = clock.seconds()
        self.sent = 0
        self._call: Any = clock.callLater(interval, self._due)

    @property
    def active(self) -> bool:
        return self._call is not None

    def reported(self, phase: str, message: str, extra: Mapping[str, Any], sent: bool) -> None:
        """The command reported progress itself: remember it; silence counts from now if it left."""
        self.phase, self.message = phase, message
        self.extra = {k: extra[k] for k in REPEATED_KEYS if k in extra}
        if sent:
            self.last_sent = self._clock.seconds()

    def set_phase(self, phase: str, message: str) -> None:
        """Say where the command is without sending anything (e.g. it left its lane queue)."""
        self.phase, self.message, self.extra = phase, message, {}

    def send_now(self) -> None:
        """Repeat the last phase at once (after a reconnect, or when the backend re-dispatched it)."""
        if self._call is None:
            return
        if self._send(self.phase, self.message, dict(self.extra, keepalive=True)):
            self.sent += 1
            self.last_sent = self._clock.seconds()

    def stop(self) -> None:
        call, self._call = self._call, None
        if call is not None and call.active():
            call.cancel()

    def _due(self) -> None:
        self._call = None
        now = self._clock.seconds()
        wait = self.last_sent + self.interval - now
        if wait <= 1e-9:
            self._call = self._clock.callLater(self.interval, self._due)
            self.send_now()
            return
        self._call = self._clock.callLater(wait, self._due)
