"""
Told, not polled: when the engine's socket file appears (dockerd started, or restarted and its
socket made again), without a timer.

L{SocketWatch} watches, with inotify, the nearest existing directory on the way to the socket
(its own directory, or the parent the first missing component would be made in) for entries
created or moved in. Each event there re-checks the path: the socket is there, or the watch
moves one directory down (or back up, if the watched directory itself went away). A path made
between the check and the watch is caught by checking again once the watch is in place.

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
#: watch): the watch then gives up and the engine probes on its back-off.
MAX_MOVES = 64


def nearest_existing(path: str, exists: Callable[[str], bool] = os.path.isdir) -> str:
    """The nearest existing directory on the way to C{path} (its directory, or an ancestor)."""
    d = os.path.dirname(os.path.abspath(path)) or "/"
    while d != "/" and not exists(d):
        d = os.path.dirname(d) or "/"
    return d


class SocketWatch:
    """
    Calls C{appeared} once when C{path} exists (see the module docstring).

    @param notifier: an object with C{watch(FilePath, mask, callbacks)}, C{ignore(FilePath)}
        and C{loseConnection()} (Twisted's C{INotify}).
    """

    log = Logger()

    def __init__(
        self,
        notifier: Any,
        path: str,
        appeared: Callable[[], None],
        *,
        exists: Callable[[str], bool] = os.path.exists,
        isdir: Callable[[str], bool] = os.path.isdir,
    ) -> None:
        self._notifier = notifier
        self.path = os.path.abspath(path)
        self._appeared = appeared
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
            self._notifier.loseConnection()
        except Exception:
            self.log.failure("Closing the inotify watch of {path} failed", path=self.path)

    def _unwatch(self) -> None:
        from twisted.python.filepath import FilePath

        if self.watched:
            try:
                self._notifier.ignore(FilePath(self.watched))
            except Exception:
                pass  # the kernel dropped it already (the directory went away)
            self.watched = ""

    def _event(self, _watch: Any, _path: Any, _mask: int) -> None:
        if self.active and not self._recheck():
            self.stop()

    def _recheck(self) -> bool:
        from twisted.internet import inotify
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
            mask = inotify.IN_CREATE | inotify.IN_MOVED_TO | inotify.IN_DELETE_SELF | inotify.IN_MOVE_SELF
            try:
                self._notifier.watch(FilePath(target), mask=mask, callbacks=[self._event])
            except Exception:
                # Gone again between the check and the watch, or no watch left: look again.
                continue
            self.watched = target
            self.moves += 1
        return False


def watch_socket(reactor: Any, path: str, appeared: Callable[[], None]) -> SocketWatch | None:
    """A started L{SocketWatch} of C{path}, or C{None} where inotify cannot be used."""
    if not IReactorFDSet.providedBy(reactor):
        return None
    try:
        from twisted.internet import inotify

        notifier = inotify.INotify(reactor)
        notifier.startReading()
    except Exception:
        # Not Linux, or no inotify instance left (fs.inotify.max_user_instances).
        return None
    watch = SocketWatch(notifier, path, appeared)
    try:
        started = watch.start()
    except Exception:
        watch.stop()
        return None
    if not started:
        watch.stop()
        return None
    return watch
