"""check_system_updates: parsing of apt/dnf/fwupd output and the result shape of protocol 4."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.system_updates import check_system_updates, parse_apt, parse_dnf

APT = b"""Listing...
apt/oldstable-security 2.6.2 amd64 [upgradable from: 2.6.1]
base-files/oldstable 12.4+deb12u15 amd64 [upgradable from: 12.4+deb12u11]
"""
FWUPD = json.dumps({"Devices": [{"Name": "GPU BMC", "Version": "1.0", "Releases": [{"Version": "1.2", "Summary": "fix"}]}]}).encode()


class ParseTests(SynchronousTestCase):
    def test_apt(self) -> None:
        """apt list --upgradable lines become name/old/new."""
        self.assertEqual(parse_apt(APT.decode())[0], {"name": "apt", "old_version": "2.6.1", "new_version": "2.6.2"})

    def test_dnf(self) -> None:
        """dnf check-update lines become name/new."""
        out = "\nkernel.x86_64    5.14.0-400.el9    baseos\n"
        self.assertEqual(parse_dnf(out), [{"name": "kernel", "old_version": "", "new_version": "5.14.0-400.el9"}])

    def test_result_shape(self) -> None:
        """The result carries every field the UI reads."""
        calls: list[tuple[str, list[str]]] = []

        async def run(exe: str, args: list[str]) -> tuple[bytes, bytes, int]:
            calls.append((exe, args))
            return (FWUPD if "fwupdmgr" in exe else APT), b"", 0

        which = {"apt": "/usr/bin/apt", "fwupdmgr": "/usr/bin/fwupdmgr"}.get
        result: dict[str, Any] = self.successResultOf(Deferred.fromCoroutine(check_system_updates(run, which)))
        self.assertEqual(result["package_manager"], "apt")
        self.assertEqual(result["system_packages"]["package_count"], 2)
        self.assertTrue(result["system_packages"]["updates_available"])
        self.assertEqual(result["firmware"]["devices"][0]["update_version"], "1.2")
        self.assertEqual(set(result), {"package_manager", "os", "system_packages", "firmware"})
        self.assertEqual(calls[0], ("/usr/bin/apt", ["list", "--upgradable"]))
