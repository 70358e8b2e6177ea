"""
The stand-in backend counts what each inbound frame would cost the real backend (protocol
3.2): offset-row writes for frames whose seq passes the check, one pending-commands query per
accepted frame, and the estimated CPU (4.4 ms with seq, 2.9 ms without), per node and in total,
through DevBackend.costs() and GET /dev/costs, /dev/nodes/<id>/costs.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmport_agent.devbackend._state import CPU_MS_WITH_SEQ, CPU_MS_WITHOUT_SEQ, FrameCost
from tests.test_devbackend import LoopbackMixin


class FrameCostTests(SynchronousTestCase):
    def test_cpu_estimate(self) -> None:
        """4.4 ms per accepted frame with seq, 2.9 ms per accepted frame without; dropped ones cost nothing."""
        self.assertEqual((CPU_MS_WITH_SEQ, CPU_MS_WITHOUT_SEQ), (4.4, 2.9))
        cost = FrameCost(frames=12, offset_writes=6, dispatch_queries=10)
        self.assertAlmostEqual(cost.cpu_ms, 6 * 4.4 + 4 * 2.9)
        total = FrameCost()
        total.add(cost)
        total.add(FrameCost(frames=1, offset_writes=0, dispatch_queries=1, connects=2))
        self.assertEqual(
            total.to_dict(),
            {"frames": 13, "offset_writes": 6, "dispatch_queries": 11, "connects": 2,
             "wakeup_drains": 0, "cpu_ms": round(6 * 4.4 + 5 * 2.9, 3)},
        )


class CostCounterTests(LoopbackMixin, TestCase):
    """Real frames over loopback, counted as the real backend would spend on them."""

    timeout = 20

    async def test_counts_per_frame_kind(self) -> None:
        """With seq: write + query; without: query only; seq not increasing: neither (2026-04); per node and total."""
        await self.start(generation="2026-04")
        one = await self.enroll("node-1")
        two = await self.enroll("node-2")
        a = await self.open_stream(one["credential"])
        b = await self.open_stream(two["credential"])
        a.send({"type": "heartbeat"})           # seq 1: write + query
        a.send({"type": "poll"}, seq=False)     # query only
        a.send({"type": "poll"}, seq=False)     # query only
        a.send({"type": "heartbeat", "seq": 1})  # not increasing: dropped, no dispatch
        a.send({"type": "inventory", "inventory": {}})  # seq 2: write + query
        b.send({"type": "poll"}, seq=False)
        await a.barrier()
        await b.barrier()
        costs = self.backend.costs()
        node_a = costs["nodes"][one["node_id"]]
        self.assertEqual(
            (node_a["frames"], node_a["offset_writes"], node_a["dispatch_queries"], node_a["connects"]),
            (5, 2, 4, 1),
        )
        self.assertAlmostEqual(node_a["cpu_ms"], 2 * 4.4 + 2 * 2.9)
        node_b = self.backend.costs(two["node_id"])
        self.assertEqual((node_b["frames"], node_b["offset_writes"], node_b["dispatch_queries"]), (1, 0, 1))
        self.assertAlmostEqual(node_b["cpu_ms"], 2.9)
        total = costs["total"]
        self.assertEqual((total["frames"], total["offset_writes"], total["dispatch_queries"]), (6, 2, 5))
        self.assertAlmostEqual(total["cpu_ms"], 2 * 4.4 + 3 * 2.9, places=3)

    async def test_filtered_frames_cost_nothing(self) -> None:
        """A frame the inbound filter discards (lost on the wire) gets no write and no query."""
        await self.start()
        one = await self.enroll("node-1")
        a = await self.open_stream(one["credential"])
        self.backend.inbound_filter = lambda node_id, frame: frame.get("type") != "lost"
        a.send({"type": "lost"})
        a.send({"type": "heartbeat"})
        await a.barrier()
        cost = self.backend.costs(one["node_id"])
        self.assertEqual((cost["offset_writes"], cost["dispatch_queries"]), (1, 1))

    async def test_http_api(self) -> None:
        """GET /dev/costs (total and per node) and /dev/nodes/<id>/costs; counted without keeping frames."""
        await self.start(keep_frames=False)
        one = await self.enroll("node-1")
        a = await self.open_stream(one["credential"])
        a.send({"type": "heartbeat"})
        a.send({"type": "poll"}, seq=False)
        await a.barrier()
        code, body = await self.get("/dev/costs")
        self.assertEqual(code, 200)
        self.assertEqual(body["total"]["dispatch_queries"], 2)
        self.assertEqual(body["nodes"][one["node_id"]]["offset_writes"], 1)
        self.assertIsInstance(body["at"], float)
        code, node = await self.get(f"/dev/nodes/{one['node_id']}/costs")
        self.assertEqual(code, 200)
        self.assertEqual((node["frames"], node["cpu_ms"]), (2, round(4.4 + 2.9, 3)))
        # keep_frames=False: nothing kept, the counters still count.
        self.assertEqual(self.backend.frames(one["node_id"]), [])
        code, _ = await self.get("/dev/nodes/nope/costs")
        self.assertEqual(code, 404)


class CliTests(SynchronousTestCase):
    def test_keep_frames_option(self) -> None:
        """llmport-agent devbackend keeps frames by default; --no-keep-frames turns it off."""
        from llmport_agent.devbackend import cli

        self.assertTrue(cli.build_parser().parse_args([]).keep_frames)
        self.assertFalse(cli.build_parser().parse_args(["--no-keep-frames"]).keep_frames)
