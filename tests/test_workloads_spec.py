"""Pure unit tests: deploy payload -> container spec, local policy, value validation."""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.base import INVALID_COMMAND, POLICY_VIOLATION, CommandFailed
from llmport_agent.workloads.handlers import merge_log_lines, parse_tail
from llmport_agent.workloads.images import PullProgress
from llmport_agent.workloads.policy import (
    PolicyError,
    image_allowed,
    parse_allowlist,
    parse_bytes,
    parse_cpus,
    parse_image_ref,
    parse_port,
)
from llmport_agent.workloads.ports import choose_host_port
from llmport_agent.workloads.settings import WorkloadSettings
from llmport_agent.workloads.spec import (
    LABEL_AGENT_ID,
    LABEL_COMMAND_ID,
    LABEL_CONTAINER_PORT,
    LABEL_HOST_PORT,
    LABEL_MANAGED,
    LABEL_PROVIDER,
    LABEL_RUNTIME_ID,
    build_spec,
    endpoint_url,
    render,
    slug_container_name,
)

RID = "6f1c3f5e-8a51-4c51-9a43-0d8c3f7a1b22"


def payload(**over: Any) -> dict[str, Any]:
    """A deploy payload shaped like the backend's, with empty-string defaults."""
    base: dict[str, Any] = {
        "runtime_id": RID,
        "runtime_name": "Llama 3 8B",
        "container_name": "",
        "provider_id": "p1",
        "provider_type": "vllm",
        "model_id": "m1",
        "generic_config": {"model": "meta-llama/Llama-3-8B"},
        "provider_config": {},
        "openai_compat": True,
        "model_sync": None,
        "image_source": None,
        # Left out (null): the provider's default applies; "" would mean "no GPU" (10.4).
        "gpu_request": None,
        "ipc_mode": "",
        "shm_size": "",
        "memory_limit": "",
        "cpu_limit": "",
        "container_port": "",
        "placement_hints": {},
    }
    for key, value in over.items():
        base[key] = value
    return base


SETTINGS = WorkloadSettings(agent_id="node-1", advertise_host="10.0.0.5", model_store="/srv/models")


def spec_of(p: dict[str, Any], settings: WorkloadSettings = SETTINGS, allow: str = "") -> Any:
    return build_spec(p, settings, parse_allowlist(allow))


class ImageRefTests(SynchronousTestCase):
    """Image references parse the way the engine parses them."""

    def test_hub_defaults(self) -> None:
        """A bare name is docker.io/library/<name> with tag latest."""
        ref = parse_image_ref("busybox")
        self.assertEqual(ref.registry, "docker.io")
        self.assertEqual(ref.path, ("library", "busybox"))
        self.assertEqual(ref.canonical, "busybox:latest")

    def test_registry_port_tag_digest(self) -> None:
        """Registry with port, nested path, tag and digest are all recognised."""
        digest = "sha256:" + "a" * 64
        ref = parse_image_ref(f"127.0.0.1:5000/org/team/img:v1@{digest}")
        self.assertEqual(ref.registry, "127.0.0.1:5000")
        self.assertEqual(ref.path, ("org", "team", "img"))
        self.assertEqual(ref.tag, "v1")
        self.assertEqual(ref.digest, digest)

    def test_malformed(self) -> None:
        """Upper case paths, bad tags, bad digests and blanks are refused with the field named."""
        for bad in ("Ubuntu/Thing", "img:", "img@sha256:xyz", "", "a b", "img:bad/tag"):
            with self.assertRaises(PolicyError) as cm:
                parse_image_ref(bad)
            self.assertIn("image", str(cm.exception))


