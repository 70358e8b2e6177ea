"""
JSON nested deeper than Python's recursion limit (a few kilobytes of C{[}) makes C{json.loads}
raise C{RecursionError}, which is not a C{ValueError}. Where a container or the network writes
the JSON, that must read as "not JSON", never escape: a replica log line would stop the Ray
Serve log pass at that line for good, a helper's answer or Ray's metrics file would fail the
command with a traceback, and a backend reply would escape the enrollment, rotation and join
error handling.
"""

from __future__ import annotations

import os
from typing import Any

from treq.testing import StubTreq
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from llmport_agent.logs import rayserve
from llmport_agent.ray import helpercli
from llmport_agent.session.backend_http import BackendHTTP, Rejected, Transient

DEEP = "[" * 50_000
NOW = 1_800_000_000 * 1_000_000_000


class ContainerWrittenTests(SynchronousTestCase):
    def test_a_deep_replica_log_line_is_shipped_as_text(self) -> None:
        line = '{"levelname": ' + DEEP
        self.assertEqual(rayserve.line_fields(line, NOW), (NOW, "unknown"))

    def test_a_deep_line_does_not_stop_the_pass(self) -> None:
        root = os.path.abspath(self.mktemp())
        serve = os.path.join(root, "session_1", "logs", "serve")
        os.makedirs(serve)
        with open(os.path.join(serve, "replica_llmport-a_dep_r1.log"), "w") as f:
            f.write('{"a": ' + DEEP[:20_000] + "\nINFO 2027-01-15 08:00:00,000 after\n")
        result = rayserve.scan(root, {}, first_run=False, now_ns=NOW)
        lines = [e[2] for read in result.files for e in read.entries]
        self.assertEqual(len(lines), 2)
        self.assertEqual(lines[1], "INFO 2027-01-15 08:00:00,000 after")

    def test_a_deep_helper_answer_is_no_answer(self) -> None:
        self.assertIsNone(helpercli.first_json_object("{" + '"a":' + DEEP + "\n"))

    def test_a_deep_metrics_file_is_no_targets(self) -> None:
        self.assertEqual(helpercli.metrics_targets(DEEP), {"enabled": False, "targets": []})


class Deep(Resource):
    isLeaf = True

    def __init__(self, code: int) -> None:
        super().__init__()
        self.code = code

    def render(self, request: Any) -> bytes:
        request.setResponseCode(self.code)
        return ('{"detail": ' + DEEP[:60_000]).encode()


class BackendTests(SynchronousTestCase):
    def client(self, code: int) -> BackendHTTP:
        return BackendHTTP(Clock(), StubTreq(Deep(code)), "http://b.example", 5)

    def outcome(self, code: int, call: Any) -> Any:
        """The call's failure, or C{None} when it answered (a log sink's 404 is "no sink")."""
        d = Deferred.fromCoroutine(call(self.client(code)))
        results: list[Any] = []
        d.addBoth(results.append)
        self.assertEqual(len(results), 1)
        return results[0] if isinstance(results[0], Failure) else None

    def test_deep_replies_are_malformed_not_a_recursion_error(self) -> None:
        calls = {
            "enroll": lambda c: c.enroll("tok", "a", "h", {}, "1"),
            "rotate": lambda c: c.rotate("c.red", 5),
            "whoami": lambda c: c.whoami("c.red"),
            "join": lambda c: c.request_join("a", "h", {}, "1"),
            "collect": lambda c: c.collect_join("r1", "secret"),
            "secret": lambda c: c.cluster_secret("ref", "c.red", 5),
            "sink": lambda c: c.log_sink("c.red"),
        }
        for name, call in calls.items():
            for code in (200, 404, 401, 502):
                f = self.outcome(code, call)
                self.assertTrue(f is None or f.check(Transient, Rejected), f"{name} {code}: {f!r}")


class NetworkAnswerTests(SynchronousTestCase):
    def test_a_deep_error_detail_is_no_detail(self) -> None:
        from llmport_agent.models._http import detail_of

        self.assertEqual(detail_of(('{"detail": ' + DEEP).encode()), "")

    def test_doctor_shows_whoami_without_escapes_or_a_traceback(self) -> None:
        import json

        from llmport_agent.doctor import checks
        from llmport_agent.doctor.run import make_context

        d = os.path.abspath(self.mktemp())
        os.makedirs(d)
        with open(os.path.join(d, "state.json"), "w") as f:
            json.dump({"credential": "c.red"}, f)
        ctx = make_context(os.path.join(d, "absent.env"), {
            "LLM_PORT_NODE_AGENT_BACKEND_URL": "http://127.0.0.1:9",
            "LLM_PORT_NODE_AGENT_STATE_PATH": os.path.join(d, "state.json"),
            "LLM_PORT_NODE_AGENT_OPS_PORT": "0"})
        for body, shown in ((DEEP.encode(), "(node )"), (b'{"node_id": "n1\\u001b[2J"}', "(node n1?[2J)")):
            self.patch(checks, "_http", lambda *a, body=body, **kw: (200, {}, body))
            findings = checks.check_credential(ctx)
            self.assertEqual([f.status for f in findings], ["ok"])
            self.assertIn(shown, findings[0].detail)
            self.assertNotIn("\x1b", findings[0].line())
