"""
File operations that never follow a symbolic link, for directories that other processes can
write (the model store is mounted into workload containers).

Everything here works relative to an open directory file descriptor: a directory is entered
with C{O_DIRECTORY|O_NOFOLLOW}, a file is opened through an C{O_PATH|O_NOFOLLOW} handle that
is checked to be a regular file before it is opened for real (so a FIFO or a device node
planted where a file belongs is never opened, and never blocks a thread), new files are
created with C{O_CREAT|O_EXCL|O_NOFOLLOW}, and renames, unlinks and symlinks are the C{*at()}
calls, which act on the link itself. A directory held open stays the same directory whatever
is renamed around it, so a walk that starts inside a tree can never leave it.

Blocking: call these from a worker thread. Only Linux (and other systems with C{dir_fd}
support) is supported; C{O_PATH} is used where the system has it.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
O_PATH = getattr(os, "O_PATH", 0)
O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
O_NOCTTY = getattr(os, "O_NOCTTY", 0)

#: Flags that open an existing directory without following a link in the last component.
DIR_FLAGS = os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC

#: The most descriptors L{remove_tree} holds open (one per level); deeper directories are moved
#: up and removed in a later pass, so no depth stops it.
MAX_TREE_DEPTH = 128

#: Called as C{on_foreign(relative_path, what_was_there)} when something that is not what the
#: agent expects (a symlink, a FIFO, a file where a directory belongs) has been removed.
ForeignCallback = Callable[[str, str], None]

_NOT_A_DIR = (errno.ENOTDIR, errno.ELOOP)
_PROC_FD = "/proc/self/fd"


class NotRegularFile(OSError):
    """A name that must be a regular file is something else (the message says what)."""


def describe_mode(mode: int) -> str:
    """A few words for what a C{st_mode} is: C{"a symbolic link"}, C{"a FIFO"}, ..."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device node"
    return "an unknown kind of file"


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    """C{lstat} of C{name} in C{dir_fd}, or C{None} when it does not exist."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def open_dir(path: str) -> int:
    """
    Open a directory the operator named (the model store's own path). Links in I{this} path
    are followed on purpose: the operator may point the store at another disk. Everything
    below it is entered with L{open_dir_at}.
    """
    return os.open(path, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)


def open_dir_at(
    parent_fd: int,
    name: str,
    *,
    create: bool = False,
    mode: int = 0o755,
    on_foreign: ForeignCallback | None = None,
    where: str = "",
) -> int:
    """
    Open directory C{name} inside C{parent_fd} without following a link.

    @param create: create it when missing; anything else in its place (a symlink, a file, a
        FIFO) is removed without being followed, reported to C{on_foreign}, and replaced by
        a directory. Without C{create}, a missing name raises C{FileNotFoundError} and
        anything that is not a directory raises C{NotADirectoryError}.
    @param where: the relative path of C{name}, for messages.
    @return: a new descriptor (close it).
    """
    label = where or name
    created = False
    for _ in range(4):
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
        except FileNotFoundError:
            if not create:
                raise
        except OSError as e:
            if e.errno not in _NOT_A_DIR:
                raise
            if not create:
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", label) from None
            st = lstat_at(parent_fd, name)
            if st is not None and not stat.S_ISDIR(st.st_mode):
                remove_entry(parent_fd, name, where=label)
                if on_foreign is not None:
                    on_foreign(label, describe_mode(st.st_mode))
        else:
            if created:
                os.fchmod(fd, mode)  # the mode asked for, not narrowed by the umask
            return fd
        try:
            os.mkdir(name, mode, dir_fd=parent_fd)
            created = True
        except FileExistsError:
            pass  # raced with someone else: look again
    raise NotADirectoryError(errno.ENOTDIR, "keeps being replaced by something else", label)


@contextmanager
def opened_dir_at(parent_fd: int, name: str, **kw: object) -> Iterator[int]:
    """L{open_dir_at} as a context manager that closes the descriptor."""
    fd = open_dir_at(parent_fd, name, **kw)  # type: ignore[arg-type]
    try:
        yield fd
    finally:
        os.close(fd)


def open_path_at(root_fd: int, parts: list[str], *, create: bool = False,
                 on_foreign: ForeignCallback | None = None, where: str = "") -> int:
    """
    Walk C{parts} (directory names) down from C{root_fd} with L{open_dir_at}; returns a new
    descriptor of the last one (C{os.dup} of C{root_fd} for no parts).
    """
    fd = os.dup(root_fd)
    done: list[str] = [where] if where else []
    try:
        for part in parts:
            done.append(part)
            child = open_dir_at(fd, part, create=create, on_foreign=on_foreign,
                                where="/".join(done))
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file_at(dir_fd: int, name: str, flags: int = os.O_RDONLY, *,
                 where: str = "") -> tuple[int, os.stat_result]:
    """
    Open the existing regular file C{name} in C{dir_fd}: never through a link, and never a
    FIFO, socket or device node (those raise L{NotRegularFile} without being opened; with
    C{O_PATH} the check and the open name the same inode, so there is no race).

    @param flags: C{os.O_RDONLY}, C{os.O_RDWR}, ...; C{O_CREAT} is not allowed (use
        L{create_file_at}).
    @return: C{(fd, fstat of it)}.
    @raise FileNotFoundError: it does not exist.
    """
    if flags & os.O_CREAT:
        raise ValueError("open_file_at opens existing files only")
    label = where or name
    if O_PATH and os.path.isdir(_PROC_FD):
        handle = os.open(name, O_PATH | O_NOFOLLOW | O_CLOEXEC, dir_fd=dir_fd)
        try:
            st = os.fstat(handle)
            if not stat.S_ISREG(st.st_mode):
                raise NotRegularFile(errno.EINVAL, f"is {describe_mode(st.st_mode)}", label)
            fd = os.open(f"{_PROC_FD}/{handle}", flags | O_CLOEXEC | O_NOCTTY)
        finally:
            os.close(handle)
    else:  # no O_PATH: open without blocking, then check before any read or write
        st0 = lstat_at(dir_fd, name)
        if st0 is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", label)
        if not stat.S_ISREG(st0.st_mode):
            raise NotRegularFile(errno.EINVAL, f"is {describe_mode(st0.st_mode)}", label)
        fd = os.open(name, flags | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, dir_fd=dir_fd)
        os.set_blocking(fd, True)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, f"is {describe_mode(st.st_mode)}", label)
    return fd, st


def create_file_at(dir_fd: int, name: str, mode: int = 0o644, flags: int = os.O_RDWR) -> int:
    """Create a new regular file (fails with C{FileExistsError} if anything has that name)."""
    return os.open(name, flags | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode,
                   dir_fd=dir_fd)


def create_temp_file_at(dir_fd: int, prefix: str, mode: int = 0o600) -> tuple[int, str]:
    """A new uniquely named regular file in C{dir_fd}: C{(fd, name)}."""
    for _ in range(100):
        name = f"{prefix}{secrets.token_hex(6)}.tmp"
        try:
            return create_file_at(dir_fd, name, mode, os.O_WRONLY), name
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", prefix)


def make_temp_dir_at(dir_fd: int, prefix: str, mode: int = 0o755) -> str:
    """A new uniquely named empty directory in C{dir_fd}; returns its name."""
    for _ in range(100):
        name = f"{prefix}{secrets.token_hex(6)}"
        try:
            os.mkdir(name, mode, dir_fd=dir_fd)
        except FileExistsError:
            continue
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
        try:
            os.fchmod(fd, mode)  # not narrowed by the umask
        finally:
            os.close(fd)
        return name
    raise FileExistsError(errno.EEXIST, "no free temporary name", prefix)


def read_file_at(dir_fd: int, name: str, limit: int, *, where: str = "") -> bytes:
    """The first C{limit} bytes of regular file C{name} (L{open_file_at} rules)."""
    fd, _ = open_file_at(dir_fd, name, where=where)
    try:
        chunks: list[bytes] = []
        left = limit
        while left > 0:
            block = os.read(fd, min(left, 1 << 20))
            if not block:
                break
            chunks.append(block)
            left -= len(block)
        return b"".join(chunks)
    finally:
        os.close(fd)


def fsync_fd(fd: int) -> None:
    """fsync, ignoring file systems that cannot sync a directory (EINVAL)."""
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise


def atomic_write_at(
    dir_fd: int,
    name: str,
    data: bytes,
    mode: int = 0o600,
    *,
    tmp_dir_fd: int | None = None,
    durable: bool = True,
) -> None:
    """
    Replace C{name} in C{dir_fd} with C{data} atomically: a new temporary file (created with
    C{O_EXCL|O_NOFOLLOW} in C{tmp_dir_fd}, by default C{dir_fd}; same file system), written,
    fsynced, renamed over C{name} (a link there is replaced, never followed), and the
    directory fsynced. With C{durable=False} both fsyncs are skipped (a hint that may be
    lost on power failure, never torn).
    """
    tmp_fd = dir_fd if tmp_dir_fd is None else tmp_dir_fd
    fd, tmp = create_temp_file_at(tmp_fd, f".{name[:64]}.", mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=tmp_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=tmp_fd)
        except OSError:
            pass
        raise
    if durable:
        fsync_fd(dir_fd)


def remove_entry(dir_fd: int, name: str, *, where: str = "") -> bool:
    """
    Remove C{name} from C{dir_fd} whatever it is, never following a link: a directory with
    L{remove_tree}, anything else with C{unlink}. @return: whether something was removed.
    """
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return False
    except (IsADirectoryError, PermissionError) as e:
        # Linux answers EISDIR for directories; some systems EPERM.
        st = lstat_at(dir_fd, name)
        if st is None:
            return False
        if not stat.S_ISDIR(st.st_mode):
            raise e from None
    remove_tree(dir_fd, name, where=where)
    return True


def remove_tree(dir_fd: int, name: str, *, where: str = "") -> None:
    """
    Remove the directory C{name} in C{dir_fd} and everything under it, by descriptors only
    (no path is ever resolved, no link followed, nothing opened but directories). Iterative,
    linear in the entries, however deep the tree: at most L{MAX_TREE_DEPTH} descriptors are
    held, and a directory found below that depth is moved up into the tree's top directory
    (a rename inside the tree being removed) and removed from there in a later pass. A
    directory replaced by something else while the walk runs is unlinked instead.
    """
    label = where or name
    hoisted = 0
    while True:
        try:
            top = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno not in _NOT_A_DIR:
                raise
            try:
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            return
        moved = _remove_pass(dir_fd, name, top, label, hoisted)
        if moved < 0:
            return  # the top directory itself is gone
        hoisted += moved
        if hoisted > MAX_HOISTED:
            raise OSError(errno.ELOOP, f"more than {MAX_HOISTED} directories below depth {MAX_TREE_DEPTH}", label)


#: The most directories L{remove_tree} moves up from below L{MAX_TREE_DEPTH} (a tree that grows
#: while it is removed cannot keep the walk going for ever).
MAX_HOISTED = 1 << 20


def _remove_pass(dir_fd: int, name: str, top: int, label: str, hoisted: int) -> int:
    """
    One walk of the tree C{name} (open as C{top}, which this closes): everything removed that can
    be within L{MAX_TREE_DEPTH} levels, deeper directories moved up into C{top}. -1: the top
    directory is removed; else how many directories were moved up (another pass is needed).
    """
    # stack of (parent fd, name in parent, own fd, entries iterator)
    try:
        listing = os.scandir(top)
    except BaseException:
        os.close(top)
        raise
    stack: list[tuple[int, str, int, Iterator[os.DirEntry[str]]]] = [
        (dir_fd, name, top, _closing_iter(listing))
    ]
    moved = 0
    try:
        while stack:
            parent, own_name, fd, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:
                stack.pop()
                os.close(fd)
                try:
                    os.rmdir(own_name, dir_fd=parent)
                except FileNotFoundError:
                    pass
                except NotADirectoryError:
                    # A writer swapped the directory for a link (or a file) since it was opened:
                    # the name goes (the link itself, never what it points at).
                    try:
                        os.unlink(own_name, dir_fd=parent)
                    except FileNotFoundError:
                        pass
                except OSError as e:
                    # Not empty: a directory moved up into the top one after its listing passed
                    # it (or a writer added one); the next pass takes it.
                    if e.errno != errno.ENOTEMPTY or stack:
                        raise
                    return moved or 1
                continue
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            if not is_dir:
                try:
                    os.unlink(entry.name, dir_fd=fd)
                except FileNotFoundError:
                    pass
                except IsADirectoryError:
                    is_dir = True  # became a directory since scandir
                if not is_dir:
                    continue
            if len(stack) >= MAX_TREE_DEPTH:
                # No deeper descriptor: the directory moves up into the top one (same tree, same
                # file system; whatever it holds goes with it) under a name of its own.
                if hoisted + moved >= MAX_HOISTED:
                    raise OSError(errno.ELOOP, f"more than {MAX_HOISTED} directories below depth "
                                  f"{MAX_TREE_DEPTH}", label)
                try:
                    os.rename(entry.name, f".deep-{hoisted + moved}-{os.urandom(4).hex()}", src_dir_fd=fd,
                              dst_dir_fd=top)
                except FileNotFoundError:
                    continue
                moved += 1
                continue
            try:
                child = os.open(entry.name, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                continue
            except OSError as e:
                if e.errno not in _NOT_A_DIR:
                    raise
                try:
                    os.unlink(entry.name, dir_fd=fd)
                except FileNotFoundError:
                    pass
                continue
            try:
                listing = os.scandir(child)
            except BaseException:
                os.close(child)
                raise
            stack.append((fd, entry.name, child, _closing_iter(listing)))
    finally:
        for _, _, fd, entries in stack:
            close = getattr(entries, "close", None)
            if close is not None:
                close()
            os.close(fd)
    return -1


class _Listing(Protocol):
    """What C{os.scandir} returns: an iterator of entries that is its own context manager."""

    def __iter__(self) -> Iterator[os.DirEntry[str]]: ...

    def __enter__(self) -> object: ...

    def __exit__(self, *exc: object) -> object: ...


def _closing_iter(it: _Listing) -> Iterator[os.DirEntry[str]]:
    with it:
        yield from it
