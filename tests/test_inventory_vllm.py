"""
Tests for the engine sections of the inventory (protocol 10.5): C{vllm_containers}
(L{llmport_agent.inventory.vllm}), C{ray_runtime} (L{llmport_agent.inventory.rayruntime}),
their wiring (L{llmport_agent.inventory.sections}) and the collector's C{sections} and
C{paths}; unit fixtures of C{docker inspect} answers, then the real Docker engine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmport_agent.inventory.collector import InventoryCollector, assert_no_nulls
from llmport_agent.inventory.gpu import NoGPUSource
from llmport_agent.inventory.rayruntime import RAY_RUNTIME_CONTAINER, describe_ray_runtime
from llmport_agent.inventory.sections import inventory_sections
from llmport_agent.inventory.vllm import (
    MAX_ARG_CHARS,
    MAX_ARGS,
    MAX_ARGS_TOTAL,
    describe,
    discover_vllm,
    looks_like_vllm,
    parse_args,
    redact,
)
from llmport_agent.ray.container import LABEL_RAY, RAY_VALUE, snapshot
from llmport_agent.workloads.spec import LABEL_AGENT_ID, LABEL_MANAGED, MANAGED_VALUE

AGENT = "gpu-node-7"
#: How the agent marks its Ray runtime container (llmport_agent.ray.container).
RAY_LABELS = {LABEL_RAY: RAY_VALUE, LABEL_AGENT_ID: AGENT}

SECRET = "sk-live-THE-SECRET-0123456789"
HF = "hf_THE_HF_TOKEN_abcdef"


def inspect_answer(
    name: str = "qwen-chat",
    *,
    entrypoint: list[str] | None = None,
    cmd: list[str] | None = None,
    image: str = "vllm/vllm-openai:v0.11.0",
    labels: dict[str, str] | None = None,
    network: str = "bridge",
    ports: dict[str, Any] | None = None,
    status: str = "running",
) -> dict[str, Any]:
    """A C{docker inspect} answer shaped like the engine's (API 1.41)."""
    return {
        "Id": "4f9c1e2d3b4a5f6e7d8c9b0a1f2e3d4c5b6a7f8e9d0c1b2a3f4e5d6c7b8a9f0e",
        "Name": f"/{name}",
        "Image": "sha256:" + "ab" * 32,
        "State": {"Status": status, "Running": status == "running", "ExitCode": 0,
                  "StartedAt": "2026-11-30T09:00:00.123456789Z",
                  "FinishedAt": "0001-01-01T00:00:00Z"},
        "Config": {
            "Image": image,
            "Entrypoint": entrypoint if entrypoint is not None else ["python3", "-m", "vllm.entrypoints.openai.api_server"],
            "Cmd": cmd if cmd is not None else ["--model", "Qwen/Qwen3-8B", "--port", "8000"],
            "Env": [f"HF_TOKEN={HF}", f"VLLM_API_KEY={SECRET}", "PATH=/usr/bin"],
            "Labels": labels or {},
        },
        "HostConfig": {
            "NetworkMode": network,
            "RestartPolicy": {"Name": "unless-stopped", "MaximumRetryCount": 0},
            "PortBindings": ports or {"8000/tcp": [{"HostIp": "", "HostPort": "18000"}]},
            "DeviceRequests": [{"Driver": "", "Count": -1, "DeviceIDs": None,
                                "Capabilities": [["gpu"]], "Options": {}}],
        },
        "NetworkSettings": {"Ports": {"8000/tcp": [{"HostIp": "0.0.0.0", "HostPort": "18000"}]}},
        "Mounts": [{"Type": "bind", "Source": "/srv/hf", "Destination": "/root/.cache/huggingface",
                    "Mode": "", "RW": True}],
    }


