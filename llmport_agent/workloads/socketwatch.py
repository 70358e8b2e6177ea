"""
Told, not polled: when the engine's socket file appears (dockerd started, or restarted and its
socket made again), without a timer.

L{SocketWatch} watches, with inotify, the nearest existing directory on the way to the socket
(its own directory, or the parent the first missing component would be made in) for entries
created or moved in. An event naming the next component of the path (or saying that the
watched directory itself went away or that events were lost) re-checks the path: the socket is
there, or the watch moves one directory down, or back up when the watched directory itself
went away (deleted, moved, its file system unmounted). A path made between the check and the
watch is caught by checking again once the watch is in place.

The notifier is the agent's own (L{llmport_agent.workloads.inotify}), not Twisted's: no
C{ldconfig} process started and waited for on the reactor thread at start, and its descriptor
stays open when a watched directory is deleted.

A watch that ends without the socket appearing and without its owner stopping it (the path
kept changing, no inotify watch left: C{fs.inotify.max_user_watches}, the inotify descriptor
lost) calls its C{lost} callback: the engine then probes on its usual back-off again and tries
a new watch at its next failed probe.

L{watch_socket} gives C{None} where inotify cannot be used (not Linux, no inotify instance
left, a reactor without file descriptors such as a test clock): the engine then keeps probing
on its back-off.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IReactorFDSet
from twisted.logger import Logger

from llmport_agent.workloads.inotify import (
    IN_CREATE,
    IN_IGNORED,
    IN_MOVE_SELF,
    IN_MOVED_TO,
    IN_ONLYDIR,
    IN_Q_OVERFLOW,
    INotify,
)

#: At most this many directory changes in one re-check (a path that keeps changing under the
#: watch, or no inotify watch left): the watch then gives up and the engine probes on its
#: back-off.
MAX_MOVES = 64

#: What is asked for, on directories only; the kernel says C{IN_IGNORED} whenever a watch goes
#: away (its directory deleted, its file system unmounted), asked or not, and C{IN_Q_OVERFLOW}
#: when events were lost.
WATCH_MASK = IN_CREATE | IN_MOVED_TO | IN_MOVE_SELF | IN_ONLYDIR


def nearest_existing(path: str, exists: Callable[[str], bool] = os.path.isdir) -> str:
    """The nearest existing directory on the way to C{path} (its directory, or an ancestor)."""
    d = os.path.dirname(os.path.abspath(path)) or "/"
    while d != "/" and not exists(d):
        d = os.path.dirname(d) or "/"
    return d


def next_component(path: str, directory: str) -> str:
    """The name under C{directory} on the way to C{path} ("" when C{path} is not under it)."""
    prefix = directory.rstrip("/") + "/"
    if not path.startswith(prefix):
        return ""
    return path[len(prefix):].split("/", 1)[0]


class SocketWatch:
    """
    Calls C{appeared} once when C{path} exists, or C{lost} once when the watch ends without
    that and without L{stop} (see the module docstring).

    @param notifier: an object with C{watch(path, mask, callback)} (C{callback(mask, name)};
        gives the watch descriptor), C{ignore(wd)} and C{close()}: an
        L{llmport_agent.workloads.inotify.INotify} (see L{watch_socket}); L{notifierLost} is
        called when its descriptor is closed under the watch.
    """

    log = Logger()

    def __init__(
        self,
        notifier: Any,
        path: str,
        appeared: Callable[[], None],
        lost: Callable[[str], None] | None = None,
        *,
        exists: Callable[[str], bool] = os.path.exists,
        isdir: Callable[[str], bool] = os.path.isdir,
    ) -> None:
        self._notifier = notifier
        self.path = os.path.abspath(path)
        self._appeared = appeared
        self._lost = lost
        self._exists = exists
        self._isdir = isdir
        #: The directory watched now ("" when none), its watch descriptor, and the name in it
        #: on the way to the path.
        self.watched = ""
        self._wd: int | None = None
        self._next = ""
        self.active = True
        self.moves = 0

    def start(self) -> bool:
        """Watch; False when the path keeps changing (the caller probes instead)."""
        return self._recheck()

    def stop(self) -> None:
        if not self.active:
            return
        self.active = False
        self._unwatch()
        try:
            self._notifier.close()
        except Exception:
            self.log.failure("Closing the inotify watch of {path} failed", path=self.path)

    def _give_up(self, why: str) -> None:
        """The watch ended without the path appearing: stopped, and the owner told."""
        if not self.active:
            return
        self.stop()
        if self._lost is not None:
            self._lost(why)

    def notifierLost(self, reason: Any = None) -> None:
        """The inotify descriptor was closed under the watch: nothing more will be told."""
        if self.active:
            self._forget()  # gone with the descriptor
            self._give_up("the inotify descriptor was closed")

    def _forget(self) -> None:
        self.watched, self._wd, self._next = "", None, ""

    def _unwatch(self) -> None:
        wd = self._wd
        self._forget()
        if wd is not None:
            try:
                self._notifier.ignore(wd)
            except Exception:
                pass  # the kernel dropped it already (the directory went away)

    def _event(self, mask: int, name: str) -> None:
        if not self.active:
            return
        if mask & IN_IGNORED:
            # The kernel dropped the watch (the directory deleted, unmounted): the notifier
            # forgot it already.
            self._forget()
        elif mask & IN_MOVE_SELF:
            # The directory moved (the watch follows it elsewhere): forget it, even if the same
            # path is there again.
            self._unwatch()
        elif mask & IN_Q_OVERFLOW:
            # Events were lost, an IN_IGNORED among them maybe (the directory deleted and made
            # again: the watch would be a dead one on the same path): watch afresh.
            self._unwatch()
        elif name != self._next:
            return  # another entry of the watched directory
        self._check()

    def _check(self) -> None:
        if not self.active:
            return
        try:
            ok = self._recheck()
        except Exception:
            self.log.failure("Re-checking the watch of {path} failed", path=self.path)
            ok = False
        if not ok:
            self._give_up(f"its path kept changing or no inotify watch was left ({MAX_MOVES} tries)")

    def _recheck(self) -> bool:
        for _ in range(MAX_MOVES):
            if not self.active:
                return True
            if self._exists(self.path):
                self.stop()
                self._appeared()
                return True
            target = nearest_existing(self.path, self._isdir)
            if target == self.watched:
                return True
            self._unwatch()
            try:
                wd = self._notifier.watch(target, WATCH_MASK, self._event)
            except Exception:
                # Gone again between the check and the watch, or no watch left: look again.
                continue
            self.watched, self._wd, self._next = target, wd, next_component(self.path, target)
            self.moves += 1
        return False


def watch_socket(
    reactor: Any, path: str, appeared: Callable[[], None], lost: Callable[[str], None] | None = None
) -> SocketWatch | None:
    """
    A started L{SocketWatch} of C{path}, or C{None} where inotify cannot be used. C{lost(why)}
    is called if the watch ends without the path appearing and without C{stop()}.
    """
    if not IReactorFDSet.providedBy(reactor):
        return None
    try:
        notifier = INotify(reactor)
    except OSError:
        # Not Linux, or no inotify instance left (fs.inotify.max_user_instances).
        return None
    watch = SocketWatch(notifier, path, appeared, lost)
    notifier.on_lost = watch.notifierLost
    try:
        notifier.startReading()
        started = watch.start()
    except Exception:
        watch.stop()
        return None
    if not started:
        watch.stop()
        return None
    return watch