class AllowlistTests(SynchronousTestCase):
    """IMAGE_ALLOWLIST matches at registry and path-segment boundaries."""

    def allowed(self, allow: str, image: str) -> bool:
        return image_allowed(parse_image_ref(image), parse_allowlist(allow))

    def test_segment_boundary(self) -> None:
        """ghcr.io/org admits ghcr.io/org/x and refuses ghcr.io/org-evil/x."""
        self.assertTrue(self.allowed("ghcr.io/org", "ghcr.io/org/x:1"))
        self.assertTrue(self.allowed("ghcr.io/org/", "ghcr.io/org/sub/x"))
        self.assertFalse(self.allowed("ghcr.io/org", "ghcr.io/org-evil/x"))
        self.assertFalse(self.allowed("ghcr.io/org", "ghcr.io/orgx"))
        self.assertFalse(self.allowed("ghcr.io/org", "evil.io/ghcr.io/org/x"))

    def test_registry_only(self) -> None:
        """A registry entry admits everything there and nothing elsewhere."""
        self.assertTrue(self.allowed("ghcr.io", "ghcr.io/anything/x"))
        self.assertFalse(self.allowed("ghcr.io", "ghcr.io.evil.com/x"))
        self.assertTrue(self.allowed("127.0.0.1:5000", "127.0.0.1:5000/a/b:1"))
        self.assertFalse(self.allowed("127.0.0.1:5000", "127.0.0.1:5001/a/b:1"))

    def test_hub_names(self) -> None:
        """Hub entries: namespaces, official images, and the docker.io aliases."""
        self.assertTrue(self.allowed("vllm", "vllm/vllm-openai:latest"))
        self.assertTrue(self.allowed("ollama", "ollama"))
        self.assertTrue(self.allowed("docker.io/vllm", "vllm/vllm-openai"))
        self.assertTrue(self.allowed("docker.io", "index.docker.io/library/busybox"))
        self.assertFalse(self.allowed("vllm", "vllm-evil/x"))
        self.assertFalse(self.allowed("vllm", "ghcr.io/vllm/x"))

    def test_tag_and_digest_entries(self) -> None:
        """An entry with a tag or digest admits exactly that."""
        digest = "sha256:" + "b" * 64
        self.assertTrue(self.allowed("ollama/ollama:0.5", "ollama/ollama:0.5"))
        self.assertFalse(self.allowed("ollama/ollama:0.5", "ollama/ollama:0.6"))
        self.assertTrue(self.allowed(f"ghcr.io/o/x@{digest}", f"ghcr.io/o/x@{digest}"))
        self.assertFalse(self.allowed(f"ghcr.io/o/x@{digest}", "ghcr.io/o/x:latest"))
        self.assertTrue(self.allowed("ghcr.io/o", f"ghcr.io/o/x@{digest}"))

    def test_empty_allows_all(self) -> None:
        """An empty allowlist (or '*') admits every image."""
        self.assertTrue(self.allowed("", "anything/at:all"))
        self.assertTrue(self.allowed("*", "anything/at:all"))

    def test_bad_entry(self) -> None:
        """A malformed entry is a configuration error."""
        with self.assertRaises(PolicyError):
            parse_allowlist("Ghcr.io/ORG/Bad Thing")

    def test_applies_to_provider_default(self) -> None:
        """The provider's default image goes through the allowlist too."""
        with self.assertRaises(CommandFailed) as cm:
            spec_of(payload(), allow="ghcr.io")
        self.assertEqual(cm.exception.error_code, POLICY_VIOLATION)
        self.assertIn("vllm/vllm-openai", cm.exception.error_message)
        self.assertIn("IMAGE_ALLOWLIST", cm.exception.error_message)
        spec_of(payload(), allow="vllm")


