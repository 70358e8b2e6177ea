"""
C{describe_ray_cluster} read from Ray itself: what the agent believes of the inspection
program's output (L{describe.parse_output}: noise, markers, size, depth, types), the
comparison of a candidate with what runs (L{configdiff.compare}), and the program itself
(C{llmport_agent/ray/programs/describe_cluster.py}) run with this machine's python3 against
the project's stand-in C{ray} package (C{tests/support/standin_ray}): members, Serve details,
an LLM server's internal C{LLMConfig} subclass found, an ingress's handles not taken for
configurations, an app llm-port did not deploy listed with no configurations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from llmport_agent.ray import describe
from llmport_agent.ray.configdiff import MAX_DIFFS, compare

NONCE = "0123456789abcdef"
STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support", "standin_ray")
APP = "llmport-e783c0c2"
#: As the backend compiles it (keys it sets only).
CANDIDATE = {
    "model_loading_config": {"model_id": "Qwen2.5-0.5B-Instruct", "model_source": "/models/qwen"},
    "engine_kwargs": {"tool_call_parser": "hermes", "gpu_memory_utilization": 0.8, "enable_auto_tool_choice": True},
    "deployment_config": {"num_replicas": 1},
}
#: As the program dumps it from the running cluster (every field, Ray's defaults filled in).
RUNNING = {
    "model_loading_config": {"model_id": "Qwen2.5-0.5B-Instruct", "model_source": "/models/qwen", "tokenizer_source": None},
    "llm_engine": "vLLM",
    "engine_kwargs": {"tool_call_parser": "hermes", "gpu_memory_utilization": 0.8, "enable_auto_tool_choice": True},
    "deployment_config": {"num_replicas": 1},
    "accelerator_type": None,
    "runtime_env": None,
}
DEFAULTS = ("accelerator_type", "llm_engine", "model_loading_config.tokenizer_source", "runtime_env")


def wrap(doc: Any, nonce: str = NONCE) -> str:
    begin, end = describe.markers(nonce)
    return f"{begin}{json.dumps(doc)}{end}"


class ParseTests(SynchronousTestCase):
    def test_found_among_rays_own_lines(self) -> None:
        noisy = (
            "2026-12-02 INFO worker.py:1 -- Connecting to existing Ray cluster\n"
            '{"attached": false, "nodes": "a line that looks like JSON is not the answer"}\n'
            + wrap({"attached": True, "ray_version": "2.58.0", "nodes": [], "apps": []})
            + "\n(ServeController pid=1) INFO shutting down\n"
        )
        found = describe.parse_output(noisy, NONCE)
        self.assertTrue(found.attached)
        self.assertEqual(describe.parse_output(noisy.encode() + b"\xff\xfe trailing bytes", NONCE), found)
        self.assertEqual(found.ray_version, "2.58.0")

    def test_missing_or_foreign_markers(self) -> None:
        begin, end = describe.markers(NONCE)
        for text, why in (
            ('{"attached": true}', "no begin marker"),
            (begin + '{"attached": true}', "no end marker"),
            (end + '{"attached": true}' + begin, "no end marker"),
            (wrap({"attached": True}, nonce="another"), "no begin marker"),
            ("", "no begin marker"),
        ):
            with self.assertRaises(describe.BadOutput) as cm:
                describe.parse_output(text, NONCE)
            self.assertIn(why, str(cm.exception))

    def test_oversized_output_is_refused(self) -> None:
        text = "x" * describe.MAX_OUTPUT + wrap({"attached": True})
        with self.assertRaises(describe.BadOutput) as cm:
            describe.parse_output(text, NONCE)
        self.assertIn("larger than", str(cm.exception))

    def test_not_json_too_deep_or_not_an_object(self) -> None:
        begin, end = describe.markers(NONCE)
        deep = {"attached": True, "apps": [{"name": "a", "llm_configs": [{}]}]}
        inner: Any = deep["apps"][0]["llm_configs"][0]
        for _ in range(80):
            inner["x"] = {}
            inner = inner["x"]
        for text, why in (
            (begin + "{not json" + end, "not JSON"),
            (begin + "[" * 200_000 + "]" * 200_000 + end, "not JSON"),  # the parser's own recursion limit
            (wrap(deep), "nested more than 64"),
            (wrap([1, 2]), "not an object"),
        ):
            with self.assertRaises(describe.BadOutput) as cm:
                describe.parse_output(text, NONCE)
            self.assertIn(why, str(cm.exception))

    def test_every_field_is_type_checked(self) -> None:
        doc = {
            "attached": "yes",  # only true is true
            "ray_version": 2.58,
            "gcs_address": ["x"],
            "nodes": [
                {"node_id": "h", "ip": "127.0.0.2", "alive": True, "is_head": True, "gpus": 8, "cpus": 2.5},
                {"node_id": 5, "ip": {"x": 1}, "alive": "true", "is_head": 1, "gpus": "8", "cpus": float("nan")},
                "not a node",
            ],
            "serve": {"running": 1, "http_options": {"host": "127.0.0.1", "port": 8000, "nested": {"x": 1}, "list": [1]}},
            "apps": [
                {"name": APP, "deployments": [{"name": "LLMServer", "running_replicas": "1"}, {"status": "x"}],
                 "llm_configs": [RUNNING, "not a config", 7], "defaults": ["not a list of lists"], "errors": [5, "e"]},
                {"route_prefix": "/nameless"},
                {"name": "other", "llm_configs": {"not": "a list"}},
            ],
            "errors": "not a list",
        }
        found = describe.parse_output(wrap(doc), NONCE)
        self.assertFalse(found.attached)
        self.assertIsNone(found.ray_version)
        self.assertIsNone(found.gcs_address)
        self.assertEqual(len(found.nodes), 2)
        good, bad = found.nodes
        self.assertEqual((good["ip"], good["node_ip"], good["is_head"], good["gpus"], good["cpus"]),
                         ("127.0.0.2", "127.0.0.2", True, 8.0, 2.5))
        self.assertEqual((bad["node_id"], bad["ip"], bad["alive"], bad["is_head"], bad["gpus"], bad["cpus"]),
                         (None, None, False, False, 0.0, 0.0))
        self.assertFalse(found.serve_running)
        self.assertEqual(found.http_options, {"host": "127.0.0.1", "port": 8000})
        self.assertEqual([a.name for a in found.apps], [APP, "other"])
        ours, other = found.apps
        self.assertTrue(ours.ours)
        self.assertFalse(other.ours)
        self.assertEqual(ours.llm_configs, (RUNNING,))
        self.assertEqual(ours.defaults, ((),))  # unknown defaults: none assumed
        self.assertEqual([d["name"] for d in ours.deployments], ["LLMServer"])
        self.assertEqual(ours.deployments[0]["running_replicas"], 0)
        self.assertIn("e", ours.errors)
        self.assertTrue(any("left out" in e for e in ours.errors))
        self.assertEqual(other.llm_configs, ())
        self.assertEqual(found.errors, ())

    def test_bounded_lists(self) -> None:
        doc = {"attached": True, "nodes": [{"ip": "127.0.0.1"}] * (describe.MAX_NODES + 10),
               "apps": [{"name": f"a{i}"} for i in range(describe.MAX_APPS + 10)],
               "errors": ["e"] * 1000}
        found = describe.parse_output(wrap(doc), NONCE)
        self.assertEqual(len(found.nodes), describe.MAX_NODES)
        self.assertEqual(len(found.apps), describe.MAX_APPS)
        self.assertEqual(len(found.errors), describe.MAX_ERRORS)

    def test_candidates(self) -> None:
        self.assertEqual(describe.candidates(None), {})
        got = describe.candidates({APP: {"llm_configs": [CANDIDATE]}, "b": {"llm_configs": "x"}, "c": 5, 7: {}})
        self.assertEqual(got[APP], [CANDIDATE])
        self.assertIn("no llm_configs list", got["b"])
        self.assertIn("no llm_configs list", got["c"])
        self.assertNotIn(7, got)


class CompareTests(SynchronousTestCase):
    def test_a_candidate_that_compiles_to_what_runs_is_equal(self) -> None:
        result = compare([RUNNING], [CANDIDATE], [DEFAULTS])
        self.assertEqual(result.as_result(), {"equal": True, "diff": []})

    def test_a_nested_difference_says_where(self) -> None:
        other = {**CANDIDATE, "engine_kwargs": {**CANDIDATE["engine_kwargs"], "tool_call_parser": "llama3_json"}}
        result = compare([RUNNING], [other], [DEFAULTS])
        self.assertEqual(result.as_result(), {"equal": False, "diff": [
            {"path": "llm_configs.0.engine_kwargs.tool_call_parser", "running": "hermes", "candidate": "llama3_json"}]})

    def test_a_key_only_the_running_config_has(self) -> None:
        """A setting that runs but is not in the candidate is a difference, unless Ray filled it in."""
        fewer = {**CANDIDATE, "engine_kwargs": {"gpu_memory_utilization": 0.8, "enable_auto_tool_choice": True}}
        result = compare([RUNNING], [fewer], [DEFAULTS])
        self.assertFalse(result.equal)
        self.assertEqual(list(result.diff), [{"path": "llm_configs.0.engine_kwargs.tool_call_parser",
                                              "running": "hermes", "candidate": None, "absent": "candidate"}])
        # Without the list of defaults, Ray's filled-in fields are differences too (never a guess).
        strict = compare([RUNNING], [CANDIDATE], [])
        self.assertFalse(strict.equal)
        self.assertEqual([d["path"] for d in strict.diff], [
            "llm_configs.0.accelerator_type", "llm_configs.0.llm_engine",
            "llm_configs.0.model_loading_config.tokenizer_source", "llm_configs.0.runtime_env"])

    def test_a_key_only_the_candidate_has(self) -> None:
        more = {**CANDIDATE, "engine_kwargs": {**CANDIDATE["engine_kwargs"], "max_model_len": 4096}}
        result = compare([RUNNING], [more], [DEFAULTS])
        self.assertEqual(list(result.diff), [{"path": "llm_configs.0.engine_kwargs.max_model_len",
                                              "running": None, "candidate": 4096, "absent": "running"}])
        # A default that the candidate sets differently is compared like any key.
        engine = compare([RUNNING], [{**CANDIDATE, "llm_engine": "SGLang"}], [DEFAULTS])
        self.assertEqual([(d["path"], d["running"], d["candidate"]) for d in engine.diff],
                         [("llm_configs.0.llm_engine", "vLLM", "SGLang")])

    def test_list_length_differences(self) -> None:
        result = compare([RUNNING], [CANDIDATE, CANDIDATE], [DEFAULTS])
        self.assertFalse(result.equal)
        self.assertEqual(list(result.diff), [{"path": "llm_configs", "running": 1, "candidate": 2, "length": True}])
        nested_run = {**RUNNING, "runtime_env": {"pip": ["a", "b"]}}
        nested_cand = {**CANDIDATE, "runtime_env": {"pip": ["a"]}}
        result = compare([nested_run], [nested_cand], [DEFAULTS])
        self.assertEqual(list(result.diff), [
            {"path": "llm_configs.0.runtime_env.pip", "running": 2, "candidate": 1, "length": True}])
        self.assertEqual(compare([], [CANDIDATE]).as_result()["diff"][0]["path"], "llm_configs")

    def test_strict_types(self) -> None:
        def one(running: Any, candidate: Any) -> bool | None:
            return compare([{"v": running}], [{"v": candidate}]).equal

        self.assertFalse(one(0.8, "0.8"))
        self.assertFalse(one(True, 1))
        self.assertFalse(one(0, False))
        self.assertFalse(one(None, 0))
        self.assertFalse(one({"a": 1}, [["a", 1]]))
        self.assertFalse(one("1", 1))
        self.assertTrue(one(1, 1.0))  # JSON does not tell them apart
        self.assertTrue(one(None, None))
        self.assertTrue(one([1, "a", None], [1, "a", None]))

    def test_deterministic_order(self) -> None:
        a = {"z": 1, "b": {"y": 1, "c": 1}, "a": 1}
        b = {"a": 2, "z": 2, "b": {"c": 2, "y": 2}}
        paths = [d["path"] for d in compare([a], [b]).diff]
        self.assertEqual(paths, ["llm_configs.0.a", "llm_configs.0.b.c", "llm_configs.0.b.y", "llm_configs.0.z"])
        again = [d["path"] for d in compare([dict(reversed(list(a.items())))], [b]).diff]
        self.assertEqual(again, paths)

    def test_bounds(self) -> None:
        many_a = {f"k{i:03}": i for i in range(200)}
        many_b = {f"k{i:03}": -i - 1 for i in range(200)}
        result = compare([many_a], [many_b])
        self.assertFalse(result.equal)
        self.assertEqual(len(result.diff), MAX_DIFFS)
        self.assertTrue(result.as_result()["diff_truncated"])
        self.assertEqual(result.diff[0]["path"], "llm_configs.0.k000")
        deep: Any = {}
        inner = deep
        for _ in range(40):
            inner["x"] = {}
            inner = inner["x"]
        self.assertEqual(compare([deep], [deep]).as_result()["equal"], None)
        self.assertIn("nested more than", compare([deep], [deep]).explanation or "")
        big = [list(range(2000))] * 60
        result = compare(big, big, max_values=50_000)
        self.assertIsNone(result.equal)
        self.assertIsNone(result.as_result()["diff"])
        self.assertIn("too large", result.explanation or "")
        self.assertIsNone(compare("x", [CANDIDATE]).equal)  # type: ignore[arg-type]

    def test_a_shown_value_is_bounded(self) -> None:
        result = compare([{"v": "x" * 10_000, "w": {str(i): i for i in range(1000)}}], [{"v": "y", "w": 1}])
        shown = {d["path"]: d["running"] for d in result.diff}
        self.assertLess(len(shown["llm_configs.0.v"]), 600)
        self.assertEqual(shown["llm_configs.0.w"], "<object with 1000 items>")


class ProgramTests(SynchronousTestCase):
    """The program itself, in a python3 subprocess, against the stand-in ray package."""

    def setUp(self) -> None:
        try:
            import pydantic  # noqa: F401
        except ImportError:
            raise SkipTest("needs pydantic (Ray's LLMConfig is a pydantic model): pip install -e '.[dev]'") from None

    def run_program(self, scenario: dict[str, Any], pythonpath: str = STANDIN) -> describe.Inspection:
        path = os.path.abspath(self.mktemp())
        with open(path, "w", encoding="utf-8") as f:
            json.dump(scenario, f)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": pythonpath,
               "STANDIN_RAY_SCENARIO": path, **describe.program_env(NONCE)}
        proc = subprocess.run([sys.executable, "-"], input=describe.program(), capture_output=True,
                              env=env, check=False, timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stderr.decode()[-2000:])
        return describe.parse_output(proc.stdout, NONCE)

    def scenario(self, **over: Any) -> dict[str, Any]:
        s: dict[str, Any] = {
            "gcs_address": "127.0.0.2:6379",
            "nodes": [
                {"NodeID": "h", "NodeManagerAddress": "127.0.0.2", "NodeManagerHostname": "head", "Alive": True,
                 "Resources": {"CPU": 4.0, "GPU": 1.0, "node:__internal_head__": 1.0}},
                {"NodeID": "w", "NodeManagerAddress": "127.0.0.3", "NodeManagerHostname": "worker", "Alive": True,
                 "Resources": {"CPU": 4.0, "GPU": 1.0}},
            ],
            "apps": {
                APP: {"deployments": {"LLMServer:qwen": {"llm_config": CANDIDATE}, "OpenAiIngress": {}}},
                "someone-elses-app": {"route_prefix": "/x", "deployments": {"LLMServer:z": {"llm_config": CANDIDATE}}},
                "team-llmport-app": {"route_prefix": "/t", "deployments": {"LLMServer:t": {"llm_config": CANDIDATE}}},
            },
        }
        s.update(over)
        return s

    def test_reads_members_and_each_apps_configuration(self) -> None:
        found = self.run_program(self.scenario())
        self.assertTrue(found.attached)
        self.assertEqual(found.errors, ())
        self.assertEqual((found.ray_version, found.gcs_address), ("2.58.0", "127.0.0.2:6379"))
        self.assertEqual([(n["ip"], n["is_head"], n["hostname"]) for n in found.nodes],
                         [("127.0.0.2", True, "head"), ("127.0.0.3", False, "worker")])
        self.assertTrue(found.serve_running)
        self.assertEqual(found.http_options, {"host": "127.0.0.1", "port": 8000})
        apps = {a.name: a for a in found.apps}
        ours = apps[APP]
        self.assertEqual(ours.errors, ())
        self.assertEqual(len(ours.llm_configs), 1, "the ingress's handles are not taken for configurations")
        self.assertEqual(ours.llm_configs[0]["engine_kwargs"]["tool_call_parser"], "hermes")
        self.assertEqual(ours.llm_configs[0]["llm_engine"], "vLLM")
        self.assertIn("llm_engine", ours.defaults[0])
        self.assertIn("model_loading_config.tokenizer_source", ours.defaults[0])
        self.assertNotIn("engine_kwargs", ours.defaults[0])
        self.assertEqual([d["name"] for d in ours.deployments], ["LLMServer:qwen", "OpenAiIngress"])
        self.assertEqual(ours.deployments[0]["running_replicas"], 1)
        other = apps["someone-elses-app"]
        self.assertEqual((other.llm_configs, other.route_prefix), ((), "/x"), "an app llm-port did not deploy is listed, not read")
        # A name that merely contains llmport- is not llm-port's: only a name starting with it.
        contains = apps["team-llmport-app"]
        self.assertEqual((contains.llm_configs, contains.ours), ((), False))

    def test_what_it_reads_compares_with_the_backends_candidate(self) -> None:
        ours = next(a for a in self.run_program(self.scenario()).apps if a.name == APP)
        self.assertEqual(compare(list(ours.llm_configs), [CANDIDATE], ours.defaults).as_result(),
                         {"equal": True, "diff": []})
        other = {**CANDIDATE, "engine_kwargs": {**CANDIDATE["engine_kwargs"], "tool_call_parser": "llama3_json"}}
        self.assertEqual([d["path"] for d in compare(list(ours.llm_configs), [other], ours.defaults).diff],
                         ["llm_configs.0.engine_kwargs.tool_call_parser"])

    def test_no_cluster_no_serve_and_a_failing_deployment(self) -> None:
        found = self.run_program(self.scenario(attach_error="Could not find any running Ray instance."))
        self.assertFalse(found.attached)
        self.assertTrue(found.ray_importable)
        self.assertIn("Could not find any running Ray instance", found.errors[0])
        found = self.run_program(self.scenario(serve_running=False))
        self.assertTrue(found.attached)
        self.assertEqual((found.serve_running, found.apps), (False, ()))
        broken = self.scenario()
        broken["apps"][APP]["deployments"]["LLMServer:qwen"]["error"] = "controller gone"
        ours = next(a for a in self.run_program(broken).apps if a.name == APP)
        self.assertEqual(ours.llm_configs, ())
        self.assertIn("controller gone", ours.errors[0])

    def test_without_ray(self) -> None:
        found = self.run_program(self.scenario(), pythonpath=os.path.abspath(self.mktemp()))
        self.assertFalse(found.ray_importable)
        self.assertFalse(found.attached)
        self.assertIn("import ray", found.errors[0])
