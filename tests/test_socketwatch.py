"""
The engine socket watch on the agent's own inotify notifier (llmport_agent/workloads/inotify.py):
real inotify on temporary directories, driven by the real reactor (each step waits on a
Deferred that the watch's own callbacks fire, under trial's timeout), and the notifier's
parser and reader fed crafted bytes through a pipe.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from typing import Any
from unittest import SkipTest

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmport_agent.workloads import inotify
from llmport_agent.workloads.inotify import (
    EVENT,
    IN_CREATE,
    IN_IGNORED,
    IN_Q_OVERFLOW,
    INotify,
    parse_events,
)
from llmport_agent.workloads.socketwatch import SocketWatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def event(wd: int, mask: int, name: bytes = b"", pad: int = 0, cookie: int = 0) -> bytes:
    """One struct inotify_event as the kernel writes it (the name NUL-padded)."""
    raw = name + b"\0" * pad if name or pad else b""
    return EVENT.pack(wd, mask, cookie, len(raw)) + raw


def real_notifier(test: TestCase) -> INotify:
    try:
        notifier = INotify(reactor)
    except OSError:
        raise SkipTest("no inotify here") from None
    test.addCleanup(notifier.close)
    return notifier


def tmpdir(test: Any) -> str:
    root = tempfile.mkdtemp(prefix="sockwatch-")  # short: a socket path has 107 bytes at most
    test.addCleanup(shutil.rmtree, root, True)
    return root


class PipeCalls:
    """inotify's calls with a pipe for the descriptor: the test writes the events."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self.next_wd = 0
        self.removed: list[int] = []

    def init1(self, flags: int) -> int:
        return self.read_fd

    def add_watch(self, fd: int, path: bytes, mask: int) -> int:
        self.next_wd += 1
        return self.next_wd

    def rm_watch(self, fd: int, wd: int) -> int:
        self.removed.append(wd)
        return 0

    def error(self, what: str) -> OSError:
        return OSError(what)

    def close_writer(self) -> None:
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1


def pipe_notifier(test: Any, the_reactor: Any = None) -> tuple[INotify, PipeCalls]:
    calls = PipeCalls()
    notifier = INotify(the_reactor, calls=calls)  # type: ignore[arg-type]
    test.addCleanup(calls.close_writer)
    test.addCleanup(notifier.close)
    return notifier, calls


