"""
C{check_system_updates}: a read-only look at pending OS package and firmware updates.

Runs the host's package manager in list mode (C{apt list --upgradable}, C{dnf check-update}) and
C{fwupdmgr get-updates --json} when present, as child processes with a timeout (never on the
reactor thread, never as a shell). Nothing is installed: C{apply_system_updates} stays refused,
because upgrading a GPU host's packages remotely is the operator's decision.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
from collections.abc import Awaitable, Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.utils import getProcessOutputAndValue

Runner = Callable[[str, list[str]], Awaitable[tuple[bytes, bytes, int]]]

_APT_LINE = re.compile(r"^(?P<name>[^/\s]+)/\S+\s+(?P<new>\S+)\s+\S+(?:\s+\[upgradable from: (?P<old>[^\]]+)\])?")


def parse_apt(output: str) -> list[dict[str, str]]:
    packages = []
    for line in output.splitlines():
        m = _APT_LINE.match(line.strip())
        if m:
            packages.append({"name": m["name"], "old_version": m["old"] or "", "new_version": m["new"]})
    return packages


def parse_dnf(output: str) -> list[dict[str, str]]:
    packages = []
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 3 and "." in parts[0] and not line.startswith((" ", "Last metadata", "Obsoleting")):
            packages.append({"name": parts[0].rsplit(".", 1)[0], "old_version": "", "new_version": parts[1]})
    return packages


def parse_fwupd(output: str) -> list[dict[str, str]]:
    try:
        data = json.loads(output)
    except ValueError:
        return []
    devices = []
    for dev in data.get("Devices", []) if isinstance(data, dict) else []:
        if not isinstance(dev, dict):
            continue
        releases = dev.get("Releases") or []
        release = releases[0] if releases and isinstance(releases[0], dict) else {}
        devices.append({
            "name": str(dev.get("Name", "")),
            "current_version": str(dev.get("Version", "")),
            "update_version": str(release.get("Version", "")),
            "summary": str(release.get("Summary", "")),
        })
    return devices


def os_name() -> str:
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return platform.platform()


def process_runner(reactor: Any, timeout: float = 120.0) -> Runner:
    async def run(executable: str, args: list[str]) -> tuple[bytes, bytes, int]:
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LC_ALL": "C"}
        d: Deferred[tuple[bytes, bytes, int]] = getProcessOutputAndValue(
            executable, args, env=env, reactor=reactor
        )
        d.addTimeout(timeout, reactor)
        return await d

    return run


async def check_system_updates(run: Runner, which: Callable[[str], str | None] = shutil.which) -> dict[str, Any]:
    result: dict[str, Any] = {
        "package_manager": "",
        "os": os_name(),
        "system_packages": {"updates_available": False, "package_count": 0, "packages": []},
        "firmware": {"available": False, "updates_available": False, "device_count": 0, "devices": []},
    }
    packages: list[dict[str, str]] = []
    apt = which("apt")
    dnf = which("dnf")
    if apt:
        result["package_manager"] = "apt"
        out, err, _ = await run(apt, ["list", "--upgradable"])
        packages = parse_apt(out.decode("utf-8", "replace"))
    elif dnf:
        result["package_manager"] = "dnf"
        out, err, code = await run(dnf, ["-q", "check-update"])
        packages = parse_dnf(out.decode("utf-8", "replace")) if code in (0, 100) else []
    result["system_packages"] = {
        "updates_available": bool(packages),
        "package_count": len(packages),
        "packages": packages[:1000],
    }
    fwupd = which("fwupdmgr")
    if fwupd:
        out, err, code = await run(fwupd, ["get-updates", "--json", "--no-unreported-check"])
        devices = parse_fwupd(out.decode("utf-8", "replace"))
        result["firmware"] = {
            "available": True,
            "updates_available": bool(devices),
            "device_count": len(devices),
            "devices": devices,
        }
    return result
