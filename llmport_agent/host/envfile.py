"""
The env file of the systemd unit: tightened to 0600 at start when other users may read it
(issue 20), and said once: L{EnvFileCheck}, which the agent runs as it starts.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.logger import Logger

from llmport_agent.core.config import SETTINGS

#: The env file `llmport-agent start` (and llm-port's own installer) writes for the unit.
ENV_FILE = "/etc/llmport-agent.env"


def env_file_path() -> str:
    """L{ENV_FILE}, under C{$LLMPORT_AGENT_SYSTEM_ROOT} when set (tests of the installer)."""
    root = os.environ.get("LLMPORT_AGENT_SYSTEM_ROOT", "")
    return os.path.join(root, ENV_FILE.lstrip("/")) if root else ENV_FILE


def tighten_env_file(path: str) -> tuple[str, str, int] | None:
    """
    Thread function: chmod 0600 the env file when group or others may read or write it. Not
    following a symlink (a link there is left alone). C{None} when nothing was to do, else
    (C{"tightened"} or why not, the path, the mode found).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if not stat.S_ISREG(st.st_mode) or not mode & (stat.S_IRWXG | stat.S_IRWXO):
            return None
        why = "it belongs to another user" if st.st_uid != os.geteuid() and os.geteuid() != 0 else ""
        if not why:
            try:
                os.fchmod(fd, 0o600)
                return ("tightened", path, mode)
            except OSError as e:
                why = e.strerror or "chmod failed"
        # Not ours to change: worth a warning only when it holds a secret.
        text = os.read(fd, 1 << 20).decode("utf-8", "replace")
        secret = {s.env for s in SETTINGS if s.secret}
        for line in text.splitlines():
            key, sep, value = line.strip().partition("=")
            if sep and key.strip().removeprefix("export ").strip() in secret and value.strip().strip("\"'"):
                return (why, path, mode)
        return None
    finally:
        os.close(fd)


class EnvFileCheck:
    """
    The env file (llm-port's own installer writes it 0644, token included) readable or
    writable by other users is tightened to 0600 (issue 20), and said once; when it cannot
    be (another owner), the warning says what to run.

    @param run: runs a thread function on a bounded pool (L{PoolService.run}).
    @param path: the env file (by default L{env_file_path}, read when the check runs).
    @param log: where the outcome is said.
    """

    def __init__(self, run: Callable[..., Deferred[Any]], log: Logger, path: str | None = None) -> None:
        self.run = run
        self.log = log
        self.path = path

    def check(self) -> None:
        """Tighten the env file on the pool; say what was done (or what to run) once."""
        path = env_file_path() if self.path is None else self.path
        self.run(tighten_env_file, path).addCallbacks(
            self.checked, lambda f: self.log.failure("Checking the env file failed", f)
        )

    def checked(self, result: tuple[str, str, int] | None) -> None:
        """Say the outcome of L{tighten_env_file}: nothing when nothing was to do."""
        if result is None:
            return
        outcome, path, mode = result
        if outcome == "tightened":
            self.log.warn(
                "{path} was readable by other users (mode {mode:04o}) and holds this node's settings "
                "(an enrollment token, passwords): its mode is now 0600",
                path=path,
                mode=mode,
            )
        else:
            self.log.warn(
                "{path} is readable by other users (mode {mode:04o}) and could not be tightened ({why}): "
                "run `chmod 600 {path}` (llmport-agent start does this); once the node is enrolled the "
                "token line can be removed",
                path=path,
                mode=mode,
                why=outcome,
            )
