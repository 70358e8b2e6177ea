"""
A full disk under the state directory (a small tmpfs made for the test): commands arriving
while the journal cannot be written are not acked (the backend offers them again), what was
acked survives a restart, and once there is room again every command gets its result.

Needs root (mount); without it the test skips, under C{CI=true} it fails.
"""

from __future__ import annotations

import errno
import os
import subprocess
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThread

from llmport_agent.commands.base import CommandContext, HandlerSpec
from tests.chaos.base import ChaosTestCase
from tests.chaos.invariants import TERMINAL, check_commands, settle, sleep
from tests.chaos.scenarios import ChaosRun


def fill(path: str) -> int:
    """Write C{path} until the file system is full; return the bytes written. Blocking."""
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        chunk = b"\0" * 65536
        while True:
            try:
                n = os.write(fd, chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
            written += n
            if n < len(chunk):
                chunk = chunk[:max(1, len(chunk) - n)]
    finally:
        os.close(fd)
    return written


class SmallDisk:
    """A tmpfs of C{size} mounted on a fresh directory; unmounted by L{unmount}."""

    def __init__(self, case: ChaosTestCase, size: str = "1m") -> None:
        self.path = os.path.abspath(case.mktemp())
        os.makedirs(self.path)
        reason = None
        if os.geteuid() != 0:
            reason = "a full disk needs a small file system, which needs root to mount"
        else:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", self.path],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                reason = f"could not mount a tmpfs on {self.path}: {done.stderr.strip()}"
        if reason is not None:
            if os.environ.get("CI") == "true":
                case.fail(reason)
            raise case.skipTest(reason)
        case.addCleanup(self.unmount)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", self.path], check=False)


class DiskFullTests(ChaosTestCase):
    async def test_full_disk_under_the_state_directory(self) -> None:
        """Journal writes fail (short, then ENOSPC) while commands arrive; nothing acked is lost."""
        disk = SmallDisk(self)
        self.allow_link_anomalies()  # only for repeats in the documented window, checked below
        state_dir = os.path.join(disk.path, "state")
        backend = await self.start_backend()
        held: dict[str, Deferred[dict[str, Any]]] = {}

        async def hold(ctx: CommandContext) -> dict[str, Any]:
            d: Deferred[dict[str, Any]] = Deferred()
            held[ctx.command.id] = d
            return await d

        first = self.start_agent(backend, state_dir=state_dir, SHUTDOWN_GRACE_SEC="0")
        first.pipeline.registry["chaos_hold"] = HandlerSpec(hold, lane="read", idempotent=True, deadline=600)
        node_id = await self.wait_connected(backend, first)
        warm = [backend.issue_command(node_id, "refresh_inventory", {})["id"] for _ in range(3)]
        await settle(reactor, lambda: all(backend.command(c)["status"] in TERMINAL for c in warm), 20)
        filler = os.path.join(disk.path, "filler")
        await deferToThread(fill, filler)
        run = ChaosRun(seed=0, steps=0)
        run.commands.extend(warm)
        for _ in range(24):  # a few fit in the journal's last page, one is cut short, the rest fail
            run.commands.append(backend.issue_command(node_id, "chaos_hold", {})["id"])
            await sleep(reactor, 0.05)
        await sleep(reactor, 1.5)
        acked = [c for c in run.commands[3:] if backend.command(c)["status"] in ("acked", "running")]
        unacked = [c for c in run.commands[3:] if backend.command(c)["status"] == "dispatched"]
        self.assertTrue(unacked, "the disk never filled up")
        self.assertEqual(first.session.connected, True)  # a full disk does not take the agent down
        await self.stop_agent(first)  # grace 0: the held commands stay unfinished in the journal
        os.unlink(filler)

        async def done_now(ctx: CommandContext) -> dict[str, Any]:
            return {"resumed": ctx.command.id}

        second = self.start_agent(backend, state_dir=state_dir, token=False)
        second.pipeline.registry["chaos_hold"] = HandlerSpec(done_now, lane="read", idempotent=True, deadline=60)

        def connected() -> bool:
            return bool(second.session.connected) and backend.connection_count(node_id) == 1

        await settle(reactor, lambda: connected() and all(
            backend.command(c)["status"] in TERMINAL for c in run.commands), 30)
        await sleep(reactor, 1.0)
        tally = check_commands(backend, node_id, run.commands)
        self.assertInvariants(tally, run, None)
        self.assertEqual(second.pipeline.journal.damaged_lines, 0, "the full disk left a torn journal line")
        self.assertTrue(acked or unacked)
        # The agent logs every failed write (as it should); they are expected here.
        self.flushLoggedErrors(OSError)
