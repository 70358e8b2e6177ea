"""
A real systemd (PID 1) in private PID, mount and UTS namespaces, booted as design.md says:
overlays on /etc, /var/lib, /opt and /home (upper and work directories outside /tmp); tmpfs on
/run, /srv, /tmp, /var/tmp and /var/log (with a host's modes); every unit wanted or required by
anything masked (except journald's), plus systemd-tmpfiles-setup and the udev, sysctl,
modules-load, modprobe@, networking and docker units, so nothing inside acts on the host. With
C{sessions}: the system bus, polkit and logind run (inside the private /run; the bus's
activation directory emptied, the daemons that could act on the host through it masked, logind
with no VTs and no IPC removal) and user managers start, their wanted units and tmpfiles masked.
Ended by a SIGKILL of that systemd.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import time

SYSTEMD = "/lib/systemd/systemd"

BOOT = r"""#!/bin/sh
set -eu
base="$1"
sessions="${2:-}"
dirs="etc var/lib opt"
# /home too where the host has one: nothing inside ever writes to the host's homes.
[ -d /home ] && dirs="$dirs home"
for d in $dirs; do
  n=$(echo "$d" | tr / _)
  mkdir -p "$base/$n.upper" "$base/$n.work"
  mount -t overlay overlay -o "lowerdir=/$d,upperdir=$base/$n.upper,workdir=$base/$n.work" "/$d"
done
# The modes of a real host's (a tmpfs is 1777 unless told): /srv is root's, not everyone's.
for d in /run /srv /var/log; do mount -t tmpfs -o mode=755 tmpfs "$d"; done
for d in /tmp /var/tmp; do mount -t tmpfs -o mode=1777 tmpfs "$d"; done
masked=/etc/systemd/system
for f in /etc/systemd/system/*.wants/* /etc/systemd/system/*.requires/* \
         /lib/systemd/system/*.wants/* /lib/systemd/system/*.requires/*; do
  [ -e "$f" ] || [ -L "$f" ] || continue
  n=$(basename "$f")
  case "$n" in systemd-journald*) continue;; esac
  if [ -n "$sessions" ]; then case "$n" in dbus.socket|dbus.service|systemd-logind.service) continue;; esac; fi
  ln -sfn /dev/null "$masked/$n"
done
for n in systemd-tmpfiles-setup.service systemd-tmpfiles-setup-dev.service systemd-tmpfiles-clean.timer \
         systemd-udevd.service systemd-udev-trigger.service systemd-udev-settle.service \
         systemd-udevd-control.socket systemd-udevd-kernel.socket systemd-sysctl.service \
         systemd-modules-load.service modprobe@.service networking.service docker.service docker.socket \
         containerd.service; do
  ln -sfn /dev/null "$masked/$n"
done
if [ -n "$sessions" ]; then
  # Login sessions (logind, the system bus, polkit, user@.service): all inside the private /run.
  # The bus activates nothing (its service directory is emptied); what could act on the host
  # through it is masked anyway. logind: no VTs, no IPC removal (the IPC namespace is the host's).
  mount -t tmpfs tmpfs /usr/share/dbus-1/system-services
  for n in systemd-timedated.service systemd-hostnamed.service systemd-localed.service \
           systemd-networkd.service systemd-timesyncd.service packagekit.service \
           dbus-org.freedesktop.timesync1.service autovt@.service getty@.service; do
    ln -sfn /dev/null "$masked/$n"
  done
  mkdir -p /etc/systemd/logind.conf.d /etc/systemd/user
  printf '[Login]\nNAutoVTs=0\nReserveVT=0\nRemoveIPC=no\nKillUserProcesses=no\nUserStopDelaySec=1\nHandlePowerKey=ignore\nHandleSuspendKey=ignore\nHandleHibernateKey=ignore\nHandleLidSwitch=ignore\nHandleRebootKey=ignore\n' \
    > /etc/systemd/logind.conf.d/pid1-test.conf
  # The user managers: only their own bus (every other wanted user unit and tmpfiles masked).
  for f in /etc/systemd/user/*.wants/* /lib/systemd/user/*.wants/*; do
    [ -e "$f" ] || [ -L "$f" ] || continue
    n=$(basename "$f")
    [ "$n" = dbus.socket ] && continue
    ln -sfn /dev/null "/etc/systemd/user/$n"
  done
  for n in systemd-tmpfiles-setup.service systemd-tmpfiles-clean.timer systemd-tmpfiles-clean.service; do
    ln -sfn /dev/null "/etc/systemd/user/$n"
  done
fi
printf '[Unit]\nDescription=pid1 test\nDefaultDependencies=no\n' > "$masked/pid1-test.target"
echo booting > "$base/booted"
exec /lib/systemd/systemd --system --unit=pid1-test.target
"""


def unavailable() -> str | None:
    """Why a systemd cannot be booted here, or None."""
    if os.geteuid() != 0:
        return "not root: booting systemd as PID 1 in namespaces needs root"
    if not os.path.exists(SYSTEMD) or shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return "systemd, unshare or nsenter is missing"
    return None


#: What login sessions inside need (Debian packages dbus, libpam-systemd, polkitd).
SESSION_PARTS = {
    "/usr/bin/dbus-daemon": "dbus",
    "/lib/systemd/systemd-logind": "systemd",
    "/lib/*/security/pam_systemd.so": "libpam-systemd",
    "/usr/lib/polkit-1/polkitd": "polkitd",
}


