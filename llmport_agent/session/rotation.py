"""
Credential rotation (protocol 2): every C{ROTATION_INTERVAL} of wall-clock time, checked
every C{ROTATION_CHECK}; an unknown outcome keeps the credential in use.

L{Rotation} owns its check loop and whether a rotation is running. Inputs: L{Rotation.start},
L{Rotation.stop}, L{Rotation.tick} (the loop's), L{Rotation.rotate}. What it needs from the
session: C{opened_at}, the reactor time the current stream opened (None: not open).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from llmport_agent.core.state import StateStore
from llmport_agent.session.backend_http import BackendHTTP, Rejected, Transient
from llmport_agent.session.shared import SessionStats
from llmport_agent.session.stop import StopGate

ROTATION_INTERVAL = 12 * 3600.0
ROTATION_CHECK = 600.0
ROTATION_TIMEOUT = 10.0


class Rotation:
    def __init__(
        self,
        *,
        clock: Any,
        state: StateStore,
        backend: BackendHTTP,
        wallclock: Callable[[], float],
        gate: StopGate,
        stats: SessionStats,
        log: Logger,
        opened_at: Callable[[], float | None],
    ) -> None:
        self._clock = clock
        self._state = state
        self._backend = backend
        self._wallclock = wallclock
        self._gate = gate
        self._stats = stats
        self._log = log
        self._opened_at = opened_at
        self._rotating = False
        self._loop: LoopingCall | None = None

    def start(self) -> None:
        """Check every C{ROTATION_CHECK} from now on."""
        self._loop = LoopingCall(self.tick)
        self._loop.clock = self._clock
        self._loop.start(ROTATION_CHECK, now=False)

    def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and loop.running:
            loop.stop()

    def tick(self) -> None:
        """Rotate if the credential is due and the stream has been open for a minute."""
        last = self._state.get("last_rotation_at") or self._state.get("enrolled_at")
        now = self._wallclock()
        if last is None or float(last) > now + 3600:
            # Never rotated, or the wall clock was ahead when we did (NTP corrected it since):
            # count from now rather than postpone rotation for as long as the clock was wrong.
            self._state.note(last_rotation_at=now)
            return
        if now - float(last) < ROTATION_INTERVAL or self._rotating:
            return
        opened_at = self._opened_at()
        if opened_at is None:
            return
        if self._clock.seconds() - opened_at < 60:
            return
        self.rotate().addErrback(lambda f: self._log.failure("Credential rotation failed", failure=f))

    def rotate(self) -> Deferred[bool]:
        """Rotate the credential now (see L{rotate_now}); a stop waits for it."""
        d = Deferred.fromCoroutine(self.rotate_now())
        self._gate.track_critical(d)
        return d

    async def rotate_now(self) -> bool:
        """
        Rotate the credential (protocol 2). The backend revokes the old credential before it
        replies, so an unknown outcome keeps both: the new one if it arrived, else the old one.
        """
        state, log = self._state, self._log
        old = state.credential
        if not old:
            return False
        self._rotating = True
        try:
            try:
                _, new = await self._gate.request(self._backend.rotate(old, ROTATION_TIMEOUT))
            except CancelledError:
                log.warn(
                    "Credential rotation was cut short by the stop; its outcome is unknown. The "
                    "current credential stays in use; if the backend refuses it, this node needs a "
                    "new enrollment token."
                )
                return False
            except Rejected as e:
                self._stats.rotation_errors += 1
                log.warn(
                    "Credential rotation refused ({detail}); keeping the current credential",
                    detail=e.detail,
                )
                await state.update(last_rotation_at=self._wallclock())
                return False
            except Transient as e:
                self._stats.rotation_errors += 1
                log.warn(
                    "Credential rotation outcome unknown ({error}); the backend may have revoked the "
                    "current credential. It stays in use; if the backend refuses it, this node needs a "
                    "new enrollment token.",
                    error=str(e),
                )
                await state.update(last_rotation_at=self._wallclock())
                return False
            # The backend revoked the old credential before replying: it is useless now.
            await state.update(credential=new, previous_credential=None, last_rotation_at=self._wallclock())
            self._stats.rotations += 1
            log.info("Credential rotated; the new one is stored in {path}", path=state.path)
            return True
        finally:
            self._rotating = False
