"""
Told, not polled: when the engine's socket file appears (dockerd started, or restarted and its
socket made again), without a timer.

L{SocketWatch} watches, with inotify, the nearest existing directory on the way to the socket
(its own directory, or the parent the first missing component would be made in) for entries
created or moved in. Each event there re-checks the path: the socket is there, or the watch
moves one directory down, or back up when the watched directory itself went away (deleted,
moved, its file system unmounted). A path made between the check and the watch is caught by
checking again once the watch is in place.

Twisted's C{INotify} asks every watch for C{IN_DELETE_SELF} and answers it by dropping that
watch and closing its inotify descriptor: one deleted directory would end the whole watch. The
notifier made here keeps its descriptor open until its L{SocketWatch} stops; the watch forgets
the dropped directory and moves up once Twisted has dropped it.

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

#: At most this many directory changes in one re-check (a path that keeps changing under the
#: watch, or no inotify watch left): the watch then gives up and the engine probes on its
#: back-off.
MAX_MOVES = 64

#: inotify's flags (<sys/inotify.h>; the same values Twisted's C{inotify} module names, without
#: importing it before a watch is made).
IN_CREATE = 0x100
IN_MOVED_TO = 0x080
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_IGNORED = 0x8000

#: What is asked for (Twisted adds C{IN_DELETE_SELF}); the kernel says C{IN_IGNORED} whenever a
#: watch goes away (its directory deleted, its file system unmounted), asked or not.
WATCH_MASK = IN_CREATE | IN_MOVED_TO | IN_MOVE_SELF


def nearest_existing(path: str, exists: Callable[[str], bool] = os.path.isdir) -> str:
    """The nearest existing directory on the way to C{path} (its directory, or an ancestor)."""
    d = os.path.dirname(os.path.abspath(path)) or "/"
    while d != "/" and not exists(d):
        d = os.path.dirname(d) or "/"
    return d


class SocketWatch:
    """
    Calls C{appeared} once when C{path} exists, or C{lost} once when the watch ends without
    that and without L{stop} (see the module docstring).

    @param notifier: an object with C{watch(FilePath, mask, callbacks)}, C{ignore(FilePath)}
        and C{close()} (see L{watch_socket}); L{notifierLost} is called when its descriptor is
        closed under the watch.
    @param later: calls a function soon, from the reactor (C{None}: at once).
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
        later: Callable[[Callable[[], None]], Any] | None = None,
    ) -> None:
        self._notifier = notifier
        self.path = os.path.abspath(path)
        self._appeared = appeared
        self._lost = lost
        self._later = later
        self._exists = exists
        self._isdir = isdir
        #: The directory watched now ("" when none).
        self.watched = ""
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
            self.watched = ""  # gone with the descriptor
            self._give_up("the inotify descriptor was closed")

    def _unwatch(self) -> None:
        from twisted.python.filepath import FilePath

        if self.watched:
            try:
                self._notifier.ignore(FilePath(self.watched))
            except Exception:
                pass  # the kernel dropped it already (the directory went away)
            self.watched = ""

    def _event(self, _watch: Any, _path: Any, mask: int) -> None:
        if not self.active:
            return
        if mask & IN_DELETE_SELF:
            # The watched directory was deleted: Twisted drops its watch once this returns (and
            # would hand back that dead watch for the same path until then). Looked at again
            # after that.
            self.watched = ""
            if self._later is not None:
                self._later(self._check)
                return
        elif mask & (IN_IGNORED | IN_MOVE_SELF):
            # The kernel dropped the watch (unmounted), or the directory moved (the watch follows
            # it elsewhere): forget it, even if the same path is there again.
            self._unwatch()
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
        from twisted.python.filepath import FilePath

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
                self._notifier.watch(FilePath(target), mask=WATCH_MASK, callbacks=[self._event])
            except Exception:
                # Gone again between the check and the watch, or no watch left: look again.
                continue
            self.watched = target
            self.moves += 1
        return False


def _notifier(reactor: Any) -> Any:
    """
    Twisted's C{INotify}, closed only by C{close()} (Twisted closes it when a watched directory
    is deleted: see the module docstring), and saying when its descriptor is closed anyway
    (C{on_lost}).
    """
    from twisted.internet import inotify

    class Notifier(inotify.INotify):  # type: ignore[misc]
        on_lost: Callable[[Any], None] | None = None

        def loseConnection(self, *args: Any) -> None:
            """Twisted's answer to a deleted watched directory: the descriptor is kept."""

        def close(self) -> None:
            super().loseConnection()

        def connectionLost(self, reason: Any) -> None:
            super().connectionLost(reason)
            if self.on_lost is not None:
                self.on_lost(reason)

    return Notifier(reactor)


def watch_socket(
    reactor: Any, path: str, appeared: Callable[[], None], lost: Callable[[str], None] | None = None
) -> SocketWatch | None:
    """
    A started L{SocketWatch} of C{path}, or C{None} where inotify cannot be used. C{lost(why)}
    is called if the watch ends without the path appearing and without C{stop()}.
    """
    clock: Any = reactor  # (not narrowed to IReactorFDSet below)
    if not IReactorFDSet.providedBy(reactor):
        return None
    try:
        notifier = _notifier(reactor)
        notifier.startReading()
    except Exception:
        # Not Linux, or no inotify instance left (fs.inotify.max_user_instances).
        return None
    watch = SocketWatch(notifier, path, appeared, lost, later=lambda f: clock.callLater(0, f))
    notifier.on_lost = watch.notifierLost
    try:
        started = watch.start()
    except Exception:
        watch.stop()
        return None
    if not started:
        watch.stop()
        return None
    return watch
