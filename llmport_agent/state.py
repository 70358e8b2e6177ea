"""
The agent's small persistent state (C{STATE_PATH}): credential, node id, backend-recorded host,
rotation time, node modes (maintenance, draining), the node profile.

Writes are atomic and durable (see L{llmport_agent.storage.atomic_write}), serialized, and run off
the reactor thread, serialisation to JSON included. A corrupt file is moved aside, never silently
dropped.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from attrs import define, field
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmport_agent.storage import atomic_write, ensure_private_dir, move_aside
from llmport_agent.threads import BlockingRunner

log = Logger()

STATE_VERSION = 1


class StateUnreadable(Exception):
    """The state file exists but cannot be read (permissions, I/O error): an operator must look."""


@define
class LoadResult:
    """What L{load_state} found."""

    data: dict[str, Any]
    moved_to: str | None = None
    problem: str | None = None


def resolve_state_path(configured: str, environ: dict[str, str] | None = None) -> tuple[str, str | None]:
    """
    Decide where state lives. When not root and the configured path's directory cannot be
    created or written, fall back to the XDG state directory.

    @return: (path, note) where note is a line to log when the fallback was taken.
    """
    env = dict(os.environ if environ is None else environ)
    directory = os.path.dirname(os.path.abspath(configured))
    if os.geteuid() == 0 or _writable_dir(directory):
        return configured, None
    base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    fallback = os.path.join(base, "llmport-agent", "state.json")
    return fallback, (
        f"{directory} is not writable by this user; keeping state in {fallback} instead "
        "(set LLM_PORT_NODE_AGENT_STATE_PATH to choose)"
    )


def _writable_dir(directory: str) -> bool:
    probe = directory
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return False
        probe = parent
    return os.access(probe, os.W_OK | os.X_OK)


def load_state(path: str) -> LoadResult:
    """Read the state file. Blocking. A damaged file is moved aside and an empty state returned."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return LoadResult({})
    except IsADirectoryError:
        moved = move_aside(path)
        return LoadResult({}, moved, f"{path} is a directory, not a state file")
    except OSError as e:
        # Not corruption: the file (and the credential in it) may be fine. Never move it aside.
        raise StateUnreadable(
            f"The state file {path} exists but cannot be read ({e.strerror or e}); fix its "
            "permissions or the disk and start the agent again (the credential in it is kept)"
        ) from None
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        moved = move_aside(path)
        return LoadResult({}, moved, f"{path} is corrupt ({e})")
    return LoadResult(data)


def token_fingerprint(token: str) -> str:
    """A non-reversible fingerprint, so state can remember which tokens were used."""
    return hashlib.sha256(b"llmport-agent-token:" + token.encode()).hexdigest()[:32]


@define
class StateStore:
    """
    In-memory state with durable, serialized writes.

    Keys: C{credential}, C{pending_credential} (a rotation in doubt), C{node_id}, C{agent_id},
    C{backend_host}, C{enrolled_at}, C{last_rotation_at}, C{used_tokens}, C{maintenance},
    C{draining}, C{profile}.
    """

    runner: BlockingRunner
    path: str
    data: dict[str, Any] = field(factory=dict)
    _chain: Deferred[None] = field(factory=lambda: succeed(None))
    writes: int = 0

    def load(self) -> Deferred[LoadResult]:
        """Load from disk (off the reactor). Logs, once, what happened to a damaged file."""

        def loaded(result: LoadResult) -> LoadResult:
            self.data = dict(result.data)
            if result.problem:
                log.error(
                    "State file problem: {problem}; moved aside to {moved}. The stored credential "
                    "(if any) could not be read: an enrollment token is needed "
                    "(LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN).",
                    problem=result.problem,
                    moved=result.moved_to or "(could not move)",
                )
            return result

        return self.runner.run(load_state, self.path).addCallback(loaded)

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    @property
    def credential(self) -> str | None:
        value = self.data.get("credential")
        return value if isinstance(value, str) and value else None

    def update(self, **changes: Any) -> Deferred[None]:
        """Apply C{changes} (a value of None deletes the key) and write the file durably."""
        for key, value in changes.items():
            if value is None:
                self.data.pop(key, None)
            else:
                self.data[key] = value
        # A shallow copy: values are replaced, never changed in place, so the I/O thread can
        # serialise it while the reactor goes on (a big state never stalls the reactor).
        snapshot = dict(self.data, version=STATE_VERSION)

        def write(_: object) -> Deferred[None]:
            return self.runner.run(self._write, snapshot)

        result: Deferred[None] = Deferred()

        def written(_: object) -> None:
            result.callback(None)

        def failed(f: Failure) -> None:
            log.failure("Could not write the state file {path}", failure=f, path=self.path)
            result.errback(f)

        d = self._chain.addCallback(write)
        d.addCallbacks(written, failed)
        self._chain = d
        return result

    def _write(self, snapshot: dict[str, Any]) -> None:
        """Thread function: serialise and write the state file."""
        payload = json.dumps(snapshot, indent=1, sort_keys=True).encode()
        ensure_private_dir(os.path.dirname(os.path.abspath(self.path)))
        atomic_write(self.path, payload, 0o600)
        self.writes += 1

    def note(self, **changes: Any) -> None:
        """L{update} without waiting (a failed write is already logged by L{update})."""
        self.update(**changes).addErrback(lambda _: None)

    def flush(self) -> Deferred[None]:
        """Fires when every write requested so far is on disk (or has failed)."""
        d: Deferred[None] = Deferred()

        def done(result: object) -> object:
            d.callback(None)
            return result

        self._chain.addBoth(done)
        return d
