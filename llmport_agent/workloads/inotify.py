"""
The agent's own inotify notifier: a descriptor on the reactor that tells each watch's callback
what happened in its directory.

Twisted has one (C{twisted.internet.inotify}), not used here for two reasons:

 - importing it loads libc with C{ctypes.util.find_library("c")}, which starts
   C{/sbin/ldconfig -p} and waits for it, on the reactor thread: a process and a few
   milliseconds at every start of a node without its engine's socket (the socket watch is made
   before the first connect);
 - it asks every watch for C{IN_DELETE_SELF} and answers it by closing its descriptor: one
   deleted directory would end every watch on it.

Here libc is the one the process already has mapped (C{ctypes.CDLL(None)}), and the descriptor
stays open until L{INotify.close} (or an error reading it): a watch the kernel drops (its
directory deleted, its file system unmounted) is said with C{IN_IGNORED} and forgotten. Events
are parsed from bounded reads, at most L{MAX_READS} reads a turn of the reactor; input that is
not whole events is dropped, never raised.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from typing import Any

from twisted.internet import main
from twisted.internet.interfaces import IReadDescriptor
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

#: <sys/inotify.h>
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000

#: One event's fixed part: wd (int32), mask, cookie, len (uint32), in the machine's order.
EVENT = struct.Struct("=iIII")

#: Bytes asked for by one read (whole events only: the kernel never splits one; an event is
#: 16 bytes and a name of at most 256).
READ_SIZE = 65536
#: Reads in one turn of the reactor at most (the descriptor stays readable: the rest is read
#: at the next turn).
MAX_READS = 16

Callback = Callable[[int, str], None]


def parse_events(data: bytes) -> list[tuple[int, int, int, str]]:
    """
    The events in C{data} as C{(wd, mask, cookie, name)}; a truncated event at the end (its
    fixed part, or a name running past the end) is dropped with what follows.
    """
    events: list[tuple[int, int, int, str]] = []
    offset, end = 0, len(data)
    while end - offset >= EVENT.size:
        wd, mask, cookie, length = EVENT.unpack_from(data, offset)
        offset += EVENT.size
        if length > end - offset:
            break
        name = data[offset:offset + length].split(b"\0", 1)[0]
        offset += length
        events.append((wd, mask, cookie, os.fsdecode(name)))
    return events


class _LibC:
    """inotify's three calls from the libc the process has mapped (no C{find_library})."""

    def __init__(self) -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        self.init1 = libc.inotify_init1
        self.init1.argtypes = [ctypes.c_int]
        self.init1.restype = ctypes.c_int
        self.add_watch = libc.inotify_add_watch
        self.add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self.add_watch.restype = ctypes.c_int
        self.rm_watch = libc.inotify_rm_watch
        self.rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        self.rm_watch.restype = ctypes.c_int
        self.get_errno = ctypes.get_errno

    def error(self, what: str) -> OSError:
        code = self.get_errno()
        return OSError(code, f"{what}: {os.strerror(code)}")


_libc: _LibC | None = None


def libc() -> _LibC:
    """The calls, loaded once; C{OSError} where there are none (not Linux, an old libc)."""
    global _libc
    if _libc is None:
        try:
            _libc = _LibC()
        except (OSError, AttributeError) as exc:
            raise OSError(f"inotify is not available here: {exc}") from None
    return _libc


