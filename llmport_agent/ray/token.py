"""
The Ray cluster token (protocol 10.6).

Fetched from the backend with the node credential (C{GET .../nodes/secrets/{credential_ref}}),
kept for 300 s per C{credential_ref}, and written as C{<RAY_TOKEN_DIR>/cluster.token} (0600,
atomically, never through a link) for C{ray start} inside the runtime container, which sees
the directory read-only. C{stop_ray} deletes it.

The token never reaches a log line, an exception text, an event, a metric or a command
result: messages name the C{credential_ref}, never the value. L{ClusterTokens.secrets} gives
the log scrubber the value while the agent holds it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import DeferredLock
from twisted.logger import Logger

from llmport_agent.core import safefs
from llmport_agent.core.threads import BlockingRunner
from llmport_agent.session.backend_http import BackendHTTP, Rejected, Transient

from ..commands.base import INVALID_COMMAND, RUNTIME_ERROR, CommandFailed

TOKEN_FILE = "cluster.token"
TOKEN_TTL_SEC = 300.0
_REF_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$")


def check_ref(value: object) -> str:
    """A C{credential_ref}: a short token of safe characters."""
    if not isinstance(value, str) or not value.strip():
        raise CommandFailed(INVALID_COMMAND, "credential_ref is required (the cluster's secret reference)")
    ref = value.strip()
    if not _REF_RE.match(ref):
        raise CommandFailed(INVALID_COMMAND, f"credential_ref {ref[:60]!r} is not a valid secret reference")
    return ref


def _write(token_dir: str, data: bytes) -> None:
    """Thread function: C{token_dir} (0700, made when missing) / cluster.token, 0600, atomic."""
    os.makedirs(token_dir, mode=0o700, exist_ok=True)
    fd = safefs.open_dir(token_dir)
    try:
        safefs.atomic_write_at(fd, TOKEN_FILE, data, 0o600)
    finally:
        os.close(fd)


def _remove(token_dir: str) -> bool:
    try:
        fd = safefs.open_dir(token_dir)
    except FileNotFoundError:
        return False
    try:
        return safefs.remove_entry(fd, TOKEN_FILE)
    finally:
        os.close(fd)


def _read(token_dir: str) -> str:
    fd = safefs.open_dir(token_dir)
    try:
        return safefs.read_file_at(fd, TOKEN_FILE, 8192).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)


def ensure_dir(token_dir: str) -> None:
    """Thread function: the token directory exists (0700), so the engine never makes it."""
    os.makedirs(token_dir, mode=0o700, exist_ok=True)


class ClusterTokens:
    """
    @param credential: returns the node credential now (or C{None} before enrollment).
    @param pool: runs the file writes (the I/O pool).
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        backend: BackendHTTP,
        credential: Callable[[], str | None],
        pool: BlockingRunner,
        token_dir: str,
        *,
        ttl: float = TOKEN_TTL_SEC,
        timeout: float = 20.0,
    ) -> None:
        self._reactor = reactor
        self._backend = backend
        self._credential = credential
        self._pool = pool
        self.token_dir = token_dir
        self.ttl = ttl
        self.timeout = timeout
        self._lock = DeferredLock()
        self._ref: str | None = None
        self._fetched_at = 0.0
        self._value: str | None = None
        self._read_value: str | None = None
        #: Fetches from the backend so far (tests, diagnostics).
        self.fetches = 0

    @property
    def path(self) -> str:
        return os.path.join(self.token_dir, TOKEN_FILE)

    def secrets(self) -> list[str]:
        """The token while the agent holds it (for the log scrubber)."""
        return [v for v in (self._value, self._read_value) if v]

    def fresh(self, ref: str) -> bool:
        return self._ref == ref and self._value is not None and self._reactor.seconds() - self._fetched_at < self.ttl

    async def ensure(self, credential_ref: object) -> None:
        """
        Make C{cluster.token} hold the token of C{credential_ref} (fetched at most every
        C{ttl} seconds).

        @raise CommandFailed: C{invalid_command} (bad reference) or C{runtime_error} naming what
            to do; never with the token in it.
        """
        ref = check_ref(credential_ref)
        await self._lock.acquire()
        try:
            if self.fresh(ref):
                return
            credential = self._credential()
            if not credential:
                raise CommandFailed(RUNTIME_ERROR, "This node has no credential yet (not enrolled); it cannot fetch the Ray cluster token.")
            try:
                token = await self._backend.cluster_secret(ref, credential, self.timeout)
            except Rejected as e:
                if e.status == 404:
                    raise CommandFailed(
                        RUNTIME_ERROR,
                        f"The backend has no cluster token {ref} for this node (HTTP 404: the node is not a "
                        "member of that environment); add the node to the environment and retry.",
                    ) from None
                raise CommandFailed(
                    RUNTIME_ERROR,
                    f"The backend refused this node's credential when fetching cluster token {ref} "
                    f"(HTTP {e.status}); re-enroll the node if its credential was revoked.",
                ) from None
            except Transient as e:
                raise CommandFailed(
                    RUNTIME_ERROR,
                    f"Could not fetch cluster token {ref} from the backend: {e}; retry when the backend is reachable.",
                ) from None
            self.fetches += 1
            self._value = token
            try:
                await self._pool.run(_write, self.token_dir, token.encode("utf-8"))
            except OSError as e:
                self._ref = None
                raise CommandFailed(
                    RUNTIME_ERROR,
                    f"Could not write the cluster token in {self.token_dir}: {e.strerror or type(e).__name__}; "
                    "check LLM_PORT_NODE_AGENT_RAY_TOKEN_DIR is a writable directory.",
                ) from None
            self._ref = ref
            self._fetched_at = self._reactor.seconds()
            self.log.info("Ray cluster token {ref} written to {path}", ref=ref, path=self.path)
        finally:
            self._lock.release()

    async def delete(self) -> bool:
        """Remove the token file and forget the token; whether a file was there."""
        await self._lock.acquire()
        try:
            self._ref = None
            self._value = None
            self._read_value = None
            try:
                return bool(await self._pool.run(_remove, self.token_dir))
            except OSError as e:
                raise CommandFailed(
                    RUNTIME_ERROR,
                    f"Could not delete the cluster token in {self.token_dir}: {e.strerror or type(e).__name__}.",
                ) from None
        finally:
            self._lock.release()

    async def read(self) -> str | None:
        """The token on disk (for C{describe_ray_cluster}'s sealed hand-over), or C{None}."""
        try:
            value = str(await self._pool.run(_read, self.token_dir))
        except OSError:
            return None
        if value and value != self._value:
            # A token written before a restart: the log scrubber must know it too.
            self._read_value = value
        return value or None