class RedactTests(SynchronousTestCase):
    """Secret-looking flag values never leave."""

    def test_both_forms(self) -> None:
        """--api-key X and --api-key=X, and any flag naming token/secret/password/key."""
        args = ["--model", "m", "--api-key", SECRET, f"--api-key={SECRET}", "--hf-token", HF,
                f"--ssl-keyfile=/k/{SECRET}", "--db-password", "pw", "--client-secret=s3"]
        out = redact(args)
        self.assertEqual(out, ["--model", "m", "--api-key", "***", "--api-key=***", "--hf-token", "***",
                               "--ssl-keyfile=***", "--db-password", "***", "--client-secret=***"])
        self.assertNotIn(SECRET, json.dumps(out))

    def test_flag_after_secret_flag_is_kept_and_checked(self) -> None:
        """A bare secret flag followed by another flag hides nothing of it; that flag is checked itself."""
        self.assertEqual(redact(["--api-key", "--port", "8000"]), ["--api-key", "--port", "8000"])
        self.assertEqual(redact(["--api-key", "--token", "t", "x"]), ["--api-key", "--token", "***", "x"])
        self.assertEqual(redact(["--api-key", "-dash-leading-key"]), ["--api-key", "***"])

    def test_case_insensitive(self) -> None:
        """--API-KEY is a secret too."""
        self.assertEqual(redact(["--API-KEY", "v"]), ["--API-KEY", "***"])


class ParseTests(SynchronousTestCase):
    """What a vLLM command line says."""

    def test_settings_and_task(self) -> None:
        """Model, names, port, host, task from flags, the 8 settings typed."""
        parsed = parse_args([
            "Qwen/Qwen3-Embedding-0.6B", "--served-model-name", "emb", "emb2", "--port", "9001",
            "--host", "0.0.0.0", "--task", "embed", "-tp", "2", "--pipeline-parallel-size=1",
            "--max-model-len", "8192", "--dtype", "bfloat16", "--quantization", "fp8",
            "--gpu-memory-utilization", "0.85", "--kv-cache-dtype", "fp8_e5m2", "--max-num-seqs", "64",
            "--enforce-eager", "--api-key", "",
        ])
        self.assertEqual(parsed["model"], "Qwen/Qwen3-Embedding-0.6B")
        self.assertEqual(parsed["served_model_names"], ["emb", "emb2"])
        self.assertEqual((parsed["port"], parsed["host"]), (9001, "0.0.0.0"))
        self.assertEqual((parsed["task"], parsed["task_from"]), ("embeddings", "flags"))
        self.assertIs(parsed["api_key_required"], False)
        self.assertEqual(parsed["settings"], {
            "tensor_parallel_size": 2, "pipeline_parallel_size": 1, "max_model_len": 8192,
            "dtype": "bfloat16", "quantization": "fp8", "gpu_memory_utilization": 0.85,
            "kv_cache_dtype": "fp8_e5m2", "max_num_seqs": 64,
        })

    def test_task_from_name_and_defaults(self) -> None:
        """No --task: a reranker's name says scoring (task_from name); port defaults to 8000."""
        parsed = parse_args(["--model", "BAAI/bge-reranker-v2-m3", "--api-key", "k", "--max-model-len", "x"])
        self.assertEqual((parsed["task"], parsed["task_from"]), ("scoring", "name"))
        self.assertEqual(parsed["port"], 8000)
        self.assertIs(parsed["api_key_required"], True)
        self.assertEqual(parsed["settings"], {})  # "x" is no integer
        self.assertEqual(parsed["served_model_names"], ["BAAI/bge-reranker-v2-m3"])