class SpecDefaultsTests(SynchronousTestCase):
    """Protocol 4.1 defaults and naming."""

    def test_slug(self) -> None:
        """Container names: llm-port- + slug (<= 48 chars), fallback llm-port-runtime."""
        self.assertEqual(slug_container_name("Llama 3 8B!"), "llm-port-llama-3-8b")
        self.assertEqual(slug_container_name("  --  "), "llm-port-runtime")
        self.assertEqual(slug_container_name(None), "llm-port-runtime")
        long = slug_container_name("x" * 60)
        self.assertEqual(long, "llm-port-" + "x" * 48)
        self.assertEqual(slug_container_name("a" * 47 + " b"), "llm-port-" + "a" * 47)

    def test_payload_container_name_wins(self) -> None:
        """payload.container_name is used as given."""
        spec = spec_of(payload(container_name="my-runtime"))
        self.assertEqual(spec.container_name, "my-runtime")

    def test_vllm_defaults(self) -> None:
        """vLLM: default image, all GPUs, shm 1g, host IPC, port 8000, /health."""
        spec = spec_of(payload())
        self.assertEqual(spec.image.canonical, "vllm/vllm-openai:latest")
        self.assertEqual(spec.gpu.describe(), "all")
        self.assertEqual(spec.shm_size, 1024**3)
        self.assertEqual(spec.ipc_mode, "host")
        self.assertEqual(spec.container_port, 8000)
        self.assertEqual(spec.health_path, "/health")

    def test_provider_defaults(self) -> None:
        """Per-provider images, GPU defaults and readiness paths."""
        tgi = spec_of(payload(provider_type="tgi"))
        self.assertEqual(tgi.image.canonical, "ghcr.io/huggingface/text-generation-inference:latest")
        self.assertEqual(tgi.gpu.describe(), "all")
        llama = spec_of(payload(provider_type="llamacpp"))
        self.assertEqual(llama.image.canonical, "ghcr.io/ggerganov/llama.cpp:server")
        self.assertIsNone(llama.gpu)
        self.assertIsNone(llama.shm_size)
        self.assertIsNone(llama.ipc_mode)
        ollama = spec_of(payload(provider_type="ollama"))
        self.assertEqual(ollama.image.canonical, "ollama/ollama:latest")
        self.assertEqual(ollama.health_path, "/")

    def test_top_level_wins(self) -> None:
        """Top-level values win over provider_config; blank top-level values do not."""
        spec = spec_of(
            payload(
                container_port="9000",
                memory_limit="",
                provider_config={"container_port": 7000, "memory_limit": "2g", "cpu_limit": "1.5"},
            )
        )
        self.assertEqual(spec.container_port, 9000)
        self.assertEqual(spec.mem_limit, 2 * 1024**3)
        self.assertEqual(spec.nano_cpus, 1_500_000_000)

    def test_gpu_forms(self) -> None:
        """GPU requests: all, a count, device ids, none; as engine device requests."""
        self.assertEqual(
            spec_of(payload(gpu_request="2")).gpu.device_request(),
            {"Driver": "", "Capabilities": [["gpu"]], "Options": {}, "Count": 2, "DeviceIDs": None},
        )
        ids = spec_of(payload(gpu_request='"device=0,1"')).gpu.device_request()
        self.assertEqual(ids["DeviceIDs"], ["0", "1"])
        self.assertEqual(spec_of(payload(gpu_request="all")).gpu.device_request()["Count"], -1)
        self.assertIsNone(spec_of(payload(gpu_request="none", provider_type="tgi")).gpu)
        with self.assertRaises(CommandFailed) as cm:
            spec_of(payload(gpu_request="lots"))
        self.assertEqual(cm.exception.error_code, INVALID_COMMAND)
        self.assertIn("gpu_request", cm.exception.error_message)

    def test_no_gpu_values_mean_no_gpu_flags(self) -> None:
        """
        protocol 10.4: gpu_request "none", "0" or "" means no GPU flags at all, for vllm and
        tgi too (whose default, when gpu_request is left out, is all GPUs). The ipc quirk of
        protocol 9 (the backend adds ipc_mode "host" for any non-empty gpu_request) gives
        private IPC with a /dev/shm instead, never host IPC without a GPU.
        """
        for ptype in ("vllm", "tgi", "llamacpp"):
            for value in ("none", "0", "", "  ", "NONE"):
                for where in ("top", "provider_config"):
                    with self.subTest(ptype=ptype, value=value, where=where):
                        p = payload(provider_type=ptype, ipc_mode="host", shm_size="1g")
                        if where == "top":
                            p["gpu_request"] = value
                        else:
                            p["provider_config"] = {"gpu_request": value}
                        spec = spec_of(p)
                        self.assertIsNone(spec.gpu)
                        self.assertNotEqual(spec.ipc_mode, "host")
                        args = render(spec, host_port=8000, command_id="c", agent_id="node-1")
                        self.assertNotIn("device_requests", args["host_config"])
                        self.assertNotIn("devices", args["host_config"])
        # Top level "" with a real request in provider_config: the real request wins.
        spec = spec_of(payload(gpu_request="", provider_config={"gpu_request": "2"}))
        self.assertEqual(spec.gpu.describe(), "2")
        # Left out: the provider default.
        self.assertEqual(spec_of(payload(gpu_request=None)).gpu.describe(), "all")

    def test_environment(self) -> None:
        """Runtime env, model store env (offline for sync_from_server), nvcr.io GPU env."""
        spec = spec_of(
            payload(
                model_sync={"source": "sync_from_server", "hf_repo_id": "org/m", "blobs": []},
                provider_config={"image": "nvcr.io/nvidia/vllm:1"},
            )
        )
        env = spec.environment
        self.assertEqual(env["LLM_PORT_RUNTIME_ID"], RID)
        self.assertEqual(env["LLM_PORT_PROVIDER_TYPE"], "vllm")
        self.assertEqual(env["HF_HUB_CACHE"], "/data/hf-cache")
        self.assertEqual(env["HF_HUB_OFFLINE"], "1")
        self.assertEqual(env["TRANSFORMERS_OFFLINE"], "1")
        self.assertEqual(env["NVIDIA_DISABLE_REQUIRE"], "1")
        hf = spec_of(payload(model_sync={"source": "download_from_hf", "hf_repo_id": "org/m"}))
        self.assertNotIn("HF_HUB_OFFLINE", hf.environment)

    def test_store_mount_mode(self) -> None:
        """
        The store is mounted read-write only into workloads that download into it
        (download_from_hf); sync_from_server and no model source get it read-only, and
        MODEL_STORE_READ_ONLY makes every mount read-only.
        """

        def mode(p: dict[str, Any], settings: WorkloadSettings = SETTINGS) -> str:
            args = render(spec_of(p, settings), host_port=18000, command_id="c", agent_id="n")
            return str(args["host_config"]["binds"]["/srv/models"]["mode"])

        hf = payload(model_sync={"source": "download_from_hf", "hf_repo_id": "org/m"})
        synced = payload(model_sync={"source": "sync_from_server", "hf_repo_id": "org/m"})
        by_provider = payload(provider_config={"model_source": "download_from_hf"})
        self.assertEqual(mode(hf), "rw")
        self.assertEqual(mode(by_provider), "rw")
        self.assertEqual(mode(synced), "ro")
        self.assertEqual(mode(payload()), "ro")
        forced = WorkloadSettings(
            agent_id="n", model_store="/srv/models", model_store_read_only=True
        )
        self.assertEqual(mode(hf, forced), "ro")

    def test_sync_needs_model_store(self) -> None:
        """sync_from_server without a model store is an invalid command."""
        settings = WorkloadSettings(agent_id="n")
        with self.assertRaises(CommandFailed) as cm:
            spec_of(payload(model_sync={"source": "sync_from_server", "hf_repo_id": "o/m"}), settings)
        self.assertIn("MODEL_STORE", cm.exception.error_message)


