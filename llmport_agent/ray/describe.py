"""
C{describe_ray_cluster} read from Ray itself (protocol 10.6): the inspection program that
runs inside the runtime container, and what the agent believes of its output.

The program (C{programs/describe_cluster.py}, a resource of this package) runs as C{python3 -}
with the program on stdin and a fresh nonce in its environment, and prints one JSON document
between markers that carry the nonce. Its output is a container's words, so
L{parse_output}: bounds the text (L{MAX_OUTPUT}), finds the markers with two linear
searches, parses the JSON between them within the command limits (size, depth), and keeps
only fields of the expected types and sizes. Pure: no I/O except L{program}, which reads the
resource (called on a thread pool).
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Mapping
from importlib import resources
from typing import Any

from llmport_agent.core.values import frozen

from ..commands.jsonsafe import json_problem
from ..commands.parse import MAX_COMMAND_DEPTH
from .execs import OUTPUT_LIMIT

#: The interpreter and argv: the program is read from stdin.
ARGV = ("python3", "-")
#: Apps llm-port deploys are named C{llmport-<deployment id>}; only theirs are read.
APP_PREFIX = "llmport-"
#: Characters of the program's stdout looked at (the exec keeps at most OUTPUT_LIMIT bytes).
MAX_OUTPUT = OUTPUT_LIMIT
#: Characters of JSON between the markers.
MAX_DOC = OUTPUT_LIMIT
MAX_NODES = 1024
MAX_APPS = 256
MAX_DEPLOYMENTS = 64
MAX_CONFIGS = 16
MAX_ERRORS = 32
MAX_DEFAULTS = 4096
_TEXT = 2000

_program: bytes | None = None


def program() -> bytes:
    """The inspection program's source (read once; a blocking read: call it on a pool)."""
    global _program
    if _program is None:
        _program = resources.files(__package__).joinpath("programs/describe_cluster.py").read_bytes()
    return _program


def new_nonce() -> str:
    return secrets.token_hex(12)


def program_env(nonce: str) -> dict[str, str]:
    return {"LLMPORT_DESCRIBE_NONCE": nonce, "LLMPORT_DESCRIBE_APP_PREFIX": APP_PREFIX}


def markers(nonce: str) -> tuple[str, str]:
    return f"@@llmport-describe-begin:{nonce}@@", f"@@llmport-describe-end:{nonce}@@"


class BadOutput(ValueError):
    """The program's output is not a document the agent can use (one phrase why)."""


@frozen
class App:
    name: str
    route_prefix: str
    status: str
    message: str
    deployments: tuple[dict[str, Any], ...]
    llm_configs: tuple[dict[str, Any], ...]
    defaults: tuple[tuple[str, ...], ...]
    errors: tuple[str, ...]
    ours: bool


@frozen
class Inspection:
    """What the program reported, every field checked."""

    ray_importable: bool
    attached: bool
    ray_version: str | None
    gcs_address: str | None
    nodes: tuple[dict[str, Any], ...]
    serve_running: bool
    http_options: dict[str, Any] | None
    apps: tuple[App, ...]
    errors: tuple[str, ...]


def _str(value: Any, limit: int = _TEXT) -> str | None:
    return value[:limit] if isinstance(value, str) else None


