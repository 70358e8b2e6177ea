"""
The one place that makes untrusted words safe to print, and that judges a node id.

Whatever the backend names (a node id, an agent id, a rejection's message), whatever answers on
the ops port, and whatever a state file holds reaches root's terminal through L{shown}: bounded,
with no control character (C0, DEL, C1: escape sequences, carriage returns that overwrite a line,
newlines that fake one), no Unicode line or paragraph separator and no bidirectional override
(text that reads differently from what it is). C{join}, C{status}, C{doctor} and the backend
client all use it.

A node id handed out by the backend (at enrollment, an approved join, C{whoami}, C{hello_ack}) is
checked where it is received (L{checked_node_id}): the agent stores it, sends it and names it in
file paths and log lines, so it must be a plain token, not whatever a backend chose to send.
"""

from __future__ import annotations

import re

#: The default bound of a shown text (a rejection's detail, a message).
MAX_SHOWN_CHARS = 300
#: What replaces a character that is not shown.
REPLACEMENT = "?"

#: C0, DEL and C1 controls; line/paragraph separators (U+2028/9, U+0085 is C1); the
#: bidirectional marks, embeddings, overrides and isolates (U+200E/F, U+202A-E, U+2066-9).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u2028-\u202e\u2066-\u2069]")

#: A node id: letters, digits and C{- _ . :}, starting with a letter or digit, 1-128 characters
#: (the backend's are UUIDs; the stand-in's and the original's fit too).
NODE_ID_MAX = 128
_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def shown(text: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """
    C{text} as a terminal or a log line may show it: at most C{limit} characters (cut before
    cleaning, so a long text costs nothing), every unsafe character replaced by C{?}.
    """
    value = text if isinstance(text, str) else str(text)
    return _UNSAFE.sub(REPLACEMENT, value[:limit])


def has_unsafe(text: str) -> bool:
    """Whether L{shown} would change a character of C{text} (length aside)."""
    return _UNSAFE.search(text) is not None


class BadNodeId(ValueError):
    """The backend handed out a node id that is not one (see L{checked_node_id})."""


def node_id_problem(value: object) -> str | None:
    """Why C{value} is not a node id (one phrase), or C{None} when it is one."""
    if not isinstance(value, str):
        return f"not a string ({type(value).__name__})"
    if not value:
        return "empty"
    if len(value) > NODE_ID_MAX:
        return f"{len(value)} characters (at most {NODE_ID_MAX})"
    if _NODE_ID.fullmatch(value) is None:
        return "characters other than letters, digits and - _ . : (or not starting with a letter or digit)"
    return None


def checked_node_id(value: object, where: str) -> str:
    """
    C{value} when it is a node id; else L{BadNodeId} whose message is one line naming C{where}
    (e.g. "the enrollment reply") and the value as L{shown} shows it (bounded, cleaned).
    """
    problem = node_id_problem(value)
    if problem is None:
        assert isinstance(value, str)
        return value
    return _raise(value, where, problem)


def _raise(value: object, where: str, problem: str) -> str:
    raise BadNodeId(
        f"the backend sent a node id in {where} that is not one ({problem}: {shown(repr(value), 80)}); "
        "nothing was stored: check that BACKEND_URL is your llm-port backend"
    )
