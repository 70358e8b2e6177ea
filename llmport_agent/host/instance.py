"""
One agent per state file: an exclusive C{flock} on C{<state>.lock} beside it (C{state.json} ->
C{state.lock}, the file the original agent locks too, so the two exclude each other), held for
the life of the process. The kernel releases it however the process ends (a C{kill -9}
included), so a stale lock never blocks the next start.

The holder writes its PID into the file (the lock is advisory: writing does not touch it), so a
second agent can say which process holds it. The original agent leaves the file empty. The file
is opened without following a link and must be a regular file with one name: a hard link to
another file (which the PID would overwrite) or a FIFO planted there is refused, untouched.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from attrs import field

from llmport_agent.core.values import define

#: The most of the lock file read to find the holder's PID.
_PID_READ = 64


def lock_path(state_path: str) -> str:
    """C{/var/lib/llmport-agent/state.json} -> C{/var/lib/llmport-agent/state.lock}."""
    root, _ext = os.path.splitext(os.path.abspath(state_path))
    return root + ".lock"


class AlreadyRunning(Exception):
    """Another process holds the lock. C{str()} is the one line to show the operator."""

    def __init__(self, path: str, pid: int | None) -> None:
        who = f"process {pid}" if pid else "another process (it wrote no PID: the original agent?)"
        super().__init__(
            f"another llmport-agent is already running on this node's state: {who} holds {path}; "
            "two agents on one state answer the same node's commands twice. Stop that one first "
            "(systemctl stop llmport-agent, or kill it), or give this one its own "
            "LLM_PORT_NODE_AGENT_STATE_PATH"
        )
        self.path = path
        self.pid = pid


def _read_pid(fd: int) -> int | None:
    try:
        raw = os.pread(fd, _PID_READ, 0)
    except OSError:
        return None
    text = raw.decode("ascii", "replace").strip()
    return int(text) if text.isdigit() and 0 < int(text) < 1 << 31 else None


@define(eq=False, repr=False)  # a component: identity, not value
class InstanceLock:
    """
    The lock of one state file. L{acquire} and L{release} are blocking (a file open and a
    C{flock}); the agent runs them on its I/O pool.
    """

    state_path: str
    path: str = field(init=False)
    _fd: int | None = field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        self.path = lock_path(self.state_path)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """
        Take the lock (non-blocking) and write this PID into the file.

        @raise AlreadyRunning: another process holds it.
        @raise OSError: the lock file cannot be created (permissions, disk).
        """
        if self._fd is not None:
            return
        directory = os.path.dirname(self.path)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            # A hard link to another file (the PID would be written into it) or a FIFO or device
            # planted in the state directory: never written, never locked.
            os.close(fd)
            what = "a hard link to another file" if stat.S_ISREG(st.st_mode) else "not a regular file"
            raise OSError(errno.EPERM, f"the lock file is {what}; remove it (rm {self.path}) and start again",
                          self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            pid = _read_pid(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise AlreadyRunning(self.path, pid) from None
            raise
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # the lock is what counts; the PID is for the message only
        self._fd = fd

    def release(self) -> None:
        """Give the lock back (the PID is cleared first, so nobody names a dead process)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)
