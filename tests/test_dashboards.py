"""
The Grafana dashboard (`deploy/grafana/llmport-agent.json`) and the Prometheus alert rules
(`deploy/prometheus/llmport-agent.rules.yml`), checked without a Grafana or a Prometheus:

 - every expression parses with a real PromQL parser (the `promql-parser` package);
 - every metric and label an expression uses is exported by a running agent's `/metrics`
   (a real agent against the stand-in backend, with fake NVML GPUs, Loki on and the Docker
   engine away, scraped over HTTP and parsed with prometheus_client's own parser): a renamed
   metric or label turns these tests red;
 - the dashboard is valid for Grafana: schema version, unique panel ids, a datasource variable
   and a node selector, every panel with the datasource and a target, every selector filtered
   by the node selector;
 - every rule has a runbook: summary and description, a severity, a `for`.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import promql_parser
import treq
import yaml
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.inventory.gpu import NVMLGPUSource
from llmport_agent.ops import OpsService
from tests.agentharness import AgentTestCase
from tests.test_ops import fake_gpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "llmport-agent.json")
RULES = os.path.join(ROOT, "deploy", "prometheus", "llmport-agent.rules.yml")

#: Series and labels Prometheus itself adds to every target (not the agent's to export).
SYNTHETIC_SERIES = frozenset({"up"})
TARGET_LABELS = frozenset({"instance", "job"})

#: Grafana's variables, replaced by values of the right kind before parsing.
GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "${instance}": "node-a:9464",
    "$instance": "node-a:9464",
}


def grafana_to_promql(expr: str) -> str:
    for name, value in sorted(GRAFANA_VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    if "$" in expr:
        raise AssertionError(f"unknown Grafana variable in {expr!r}")
    return expr


def dashboard() -> dict[str, Any]:
    with open(DASHBOARD, encoding="utf-8") as f:
        return dict(json.load(f))


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in board["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # panels inside a collapsed row
    return out


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expression) of every target, and the node selector's query."""
    board = dashboard()
    exprs = [(p["title"], t["expr"]) for p in panels(board) if p.get("type") != "row"
             for t in p.get("targets", [])]
    return exprs