class DescribeTests(SynchronousTestCase):
    """One inspected container as the backend reads it."""

    def test_fields(self) -> None:
        """Every 10.5 field from a container started by hand; env never read; secrets starred."""
        info = inspect_answer(cmd=["--model", "Qwen/Qwen3-8B", "--api-key", SECRET, "--port", "8000"],
                              labels={"spark.llm": "true", "org.opencontainers.image.version": "1",
                                      "owner.api_token": SECRET})
        d = describe(info)
        assert d is not None
        self.assertEqual(d["name"], "qwen-chat")
        self.assertEqual(d["id"], info["Id"][:12])
        self.assertEqual(d["image"], "vllm/vllm-openai:v0.11.0")
        self.assertEqual((d["state"], d["exit_code"]), ("running", 0))
        self.assertEqual(d["started_at"], "2026-11-30T09:00:00.123456789Z")
        self.assertEqual((d["restart_policy"], d["network_mode"]), ("unless-stopped", "bridge"))
        self.assertEqual((d["host_port"], d["port"], d["gpus"]), (18000, 8000, "all"))
        self.assertEqual(d["managed_by"], "owner")
        self.assertEqual(d["labels"], {"owner.api_token": "***", "spark.llm": "true"})
        self.assertEqual(d["mounts"], [{"source": "/srv/hf", "destination": "/root/.cache/huggingface"}])
        self.assertEqual(d["args"], ["--model", "Qwen/Qwen3-8B", "--api-key", "***", "--port", "8000"])
        self.assertEqual(d["model"], "Qwen/Qwen3-8B")
        self.assertNotIn("task", d)  # neither the flags nor the name say
        self.assertIs(d["api_key_required"], True)
        text = json.dumps(d)
        for secret in (SECRET, HF, "VLLM_API_KEY", "HF_TOKEN"):
            self.assertNotIn(secret, text)
        assert_no_nulls(d)

    def test_forms_of_command(self) -> None:
        """vllm serve, sh -c "vllm serve ...", flags to the image's entrypoint; not: sleep, other images."""
        serve = describe(inspect_answer(entrypoint=[], cmd=["vllm", "serve", "m1", "--port", "8100"],
                                        image="custom/image:1"))
        assert serve is not None
        self.assertEqual((serve["model"], serve["port"]), ("m1", 8100))
        shell = describe(inspect_answer(entrypoint=["/bin/sh", "-c"], image="ubuntu:24.04",
                                        cmd=[f"HF_TOKEN={HF} vllm serve m2 --api-key={SECRET}"]))
        assert shell is not None
        self.assertEqual(shell["args"], ["m2", "--api-key=***"])
        self.assertNotIn(HF, json.dumps(shell))
        self.assertIsNone(describe(inspect_answer(entrypoint=[], cmd=["sleep", "infinity"])))
        self.assertIsNone(describe(inspect_answer(entrypoint=["nginx"], cmd=["-g", "daemon off;"],
                                                  image="nginx:1")))

    def test_host_network_port(self) -> None:
        """Host networking: the host port is vLLM's own port."""
        d = describe(inspect_answer(network="host", cmd=["--model", "m", "--port", "8123"], ports={}))
        assert d is not None
        self.assertEqual(d["host_port"], 8123)

    def test_own_containers_skipped(self) -> None:
        """llm-port-* names and the agent's label are llm-port's own: not described, not listed."""
        self.assertIsNone(describe(inspect_answer(name="llm-port-qwen")))
        self.assertIsNone(describe(inspect_answer(labels={LABEL_MANAGED: MANAGED_VALUE})))
        self.assertFalse(looks_like_vllm({"Names": ["/llm-port-x"], "Image": "vllm/vllm-openai"}))
        self.assertFalse(looks_like_vllm({"Names": ["/x"], "Image": "vllm/vllm-openai",
                                          "Labels": {LABEL_MANAGED: MANAGED_VALUE}}))
        self.assertTrue(looks_like_vllm({"Names": ["/x"], "Image": "busybox", "Command": "sh -c 'vllm serve m'"}))
        self.assertFalse(looks_like_vllm({"Names": ["/x"], "Image": "busybox", "Command": "sleep 1"}))

    def test_args_bounded(self) -> None:
        """Thousands of arguments, megabyte arguments: at most MAX_ARGS of MAX_ARG_CHARS reported."""
        cmd = ["--model", "m", "--x", "y" * 1_000_000] + [f"--f{i}={'v' * 300}" for i in range(5000)]
        d = describe(inspect_answer(cmd=cmd))
        assert d is not None
        self.assertLessEqual(len(d["args"]), MAX_ARGS)
        self.assertLessEqual(max(len(a) for a in d["args"]), MAX_ARG_CHARS)
        self.assertLessEqual(sum(len(a) for a in d["args"]), MAX_ARGS_TOTAL)
        self.assertEqual(d["args"][:3], ["--model", "m", "--x"])
        self.assertLess(len(json.dumps(d)), 20_000)

    def test_hostile_shapes(self) -> None:
        """Wrong types anywhere are tolerated (no exception), junk is skipped."""
        for bad in ({}, {"Config": []}, {"Name": 5, "Config": {"Cmd": "vllm serve"}},
                    {"Name": "/a", "Config": {"Image": "vllm", "Cmd": ["--model", "m"], "Labels": []},
                     "State": "x", "HostConfig": {"DeviceRequests": "x", "RestartPolicy": None},
                     "Mounts": "x"}):
            try:
                describe(bad)
            except Exception as e:  # pragma: no cover - the failure message
                self.fail(f"{bad!r}: {e!r}")


