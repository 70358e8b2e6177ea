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
 - every rule has a runbook: summary and description, a severity, a `for`;
 - (issue 26) every selector is scoped to the agents' scrape job (the dashboard's `job`
   variable, the rules' job="llmport-agent"), stat panels turn red on a bad value, the Nodes
   table is one table (its queries merged), every panel has a description;
 - against a real Prometheus (Debian package prometheus) scraping a running agent and a second
   target (Prometheus itself): every expression evaluates, every selector returns only the
   agent's series, "Agents up" is 1 where `sum(up)` is 2, and the rules load and evaluate.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from typing import Any
from urllib.parse import quote

import promql_parser
import treq
import yaml
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.inventory.nvml import NVMLGPUSource
from llmport_agent.ops.endpoint import OpsService
from tests.agentharness import AgentTestCase
from tests.support.docker_env import free_port
from tests.support.packages import require_package
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
    "${job}": "llmport-agent",
    "$job": "llmport-agent",
}
#: The scrape job the rules select (and the docs' scrape configuration names).
RULES_JOB = "llmport-agent"


def grafana_to_promql(expr: str, variables: dict[str, str] | None = None) -> str:
    for name, value in sorted((variables or GRAFANA_VARIABLES).items(), key=lambda kv: -len(kv[0])):
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
        self.assertRegex(query, r'^label_values\(llmport_agent_build_info\{job=~"\$job"\}, *instance\)$')
        job = variables["job"]
        self.assertEqual((job["type"], job["datasource"]["uid"]), ("query", "${datasource}"))
        query = job["query"]["query"] if isinstance(job["query"], dict) else job["query"]
        self.assertRegex(query, r"^label_values\(llmport_agent_build_info, *job\)$")
        # "All" is the agents' jobs, never every job (no allValue ".*").
        self.assertTrue(job["multi"] and job["includeAll"])
        self.assertIn(job.get("allValue"), (None, ""))
        names = [v["name"] for v in board["templating"]["list"]]
        self.assertLess(names.index("job"), names.index("instance"))  # instance depends on job
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

    def test_every_selector_is_scoped_to_the_agents_job(self) -> None:
        """With Node = All, only the agents' job counts (not Prometheus scraping itself)."""
        for title, expr in dashboard_exprs():
            selectors = Use(grafana_to_promql(expr)).selectors
            self.assertTrue(selectors, title)
            for name, labels in selectors:
                self.assertEqual(labels.get("job"), GRAFANA_VARIABLES["$job"],
                                 f"panel {title!r}: {name} is not filtered by job=~\"$job\"")
        # The check sees an unscoped selector.
        self.assertNotIn("job", Use(grafana_to_promql('sum(up{instance=~"$instance"})')).selectors[0][1])

    def test_every_panel_has_a_description(self) -> None:
        for p in panels(dashboard()):
            if p["type"] != "row":
                self.assertGreater(len(p.get("description", "").strip()), 20, p["title"])

    def test_stat_panels_turn_red_on_a_bad_value(self) -> None:
        """Each stat panel's thresholds colour its bad value red and its good value otherwise."""
        cases = {"Agents up": (0, 3), "Connected to the backend": (0, 3), "GPUs unhealthy": (3, 0),
                 "Engine up": (0, 1), "Event outbox": (5000, 0)}
        stats = {p["title"]: p for p in panels(dashboard()) if p["type"] == "stat"}
        self.assertTrue(set(cases) <= set(stats), sorted(stats))
        for title, p in stats.items():
            defaults = p["fieldConfig"]["defaults"]
            steps = defaults["thresholds"]["steps"]
            self.assertEqual(defaults["thresholds"]["mode"], "absolute", title)
            self.assertEqual(defaults["color"]["mode"], "thresholds", title)
            self.assertIsNone(steps[0]["value"], title)  # the base step
            self.assertIn(p["options"].get("colorMode"), ("background", "value"), title)
            if title in cases:
                bad, good = cases[title]
                self.assertEqual(threshold_colour(steps, bad), "red", f"{title} at {bad}")
                self.assertNotEqual(threshold_colour(steps, good), "red", f"{title} at {good}")
            else:
                self.assertNotIn("red", [s["color"] for s in steps], f"{title}: no bad value, no red")

    def test_the_nodes_table_is_one_merged_table(self) -> None:
        tables = [p for p in panels(dashboard()) if p["title"] == "Nodes"]
        self.assertEqual(len(tables), 1)
        table = tables[0]
        self.assertEqual(table["type"], "table")
        self.assertGreaterEqual(len(table["targets"]), 2)
        for t in table["targets"]:
            self.assertEqual((t.get("format"), t.get("instant")), ("table", True), t["refId"])
            grouping = Use(grafana_to_promql(t["expr"])).grouping
            self.assertTrue({"instance", "job"} <= grouping, t["expr"])  # the columns it merges on
        kinds = [tr["id"] for tr in table.get("transformations", [])]
        self.assertTrue(kinds and kinds[0] in ("merge", "joinByField"), kinds)
        hidden = next(tr for tr in table["transformations"] if tr["id"] == "organize")["options"]["excludeByName"]
        for column in ("Time", "Value #A", "Value #B"):
            self.assertTrue(hidden.get(column), column)

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


