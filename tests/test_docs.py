"""
The documentation in docs/ builds with Sphinx, warnings as errors, and its generated references
match the code: every setting of C{config.SETTINGS} (with its default and validation), every
command of the argument parsers, every metric family of the collector. A setting added with an
empty help text fails the build.

Without Sphinx (the C{docs} extra) the build test skips with one line; in CI (C{CI=true} or
C{LLMPORT_REQUIRE_DOCS=1}, set by C{.ci/run}, which installs the extra) it fails instead.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from llmport_agent.config import SETTINGS, Setting

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _need_sphinx() -> None:
    if importlib.util.find_spec("sphinx") and importlib.util.find_spec("myst_parser"):
        return
    reason = "sphinx or myst-parser is not installed: pip install -e '.[docs]'"
    if os.environ.get("CI") == "true" or os.environ.get("LLMPORT_REQUIRE_DOCS") == "1":
        raise AssertionError(reason + " (required in CI)")
    raise SkipTest(reason)


def _extension():  # type: ignore[no-untyped-def]
    _need_sphinx()
    sys.path.insert(0, os.path.join(DOCS, "_ext"))
    try:
        import llmport_reference
    finally:
        sys.path.remove(os.path.join(DOCS, "_ext"))
    return llmport_reference


class BuildTests(SynchronousTestCase):
    def build(self, source: str) -> tuple[int, str, str]:
        out = tempfile.mkdtemp()
        self.addCleanup(subprocess.run, ["rm", "-rf", out])
        done = subprocess.run(
            [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", source, out],
            capture_output=True, text=True, timeout=300, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT})
        return done.returncode, done.stdout + done.stderr, out

    def test_builds_without_warnings(self) -> None:
        """`tox -e docs` builds: no warning, and the generated pages hold what the code has."""
        _need_sphinx()
        rc, output, out = self.build(DOCS)
        self.assertEqual(rc, 0, output)
        with open(os.path.join(out, "configuration.html"), encoding="utf-8") as f:
            config = f.read()
        self.assertEqual([s.env for s in SETTINGS if s.env not in config], [])
        self.assertEqual([s.option for s in SETTINGS if f"--{s.option}" not in config], [])
        # Readable on a laptop: one block per setting (no wide table), code scrolling inside.
        self.assertNotIn("<table", config.split('id="settings"', 1)[1].split('id="notes-on-some-settings"', 1)[0])
        self.assertIn("_static/custom.css", config)
        with open(os.path.join(out, "_static", "custom.css"), encoding="utf-8") as f:
            css = f.read()
        self.assertIn("overflow-x: auto", css)
        with open(os.path.join(out, "cli.html"), encoding="utf-8") as f:
            cli = f.read()
        for command in ("run", "config", "start", "join", "stop", "status", "doctor", "demo",
                        "devbackend", "devbackend join-requests", "devbackend approve", "devbackend reject"):
            self.assertIn(f"llmport-agent {command}", cli)
        self.assertIn("--env-file", cli)  # doctor's own parser
        self.assertIn("--generation", cli)  # devbackend's own parser
        with open(os.path.join(out, "metrics.html"), encoding="utf-8") as f:
            metrics = f.read()
        ext = _extension()
        families = ext.metric_families()
        self.assertGreater(len(families), 50)
        self.assertEqual([name for name, *_ in families if name not in metrics], [])

    def test_setting_without_help_fails_the_build(self) -> None:
        """A setting added to SETTINGS with an empty help text turns the build red."""
        _need_sphinx()
        from sphinx.errors import ExtensionError

        from llmport_agent import config

        ext = _extension()
        undocumented = Setting("NEW_KNOB", "new_knob", 1, SETTINGS[0].parse, "")
        self.patch(config, "SETTINGS", (*SETTINGS, undocumented))
        with self.assertRaises(ExtensionError) as caught:
            ext.settings_rst()
        self.assertIn("LLM_PORT_NODE_AGENT_NEW_KNOB has no help text", str(caught.exception))


class ReferenceTests(SynchronousTestCase):
    def test_settings_blocks(self) -> None:
        """One block per setting: the variable as a heading, its option, default as written, rule, change."""
        ext = _extension()
        lines = ext.settings_rst()
        blocks: dict[str, list[str]] = {}
        for line in lines:
            if line.startswith("### `"):
                current = blocks.setdefault(line[5:-1], [])
            elif line:
                current.append(line)
        self.assertEqual(list(blocks), [s.env for s in SETTINGS])
        block = blocks["LLM_PORT_NODE_AGENT_HEARTBEAT_INTERVAL_SEC"]
        self.assertEqual(block[:4], ["- option: `--heartbeat-interval-sec`", "- default: 15",
                                     "- accepts: a number >= 1", "- a change needs: a restart"])
        self.assertTrue(block[4].startswith("Seconds"), block)
        self.assertIn("`llmport-agent start` again", blocks["LLM_PORT_NODE_AGENT_MODEL_STORE"][3])
        self.assertIn("this host's name", "\n".join(lines))  # a computed default shows its docstring
        self.assertIn("*Secret: masked by*", blocks["LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN"][4])
        # No table: nothing that needs a screen wider than a laptop's.
        self.assertFalse([line for line in lines if line.startswith("|")])

    def test_default_without_docstring_fails(self) -> None:
        """A computed default with nothing to show fails the build rather than showing a repr."""
        from sphinx.errors import ExtensionError

        ext = _extension()
        setting = Setting("X", "x", lambda v: 1, SETTINGS[0].parse, "help")
        self.assertRaises(ExtensionError, ext.default_text, setting)
