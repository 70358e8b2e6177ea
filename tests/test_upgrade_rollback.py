"""
`start` as an upgrade whose new build does not come up: the previous executable (kept as
`<executable>.previous`, or read from the running agent's `/proc/<pid>/exe`), the unit and the
env file are put back and the previous build is restarted; one line says so. Against a stand-in
systemctl whose `restart` fails exactly when the unit's executable is a broken build (the fault
injected is the new build's readiness). What is kept or put back is a regular file of the
installing user, never through a link, in a directory nobody else can write.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from llmport_agent.host.installer import Installer, System, unstable_place
from llmport_agent.host.previousbuild import NotKept, PreviousBuild
from tests.test_installer import Host, agent_vars

# restart fails (a Type=notify start that never got ready) when the build the unit runs says BROKEN.
STAND_IN = """#!/bin/sh
echo "$*" >> "$SYSTEMCTL_LOG"
[ "$1" = --user ] && shift
case "$1" in
  show) printf 'LoadState=loaded\\nActiveState=active\\nMainPID=4242\\n';;
  is-active) [ -n "$SYSTEMCTL_ACTIVE" ] || exit 3;;
  is-enabled) [ -f "$SYSTEMCTL_UNIT" ] || exit 1;;
  restart)
    exe=$(/bin/sed -n 's/^ExecStart=\\(.*\\) run$/\\1/p' "$SYSTEMCTL_UNIT")
    if /bin/grep -q BROKEN "$exe"; then
      echo "Job for llmport-agent.service failed because the service did not take the steps required by its unit configuration." >&2
      exit 1
    fi;;
esac
exit 0
"""

BUILD_1 = "#!/bin/sh\n# build 1\nexec true\n"
BUILD_2 = "#!/bin/sh\n# build 2\nexec true\n"
BROKEN = "#!/bin/sh\n# build 3, BROKEN\nexit 1\n"


class Node:
    """A Host whose executable is a real file at /usr/local/bin under the fake root."""

    def __init__(self, test: SynchronousTestCase) -> None:
        if os.geteuid() != 0:
            raise SkipTest("the previous build is kept only when the files are root's: run as root")
        self.h = Host(test)
        with open(os.path.join(self.h.bin, "systemctl"), "w") as f:
            f.write(STAND_IN)
        self.exe = self.h.path("/usr/local/bin/llmport-agent")
        place = unstable_place(self.exe)
        if place:
            # The fake root is under trial's temp directory: `start` rightly refuses an
            # executable there (PrivateTmp hides it from the unit).
            raise SkipTest(f"trial's temp directory is under {place}, where start refuses an executable: "
                           "run trial with --temp-directory outside /tmp")
        os.makedirs(os.path.dirname(self.exe), mode=0o755)
        os.chmod(os.path.dirname(self.exe), 0o755)
        self.install(BUILD_1)
        self.proc = self.h.path("/proc")
        os.makedirs(self.proc)

    def install(self, text: str) -> None:
        """As llm-port's install script does: a new file renamed over the old one (install -m 0755)."""
        tmp = self.exe + ".new"
        with open(tmp, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o755)
        os.replace(tmp, self.exe)

    def start(self, **variables: str) -> int:
        h = self.h
        h.out.truncate(0)
        h.err.truncate(0)
        h.out.seek(0)
        h.err.seek(0)
        environ = dict(variables)
        environ["SYSTEMCTL_UNIT"] = self.unit
        system = h.system(environ=environ, exe=self.exe)
        system = System(root=system.root, environ=system.environ, geteuid=system.geteuid,
                        which=system.which, executable=self.exe, one_process=True, proc=self.proc,
                        out=h.out, err=h.err)
        return Installer(system).start()

    @property
    def unit(self) -> str:
        return self.h.path("/etc/systemd/system/llmport-agent.service")

    def read(self, path: str) -> str:
        with open(path) as f:
            return f.read()

    def running(self, text: str, deleted: bool = True) -> None:
        """The unit's main process (pid 4242) runs C{text}: /proc/4242/exe as the kernel shows it."""
        d = os.path.join(self.proc, "4242")
        os.makedirs(d, exist_ok=True)
        image = self.exe + (" (deleted)" if deleted else "")
        with open(image, "w") as f:
            f.write(text)
        os.chmod(image, 0o755)
        os.symlink(image, os.path.join(d, "exe"))