class FakeAPI:
    """docker-py's low-level API, enough for discover_vllm: containers() and inspect_container()."""

    def __init__(self, infos: list[dict[str, Any]], on_inspect: Callable[[], None] | None = None) -> None:
        self.infos = {i["Id"]: i for i in infos}
        self.inspected: list[str] = []
        self.on_inspect = on_inspect

    def containers(self, all: bool = False) -> list[dict[str, Any]]:
        assert all, "stopped containers are reported too"
        return [{"Id": i["Id"], "Names": [i["Name"]], "Image": i["Config"]["Image"],
                 "Command": " ".join(i["Config"]["Entrypoint"] + i["Config"]["Cmd"]),
                 "Labels": i["Config"]["Labels"]} for i in self.infos.values()]

    def inspect_container(self, cid: str) -> dict[str, Any]:
        self.inspected.append(cid)
        if self.on_inspect is not None:
            self.on_inspect()
        if cid not in self.infos:
            from docker.errors import NotFound

            raise NotFound(f"No such container: {cid}")
        return self.infos[cid]


class FakeClient:
    def __init__(self, api: FakeAPI) -> None:
        self.api = api


def many(n: int, **kw: Any) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        info = inspect_answer(name=f"v{i}", **kw)
        info["Id"] = f"{i:064x}"
        out.append(info)
    return out


class DiscoverTests(SynchronousTestCase):
    """The thread function's bounds."""

    def test_at_most_fifty(self) -> None:
        """80 vLLM containers: 50 described, and no inspect after the 50th."""
        api = FakeAPI(many(80))
        found = discover_vllm(FakeClient(api))
        self.assertEqual(len(found), 50)
        self.assertEqual(len(api.inspected), 50)

    def test_time_budget(self) -> None:
        """Inspects stop once the budget is spent (each takes 1 s on this clock)."""
        now = [0.0]
        api = FakeAPI(many(10), on_inspect=lambda: now.__setitem__(0, now[0] + 1.0))
        found = discover_vllm(FakeClient(api), budget=3.5, clock=lambda: now[0])
        self.assertEqual(len(found), 4)

    def test_only_candidates_inspected(self) -> None:
        """Containers that are not vLLM, or are llm-port's, are never inspected."""
        infos = many(2)
        other = inspect_answer(name="web", entrypoint=["nginx"], cmd=[], image="nginx:1")
        other["Id"] = "f" * 64
        ours = inspect_answer(name="llm-port-qwen")
        ours["Id"] = "e" * 64
        api = FakeAPI([*infos, other, ours])
        self.assertEqual([d["name"] for d in discover_vllm(FakeClient(api))], ["v0", "v1"])
        self.assertEqual(sorted(api.inspected), sorted(i["Id"] for i in infos))


class RayRuntimeTests(SynchronousTestCase):
    """The ray_runtime object."""

    def test_ours(self) -> None:
        """The agent's labelled container: {container, running, started_at, image, image_id}."""
        info = inspect_answer(name=RAY_RUNTIME_CONTAINER, image="llm-port/ray-runtime@sha256:" + "cd" * 32,
                              labels=RAY_LABELS)
        r = describe_ray_runtime(snapshot(info), AGENT)
        self.assertEqual(r, {"container": RAY_RUNTIME_CONTAINER, "running": True, "state": "running",
                             "started_at": "2026-11-30T09:00:00.123456789Z",
                             "image": "llm-port/ray-runtime@sha256:" + "cd" * 32,
                             "image_id": "sha256:" + "ab" * 32})

    def test_not_ours(self) -> None:
        """A container of that name without the agent's label is not reported."""
        self.assertIsNone(describe_ray_runtime(snapshot(inspect_answer(name=RAY_RUNTIME_CONTAINER)), AGENT))
        # the workloads' label is not the Ray runtime's; another agent's Ray label is not this one's
        managed = inspect_answer(name=RAY_RUNTIME_CONTAINER, labels={LABEL_MANAGED: MANAGED_VALUE})
        self.assertIsNone(describe_ray_runtime(snapshot(managed), AGENT))
        other = inspect_answer(name=RAY_RUNTIME_CONTAINER, labels={LABEL_RAY: RAY_VALUE, LABEL_AGENT_ID: "x"})
        self.assertIsNone(describe_ray_runtime(snapshot(other), AGENT))


