"""
Files the agent appends to in its state directory (the command journal, the event outbox): a
symbolic link planted at that name is refused, never followed, so root's lines never land in
another file.
"""

from __future__ import annotations

import errno
import os

from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.core.storage import append_lines, append_records


class AppendTests(SynchronousTestCase):
    def test_a_link_is_never_appended_through(self) -> None:
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        victim = os.path.join(d, "victim")
        with open(victim, "w") as f:
            f.write("precious\n")
        journal = os.path.join(d, "commands.jsonl")
        os.symlink(victim, journal)
        e = self.assertRaises(OSError, append_lines, journal, [b'{"id": "c1"}\n'])
        self.assertEqual(e.errno, errno.ELOOP)
        self.assertRaises(OSError, append_records, journal, [{"id": "c1"}])
        with open(victim) as f:
            self.assertEqual(f.read(), "precious\n")

    def test_a_new_file_is_private(self) -> None:
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        path = os.path.join(d, "commands.jsonl")
        old = os.umask(0)
        try:
            append_lines(path, [b"{}\n"])
        finally:
            os.umask(old)
        self.assertEqual(os.stat(path).st_mode & 0o777, 0o600)
