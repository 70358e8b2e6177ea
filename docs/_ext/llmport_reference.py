"""
Sphinx directives that generate the reference pages from the code, at build time:

- ``llmport-settings``: the configuration reference, from ``llmport_agent.core.config.SETTINGS``,
  one block per setting (name, option, default, validation, secret, what a change needs). A
  setting whose help is empty fails the build.
- ``llmport-cli``: the command-line reference, from the argument parsers (``cli.build_parser``,
  and the doctor, demo and devbackend parsers).
- ``llmport-metrics``: the metrics reference, from ``metrics.make_registry`` around an agent
  built (not started) on a memory reactor, fake NVML GPUs, Loki and an engine client configured,
  so that every family the collector can export is listed with its type, labels and help.

Nothing here is checked in as generated text: a change to the code changes the pages.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown (MyST) pipe table: the pages are MyST, and so is what a directive inserts."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        out.append("| " + " | ".join(_cell(c) for c in row) + " |")
    out.append("")
    return out


# -- configuration -----------------------------------------------------------------------------

#: Values that no parser accepts: the first ConfigError's "expected ..." tail names the rule.
_PROBES = ("?not a value?", "-1000000000")


def validation(setting: Any) -> str:
    from llmport_agent.core.config import ConfigError

    for probe in _PROBES:
        try:
            setting.parse(setting.env, probe)
        except ConfigError as e:
            text = str(e)
            _, sep, expected = text.partition("; expected ")
            return expected if sep else text.split(": ", 1)[-1]
    return "any text" if setting.parse.__name__ in ("_str", "_optional_str") else "accepted as written"


def default_text(setting: Any) -> str:
    from llmport_agent.core.config import display_value

    if callable(setting.default):
        doc = (setting.default.__doc__ or "").strip()
        if not doc:
            raise ExtensionError(
                f"llmport-settings: the default of {setting.name} is computed by "
                f"{setting.default.__name__!r}, which has no docstring to show; give it one"
            )
        return doc
    if isinstance(setting.default, tuple):
        return ",".join(str(x) for x in setting.default) or "(unset)"
    return display_value(setting.default)


def settings_rst() -> list[str]:
    """
    One block per setting (a heading with the variable, then its option, default, what it
    accepts, what a change needs, and its meaning): readable on a laptop screen, where a
    six-column table was not.
    """
    from llmport_agent.core.config import SETTINGS
    from llmport_agent.host.installer import UNIT_PATH_SETTINGS

    lines: list[str] = []
    for s in SETTINGS:
        if not s.help.strip():
            raise ExtensionError(
                f"llmport-settings: {s.env} has no help text in llmport_agent/core/config.py "
                "(every setting is documented; write its Setting(..., help=...))"
            )
        change = ("`llmport-agent start` again (the unit's writable paths change)"
                  if s.name in UNIT_PATH_SETTINGS else "a restart")
        meaning = _cell(s.help) + (" *Secret: masked by* `config` *and never logged.*" if s.secret else "")
        lines += [
            f"### `{s.env}`",
            "",
            f"- option: `--{s.option}`",
            f"- default: {_cell(default_text(s))}",
            f"- accepts: {_cell(validation(s))}",
            f"- a change needs: {change}",
            "",
            meaning,
            "",
        ]
    return lines


# -- command line ------------------------------------------------------------------------------


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    from llmport_agent.cli import build_parser
    from llmport_agent.demo.run import build_parser as demo_parser
    from llmport_agent.devbackend.cli import ADMIN_VERBS, admin_parser
    from llmport_agent.devbackend.cli import build_parser as devbackend_parser
    from llmport_agent.doctor.run import build_parser as doctor_parser

    main = build_parser()
    out = [("llmport-agent", main)]
    for action in main._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if name not in ("doctor", "demo", "devbackend"):
                    out.append((f"llmport-agent {name}", sub))
    out += [("llmport-agent doctor", doctor_parser()), ("llmport-agent demo", demo_parser()),
            ("llmport-agent devbackend", devbackend_parser())]
    out += [(f"llmport-agent devbackend {verb}", admin_parser(verb)) for verb in ADMIN_VERBS]
    return out


def cli_rst() -> list[str]:
    os.environ["COLUMNS"] = "100"  # argparse wraps help to this width
    lines: list[str] = []
    for title, parser in _parsers():
        lines += [f"### `{title}`", "", "```text", *parser.format_help().splitlines(), "```", ""]
    return lines


# -- metrics -----------------------------------------------------------------------------------


def metric_families() -> list[tuple[str, str, tuple[str, ...], str]]:
    """(name, type, label names, help) of every family a configured agent exports."""
    from twisted.internet.testing import MemoryReactorClock

    from llmport_agent.agent.service import AgentService
    from llmport_agent.core.config import load_config
    from llmport_agent.inventory.fakes import FakeGPU, FakeNVML
    from llmport_agent.inventory.nvml import NVMLGPUSource
    from llmport_agent.ops.metrics import make_registry

    with tempfile.TemporaryDirectory() as d:
        config = load_config(environ={
            "LLM_PORT_NODE_AGENT_STATE_PATH": os.path.join(d, "state.json"),
            "LLM_PORT_NODE_AGENT_MODEL_STORE": os.path.join(d, "models"),
            "LLM_PORT_NODE_AGENT_LOKI_URL": "http://127.0.0.1:9/",
            "LLM_PORT_NODE_AGENT_OPS_PORT": "0",
        })
        gpus = FakeNVML([FakeGPU(name="doc GPU", uuid="GPU-00000000-0000-0000-0000-000000000000",
                                 pci_bus_id="00000000:0A:00.0", memory_total=1 << 30, memory_used=0)])
        agent = AgentService(MemoryReactorClock(), config, gpu_source=NVMLGPUSource(gpus),
                             docker_environ={"DOCKER_HOST": "unix://" + os.path.join(d, "no-docker.sock")})
        out = []
        for family in make_registry(agent).collect():
            labels = tuple(getattr(family, "_labelnames", ()) or ())
            if not labels:
                seen: list[str] = []
                for sample in family.samples:
                    seen += [k for k in sample.labels if k not in seen and k not in ("le", "quantile")]
                labels = tuple(seen)
            name = family.name + ("_total" if family.type == "counter" else "")
            out.append((name, family.type, labels, family.documentation))
    return out


def metrics_rst() -> list[str]:
    rows = []
    for name, kind, labels, doc in metric_families():
        if not doc.strip():
            raise ExtensionError(f"llmport-metrics: {name} has no help text")
        rows.append([f"`{name}`", kind, ", ".join(f"`{x}`" for x in labels), doc])
    return _table(["metric", "type", "labels", "help"], rows)


# -- the directives ----------------------------------------------------------------------------


class _Generated(SphinxDirective):
    has_content = False

    def lines(self) -> list[str]:
        raise NotImplementedError

    def run(self) -> list[nodes.Node]:
        node = nodes.section()
        node.document = self.state.document
        nested_parse_with_titles(self.state, StringList(self.lines(), source="(generated)"), node)
        return node.children


class SettingsDirective(_Generated):
    def lines(self) -> list[str]:
        return settings_rst()


class CLIDirective(_Generated):
    def lines(self) -> list[str]:
        return cli_rst()


class MetricsDirective(_Generated):
    def lines(self) -> list[str]:
        return metrics_rst()


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("llmport-settings", SettingsDirective)
    app.add_directive("llmport-cli", CLIDirective)
    app.add_directive("llmport-metrics", MetricsDirective)
    return {"parallel_read_safe": True, "version": "1"}
