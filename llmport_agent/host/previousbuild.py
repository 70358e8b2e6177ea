"""
The previous build, kept beside the installed executable so that a failed upgrade can go back.

C{start} restarts the unit with whatever build is at the unit's C{ExecStart} path. An upgrade
(llm-port's install script, or an operator) puts the new executable there first, so when the
new build does not come up, putting back the previous unit and env file is not enough: the
previous executable is gone. This module keeps a copy of it as C{<executable>.previous}:

- before the restart, from the running agent (C{/proc/<MainPID>/exe}) when that process runs
  the executable at this path and the file there has since been replaced (the first upgrade
  from a build that kept no copy, or from the original agent's binary); the link is read and
  opened through one descriptor of C{/proc/<MainPID>}, and what was opened must be what the
  link named, so a process that exits in between (its number reused by another program) is
  never taken for the build;
- after a restart that came up, from the executable itself (the build that last started).

Only a regular file owned by the installing user (root for the system unit), in a directory of
that user or root, neither of them writable by group or others, is kept or put back; links are
never followed; every write is a new file beside the target renamed over it (atomic), and a
restore is the same rename of a copy of C{.previous} over the executable.

Blocking (a one-shot command line tool's work, never on the reactor).
"""

from __future__ import annotations

import os
import stat

from llmport_agent.core import safefs
from llmport_agent.core.values import define

SUFFIX = ".previous"
#: No executable this agent ships comes near it; a larger file is not copied (bounded work).
MAX_EXECUTABLE = 2 << 30
_CHUNK = 1 << 20


class NotKept(Exception):
    """Why the previous build is not kept or put back (one clause, for the operator's line)."""