class VllmCommandTests(SynchronousTestCase):
    """The vLLM command line (protocol 4.1)."""

    def test_served_model_name_is_the_repo_id(self) -> None:
        """engine_args cannot rename the served model: the gateway routes by hf_repo_id."""
        cmd = self.command(payload(
            model_sync={"source": "download_from_hf", "hf_repo_id": "org/served"},
            provider_config={"engine_args": {"served_model_name": "other", "port": 1}},
        ))
        self.assertNotIn("--served-model-name", cmd)
        self.assertNotIn("other", cmd)
        self.assertEqual(cmd[:3], ["serve", "--model", "org/served"])

    def command(self, p: dict[str, Any], host_port: int = 8000, settings: WorkloadSettings = SETTINGS) -> list[str]:
        args = render(spec_of(p, settings), host_port=host_port, command_id="c1", agent_id="node-1")
        self.assertEqual(args["create"]["entrypoint"], ["vllm"])
        return list(args["create"]["command"])

    def test_full_command_line(self) -> None:
        """Model from hf_repo_id, generic flags, tool calling, chat template, engine args, extra args."""
        cmd = self.command(
            payload(
                model_sync={"source": "download_from_hf", "hf_repo_id": "org/served"},
                generic_config={
                    "model": "ignored/model",
                    "max_model_len": 8192,
                    "dtype": "bfloat16",
                    "gpu_memory_utilization": 0.9,
                    "tensor_parallel_size": 2,
                    "swap_space": 4,
                    "enforce_eager": True,
                    "tool_call_parser": "hermes",
                },
                provider_config={
                    "engine_args": {
                        "chat-template": "/t.jinja",
                        "--trust-remote-code": True,
                        "disable-log-stats": False,
                        "max-num-seqs": 16,
                        "empty": "",
                    },
                    "extra_args": ["--seed", "1"],
                },
            )
        )
        self.assertEqual(
            cmd,
            [
                "serve", "--model", "org/served", "--host", "0.0.0.0", "--port", "8000",
                "--max-model-len", "8192", "--dtype", "bfloat16",
                "--gpu-memory-utilization", "0.9", "--tensor-parallel-size", "2",
                "--swap-space", "4", "--enforce-eager",
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                "--chat-template", "/t.jinja",
                "--trust-remote-code", "--max-num-seqs", "16",
                "--seed", "1",
            ],
        )  # fmt: skip

    def test_tool_parser_precedence_and_off(self) -> None:
        """engine_args parser wins; default openai; enable-auto-tool-choice false turns it off."""
        cmd = self.command(payload(provider_config={"engine_args": {"tool-call-parser": "llama3_json"}}))
        self.assertIn("llama3_json", cmd)
        self.assertEqual(cmd[cmd.index("--tool-call-parser") + 1], "llama3_json")
        cmd = self.command(payload())
        self.assertEqual(cmd[cmd.index("--tool-call-parser") + 1], "openai")
        cmd = self.command(payload(provider_config={"engine_args": {"enable-auto-tool-choice": False}}))
        self.assertNotIn("--enable-auto-tool-choice", cmd)
        self.assertNotIn("--tool-call-parser", cmd)

    def test_host_network_port_follows(self) -> None:
        """With host networking the server listens on the host port."""
        settings = WorkloadSettings(agent_id="n", network_mode="host")
        cmd = self.command(payload(), host_port=8123, settings=settings)
        self.assertEqual(cmd[cmd.index("--port") + 1], "8123")

    def test_no_model(self) -> None:
        """vLLM without any model is an invalid command naming the fields."""
        with self.assertRaises(CommandFailed) as cm:
            spec_of(payload(generic_config={}))
        self.assertEqual(cm.exception.error_code, INVALID_COMMAND)
        self.assertIn("generic_config.model", cm.exception.error_message)

    def test_provider_command(self) -> None:
        """provider_config.command as a list or a shell-split string replaces the default."""
        spec = spec_of(payload(provider_config={"command": "python -m x --name 'a b'"}))
        args = render(spec, host_port=1, command_id="c", agent_id="a")
        self.assertIsNone(args["create"]["entrypoint"])
        self.assertEqual(args["create"]["command"], ["python", "-m", "x", "--name", "a b"])
        spec = spec_of(payload(provider_config={"command": ["a", 1]}))
        self.assertEqual(render(spec, host_port=1, command_id="c", agent_id="a")["create"]["command"], ["a", "1"])
        with self.assertRaises(CommandFailed):
            spec_of(payload(provider_config={"command": "unbalanced 'quote"}))


