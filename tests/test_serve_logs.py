"""
fetch_container_logs for a Ray Serve app (protocol 10.4), against the real test engine: a plain
busybox container named C{llm-port-ray-runtime} (with the labels the agent gives its Ray runtime
container) stands in for it and
holds replica log files under C{/tmp/ray/session_latest/logs/serve/} (C{session_latest} a
symlink, as Ray makes it). Also the C{tail} rule: an integer clamped to 10..200.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import Any

from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.base import INVALID_COMMAND, CommandFailed
from llmport_agent.ray.container import LABEL_RAY, RAY_VALUE
from llmport_agent.workloads.handlers import parse_tail
from llmport_agent.workloads.servelogs import RAY_CONTAINER, parse_replica, serve_app_name
from llmport_agent.workloads.spec import LABEL_AGENT_ID

from .support.docker_env import BUSYBOX
from .support.rig import WorkloadTestBase, httpd_payload, ids_of

APP = "llmport-" + str(uuid.UUID(int=7))
BIG = "llmport-" + str(uuid.UUID(int=9))
#: The Ray runtime container's labels as the agent (rig agent id "test-node") creates it.
OURS = {LABEL_RAY: RAY_VALUE, LABEL_AGENT_ID: "test-node"}
LOGDIR = "/tmp/ray/session_2026-12-02_10-00-00_000000_1/logs/serve"


def _script(host_secret: str) -> str:
    """Replica logs of APP (10, for the 8-file limit), another app's, and hostile entries."""
    lines = []
    lines.append(f"mkdir -p {LOGDIR}; ln -s session_2026-12-02_10-00-00_000000_1 /tmp/ray/session_latest")
    lines.append(f"cd {LOGDIR}")
    for i in range(10):
        name = f"replica_{APP}_LLMServer_r{i:02d}.log"
        # 300 lines each, the file number in every line; mtime increasing with i.
        lines.append(f"j=0; while [ $j -lt 300 ]; do echo \"file {i} line $j\"; j=$((j+1)); done > {name}")
        lines.append(f"touch -d '2026-01-01 00:{i:02d}:00' {name}")
    lines.append("echo other-app > replica_llmport-other_LLMServer_x.log")
    # One endless line (4 MiB, no newline) in a replica file of another app id: bounded.
    lines.append(f"yes x | tr -d '\\n' | head -c 4194304 > replica_{BIG}_LLMServer_big.log")
    # A symlink to a path that exists on the host only: resolved in the container, not there.
    lines.append(f"ln -s {host_secret} replica_{APP}_LLMServer_zz.log; touch -h -d '2026-01-01 00:59:00' replica_{APP}_LLMServer_zz.log")
    lines.append("exec sleep 600")
    return "; ".join(lines)


class TailRuleTests(SynchronousTestCase):
    def test_clamped(self) -> None:
        """tail: an integer clamped to 10..200; absent means 200 (the default 300, clamped)."""
        self.assertEqual(parse_tail(None), 200)
        self.assertEqual(parse_tail(""), 200)
        self.assertEqual(parse_tail(50), 50)
        self.assertEqual(parse_tail("50"), 50)
        self.assertEqual(parse_tail(" 75 "), 75)
        self.assertEqual(parse_tail(120.0), 120)
        for low in (0, 1, 9, -5, "3"):
            self.assertEqual(parse_tail(low), 10)
        for high in (201, 300, 10_000, "99999", 10**30):
            self.assertEqual(parse_tail(high), 200)

    def test_not_an_integer(self) -> None:
        for bad in ("x", True, 1.5, "1e3", [], {}, "9" * 5000):
            with self.assertRaises(CommandFailed) as cm:
                parse_tail(bad)
            self.assertEqual(cm.exception.error_code, INVALID_COMMAND)

    def test_names(self) -> None:
        """Only llmport-<id> names are Serve apps; replica ids of a small alphabet only."""
        self.assertEqual(serve_app_name(APP), APP)
        for name in ("Llama 3", "llmport-", "llmport-a;rm -rf /", "llmport-$(id)", "llmport-a*", None, 3):
            self.assertIsNone(serve_app_name(name))
        self.assertEqual(parse_replica("r03"), "r03")
        for bad in ("", "a b", "*", "$(id)", "../x", None):
            self.assertIsNone(parse_replica(bad))


