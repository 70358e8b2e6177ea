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
import re
import subprocess
import sys
import tempfile

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from llmport_agent.core.config import SETTINGS, Setting

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

    def test_pages_fit_a_laptop_screen(self) -> None:
        """
        Headless Chromium at 1280x900 lays out the built configuration and operator-guide pages:
        no horizontal page scroll, and no code block, table or heading sticking out of the body
        (a code block scrolls inside itself). Before issue 26 the configuration page was 2261 px
        wide and an operator-guide table stuck out of the body.
        """
        _need_sphinx()
        from tests.support.packages import require_package

        require_package("chromium", "chromium")
        rc, output, out = self.build(DOCS)
        self.assertEqual(rc, 0, output)
        for page in ("configuration", "operator-guide"):
            width, right, body = self.measure(out, page)
            self.assertLessEqual(width, 1280, f"{page}: the page is {width} px wide at a 1280 px window")
            self.assertLessEqual(right, body + 1, f"{page}: something ends at {right} px, the body at {body} px")
        # The measure sees a page that does not fit.
        width, right, body = self.measure(out, "configuration", extra='<pre style="width: 3000px; max-width: none">x</pre>')
        self.assertGreater(width, 1280)
        self.assertGreater(right, body)

    def measure(self, out: str, page: str, extra: str = "") -> tuple[int, int, int]:
        """(document width, right edge of the body's widest block, the body's right edge) in px."""
        with open(os.path.join(out, f"{page}.html"), encoding="utf-8") as f:
            html = f.read()
        script = (
            "<script>document.title = [document.documentElement.scrollWidth,"
            " Math.max(0, ...Array.from(document.querySelectorAll('div.body pre, div.body table, div.body h3,"
            " div.body div.highlight')).map(e => e.getBoundingClientRect().right)),"
            " document.querySelector('div.body').getBoundingClientRect().right].map(Math.round).join(' ');</script>")
        if extra:
            html = html.replace('<div class="body" role="main">', '<div class="body" role="main">' + extra, 1)
        probe = os.path.join(out, f"probe-{page}.html")
        with open(probe, "w", encoding="utf-8") as f:
            f.write(html.replace("</body>", script + "</body>", 1))
        profile = tempfile.mkdtemp()
        self.addCleanup(subprocess.run, ["rm", "-rf", profile])
        done = subprocess.run(
            ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
             "--window-size=1280,900", "--dump-dom", "file://" + probe],
            capture_output=True, text=True, timeout=120)
        found = re.search(r"<title>(\d+) (\d+) (\d+)</title>", done.stdout)
        self.assertIsNotNone(found, done.stderr[-2000:])
        assert found is not None
        return int(found.group(1)), int(found.group(2)), int(found.group(3))

    def test_setting_without_help_fails_the_build(self) -> None:
        """A setting added to SETTINGS with an empty help text turns the build red."""
        _need_sphinx()
        from sphinx.errors import ExtensionError

        from llmport_agent.core import config

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


class DocsTruthTests(SynchronousTestCase):
    """
    Every page says what is true today (issue 26): the modules, paths, commands, options and
    settings it names exist, and nothing a test shows working is called unbuilt or refused
    (tests/docscheck.py; runs in CI with the rest of the suite, no Sphinx needed).
    """

    def test_every_page_names_what_exists(self) -> None:
        from tests.docscheck import all_problems, pages

        self.assertGreater(len(pages()), 10)
        self.assertEqual(all_problems(), [])

    def test_the_check_sees_what_is_wrong(self) -> None:
        from tests.docscheck import _source_strings, cli_options, problems_of

        page = "\n".join([
            "# Title", "", "## Not yet built", "", "## Not yet built", "",
            "See `llmport_agent/workloads/gone.py` and `llmport_agent.workloads.handlers.NoSuchThing`,",
            "and `previousbuilds.py`.",
            "",
            "```text",
            "sudo llmport-agent frobnicate --now",
            "llmport-agent status --usr",
            "llmport-agent devbackend approve --no-such-flag",
            "LLM_PORT_NODE_AGENT_NO_SUCH_SETTING=1 llmport-agent run",
            "```",
            "",
        ])
        found = problems_of("x.md", page, cli_options())
        for needle in ("llmport_agent/workloads/gone.py does not exist",
                       "llmport_agent.workloads.handlers.NoSuchThing is no module",
                       "previousbuilds.py is no file", "`llmport-agent frobnicate` is no command",
                       "`llmport-agent status` has no option --usr",
                       "`llmport-agent devbackend approve` has no option --no-such-flag",
                       "LLM_PORT_NODE_AGENT_NO_SUCH_SETTING is no setting",
                       "the heading 'Not yet built' is there 2 times"):
            self.assertTrue(any(needle in p for p in found), (needle, found))
        self.assertEqual(len(found), 8, found)
        # What exists passes.
        fine = ("`llmport_agent/workloads/handlers.py`, `llmport_agent.workloads.handlers.WorkloadManager`, "
                "`llmport-agent status --user`, `llmport-agent config --set NAME=VALUE`, "
                "`LLM_PORT_NODE_AGENT_READINESS_TIMEOUT_SEC`, `llmport_agent.ops.endpoint.access` (a log namespace)")
        self.assertEqual(problems_of("y.md", fine, cli_options(), _source_strings()), [])

    def test_the_claims_these_pages_made_before_are_caught(self) -> None:
        """The sentences docs/status.md and docs/cli.md had while join --user and adopted logs worked."""
        from tests.docscheck import claim_problems

        old_status = (
            "- `join --user` (a systemd `--user` service without root) is refused with one line for now;\n"
            "  `join` then `start` run as root.\n"
            "- Containers adopted from the original agent are not followed by the Loki container log reader\n"
            "  (it follows labelled containers) until their next deploy or update replaces them.\n")
        old_cli = ("| `sudo llmport-agent join [URL] [--user]` | join the current llm-port without a token: files a "
                   "join request. See \"Joining without a token\". `--user` (a systemd `--user` service) is not "
                   "available yet |\n")
        said = claim_problems("status.md", old_status) + claim_problems("cli.md", old_cli)
        self.assertEqual(len(said), 3, said)
        self.assertIn("join --user", said[0])
        self.assertIn("adopted containers", said[1])
        self.assertIn("join --user", said[2])
        # A true limit stays allowed: `start --user` as root is refused.
        self.assertEqual(claim_problems("g.md", "`start --user` as root is refused; `status --user` works."), [])

    def test_each_working_feature_names_its_test(self) -> None:
        from tests.docscheck import ROOT as REPO
        from tests.docscheck import WORKING

        for feature, _claims, _row, (test, marker) in WORKING:
            with open(os.path.join(REPO, test), encoding="utf-8") as f:
                self.assertIn(marker, f.read(), feature)

    def test_the_architecture_page_lists_every_module(self) -> None:
        """
        Every entry directly under llmport_agent/ is on the page (its layout before issue 26
        lacked modules; issue 28 moved them into layer packages), and one taken out is named.
        """
        from tests.docscheck import architecture_problems

        self.assertEqual(architecture_problems(), [])
        with open(os.path.join(DOCS, "architecture.md"), encoding="utf-8") as f:
            text = f.read()
        for module in ("agent/", "core/", "host/", "ops/", "demo/", "cli.py", "events/"):
            without = re.sub(r"(?<![\w/])" + re.escape(module), "", text)
            self.assertEqual(architecture_problems(without),
                             [f"docs/architecture.md: llmport_agent/{module} is not in the layout"])
