"""
The agent's small persistent state (C{STATE_PATH}): credential, node id, backend-recorded host,
rotation time, node modes (maintenance, draining), the node profile.

Writes are atomic and durable (see L{llmport_agent.core.storage.atomic_write}), serialized, and run off
the reactor thread, serialisation to JSON included. A corrupt file is moved aside, never silently
dropped.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from attrs import field
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmport_agent.core.storage import atomic_write, ensure_private_dir, move_aside
from llmport_agent.core.threads import BlockingRunner
from llmport_agent.core.values import define

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


def user_state_dir(environ: dict[str, str] | None = None) -> str:
    """
    A user's one state directory, whatever started the agent (C{run} as that user, C{start
    --user}, C{join --user}): C{$XDG_DATA_HOME/llmport-agent}, default
    C{~/.local/share/llmport-agent} (the original agent's user mode).
    """
    env = os.environ if environ is None else environ
    base = env.get("XDG_DATA_HOME") or ""
    if not os.path.isabs(base):
        base = os.path.join(env.get("HOME") or os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "llmport-agent")


def old_user_state_dir(environ: dict[str, str] | None = None) -> str:
    """Where C{run} as a user kept state before (C{$XDG_STATE_HOME/llmport-agent}, C{~/.local/state/...})."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_STATE_HOME") or ""
    if not os.path.isabs(base):
        base = os.path.join(env.get("HOME") or os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "llmport-agent")


def resolve_state_path(configured: str, environ: dict[str, str] | None = None) -> tuple[str, str | None]:
    """
    Decide where state lives. When not root and the configured path's directory cannot be
    created or written, fall back to the user's state directory (L{user_state_dir}).

    @return: (path, note) where note is a line to log when the fallback was taken.
    """
    env = dict(os.environ if environ is None else environ)
    directory = os.path.dirname(os.path.abspath(configured))
    if os.geteuid() == 0 or _writable_dir(directory):
        return configured, None
    fallback = os.path.join(user_state_dir(env), "state.json")
    return fallback, (
        f"{directory} is not writable by this user; keeping state in {fallback} instead "
        "(set LLM_PORT_NODE_AGENT_STATE_PATH to choose)"
    )


class TwoStates(Exception):
    """A user's state exists in both the old and the current place: one line, an operator chooses."""


def adopt_old_state(state_path: str, environ: dict[str, str] | None = None, euid: int | None = None) -> str | None:
    """
    One state location per user: when C{state_path} is the user's state file
    (L{user_state_dir}) and the old place (L{old_user_state_dir}) holds a state, move the old
    directory's entries there (renames; its lock file is left behind) and say so (the line
    returned). Blocking (a few renames).

    @raise TwoStates: both places hold a state file (never a second identity: nothing is moved
        and nothing enrolls), an agent still runs on the old one, or a name is in both.
    """
    from llmport_agent.host.instance import AlreadyRunning, InstanceLock

    if (os.geteuid() if euid is None else euid) == 0:
        return None
    new_dir = user_state_dir(environ)
    if os.path.abspath(state_path) != os.path.join(new_dir, "state.json"):
        return None
    old_dir = old_user_state_dir(environ)
    old_state = os.path.join(old_dir, "state.json")
    if os.path.realpath(old_dir) == os.path.realpath(new_dir) or not os.path.lexists(old_state):
        return None
    if os.path.lexists(state_path):
        raise TwoStates(
            f"two states for this user: {old_state} (the old place) and {state_path}; each may hold "
            f"an identity of its own, so nothing enrolls: keep one (move the other away, e.g. "
            f"mv {old_dir} {old_dir}.old) and start again"
        )
    lock = InstanceLock(old_state)
    try:
        lock.acquire()
    except AlreadyRunning as e:
        raise TwoStates(f"the old state {old_state} is in use ({e}); stop that agent, then start again") from None
    try:
        ensure_private_dir(new_dir)
        names = sorted(n for n in os.listdir(old_dir) if n != os.path.basename(lock.path))
        clash = [n for n in names if os.path.lexists(os.path.join(new_dir, n))]
        if clash:
            raise TwoStates(f"{old_dir} and {new_dir} both hold {', '.join(clash[:5])}: keep one, move the "
                            "other away, and start again")
        # state.json last: a move cut short leaves the old place still the state (tried again).
        for name in sorted(names, key=lambda n: n == "state.json"):
            try:
                os.rename(os.path.join(old_dir, name), os.path.join(new_dir, name))
            except OSError as e:
                raise TwoStates(f"could not move {os.path.join(old_dir, name)} to {new_dir} ({e.strerror}): "
                                f"move what is left in {old_dir} there by hand, then start again") from None
    finally:
        lock.release()
    try:
        os.unlink(lock.path)
        os.rmdir(old_dir)
    except OSError:
        pass
    return (f"moved this user's state from {old_dir} (the old place) to {new_dir}: one state, one "
            "identity, whichever way the agent is started")


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


@define(eq=False, repr=False)  # a component: identity, not value
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