def threshold_colour(steps: list[dict[str, Any]], value: float) -> str:
    """The colour Grafana gives C{value}: the last step whose value it reaches (absolute mode)."""
    colour = steps[0]["color"]
    for step in steps[1:]:
        if value >= step["value"]:
            colour = step["color"]
    return str(colour)


class RuleRunbookTests(SynchronousTestCase):
    def test_every_rule_selects_the_agents_job(self) -> None:
        for rule in rules():
            for name, labels in Use(rule["expr"]).selectors:
                self.assertEqual(labels.get("job"), RULES_JOB, f"rule {rule['alert']}: {name} lacks job=\"{RULES_JOB}\"")

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


class _ScrapedAgent(AgentTestCase):
    """A running agent whose /metrics is served."""

    timeout = 120

    async def scrape(self) -> str:
        port = await self.serve_metrics()
        response = await treq.get(f"http://127.0.0.1:{port}/metrics", persistent=False)
        self.assertEqual(response.code, 200)
        text = str(await response.text())
        await deferLater(reactor, 0, lambda: None)
        return text

    async def serve_metrics(self) -> int:
        """A running agent (two fake GPUs, Loki failing, no engine, commands run) and its /metrics port."""
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
        return int(port)


class AgainstARunningAgentTests(_ScrapedAgent):
    """The expressions against the names a running agent exports."""

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