class RenderTests(SynchronousTestCase):
    """The engine create call."""

    def test_labels_and_host_config(self) -> None:
        """Labels on every container; restart policy, GPUs, shm, ipc, limits, model store."""
        spec = spec_of(payload(memory_limit="8g", cpu_limit="4", gpu_request="1"))
        args = render(spec, host_port=18000, command_id="cmd-1", agent_id="node-1")
        labels = args["create"]["labels"]
        self.assertEqual(labels[LABEL_MANAGED], "llmport-agent")
        self.assertEqual(labels[LABEL_RUNTIME_ID], RID)
        self.assertEqual(labels[LABEL_COMMAND_ID], "cmd-1")
        self.assertEqual(labels[LABEL_PROVIDER], "vllm")
        self.assertEqual(labels[LABEL_CONTAINER_PORT], "8000")
        self.assertEqual(labels[LABEL_HOST_PORT], "18000")
        self.assertEqual(labels[LABEL_AGENT_ID], "node-1")
        hc = args["host_config"]
        self.assertEqual(hc["restart_policy"], {"Name": "unless-stopped"})
        self.assertEqual(hc["port_bindings"], {8000: 18000})
        self.assertEqual(hc["device_requests"][0]["Count"], 1)
        self.assertEqual(hc["shm_size"], 1024**3)
        self.assertEqual(hc["ipc_mode"], "host")
        self.assertEqual(hc["mem_limit"], 8 * 1024**3)
        self.assertEqual(hc["nano_cpus"], 4 * 10**9)
        # No model source: the workload only reads the store.
        self.assertEqual(hc["binds"], {"/srv/models": {"bind": "/data/hf-cache", "mode": "ro"}})
        self.assertEqual(args["create"]["name"], "llm-port-llama-3-8b")

    def test_endpoint_url(self) -> None:
        """endpoint_url uses the advertise scheme/host and the real host port."""
        self.assertEqual(endpoint_url(SETTINGS, 18000), "http://10.0.0.5:18000")
        v6 = WorkloadSettings(agent_id="n", advertise_scheme="https", advertise_host="fd00::1")
        self.assertEqual(endpoint_url(v6, 1), "https://[fd00::1]:1")


