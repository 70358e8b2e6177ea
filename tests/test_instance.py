"""
One agent per state file (issue 20 #4): the lock beside the state file, with two real agent
processes on one state; the holder's PID in the message; a killed holder does not block the
next start; the original agent's empty lock file is named as such.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.host.instance import AlreadyRunning, InstanceLock, lock_path
from tests.test_process import _ProcessBase

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True)
time.sleep(120)
"""


class LockTests(SynchronousTestCase):
    def test_path_beside_the_state_file(self) -> None:
        self.assertEqual(lock_path("/var/lib/llmport-agent/state.json"), "/var/lib/llmport-agent/state.lock")
        self.assertEqual(lock_path("/x/state"), "/x/state.lock")

    def hold_elsewhere(self, path: str) -> subprocess.Popen[bytes]:
        """Another process (no PID written, as the original agent does) holding the lock."""
        proc = subprocess.Popen([sys.executable, "-c", HOLD, path], stdout=subprocess.PIPE)
        self.addCleanup(lambda: (proc.kill(), proc.wait()))
        assert proc.stdout is not None
        self.assertEqual(proc.stdout.readline().strip(), b"held")
        return proc

    def test_second_holder_refused_and_the_first_pid_named(self) -> None:
        d = self.mktemp()
        first = InstanceLock(os.path.join(d, "state.json"))
        first.acquire()
        self.addCleanup(first.release)
        with open(first.path) as f:
            self.assertEqual(f.read().strip(), str(os.getpid()))
        # flock is per open file: a second open in this process is refused like another process.
        second = InstanceLock(os.path.join(d, "state.json"))
        e = self.assertRaises(AlreadyRunning, second.acquire)
        self.assertEqual(e.pid, os.getpid())
        self.assertIn(f"process {os.getpid()} holds {first.path}", str(e))
        self.assertFalse(second.held)
        first.release()
        second.acquire()
        second.release()

    def test_release_clears_the_pid(self) -> None:
        """After release() the file names nobody (a PID left there would name a dead or reused process)."""
        d = self.mktemp()
        lock = InstanceLock(os.path.join(d, "state.json"))
        lock.acquire()
        lock.release()
        self.assertFalse(lock.held)
        with open(lock.path) as f:
            self.assertEqual(f.read(), "")
        # And a later holder is named by its own PID, nothing left over.
        again = InstanceLock(os.path.join(d, "state.json"))
        again.acquire()
        self.addCleanup(again.release)
        with open(again.path) as f:
            self.assertEqual(f.read(), f"{os.getpid()}\n")

    def test_a_hard_link_is_never_written(self) -> None:
        """state.lock planted as a hard link to another file: refused, that file untouched."""
        d = self.mktemp()
        os.makedirs(d)
        victim = os.path.join(d, "victim")
        with open(victim, "w") as f:
            f.write("precious\n")
        lock = InstanceLock(os.path.join(d, "state.json"))
        os.link(victim, lock.path)
        e = self.assertRaises(OSError, lock.acquire)
        self.assertIn("hard link", e.strerror)
        self.assertIn(f"rm {lock.path}", e.strerror)
        self.assertFalse(lock.held)
        with open(victim) as f:
            self.assertEqual(f.read(), "precious\n")

    def test_a_fifo_is_refused_at_once(self) -> None:
        d = self.mktemp()
        os.makedirs(d)
        lock = InstanceLock(os.path.join(d, "state.json"))
        os.mkfifo(lock.path)
        e = self.assertRaises(OSError, lock.acquire)
        self.assertIn("not a regular file", e.strerror)
        self.assertFalse(lock.held)

    def test_held_by_a_process_that_wrote_no_pid(self) -> None:
        d = self.mktemp()
        os.makedirs(d)
        state = os.path.join(d, "state.json")
        proc = self.hold_elsewhere(lock_path(state))
        e = self.assertRaises(AlreadyRunning, InstanceLock(state).acquire)
        self.assertIsNone(e.pid)
        self.assertIn("wrote no PID", str(e))
        # The kernel releases it when the holder dies, however it dies.
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        lock = InstanceLock(state)
        lock.acquire()
        lock.release()


class TwoAgentsTests(_ProcessBase):
    timeout = 240

    async def test_second_agent_exits_1_naming_the_first(self) -> None:
        from tests.agentharness import agent_env

        b = await self.backend()
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        env = agent_env(b, d, ENROLLMENT_TOKEN=b.mint_token()["token"])
        agent_id = env["LLM_PORT_NODE_AGENT_AGENT_ID"]
        first = self.start([sys.executable, "-m", "llmport_agent.cli", "run"], env)
        # Enrolled and connected (not "healthy": with no engine on the host the first heartbeat
        # turns the node "degraded", which can come before a poll sees "healthy"), or exited.

        def connected() -> bool:
            node = b.node_by_agent_id(agent_id)
            return node is not None and b.connection_count(node["id"]) == 1

        await b.wait_for(lambda: connected() or first.poll() is not None, 60)
        self.assertIsNone(first.poll(), self.output()[-2000:])
        node_id = b.node_by_agent_id(agent_id)["id"]
        state_before = open(env["LLM_PORT_NODE_AGENT_STATE_PATH"], "rb").read()

        first_log = self.log_path
        second = self.start([sys.executable, "-m", "llmport_agent.cli", "run"], env)
        await b.wait_for(lambda: second.poll() is not None, 60)
        text = self.output()
        self.assertEqual(second.returncode, 1, text[-2000:])
        self.log_path = first_log
        lock = os.path.join(d, "state.lock")
        self.assertIn(f"process {first.pid} holds {lock}", text)
        # It touched nothing: one session, the state file as the first agent left it.
        self.assertEqual(b.connection_count(node_id), 1)
        self.assertEqual(open(env["LLM_PORT_NODE_AGENT_STATE_PATH"], "rb").read(), state_before)

        # A holder killed with SIGKILL does not block the next start.
        first.kill()
        first.wait()
        third = self.start([sys.executable, "-m", "llmport_agent.cli", "run"], env)

        def holder() -> str:
            with open(lock) as f:
                return f.read().strip()

        await b.wait_for(lambda: holder() == str(third.pid) or third.poll() is not None, 60)
        self.assertIsNone(third.poll(), self.output()[-2000:])
        await b.wait_for(lambda: b.connection_count(node_id) == 1, 60)
        third.send_signal(signal.SIGTERM)
        await b.wait_for(lambda: third.poll() is not None, 60)
        self.assertEqual(third.returncode, 0, self.output()[-2000:])