def _flt(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    try:
        number = float(value)
    except OverflowError:  # an integer past any float (JSON integers have no bound)
        return 0.0
    return number if math.isfinite(number) and number >= 0 else 0.0


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return max(0, min(value, 1_000_000))


def _list(value: Any, limit: int) -> list[Any]:
    return list(value[:limit]) if isinstance(value, list) else []


def _errors(value: Any) -> tuple[str, ...]:
    return tuple(e[:500] for e in _list(value, MAX_ERRORS) if isinstance(e, str))


def _node(raw: Any) -> dict[str, Any] | None:
    if not isinstance(raw, dict):
        return None
    alive = raw.get("alive") is True
    ip = _str(raw.get("ip"), 128)
    return {
        "node_id": _str(raw.get("node_id"), 128),
        "ip": ip,
        "node_ip": ip,
        "hostname": _str(raw.get("hostname"), 256),
        "alive": alive,
        "is_head": raw.get("is_head") is True,
        "state": "ALIVE" if alive else "DEAD",
        "gpus": _flt(raw.get("gpus")),
        "cpus": _flt(raw.get("cpus")),
    }


def _deployment(raw: Any) -> dict[str, Any] | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        return None
    running = _int(raw.get("running_replicas"))
    pending = _int(raw.get("pending_replicas"))
    return {
        "name": raw["name"][:256],
        "status": _str(raw.get("status"), 64) or "",
        "message": _str(raw.get("message"), 4000) or "",
        "running_replicas": running,
        "num_replicas_ready": running,
        "num_replicas_pending": pending,
    }


def _http_options(raw: Any) -> dict[str, Any] | None:
    if not isinstance(raw, dict):
        return None
    out: dict[str, Any] = {}
    for key, value in list(raw.items())[:32]:
        if not isinstance(key, str):
            continue
        if value is None or isinstance(value, bool):
            out[key[:64]] = value
        elif isinstance(value, int | float):
            out[key[:64]] = value if math.isfinite(value) else None
        elif isinstance(value, str):
            out[key[:64]] = value[:256]
    return out


def _app(raw: Any) -> App | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not raw["name"]:
        return None
    name = raw["name"][:256]
    configs = [c for c in _list(raw.get("llm_configs"), MAX_CONFIGS) if isinstance(c, dict)]
    errors = list(_errors(raw.get("errors")))
    raw_configs = raw.get("llm_configs")
    if isinstance(raw_configs, list) and len(configs) != len(raw_configs):
        errors.append("some llm_configs were not objects or were too many; they are left out")
    raw_defaults = _list(raw.get("defaults"), MAX_CONFIGS)
    defaults: list[tuple[str, ...]] = []
    for i in range(len(configs)):
        d = raw_defaults[i] if i < len(raw_defaults) else None
        # Unknown defaults: none assumed (every key only Ray has then counts as a difference).
        defaults.append(tuple(p[:512] for p in _list(d, MAX_DEFAULTS) if isinstance(p, str)))
    deployments = [d for d in (_deployment(x) for x in _list(raw.get("deployments"), MAX_DEPLOYMENTS)) if d]
    return App(
        name=name,
        route_prefix=_str(raw.get("route_prefix"), 256) or f"/{name}",
        status=_str(raw.get("status"), 64) or "",
        message=_str(raw.get("message"), 4000) or "",
        deployments=tuple(deployments),
        llm_configs=tuple(configs),
        defaults=tuple(defaults),
        errors=tuple(errors),
        ours=name.startswith(APP_PREFIX),
    )


def parse_output(output: bytes | str, nonce: str) -> Inspection:
    """
    The program's document from its stdout (bytes are decoded here, on the caller's pool),
    checked field by field.

    @raise BadOutput: no markers, too large, not JSON, too deep, or not an object.
    """
    text = output.decode("utf-8", "replace") if isinstance(output, bytes) else output
    if len(text) > MAX_OUTPUT:
        raise BadOutput(f"its output is larger than {MAX_OUTPUT} characters")
    begin, end = markers(nonce)
    start = text.find(begin)
    if start < 0:
        raise BadOutput("its output holds no inspection document (no begin marker)")
    start += len(begin)
    stop = text.find(end, start)
    if stop < 0:
        raise BadOutput("its inspection document is cut short (no end marker)")
    if stop - start > MAX_DOC:
        raise BadOutput(f"its inspection document is larger than {MAX_DOC} characters")
    try:
        doc = json.loads(text[start:stop])
    except (ValueError, RecursionError) as exc:
        raise BadOutput(f"its inspection document is not JSON ({str(exc)[:120]})") from None
    problem = json_problem(doc, max_depth=MAX_COMMAND_DEPTH)
    if problem is not None:
        raise BadOutput(f"its inspection document is refused: {problem}")
    if not isinstance(doc, dict):
        raise BadOutput(f"its inspection document is not an object (got {type(doc).__name__})")
    raw_serve = doc.get("serve")
    serve: dict[str, Any] = raw_serve if isinstance(raw_serve, dict) else {}
    return Inspection(
        ray_importable=doc.get("ray_importable") is not False,
        attached=doc.get("attached") is True,
        ray_version=_str(doc.get("ray_version"), 64),
        gcs_address=_str(doc.get("gcs_address"), 256),
        nodes=tuple(n for n in (_node(x) for x in _list(doc.get("nodes"), MAX_NODES)) if n),
        serve_running=serve.get("running") is True,
        http_options=_http_options(serve.get("http_options")),
        apps=tuple(a for a in (_app(x) for x in _list(doc.get("apps"), MAX_APPS)) if a),
        errors=_errors(doc.get("errors")),
    )


def candidates(raw: Any) -> dict[str, Any]:
    """C{verify}'s candidates by app: a list of configurations, or a phrase saying what is wrong."""
    out: dict[str, Any] = {}
    if not isinstance(raw, Mapping):
        return out
    for name, entry in list(raw.items())[:MAX_APPS]:
        if not isinstance(name, str):
            continue
        configs = entry.get("llm_configs") if isinstance(entry, Mapping) else None
        if isinstance(configs, list):
            out[name[:256]] = configs
        else:
            out[name[:256]] = "the candidate has no llm_configs list"
    return out


def without_secrets(obj: Any, secrets: list[str]) -> Any:
    """
    A copy of C{obj} (JSON values) with every exact occurrence of C{secrets} in its strings
    replaced by C{***}: the container can read the cluster token and print it anywhere in
    what it reports. Iterative; C{obj} is already bounded by L{parse_output}.
    """
    wanted = [s for s in secrets if s and len(s) >= 8]
    if not wanted:
        return obj

    def clean(text: str) -> str:
        for secret in wanted:
            if secret in text:
                text = text.replace(secret, "***")
        return text

    holder: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(obj, holder, 0)]
    while stack:
        value, parent, key = stack.pop()
        if isinstance(value, dict):
            out: dict[Any, Any] = {}
            parent[key] = out
            for k, v in value.items():
                out[clean(k) if isinstance(k, str) else k] = None
                stack.append((v, out, clean(k) if isinstance(k, str) else k))
        elif isinstance(value, list | tuple):
            items: list[Any] = [None] * len(value)
            parent[key] = items
            for i, v in enumerate(value):
                stack.append((v, items, i))
        elif isinstance(value, str):
            parent[key] = clean(value)
        else:
            parent[key] = value
    return holder[0]
