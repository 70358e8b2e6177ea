"""
Frames that do not parse as a whole. The backend lists its 50 oldest pending commands in every
C{commands} frame: one command that breaks the JSON parser (nested past its recursion limit,
invalid UTF-8 in one string) must not cost the others, in this frame or any later one. The
frame is taken apart item by item; a command whose id can be read is answered
C{invalid_command}; the rest run normally.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.commands.parse import MAX_COMMAND_DEPTH
from llmport_agent.devbackend import _stream as dev_stream
from llmport_agent.session.framesplit import UnparsedItem, salvage_frame
from tests.agentharness import AgentTestCase
from tests.test_pipeline import Harness, command

TERMINAL = ("succeeded", "failed")
MARKER = "DEEP-MARKER"


def sleep(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


class DeepStream(dev_stream.StreamProtocol):
    """The stand-in backend, serialising a marker as an array nested 1200 levels deep."""

    def _send_json(self, message: dict[str, Any]) -> None:
        text = json.dumps(message).replace(json.dumps(MARKER), deep(1200))
        self.sendMessage(text.encode("utf-8"), isBinary=False)


class DeepCommandTests(AgentTestCase):
    async def test_over_deep_command_next_to_a_good_one(self) -> None:
        """
        A host_op whose payload is nested 1200 levels deep (valid JSON the parser cannot take)
        and a collect_diagnostics, listed together in every commands frame: the diagnostics
        succeed, the deep one fails with invalid_command, the session stays up.
        """
        self.patch(dev_stream.StreamFactory, "protocol", DeepStream)
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        opens = agent.session.stats.opens
        bad = backend.issue_command(node_id, "host_op", {"blob": MARKER})
        good = backend.issue_command(node_id, "collect_diagnostics", {})
        await backend.wait_for(
            lambda: all(backend.command(c["id"])["status"] in TERMINAL for c in (bad, good)), 15
        )
        self.flushLoggedErrors(RecursionError)
        self.assertEqual(backend.command(good["id"])["status"], "succeeded")
        rec = backend.command(bad["id"])
        self.assertEqual((rec["status"], rec["error_code"]), ("failed", "invalid_command"))
        self.assertIn("could not be parsed", rec["error_message"])
        self.assertEqual(agent.session.stats.opens, opens)
        later = backend.issue_command(node_id, "refresh_inventory", {})
        await backend.wait_for(lambda: backend.command(later["id"])["status"] == "succeeded", 15)

    async def test_deep_but_parsable_command(self) -> None:
        """
        A command nested 800 levels deep parses, but would break every recursive consumer
        after it (journal copy, serialisation): it is answered invalid_command, not left
        unanswered (the backend would list it for ever).
        """
        text_payload = "{}"
        for _ in range(800):
            text_payload = '{"a":' + text_payload + "}"

        class Splice(dev_stream.StreamProtocol):
            # The backend's JSON encoder here cannot write it: splice it into the frame.
            def _send_json(self, message: dict[str, Any]) -> None:
                text = json.dumps(message).replace(json.dumps({"blob": MARKER}), text_payload)
                self.sendMessage(text.encode("utf-8"), isBinary=False)

        self.patch(dev_stream.StreamFactory, "protocol", Splice)
        backend = await self.start_backend()
        agent = self.start_agent(backend)
        node_id = await self.wait_connected(backend, agent)
        cmd = backend.issue_command(node_id, "collect_diagnostics", {"blob": MARKER})
        good = backend.issue_command(node_id, "refresh_inventory", {})
        await backend.wait_for(
            lambda: all(backend.command(c["id"])["status"] in TERMINAL for c in (cmd, good)), 15
        )
        self.flushLoggedErrors(RecursionError)
        rec = backend.command(cmd["id"])
        self.assertEqual((rec["status"], rec["error_code"]), ("failed", "invalid_command"))
        self.assertEqual(backend.command(good["id"])["status"], "succeeded")


class SalvageTests(SynchronousTestCase):
    """The scanner on its own."""

    def test_items_parsed_one_by_one(self) -> None:
        good = command("noop")
        bad_id = str(uuid.uuid4())
        text = (
            '{"type": "commands", "items": ['
            + json.dumps(good)
            + f', {{"id": "{bad_id}", "command_type": "host_op", "payload": {deep(3000)}}}'
            + ', {"id": "x", "payload": "\\u005d\\"}]{["}'
            + "]}"
        )
        frame, problems = salvage_frame(text.encode())  # type: ignore[misc]
        self.assertEqual(frame["type"], "commands")
        items = frame["items"]
        self.assertEqual(items[0], good)
        self.assertIsInstance(items[1], UnparsedItem)
        self.assertEqual(items[1].fields, {"id": bad_id, "command_type": "host_op"})
        self.assertIn("nested too deeply", items[1].reason)
        self.assertEqual(items[2], {"id": "x", "payload": ']"}]{['})
        self.assertEqual(len(problems), 1)

    def test_invalid_utf8_in_one_item(self) -> None:
        good = command("noop")
        raw = b'{"type":"commands","items":[' + json.dumps(good).encode() + b',{"id":"' + \
            str(uuid.uuid4()).encode() + b'","payload":{"s":"\xff\xfe"}}]}'
        frame, _ = salvage_frame(raw)  # type: ignore[misc]
        self.assertEqual(frame["items"][0], good)
        self.assertIn("UTF-8", frame["items"][1].reason)

    def test_deep_profile_in_hello(self) -> None:
        """A hello_ack whose profile is too deep still delivers its commands."""
        good = command("noop")
        text = '{"type":"hello_ack","session_id":"s","node_id":"n","profile":{"x":' + deep(5000) + \
            '},"commands":[' + json.dumps(good) + "]}"
        frame, problems = salvage_frame(text.encode())  # type: ignore[misc]
        self.assertEqual(frame["commands"], [good])
        self.assertIsInstance(frame["profile"], UnparsedItem)
        self.assertEqual(frame["node_id"], "n")

    def test_not_an_object(self) -> None:
        for text in (b"[1,2", b"garbage", b'{"a": [1, 2', b'{"a" 1}', b"{} trailing", b""):
            self.assertIsNone(salvage_frame(text), text)

    def test_large_deep_frame_is_linear(self) -> None:
        """8 MiB of brackets: no recursion, one pass (a run of brackets is one step)."""
        text = '{"type":"commands","items":[{"id":"' + str(uuid.uuid4()) + '","payload":' + \
            deep(4 * 1024 * 1024) + "}]}"
        frame, _ = salvage_frame(text.encode())  # type: ignore[misc]
        self.assertIsInstance(frame["items"][0], UnparsedItem)

    def test_costly_frame_is_bounded(self) -> None:
        """
        A broken item whose structure is costly to walk (8 MiB of `[],` pairs around a deep
        core): the scanner stops at its budget, the good items before it come through, and the
        costly command itself is still answerable (its id came first).
        """
        good = command("noop")
        cid = str(uuid.uuid4())
        text = '{"type":"commands","items":[' + json.dumps(good) + ',{"id":"' + cid + \
            '","payload":[' + "[]," * (3 * 1024 * 1024) + deep(2000) + "]}," + json.dumps(command("noop")) + "]}"
        frame, problems = salvage_frame(text.encode())  # type: ignore[misc]
        self.assertEqual(frame["items"][0], good)
        self.assertEqual(frame["items"][1].get("id"), cid)
        self.assertEqual(len(frame["items"]), 2)
        self.assertIn("left out", problems[-1])

    def test_pipeline_answers_an_unparsed_command(self) -> None:
        """The pipeline answers a salvaged command with invalid_command under its own id."""
        h = Harness(self)
        cid = str(uuid.uuid4())
        good = command("noop")
        h.pipeline.frame_received({"type": "commands", "items": [
            UnparsedItem({"id": cid, "command_type": "host_op"}, "it is nested too deeply"), good]})
        self.assertEqual(h.kinds_for(cid), ["command_ack", "command_result"])
        result = h.frames_for(cid)[-1]
        self.assertEqual(result["error_code"], "invalid_command")
        self.assertIn("nested too deeply", result["error_message"])
        self.assertEqual(h.calls, [("noop", good["id"])])

    def test_depth_limit(self) -> None:
        """A command nested deeper than MAX_COMMAND_DEPTH is refused; one just inside runs."""
        h = Harness(self)
        inside: Any = {}
        for _ in range(MAX_COMMAND_DEPTH - 4):
            inside = {"a": inside}
        outside: Any = []
        for _ in range(MAX_COMMAND_DEPTH + 1):
            outside = [outside]
        ok, bad = command("noop", {"v": inside}), command("noop", {"v": outside})
        h.deliver(ok, bad)
        self.assertEqual(h.calls, [("noop", ok["id"])])
        self.assertEqual(h.frames_for(bad["id"])[-1]["error_code"], "invalid_command")
