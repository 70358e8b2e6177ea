"""JSON log lines: one flat object per line with time, level, logger, message and the event's fields."""

from __future__ import annotations

import io
import json

from twisted.logger import Logger, LogPublisher
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.logsetup import make_observer, want_json

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

    def test_message_text_is_not_mangled(self) -> None:
        """Patterns apply to values, not to the agent's own words ("token: mint a new one")."""
        line = self.emit(lambda log: log.critical("no enrollment token: mint a new one ({why})",
                                                  why="password=hunter22", reason="x"))[0]
        self.assertEqual(line["message"], "no enrollment token: mint a new one (password=***)")

    def test_a_fix_hint_in_a_field_survives(self) -> None:
        """
        The agent's fatal line carries its text in a field ({reason}), which is redacted: the
        hint after "token:" must survive it (issue 26: "no enrollment token: *** a new one").
        """
        from llmport_agent.session.enrollment import TOKEN_HELP

        reason = f"No credential in /var/lib/x and no enrollment token: {TOKEN_HELP} and set Y"
        line = self.emit(lambda log: log.critical("{reason}", reason=reason))[0]
        self.assertEqual(line["message"], reason)
        self.assertEqual(line["reason"], reason)
        self.assertIn("token: mint a new one with POST", line["message"])

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