@implementer(IReadDescriptor)
class INotify:
    """
    An inotify descriptor read by C{reactor} once L{startReading} ran.

    @param on_lost: called with the reason when the descriptor is closed by an error reading
        it (not by L{close}).
    @raise OSError: no inotify here, or no instance left (C{fs.inotify.max_user_instances}).
    """

    log = Logger()

    def __init__(self, reactor: Any, on_lost: Callable[[Failure], None] | None = None,
                 *, calls: _LibC | None = None) -> None:
        self._calls = calls if calls is not None else libc()
        fd = self._calls.init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise self._calls.error("inotify_init1")
        self._fd = fd
        self._reactor = reactor
        self.on_lost = on_lost
        #: wd -> (path, callback)
        self._watches: dict[int, tuple[str, Callback]] = {}
        self._reading = False
        self.closed = False

    # -- watches

    def watch(self, path: str, mask: int, callback: Callback) -> int:
        """
        Watch the directory C{path} for C{mask}: C{callback(mask, name)} for each event (and
        C{IN_IGNORED} when the kernel dropped the watch, C{IN_Q_OVERFLOW} when events were
        lost). The watch descriptor; C{OSError} when the kernel refuses (gone, not a
        directory with C{IN_ONLYDIR}, no watch left). A directory this descriptor watches
        already (another path to the same inode) gets the same watch descriptor back: the later
        callback replaces the earlier one (a socket watch watches one directory at a time).
        """
        if self.closed:
            raise OSError(f"the inotify descriptor is closed: cannot watch {path}")
        wd = self._calls.add_watch(self._fd, os.fsencode(path), mask)
        if wd < 0:
            raise self._calls.error(f"inotify_add_watch {path}")
        self._watches[wd] = (path, callback)
        return int(wd)

    def ignore(self, watch: int | str) -> bool:
        """Stop the watch C{watch} (its descriptor or path); False when there is none."""
        if isinstance(watch, str):
            wds = [wd for wd, (path, _) in self._watches.items() if path == watch]
        else:
            wds = [watch] if watch in self._watches else []
        for wd in wds:
            del self._watches[wd]
            if not self.closed:
                # -1 (EINVAL) when the kernel dropped it already: its IN_IGNORED is on its way.
                self._calls.rm_watch(self._fd, wd)
        return bool(wds)

    def watched(self) -> list[str]:
        return [path for path, _ in self._watches.values()]

    # -- the descriptor

    def startReading(self) -> None:
        if not self.closed and not self._reading:
            self._reading = True
            self._reactor.addReader(self)

    def close(self) -> None:
        """Stop reading and close the descriptor (once; again is a no-op)."""
        if self.closed:
            return
        self.closed = True
        self._watches.clear()
        try:
            if self._reading:
                self._reading = False
                self._reactor.removeReader(self)
        finally:
            os.close(self._fd)

    def fileno(self) -> int:
        return -1 if self.closed else self._fd

    def logPrefix(self) -> str:
        return "inotify"

    def connectionLost(self, reason: Failure) -> None:
        """The reactor gave up on the descriptor (an error reading it): closed, and said."""
        if self.closed:
            return
        self._reading = False  # the reactor removed it
        self.close()
        if self.on_lost is not None:
            self.on_lost(reason)

    def doRead(self) -> Any:
        for _ in range(MAX_READS):
            if self.closed:
                return None
            try:
                data = os.read(self._fd, READ_SIZE)
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as exc:
                return exc
            if not data:
                return main.CONNECTION_LOST
            self.dispatch(parse_events(data))
            if len(data) < READ_SIZE - EVENT.size - 256:
                return None  # read to the end (saves the read that says EAGAIN)
        return None

    def dispatch(self, events: list[tuple[int, int, int, str]]) -> None:
        """Call each event's watch; a failing callback is logged, never raised to the reactor."""
        for wd, mask, _cookie, name in events:
            if self.closed:
                return
            if mask & IN_Q_OVERFLOW:
                # Events were lost: every watch looks again.
                targets = [cb for _, cb in self._watches.values()]
            else:
                entry = self._watches.get(wd)
                if entry is None:
                    continue  # ignored already (its IN_IGNORED after ignore())
                if mask & IN_IGNORED:
                    del self._watches[wd]
                targets = [entry[1]]
            for callback in targets:
                if self.closed:
                    return  # a callback closed the notifier
                try:
                    callback(mask, name)
                except Exception:
                    self.log.failure("An inotify callback failed (event {mask:#x})", mask=mask)