class StubEngine:
    """DockerEngine.call's contract, calling the thread function at once with a fake client."""

    def __init__(self, client: Any, available: bool = True) -> None:
        self.client = client
        self.available = available
        self.calls: list[str] = []
        self.pending: Deferred[Any] | None = None

    async def call(self, fn: Callable[..., Any], *args: Any, what: str | None = None) -> Any:
        self.calls.append(fn.__name__)
        if self.pending is not None:
            return await self.pending
        return fn(self.client, *args)


class SyncRunner:
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Deferred[Any]:
        return defer.maybeDeferred(fn, *args, **kwargs)


class CollectorSectionTests(SynchronousTestCase):
    """The collector puts the sections and the paths into what it reports."""

    def make(self, engine: Any, **kw: Any) -> InventoryCollector:
        self.clock = Clock()
        state = self.mktemp()
        os.makedirs(state)
        runner = SyncRunner()
        return InventoryCollector(
            self.clock, runner, NoGPUSource(), state_dir=state, model_store=None,
            sections=inventory_sections(runner, engine, agent_id=AGENT, sysfs_root=os.path.join(
                os.path.dirname(__file__), "data", "sysfs", "gpu-node")),
            paths={"model_store": "/srv/llm-port/models", "ray_session": "/var/lib/llm-port/ray"},
            **kw,
        )

    def test_sections_in_inventory(self) -> None:
        """network, vllm_containers, ray_runtime in the inventory; paths in static capabilities."""
        ray = inspect_answer(name=RAY_RUNTIME_CONTAINER, labels=RAY_LABELS)
        ray["Id"] = "9" * 64
        api = FakeAPI([*many(2), ray])
        api.infos[RAY_RUNTIME_CONTAINER] = ray
        collector = self.make(StubEngine(FakeClient(api)))
        report = self.successResultOf(Deferred.fromCoroutine(collector.collect()))
        inv = report.inventory
        self.assertIn("fabrics", inv["network"])
        self.assertEqual([c["name"] for c in inv["vllm_containers"]], ["v0", "v1"])
        self.assertEqual(inv["ray_runtime"]["container"], RAY_RUNTIME_CONTAINER)
        paths = {"model_store": "/srv/llm-port/models", "ray_session": "/var/lib/llm-port/ray"}
        self.assertEqual(inv["static_capabilities"]["paths"], paths)
        self.assertEqual(collector.last_capabilities()["paths"], paths)
        self.assertNotIn("network", collector.last_capabilities())  # heartbeats unchanged
        assert_no_nulls(inv)

    def test_engine_down_no_call(self) -> None:
        """Engine unavailable: no engine call; the engine sections are absent, network still there."""
        engine = StubEngine(FakeClient(FakeAPI([])), available=False)
        report = self.successResultOf(Deferred.fromCoroutine(self.make(engine).collect()))
        self.assertEqual(engine.calls, [])
        self.assertNotIn("vllm_containers", report.inventory)
        self.assertNotIn("ray_runtime", report.inventory)
        self.assertIn("network", report.inventory)

    def test_hung_engine_cut_off(self) -> None:
        """An engine call that never answers: the report comes after the section deadline without it."""
        engine = StubEngine(FakeClient(FakeAPI([])))
        engine.pending = Deferred()
        collector = self.make(engine, section_timeout=5.0)
        d = Deferred.fromCoroutine(collector.collect())
        self.assertNoResult(d)
        self.clock.advance(5.0)
        report = self.successResultOf(d)
        self.assertNotIn("vllm_containers", report.inventory)
        self.assertIn("network", report.inventory)
        self.flushLoggedErrors()

    def test_failing_section_logged_once(self) -> None:
        """A section that raises is left out and said once, not at every report."""
        from twisted.logger import globalLogPublisher

        seen: list[str] = []

        def observer(event: dict[str, Any]) -> None:
            if event.get("section") == "vllm_containers":
                seen.append(str(event.get("log_format")))

        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)

        class Boom(FakeAPI):
            def containers(self, all: bool = False) -> list[dict[str, Any]]:
                raise RuntimeError("engine says no")

        collector = self.make(StubEngine(FakeClient(Boom([]))))
        for _ in range(3):
            report = self.successResultOf(Deferred.fromCoroutine(collector.collect()))
            self.assertNotIn("vllm_containers", report.inventory)
        self.assertEqual(len(seen), 1)