def sessions_unavailable() -> str | None:
    """Why login sessions (logind, linger, user@.service) cannot run inside, or None."""
    missing = sorted({pkg for path, pkg in SESSION_PARTS.items()
                      if not glob.glob(path) and not glob.glob("/usr" + path)})
    if missing:
        return "login sessions under the booted systemd need the Debian packages " + ", ".join(missing)
    return None


class BootedSystemd:
    """One booted systemd; L{run} drives it (C{nsenter} into its namespaces)."""

    def __init__(self, base: str, sessions: bool = False) -> None:
        """
        @param sessions: leave the system bus and logind unmasked (L{start_sessions}): login
            sessions, linger and C{user@.service} work inside, with the bus activating nothing.
        """
        self.base = base  # outside /tmp (the namespace mounts its own /tmp)
        os.makedirs(base, exist_ok=True)
        self.script = os.path.join(base, "boot.sh")
        with open(self.script, "w") as f:
            f.write(BOOT)
        os.chmod(self.script, 0o755)
        self.log = open(os.path.join(base, "boot.log"), "wb")
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount", "--uts", "--propagation", "private", "--mount-proc",
             self.script, base, "sessions" if sessions else ""], stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.pid = 0

    def wait_booted(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the namespace ended at boot: {self.boot_log()}")
            if not self.pid:
                self.pid = self._find_pid1()
            if self.pid:
                done = self.run("systemctl", "is-system-running", check=False)
                if done.stdout.strip() in ("running", "degraded"):
                    return
            time.sleep(0.2)
        raise RuntimeError(f"systemd did not come up in {timeout} s: {self.boot_log()}")

    def _find_pid1(self) -> int:
        # unshare --fork: the child of unshare is PID 1 inside (systemd once exec'd).
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                kids = f.read().split()
        except OSError:
            return 0
        for kid in kids:
            try:
                with open(f"/proc/{kid}/comm") as f:
                    if f.read().strip() == "systemd":
                        return int(kid)
            except OSError:
                pass
        return 0

    def start_sessions(self) -> None:
        """The system bus, polkit (it answers logind's questions) and logind, started by hand."""
        units = ["dbus.socket", "dbus.service", "systemd-logind.service"]
        if os.path.exists("/lib/systemd/system/polkit.service"):
            units.insert(2, "polkit.service")
        self.run("systemctl", "start", *units)

    def add_user(self, name: str) -> int:
        """A user in the private /etc, its home under the private /var/lib (never /home); its uid."""
        home = f"/var/lib/{name}-home"
        self.run("useradd", "--home-dir", home, "--create-home", "--shell", "/bin/sh", "--user-group", name)
        return int(self.run("id", "-u", name).stdout.strip())

    def boot_log(self) -> str:
        with open(os.path.join(self.base, "boot.log"), errors="replace") as f:
            return f.read()[-2000:]

    def run(self, *args: str, check: bool = True, timeout: float = 120,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["nsenter", "-t", str(self.pid), "-m", "-p", "-u", "--", *args],
                              capture_output=True, text=True, timeout=timeout, input=input)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: exit {done.returncode}: {done.stderr.strip()[-1000:]}")
        return done

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        """Write a file inside (its /etc, /opt, /var/lib are private overlays)."""
        self.run("sh", "-c", f'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod {mode:o} "$1"', "sh", path,
                 input=text)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run("systemctl", "show", unit, "--property=" + ",".join(props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def stop(self) -> None:
        """SIGKILL of that systemd ends every process inside."""
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
