"""
Tests that need a Debian package skip, when it is missing, with one line naming the package
and the command that installs it. C{LLMPORT_REQUIRE_PACKAGES=1} (set by C{.ci/run} in CI) turns
such a skip into a failure: a skipped test catches nothing.
"""

from __future__ import annotations

import os
import shutil

from twisted.trial.unittest import SkipTest

REQUIRE_ENV = "LLMPORT_REQUIRE_PACKAGES"


def package_skip(package: str, what: str) -> None:
    """Skip (or fail, under L{REQUIRE_ENV}) because C{what} of Debian C{package} is missing."""
    reason = f"needs Debian package {package} ({what} is missing): sudo apt-get install {package}"
    if os.environ.get(REQUIRE_ENV, "") == "1":
        raise AssertionError(f"{REQUIRE_ENV}=1 but the test {reason}")
    raise SkipTest(reason)


def require_package(package: str, *programs: str) -> None:
    """Each of C{programs} (an absolute path, or a name looked up on PATH) must be there."""
    for program in programs:
        found = os.access(program, os.X_OK) if program.startswith("/") else shutil.which(program)
        if not found:
            package_skip(package, program)
