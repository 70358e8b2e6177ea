"""
A real systemd (PID 1) in private PID, mount and UTS namespaces, booted as design.md says:
overlays on /etc, /var/lib and /opt (upper and work directories outside /tmp); tmpfs on /run,
/srv, /tmp, /var/tmp and /var/log; every unit wanted or required by anything masked (except
journald's), plus systemd-tmpfiles-setup and the udev, sysctl, modules-load, networking and
docker units, so nothing inside acts on the host. Ended by a SIGKILL of that systemd.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

SYSTEMD = "/lib/systemd/systemd"

BOOT = r"""#!/bin/sh
set -eu
base="$1"
for d in etc var/lib opt; do
  n=$(echo "$d" | tr / _)
  mkdir -p "$base/$n.upper" "$base/$n.work"
  mount -t overlay overlay -o "lowerdir=/$d,upperdir=$base/$n.upper,workdir=$base/$n.work" "/$d"
done
for d in /run /srv /tmp /var/tmp /var/log; do mount -t tmpfs tmpfs "$d"; done
masked=/etc/systemd/system
for f in /etc/systemd/system/*.wants/* /etc/systemd/system/*.requires/* \
         /lib/systemd/system/*.wants/* /lib/systemd/system/*.requires/*; do
  [ -e "$f" ] || [ -L "$f" ] || continue
  n=$(basename "$f")
  case "$n" in systemd-journald*) continue;; esac
  ln -sfn /dev/null "$masked/$n"
done
for n in systemd-tmpfiles-setup.service systemd-tmpfiles-setup-dev.service systemd-tmpfiles-clean.timer \
         systemd-udevd.service systemd-udev-trigger.service systemd-udev-settle.service \
         systemd-udevd-control.socket systemd-udevd-kernel.socket systemd-sysctl.service \
         systemd-modules-load.service networking.service docker.service docker.socket containerd.service; do
  ln -sfn /dev/null "$masked/$n"
done
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


class BootedSystemd:
    """One booted systemd; L{run} drives it (C{nsenter} into its namespaces)."""

    def __init__(self, base: str) -> None:
        self.base = base  # outside /tmp (the namespace mounts its own /tmp)
        os.makedirs(base, exist_ok=True)
        self.script = os.path.join(base, "boot.sh")
        with open(self.script, "w") as f:
            f.write(BOOT)
        os.chmod(self.script, 0o755)
        self.log = open(os.path.join(base, "boot.log"), "wb")
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount", "--uts", "--propagation", "private", "--mount-proc",
             self.script, base], stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
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