@define
class PreviousBuild:
    """The executable at C{path} and its kept copy C{path + SUFFIX}, owned by C{owner}."""

    path: str
    owner: int
    proc: str = "/proc"

    @property
    def kept(self) -> str:
        return self.path + SUFFIX

    # -- checks -----------------------------------------------------------------------------

    def _open_dir(self) -> int:
        directory = os.path.dirname(os.path.abspath(self.path))
        try:
            fd = safefs.open_dir(directory)
        except OSError as e:
            raise NotKept(f"{directory} cannot be opened ({e.strerror})") from None
        st = os.fstat(fd)
        if st.st_uid not in (0, self.owner) or st.st_mode & 0o022:
            os.close(fd)
            raise NotKept(f"{directory} is writable by others or owned by another user "
                          f"({safefs.describe_mode(st.st_mode)}, uid {st.st_uid})")
        return fd

    def _trusted(self, st: os.stat_result, what: str) -> None:
        if not stat.S_ISREG(st.st_mode):
            raise NotKept(f"{what} is {safefs.describe_mode(st.st_mode)}, not a regular file")
        if st.st_uid != self.owner or st.st_mode & 0o022:
            raise NotKept(f"{what} is owned by uid {st.st_uid} or writable by others, so it is left alone")
        if st.st_size > MAX_EXECUTABLE:
            raise NotKept(f"{what} is larger than {MAX_EXECUTABLE >> 30} GiB")

    def _open_at(self, dir_fd: int, name: str) -> tuple[int, os.stat_result]:
        try:
            fd, st = safefs.open_file_at(dir_fd, name, where=os.path.join(os.path.dirname(self.path), name))
        except FileNotFoundError:
            raise NotKept(f"{os.path.join(os.path.dirname(self.path), name)} does not exist") from None
        except OSError as e:
            raise NotKept(f"{e.filename or name} cannot be opened ({e.strerror})") from None
        try:
            self._trusted(st, os.path.join(os.path.dirname(self.path), name))
        except NotKept:
            os.close(fd)
            raise
        return fd, st

    # -- the two copies ---------------------------------------------------------------------

    def keep_running(self, pid: int) -> bool:
        """
        Before the restart: when process C{pid} (the unit's main process) runs the executable at
        this path and that file has been replaced since it started, copy what it runs to
        C{.previous}. C{False} when there was nothing to keep (another program runs, the same
        file is still in place).
        """
        if pid <= 0:
            return False
        # The link is read and opened through one descriptor of /proc/<pid>: the process, not its
        # number (one that exits in between, its number taken by another program, fails both).
        try:
            proc_fd = os.open(os.path.join(self.proc, str(pid)), safefs.DIR_FLAGS)
        except OSError:
            return False
        try:
            return self._keep_running(proc_fd)
        finally:
            os.close(proc_fd)

    def _keep_running(self, proc_fd: int) -> bool:
        try:
            target = os.readlink("exe", dir_fd=proc_fd)
        except OSError:
            return False
        names = {os.path.abspath(self.path), os.path.realpath(self.path)}
        if target.removesuffix(" (deleted)") not in names:
            return False  # an interpreter, a wrapper's child: not a build of its own
        dir_fd = self._open_dir()
        try:
            try:
                src = os.open("exe", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc_fd)  # the running inode
            except OSError as e:
                raise NotKept(f"the running build cannot be read ({e.strerror})") from None
            try:
                try:
                    opened = os.readlink(f"/proc/self/fd/{src}")
                except OSError:
                    opened = target
                if opened != target:
                    raise NotKept("the running process changed while its build was read")
                st = os.fstat(src)
                self._trusted(st, "the running build")
                now = safefs.lstat_at(dir_fd, os.path.basename(self.path))
                if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                    return False  # not replaced: the kept copy (if any) stays what it is
                self._copy(src, st, dir_fd, os.path.basename(self.kept))
            finally:
                os.close(src)
        finally:
            os.close(dir_fd)
        return True

    def keep_current(self) -> bool:
        """After a restart that came up: C{.previous} := the executable (C{False}: already equal)."""
        return self._mirror(self.path, self.kept)

    def restore(self) -> bool:
        """
        Put C{.previous} back at the executable's path (a copy renamed over it; the kept copy
        stays). C{False} when the executable already is that build.

        @raise NotKept: there is no trustworthy copy.
        """
        return self._mirror(self.kept, self.path)

    # -- helpers ----------------------------------------------------------------------------

    def _mirror(self, source: str, target: str) -> bool:
        """C{target} := a copy of C{source} (both in the executable's directory); C{False}: equal."""
        dir_fd = self._open_dir()
        try:
            src, st = self._open_at(dir_fd, os.path.basename(source))
            try:
                if self._same_as(src, st, dir_fd, os.path.basename(target)):
                    return False
                self._copy(src, st, dir_fd, os.path.basename(target))
            finally:
                os.close(src)
        finally:
            os.close(dir_fd)
        return True

    def _same_as(self, src: int, st: os.stat_result, dir_fd: int, name: str) -> bool:
        """Whether regular file C{name} holds the same bytes as C{src} (read from the start)."""
        try:
            other, ost = safefs.open_file_at(dir_fd, name)
        except OSError:
            return False
        try:
            if ost.st_size != st.st_size or stat.S_IMODE(ost.st_mode) != stat.S_IMODE(st.st_mode):
                return False
            os.lseek(src, 0, os.SEEK_SET)
            left = st.st_size
            while left > 0:
                a = os.read(src, min(_CHUNK, left))
                if not a or os.read(other, len(a)) != a:
                    return False
                left -= len(a)
            return True
        finally:
            os.close(other)
            os.lseek(src, 0, os.SEEK_SET)

    def _copy(self, src: int, st: os.stat_result, dir_fd: int, name: str) -> None:
        """C{src} -> C{name} in C{dir_fd}: a new file beside it, fsynced, renamed over it."""
        mode = stat.S_IMODE(st.st_mode) & 0o755
        fd, tmp = safefs.create_temp_file_at(dir_fd, f".{name[:64]}.", mode)
        try:
            try:
                os.lseek(src, 0, os.SEEK_SET)
                left = st.st_size
                while left > 0:
                    block = os.read(src, min(_CHUNK, left))
                    if not block:
                        raise NotKept("the build changed while it was copied")
                    view = memoryview(block)
                    while view:
                        view = view[os.write(fd, view):]
                    left -= len(block)
                os.fchmod(fd, mode)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
        safefs.fsync_fd(dir_fd)