class FailedUpgradeTests(SynchronousTestCase):
    def test_the_previous_executable_unit_and_env_file_are_put_back(self) -> None:
        n = Node(self)
        self.assertEqual(n.start(**agent_vars()), 0, n.h.err.getvalue())
        self.assertEqual(n.read(n.exe + ".previous"), BUILD_1)
        unit_before, env_before = n.read(n.unit), n.read(n.h.path("/etc/llmport-agent.env"))
        n.h.active = "1"
        n.install(BROKEN)
        rc = n.start(**agent_vars(LOG_LEVEL="debug"))
        self.assertEqual(rc, 1)
        self.assertEqual(n.read(n.exe), BUILD_1)
        self.assertEqual(os.stat(n.exe).st_mode & 0o777, 0o755)
        self.assertEqual(n.read(n.unit), unit_before)
        self.assertEqual(n.read(n.h.path("/etc/llmport-agent.env")), env_before)
        # put back, reloaded, and the previous build restarted
        self.assertEqual(n.h.calls()[-2:], ["daemon-reload", "restart llmport-agent.service"])
        err = n.h.err.getvalue()
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn("systemctl restart failed (Job for llmport-agent.service failed", err)
        self.assertIn(f"the previous executable (kept as {n.exe}.previous), the unit and the configuration "
                      "were put back as they were and the agent was started again with them", err)
        self.assertIn("journalctl -u llmport-agent -n 50", err)
        self.assertEqual(n.read(n.exe + ".previous"), BUILD_1)
        self.assertEqual(sorted(os.listdir(os.path.dirname(n.exe))), ["llmport-agent", "llmport-agent.previous"])

    def test_a_good_upgrade_keeps_the_new_build(self) -> None:
        n = Node(self)
        self.assertEqual(n.start(**agent_vars()), 0)
        n.h.active = "1"
        n.install(BUILD_2)
        self.assertEqual(n.start(), 0, n.h.err.getvalue())
        self.assertEqual(n.read(n.exe + ".previous"), BUILD_2)
        self.assertEqual(n.h.calls()[-1], "restart llmport-agent.service")
        # and the next broken one goes back to build 2, not 1
        n.install(BROKEN)
        self.assertEqual(n.start(), 1)
        self.assertEqual(n.read(n.exe), BUILD_2)

    def test_the_first_upgrade_keeps_the_running_build(self) -> None:
        """No copy was kept (an older build, the original agent): the running process's image is."""
        n = Node(self)
        self.assertEqual(n.start(**agent_vars()), 0)
        os.unlink(n.exe + ".previous")
        n.h.active = "1"
        n.running(BUILD_1)
        n.install(BROKEN)
        self.assertEqual(n.start(), 1)
        self.assertEqual(n.read(n.exe), BUILD_1)
        self.assertIn("the previous executable (kept as", n.h.err.getvalue())

    def test_a_pid_taken_by_another_program_is_not_kept(self) -> None:
        """
        The unit's main process exits between the read of its exe link and the open, and its
        number goes to a process running another root-owned program (a shell): that program is
        never kept as the previous build, so a failed upgrade never puts it in place.
        """
        from llmport_agent.host import previousbuild

        n = Node(self)
        self.assertEqual(n.start(**agent_vars()), 0)
        os.unlink(n.exe + ".previous")
        n.h.active = "1"
        n.running(BUILD_1)
        other = n.h.path("/usr/bin/other")
        os.makedirs(os.path.dirname(other))
        shutil.copy(os.path.realpath(shutil.which("sh") or "/bin/sh"), other)
        link = os.path.join(n.proc, "4242", "exe")
        real_readlink = os.readlink
        swapped: list[str] = []

        def readlink(path: Any, *args: Any, **kw: Any) -> str:
            target = real_readlink(path, *args, **kw)
            if os.path.basename(str(path)) == "exe" and not swapped:
                swapped.append(target)
                os.unlink(link)  # the process exits; pid 4242 now runs `other`
                os.symlink(other, link)
            return target

        self.patch(previousbuild.os, "readlink", readlink)
        n.install(BROKEN)
        self.assertEqual(n.start(), 1)
        self.assertEqual(swapped, [n.exe + " (deleted)"])
        self.assertFalse(os.path.lexists(n.exe + ".previous"))
        self.assertEqual(n.read(n.exe), BROKEN)
        self.assertIn("the running process changed while its build was read", n.h.err.getvalue())

    def test_a_running_interpreter_is_not_taken_for_the_build(self) -> None:
        n = Node(self)
        self.assertEqual(n.start(**agent_vars()), 0)
        os.unlink(n.exe + ".previous")
        n.h.active = "1"
        os.makedirs(os.path.join(n.proc, "4242"))
        os.symlink(os.path.realpath(shutil.which("sh") or "/bin/sh"), os.path.join(n.proc, "4242", "exe"))
        n.install(BROKEN)
        self.assertEqual(n.start(), 1)
        self.assertEqual(n.read(n.exe), BROKEN)
        err = n.h.err.getvalue()
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn(f"the previous executable could not be put back: {n.exe}.previous does not exist; "
                      "the unit runs the new one", err)
        self.assertIn("the unit and configuration were put back as they were", err)

    def test_an_unchanged_executable_is_left_alone(self) -> None:
        """A failed restart of the same build (a bad setting): unit and env back, the file untouched."""
        n = Node(self)
        self.assertEqual(n.start(**agent_vars()), 0)
        n.h.active = "1"
        ino = os.stat(n.exe).st_ino
        with open(n.exe, "a") as f:  # the stand-in fails restarts of this build from now on
            f.write("# BROKEN\n")
        previous = PreviousBuild(n.exe, 0, n.proc)
        with open(previous.kept, "a") as f:
            f.write("# BROKEN\n")
        self.assertEqual(n.start(), 1)
        self.assertEqual(os.stat(n.exe).st_ino, ino)
        self.assertIn("the unit and configuration were put back", n.h.err.getvalue())
        self.assertNotIn("previous executable", n.h.err.getvalue())


