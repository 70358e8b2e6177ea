"""
C{start --user NAME} makes the model store and state directories and gives them to that user:
what it chowns is the directory it just made, never a link put in its place (a user who can
write the parent swapping the new directory for a link to a root file would get that file).
"""

from __future__ import annotations

import os

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from llmport_agent import installer


class MakedirsTests(SynchronousTestCase):
    def test_a_link_swapped_in_after_mkdir_is_not_chowned(self) -> None:
        if os.geteuid() != 0:
            raise SkipTest("chown to another user needs root")
        base = os.path.abspath(self.mktemp())
        os.makedirs(base)
        victim = os.path.join(base, "victim")
        with open(victim, "w") as f:
            f.write("root's\n")
        target = os.path.join(base, "store")
        real_mkdir = os.mkdir

        def racing_mkdir(path: str, mode: int = 0o777, **kw: object) -> None:
            real_mkdir(path, mode)
            if path == target:  # the other user's move between the mkdir and the chown
                os.rmdir(path)
                os.symlink(victim, path)

        self.patch(installer.os, "mkdir", racing_mkdir)
        undo = installer._Undo()
        self.assertRaises(OSError, installer._makedirs, target, undo, 0o755, 65534, 65534)
        self.assertEqual(os.stat(victim).st_uid, 0)

    def test_made_directories_belong_to_the_user(self) -> None:
        if os.geteuid() != 0:
            raise SkipTest("chown to another user needs root")
        base = os.path.abspath(self.mktemp())
        os.makedirs(base)
        target = os.path.join(base, "a", "b")
        installer._makedirs(target, installer._Undo(), 0o700, 65534, 65534)
        for d in (os.path.join(base, "a"), target):
            st = os.lstat(d)
            self.assertEqual((st.st_uid, st.st_gid, st.st_mode & 0o777), (65534, 65534, 0o700))
