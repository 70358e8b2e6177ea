"""
Bridge-network port resolution (the default WORKLOAD_NETWORK=bridge), in-process.

The test engine runs with --bridge=none, so a real bridge publish cannot happen here; these
tests cover each step on its own: what the container is created with (ports and bindings,
the publish address), how the engine's published ports are read back from `docker inspect`
(IPv4/IPv6 bindings, UDP, empty bindings), that the published port wins over the label, and
that a deploy reports and probes the port the engine really published, not the one it asked
for (the engine is real; only its inspect answer is made to show a bridge publish).
"""

from __future__ import annotations

from typing import Any

from attrs import evolve
from twisted.internet.defer import succeed
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.workloads import containers as ops
from llmport_agent.workloads.spec import (
    LABEL_CONTAINER_PORT,
    LABEL_HOST_PORT,
    LABEL_NETWORK,
    render,
)

from .support.rig import WorkloadTestBase, httpd_payload
from .test_workloads_spec import SETTINGS, spec_of
from .test_workloads_spec import payload as spec_payload


def inspect_info(ports: dict[str, Any], labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "Id": "c" * 64,
        "Name": "/llm-port-x",
        "State": {"Status": "running", "Running": True},
        "Config": {"Labels": labels or {}, "Env": [], "Image": "busybox"},
        "HostConfig": {"NetworkMode": "bridge", "RestartPolicy": {"Name": "unless-stopped"}},
        "NetworkSettings": {"Ports": ports},
    }


class RenderBridgeTests(SynchronousTestCase):
    def spec(self) -> Any:
        return spec_of(spec_payload(), evolve(SETTINGS, network_mode="bridge"))

    def test_bridge_publishes_the_container_port(self) -> None:
        args = render(self.spec(), host_port=18001, command_id="c", agent_id="a")
        self.assertEqual(args["host_config"]["network_mode"], "bridge")
        self.assertEqual(args["create"]["ports"], [8000])
        self.assertEqual(args["host_config"]["port_bindings"], {8000: 18001})
        self.assertEqual(args["create"]["labels"][LABEL_HOST_PORT], "18001")
        self.assertEqual(args["create"]["labels"][LABEL_NETWORK], "bridge")

    def test_publish_host_ip(self) -> None:
        args = render(self.spec(), host_port=18001, command_id="c", agent_id="a", publish_host_ip="127.0.0.1")
        self.assertEqual(args["host_config"]["port_bindings"], {8000: ("127.0.0.1", 18001)})

    def test_host_network_publishes_nothing(self) -> None:
        spec = spec_of(spec_payload(), evolve(SETTINGS, network_mode="host"))
        args = render(spec, host_port=8000, command_id="c", agent_id="a")
        self.assertNotIn("ports", args["create"])
        self.assertNotIn("port_bindings", args["host_config"])


class PublishedPortTests(SynchronousTestCase):
    def test_inspect_ports_read_back(self) -> None:
        snap = ops.snapshot(inspect_info({
            "8000/tcp": [{"HostIp": "0.0.0.0", "HostPort": "32768"}, {"HostIp": "::", "HostPort": "32768"}],
            "9000/udp": [{"HostIp": "0.0.0.0", "HostPort": "40000"}],
            "9100/tcp": None,  # exposed, not published
            "9200/tcp": [{"HostIp": "", "HostPort": ""}, {"HostIp": "::", "HostPort": "32770"}],
        }))
        self.assertEqual(snap["ports"], {8000: 32768, 9200: 32770})
        self.assertEqual(snap["network_mode"], "bridge")

    def test_published_port_wins_over_the_label(self) -> None:
        """The label says what was asked; the engine's binding is where it listens."""
        labels = {LABEL_CONTAINER_PORT: "8000", LABEL_HOST_PORT: "18000"}
        snap = ops.snapshot(inspect_info({"8000/tcp": [{"HostIp": "0.0.0.0", "HostPort": "32768"}]}, labels))
        self.assertEqual(ops.host_port_of(snap), 32768)
        self.assertEqual(ops.host_port_of(snap, 8000), 32768)

    def test_label_when_nothing_is_published(self) -> None:
        """A stopped bridge container has no bindings in inspect: the recorded host port."""
        labels = {LABEL_CONTAINER_PORT: "8000", LABEL_HOST_PORT: "18000"}
        snap = ops.snapshot(inspect_info({}, labels))
        self.assertEqual(ops.host_port_of(snap), 18000)

    def test_other_published_port_without_labels(self) -> None:
        snap = ops.snapshot(inspect_info({"8080/tcp": [{"HostIp": "0.0.0.0", "HostPort": "32771"}]}))
        self.assertEqual(ops.host_port_of(snap), 32771)
        self.assertIsNone(ops.host_port_of(ops.snapshot(inspect_info({}))))


class DeployUsesThePublishedPortTests(WorkloadTestBase):
    async def test_endpoint_and_probe_use_the_published_port(self) -> None:
        """The engine published another host port than asked: the result and the probe use it."""
        published = 41234
        real_inspect = ops.inspect

        def bridged_inspect(client: Any, ident: str) -> dict[str, Any] | None:
            snap = real_inspect(client, ident)
            if snap is not None:
                cport = int(snap["labels"][LABEL_CONTAINER_PORT])
                snap["ports"] = {cport: published}
            return snap

        probed: list[str] = []

        def probe(url: str) -> Any:
            probed.append(url)
            return succeed(200)

        self.patch(ops, "inspect", bridged_inspect)
        self.rig.manager._probe = probe
        payload = httpd_payload()
        ctx, result = await self.rig.run("deploy_workload", payload)
        self.assertEqual(result["host_port"], published)
        self.assertEqual(result["endpoint_url"], f"http://192.0.2.10:{published}")
        self.assertTrue(probed)
        self.assertTrue(all(u.startswith(f"http://127.0.0.1:{published}/") for u in probed), probed)
        resolve = [p for p in ctx.frames if p.get("phase") == "resolve_endpoint"]
        self.assertEqual(resolve[-1]["host_port"], published)