class ServeLogsTests(WorkloadTestBase):
    """Replica logs inside the Ray runtime container come first."""

    async def ray_container(self, labels: dict[str, str] | None = None) -> Any:
        fd, secret = tempfile.mkstemp(prefix="llmport-host-only-")
        os.write(fd, b"HOST-ONLY-SECRET\n")
        os.close(fd)
        self.addCleanup(os.unlink, secret)

        def run() -> Any:
            return self.env.client().containers.run(
                BUSYBOX, ["sh", "-c", _script(secret)], name=RAY_CONTAINER, detach=True, network_mode="none",
                labels=OURS if labels is None else labels,
            )

        container = await deferToThread(run)

        def ready() -> bool:
            code, _ = container.exec_run(["sh", "-c", f"test -L {LOGDIR}/replica_{APP}_LLMServer_zz.log"])
            return code == 0

        for _ in range(100):
            if await deferToThread(ready):
                return container
        self.fail("the stand-in Ray container did not write its files")

    def logs_payload(self, **extra: Any) -> dict[str, Any]:
        p = ids_of(httpd_payload())
        p["runtime_name"] = APP
        p.update(extra)
        return p

    async def test_replica_logs_first(self) -> None:
        """The newest 8 replica files of the app, newest first, each headed, tail lines each."""
        await self.ray_container()
        _, result = await self.rig.run("fetch_container_logs", self.logs_payload(tail=20))
        self.assertTrue(result["found"])
        self.assertEqual(result["source"], "ray_serve")
        self.assertEqual(result["container_name"], RAY_CONTAINER)
        text = result["logs"]
        headers = [line for line in text.splitlines() if line.startswith("=====")]
        self.assertEqual(headers, [f"===== replica_{APP}_LLMServer_r{i:02d}.log =====" for i in range(9, 1, -1)])
        self.assertEqual(result["files"], 8)
        self.assertNotIn("HOST-ONLY-SECRET", text)  # the symlink did not reach the host file
        self.assertNotIn("other-app", text)
        for i in range(9, 1, -1):
            rows = [line for line in text.splitlines() if line.startswith(f"file {i} ")]
            self.assertEqual(rows, [f"file {i} line {j}" for j in range(280, 300)])

    async def test_tail_clamped_and_replica_filter(self) -> None:
        """tail 5 is 10 lines; replica_id narrows to that replica's file."""
        await self.ray_container()
        _, result = await self.rig.run("fetch_container_logs", self.logs_payload(tail=5, replica_id="r03"))
        text = result["logs"]
        self.assertEqual(
            [line for line in text.splitlines() if line.startswith("=====")],
            [f"===== replica_{APP}_LLMServer_r03.log ====="],
        )
        self.assertEqual(len([line for line in text.splitlines() if line.startswith("file 3 ")]), 10)
        _, big = await self.rig.run("fetch_container_logs", self.logs_payload(tail=100_000, replica_id="r04"))
        self.assertEqual(len([line for line in big["logs"].splitlines() if line.startswith("file 4 ")]), 200)

    async def test_no_replica_files_falls_back(self) -> None:
        """No matching file (or no Ray container): the container's logs, with a note."""
        await self.ray_container()
        payload = ids_of(httpd_payload())
        payload["runtime_name"] = "llmport-" + str(uuid.UUID(int=8))  # an app without files
        _, result = await self.rig.run("fetch_container_logs", payload)
        self.assertEqual(result.get("source"), None)
        self.assertIn("no Ray Serve replica logs of llmport-", result["logs"])
        self.assertIn("No managed container", result["logs"])

    async def test_not_a_serve_app(self) -> None:
        """A plain runtime name never reads the Ray container."""
        await self.ray_container()
        _, result = await self.rig.run("fetch_container_logs", ids_of(httpd_payload()))
        self.assertNotIn("=====", result["logs"])
        self.assertNotIn("Serve", result["logs"])

    async def test_bounded(self) -> None:
        """A 4 MiB line without a newline: at most 128 KiB of it come out."""
        await self.ray_container()
        p = self.logs_payload()
        p["runtime_name"] = BIG
        _, result = await self.rig.run("fetch_container_logs", p)
        self.assertEqual(result["source"], "ray_serve")
        self.assertLess(len(result["logs"]), 140 * 1024)
        self.assertGreater(result["logs"].count("x"), 100 * 1024)

    async def test_foreign_container_not_entered(self) -> None:
        """A container of that name without this agent's Ray labels is never exec'd into."""
        for labels in ({}, {LABEL_RAY: RAY_VALUE, LABEL_AGENT_ID: "another-node"}):
            self.env.remove_all_containers()
            await self.ray_container(labels)
            _, result = await self.rig.run("fetch_container_logs", self.logs_payload())
            self.assertNotIn("=====", result["logs"])
            self.assertIn("no Ray Serve replica logs", result["logs"])

    async def test_without_ray_container(self) -> None:
        _, result = await self.rig.run("fetch_container_logs", self.logs_payload())
        self.assertFalse(result["found"])
        self.assertIn("no Ray Serve replica logs", result["logs"])
