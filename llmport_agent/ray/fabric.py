"""
Fabric probes (protocol 10.6): C{validate_fabric_listen} and C{validate_fabric_connect}.

The backend certifies a candidate fabric between two nodes by having one node listen on its
fabric IP and the other dial it from its own fabric IP (the source address pinned, so the
kernel cannot route the probe over another link). The wire exchange interoperates with the
original agent's (a cluster mixing the two agents validates its fabric either way): the
dialler sends one line C{<probe token or "probe">}, the listener answers one line C{ACK} or
C{ERR_AUTH} and closes. A line ends in C{\\n}; a C{\\r} before it is dropped, so the
original's C{<token>\\n} and a C{<token>\\r\\n} are read alike. This agent writes its lines
with C{\\r\\n}, which the original's reader (a stripped C{readline}) takes as well.

A connection that has not sent its line within L{HEADER_DEADLINE} seconds is dropped (never
held to the listen timeout), and when the listener holds as many unanswered connections as it
allows, a new one drops the oldest of the peer address holding the most: idle sockets from
anyone on the fabric cannot keep the real peers out. Both commands answer C{success: true}; a fabric that does not work
is C{listening: false} / C{reachable: false} with an C{error} line the planner shows.

Everything runs on the reactor (Twisted endpoints, no threads); every wait is bounded
(C{timeout_sec} and C{retry_for_sec} are capped), every read is one short line, and the
listener is closed on every exit path. The probe token is compared in constant time and never
reaches a result or a log line.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping
from typing import Any

from twisted.internet import error as ierror
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.endpoints import (
    TCP4ClientEndpoint,
    TCP4ServerEndpoint,
    TCP6ClientEndpoint,
    TCP6ServerEndpoint,
    connectProtocol,
)
from twisted.internet.protocol import Factory
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.protocols.basic import LineOnlyReceiver

from ..commands.base import CommandContext, HandlerSpec

#: Longest wait of one probe (seconds): a fabric answers in milliseconds.
MAX_TIMEOUT_SEC = 60.0
#: Longest time a dialler keeps retrying a peer that is not listening yet.
MAX_RETRY_SEC = 120.0
#: Most probes one listener waits for (one per other node of the environment).
MAX_EXPECTED_PROBES = 256
#: Connections a listener holds at once beyond the expected probes.
_EXTRA_CONNECTIONS = 16
#: Longest probe line (the token is a short random string).
MAX_LINE = 512
#: Seconds a connection has to send its probe line (a peer sends it at once).
HEADER_DEADLINE = 3.0
_RETRY_DELAY = 0.25
_ACK = b"ACK"
_ERR_AUTH = b"ERR_AUTH"

log = Logger()


class ProbeInputError(ValueError):
    """A payload field that cannot be probed with (answered as a C{success: true} failure)."""


def _ip(value: object, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ProbeInputError(f"{key} is required (the fabric IP address)")
    try:
        address = ipaddress.ip_address(value.strip())
    except ValueError:
        raise ProbeInputError(f"{key} {value[:60]!r} is not an IP address") from None
    if address.is_unspecified or address.is_multicast:
        raise ProbeInputError(f"{key} {address} is not a unicast interface address")
    return str(address)


def _port(value: object, key: str) -> int:
    if isinstance(value, bool):
        raise ProbeInputError(f"{key} must be a port number from 1 to 65535")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer past any float
        raise ProbeInputError(f"{key} {str(value)[:20]!r} must be a port number from 1 to 65535") from None
    if not number.is_integer() or not 0 < number < 65536:
        raise ProbeInputError(f"{key} {str(value)[:20]} must be a port number from 1 to 65535")
    return int(number)


def _seconds(payload: Mapping[str, Any], key: str, default: float, cap: float, minimum: float) -> float:
    value = payload.get(key)
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        raise ProbeInputError(f"{key} must be a number of seconds")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ProbeInputError(f"{key} {str(value)[:20]!r} must be a number of seconds") from None
    if number != number:  # NaN
        raise ProbeInputError(f"{key} must be a number of seconds")
    return min(max(number, minimum), cap)


def _token(payload: Mapping[str, Any]) -> bytes:
    value = payload.get("probe_token")
    if value is None:
        return b""
    if not isinstance(value, str):
        raise ProbeInputError("probe_token must be a string")
    raw = value.encode("utf-8")
    if len(raw) >= MAX_LINE or b"\n" in raw or b"\r" in raw:
        raise ProbeInputError(f"probe_token must be one line shorter than {MAX_LINE} bytes")
    return raw


def _describe(failure_value: BaseException) -> str:
    """One line naming a connect failure; the words C{refused}/C{timeout}/C{unreachable} mark
    the failures a dialler retries (the peer may not be listening yet)."""
    if isinstance(failure_value, ierror.ConnectionRefusedError):
        return "connection refused: nothing listens on that address and port"
    if isinstance(failure_value, (ierror.TimeoutError, ierror.TCPTimedOutError)):
        return "connect timeout: the peer did not answer"
    if isinstance(failure_value, ierror.NoRouteError):
        return "host unreachable: no route to the peer"
    if isinstance(failure_value, ierror.ConnectBindError):
        return f"cannot bind the source IP ({failure_value.osError or failure_value}): is it an address of this node?"
    name = type(failure_value).__name__
    detail = str(failure_value).strip().splitlines()[0][:200] if str(failure_value).strip() else ""
    lowered = detail.lower()
    if "unreachable" in lowered or "refused" in lowered:
        return f"{name}: {detail}"
    return f"{name}: {detail}" if detail else name


def _retryable(message: str | None) -> bool:
    if not message:
        return False
    lowered = message.lower()
    return "refused" in lowered or "timeout" in lowered or "unreachable" in lowered


# -- the listener -------------------------------------------------------------------------


class _ProbeServer(LineOnlyReceiver):
    """One probe connection: read one line (within L{HEADER_DEADLINE}), answer, close."""

    delimiter = b"\n"
    MAX_LENGTH = MAX_LINE
    factory: _ListenerFactory
    transport: Any
    answered = False

    def connectionMade(self) -> None:
        f = self.factory
        if f.finished:
            self.transport.abortConnection()
            return
        f.admit(self)
        self._timer = f.reactor.callLater(min(HEADER_DEADLINE, f.timeout), self.transport.abortConnection)

    def lineReceived(self, line: bytes) -> None:
        f = self.factory
        if self.answered or f.finished or self not in f.pending:  # answered, dropped or closing
            return
        self.answered = True
        f.pending.pop(self, None)
        given = line[:-1] if line.endswith(b"\r") else line
        if f.token and not hmac.compare_digest(given, f.token):
            self.sendLine(_ERR_AUTH)
            f.rejected += 1
        else:
            self.sendLine(_ACK)
            peer = self.transport.getPeer()
            f.accepted.append([peer.host, peer.port])
        self.transport.loseConnection()
        f.check()

    def sendLine(self, line: bytes) -> None:
        self.transport.write(line + b"\r\n")

    def lineLengthExceeded(self, line: bytes) -> None:
        self.transport.abortConnection()

    def connectionLost(self, reason: Any = None) -> None:
        f = self.factory
        f.open.discard(self)
        f.pending.pop(self, None)
        timer = getattr(self, "_timer", None)
        if timer is not None and timer.active():
            timer.cancel()


class _ListenerFactory(Factory):
    protocol = _ProbeServer  # type: ignore[assignment]

    def __init__(self, reactor: Any, token: bytes, expected: int, timeout: float) -> None:
        self.reactor = reactor
        self.token = token
        self.expected = expected
        self.timeout = timeout
        self.accepted: list[list[Any]] = []
        self.rejected = 0
        self.open: set[_ProbeServer] = set()
        #: Connections that have not sent their line yet, oldest first, with their peer host.
        self.pending: dict[_ProbeServer, str] = {}
        self.finished = False
        self.done: Deferred[bool] = Deferred()

    @property
    def capacity(self) -> int:
        """Unanswered connections held at once."""
        return self.expected + _EXTRA_CONNECTIONS

    def admit(self, proto: _ProbeServer) -> None:
        """
        Hold C{proto} until its line comes; when L{capacity} are already waiting, the oldest
        of the peer address that holds the most is dropped to make room.
        """
        if len(self.pending) >= self.capacity:
            counts: dict[str, int] = {}
            for host in self.pending.values():
                counts[host] = counts.get(host, 0) + 1
            busiest = max(counts.values())
            victim = next(p for p, host in self.pending.items() if counts[host] == busiest)
            del self.pending[victim]
            victim.transport.abortConnection()
        self.open.add(proto)
        self.pending[proto] = str(proto.transport.getPeer().host)

    def check(self) -> None:
        if not self.finished and len(self.accepted) >= self.expected:
            self.finish(True)

    def finish(self, complete: bool) -> None:
        if self.finished:
            return
        self.finished = True
        self.done.callback(complete)


class Listener:
    """A bound probe listener; C{result} fires with the C{validate_fabric_listen} answer."""

    def __init__(self, factory: _ListenerFactory, port: Any, timer: Any) -> None:
        self._factory = factory
        self._port = port
        self._timer = timer

    @property
    def port(self) -> int:
        return int(self._port.getHost().port)

    async def result(self) -> dict[str, Any]:
        f = self._factory
        try:
            complete = await f.done
        finally:
            if self._timer.active():
                self._timer.cancel()
            f.finished = True
            await self._port.stopListening()
            # Probes still open after the answer are not waited for.
            for proto in list(f.open):
                if proto.transport is not None:
                    proto.transport.loseConnection()
        answer: dict[str, Any] = {
            "listening": True,
            "connected": complete,
            "probes_accepted": len(f.accepted),
            "expected_probes": f.expected,
        }
        if f.accepted:
            answer["peer"] = f.accepted[-1]
            answer["peers"] = list(f.accepted)
        if not complete:
            answer["error"] = "timeout_waiting_for_probe"
            if f.rejected:
                answer["error"] += f" ({f.rejected} probe(s) rejected: wrong probe token)"
        return answer


async def start_listener(
    reactor: Any, ip: str, port: int, token: bytes, expected: int, timeout: float
) -> Listener:
    """Bind the probe listener on C{ip}:C{port} (C{port} 0 picks one; tests)."""
    factory = _ListenerFactory(reactor, token, expected, timeout)
    endpoint_type = TCP6ServerEndpoint if ":" in ip else TCP4ServerEndpoint
    endpoint = endpoint_type(reactor, port, backlog=expected + _EXTRA_CONNECTIONS, interface=ip)
    listening = await endpoint.listen(factory)
    timer = reactor.callLater(timeout, factory.finish, False)
    return Listener(factory, listening, timer)


async def listen(reactor: Any, payload: Mapping[str, Any]) -> dict[str, Any]:
    """The C{validate_fabric_listen} answer for C{payload}."""
    try:
        ip = _ip(payload.get("ip"), "ip")
        port = _port(payload.get("port"), "port")
        timeout = _seconds(payload, "timeout_sec", 5.0, MAX_TIMEOUT_SEC * 5, 0.1)
        expected = int(_seconds(payload, "expected_probes", 1, MAX_EXPECTED_PROBES, 1))
        token = _token(payload)
    except ProbeInputError as exc:
        return {"listening": False, "connected": False, "probes_accepted": 0,
                "expected_probes": 0, "error": str(exc)}
    try:
        listener = await start_listener(reactor, ip, port, token, expected, timeout)
    except ierror.CannotListenError as exc:
        why = exc.socketError if exc.socketError is not None else exc
        return {"listening": False, "connected": False, "probes_accepted": 0, "expected_probes": expected,
                "error": f"cannot listen on {ip}:{port} ({why}): is the IP an address of this node and the port free?"}
    log.info("Fabric probe listener on {ip}:{port} for {expected} probe(s)", ip=ip, port=port, expected=expected)
    answer = await listener.result()
    log.info("Fabric probe listener on {ip}:{port} closed: {accepted}/{expected} accepted",
             ip=ip, port=port, accepted=answer["probes_accepted"], expected=expected)
    return answer


# -- the dialler --------------------------------------------------------------------------


class _ProbeClient(LineOnlyReceiver):
    delimiter = b"\n"
    MAX_LENGTH = MAX_LINE
    transport: Any

    def __init__(self, reactor: Any, token: bytes, timeout: float) -> None:
        self._reactor = reactor
        self._token = token
        self._timeout = timeout
        self.answer: Deferred[bytes] = Deferred()
        self._timer: Any = None

    def connectionMade(self) -> None:
        self.transport.write((self._token or b"probe") + b"\r\n")
        self._timer = self._reactor.callLater(self._timeout, self._give_up, "read timeout: the peer accepted but did not answer")

    def _give_up(self, why: str) -> None:
        if not self.answer.called:
            self.answer.errback(ProbeInputError(why))
        self.transport.abortConnection()

    def lineReceived(self, line: bytes) -> None:
        if not self.answer.called:
            self.answer.callback(line[:-1] if line.endswith(b"\r") else line)
        self.transport.loseConnection()

    def lineLengthExceeded(self, line: bytes) -> None:
        self._give_up("the peer answered with an over-long line (not a fabric probe listener)")

    def connectionLost(self, reason: Any = None) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        if not self.answer.called:
            self.answer.errback(ProbeInputError("the peer closed the connection without answering"))


async def probe_once(
    reactor: Any, ip: str, port: int, token: bytes, timeout: float, source_ip: str | None
) -> dict[str, Any]:
    """One dial: C{{reachable, rtt_ms}} or C{{reachable: false, error}}."""
    endpoint_type = TCP6ClientEndpoint if ":" in ip else TCP4ClientEndpoint
    bind = (source_ip, 0) if source_ip else None
    endpoint = endpoint_type(reactor, ip, port, timeout=max(1, int(round(timeout))), bindAddress=bind)
    started = reactor.seconds()
    client = _ProbeClient(reactor, token, timeout)
    connecting = connectProtocol(endpoint, client)
    guard = reactor.callLater(timeout, connecting.cancel)
    try:
        await connecting
    except (CancelledError, ierror.ConnectingCancelledError):
        return {"reachable": False, "error": "connect timeout: the peer did not answer"}
    except Exception as exc:  # noqa: BLE001 - every connect failure is an answer
        return {"reachable": False, "error": _describe(exc)}
    finally:
        if guard.active():
            guard.cancel()
    try:
        line = await client.answer
    except ProbeInputError as exc:
        return {"reachable": False, "error": str(exc)}
    rtt_ms = (reactor.seconds() - started) * 1000.0
    if line == _ACK:
        return {"reachable": True, "rtt_ms": round(rtt_ms, 3)}
    shown = line.decode("utf-8", "replace")[:60]
    return {"reachable": False, "error": f"probe rejected: {shown}"}


async def connect(reactor: Any, payload: Mapping[str, Any]) -> dict[str, Any]:
    """The C{validate_fabric_connect} answer for C{payload}."""
    target_ip = payload.get("target_ip")
    target_port = payload.get("target_port")
    try:
        ip = _ip(target_ip, "target_ip")
        port = _port(target_port, "target_port")
        source = payload.get("source_ip")
        source_ip = _ip(source, "source_ip") if source not in (None, "") else None
        if source_ip is not None and (":" in source_ip) != (":" in ip):
            raise ProbeInputError("source_ip and target_ip must both be IPv4 or both IPv6")
        timeout = _seconds(payload, "timeout_sec", 5.0, MAX_TIMEOUT_SEC, 0.1)
        retry_for = _seconds(payload, "retry_for_sec", 0.0, MAX_RETRY_SEC, 0.0)
        token = _token(payload)
    except ProbeInputError as exc:
        return {"reachable": False, "error": str(exc), "target_ip": str(target_ip)[:64],
                "target_port": target_port if isinstance(target_port, int) else None, "attempts": 0}
    deadline = reactor.seconds() + retry_for
    attempts = 0
    while True:
        attempts += 1
        result = await probe_once(reactor, ip, port, token, timeout, source_ip)
        if result["reachable"] or not _retryable(result.get("error")):
            break
        if reactor.seconds() + _RETRY_DELAY > deadline:
            break
        await deferLater(reactor, _RETRY_DELAY, lambda: None)
    result.update(target_ip=ip, target_port=port, attempts=attempts)
    return result


def fabric_handler_specs() -> dict[str, HandlerSpec]:
    """The two probe commands for the command pipeline's registry (no Docker needed)."""

    async def listen_handler(ctx: CommandContext) -> dict[str, Any]:
        payload = ctx.command.payload if isinstance(ctx.command.payload, Mapping) else {}
        return await listen(ctx.reactor, payload)

    async def connect_handler(ctx: CommandContext) -> dict[str, Any]:
        payload = ctx.command.payload if isinstance(ctx.command.payload, Mapping) else {}
        return await connect(ctx.reactor, payload)

    # Not idempotent: the journal keeps the probe token scrubbed, so a probe cut by a restart
    # is answered agent_restarted (the backend re-issues it) rather than re-run without it.
    return {
        "validate_fabric_listen": HandlerSpec(listen_handler, "read", False, MAX_TIMEOUT_SEC * 5 + 30, keep_result=False),
        "validate_fabric_connect": HandlerSpec(
            connect_handler, "read", False, MAX_RETRY_SEC + MAX_TIMEOUT_SEC * 2 + 30, keep_result=False
        ),
    }
