"""
Run a command under the main restrictions of the agent's systemd unit, without systemd (PID 1
is not systemd on the test machines), so the tests can check the hardening against what the
agent really does:

 - SystemCallFilter=@system-service ~@privileged (allow list from `systemd-analyze
   syscall-filter`, everything else EPERM), SystemCallArchitectures=native;
 - RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK (socket() of any other family:
   EAFNOSUPPORT);
 - NoNewPrivileges=yes, CapabilityBoundingSet= as in the unit;
 - ProtectSystem=strict with ReadWritePaths= (a private mount namespace where every mount is
   read-only but /dev, /proc, /sys and the given paths), PrivateTmp=yes (a private /tmp).

Usage (as root, by a Python that has Debian's python3-seccomp):
    /usr/bin/python3 sandbox.py --rw DIR [--rw DIR ...] [--caps CAP_X,CAP_Y] [--shared-tmp] -- COMMAND ...
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import socket
import subprocess
import sys
import tempfile

MS_RDONLY = 1
MS_NOSUID = 2
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
CLONE_NEWNS = 0x00020000
PR_CAPBSET_DROP = 24

CAPS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3}
LAST_CAP = 40

libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def mount(src: str | None, target: str, fstype: str | None, flags: int) -> None:
    _check(libc.mount(src.encode() if src else None, target.encode(), fstype.encode() if fstype else None,
                      ctypes.c_ulong(flags), None), f"mount {target}")


def syscall_groups() -> dict[str, list[str]]:
    out = subprocess.run(["systemd-analyze", "syscall-filter"], capture_output=True, text=True, check=True).stdout
    groups: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines():
        if line.startswith("@"):
            current = line.strip()
            groups[current] = []
        elif current and line.strip() and not line.strip().startswith("#"):
            groups[current].append(line.strip())
    return groups


def expand(name: str, groups: dict[str, list[str]], seen: set[str] | None = None) -> set[str]:
    seen = seen or set()
    if not name.startswith("@"):
        return {name}
    if name in seen:
        return set()
    seen.add(name)
    out: set[str] = set()
    for item in groups.get(name, []):
        out |= expand(item, groups, seen)
    return out


def protect_system(rw: list[str], private_tmp: bool = True) -> None:
    _check(libc.unshare(CLONE_NEWNS), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    tmp = tempfile.mkdtemp(prefix="sandbox-tmp-")
    for path in rw:
        mount(path, path, None, MS_BIND)
    keep = {os.path.realpath(p) for p in rw}
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in sorted(set(points), key=len):
        point = point.replace("\\040", " ")
        if point in keep or point.startswith(("/dev", "/proc", "/sys")):
            continue
        try:
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
        except OSError:
            pass  # a mount that refuses a bind remount (e.g. already gone): leave it
    # PrivateTmp: a writable private /tmp (and /var/tmp) over the read-only one.
    for path in ("/tmp", "/var/tmp") if private_tmp else ():
        try:
            mount(tmp, path, None, MS_BIND)
            mount(None, path, None, MS_REMOUNT | MS_BIND | MS_NOSUID)
        except OSError:
            pass


def drop_caps(keep: set[int]) -> None:
    for cap in range(LAST_CAP + 1):
        if cap not in keep:
            libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)


def load_filter() -> None:
    import seccomp

    groups = syscall_groups()
    allowed = expand("@system-service", groups) - expand("@privileged", groups)
    allowed.discard("socket")
    f = seccomp.SyscallFilter(defaction=seccomp.ERRNO(errno.EPERM))
    for name in sorted(allowed):
        try:
            f.add_rule(seccomp.ALLOW, name)
        except (RuntimeError, ValueError, OSError):
            pass  # not a syscall of this architecture
    for family in (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK):
        f.add_rule(seccomp.ALLOW, "socket", seccomp.Arg(0, seccomp.EQ, int(family)))
    f.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), "socket", seccomp.Arg(0, seccomp.GT, 0))
    f.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), "socket", seccomp.Arg(0, seccomp.EQ, 0))
    f.load()  # also sets no_new_privs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rw", action="append", default=[])
    p.add_argument("--caps", default="CAP_DAC_OVERRIDE,CAP_DAC_READ_SEARCH,CAP_FOWNER")
    p.add_argument("--shared-tmp", action="store_true",
                   help="keep the host's /tmp (read-only) instead of a private one (the test engine's socket is there)")
    p.add_argument("command", nargs="+")
    args = p.parse_args()
    protect_system([os.path.realpath(d) for d in args.rw], private_tmp=not args.shared_tmp)
    drop_caps({CAPS[c] for c in args.caps.split(",") if c})
    load_filter()
    os.execvpe(args.command[0], args.command, os.environ)


if __name__ == "__main__":
    try:
        main()
    except OSError as e:
        print(f"sandbox: {e}", file=sys.stderr)
        sys.exit(125)
