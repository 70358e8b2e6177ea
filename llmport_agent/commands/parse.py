"""
Turning inbound command objects into L{Command}s, defensively, and verifying signatures.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid
from datetime import UTC
from typing import Any

from llmport_agent.commands.base import Command, is_uuid
from llmport_agent.core.values import frozen
from llmport_agent.session.framesplit import UnparsedItem


@frozen
class Malformed:
    """A command object that cannot run. C{command_id} is set when there is an id to answer to."""

    command_id: str | None
    message: str
    correlation_id: str | None = None


def parse_command(obj: Any) -> Command | Malformed:
    """Validate the shape of one command object (protocol 3.1)."""
    if isinstance(obj, UnparsedItem):
        # Salvaged from a frame that did not parse as a whole: answer it if its id is readable.
        cid = obj.get("id")
        corr = obj.get("correlation_id")
        message = f"the command could not be parsed ({obj.reason}); it was not run"
        if not is_uuid(cid):
            return Malformed(None, message)
        return Malformed(str(uuid.UUID(cid)), message, corr if isinstance(corr, str) and corr else None)
    if not isinstance(obj, dict):
        return Malformed(None, f"command is not a JSON object (got {type(obj).__name__})")
    cid = obj.get("id")
    if cid is None:
        return Malformed(None, "command has no 'id'")
    if not is_uuid(cid):
        return Malformed(None, f"command 'id' is not a UUID string: {str(cid)[:64]!r}")
    # The backend treats ids as UUID values: one canonical spelling for de-duplication.
    cid = str(uuid.UUID(cid))
    corr = obj.get("correlation_id")
    corr = corr if isinstance(corr, str) and corr else None

    def bad(message: str) -> Malformed:
        return Malformed(cid, message, corr)

    ctype = obj.get("command_type")
    if ctype is None:
        return bad("field 'command_type' is missing")
    if not isinstance(ctype, str) or not ctype.strip():
        return bad(f"field 'command_type' must be a non-empty string (got {type(ctype).__name__})")
    if len(ctype) > 128:
        return bad("field 'command_type' is longer than 128 characters")
    payload = obj.get("payload", {})
    if payload is None:
        payload = {}
    if not isinstance(payload, dict):
        return bad(f"field 'payload' must be an object (got {type(payload).__name__})")
    timeout = obj.get("timeout_sec")
    if timeout is not None and (not isinstance(timeout, int) or isinstance(timeout, bool)):
        return bad(f"field 'timeout_sec' must be an integer or null (got {type(timeout).__name__})")
    idem = obj.get("idempotency_key")
    if idem is not None and not isinstance(idem, str):
        return bad("field 'idempotency_key' must be a string")
    issued = obj.get("issued_at")
    if issued is not None and not isinstance(issued, str):
        return bad("field 'issued_at' must be an ISO 8601 string")
    rid = payload.get("runtime_id")
    if rid is not None and not isinstance(rid, str):
        return bad("field 'payload.runtime_id' must be a string")
    return Command(
        id=cid,
        command_type=ctype,
        payload=payload,
        correlation_id=corr,
        idempotency_key=idem,
        timeout_sec=timeout,
        issued_at=issued,
        raw=obj,
    )


def signing_key(credential: str) -> bytes:
    return hmac.new(credential.encode("utf-8"), b"command-signing", hashlib.sha256).digest()


def signature_for(command: dict[str, Any], credential: str) -> str:
    """The signature protocol 3.1 describes, over the command without its C{signature}."""
    body = {k: v for k, v in command.items() if k != "signature"}
    data = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return hmac.new(signing_key(credential), data, hashlib.sha256).hexdigest()


def signature_ok(command: dict[str, Any], credential: str) -> bool:
    sig = command.get("signature")
    if not isinstance(sig, str) or not sig.isascii():
        return False
    try:
        expected = signature_for(command, credential)
    except (TypeError, ValueError):
        return False
    return hmac.compare_digest(sig.lower().encode("ascii"), expected.encode("ascii"))


def parse_iso8601(value: str) -> float | None:
    from datetime import datetime

    try:
        text = value.replace("Z", "+00:00")
        dt = datetime.fromisoformat(text)
    except (ValueError, AttributeError):
        return None
    if dt.tzinfo is None:

        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


#: Keys whose values are registry credentials: kept in memory, never written to the journal.
_CREDENTIAL_KEYS = frozenset({"registry_auth", "registry_credentials", "registry_credential"})
_SECRET_FIELDS = frozenset({"password", "identitytoken", "registrytoken", "auth", "token", "probe_token"})

#: A single command larger than this (serialized) is refused as invalid.
MAX_COMMAND_BYTES = 1024 * 1024


#: A command nested deeper than this (objects and arrays) is refused as invalid: no payload of
#: the protocol comes near it, and deeper ones would strain every recursive consumer.
MAX_COMMAND_DEPTH = 64


class TooDeep(ValueError):
    """The value is nested deeper than allowed."""


def scrub_for_journal(obj: Any, max_depth: int = MAX_COMMAND_DEPTH) -> Any:
    """
    A copy of a command object without registry credentials (they never reach the disk).
    Iterative (no recursion, whatever the input).

    @raise TooDeep: C{obj} is nested more than C{max_depth} levels deep.
    """
    holder: list[Any] = [None]
    stack: list[tuple[Any, Any, Any, int]] = [(obj, holder, 0, 1)]
    while stack:
        value, parent, key, depth = stack.pop()
        if isinstance(value, dict):
            if depth > max_depth:
                raise TooDeep(f"nested more than {max_depth} levels deep")
            out: dict[str, Any] = {}
            parent[key] = out
            for k, v in value.items():
                if k in _CREDENTIAL_KEYS:
                    out[k] = {"_redacted": "registry credentials are not kept on disk"}
                elif k in _SECRET_FIELDS and isinstance(v, str):
                    out[k] = "***"
                elif isinstance(v, dict | list):
                    out[k] = None
                    stack.append((v, out, k, depth + 1))
                else:
                    out[k] = v
        elif isinstance(value, list):
            if depth > max_depth:
                raise TooDeep(f"nested more than {max_depth} levels deep")
            items: list[Any] = list(value)
            parent[key] = items
            for i, v in enumerate(items):
                if isinstance(v, dict | list):
                    stack.append((v, items, i, depth + 1))
        else:
            parent[key] = value
    return holder[0]


def json_size(obj: Any) -> int:
    """The length of C{obj} as JSON; -1 when it is too deep to serialise."""
    try:
        return len(json.dumps(obj, default=str))
    except RecursionError:
        return -1
    except (TypeError, ValueError):
        return MAX_COMMAND_BYTES + 1
