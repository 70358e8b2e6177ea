"""
The receiver's side of peer seeding against the clock (L{ImageSeeding.download}): the backend
sends C{serve_runtime_image} and the receivers' C{ensure_runtime_image} at the same moment, so
the seeder may refuse connections or answer 503 for minutes while it exports. The receiver
retries for the command's budget (C{timeout_sec}) with a progress message every 30 s, then
fails C{image_seed_failed} (the backend then asks the llm-port server); a refused token or
another answer fails at once; a broken download resumes where it stopped.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, ensureDeferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.base import CommandFailed
from llmport_agent.ray import seeding
from llmport_agent.ray.seeding import IMAGE_SEED_FAILED, Attempt, ImageSeeding
from tests.support.context import RecordingContext, make_command

TOTAL = 1000


class Seeder:
    """Scripted answers of a seeder, one per attempt; the last repeats."""

    def __init__(self, clock: Clock, script: list[Any]) -> None:
        self.clock = clock
        self.script = script
        self.calls: list[tuple[float, int]] = []
        self.ids: set[str] = set()

    def __call__(self, host: str, port: int, path: str, token: bytes, download_id: str, tar: str, have: int,
                 meter: seeding.Meter) -> Deferred[Attempt]:
        self.ids.add(download_id)
        self.calls.append((self.clock.seconds(), have))
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        return succeed(step(have) if callable(step) else step)


def refused(have: int = 0) -> Attempt:
    return Attempt("unreachable", why="Connection refused")


def busy(retry: float | None = 5) -> Attempt:
    return Attempt("busy", code=503, why="HTTP 503", retry_after=retry)


def whole(have: int) -> Attempt:
    return Attempt("body", code=206 if have else 200, total=TOTAL, have=TOTAL, complete=True)


def half(have: int) -> Attempt:
    return Attempt("body", code=200, total=TOTAL, have=TOTAL // 2, why="the connection broke")


class WaitTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.seeding = ImageSeeding(self.clock, None, None, "/nonexistent", None,  # type: ignore[arg-type]
                                    resume_attempts=3, resume_delay=1.0)

    def start(self, script: list[Any], timeout_sec: int | None = 300) -> tuple[Deferred[int], RecordingContext, Seeder]:
        command = make_command("ensure_runtime_image", {})
        command = type(command)(**{**{k: getattr(command, k) for k in ("id", "command_type", "payload",
                                  "correlation_id", "idempotency_key", "issued_at")}, "timeout_sec": timeout_sec})
        ctx = RecordingContext(command, self.clock)
        seeder = Seeder(self.clock, script)
        self.seeding.attempt = seeder
        d = ensureDeferred(self.seeding.download("10.1.0.2", 8271, "/image", b"tok", "peer.tar", ctx, "img:1",
                                                 seeding._peer_wait(ctx)))
        return d, ctx, seeder

    def run_for(self, seconds: float, step: float = 0.5) -> None:
        for _ in range(int(seconds / step)):
            self.clock.advance(step)

    def waiting_notes(self, ctx: RecordingContext) -> list[dict[str, Any]]:
        return [f for f in ctx.frames if f["phase"] == "waiting_for_peer"]

    def test_refused_for_minutes_then_served(self) -> None:
        """A seeder still exporting for 200 s (refused connections): the receiver waits it out."""
        d, ctx, seeder = self.start([lambda have: refused() if self.clock.seconds() < 200 else whole(have)])
        self.run_for(240)
        self.assertEqual(self.successResultOf(d), TOTAL)
        notes = self.waiting_notes(ctx)
        # One note at once, then one every 30 s: 0, 30, ..., 180.
        self.assertEqual(len(notes), 7, [n["message"] for n in notes])
        self.assertIn("may still be exporting", notes[0]["message"])
        self.assertTrue(all(b - a <= 5.0 for (a, _), (b, _) in zip(seeder.calls, seeder.calls[1:], strict=False)))
        self.assertLess(len(seeder.calls), 200 / 1.0 + 10)  # not a busy loop

    def test_503_is_retry_later(self) -> None:
        d, ctx, seeder = self.start([busy(7), busy(7), busy(None), whole])
        self.run_for(60)
        self.assertEqual(self.successResultOf(d), TOTAL)
        self.assertEqual([t for t, _ in seeder.calls][:3], [0.0, 7.0, 14.0])  # Retry-After honoured

    def test_gives_up_at_the_commands_budget(self) -> None:
        d, ctx, seeder = self.start([refused], timeout_sec=120)
        self.run_for(119)
        self.assertNoResult(d)
        self.run_for(10)
        err = self.failureResultOf(d, CommandFailed).value
        self.assertEqual(err.error_code, IMAGE_SEED_FAILED)
        self.assertIn("did not serve the runtime image within 120 s", err.error_message)
        self.assertIn("llm-port server", err.error_message)
        self.assertLessEqual(seeder.calls[-1][0], 120.0)

    def test_no_budget_means_the_default_wait(self) -> None:
        d, _ctx, _seeder = self.start([busy(30)], timeout_sec=None)
        self.run_for(seeding.DEFAULT_PEER_WAIT_S - 1)
        self.assertNoResult(d)
        self.run_for(40)
        self.assertEqual(self.failureResultOf(d, CommandFailed).value.error_code, IMAGE_SEED_FAILED)

    def test_token_refused_fails_at_once(self) -> None:
        d, _ctx, seeder = self.start([Attempt("denied", code=401)])
        err = self.failureResultOf(d, CommandFailed).value
        self.assertEqual((err.error_code, len(seeder.calls)), (IMAGE_SEED_FAILED, 1))
        self.assertIn("HTTP 401", err.error_message)

    def test_another_answer_fails_at_once(self) -> None:
        d, _ctx, _seeder = self.start([Attempt("http", code=404, why="HTTP 404")])
        self.assertIn("HTTP 404", self.failureResultOf(d, CommandFailed).value.error_message)

    def test_a_broken_download_resumes_where_it_stopped(self) -> None:
        d, ctx, seeder = self.start([half, whole])
        self.run_for(5)
        self.assertEqual(self.successResultOf(d), TOTAL)
        self.assertEqual([have for _t, have in seeder.calls], [0, TOTAL // 2])
        self.assertEqual(len(seeder.ids), 1)  # one download id across its resumes
        done = [f for f in ctx.frames if f["phase"] == "peer_download"]
        self.assertEqual(done[-1]["bytes_done"], TOTAL)

    def test_resumes_without_progress_give_up(self) -> None:
        d, _ctx, seeder = self.start([half])
        self.run_for(120)
        err = self.failureResultOf(d, CommandFailed).value
        self.assertIn("resumes without progress", err.error_message)
        self.assertEqual(len(seeder.calls), 1 + 3 + 1)

    def test_progress_while_the_body_arrives(self) -> None:
        """A long download reports its bytes every progress_interval, from the thread's meter."""
        pending: Deferred[Attempt] = Deferred()
        meters: list[seeding.Meter] = []

        def attempt(*args: Any) -> Deferred[Attempt]:
            meters.append(args[-1])
            return pending

        d, ctx, _seeder = self.start([whole])
        self.seeding.attempt = attempt  # the next attempt is the slow one
        d2 = ensureDeferred(self.seeding.download("10.1.0.2", 8271, "/image", b"tok", "p.tar", ctx, "img:1", 60))
        meters[0].total, meters[0].have = TOTAL, 100
        self.clock.advance(self.seeding.progress_interval)
        meters[0].have = 600
        self.clock.advance(self.seeding.progress_interval)
        frames = [f for f in ctx.frames if f["phase"] == "peer_download" and f["bytes_done"] in (100, 600)]
        self.assertEqual([f["bytes_done"] for f in frames], [100, 600])
        pending.callback(whole(0))
        self.assertEqual(self.successResultOf(d2), TOTAL)
        self.assertEqual(self.successResultOf(d), TOTAL)
        self.assertEqual(self.clock.getDelayedCalls(), [])  # the progress timer stopped