def rules() -> list[dict[str, Any]]:
    with open(RULES, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    return [r for g in doc["groups"] for r in g["rules"]]


class Use:
    """The metrics and labels one PromQL expression uses, read from its syntax tree."""

    def __init__(self, expr: str) -> None:
        self.selectors: list[tuple[str, dict[str, str]]] = []  # (metric, {label: value})
        self.grouping: set[str] = set()  # by/without/on/ignoring/group_x labels
        self.tree = promql_parser.parse(expr)
        promql_parser.walk(self.tree, self._visit)

    def _visit(self, node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name
            labels: dict[str, str] = {}
            for m in node.matchers.matchers:
                if m.name == "__name__":
                    name = m.value
                else:
                    labels[m.name] = m.value
            assert name, f"a selector without a metric name: {node}"
            self.selectors.append((name, labels))
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            self.grouping.update(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            matching = node.modifier.matching
            if matching is not None:
                self.grouping.update(matching.labels)
            self.grouping.update(node.modifier.group_labels or ())
        return True


class Exported:
    """Sample names and, for each, the label names seen, from one real scrape."""

    def __init__(self, text: str) -> None:
        self.labels: dict[str, set[str]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.labels.setdefault(sample.name, set()).update(sample.labels)

    def check(self, where: str, expr: str) -> list[str]:
        problems = []
        use = Use(expr)
        seen: set[str] = set(TARGET_LABELS)
        for name, labels in use.selectors:
            if name in SYNTHETIC_SERIES:
                continue
            if name not in self.labels:
                problems.append(f"{where}: {name} is not exported by the agent")
                continue
            seen |= self.labels[name]
            for label in labels:
                if label not in self.labels[name] and label not in TARGET_LABELS:
                    problems.append(f"{where}: {name} has no label {label!r}")
        for label in use.grouping - seen:
            problems.append(f"{where}: groups by {label!r}, which none of its series has")
        return problems


class ExpressionSyntaxTests(SynchronousTestCase):
    def test_every_dashboard_expression_parses(self) -> None:
        exprs = dashboard_exprs()
        self.assertGreater(len(exprs), 20)
        for title, expr in exprs:
            try:
                promql_parser.parse(grafana_to_promql(expr))
            except ValueError as e:
                self.fail(f"panel {title!r}: {expr!r} does not parse: {e}")

    def test_every_rule_expression_parses(self) -> None:
        for rule in rules():
            try:
                promql_parser.parse(rule["expr"])
            except ValueError as e:
                self.fail(f"rule {rule['alert']}: does not parse: {e}")

    def test_a_broken_expression_is_caught(self) -> None:
        """The parser is real: it refuses what Prometheus refuses."""
        for bad in ("rate(llmport_agent_heartbeats_total)", "sum by (x (y)", "foo{a=b}"):
            self.assertRaises(ValueError, promql_parser.parse, bad)
        use = Use('sum by (gpu) (rate(a_total{x="1"}[5m])) / on(instance) b')
        self.assertEqual(use.selectors, [("a_total", {"x": "1"}), ("b", {})])
        self.assertEqual(use.grouping, {"gpu", "instance"})


class GrafanaValidityTests(SynchronousTestCase):
    def test_dashboard_shape(self) -> None:
        board = dashboard()
        self.assertIsInstance(board["schemaVersion"], int)
        self.assertGreaterEqual(board["schemaVersion"], 36)
        self.assertTrue(board["title"])
        self.assertRegex(board["uid"], r"^[A-Za-z0-9_-]{1,40}$")
        self.assertIn("id", board)  # null: Grafana assigns one on import
        ids = [p["id"] for p in panels(board)]
        self.assertEqual(len(ids), len(set(ids)), "panel ids must be unique")
        self.assertTrue(all(isinstance(i, int) for i in ids))
        variables = {v["name"]: v for v in board["templating"]["list"]}
        self.assertEqual(variables["datasource"]["type"], "datasource")
        self.assertEqual(variables["datasource"]["query"], "prometheus")
        node = variables["instance"]
        self.assertEqual(node["type"], "query")
        self.assertEqual(node["datasource"]["uid"], "${datasource}")
        self.assertTrue(node["multi"] and node["includeAll"])
        query = node["query"]["query"] if isinstance(node["query"], dict) else node["query"]
        self.assertRegex(query, r"^label_values\(llmport_agent_build_info, *instance\)$")
        for p in panels(board):
            for key in ("id", "type", "title", "gridPos"):
                self.assertIn(key, p, p.get("title"))
            for key in ("h", "w", "x", "y"):
                self.assertIsInstance(p["gridPos"][key], int)
            self.assertLessEqual(p["gridPos"]["x"] + p["gridPos"]["w"], 24, p["title"])
            if p["type"] == "row":
                continue
            self.assertEqual(p["datasource"], {"type": "prometheus", "uid": "${datasource}"}, p["title"])
            self.assertTrue(p["targets"], f"panel {p['title']!r} has no target")
            refs = [t["refId"] for t in p["targets"]]
            self.assertEqual(len(refs), len(set(refs)), p["title"])
            for t in p["targets"]:
                self.assertEqual(t["datasource"], p["datasource"], p["title"])
                self.assertTrue(t["expr"].strip(), p["title"])

    def test_every_selector_follows_the_node_selector(self) -> None:
        for title, expr in dashboard_exprs():
            for name, labels in Use(grafana_to_promql(expr)).selectors:
                self.assertEqual(labels.get("instance"), GRAFANA_VARIABLES["$instance"],
                                 f"panel {title!r}: {name} is not filtered by instance=~\"$instance\"")
                self.assertIn('instance=~"$instance"', expr, title)

    def test_what_the_dashboard_shows(self) -> None:
        """The panels the issue asks for are there (by the series they read)."""
        used = {name for _t, e in dashboard_exprs() for name, _l in Use(grafana_to_promql(e)).selectors}
        for name in ("llmport_agent_session_state", "llmport_agent_connected",
                     "llmport_agent_command_pickup_seconds_bucket", "llmport_agent_command_duration_seconds_bucket",
                     "llmport_agent_command_duration_seconds_count", "llmport_agent_workloads",
                     "llmport_agent_gpu_health", "llmport_agent_gpu_utilization_ratio",
                     "llmport_agent_gpu_memory_used_bytes", "llmport_agent_gpu_temperature_celsius",
                     "llmport_agent_loki_lines_sent_total", "llmport_agent_loki_lines_dropped_total",
                     "llmport_agent_loki_spool_bytes", "llmport_agent_reactor_lateness_seconds_bucket",
                     "process_resident_memory_bytes", "process_cpu_seconds_total"):
            self.assertIn(name, used)


class RuleRunbookTests(SynchronousTestCase):
    def test_every_rule_has_a_runbook(self) -> None:
        names = []
        for rule in rules():
            names.append(rule["alert"])
            self.assertRegex(rule["alert"], r"^LlmportAgent[A-Za-z]+$")
            self.assertRegex(str(rule.get("for", "")), r"^\d+[smh]$", rule["alert"])
            self.assertIn(rule["labels"]["severity"], ("warning", "critical"), rule["alert"])
            notes = rule["annotations"]
            self.assertGreater(len(notes["summary"]), 10, rule["alert"])
            self.assertGreater(len(notes["description"]), 60, rule["alert"])
            self.assertIn("{{ $labels.instance }}", notes["summary"] + notes["description"], rule["alert"])
        self.assertEqual(len(names), len(set(names)))
        for wanted in ("LlmportAgentDown", "LlmportAgentDisconnected", "LlmportAgentGPUUnhealthy",
                       "LlmportAgentCommandFailures", "LlmportAgentLokiDropping", "LlmportAgentLokiSpoolFull",
                       "LlmportAgentReactorLate", "LlmportAgentCredentialRejected",
                       "LlmportAgentEngineUnreachable"):
            self.assertIn(wanted, names)

    def test_disconnected_means_five_minutes(self) -> None:
        rule = next(r for r in rules() if r["alert"] == "LlmportAgentDisconnected")
        self.assertEqual(rule["for"], "5m")


class AgainstARunningAgentTests(AgentTestCase):
    """The expressions against the names a running agent exports."""

    timeout = 120

    async def scrape(self) -> str:
        backend = await self.start_backend()
        d = os.path.abspath(self.mktemp())
        agent = self.start_agent(
            backend, state_dir=d, gpu_source=NVMLGPUSource(fake_gpus(2)),
            docker_host="unix://" + os.path.join(d, "no-docker.sock"),
            LOKI_URL="http://127.0.0.1:9",  # nothing listens: pushes fail, lines are counted
        )
        self.allow_anomalies(".", "the deploy fails on purpose (no engine)")
        # The health watcher's view of workloads (no engine here): three of them.
        agent.health.states = lambda: {f"rt-{i}": {"state": "running" if i else "exited"}  # type: ignore[union-attr]
                                       for i in range(3)}
        node_id = await self.wait_connected(backend, agent)
        await backend.wait_for(lambda: agent.inventory.sent >= 1, 20)
        ok = backend.issue_command(node_id, "set_maintenance_mode", {"enabled": False})
        bad = backend.issue_command(node_id, "deploy_workload", {"runtime_id": "rt-x"})
        await backend.wait_for(lambda: all(backend.command(c["id"])["status"] in ("succeeded", "failed")
                                           for c in (ok, bad)), 30)
        ops = OpsService(reactor, agent, 0)
        ops.startService()
        self.addCleanup(ops.stopService)
        port = ops.listening_port
        assert port is not None
        response = await treq.get(f"http://127.0.0.1:{port}/metrics", persistent=False)
        self.assertEqual(response.code, 200)
        text = str(await response.text())
        await deferLater(reactor, 0, lambda: None)
        return text

    async def test_every_series_and_label_is_exported(self) -> None:
        exported = Exported(await self.scrape())
        problems: list[str] = []
        for title, expr in dashboard_exprs():
            problems += exported.check(f"panel {title!r}", grafana_to_promql(expr))
        for rule in rules():
            problems += exported.check(f"rule {rule['alert']}", rule["expr"])
        # Legends name labels the series have.
        for p in panels(dashboard()):
            for t in p.get("targets", []):
                use = Use(grafana_to_promql(t["expr"]))
                have = set(TARGET_LABELS) | use.grouping
                for name, _l in use.selectors:
                    have |= exported.labels.get(name, set())
                for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")):
                    if label not in have:
                        problems.append(f"panel {p['title']!r}: legend names {label!r}, which its series lack")
        self.assertEqual(problems, [])
        # And the check itself sees a renamed metric or label.
        self.assertTrue(exported.check("x", "llmport_agent_gpu_temprature_celsius"))
        self.assertTrue(exported.check("x", 'llmport_agent_workloads{status="running"}'))
        self.assertTrue(exported.check("x", "sum by (gpu) (llmport_agent_workloads)"))
        self.assertEqual(exported.check("x", 'sum by (gpu) (llmport_agent_gpu_health{state="unhealthy"})'), [])
