"""JSON log lines: one flat object per line with time, level, logger, message and the event's fields."""

from __future__ import annotations

import io
import json
import os
from typing import Any

from twisted.logger import Logger, LogPublisher
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.core.logsetup import make_observer, want_json

CREDENTIAL = "0b7f3c52-1d2e-4f60-9a8b-7c6d5e4f3a21." + "A" * 43


class JSONLinesTests(SynchronousTestCase):
    def emit(self, fn: object, level: str = "INFO", secrets: list[str] | None = None) -> list[dict[str, object]]:
        out = io.StringIO()
        publisher = LogPublisher()
        publisher.addObserver(make_observer(level, stream=out, json=True, secrets=lambda: secrets or []))
        log = Logger(namespace="llmport_agent.session.service", observer=publisher)
        fn(log)  # type: ignore[operator]
        return [json.loads(line) for line in out.getvalue().splitlines()]

    def test_flat_fields(self) -> None:
        lines = self.emit(lambda log: log.info("Connected to {url} after {n} tries", url="ws://h/x", n=3))
        self.assertEqual(len(lines), 1)
        line = lines[0]
        self.assertEqual(line["level"], "info")
        self.assertEqual(line["logger"], "llmport_agent.session.service")
        self.assertEqual(line["message"], "Connected to ws://h/x after 3 tries")
        self.assertEqual((line["url"], line["n"]), ("ws://h/x", 3))
        self.assertRegex(str(line["time"]), r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
        self.assertFalse([k for k in line if k.startswith("log_") or k in ("format", "__class_uuid__")])

    def test_failure_and_objects(self) -> None:
        def log_it(log: Logger) -> None:
            try:
                raise ValueError("boom")
            except ValueError:
                log.failure("Handling {what} failed", what={"a": object()})

        line = self.emit(log_it)[0]
        self.assertEqual(line["level"], "critical")
        self.assertEqual(line["error_type"], "ValueError")
        self.assertIn("boom", str(line["error"]))
        self.assertIsInstance(line["what"], dict)

    def test_secrets_redacted(self) -> None:
        token = "tok-" + "q" * 28
        line = self.emit(lambda log: log.warn("header Bearer {c} and {t}", c=CREDENTIAL, t=token),
                         secrets=[token])[0]
        text = json.dumps(line)
        self.assertNotIn(CREDENTIAL, text)
        self.assertNotIn(token, text)

    def test_a_secret_across_the_field_cut_is_not_kept_in_part(self) -> None:
        """A field (and a traceback) longer than MAX_FIELD_CHARS with a secret across the cut."""
        from llmport_agent.core.logsetup import MAX_FIELD_CHARS

        token = "tok-" + "Q" * 40
        head = "a" * (MAX_FIELD_CHARS - 10) + token + "b" * 100
        line = self.emit(lambda log: log.info("got {v}", v=head), secrets=[token])[0]
        self.assertNotIn(token[:8], json.dumps(line))
        self.assertGreater(len(str(line["v"])), MAX_FIELD_CHARS - 200)  # bounded, not emptied
        self.assertNotIn(CREDENTIAL[:30], str(line["v"]))

        def log_it(log: Logger) -> None:
            try:
                raise ValueError(CREDENTIAL[10:] + "x" * MAX_FIELD_CHARS)
            except ValueError:
                log.failure("failed {v}", v=("y" * (MAX_FIELD_CHARS - 40)) + CREDENTIAL)

        line = self.emit(log_it)[0]
        self.assertNotIn(CREDENTIAL[:40], json.dumps(line))

    def test_message_text_is_not_mangled(self) -> None:
        """Patterns apply to values, not to the agent's own words ("token: mint a new one")."""
        line = self.emit(lambda log: log.critical("no enrollment token: mint a new one ({why})",
                                                  why="password=hunter22", reason="x"))[0]
        self.assertEqual(line["message"], "no enrollment token: mint a new one (password=***)")

    def test_a_fix_hint_in_a_field_survives(self) -> None:
        """
        The agent's fatal line: its fix hint must survive redaction (issue 26: "no enrollment
        token: *** a new one"), while fields are redacted strictly (the hint goes into the
        format literal, see AgentService._fatal).
        """
        from llmport_agent.agent import service
        from llmport_agent.session.shared import TOKEN_HELP

        reason = f"No credential in /var/lib/x and no enrollment token: {TOKEN_HELP} and set Y"

        def fatal(log: Logger) -> None:
            fake = type("Fake", (), {"log": log, "exit_status": 0, "_fatal_cb": None})()
            service.AgentService._fatal(fake, 78, reason)  # type: ignore[arg-type]

        line = self.emit(fatal)[0]
        self.assertEqual(line["message"], reason)
        self.assertIn("token: mint a new one with POST", line["message"])

    def test_foreign_text_in_a_field_is_masked_strictly(self) -> None:
        """The relaxed "sentence" rule is for the agent's own format text, not field values."""
        err = "registry login failed: password: letmein now retry"
        line = self.emit(lambda log: log.warn("Pull failed: {error}", error=err))[0]
        self.assertNotIn("letmein", json.dumps(line))
        self.assertEqual(line["message"], "Pull failed: registry login failed: password: *** now retry")
        line = self.emit(lambda log: log.warn("no enrollment token: mint one ({e})", e="x"))[0]
        self.assertEqual(line["message"], "no enrollment token: mint one (x)")

    def test_level_filter(self) -> None:
        self.assertEqual(self.emit(lambda log: log.debug("hidden"), level="INFO"), [])

    def test_auto_is_json_when_not_a_terminal(self) -> None:
        self.assertTrue(want_json("auto", io.StringIO()))
        self.assertFalse(want_json("text", io.StringIO()))
        self.assertTrue(want_json("json", io.StringIO()))

        class TTY(io.StringIO):
            def isatty(self) -> bool:
                return True

        self.assertFalse(want_json("auto", TTY()))


def parse_native(datagram: bytes) -> dict[str, str]:
    """The journal's native protocol, as journald reads it (systemd's journal-native protocol)."""
    import struct

    fields: dict[str, str] = {}
    rest = datagram
    while rest:
        nl = rest.index(b"\n")
        eq = rest.find(b"=", 0, nl)
        if eq >= 0:
            name, value, rest = rest[:eq], rest[eq + 1:nl], rest[nl + 1:]
        else:
            name = rest[:nl]
            (size,) = struct.unpack("<Q", rest[nl + 1:nl + 9])
            value = rest[nl + 9:nl + 9 + size]
            assert rest[nl + 9 + size:nl + 10 + size] == b"\n"
            rest = rest[nl + 10 + size:]
        fields[name.decode()] = value.decode()
    return fields


class JournalTests(SynchronousTestCase):
    """
    Under systemd the operator reads `journalctl -u llmport-agent`: readable lines whose
    priority `journalctl -p warning` filters on, the fields still there (issue 26: raw JSON lines,
    every one at priority 6).
    """

    def journal_socket(self) -> tuple[str, Any]:
        import shutil
        import socket
        import tempfile

        d = tempfile.mkdtemp(prefix="jr")  # a short path: AF_UNIX paths are at most 107 bytes
        self.addCleanup(shutil.rmtree, d, True)
        path = os.path.join(d, "socket")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        server.bind(path)
        server.setblocking(False)
        self.addCleanup(server.close)
        return path, server

    def received(self, server: Any) -> list[dict[str, str]]:
        out = []
        while True:
            try:
                out.append(parse_native(server.recv(1 << 20)))
            except BlockingIOError:
                return out

    def emit(self, fn: Any, socket_path: str | None, secrets: list[str] | None = None) -> str:
        stream = io.StringIO()
        publisher = LogPublisher()
        publisher.addObserver(make_observer("INFO", stream=stream, secrets=lambda: secrets or [],
                                            format="journal", journal_socket=socket_path))
        fn(Logger(namespace="llmport_agent.session.service", observer=publisher))
        return stream.getvalue()

    def test_native_entries_with_priorities_and_fields(self) -> None:
        from llmport_agent.session.shared import TOKEN_HELP

        path, server = self.journal_socket()

        def log_it(log: Logger) -> None:
            log.debug("hidden")
            log.info("Connected to {url} after {n} tries", url="ws://h/x", n=3)
            log.warn("Heartbeat late by {seconds} s", seconds=2.5)
            log.error("Command {id} failed: {why}", id="c1", why="Bearer " + CREDENTIAL)
            # As AgentService._fatal logs it: the fix hint in the format literal.
            log.critical("{reason}" + TOKEN_HELP + "{reason_rest}", reason="no enrollment token: ",
                         reason_rest=" and set X")
            try:
                raise ValueError("boom")
            except ValueError:
                log.failure("Handling {what} failed", what="a frame")

        text = self.emit(log_it, path, secrets=[])
        self.assertEqual(text, "")  # all went to the journal
        entries = self.received(server)
        self.assertEqual([e["PRIORITY"] for e in entries], ["6", "4", "3", "2", "2"])
        self.assertEqual(entries[0]["MESSAGE"], "Connected to ws://h/x after 3 tries")  # a line, not JSON
        self.assertEqual((entries[0]["URL"], entries[0]["N"]), ("ws://h/x", "3"))
        self.assertEqual(entries[0]["SYSLOG_IDENTIFIER"], "llmport-agent")
        self.assertEqual(entries[0]["LOGGER"], "llmport_agent.session.service")
        self.assertEqual(entries[1]["SECONDS"], "2.5")
        self.assertNotIn(CREDENTIAL, json.dumps(entries))
        self.assertIn("token: mint a new one with POST", entries[3]["MESSAGE"])
        self.assertEqual(entries[4]["MESSAGE"], "Handling a frame failed")
        self.assertIn("ValueError: boom", entries[4]["ERROR"])  # multi-line: the binary-safe form
        self.assertIn("\n", entries[4]["ERROR"])
        self.assertEqual(entries[4]["ERROR_TYPE"], "ValueError")

    def test_a_field_cannot_pose_as_the_message_or_priority(self) -> None:
        path, server = self.journal_socket()
        self.emit(lambda log: log.warn("real {priority} {message_id}", priority="0", message_id="x",
                                       big="y" * 200_000), path)
        (entry,) = self.received(server)
        self.assertEqual((entry["PRIORITY"], entry["MESSAGE"]), ("4", "real 0 x"))
        self.assertEqual((entry["FIELD_PRIORITY"], entry["FIELD_MESSAGE_ID"]), ("0", "x"))
        self.assertLessEqual(len(entry.get("BIG", "")), 8192)

    def test_without_the_socket_lines_carry_priority_prefixes(self) -> None:
        """sd-daemon(3): journald reads <N> at the start of a stdout line as its priority."""
        def log_it(log: Logger) -> None:
            log.info("started")
            log.warn("Heartbeat late by {seconds} s", seconds=2.5)
            try:
                raise ValueError("boom")
            except ValueError:
                log.failure("Handling failed")

        text = self.emit(log_it, os.path.join(os.path.abspath(self.mktemp()), "absent"))
        lines = text.splitlines()
        self.assertEqual(lines[:3], ["<6>started", "<4>Heartbeat late by 2.5 s", "<2>Handling failed"])
        self.assertTrue(all(line.startswith("<2>") for line in lines[2:]), lines)
        self.assertIn("<2>builtins.ValueError: boom", lines)

    def test_auto_is_the_journal_under_systemd(self) -> None:
        from llmport_agent.core.logsetup import choose_format

        path = self.mktemp()
        with open(path, "w") as stream:
            st = os.fstat(stream.fileno())
            env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
            self.assertEqual(choose_format("auto", stream, env), "journal")
            self.assertEqual(choose_format("auto", stream, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"}),
                             "json")  # stdout is not the journal's stream (redirected)
            self.assertEqual(choose_format("auto", stream, {}), "json")
            self.assertEqual(choose_format("json", stream, env), "json")  # JSON stays reachable
            self.assertEqual(choose_format("text", stream, env), "text")
