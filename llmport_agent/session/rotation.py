"""
Credential rotation (protocol 2): every C{ROTATION_INTERVAL} of wall-clock time, checked
every C{ROTATION_CHECK}; an unknown outcome keeps the credential in use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twisted.internet.defer import CancelledError, Deferred

from llmport_agent.session.backend_http import Rejected, Transient

if TYPE_CHECKING:
    from llmport_agent.session.service import SessionService

ROTATION_INTERVAL = 12 * 3600.0
ROTATION_CHECK = 600.0
ROTATION_TIMEOUT = 10.0


def rotation_tick(session: SessionService) -> Deferred[None] | None:
    last = session.state.get("last_rotation_at") or session.state.get("enrolled_at")
    now = session._wallclock()
    if last is None or float(last) > now + 3600:
        # Never rotated, or the wall clock was ahead when we did (NTP corrected it since):
        # count from now rather than postpone rotation for as long as the clock was wrong.
        session.state.note(last_rotation_at=now)
        return None
    if now - float(last) < ROTATION_INTERVAL or session._rotating:
        return None
    proto = session.proto
    if proto is None or proto.opened_at is None:
        return None
    if session._reactor.seconds() - proto.opened_at < 60:
        return None
    session.rotate().addErrback(lambda f: session.log.failure("Credential rotation failed", failure=f))
    return None


def rotate(session: SessionService) -> Deferred[bool]:
    """Rotate the credential now (see L{_rotate}); a stop waits for it."""
    d = Deferred.fromCoroutine(session._rotate())
    session._track_critical(d)
    return d


async def rotate_now(session: SessionService) -> bool:
    """
    Rotate the credential (protocol 2). The backend revokes the old credential before it
    replies, so an unknown outcome keeps both: the new one if it arrived, else the old one.
    """
    old = session.state.credential
    if not old:
        return False
    session._rotating = True
    try:
        try:
            _, new = await session._request(session.backend.rotate(old, ROTATION_TIMEOUT))
        except CancelledError:
            session.log.warn(
                "Credential rotation was cut short by the stop; its outcome is unknown. The "
                "current credential stays in use; if the backend refuses it, this node needs a "
                "new enrollment token."
            )
            return False
        except Rejected as e:
            session.stats.rotation_errors += 1
            session.log.warn(
                "Credential rotation refused ({detail}); keeping the current credential",
                detail=e.detail,
            )
            await session.state.update(last_rotation_at=session._wallclock())
            return False
        except Transient as e:
            session.stats.rotation_errors += 1
            session.log.warn(
                "Credential rotation outcome unknown ({error}); the backend may have revoked the "
                "current credential. It stays in use; if the backend refuses it, this node needs a "
                "new enrollment token.",
                error=str(e),
            )
            await session.state.update(last_rotation_at=session._wallclock())
            return False
        # The backend revoked the old credential before replying: it is useless now.
        await session.state.update(
            credential=new, previous_credential=None, last_rotation_at=session._wallclock()
        )
        session.stats.rotations += 1
        session.log.info("Credential rotated; the new one is stored in {path}", path=session.state.path)
        return True
    finally:
        session._rotating = False
