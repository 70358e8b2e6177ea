# -*- test-case-name: tests.test_logs_sink -*-
"""
Where logs go when C{LOKI_URL} is unset: the current backend says (protocol 10.7),
C{GET /api/node-files/log-sink} with the node's credential -> C{{"loki_url": url | null}};
a 404 (an April backend has no such route) means no sink.

B{When it asks.} At every stream connect while no sink is known (so a reconnect, after a
backend upgrade say, asks again), and every L{REASK_SEC} while connected and told "no sink"
(an operator may set one up later). A failure to ask (network, 5xx, a malformed answer) is
retried with jittered backoff from 5 s to 5 minutes while connected; a 401/403 waits for the
next connect (the session deals with the credential). Once a sink is found, shipping starts
and the agent stops asking: a later change of the backend's answer takes effect at the next
agent start.

B{What it accepts.} An http(s) URL with a host, at most 2048 characters, no whitespace or
control character, no query or fragment, a valid port. User info in it is used as basic auth
(like C{LOKI_URL}) and never shown: every message uses L{mask_url}.

L{ServiceSlot} is a place in the service tree for services that start later (the log shipping
built once a sink is found): it stops its children one after the other, last first.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, DeferredList
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmport_agent.core.backoff import Backoff
from llmport_agent.core.config import mask_url

__all__ = ["LogSinkDiscovery", "REASK_SEC", "ServiceSlot", "sink_config", "validate_sink_url"]

#: Seconds between questions while the backend says it has no sink.
REASK_SEC = 3600.0
MAX_URL_CHARS = 2048
_BAD_CHARS = re.compile(r"[\x00-\x20\x7f]")


def validate_sink_url(raw: object) -> str:
    """
    The sink URL as the shipper takes it (trailing C{/} removed).

    @raise ValueError: not an acceptable URL; the message shows no password.
    """
    if not isinstance(raw, str):
        raise ValueError(f"loki_url is a {type(raw).__name__}, not a string")
    value = raw.strip().rstrip("/")
    if len(value) > MAX_URL_CHARS:
        raise ValueError(f"loki_url is {len(value)} characters long (at most {MAX_URL_CHARS})")
    shown = mask_url(value) if not _BAD_CHARS.search(value) else "<URL with control characters>"
    if _BAD_CHARS.search(value):
        raise ValueError("loki_url holds whitespace or control characters")
    try:
        parts = urlsplit(value)
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        raise ValueError(f"loki_url {shown!r} is not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"loki_url {shown!r} is not an http(s) URL with a host")
    if parts.query or parts.fragment:
        raise ValueError(f"loki_url {shown!r} has a query or fragment")
    if not port_ok:
        raise ValueError(f"loki_url {shown!r} has an invalid port")
    return value


#: The operator's Loki secrets: for LOKI_URL, never sent to a sink the backend names.
_LOKI_SECRETS = ("loki_username", "loki_password", "loki_password_file", "loki_bearer_token",
                 "loki_bearer_token_file")


def sink_config(config: Any, url: str) -> tuple[Any, str | None]:
    """
    The configuration that ships to the sink C{url} the backend named: C{LOKI_URL} set to it and
    the operator's Loki credentials left out (they belong to an operator's C{LOKI_URL}; the
    backend's sink authenticates with the user info in its URL), and the one line to log when
    some were set.
    """
    import attrs

    dropped = [name for name in _LOKI_SECRETS if getattr(config, name, None)]
    note = None
    if dropped:
        names = ", ".join(f"LLM_PORT_NODE_AGENT_{n.upper()}" for n in dropped)
        note = (f"{names} set without LOKI_URL: not sent to the log sink the backend named "
                f"({mask_url(url)}); set LLM_PORT_NODE_AGENT_LOKI_URL to ship with them")
    return attrs.evolve(config, loki_url=url, **{name: None for name in _LOKI_SECRETS}), note


class LogSinkDiscovery(Service):
    """
    Asks the backend for its log sink (a session listener: subscribe it to the session).

    @param ask: returns the backend's C{loki_url} (C{None}: no sink, also for a 404); raises
        C{Rejected} for 401/403 and anything else for a failure worth retrying.
    @param on_sink: called once with the validated URL.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        ask: Callable[[], Awaitable[object]],
        on_sink: Callable[[str], None],
        *,
        backoff: Backoff | None = None,
        reask_sec: float = REASK_SEC,
    ) -> None:
        self.setName("log-sink")
        self._reactor = reactor
        self._ask = ask
        self._on_sink = on_sink
        self._backoff = backoff or Backoff(5.0, 300.0)
        self._reask_sec = reask_sec
        self._connected = False
        self._failures = 0
        self._call: Any = None
        self._inflight: Deferred[Any] | None = None
        self._said: str | None = None
        #: The sink in use once found.
        self.url: str | None = None
        self.asked = 0
        #: What the last answer was (for diagnostics).
        self.last = "not asked yet"

    def describe(self) -> dict[str, Any]:
        return {"sink": mask_url(self.url) if self.url else "", "asked": self.asked, "last": self.last}

    # -- session listener

    def session_opened(self) -> None:
        self._connected = True
        self._failures = 0
        self._schedule(0.0)

    def session_closed(self) -> None:
        self._connected = False
        self._cancel(inflight=True)

    def frame_received(self, frame: dict[str, Any]) -> None:
        pass

    # -- service

    def stopService(self) -> None:
        super().stopService()
        self._cancel(inflight=True)

    # -- asking

    def _cancel(self, inflight: bool = False) -> None:
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None
        if inflight and self._inflight is not None:
            # Its connection attempt ends now, not after the request timeout.
            self._inflight.cancel()

    def _schedule(self, delay: float) -> None:
        if self.url is not None or not self.running or not self._connected:
            return
        self._cancel()
        self._call = self._reactor.callLater(delay, self._ask_now)

    def _ask_now(self) -> None:
        self._call = None
        if self._inflight is not None or self.url is not None or not self.running:
            return
        self.asked += 1
        d = Deferred.fromCoroutine(_call(self._ask))
        self._inflight = d
        d.addCallbacks(self._answered, self._failed)
        d.addBoth(self._done)

    def _done(self, _: object) -> None:
        self._inflight = None

    def _say(self, key: str, level: str, text: str, **fields: Any) -> None:
        """Log a state change once (the same answer again is not repeated)."""
        if self._said == key:
            return
        self._said = key
        getattr(self.log, level)(text, **fields)

    def _answered(self, raw: object) -> None:
        self._failures = 0
        if raw is None:
            self.last = "no sink"
            self._say("none", "info",
                      "The backend offers no log sink and LOKI_URL is unset: logs are not shipped "
                      "(asking again in {hours:g} h and at the next connect; set "
                      "LLM_PORT_NODE_AGENT_LOKI_URL to ship them anyway)",
                      hours=self._reask_sec / 3600)
            self._schedule(self._reask_sec)
            return
        try:
            url = validate_sink_url(raw)
        except ValueError as e:
            self.last = "invalid sink URL"
            self._say(f"invalid:{e}", "warn",
                      "The backend's log sink is not usable ({why}); logs are not shipped (asking "
                      "again in {hours:g} h and at the next connect)", why=str(e),
                      hours=self._reask_sec / 3600)
            self._schedule(self._reask_sec)
            return
        self.url = url
        self.last = "sink found"
        self.log.info("Shipping logs to the backend's log sink {url}", url=mask_url(url))
        try:
            self._on_sink(url)
        except Exception:
            self.log.failure("Starting log shipping to the backend's log sink failed")

    def _failed(self, f: Failure) -> None:
        from llmport_agent.session.backend_http import Rejected

        if not self._connected or not self.running:
            return  # cancelled by a disconnect or a stop: the next connect asks again
        if f.check(Rejected):
            self.last = f"refused ({f.getErrorMessage()})"
            self._say("rejected", "warn",
                      "The backend refused the question for its log sink ({why}); asking again at "
                      "the next connect", why=f.getErrorMessage())
            return
        self._failures += 1
        delay = self._backoff.delay(self._failures)
        self.last = f"failed ({f.getErrorMessage()})"
        self._say("failed", "warn",
                  "Could not ask the backend for its log sink ({why}); retrying in {delay:.0f} s "
                  "(with backoff, up to 5 minutes)", why=f.getErrorMessage(), delay=delay)
        self._schedule(delay)


