"""State file: atomic durable writes, permissions, corruption handling, XDG fallback."""

from __future__ import annotations

import json
import os
import stat

from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.core.state import StateStore, resolve_state_path
from llmport_agent.core.storage import atomic_write
from llmport_agent.demo.testing import SynchronousRunner


class StateTests(SynchronousTestCase):
    def store(self, path: str | None = None) -> StateStore:
        path = path or os.path.join(self.mktemp(), "sub", "state.json")
        s = StateStore(SynchronousRunner(), path)
        self.successResultOf(s.load())
        return s

    def test_write_permissions(self) -> None:
        """The file is 0600 and its directory 0700."""
        s = self.store()
        self.successResultOf(s.update(credential="c.secret", node_id="n"))
        self.assertEqual(stat.S_IMODE(os.stat(s.path).st_mode), 0o600)
        self.assertEqual(stat.S_IMODE(os.stat(os.path.dirname(s.path)).st_mode), 0o700)
        with open(s.path) as f:
            self.assertEqual(json.load(f)["credential"], "c.secret")

    def test_round_trip_and_delete(self) -> None:
        """Values survive a reload; None deletes a key."""
        s = self.store()
        self.successResultOf(s.update(credential="a.b", draining=True))
        self.successResultOf(s.update(draining=None))
        s2 = self.store(s.path)
        self.assertEqual(s2.credential, "a.b")
        self.assertNotIn("draining", s2.data)

    def test_atomic_no_temp_left(self) -> None:
        """A write leaves no temporary file and replaces the whole content."""
        d = self.mktemp()
        os.makedirs(d)
        p = os.path.join(d, "f.json")
        atomic_write(p, b"one")
        atomic_write(p, b"two")
        self.assertEqual(os.listdir(d), ["f.json"])
        with open(p, "rb") as f:
            self.assertEqual(f.read(), b"two")

    def test_failed_write_keeps_old_file(self) -> None:
        """If writing fails midway the old file stays intact."""
        d = self.mktemp()
        os.makedirs(d)
        p = os.path.join(d, "f.json")
        atomic_write(p, b"old")

        class Boom(bytes):
            pass

        self.assertRaises(TypeError, atomic_write, p, object())  # type: ignore[arg-type]
        with open(p, "rb") as f:
            self.assertEqual(f.read(), b"old")
        self.assertEqual(os.listdir(d), ["f.json"])

    def test_corrupt_moved_aside(self) -> None:
        """A corrupt file is moved aside with a UTC timestamp; the agent carries on with empty state."""
        d = self.mktemp()
        os.makedirs(d)
        p = os.path.join(d, "state.json")
        with open(p, "w") as f:
            f.write("{not json")
        s = self.store(p)
        self.assertEqual(s.data, {})
        moved = [n for n in os.listdir(d) if n.startswith("state.json.corrupt-")]
        self.assertEqual(len(moved), 1)
        self.assertRegex(moved[0], r"state\.json\.corrupt-\d{8}T\d{6}Z")

    def test_json_list_is_corrupt(self) -> None:
        """A JSON value that is not an object counts as corrupt too."""
        d = self.mktemp()
        os.makedirs(d)
        p = os.path.join(d, "state.json")
        with open(p, "w") as f:
            f.write("[1,2]")
        s = self.store(p)
        self.assertEqual(s.data, {})

    def test_xdg_fallback(self) -> None:
        """A non-root user who cannot write the configured directory gets the XDG state dir."""
        if os.geteuid() == 0:
            path, note = resolve_state_path("/proc/llmport/state.json")
            self.assertEqual(path, "/proc/llmport/state.json")
            self.assertIsNone(note)
            return
        path, note = resolve_state_path("/proc/llmport/state.json", {"XDG_STATE_HOME": "/tmp/x"})
        self.assertEqual(path, "/tmp/x/llmport-agent/state.json")
        self.assertIn("not writable", note or "")
