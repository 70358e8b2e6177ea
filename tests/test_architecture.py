"""
The package stays inside issue 28's limits: no import loops between its modules (the
stand-in backend aside), at most 30 private reaches across objects, at most 20 entries
directly under C{llmport_agent/} (tests/archcheck.py; its docstring has the exact
definitions). Also runs alone: C{tox -e arch} or C{python3 tests/archcheck.py -v}.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from tests import archcheck

ROOT = Path(__file__).resolve().parent.parent


def _copy(test: SynchronousTestCase) -> Path:
    """A copy of the package in a temporary root (removed after the test)."""
    tmp = Path(tempfile.mkdtemp(prefix="archcheck-"))
    test.addCleanup(shutil.rmtree, tmp, True)
    shutil.copytree(
        ROOT / archcheck.PACKAGE,
        tmp / archcheck.PACKAGE,
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    return tmp


def _append(path: Path, text: str) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(text)


class LimitsTests(SynchronousTestCase):
    """The real tree is inside the limits."""

    def test_the_package_is_inside_the_limits(self) -> None:
        """No import loop, at most 30 private reaches, at most 20 top-level entries."""
        report = archcheck.Report(ROOT)
        self.assertEqual(report.over(), [], "\n".join(report.lines(verbose=True)))

    def test_the_script_exits_by_the_limits(self) -> None:
        """The script prints the three numbers and exits 0 exactly when inside the limits."""
        result = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "archcheck.py"), str(ROOT)],
            capture_output=True, text=True, timeout=120, check=False,
        )
        for name in archcheck.LIMITS:
            self.assertIn(name + ":", result.stdout)
        inside = not archcheck.Report(ROOT).over()
        self.assertEqual(result.returncode == 0, inside, result.stdout + result.stderr)


class CountingTests(SynchronousTestCase):
    """What is planted in a copy of the package is counted (and what is allowed is not)."""

    def setUp(self) -> None:
        self.root = _copy(self)
        self.before = archcheck.Report(self.root)
        self.pkg = self.root / archcheck.PACKAGE

    def test_a_planted_loop_is_counted(self) -> None:
        """Two modules importing each other (one only under TYPE_CHECKING) make one loop."""
        (self.pkg / "core" / "planted_a.py").write_text(
            "from llmport_agent.core import planted_b\n", encoding="utf-8"
        )
        (self.pkg / "core" / "planted_b.py").write_text(
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from llmport_agent.core.planted_a import X\n",
            encoding="utf-8",
        )
        after = archcheck.Report(self.root)
        self.assertEqual(len(after.loops), len(self.before.loops) + 1)
        self.assertIn(
            ["llmport_agent.core.planted_a", "llmport_agent.core.planted_b"], after.loops
        )
        self.assertIn(f"import loops: {len(after.loops)} > 0", " ".join(after.over()))

    def test_a_function_level_relative_import_loop_is_counted(self) -> None:
        """An import inside a function, written relative, closes a loop too."""
        (self.pkg / "core" / "planted_a.py").write_text(
            "def f():\n    from . import planted_b\n", encoding="utf-8"
        )
        (self.pkg / "core" / "planted_b.py").write_text(
            "import llmport_agent.core.planted_a\n", encoding="utf-8"
        )
        after = archcheck.Report(self.root)
        self.assertEqual(len(after.loops), len(self.before.loops) + 1)

    def test_a_loop_inside_the_stand_in_backend_is_not_counted(self) -> None:
        """Loops made only of devbackend modules are listed apart."""
        (self.pkg / "devbackend" / "planted_a.py").write_text(
            "from llmport_agent.devbackend import planted_b\n", encoding="utf-8"
        )
        (self.pkg / "devbackend" / "planted_b.py").write_text(
            "from llmport_agent.devbackend import planted_a\n", encoding="utf-8"
        )
        after = archcheck.Report(self.root)
        self.assertEqual(after.loops, self.before.loops)
        self.assertEqual(len(after.stand_in_loops), len(self.before.stand_in_loops) + 1)

    def test_a_planted_reach_is_counted(self) -> None:
        """
        C{other._name} counts once; C{self._name}, C{cls._name}, C{super()._name}, dunders
        and the documented C{os._exit} do not (that one is listed apart).
        """
        _append(
            self.pkg / "core" / "backoff.py",
            "\n\ndef _planted(other, self, cls, os):\n"
            "    other._secret = 1\n"
            "    os._exit\n"
            "    return self._x, cls._y, other.__class__, super()._z\n",
        )
        after = archcheck.Report(self.root)
        self.assertEqual(
            after.counts()["private reaches"], self.before.counts()["private reaches"] + 1
        )
        self.assertIn("other._secret", str(after.reaches["llmport_agent.core.backoff"]))
        self.assertIn("llmport_agent.core.backoff", [m for m, _line, _t in after.public])

    def test_reaches_in_an_allowlisted_adapter_are_listed_apart(self) -> None:
        """The docker-py adapter's reaches are reported under its library, not counted."""
        adapter = self.pkg / "workloads" / "dockerapi.py"
        _append(adapter, "\n\ndef _planted(api):\n    return api._more\n")
        after = archcheck.Report(self.root)
        self.assertEqual(after.counts(), self.before.counts())
        library, hits = after.adapters["llmport_agent.workloads.dockerapi"]
        self.assertEqual(library, "docker-py")
        self.assertIn("api._more", str(hits))
        self.assertIn("llmport_agent.workloads.dockerapi (docker-py)", "\n".join(after.lines(False)))

    def test_a_new_top_level_entry_is_counted(self) -> None:
        """A module or package directly under llmport_agent/ is an entry; __pycache__ is not."""
        (self.pkg / "planted.py").write_text("", encoding="utf-8")
        os.makedirs(self.pkg / "__pycache__", exist_ok=True)
        after = archcheck.Report(self.root)
        self.assertEqual(
            after.counts()["top-level entries"], self.before.counts()["top-level entries"] + 1
        )

    def test_the_script_fails_above_a_limit(self) -> None:
        """The command line exits 1 and names the measure when a limit is passed."""
        for i in range(archcheck.LIMITS["top-level entries"] + 1):
            (self.pkg / f"planted{i}.py").write_text("", encoding="utf-8")
        result = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "archcheck.py"), "-v", str(self.root)],
            capture_output=True, text=True, timeout=120, check=False,
        )
        self.assertEqual(result.returncode, 1, result.stdout)
        self.assertIn("top-level entries:", result.stdout.split("over the limits:")[1])
        self.assertIn("planted0.py", result.stdout)  # -v lists the entries
