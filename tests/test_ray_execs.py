"""
Bounded C{docker exec} (llmport_agent.ray.execs) against the real test engine: stdout and
stderr apart, stdin delivered, output kept to its limit while the rest is drained, a timeout
that ends the wait, a closed control that ends it at once, env on the exec only.
"""

from __future__ import annotations

import threading
import time
import uuid

from twisted.trial.unittest import TestCase

from llmport_agent.ray.execs import exec_in, exec_stream
from llmport_agent.workloads.engine import StreamClosed, StreamControl
from tests.support.docker_env import BUSYBOX, require_docker


class ExecTests(TestCase):
    timeout = 120

    def setUp(self) -> None:
        env = require_docker()
        self.client = env.client()
        self.name = "ray-exec-" + uuid.uuid4().hex[:8]
        c = self.client.containers.create(BUSYBOX, ["sleep", "3600"], name=self.name, network_mode="none")
        c.start()
        self.addCleanup(c.remove, force=True)

    def test_streams_stdin_env(self) -> None:
        r = exec_in(self.client, self.name, ["sh", "-c", 'echo out; echo err >&2; echo "$NCCL_X"; exit 3'],
                    {"NCCL_X": "ib0"})
        self.assertEqual((r.exit_code, r.out, r.err), (3, "out\nib0\n", "err\n"))
        r = exec_in(self.client, self.name, ["cat"], stdin=b'{"deployed": true}\n')
        self.assertEqual((r.exit_code, r.out), (0, '{"deployed": true}\n'))
        env = self.client.api.inspect_container(self.name)["Config"]["Env"] or []
        self.assertFalse([e for e in env if e.startswith("NCCL_X")])

    def test_output_bounded(self) -> None:
        r = exec_in(self.client, self.name, ["sh", "-c", "head -c 3000000 /dev/zero; echo done >&2"], limit=100000)
        self.assertEqual(r.exit_code, 0)
        self.assertEqual(len(r.stdout), 100000)
        self.assertTrue(r.truncated)
        self.assertEqual(r.err, "done\n")

    def test_timeout_and_control(self) -> None:
        started = time.monotonic()
        r = exec_in(self.client, self.name, ["sleep", "30"], timeout=1.0)
        self.assertTrue(r.timed_out)
        self.assertIsNone(r.exit_code)
        self.assertLess(time.monotonic() - started, 10)
        for delay in (0.0, 0.5):  # closed before the exec, and while it runs
            control = StreamControl()
            timer = threading.Timer(delay, control.close, ("cancelled",))
            timer.start()
            self.addCleanup(timer.cancel)
            started = time.monotonic()
            with self.assertRaises(StreamClosed):
                exec_stream(self.client, control, self.name, ["sleep", "30"], None, None, 60.0)
            self.assertLess(time.monotonic() - started, 5)