class RefusalTests(SynchronousTestCase):
    """Every local-policy refusal, with a message naming the setting."""

    def refused(self, p: dict[str, Any], words: str, settings: WorkloadSettings = SETTINGS) -> None:
        with self.assertRaises(CommandFailed) as cm:
            spec_of(p, settings)
        self.assertEqual(cm.exception.error_code, POLICY_VIOLATION, cm.exception.error_message)
        self.assertIn(words, cm.exception.error_message)
        self.assertIn("local policy", cm.exception.error_message)

    def test_privileged(self) -> None:
        """Privileged mode is refused wherever it appears."""
        self.refused(payload(provider_config={"privileged": True}), "privileged")
        self.refused(payload(privileged="true"), "privileged")

    def test_cap_add(self) -> None:
        """Added capabilities are refused."""
        self.refused(payload(provider_config={"cap_add": ["SYS_ADMIN"]}), "capabilities")

    def test_devices(self) -> None:
        """Devices other than GPUs are refused, pointing at gpu_request."""
        self.refused(payload(provider_config={"devices": ["/dev/sda:/dev/sda"]}), "gpu_request")

    def test_host_pid(self) -> None:
        """The host PID namespace is refused."""
        self.refused(payload(provider_config={"pid_mode": "host"}), "PID")

    def test_host_network_when_operator_chose_bridge(self) -> None:
        """Host networking is refused unless the operator chose it."""
        self.refused(payload(provider_config={"network_mode": "host"}), "network mode 'host'")
        host = WorkloadSettings(agent_id="n", network_mode="host")
        spec_of(payload(provider_config={"network_mode": "host"}), host)

    def test_bind_mounts(self) -> None:
        """Bind mounts other than the model store are refused."""
        self.refused(payload(provider_config={"volumes": ["/etc:/host-etc"]}), "'/etc'")
        self.refused(payload(provider_config={"mounts": [{"source": "/root", "target": "/r"}]}), "'/root'")
        spec_of(payload(provider_config={"volumes": {"/srv/models": {"bind": "/data/hf-cache"}}}))

    def test_other_containers_ipc(self) -> None:
        """Another container's IPC namespace is refused."""
        self.refused(payload(ipc_mode="container:other"), "IPC")

    def test_security_opt(self) -> None:
        """Security options are refused."""
        self.refused(payload(provider_config={"security_opt": ["seccomp=unconfined"]}), "security")


class ValidationTests(SynchronousTestCase):
    """Every payload value is validated with a message naming the field."""

    def invalid(self, p: dict[str, Any], field: str) -> None:
        with self.assertRaises(CommandFailed) as cm:
            spec_of(p)
        self.assertEqual(cm.exception.error_code, INVALID_COMMAND, cm.exception.error_message)
        self.assertIn(field, cm.exception.error_message)

    def test_fields(self) -> None:
        """Bad memory, CPU, shm, ports, names, provider, ids, sections."""
        self.invalid(payload(memory_limit="lots"), "memory_limit")
        self.invalid(payload(memory_limit="1k"), "memory_limit")
        self.invalid(payload(cpu_limit="-1"), "cpu_limit")
        self.invalid(payload(cpu_limit="four"), "cpu_limit")
        self.invalid(payload(shm_size="1 zettabyte"), "shm_size")
        self.invalid(payload(container_port="70000"), "container_port")
        self.invalid(payload(container_port="http"), "container_port")
        self.invalid(payload(provider_config={"host_port": 0}), "host_port")
        self.invalid(payload(container_name="bad name!"), "container_name")
        self.invalid(payload(container_name="-x"), "container_name")
        self.invalid(payload(provider_type="docker"), "provider_type")
        self.invalid(payload(runtime_id=""), "runtime_id")
        self.invalid(payload(runtime_id=12), "runtime_id")
        self.invalid(payload(provider_config=[1]), "provider_config")
        self.invalid(payload(generic_config="x"), "generic_config")
        self.invalid(payload(image_source="ftp"), "image_source")
        self.invalid(payload(model_sync="yes"), "model_sync")
        self.invalid(payload(provider_config={"image": "Bad/Image"}), "provider_config.image")
        self.invalid(payload(provider_config={"engine_args": {"bad flag": 1}}), "engine_args")
        self.invalid(payload(ipc_mode="weird"), "ipc_mode")
        self.invalid(payload(provider_config={"env": {"1BAD": "x"}}), "provider_config.env")

    def test_units(self) -> None:
        """Sizes, CPUs and ports parse as Docker reads them."""
        self.assertEqual(parse_bytes("512m", "x"), 512 * 1024**2)
        self.assertEqual(parse_bytes("1.5GiB", "x"), int(1.5 * 1024**3))
        self.assertEqual(parse_bytes(4096, "x"), 4096)
        self.assertEqual(parse_cpus("0.5"), 500_000_000)
        self.assertEqual(parse_port("8080", "p"), 8080)
        for bad in (True, 0, 65536, "8.5", None):
            with self.assertRaises(PolicyError):
                parse_port(bad, "p")

    def test_tail(self) -> None:
        """tail: an integer clamped to 10..200 (protocol 10.4); more in tests.test_serve_logs."""
        self.assertEqual(parse_tail(None), 200)
        self.assertEqual(parse_tail("50"), 50)
        self.assertEqual(parse_tail(10000), 200)
        self.assertEqual(parse_tail(0), 10)
        for bad in ("x", True, 1.5):
            with self.assertRaises(CommandFailed) as cm:
                parse_tail(bad)
            self.assertEqual(cm.exception.error_code, INVALID_COMMAND)


