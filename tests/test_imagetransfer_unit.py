"""
The resume decisions of L{llmport_agent.workloads.imagetransfer} on the answers a backend can
give to C{Range: bytes=<have>-} (protocol 10.4), without a network or an engine.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http_headers import Headers

from llmport_agent.commands.base import CommandFailed
from llmport_agent.workloads.imagetransfer import ImageTransfer, _Restart, parse_content_range

ID = "sha256:" + "a" * 64


class Answer:
    def __init__(self, code: int, headers: dict[str, str], body: bytes = b"") -> None:
        self.code = code
        self.headers = Headers({k: [v] for k, v in headers.items()})
        self.length = len(body)
        self._body = body

    def content(self) -> Deferred[bytes]:
        return succeed(self._body)

    def deliverBody(self, protocol: Any) -> None:
        """The body at once, then its end (as twisted's Response delivers it)."""
        from twisted.python.failure import Failure
        from twisted.web.client import ResponseDone

        protocol.makeConnection(None)
        if self._body:
            protocol.dataReceived(self._body)
        protocol.connectionLost(Failure(ResponseDone()))


def transfer() -> ImageTransfer:
    return ImageTransfer(None, None, None, "http://b.invalid", lambda: "secret-credential", stall_sec=60)  # type: ignore[arg-type]


class ResumeAnswerTests(SynchronousTestCase):
    def answer(self, response: Answer, have: int = 100, total: int = 1000) -> Any:
        d = Deferred.fromCoroutine(transfer()._resume_answer(response, "x/y:1", "secret-credential", have, total, ID))
        return d

    def test_content_range(self) -> None:
        self.assertEqual(parse_content_range("bytes 100-999/1000"), (100, 999, 1000))
        self.assertEqual(parse_content_range("bytes */1000"), (None, None, 1000))
        self.assertEqual(parse_content_range("bytes 0-9/*"), (0, 9, None))
        self.assertEqual(parse_content_range("items 1-2/3"), (None, None, None))
        self.assertEqual(parse_content_range(None), (None, None, None))

    def test_206_where_it_stopped_continues(self) -> None:
        r = Answer(206, {"content-range": "bytes 100-999/1000", "x-image-id": ID})
        self.assertIs(self.successResultOf(self.answer(r)), r)

    def test_206_elsewhere_or_other_image_restarts(self) -> None:
        for headers in (
            {"content-range": "bytes 0-999/1000", "x-image-id": ID},
            {"content-range": "bytes 100-999/2000", "x-image-id": ID},
            {"content-range": "bytes 100-999/1000", "x-image-id": "sha256:" + "b" * 64},
            {"x-image-id": ID},
        ):
            f = self.failureResultOf(self.answer(Answer(206, headers)), _Restart)
            self.assertIsNone(f.value.response)

    def test_416_with_full_size_is_done(self) -> None:
        self.assertIsNone(self.successResultOf(self.answer(Answer(416, {"content-range": "bytes */1000"}), have=1000)))

    def test_416_otherwise_restarts(self) -> None:
        self.failureResultOf(self.answer(Answer(416, {"content-range": "bytes */900"}), have=1000), _Restart)
        self.failureResultOf(self.answer(Answer(416, {}), have=1000), _Restart)

    def test_200_restarts_with_that_answer(self) -> None:
        r = Answer(200, {"x-image-id": ID})
        f = self.failureResultOf(self.answer(r), _Restart)
        self.assertIs(f.value.response, r)

    def test_409_is_final(self) -> None:
        f = self.failureResultOf(
            self.answer(Answer(409, {}, b'{"detail": "This server holds another build (id X; secret-credential)."}')),
            CommandFailed,
        )
        self.assertEqual(f.value.error_code, "server_image_mismatch")
        self.assertIn("This server holds another build (id X; ***).", f.value.error_message)
        self.assertNotIn("secret-credential", f.value.error_message)

    def test_other_status_fails(self) -> None:
        f = self.failureResultOf(self.answer(Answer(503, {}, b'{"detail": "busy"}')), CommandFailed)
        self.assertEqual(f.value.error_code, "image_transfer_failed")
        self.assertIn("HTTP 503: busy", f.value.error_message)

    def test_query(self) -> None:
        t = transfer()
        self.assertEqual(t.url("x/y", "1", None, None), "http://b.invalid/api/node-files/images/save?image=x%2Fy&tag=1")
        self.assertEqual(
            t.url("x/y", "1", ID, "sha256:" + "c" * 64),
            "http://b.invalid/api/node-files/images/save?image=x%2Fy&tag=1&expect_id=sha256%3A" + "a" * 64
            + "&expect_rootfs=sha256%3A" + "c" * 64,
        )
