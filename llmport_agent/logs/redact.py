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
   C{api_key} written as C{key=value}, C{key: value} or C{"key": "value"}. In the agent's own
   lines (C{prose=True}: the format text of its log output and of its lines shipped to Loki,
   never the field values put into it) the words of a sentence
   after a label are not a value: C{key: word more words} (a colon, a space, then a short
   lower-case word followed by more words, as in "no enrollment token: mint a new one with POST
   ...") is left as it is. Lines from elsewhere (the journal, containers, Ray) are masked
   strictly;
 - every exact occurrence of a configured secret (the enrollment token, the credential,
   registry passwords, ...), so a 32-character enrollment token is caught wherever it appears.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

__all__ = ["MASK", "Redactor", "redact", "redact_cut"]

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


#: Lower-case words one of which a line must contain for L{_KEYED} to match (a cheap pre-check).
_KEY_WORDS = ("token", "credential", "passw", "secret", "api_key")


def _bearer(m: re.Match[str]) -> str:
    return f"{m.group(1)}{m.group(2)}{MASK}"


def _url_password(m: re.Match[str]) -> str:
    return f"{m.group(1)}{MASK}@"


def _keyed(m: re.Match[str]) -> str:
    return f"{m.group(1)}{MASK}"


def _keyed_prose(m: re.Match[str]) -> str:
    label, value = m.group(1), m.group(2)
    if label.rstrip().endswith(":") and label != label.rstrip() and value.isalpha() and value.islower():
        # "token: mint a new one ...": a word in a sentence (a lower-case word that more words
        # follow); a value on its own, quoted, with digits or capitals, or after "=" is masked.
        rest = m.string[m.end(2):m.end(2) + 2]
        if len(value) <= 16 and len(rest) == 2 and rest[0] in " \t" and (rest[1].isalpha() or rest[1] == "("):
            return m.group(0)
    return f"{label}{MASK}"


def _ordered(secrets: Iterable[str | None]) -> list[str]:
    """The secrets worth searching for, longest first (a secret inside another one is masked last)."""
    return sorted(
        {s for s in secrets if isinstance(s, str) and len(s) >= MIN_SECRET_CHARS}, key=len, reverse=True
    )


def _redact(text: str, ordered: list[str], prose: bool = False) -> str:
    for secret in ordered:
        if secret in text:
            text = text.replace(secret, MASK)
    # Each pattern only runs when a cheap substring test says it could match: most lines
    # hold none of these shapes, and the patterns cost most of a line's shipping time.
    if "-" in text and "." in text:
        text = _CREDENTIAL.sub(MASK, text)
    low = text.lower()
    if "bearer" in low:
        text = _BEARER.sub(_bearer, text)
    if "://" in text and "@" in text:
        text = _URL_PASSWORD.sub(_url_password, text)
    for word in _KEY_WORDS:
        if word in low:
            text = _KEYED.sub(_keyed_prose if prose else _keyed, text)
            break
    return text


def redact(text: str, secrets: Iterable[str] = (), prose: bool = False) -> str:
    """
    C{text} with every secret-looking value and every exact C{secrets} entry masked;
    C{prose}: the agent's own words (see the module's docstring).
    """
    return _redact(text, _ordered(secrets), prose)


#: Beyond the longest configured secret, what a cut must leave room for: the longest pattern
#: that masks nothing unless whole (a node credential, 80 characters).
CUT_MARGIN = 128


def margin_for(secrets: Iterable[str | None]) -> int:
    """How much wider than a cut to redact (see L{redact_cut}) for C{secrets}."""
    return max((len(s) for s in secrets if isinstance(s, str)), default=0) + CUT_MARGIN


def redact_cut(text: str, limit: int, redact_fn: Callable[[str], str], margin: int, tail: bool = False) -> str:
    """
    C{redact_fn(text)} at most C{limit} characters long, its head (C{tail}: its end), with no
    part of a secret that straddles the cut: a window C{margin} wider than the cut is redacted,
    then the C{margin} characters at the window's open edge (where a secret the window cut in
    two stays unmasked) are dropped along with the rest.
    """
    if len(text) <= limit:
        return redact_fn(text)
    if tail:
        return redact_fn(text[-(limit + margin):])[margin:][-limit:]
    done = redact_fn(text[:limit + margin])
    return done[:max(0, len(done) - margin)][:limit]


class _Snapshot:
    def __init__(self, values: list[str], prose: bool) -> None:
        self.values, self.prose = values, prose
        self.margin = margin_for(values)

    def __call__(self, text: str) -> str:
        return _redact(text, self.values, self.prose)


class Redactor:
    """
    L{redact} with the configured secrets read at every call (they change: rotation,
    enrollment). Thread-safe as long as C{secrets} is.

    @param secrets: returns the exact values to mask; an exception counts as no secrets (the
        patterns still apply).
    """

    def __init__(self, secrets: Callable[[], Iterable[str | None]] | None = None, prose: bool = False) -> None:
        self._secrets = secrets
        self._prose = prose

    def _values(self) -> list[str]:
        if self._secrets is None:
            return []
        try:
            return _ordered(self._secrets())
        except Exception:
            return []

    def __call__(self, text: str) -> str:
        return _redact(text, self._values(), self._prose)

    def snapshot(self) -> Callable[[str], str]:
        """
        A redacting function with the secrets as they are now, for a batch of lines (reading
        the secrets once per batch instead of once per line). Safe in any thread.
        """
        return _Snapshot(self._values(), self._prose)  # its margin: for L{redact_cut}