class PortChoiceTests(SynchronousTestCase):
    """Host port choice without touching the network."""

    def test_explicit_taken(self) -> None:
        """An explicit port that is held (or reserved) is a port_conflict."""
        with self.assertRaises(CommandFailed) as cm:
            choose_host_port(8000, 9000, is_free=lambda p: p != 9000)
        self.assertEqual(cm.exception.error_code, "port_conflict")
        self.assertIn("9000", cm.exception.error_message)
        with self.assertRaises(CommandFailed):
            choose_host_port(8000, 9000, {9000}, is_free=lambda p: True)

    def test_default_and_fallback(self) -> None:
        """The container port when free; else the next free one, skipping reserved ports."""
        self.assertEqual(choose_host_port(8000, None, is_free=lambda p: True), 8000)
        self.assertEqual(
            choose_host_port(8000, None, {8001}, is_free=lambda p: p not in (8000, 8002)), 8003
        )


class LogMergeTests(SynchronousTestCase):
    """Log lines are merged in time order and capped."""

    def test_order_and_cap(self) -> None:
        """Interleaved stdout/stderr sort by timestamp; continuation lines stay put; cap keeps the tail."""
        raw = (
            b"2024-01-01T00:00:02.5Z second\n"
            b"2024-01-01T00:00:01.000000001Z first\n"
            b"continuation of first\n"
            b"2024-01-01T00:00:03Z third\n"
        )
        text, count, truncated = merge_log_lines(raw, 1024)
        self.assertEqual(
            text.splitlines(),
            [
                "2024-01-01T00:00:01.000000001Z first",
                "continuation of first",
                "2024-01-01T00:00:02.5Z second",
                "2024-01-01T00:00:03Z third",
            ],
        )
        self.assertEqual(count, 4)
        self.assertFalse(truncated)
        text, count, truncated = merge_log_lines(raw, 40)
        self.assertTrue(truncated)
        self.assertTrue(text.endswith("2024-01-01T00:00:03Z third"))
        self.assertIn("truncated", text.splitlines()[0])


class PullProgressTests(SynchronousTestCase):
    """Per-layer pull messages aggregate into bytes and a percentage."""

    def test_aggregate(self) -> None:
        """Two layers' download bytes add up; completion marks layers done; Status: ends at 100."""
        p = PullProgress()
        p.update({"status": "Pulling from x", "id": "1"})
        p.update({"status": "Pulling fs layer", "id": "a"})
        p.update({"status": "Pulling fs layer", "id": "b"})
        self.assertTrue(p.update({"status": "Downloading", "id": "a", "progressDetail": {"current": 50, "total": 100}}))
        p.update({"status": "Downloading", "id": "b", "progressDetail": {"current": 100, "total": 300}})
        self.assertEqual((p.bytes_done, p.bytes_total), (150, 400))
        self.assertLess(p.pct(), 50)
        p.update({"status": "Download complete", "id": "a"})
        p.update({"status": "Pull complete", "id": "a"})
        self.assertEqual(p.bytes_done, 200)
        self.assertEqual(p.extra()["layers_done"], 1)
        p.update({"status": "Status: Downloaded newer image for x"})
        self.assertEqual(p.pct(), 100)


