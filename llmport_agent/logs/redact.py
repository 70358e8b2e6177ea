# -*- test-case-name: tests.test_logs -*-
"""
The last line of defence before a log line leaves the node: replace what looks like a secret
with C{***}.

The agent never logs its secrets on purpose; this catches the accidents (a library printing a
header, a traceback showing a request, a container echoing its environment into the journal):

 - anything shaped like a node credential (C{<uuid>.<43 url-safe chars>});
 - the value after C{Bearer };
 - the password in C{scheme://user:password@host};
 - the value of C{enrollment_token}, C{credential}, C{password}, C{secret}, C{token},
   C{api_key} written as C{key=value} or C{"key": "value"};
 - every exact occurrence of a configured secret (the enrollment token, the credential,
   registry passwords, ...), so a 32-character enrollment token is caught wherever it appears.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

__all__ = ["MASK", "Redactor", "redact"]

MASK = "***"

#: Configured secrets shorter than this are not searched for (they would mask common words).
MIN_SECRET_CHARS = 4

_CREDENTIAL = re.compile(
    r"(?<![A-Za-z0-9_-])[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}"
    r"\.[A-Za-z0-9_-]{43}(?![A-Za-z0-9_-])"
)
_BEARER = re.compile(r"(?i)\b(bearer)(\s+)(?!\*\*\*)[^\s\"',;]{8,}")
_URL_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]+:)[^@\s/]+@")
_KEYED = re.compile(
    r"(?i)(?<![A-Za-z0-9_])((?:enrollment_token|credential|password|passwd|secret|api_key|token)"
    r"[\"']?\s*[:=]\s*[\"']?)(?!\*\*\*)([^\"'\s,;}&]+)"
)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """C{text} with every secret-looking value and every exact C{secrets} entry masked."""
    for secret in sorted({s for s in secrets if isinstance(s, str)}, key=len, reverse=True):
        if len(secret) >= MIN_SECRET_CHARS and secret in text:
            text = text.replace(secret, MASK)
    text = _CREDENTIAL.sub(MASK, text)
    text = _BEARER.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)
    text = _URL_PASSWORD.sub(lambda m: f"{m.group(1)}{MASK}@", text)
    text = _KEYED.sub(lambda m: f"{m.group(1)}{MASK}", text)
    return text


class Redactor:
    """
    L{redact} with the configured secrets read at every call (they change: rotation,
    enrollment). Thread-safe as long as C{secrets} is.

    @param secrets: returns the exact values to mask; an exception counts as no secrets (the
        patterns still apply).
    """

    def __init__(self, secrets: Callable[[], Iterable[str | None]] | None = None) -> None:
        self._secrets = secrets

    def __call__(self, text: str) -> str:
        values: list[str] = []
        if self._secrets is not None:
            try:
                values = [s for s in self._secrets() if s]
            except Exception:
                values = []
        return redact(text, values)
