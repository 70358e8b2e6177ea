"""
systemd's notify protocol (sd_notify(3)), spoken directly: datagrams to C{$NOTIFY_SOCKET}.

Under the unit (C{Type=notify}, C{NotifyAccess=main}, C{WatchdogSec=}) the agent sends
C{READY=1} once every service is up, a one-line C{STATUS=} when it changed (looked at on each
watchdog ping, at each connect and disconnect of the backend stream, and every 30 s when
there is no watchdog: no timer of its own beside the watchdog's), C{WATCHDOG=1}
from a reactor timer at half of C{$WATCHDOG_USEC} (so a stalled reactor stops the pings and
systemd restarts the agent) and C{STOPPING=1} when it begins to stop. Without C{$NOTIFY_SOCKET}
(the foreground, tests) every call is a no-op.

The socket may be a path or an abstract name (C{@name}). Sending waits at most L{SEND_TIMEOUT}
and never raises: a lost datagram is logged once, never a reason to crash the agent.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from twisted.application.service import Service
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

#: How often the status line is recomputed without a watchdog (sent only when it changed);
#: with one, at each ping, and at every connect and disconnect of the backend stream.
STATUS_INTERVAL = 30.0
#: Longest a send may wait for room in the notify socket's queue.
SEND_TIMEOUT = 0.2
#: Longest status line sent (systemd shows one line).
MAX_STATUS = 400

_ENV_NAMES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def _address(value: str) -> str | bytes | None:
    if not value:
        return None
    if value.startswith("@"):
        # Abstract namespace: a leading NUL byte instead of "@".
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None  # vsock and other forms: not used by systemd for services on Linux hosts


def watchdog_interval(environ: Mapping[str, str], pid: int, ppid: int | None = None) -> float | None:
    """
    Seconds between C{WATCHDOG=1} pings (half of C{WATCHDOG_USEC}), or None when off.
    C{WATCHDOG_PID} names the process the watchdog is for: this one, or (C{ppid}, given in the
    standalone executable) the one-file bootloader that started this one.
    """
    raw = environ.get("WATCHDOG_USEC", "")
    owner = environ.get("WATCHDOG_PID", "").strip()
    if owner and owner != str(pid) and (ppid is None or owner != str(ppid)):
        return None
    try:
        usec = int(raw)
    except ValueError:
        return None
    if usec <= 0:
        return None
    return usec / 1e6 / 2


class Notifier:
    """
    Sends notify datagrams. Reads C{NOTIFY_SOCKET} / C{WATCHDOG_USEC} / C{WATCHDOG_PID} once
    and removes them from C{environ} (children such as C{journalctl} must not inherit them).
    """

    log = Logger()

    def __init__(self, environ: MutableMapping[str, str] | None = None, pid: int | None = None) -> None:
        env = os.environ if environ is None else environ
        pid = os.getpid() if pid is None else pid
        # The standalone executable runs as two processes: PyInstaller's one-file bootloader
        # (systemd's main PID, hence NotifyAccess=all in the unit) and this one, its child.
        ppid = os.getppid() if getattr(sys, "frozen", False) else None
        self.address = _address(env.get("NOTIFY_SOCKET", ""))
        self.watchdog_sec = watchdog_interval(env, pid, ppid) if self.address is not None else None
        for name in _ENV_NAMES:
            env.pop(name, None)
        self._sock: socket.socket | None = None
        self.sent: list[str] = []  # kept short; for diagnostics and tests
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *assignments: str) -> bool:
        """Send one datagram of C{NAME=value} lines. True if it left."""
        if self.address is None:
            return False
        message = "\n".join(assignments)
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                # systemd reads its notify socket at once; a short timeout (not a non-blocking
                # send) keeps a burst from being dropped when the queue (10 datagrams) is full.
                self._sock.settimeout(SEND_TIMEOUT)
            self._sock.sendto(message.encode("utf-8", "replace"), self.address)
        except OSError as e:
            if not self._warned:
                self._warned = True
                self.log.warn("Could not notify systemd ({error}); the unit may time out",
                              error=f"{type(e).__name__}: {e}")
            return False
        self.sent.append(message)
        if len(self.sent) > 50:
            del self.sent[:25]
        return True

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


def status_line(text: str) -> str:
    """One line, bounded: what C{STATUS=} carries."""
    flat = " ".join(str(text).split())
    return flat[:MAX_STATUS]


class NotifyService(Service):
    """
    The agent's side of the unit: watchdog pings from a reactor timer, the status line on
    change, READY and STOPPING when told.

    @param status: returns the current one-line status (connected / enrolling / backing off,
        node id, workloads, last error).
    """

    log = Logger()

    def __init__(self, reactor: Any, notifier: Notifier, status: Callable[[], str]) -> None:
        self.setName("sd_notify")
        self._reactor = reactor
        self.notifier = notifier
        self._status = status
        self._last_status: str | None = None
        self._watchdog: LoopingCall | None = None
        self._status_loop: LoopingCall | None = None
        self.ready_sent = False
        self.pings = 0

    def startService(self) -> None:
        super().startService()
        if not self.notifier.enabled:
            return
        interval = self.notifier.watchdog_sec
        if interval:
            # The status line is looked at on the watchdog's wake-ups: no timer of its own.
            self._watchdog = LoopingCall(self._ping)
            self._watchdog.clock = self._reactor
            self._watchdog.start(interval, now=True)
            return
        self._status_loop = LoopingCall(self.update_status)
        self._status_loop.clock = self._reactor
        self._status_loop.start(STATUS_INTERVAL, now=False)

    def _ping(self) -> None:
        if self.notifier.notify("WATCHDOG=1"):
            self.pings += 1
        if self.ready_sent:
            self.update_status()

    # -- session listener: the line changes most when the stream opens or closes

    def session_opened(self) -> None:
        if self.ready_sent:
            self.update_status()

    def session_closed(self) -> None:
        if self.ready_sent:
            self.update_status()

    def frame_received(self, frame: Any) -> None:
        pass

    def ready(self) -> None:
        """Every service is up: C{READY=1} with the first status line."""
        if self.ready_sent or not self.notifier.enabled:
            return
        self.ready_sent = True
        line = self._current()
        self._last_status = line
        # No MAINPID=: in the standalone executable the main PID is PyInstaller's bootloader,
        # which must stay systemd's main process (it forwards signals and the exit status).
        self.notifier.notify("READY=1", "STATUS=" + line)

    def update_status(self, force: bool = False) -> None:
        if not self.notifier.enabled:
            return
        line = self._current()
        if force or line != self._last_status:
            self._last_status = line
            self.notifier.notify("STATUS=" + line)

    def _current(self) -> str:
        try:
            return status_line(self._status())
        except Exception:
            self.log.failure("Could not build the systemd status line")
            return "running"

    def stopping(self, why: str) -> None:
        """The agent begins to stop: C{STOPPING=1} and a status line saying why."""
        if not self.notifier.enabled:
            return
        line = status_line(why)
        self._last_status = line
        self.notifier.notify("STOPPING=1", "STATUS=" + line)

    def stopService(self) -> None:  # type: ignore[override]
        super().stopService()
        for loop in (self._status_loop, self._watchdog):
            if loop is not None and loop.running:
                loop.stop()
        self._status_loop = self._watchdog = None
        self.notifier.close()