class RealEngineTests(TestCase):
    """vLLM discovery and the Ray runtime on the real Docker engine (busybox containers)."""

    timeout = 120

    async def setUp(self) -> None:
        from twisted.internet import reactor

        from llmport_agent.workloads.engine import DockerEngine
        from tests.support.docker_env import BUSYBOX, require_docker

        self.env = require_docker()
        self.env.ensure_busybox()
        self.busybox = BUSYBOX
        self.engine = DockerEngine(reactor, environ={"DOCKER_HOST": self.env.host}, probe_max=1.0)
        self.engine.startService()
        self.addCleanup(self.engine.stopService)
        await self.engine.whenAvailable()

    def make_container(self, name: str, command: list[str], labels: dict[str, str] | None = None,
                       start: bool = True) -> Any:
        client = self.env.client()
        c = client.containers.create(self.busybox, command, name=name, labels=labels or {},
                                     environment={"HF_TOKEN": HF, "VLLM_API_KEY": SECRET},
                                     network_mode="none")
        self.addCleanup(self.remove, c)
        if start:
            c.start()
        return c

    def remove(self, c: Any) -> None:
        import docker

        try:
            c.remove(force=True)
        except docker.errors.NotFound:
            pass

    async def test_discovery(self) -> None:
        """A busybox 'vllm' started by hand is found, env unread, key starred; ours and others are not."""
        script = f"exec sleep 300 # vllm serve Qwen/Qwen3-8B --port 8011 --api-key {SECRET}"
        self.make_container("by-hand-vllm", ["sh", "-c", script])
        self.make_container("stopped-vllm", ["/bin/busybox", "vllm", "serve", "m2", f"--api-key={SECRET}"], start=False)
        self.make_container("llm-port-managed", ["sh", "-c", "sleep 300 # vllm serve x"])
        self.make_container("labelled", ["sh", "-c", "sleep 300 # vllm serve y"], labels={LABEL_MANAGED: MANAGED_VALUE})
        self.make_container("plain", ["sleep", "300"])
        found = await self.engine.call(discover_vllm, what="listing vLLM containers")
        by = {c["name"]: c for c in found}
        self.assertEqual(sorted(by), ["by-hand-vllm", "stopped-vllm"])
        hand = by["by-hand-vllm"]
        self.assertEqual(hand["state"], "running")
        self.assertEqual((hand["model"], hand["port"]), ("Qwen/Qwen3-8B", 8011))
        self.assertIn("--api-key", hand["args"])
        self.assertEqual(hand["args"][hand["args"].index("--api-key") + 1], "***")
        self.assertEqual(by["stopped-vllm"]["state"], "created")
        self.assertEqual(by["stopped-vllm"]["args"], ["m2", "--api-key=***"])
        text = json.dumps(found)
        for secret in (SECRET, HF, "VLLM_API_KEY"):
            self.assertNotIn(secret, text)
        assert_no_nulls(found)

    async def test_ray_runtime(self) -> None:
        """No container: None; the agent's labelled one: reported with its state and image id."""
        from llmport_agent.inventory.rayruntime import inspect_ray_runtime

        self.assertIsNone(await self.engine.call(inspect_ray_runtime, AGENT))
        c = self.make_container(RAY_RUNTIME_CONTAINER, ["sleep", "300"], labels=RAY_LABELS)
        r = await self.engine.call(inspect_ray_runtime, AGENT)
        self.assertEqual((r["container"], r["running"], r["image"]), (RAY_RUNTIME_CONTAINER, True, self.busybox))
        self.assertEqual(r["image_id"], c.attrs["Image"])
        c.remove(force=True)
        self.make_container(RAY_RUNTIME_CONTAINER, ["sleep", "300"])  # the same name, not ours
        self.assertIsNone(await self.engine.call(inspect_ray_runtime, AGENT))