class RealPrometheusTests(_ScrapedAgent):
    """
    A real Prometheus scrapes a running agent (job llmport-agent) and itself (job prometheus, a
    second target with its own up and process_* series). The dashboard's queries, with the
    variables as Grafana fills them when Job and Node are "All", and the rules run there.
    """

    timeout = 120

    async def prometheus(self, agent_port: int) -> str:
        require_package("prometheus", "prometheus", "promtool")
        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        port = free_port()
        config = os.path.join(d, "prometheus.yml")
        with open(config, "w") as f:
            yaml.safe_dump({
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [RULES],
                "scrape_configs": [
                    {"job_name": RULES_JOB, "static_configs": [{"targets": [f"127.0.0.1:{agent_port}"]}]},
                    {"job_name": "prometheus", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]},
                ],
            }, f)
        log = open(os.path.join(d, "prometheus.log"), "wb")
        self.addCleanup(log.close)
        proc = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={os.path.join(d, 'data')}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, cwd=d)

        def stop() -> None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.addCleanup(stop)
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):  # up to 30 s: both targets scraped three times
            if proc.poll() is not None:
                with open(os.path.join(d, "prometheus.log")) as f:
                    self.fail(f"prometheus exited: {f.read()[-2000:]}")
            try:
                got = await self.query(url, "count(count_over_time(up[1m]) >= 3)")
                if got and float(got[0]["value"][1]) == 2:
                    return url
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            await deferLater(reactor, 0.1, lambda: None)
        self.fail("prometheus did not scrape both targets within 30 s")

    async def api(self, url: str) -> Any:
        response = await treq.get(url, persistent=False)
        body = json.loads(await response.text())
        self.assertEqual(body.get("status"), "success", body)
        return body["data"]

    async def query(self, base: str, expr: str) -> list[dict[str, Any]]:
        data = await self.api(f"{base}/api/v1/query?query={quote(expr)}")
        return list(data["result"]) if data["resultType"] == "vector" else [{"value": data["result"]}]

    async def test_queries_count_only_the_agents_job(self) -> None:
        base = await self.prometheus(await self.serve_metrics())
        # The variables as Grafana fills them: Job's values from its query, "All" as their regex;
        # Node = All is ".*".
        jobs = await self.api(f"{base}/api/v1/label/job/values?match[]=llmport_agent_build_info")
        self.assertEqual(jobs, [RULES_JOB])
        variables = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m",
                     "${job}": "(" + "|".join(jobs) + ")", "$job": "(" + "|".join(jobs) + ")",
                     "${instance}": ".*", "$instance": ".*"}
        # A second target is there: unscoped, these count it.
        for unscoped in ("up", "process_resident_memory_bytes", "process_cpu_seconds_total"):
            seen = {r["metric"].get("job") for r in await self.query(base, unscoped)}
            self.assertEqual(seen, {RULES_JOB, "prometheus"}, unscoped)
        problems: list[str] = []
        for title, expr in dashboard_exprs():
            promql = grafana_to_promql(expr, variables)
            await self.query(base, promql)  # evaluates (no many-to-many match, no bad function)
            for selector in selectors_of(promql):
                for series in await self.query(base, selector):
                    if series["metric"].get("job") != RULES_JOB:
                        problems.append(f"panel {title!r}: {selector} returns {series['metric']}")
        self.assertEqual(problems, [])
        agents_up = next(e for t, e in dashboard_exprs() if t == "Agents up")
        self.assertEqual(float((await self.query(base, grafana_to_promql(agents_up, variables)))[0]["value"][1]), 1)
        self.assertEqual(float((await self.query(base, "sum(up)"))[0]["value"][1]), 2)
        # The rules: loaded, every selector returns only the agent's series, evaluated without error.
        for rule in rules():
            for selector in selectors_of(rule["expr"]):
                for series in await self.query(base, selector):
                    self.assertEqual(series["metric"].get("job"), RULES_JOB, (rule["alert"], selector))
        loaded: list[dict[str, Any]] = []
        for _ in range(100):  # every rule evaluated at least once (Prometheus's zero time is 0001-...)
            groups = (await self.api(f"{base}/api/v1/rules"))["groups"]
            loaded = [r for g in groups for r in g["rules"]]
            if loaded and not any(r.get("lastEvaluation", "0001").startswith("0001") for r in loaded):
                break
            await deferLater(reactor, 0.1, lambda: None)
        self.assertEqual(sorted(r["name"] for r in loaded), sorted(r["alert"] for r in rules()))
        self.assertEqual([r["name"] for r in loaded if r["health"] != "ok"], [])
        # The agent's engine is away here: its rule is the one that fires (pending, for 2m).
        active = {r["name"] for r in loaded if r.get("alerts")}
        self.assertIn("LlmportAgentEngineUnreachable", active)
        self.assertNotIn("LlmportAgentDown", active)


def selectors_of(promql: str) -> list[str]:
    """Every vector selector of an expression, as PromQL text (matchers included)."""
    found: list[str] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(str(node))
        return True

    promql_parser.walk(promql_parser.parse(promql), visit)
    return found