class IpcTests(SynchronousTestCase):
    """
    Host IPC (protocol 9: the backend asks for it for every vllm/tgi runtime whose
    gpu_request is a non-empty string, "none" included): given to workloads with GPUs while
    ALLOW_HOST_IPC is on, otherwise replaced by private IPC and a /dev/shm, with a note.
    """

    def test_cpu_only_vllm_from_the_ui_deploys(self) -> None:
        """gpu_request "none" + ipc_mode "host" (what the UI sends): private IPC, 1 GiB shm, a note."""
        spec = spec_of(payload(gpu_request="none", ipc_mode="host"))
        self.assertIsNone(spec.gpu)
        self.assertEqual(spec.ipc_mode, "private")
        self.assertEqual(spec.shm_size, 1024**3)
        self.assertEqual(len(spec.notes), 1)
        self.assertIn("private IPC", spec.notes[0])
        self.assertIn("no GPU", spec.notes[0])
        hc = render(spec, host_port=8000, command_id="c", agent_id="a")["host_config"]
        self.assertEqual(hc["ipc_mode"], "private")
        self.assertEqual(hc["shm_size"], 1024**3)
        self.assertNotIn("device_requests", hc)

    def test_gpu_request_zero_and_given_shm(self) -> None:
        """gpu_request "0" counts as no GPU; a given shm_size is kept."""
        spec = spec_of(payload(provider_type="tgi", gpu_request="0", ipc_mode="host", shm_size="2g"))
        self.assertEqual((spec.ipc_mode, spec.shm_size), ("private", 2 * 1024**3))
        self.assertIn("2 GiB", spec.notes[0])

    def test_gpu_workloads_keep_host_ipc(self) -> None:
        """With GPUs host IPC is given as asked (llama.cpp too), without a note."""
        spec = spec_of(payload(gpu_request="all", ipc_mode="host"))
        self.assertEqual(spec.ipc_mode, "host")
        self.assertEqual(spec.notes, ())
        llama = spec_of(payload(provider_type="llamacpp", ipc_mode="host", gpu_request="1"))
        self.assertEqual(llama.ipc_mode, "host")

    def test_operator_forbids_host_ipc(self) -> None:
        """ALLOW_HOST_IPC=false: even GPU workloads get private IPC (with shm), and a note says why."""
        strict = WorkloadSettings(agent_id="n", allow_host_ipc=False)
        spec = spec_of(payload(gpu_request="all"), strict)  # vLLM's default is host IPC
        self.assertEqual(spec.ipc_mode, "private")
        self.assertEqual(spec.shm_size, 1024**3)
        self.assertIn("ALLOW_HOST_IPC=false", spec.notes[0])
        self.assertIsNotNone(spec.gpu)

    def test_other_modes_unchanged(self) -> None:
        """private/shareable/none and no request pass as they are, without notes."""
        for mode in ("private", "shareable", "none"):
            spec = spec_of(payload(provider_type="llamacpp", ipc_mode=mode))
            self.assertEqual((spec.ipc_mode, spec.notes), (mode, ()))
        self.assertIsNone(spec_of(payload(provider_type="llamacpp")).ipc_mode)


class AllowlistSlashTests(SynchronousTestCase):
    """IMAGE_ALLOWLIST entries mean the same with or without a trailing slash."""

    def allowed(self, allow: str, image: str) -> bool:
        return image_allowed(parse_image_ref(image), parse_allowlist(allow))

    def test_hub_namespace_with_slash(self) -> None:
        """myorg/ admits myorg/app:1, as myorg does; neither admits other registries or namespaces."""
        for entry in ("myorg", "myorg/", "myorg//"):
            self.assertTrue(self.allowed(entry, "myorg/app:1"), entry)
            self.assertTrue(self.allowed(entry, "docker.io/myorg/app"), entry)
            self.assertFalse(self.allowed(entry, "myorg-evil/app:1"), entry)
            self.assertFalse(self.allowed(entry, "ghcr.io/myorg/app"), entry)

    def test_every_form_same_both_ways(self) -> None:
        """Registries, path prefixes and Docker Hub forms: identical decisions with a slash."""
        entries = ("ghcr.io", "ghcr.io/org", "docker.io/vllm", "vllm", "registry.local:5000",
                   "127.0.0.1:5000/team", "localhost", "library")
        images = ("ghcr.io/org/x:1", "ghcr.io/org-evil/x", "ghcr.io/other/x", "vllm/vllm-openai",
                  "vllm", "registry.local:5000/a/b", "127.0.0.1:5000/team/x", "127.0.0.1:5000/other",
                  "localhost/x", "busybox", "evil.io/ghcr.io/org/x")
        for entry in entries:
            for image in images:
                self.assertEqual(self.allowed(entry, image), self.allowed(entry + "/", image),
                                 f"{entry!r} vs {entry + '/'!r} on {image}")

    def test_port_registry_needs_its_slash(self) -> None:
        """name:5000/ is a registry on a port; name:5000 stays an image with tag 5000."""
        self.assertTrue(self.allowed("myreg:5000/", "myreg:5000/app:1"))
        self.assertTrue(self.allowed("busybox:1", "busybox:1"))
        self.assertFalse(self.allowed("busybox:1", "busybox:2"))
