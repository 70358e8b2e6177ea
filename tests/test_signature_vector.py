"""
Command signatures against a fixed test vector computed by hand from protocol.md 3.1, not
through the implementation:

    key       = HMAC-SHA256(key = credential as UTF-8, message = b"command-signing")
    signed    = the command object without "signature", JSON, sorted keys, separators (",", ":"),
                ASCII-escaped
    signature = lower-case hex HMAC-SHA256(key, signed)

The literals below were produced once with the standard library from that recipe; the command
carries non-ASCII text, nested objects with unsorted keys and nulls, so a key order, an
escaping or a separator slip changes the signature.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.parse import signature_for, signature_ok, signing_key
from llmport_agent.demo.testing import FakeSession

from .test_pipeline import Harness

CREDENTIAL = "0b6d5a2e-4f1c-4e0a-9d8b-2a7c3f1e9b10.Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MGFiY2RlZmdoaWprbG0"
KEY_HEX = "71fe0d07edf55149a63e4040bd2401cd9a2a0b43a626dadbcc4ae602d3ae075e"
SIGNED_BYTES = (
    b'{"acked_at":null,"command_type":"noop","completed_at":null,"correlation_id":null,'
    b'"dispatched_at":"2026-01-02T03:04:06+00:00","error_code":null,"error_message":null,'
    b'"id":"6f1c2d3e-4b5a-4c6d-8e9f-0a1b2c3d4e5f","idempotency_key":"k-1",'
    b'"issued_at":"2026-01-02T03:04:05+00:00","node_id":"11111111-2222-4333-8444-555555555555",'
    b'"payload":{"alpha":["\\u00e9","\\u65e5\\u672c"],"nested":{"a":2.5,"b":true},"zeta":1},'
    b'"result":null,"started_at":null,"status":"dispatched","timeout_sec":900}'
)
SIGNATURE = "80331d0e33f775a38a404b293cae0b238151830bf3adb0a65b02cfcf71ca8227"


def vector_command(**extra: Any) -> dict[str, Any]:
    cmd: dict[str, Any] = {
        "status": "dispatched",
        "id": "6f1c2d3e-4b5a-4c6d-8e9f-0a1b2c3d4e5f",
        "node_id": "11111111-2222-4333-8444-555555555555",
        "command_type": "noop",
        "correlation_id": None,
        "idempotency_key": "k-1",
        "payload": {"zeta": 1, "nested": {"b": True, "a": 2.5}, "alpha": ["\u00e9", "\u65e5\u672c"]},
        "result": None,
        "timeout_sec": 900,
        "error_code": None,
        "error_message": None,
        "issued_at": "2026-01-02T03:04:05+00:00",
        "dispatched_at": "2026-01-02T03:04:06+00:00",
        "acked_at": None,
        "started_at": None,
        "completed_at": None,
    }
    cmd.update(extra)
    return cmd


class VectorTests(SynchronousTestCase):
    def test_vector_is_self_consistent(self) -> None:
        """The literals agree with each other under the standard library (guards the vector itself)."""
        key = hmac.new(CREDENTIAL.encode("utf-8"), b"command-signing", hashlib.sha256).digest()
        self.assertEqual(key.hex(), KEY_HEX)
        self.assertEqual(hmac.new(key, SIGNED_BYTES, hashlib.sha256).hexdigest(), SIGNATURE)

    def test_signing_key(self) -> None:
        self.assertEqual(signing_key(CREDENTIAL).hex(), KEY_HEX)

    def test_signature_for_matches_the_vector(self) -> None:
        self.assertEqual(signature_for(vector_command(), CREDENTIAL), SIGNATURE)
        # the signature field itself is not signed
        self.assertEqual(signature_for(vector_command(signature="whatever"), CREDENTIAL), SIGNATURE)

    def test_signature_ok(self) -> None:
        self.assertTrue(signature_ok(vector_command(signature=SIGNATURE), CREDENTIAL))
        wrong = SIGNATURE[:-1] + ("0" if SIGNATURE[-1] != "0" else "1")
        self.assertFalse(signature_ok(vector_command(signature=wrong), CREDENTIAL))
        self.assertFalse(signature_ok(vector_command(signature=SIGNATURE), CREDENTIAL + "x"))
        changed = vector_command(signature=SIGNATURE)
        changed["payload"]["zeta"] = 2
        self.assertFalse(signature_ok(changed, CREDENTIAL))


class PipelineVectorTests(SynchronousTestCase):
    """The pipeline, holding the vector's credential, runs the signed command and refuses a forged one."""

    def harness(self) -> Harness:
        self.patch(FakeSession, "credential", lambda _self: CREDENTIAL)
        return Harness(self)

    def test_vector_signed_command_runs(self) -> None:
        h = self.harness()
        c = vector_command(signature=SIGNATURE)
        h.deliver(c)
        result = h.frames_for(c["id"])[-1]
        self.assertEqual(result["type"], "command_result")
        self.assertTrue(result["success"], result)
        self.assertEqual(h.calls, [("noop", c["id"])])

    def test_one_digit_off_is_refused(self) -> None:
        h = self.harness()
        wrong = SIGNATURE[:10] + ("a" if SIGNATURE[10] != "a" else "b") + SIGNATURE[11:]
        c = vector_command(signature=wrong)
        h.deliver(c)
        result = h.frames_for(c["id"])[-1]
        self.assertFalse(result["success"])
        self.assertEqual(result["error_code"], "signature_invalid")
        self.assertEqual(h.calls, [])
