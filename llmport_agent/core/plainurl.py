"""
Request URLs whose host needs no IDNA mapping, in the form treq takes.

treq turns every request URL into its wire form with hyperlink's C{to_uri()}, which maps the
host through IDNA's UTS 46 table even when it is plain ASCII: the table (C{idna.uts46data},
about 1.6 MiB of RSS that stays) is loaded at the agent's first backend request, on a node whose
backend is C{http://10.0.0.5:8000} or C{https://llm-port.example}. L{plain_url} gives treq a
URL (a public L{hyperlink.EncodedURL} subclass, which treq accepts as it is) whose C{to_uri()}
skips that mapping for a host that is already in its mapped form: lower-case letters, digits,
dots and hyphens in labels IDNA accepts as they are, none of them punycode (C{xn--}). Every other host (upper-case,
non-ASCII, punycode, an IPv6 literal) goes through hyperlink's own C{to_uri()} as before;
the path, query and fragment always do. The wire form is the same either way
(tests/test_start_path.py compares them).
"""

from __future__ import annotations

import re

from hyperlink import EncodedURL

#: A host that IDNA encodes as it is: labels of 1 to 63 lower-case letters, digits and hyphens,
#: no hyphen first or last, none with "--" in its third and fourth places (punycode's C{xn--}).
_LABEL = r"(?![a-z0-9]{2}--)[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_PLAIN_HOST = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")


class _PlainHostURL(EncodedURL):  # type: ignore[misc]
    def to_uri(self) -> EncodedURL:
        host = self.host
        if not host or len(host) > 253 or not _PLAIN_HOST.fullmatch(host):
            return super().to_uri()
        # hyperlink's own encoding of everything but the host, which is already in its form.
        return super().replace(host="").to_uri().replace(host=host)


def plain_url(url: str) -> EncodedURL:
    """C{url} for treq's C{request}/C{get}: the same wire form, without IDNA for a plain host."""
    return _PlainHostURL.from_text(url)


__all__ = ["plain_url"]