async def _call(ask: Callable[[], Awaitable[object]]) -> object:
    return await ask()


class ServiceSlot(MultiService):
    """
    A place in the service tree for services added later. Children added while it runs are
    started at once, in the order added; at stop they are stopped one at a time, the last
    added first, each given at most C{stop_timeout} seconds.
    """

    log = Logger()

    def __init__(self, reactor: Any, name: str, stop_timeout: float = 15.0) -> None:
        super().__init__()
        self.setName(name)
        self._reactor = reactor
        self._stop_timeout = stop_timeout

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)
        inner = Deferred.fromCoroutine(self._stop())
        # A caller that gives up on the stop (cancels) must not cut it short: the children
        # after the slow one (the shipper, the pool) would never be stopped.
        outer: Deferred[None] = Deferred(lambda _: None)

        def done(_: object) -> None:
            if not outer.called:
                outer.callback(None)

        inner.addBoth(done)
        return outer

    async def _stop(self) -> None:
        for svc in reversed(list(self)):
            if not svc.running:
                continue
            try:
                result = svc.stopService()
            except Exception:
                self.log.failure("Stopping {name} failed", name=svc.name)
                continue
            if isinstance(result, Deferred):
                result.addTimeout(self._stop_timeout, self._reactor)
                await DeferredList([result], consumeErrors=True)
