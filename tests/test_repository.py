"""
The repository holds only source: no file a test run writes (trial's temp directory, a test's
journal or outbox written into the working directory by a TestCase run outside trial) is
tracked. .ci/run also checks that the working tree is as clean after the suite as before it.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from twisted.trial.unittest import SkipTest, SynchronousTestCase

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: What the top of the repository holds; anything else tracked is a stray file.
TOP = frozenset({
    ".ci", ".gitignore", "BENCHMARKS.md", "README.md", "bench", "deploy", "docs", "llmport_agent",
    "packaging", "pyproject.toml", "tests", "tox.ini", "twisted",
})


def tracked() -> list[str]:
    if shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")):
        raise SkipTest("not a git checkout (git or .git missing): nothing to check")
    out = subprocess.run(
        ["git", "-C", ROOT, "ls-files", "-z"], capture_output=True, check=False, timeout=60
    )
    if out.returncode:
        raise SkipTest(f"git ls-files failed: {out.stderr.decode(errors='replace').strip()[:200]}")
    return [p for p in out.stdout.decode("utf-8", "replace").split("\0") if p]


def stray(paths: list[str]) -> list[str]:
    """The tracked paths that are test output or outside the repository's known top level."""
    bad = []
    for p in paths:
        parts = p.split("/")
        if parts[0] not in TOP or any(x.startswith("_trial_temp") for x in parts):
            bad.append(p)
        elif p.endswith((".jsonl", ".pyc")) and not p.startswith("tests/data/"):
            bad.append(p)
    return bad


class RepositoryTests(SynchronousTestCase):
    def test_only_source_is_tracked(self) -> None:
        bad = stray(tracked())
        self.assertEqual(bad, [], f"stray files are tracked (git rm them): {bad[:10]}")

    def test_stray_detects_test_output(self) -> None:
        """The check itself: the files once committed by a test run are caught."""
        self.assertEqual(
            stray(["__main__/T/test/qmekc2e_/temp/commands.jsonl", "tests/x/events.jsonl",
                   "_trial_temp/test.log", "llmport_agent/cli.py"]),
            ["__main__/T/test/qmekc2e_/temp/commands.jsonl", "tests/x/events.jsonl",
             "_trial_temp/test.log"],
        )

    def test_trial_temp_is_ignored(self) -> None:
        with open(os.path.join(ROOT, ".gitignore")) as f:
            self.assertIn("_trial_temp*", f.read().split())
