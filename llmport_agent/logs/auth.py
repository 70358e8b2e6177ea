# -*- test-case-name: tests.test_logs -*-
"""
How the agent authenticates to Loki: an optional tenant (C{X-Scope-OrgID}) and either basic
auth or a bearer token, each from a variable or from a file.

Files are read off the reactor (L{LokiAuth.load}) at start and again after Loki (or the proxy in
front of it) answers 401 or 403, so a rotated token file is picked up without a restart. The
values are secrets: they are never logged, never part of an exception text, and they are handed
to the redaction filter (L{LokiAuth.secrets}) so no shipped line carries them.
"""

from __future__ import annotations

import os
from typing import Any

from attrs import field

from llmport_agent.core.values import define

__all__ = ["LokiAuth", "read_secret_file"]

#: A secret file larger than this is refused (it is certainly not a token).
MAX_SECRET_FILE_BYTES = 64 * 1024


def read_secret_file(path: str, what: str) -> str:
    """
    The contents of a secret file, stripped of surrounding white space. Blocking.

    @raise ValueError: it cannot be read, is not a regular file, is empty or too large (the
        message names the path and the variable, never the contents).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"{what} {path!r} cannot be read ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        import stat

        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{what} {path!r} is not a regular file")
        if st.st_size > MAX_SECRET_FILE_BYTES:
            raise ValueError(f"{what} {path!r} is larger than {MAX_SECRET_FILE_BYTES} bytes")
        raw = os.read(fd, MAX_SECRET_FILE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path!r} is not UTF-8 text") from None
    if not text:
        raise ValueError(f"{what} {path!r} is empty")
    return text


@define
class LokiAuth:
    """
    The credentials for Loki pushes. Build it from the configuration; call L{load} (blocking)
    before use and after a 401/403.

    @ivar tenant: the C{X-Scope-OrgID} header value, if any.
    @ivar username: the basic-auth user (also taken from C{user:password@} in C{LOKI_URL}).
    """

    tenant: str | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    password_file: str | None = None
    bearer_token: str | None = field(default=None, repr=False)
    bearer_token_file: str | None = None
    _password_loaded: str | None = field(default=None, repr=False, init=False)
    _bearer_loaded: str | None = field(default=None, repr=False, init=False)

    def __attrs_post_init__(self) -> None:
        if self.username is not None and self.bearer_token is not None:
            raise ValueError("set either a Loki user name and password or a bearer token, not both")
        if self.username is not None and self.bearer_token_file is not None:
            raise ValueError("set either a Loki user name and password or a bearer token, not both")
        self._password_loaded = self.password
        self._bearer_loaded = self.bearer_token

    @property
    def enabled(self) -> bool:
        return bool(self.tenant or self.username or self.bearer_token or self.bearer_token_file)

    def load(self) -> None:
        """Read the secret files (blocking). @raise ValueError: one cannot be used."""
        if self.password_file:
            self._password_loaded = read_secret_file(self.password_file, "LOKI_PASSWORD_FILE")
        if self.bearer_token_file:
            self._bearer_loaded = read_secret_file(self.bearer_token_file, "LOKI_BEARER_TOKEN_FILE")

    def headers(self) -> dict[str, str]:
        """The headers a push carries (secrets inside: never log them)."""
        out: dict[str, str] = {}
        if self.tenant:
            out["X-Scope-OrgID"] = self.tenant
        if self._bearer_loaded:
            out["Authorization"] = f"Bearer {self._bearer_loaded}"
        return out

    def basic(self) -> tuple[str, str] | None:
        """The basic-auth pair, if any."""
        if self.username is None:
            return None
        return self.username, self._password_loaded or ""

    def secrets(self) -> list[str]:
        """The secret values, for the redaction filter."""
        return [s for s in (self._password_loaded, self._bearer_loaded) if s]

    def describe(self) -> dict[str, Any]:
        """For diagnostics: what is configured, without any secret."""
        kind = "bearer" if (self.bearer_token or self.bearer_token_file) else (
            "basic" if self.username is not None else "none"
        )
        return {
            "tenant": self.tenant or "",
            "auth": kind,
            "username": self.username or "",
            "from_file": bool(self.password_file or self.bearer_token_file),
        }