class PeerSourceTests(SynchronousTestCase):
    """source: {peer_url, token} is checked before anything is fetched (both come from the backend)."""

    def test_bad_sources_are_refused(self) -> None:
        from llmport_agent.ray.bundle import parse_bundle
        from llmport_agent.workloads.policy import parse_allowlist

        clock = Clock()
        s = ImageSeeding(clock, None, None, "/nonexistent", None)  # type: ignore[arg-type]
        s.attempt = lambda *a: self.fail("nothing may be fetched")  # type: ignore[assignment,return-value]
        bundle = parse_bundle({"image": "llmport-test/ray:1", "digest": "sha256:" + "a" * 64,
                               "requirements": {"gpus": "none"}}, allowlist=parse_allowlist("llmport-test"),
                              allowed_roots=(), token_dir="/nonexistent")
        ctx = RecordingContext(make_command("ensure_runtime_image", {}), clock)
        for url, token in (("https://10.0.0.2:8271/image", "tok"), ("http://10.0.0.2/image", "tok"),
                           ("http://u:p@10.0.0.2:8271/image", "tok"), ("http://10.0.0.2:99999/image", "tok"),
                           ("http://10.0.0.2:8271/image HTTP/1.1\r\nX: y", "tok"),
                           ("http://10.0.0.2:8271/im age", "tok"), ("http://10.0.0.2:8271/image", "to ken"),
                           ("http://10.0.0.2:8271/image", "tok\r\nX-Evil: 1"), (None, "tok")):
            d = ensureDeferred(s.load_from_peer(bundle, {"peer_url": url, "token": token}, ctx, "p/x:pending"))
            self.assertEqual(self.failureResultOf(d, CommandFailed).value.error_code, "invalid_command", url)
