"""
How the session stops: an enrollment or rotation in flight gets C{CRITICAL_STOP_GRACE} to
store its credential, then is cancelled; the stream closes cleanly (WebSocket close 1000).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from twisted.internet.defer import Deferred, succeed

if TYPE_CHECKING:
    from llmport_agent.session.service import SessionService

#: On stop, an enrollment or rotation request in flight gets this long to bring back its
#: reply (the backend may already have consumed the token / revoked the old credential);
#: then it is cancelled, so a stop always completes within about two seconds.
CRITICAL_STOP_GRACE = 0.5


def track_critical(session: SessionService, d: Deferred[Any]) -> None:
    """Enrollment and rotation: a stop waits for them, or a credential could be lost."""
    session._critical.add(d)

    def done(result: object) -> object:
        session._critical.discard(d)
        return result

    d.addBoth(done)


def stop_service(session: SessionService) -> Deferred[None]:
    session._stopping = True
    if session._sleeping is not None:
        session._sleeping.cancel()  # retry delays end at once
    pending = [d for d in session._critical if not d.called]
    if session._starting is not None and not session._starting.called:
        pending.append(session._starting)
    if pending:
        # An enrollment or rotation whose request is in flight gets a moment to bring back
        # its reply and store the credential (the backend may already have consumed the
        # token / revoked the old one), then it is cancelled: a stop takes at most ~2 s,
        # whatever REQUEST_TIMEOUT_SEC is.
        from twisted.internet.defer import DeferredList

        cancel = session._reactor.callLater(CRITICAL_STOP_GRACE, session._cancel_requests)
        waiting: Deferred[Any] = DeferredList(pending, consumeErrors=True)
        waiting.addTimeout(CRITICAL_STOP_GRACE + 1.0, session._reactor)
        waiting.addErrback(lambda _: None)

        def done(_: object) -> Deferred[None]:
            if cancel.active():
                cancel.cancel()
            session._cancel_requests()
            return session._stop_connection()

        return waiting.addCallback(done)
    return session._stop_connection()


def cancel_requests(session: SessionService) -> None:
    for d in list(session._requests):
        d.cancel()


def stop_connection(session: SessionService) -> Deferred[None]:
    session._cancel_poll()
    for loop_name in ("_rotation_loop",):
        loop = getattr(session, loop_name)
        if loop is not None and loop.running:
            loop.stop()
        setattr(session, loop_name, None)
    client, session._client = session._client, None
    proto = session.proto
    if client is None:
        return succeed(None)
    if proto is not None:
        proto.sendClose(code=1000, reason="agent stopping")
        closed: Deferred[Any] = Deferred()
        proto.is_closed.addBoth(lambda r: closed.callback(None) if not closed.called else None)
        closed.addTimeout(5, session._reactor, onTimeoutCancel=lambda *_: None)

        def stop_client(_: object) -> Deferred[None]:
            return client.stopService()

        return closed.addCallback(stop_client)
    return client.stopService()
