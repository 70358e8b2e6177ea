"""
How commands reach this node: polled or pushed (protocol 3.1, 9, 10.1), told apart at run time
from what the backend does. There is no setting: the same agent talks to both generations.

 - The April 2026 backend sends C{commands} only in reply to a frame it received: at most one
   reply per frame, a moment (its reply time) after the frame. The agent has to poll.
 - The current backend also sends C{commands} the moment a command is queued, whatever the
   agent said last. Polling buys nothing: an idle node sends only heartbeats and inventory.

B{Proof of push}: a C{commands} frame that lists a command this connection had not seen,
arriving when the agent has sent nothing for longer than L{DispatchDetector.window}: the larger
of L{PUSH_SILENCE_MIN} (0.5 s, so a push between two 2 s polls proves it) and L{REPLY_MARGIN}
times the slowest C{hello_ack} (the backend's measured reply time) this process has seen
(from the upgrade to C{hello_ack} the backend does the work of several frames: a session row, the
pending-commands query, the profile, a commit). An April backend could only produce such a frame
by answering a frame of ours later than several times its slowest measured reply (and it
answers each frame at once: a reply is a few milliseconds to a few tens of them after the frame);
a frame listing only commands already seen (the backend listing them again until our ack
reaches it) proves nothing.

B{Evidence against push}: a command seen for the first time in a frame that arrives within
L{DispatchDetector.answer_bound} of a frame of ours, where that frame of ours followed a silence
longer than the window. A pushing backend would have sent a command queued during that silence
at once, so it is a backend that answers rather than pushes (an older backend behind the same
URL, or a current one whose wake-up path is broken). One such command can be a push that
happened to land just after a heartbeat; L{ANSWERS_TO_POLL} in a row with no proof of push
between them bring polling back. This errs
on the cheap side: a wrong "not push" costs polls until the next proof; a wrong "push" would cost
command latency, which is why the proof is the stricter of the two.

The mode outlives reconnects and restarts (kept in the state file with the backend URL): a
backend upgraded behind the same URL proves push at its first pushed command; one downgraded is
caught by the first command it lists in reply to a heartbeat (which waited up to one heartbeat
interval), after which the agent polls exactly as before. A different backend URL starts over
with polling.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from itertools import islice
from typing import Any

from attrs import field
from twisted.logger import Logger

from llmport_agent.core.values import define

POLLING = "polling"
PUSH = "push"
MODES = (POLLING, PUSH)

#: Seconds of agent silence before a C{commands} frame proves push, at the least (short
#: enough that a push between two 2 s polls of the active window proves it).
PUSH_SILENCE_MIN = 0.5
#: ... or this many times the slowest C{hello_ack} seen, if larger.
REPLY_MARGIN = 4.0
#: A reply arrives within this long of our frame, at the least (evidence against push).
ANSWER_MIN = 0.25
#: Replies in a row (no proof of push between them) that bring polling back.
ANSWERS_TO_POLL = 2
#: Command ids remembered per connection for "seen before" (oldest forgotten first).
SEEN_IDS = 4096
#: Items of one frame looked at (the backend lists at most 50; one new id is enough).
ITEMS_LOOKED_AT = 256


@define(eq=False, repr=False)  # a component: identity, not value
class DispatchDetector:
    """
    Decides polling or push from the frames of the backend session (see the module docstring).

    @param clock: reactor time (seconds).
    @param on_change: called with C{(mode, reason)} when the mode changes.
    """

    clock: Callable[[], float]
    on_change: Callable[[str, str], None] = lambda mode, reason: None
    mode: str = POLLING
    reason: str = "no pushed command seen yet: the backend is treated as one that answers frames"
    #: Reactor time of the last change (None: the starting mode).
    changed_at: float | None = None
    #: Whether push was proven on the current connection (not only remembered).
    proven_here: bool = False
    proofs: int = 0
    answered: int = 0
    #: Times the evidence brought polling back (push to polling).
    fallbacks: int = 0
    slowest_hello: float = 0.0
    #: Evidence against push since the last proof (L{ANSWERS_TO_POLL} of them bring polling back).
    answered_in_a_row: int = 0
    _opened_at: float | None = None
    _hello_seen: bool = False
    _last_sent: float | None = None
    _sent_before: float | None = None
    _seen: OrderedDict[str, None] = field(factory=OrderedDict)

    log = Logger()

    @property
    def push(self) -> bool:
        return self.mode == PUSH

    @property
    def window(self) -> float:
        """Seconds of agent silence after which a C{commands} frame cannot be a reply."""
        return max(PUSH_SILENCE_MIN, REPLY_MARGIN * self.slowest_hello)

    @property
    def answer_bound(self) -> float:
        """A frame this soon after one of ours looks like its reply."""
        return min(self.window, max(ANSWER_MIN, 2.0 * self.slowest_hello))

    # -- what the session tells it ------------------------------------------------------------

    def connection_opened(self) -> None:
        now = self.clock()
        self._opened_at = now
        self._hello_seen = False
        # The upgrade counts as a frame: nothing the backend sends right after it proves push.
        self._last_sent, self._sent_before = now, None
        self._seen.clear()
        self.proven_here = False

    def connection_closed(self) -> None:
        self._opened_at = None
        self._seen.clear()

    def frame_sent(self) -> None:
        self._sent_before, self._last_sent = self._last_sent, self.clock()

    def hello_received(self, commands: Iterable[Any]) -> None:
        now = self.clock()
        if not self._hello_seen and self._opened_at is not None:
            self._hello_seen = True
            self.slowest_hello = max(self.slowest_hello, now - self._opened_at)
        # Listed at hello_ack: not news when a commands frame lists them again.
        self._remember(commands)

    def commands_received(self, items: Iterable[Any]) -> None:
        now = self.clock()
        new = self._remember(items)
        if not new or self._last_sent is None:
            return
        quiet = now - self._last_sent
        if quiet > self.window:
            self.proofs += 1
            self.proven_here = True
            self.answered_in_a_row = 0
            if self.mode != PUSH:
                self._change(
                    PUSH,
                    f"the backend sent a new command {quiet:.1f} s after the agent's last frame "
                    f"(longer than its reply time, {self.window:.1f} s): it pushes commands",
                )
            return
        isolated = self._sent_before is None or self._last_sent - self._sent_before > self.window
        if quiet <= self.answer_bound and isolated:
            self.answered += 1
            self.answered_in_a_row += 1
            if self.mode == PUSH and self.answered_in_a_row >= ANSWERS_TO_POLL:
                self.proven_here = False
                self.fallbacks += 1
                self._change(
                    POLLING,
                    f"new commands arrived just after frames of the agent's {self.answered_in_a_row} "
                    f"times in a row (the last {quiet:.2f} s after one, not during the "
                    f"{self._last_sent - (self._sent_before or self._last_sent):.1f} s of silence "
                    "before it), with no push between: this backend answers frames rather than "
                    "pushing",
                )

    def restore(self, mode: str, reason: str) -> None:
        """Start in a mode remembered from an earlier run (no change is reported)."""
        if mode in MODES:
            self.mode, self.reason = mode, reason

    def describe(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "reason": self.reason,
            "proven_on_this_connection": self.proven_here,
            "push_proofs": self.proofs,
            "answered_commands": self.answered,
            "answered_in_a_row": self.answered_in_a_row,
            "back_to_polling": self.fallbacks,
            "reply_window_sec": round(self.window, 3),
        }

    # -- internals ----------------------------------------------------------------------------

    def _remember(self, items: Iterable[Any]) -> bool:
        """Note the ids of C{items}; True when one was not seen before on this connection."""
        new = False
        for item in islice(items, ITEMS_LOOKED_AT):
            getter = getattr(item, "get", None)
            cid = getter("id") if callable(getter) else None
            if not isinstance(cid, str) or not cid:
                continue
            cid = cid[:128]
            if cid in self._seen:
                self._seen.move_to_end(cid)
                continue
            new = True
            self._seen[cid] = None
            if len(self._seen) > SEEN_IDS:
                self._seen.popitem(last=False)
        return new

    def _change(self, mode: str, reason: str) -> None:
        self.mode, self.reason, self.changed_at = mode, reason, self.clock()
        try:
            self.on_change(mode, reason)
        except Exception:
            self.log.failure("A dispatch mode listener failed")


__all__ = ["DispatchDetector", "MODES", "POLLING", "PUSH"]