class ParseEventsTests(SynchronousTestCase):
    """The kernel's records; anything else is dropped, never raised, and parsing always ends."""

    def test_events_and_names(self) -> None:
        data = event(1, IN_CREATE, b"docker.sock", pad=5) + event(2, IN_IGNORED) + event(-1, IN_Q_OVERFLOW)
        self.assertEqual(parse_events(data), [(1, IN_CREATE, 0, "docker.sock"), (2, IN_IGNORED, 0, ""),
                                              (-1, IN_Q_OVERFLOW, 0, "")])

    def test_truncated(self) -> None:
        whole = event(1, IN_CREATE, b"a", pad=3)
        # The fixed part cut short, and a name running past the end: dropped with what follows.
        self.assertEqual(parse_events(whole + whole[:10]), [(1, IN_CREATE, 0, "a")])
        self.assertEqual(parse_events(whole + EVENT.pack(2, IN_CREATE, 0, 2**32 - 1) + b"xy"),
                         [(1, IN_CREATE, 0, "a")])
        self.assertEqual(parse_events(b""), [])
        self.assertEqual(parse_events(b"\xff" * 15), [])

    def test_any_bytes(self) -> None:
        import random

        rng = random.Random(27)
        for size in range(0, 300):
            data = bytes(rng.randrange(256) for _ in range(size))
            events = parse_events(data)
            self.assertLessEqual(len(events), size // EVENT.size)
        # A name that is not UTF-8 is kept as the file system's (surrogate escapes).
        self.assertEqual(parse_events(event(3, IN_CREATE, b"\xffx", pad=2))[0][3], os.fsdecode(b"\xffx"))


class NotifierUnitTests(SynchronousTestCase):
    """The reader fed crafted bytes through a pipe (no reactor needed: doRead called here)."""

    def make(self) -> tuple[INotify, PipeCalls, list[tuple[str, int, str]]]:
        notifier, calls = pipe_notifier(self)
        told: list[tuple[str, int, str]] = []
        self.assertEqual(notifier.watch("/a", IN_CREATE, lambda m, n: told.append(("a", m, n))), 1)
        self.assertEqual(notifier.watch("/b", IN_CREATE, lambda m, n: told.append(("b", m, n))), 2)
        return notifier, calls, told

    def test_dispatch_by_wd(self) -> None:
        notifier, calls, told = self.make()
        os.write(calls.write_fd, event(2, IN_CREATE, b"x", pad=3) + event(9, IN_CREATE, b"y", pad=3)
                 + event(1, IN_CREATE, b"z", pad=3))
        self.assertIsNone(notifier.doRead())
        self.assertEqual(told, [("b", IN_CREATE, "x"), ("a", IN_CREATE, "z")])  # 9: no such watch

    def test_overflow_tells_every_watch(self) -> None:
        notifier, calls, told = self.make()
        os.write(calls.write_fd, event(-1, IN_Q_OVERFLOW))
        self.assertIsNone(notifier.doRead())
        self.assertEqual(told, [("a", IN_Q_OVERFLOW, ""), ("b", IN_Q_OVERFLOW, "")])

    def test_ignored_forgets_the_watch_and_keeps_the_descriptor(self) -> None:
        notifier, calls, told = self.make()
        os.write(calls.write_fd, event(1, IN_IGNORED) + event(1, IN_CREATE, b"late", pad=4))
        self.assertIsNone(notifier.doRead())
        self.assertEqual(told, [("a", IN_IGNORED, "")])
        self.assertEqual((notifier.watched(), notifier.closed), (["/b"], False))
        os.fstat(notifier.fileno())  # still open

    def test_truncated_input(self) -> None:
        notifier, calls, told = self.make()
        os.write(calls.write_fd, event(1, IN_CREATE, b"x", pad=3) + event(2, IN_CREATE, b"y", pad=3)[:18])
        self.assertIsNone(notifier.doRead())
        self.assertEqual(told, [("a", IN_CREATE, "x")])
        self.assertIsNone(notifier.doRead())  # nothing left: EAGAIN, no loop
        os.write(calls.write_fd, b"\x01\x02\x03")
        self.assertIsNone(notifier.doRead())
        self.assertEqual(len(told), 1)

    def test_reads_bounded_per_turn(self) -> None:
        """A descriptor that never runs dry (a flood of events): MAX_READS reads a turn, then back to the reactor."""
        notifier, calls, told = self.make()
        one = event(1, IN_CREATE, b"n" * 240, pad=16)
        full = one * (inotify.READ_SIZE // len(one))
        reads: list[int] = []

        def endless(fd: int, n: int) -> bytes:
            reads.append(n)
            return full

        self.patch(inotify.os, "read", endless)
        self.assertIsNone(notifier.doRead())
        self.assertEqual(len(reads), inotify.MAX_READS)
        self.assertEqual(len(told), inotify.MAX_READS * (inotify.READ_SIZE // len(one)))

    def test_failing_callback_does_not_reach_the_reactor(self) -> None:
        notifier, calls = pipe_notifier(self)
        told: list[str] = []

        def boom(mask: int, name: str) -> None:
            raise RuntimeError("boom")

        notifier.watch("/a", IN_CREATE, boom)
        notifier.watch("/b", IN_CREATE, lambda m, n: told.append(n))
        os.write(calls.write_fd, event(1, IN_CREATE, b"x", pad=3) + event(2, IN_CREATE, b"y", pad=3))
        self.assertIsNone(notifier.doRead())
        self.assertEqual(told, ["y"])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_callback_closing_the_notifier_stops_reading(self) -> None:
        notifier, calls = pipe_notifier(self)
        told: list[str] = []

        def close_at_first(mask: int, name: str) -> None:
            told.append(name)
            notifier.close()

        notifier.watch("/a", IN_CREATE, close_at_first)
        os.write(calls.write_fd, event(1, IN_CREATE, b"x", pad=3) + event(1, IN_CREATE, b"y", pad=3))
        self.assertIsNone(notifier.doRead())
        self.assertEqual((told, notifier.fileno()), (["x"], -1))

    def test_end_of_descriptor_is_lost(self) -> None:
        notifier, calls = pipe_notifier(self)
        lost: list[Failure] = []
        notifier.on_lost = lost.append
        calls.close_writer()
        reason = notifier.doRead()
        self.assertIsNotNone(reason)
        notifier.connectionLost(Failure(reason))  # as the reactor does with what doRead gave
        notifier.connectionLost(Failure(reason))
        self.assertEqual((len(lost), notifier.closed, notifier.fileno()), (1, True, -1))

    def test_ignore(self) -> None:
        notifier, calls, told = self.make()
        self.assertTrue(notifier.ignore(1))
        self.assertFalse(notifier.ignore(1))
        self.assertTrue(notifier.ignore("/b"))
        self.assertEqual((calls.removed, notifier.watched()), ([1, 2], []))


class NotifierTests(TestCase):
    """The notifier on real inotify and the real reactor."""

    timeout = 30

    def test_close_twice_closes_the_descriptor_once(self) -> None:
        notifier = real_notifier(self)
        notifier.startReading()
        fd = notifier.fileno()
        os.fstat(fd)
        self.assertIn(notifier, reactor.getReaders())
        notifier.close()
        notifier.close()
        self.assertNotIn(notifier, reactor.getReaders())
        self.assertEqual(notifier.fileno(), -1)
        self.assertRaises(OSError, os.fstat, fd)
        self.assertRaises(OSError, notifier.watch, "/", IN_CREATE, lambda m, n: None)

    def test_many_events_in_one_read(self) -> Deferred[None]:
        root = tmpdir(self)
        notifier = real_notifier(self)
        names = [f"f{i:03d}" for i in range(200)]
        seen: list[str] = []
        done: Deferred[None] = Deferred()

        def told(mask: int, name: str) -> None:
            seen.append(name)
            if len(seen) == len(names):
                done.callback(None)

        notifier.watch(root, IN_CREATE, told)
        for name in names:  # all queued before the reactor reads once
            open(os.path.join(root, name), "w").close()
        reads: list[int] = []
        real = notifier.doRead

        def counted() -> Any:
            reads.append(1)
            return real()

        notifier.doRead = counted  # type: ignore[method-assign]
        notifier.startReading()
        return done.addCallback(lambda _: self.assertEqual((seen, len(reads)), (names, 1)))

    def test_deleted_directory_keeps_the_descriptor(self) -> Deferred[None]:
        root = tmpdir(self)
        sub = os.path.join(root, "sub")
        os.mkdir(sub)
        notifier = real_notifier(self)
        notifier.startReading()
        masks: list[int] = []
        gone: Deferred[None] = Deferred()
        again: Deferred[str] = Deferred()

        def told(mask: int, name: str) -> None:
            masks.append(mask)
            if mask & IN_IGNORED:
                gone.callback(None)

        notifier.watch(sub, IN_CREATE, told)
        os.rmdir(sub)

        def after(_: Any) -> Deferred[Any]:
            self.assertEqual((masks, notifier.closed, notifier.watched()), ([IN_IGNORED], False, []))
            os.fstat(notifier.fileno())
            notifier.watch(root, IN_CREATE, lambda m, n: again.callback(n))
            open(os.path.join(root, "later"), "w").close()
            return again.addCallback(self.assertEqual, "later")

        return gone.addCallback(after)


class SpyNotifier(INotify):
    """Fires the waiter of a directory when a watch is made on it."""

    waiters: dict[str, Deferred[None]]

    def watch(self, path: str, mask: int, callback: Any) -> int:
        wd = super().watch(path, mask, callback)
        waiter = self.waiters.pop(path, None)
        if waiter is not None:
            waiter.callback(None)
        return wd


class RealSocketWatchTests(TestCase):
    """SocketWatch on real inotify: each step waits for the watch the previous one should make."""

    timeout = 30

    def make(self, path: str) -> tuple[SocketWatch, SpyNotifier, Deferred[None], list[str]]:
        try:
            notifier = SpyNotifier(reactor)
        except OSError:
            raise SkipTest("no inotify here") from None
        notifier.waiters = {}
        appeared: Deferred[None] = Deferred()
        count: list[str] = []
        lost: list[str] = []

        def once() -> None:
            count.append("appeared")
            appeared.callback(None)

        watch = SocketWatch(notifier, path, once, lost.append)
        notifier.on_lost = watch.notifierLost
        notifier.startReading()
        self.addCleanup(watch.stop)
        self.assertTrue(watch.start())
        self.addCleanup(lambda: self.assertEqual(lost, []))
        return watch, notifier, appeared, count

    def watched(self, notifier: SpyNotifier, path: str) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        notifier.waiters[path] = d
        return d

    def bind(self, path: str) -> None:
        sock = socket.socket(socket.AF_UNIX)
        self.addCleanup(sock.close)
        sock.bind(path)

    async def test_socket_created_appeared_once(self) -> None:
        root = tmpdir(self)
        path = os.path.join(root, "docker.sock")
        watch, notifier, appeared, count = self.make(path)
        self.assertEqual(watch.watched, root)
        open(os.path.join(root, "other"), "w").close()  # not the socket: no re-check needed
        self.bind(path)
        open(os.path.join(root, "more"), "w").close()
        await appeared
        self.assertEqual((count, watch.active, notifier.closed), (["appeared"], False, True))

    async def test_path_made_level_by_level(self) -> None:
        root = tmpdir(self)
        path = os.path.join(root, "a", "b", "docker.sock")
        watch, notifier, appeared, count = self.make(path)
        self.assertEqual(watch.watched, root)
        down = self.watched(notifier, os.path.join(root, "a"))
        os.mkdir(os.path.join(root, "a"))
        await down
        down = self.watched(notifier, os.path.join(root, "a", "b"))
        os.mkdir(os.path.join(root, "a", "b"))
        await down
        self.assertEqual(count, [])
        self.bind(path)
        await appeared
        self.assertEqual(count, ["appeared"])

    async def test_directory_deleted_then_made_again(self) -> None:
        root = tmpdir(self)
        os.makedirs(os.path.join(root, "u", "a"))
        path = os.path.join(root, "u", "a", "docker.sock")
        watch, notifier, appeared, count = self.make(path)
        fd = notifier.fileno()
        up = self.watched(notifier, root)
        shutil.rmtree(os.path.join(root, "u"))  # two levels at once
        await up
        self.assertEqual((watch.active, notifier.fileno()), (True, fd))
        down = self.watched(notifier, os.path.dirname(path))
        os.makedirs(os.path.join(root, "u", "a"))
        await down
        self.bind(path)
        await appeared
        self.assertEqual(count, ["appeared"])

    async def test_directory_moved_away(self) -> None:
        root = tmpdir(self)
        os.makedirs(os.path.join(root, "u", "a"))
        path = os.path.join(root, "u", "a", "docker.sock")
        watch, notifier, appeared, count = self.make(path)
        up = self.watched(notifier, os.path.join(root, "u"))
        os.rename(os.path.join(root, "u", "a"), os.path.join(root, "moved"))
        await up
        self.assertEqual(notifier.watched(), [os.path.join(root, "u")])  # the moved one let go
        self.bind(os.path.join(root, "moved", "docker.sock"))  # not the path any more
        down = self.watched(notifier, os.path.dirname(path))
        os.mkdir(os.path.dirname(path))
        await down
        self.assertEqual(count, [])
        self.bind(path)
        await appeared
        self.assertEqual(count, ["appeared"])


class _Fake:
    """A notifier for SocketWatch alone (what it asks of one)."""

    def __init__(self) -> None:
        self.watches: dict[int, str] = {}
        self.callbacks: dict[int, Any] = {}
        self.closed = 0

    def watch(self, path: str, mask: int, callback: Any) -> int:
        wd = len(self.callbacks) + 1
        self.watches[wd], self.callbacks[wd] = path, callback
        return wd

    def ignore(self, wd: int) -> None:
        del self.watches[wd]

    def close(self) -> None:
        self.closed += 1


class SocketWatchEventsTests(SynchronousTestCase):
    """Which events re-check the path."""

    def make(self) -> tuple[_Fake, SocketWatch, list[bool], list[int]]:
        fake, there, appeared = _Fake(), [False], []
        dirs = {"/run", "/run/user"}
        watch = SocketWatch(fake, "/run/user/1000/docker.sock", lambda: appeared.append(1),
                            exists=lambda p: there[0], isdir=dirs.__contains__)
        self.assertTrue(watch.start())
        self.assertEqual(fake.watches, {1: "/run/user"})
        return fake, watch, there, appeared

    def test_only_the_next_component(self) -> None:
        fake, watch, there, appeared = self.make()
        there[0] = True  # (what a re-check would find)
        fake.callbacks[1](IN_CREATE, "1001")
        self.assertEqual(appeared, [])
        fake.callbacks[1](IN_CREATE, "1000")
        self.assertEqual((appeared, watch.active, fake.closed, fake.watches), ([1], False, 1, {}))

    def test_overflow_rechecks(self) -> None:
        fake, watch, there, appeared = self.make()
        there[0] = True
        fake.callbacks[1](IN_Q_OVERFLOW, "")
        self.assertEqual(appeared, [1])

    def test_overflow_watches_afresh(self) -> None:
        """
        Lost events may have hidden the directory's deletion and remaking (its IN_IGNORED among
        them): after an overflow the directory is watched again, not trusted to the old watch.
        """
        fake, watch, there, appeared = self.make()
        fake.callbacks[1](IN_Q_OVERFLOW, "")
        self.assertEqual(appeared, [])
        self.assertEqual(fake.watches, {2: "/run/user"})  # the old one let go, a new one made
        there[0] = True
        fake.callbacks[2](IN_CREATE, "1000")
        self.assertEqual(appeared, [1])

    def test_ignored_moves_up(self) -> None:
        fake, watch, there, appeared = self.make()
        del fake.watches[1]  # the kernel dropped it; the notifier forgot it
        fake.callbacks[1](IN_IGNORED, "")
        self.assertEqual(fake.watches, {2: "/run/user"})  # still there: watched again


class NoTwistedInotifyTests(TestCase):
    """
    A watch in a fresh interpreter imports neither of Twisted's inotify modules, and (where
    strace is installed) starts no process: Twisted's runs ldconfig to find libc.
    """

    timeout = 60

    SCRIPT = textwrap.dedent(
        """
        import os, sys, tempfile
        from twisted.internet import reactor
        from llmport_agent.workloads.socketwatch import watch_socket
        root = tempfile.mkdtemp(prefix="sockwatch-")
        watch = watch_socket(reactor, os.path.join(root, "a", "docker.sock"), lambda: None)
        assert watch is not None and watch.watched == root, watch
        watch.stop()
        os.rmdir(root)
        bad = sorted({"twisted.internet.inotify", "twisted.python._inotify"} & set(sys.modules))
        print("IMPORTED", bad)
        """
    )

    def run_script(self, prefix: list[str]) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        return subprocess.run([*prefix, sys.executable, "-c", self.SCRIPT], env=env, capture_output=True,
                              text=True, timeout=50, cwd=ROOT)

    def test_no_twisted_inotify_module(self) -> None:
        try:
            INotify(None).close()
        except OSError:
            raise SkipTest("no inotify here") from None
        done = self.run_script([])
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("IMPORTED []", done.stdout)

    def test_no_process_started(self) -> None:
        strace = shutil.which("strace")
        if strace is None:
            raise SkipTest("strace is not installed")
        # Only the interpreter's own exec, when ptrace is allowed here at all.
        out = os.path.join(tmpdir(self), "trace")
        done = self.run_script([strace, "-f", "-qq", "-e", "trace=execve", "-o", out])
        if done.returncode != 0 and "ptrace" in done.stderr:
            raise SkipTest(f"strace cannot trace here: {done.stderr.strip()[:200]}")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("IMPORTED []", done.stdout)
        with open(out) as f:
            execs = [line for line in f if "execve(" in line]
        self.assertEqual(len(execs), 1, "".join(execs))