class TrustTests(SynchronousTestCase):
    def upgraded(self) -> Node:
        n = Node(self)
        self.assertEqual(n.start(**agent_vars()), 0)
        n.h.active = "1"
        n.install(BROKEN)
        return n

    def test_a_link_as_previous_is_not_followed(self) -> None:
        n = self.upgraded()
        elsewhere = n.h.path("/elsewhere")
        with open(elsewhere, "w") as f:
            f.write(BUILD_2)
        os.unlink(n.exe + ".previous")
        os.symlink(elsewhere, n.exe + ".previous")
        self.assertEqual(n.start(), 1)
        self.assertEqual(n.read(n.exe), BROKEN)
        self.assertIn("could not be put back", n.h.err.getvalue())

    def test_a_previous_writable_by_others_is_refused(self) -> None:
        n = self.upgraded()
        os.chmod(n.exe + ".previous", 0o757)
        self.assertEqual(n.start(), 1)
        self.assertEqual(n.read(n.exe), BROKEN)
        self.assertIn("writable by others, so it is left alone", n.h.err.getvalue())

    def test_a_directory_writable_by_others_is_refused(self) -> None:
        """
        Group- (0775) or world-writable (0777): nothing is kept or put back there; `start` itself
        refuses such an executable before anything (issue 29 #6).
        """
        for mode in (0o777, 0o775, 0o2775):
            n = Node(self)
            os.chmod(os.path.dirname(n.exe), mode)
            with self.assertRaises(NotKept) as e:
                PreviousBuild(n.exe, 0).keep_current()
            self.assertIn("writable by others", str(e.exception))
            self.assertFalse(os.path.lexists(n.exe + ".previous"))
            self.assertEqual(n.start(**agent_vars()), 1)
            self.assertIn("is writable by its group or all users", n.h.err.getvalue())
            self.assertFalse(os.path.lexists(n.exe + ".previous"))

    def test_the_copy_is_on_disk_before_its_rename(self) -> None:
        """
        Fault-injected order: the kept copy's data is fsynced before it is renamed into place
        (else a power cut after the rename can leave an empty or partial .previous), and the
        directory after the rename.
        """
        n = Node(self)
        events: list[tuple[str, str]] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd: int) -> None:
            events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            real_fsync(fd)

        def replace(src: Any, dst: Any, **kw: Any) -> None:
            events.append(("rename", os.path.basename(str(src))))
            real_replace(src, dst, **kw)

        self.patch(os, "fsync", fsync)
        self.patch(os, "replace", replace)
        self.assertTrue(PreviousBuild(n.exe, 0).keep_current())
        renamed = [i for i, (what, _) in enumerate(events) if what == "rename"]
        self.assertEqual(len(renamed), 1, events)
        temp = events[renamed[0]][1]
        data_synced = [i for i, (what, path) in enumerate(events)
                       if what == "fsync" and os.path.basename(path) == temp]
        self.assertTrue(data_synced and data_synced[0] < renamed[0], events)
        directory = os.path.dirname(n.exe)
        self.assertTrue(any(what == "fsync" and path == directory for what, path in events[renamed[0]:]), events)
        self.assertEqual(n.read(n.exe + ".previous"), BUILD_1)

    def test_a_previous_of_another_owner_is_refused(self) -> None:
        n = self.upgraded()
        os.chown(n.exe + ".previous", 65534, -1)
        self.assertRaises(NotKept, PreviousBuild(n.exe, 0).restore)
        self.assertEqual(n.start(), 1)
        self.assertEqual(n.read(n.exe), BROKEN)

    def test_a_linked_executable_is_not_copied(self) -> None:
        """pipx links its console script: the package manager owns that build; nothing is kept."""
        n = Node(self)
        target = n.h.path("/opt/pipx/llmport-agent")
        os.makedirs(os.path.dirname(target))
        shutil.move(n.exe, target)
        os.symlink(target, n.exe)
        self.assertEqual(n.start(**agent_vars()), 0)
        self.assertFalse(os.path.lexists(n.exe + ".previous"))
        self.assertNotIn("note:", n.h.out.getvalue())
