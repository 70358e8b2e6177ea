"""
The runtime image's helper CLI C{llm-port-ray-runtime} (protocol 10.6): its verbs, and the
answer shapes the backend reads.

    cluster-status
    serve-status [--app-name A]
    run-serve-app --app-name A --route-prefix /A --config -     (stdin: {llm_serving_args, http_options})
    delete-serve-app --app-name A

The first JSON object on stdout is the answer. Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from typing import Any

HELPER = "llm-port-ray-runtime"
#: Lines of stdout tried as the start of the answer (Ray may log before it).
_MAX_TRIES = 64


def first_json_object(text: str) -> dict[str, Any] | None:
    """
    The first JSON object on a line of its own start in C{text}, or C{None}. Linear in the
    text: at most L{_MAX_TRIES} lines starting with C{{} are tried, each decode reading from
    that line on.
    """
    decoder = json.JSONDecoder()
    tries = 0
    pos = 0
    n = len(text)
    while pos < n and tries < _MAX_TRIES:
        end = text.find("\n", pos)
        end = n if end < 0 else end
        line_start = pos
        while line_start < end and text[line_start] in " \t\r":
            line_start += 1
        if line_start < end and text[line_start] == "{":
            tries += 1
            try:
                value, _ = decoder.raw_decode(text, line_start)
            except (ValueError, RecursionError):  # the container's output: too deep is not JSON
                value = None
            if isinstance(value, dict):
                return value
        pos = end + 1
    return None


def _float(value: Any) -> float:
    try:
        number = float(value or 0.0)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    return number if number == number and abs(number) != float("inf") else 0.0


def _str_or_none(value: Any, limit: int = 256) -> str | None:
    return str(value)[:limit] if isinstance(value, (str, int, float)) and str(value) else None


def dead_cluster(**extra: Any) -> dict[str, Any]:
    """What C{get_ray_status} answers when no Ray runs here."""
    return {"alive": False, "version": None, "num_nodes": 0, "nodes": [], **extra}


#: Bounds on one node record passed through from the helper (protocol 10.6: every key Ray
#: gives reaches the backend, which matches members by C{node_ip}, C{node_manager_address} or
#: C{node_name}): keys per object, characters of a key and of a string, items of a list,
#: nesting depth and characters of the whole record.
MAX_NODES = 1024
_NODE_KEYS = 64
_KEY_CHARS = 128
_STRING_CHARS = 1024
_LIST_ITEMS = 256
_DEPTH = 4
_RECORD_CHARS = 16 * 1024
#: The states the backend reads as live (C{alive} true or one of these).
_LIVE_STATES = ("ALIVE", "UP", "ACTIVE")


class _Budget:
    """Characters left for one record; spent as values are copied."""

    def __init__(self, chars: int) -> None:
        self.left = chars

    def spend(self, n: int) -> bool:
        self.left -= n
        return self.left >= 0


def _json_value(value: Any, depth: int, budget: _Budget) -> tuple[bool, Any]:
    """
    (kept, copy) of a JSON value from the container: scalars as they are (strings cut to
    L{_STRING_CHARS}, floats finite), objects and lists copied within the bounds; anything
    else (or past the budget) is left out.
    """
    if value is None or isinstance(value, bool):
        return budget.spend(5), value
    if isinstance(value, int):
        if abs(value) >= 1 << 63:
            return False, None
        return budget.spend(20), value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return False, None
        return budget.spend(24), value
    if isinstance(value, str):
        text = value[:_STRING_CHARS]
        return budget.spend(len(text) + 2), text
    if depth >= _DEPTH:
        return False, None
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in list(value.items())[:_NODE_KEYS]:
            if not isinstance(key, str) or not key or len(key) > _KEY_CHARS or not budget.spend(len(key) + 4):
                continue
            kept, copy = _json_value(item, depth + 1, budget)
            if kept:
                out[key] = copy
        return budget.left >= 0, out
    if isinstance(value, list):
        items: list[Any] = []
        for item in value[:_LIST_ITEMS]:
            kept, copy = _json_value(item, depth + 1, budget)
            if kept:
                items.append(copy)
        return budget.spend(2), items
    return False, None


def node_record(node: dict[str, Any]) -> dict[str, Any]:
    """
    One C{nodes[]} record of C{get_ray_status}: every key the helper gave (JSON values,
    bounded: L{_NODE_KEYS} keys, strings of L{_STRING_CHARS}, L{_RECORD_CHARS} in all), with
    the keys the backend reads typed: C{node_id}, C{node_ip}, C{node_manager_address} (the
    node's IP when the helper gave none), C{node_name}, C{alive}, C{is_head}, C{state}
    (C{ALIVE}/C{DEAD} when the helper gave none), C{gpus}, C{cpus}.
    """
    _kept, copied = _json_value(node, 0, _Budget(_RECORD_CHARS))
    out: dict[str, Any] = copied if isinstance(copied, dict) else {}
    alive_raw = node.get("alive", node.get("Alive"))
    state_raw = node.get("state")
    state = state_raw.strip().upper()[:32] if isinstance(state_raw, str) and state_raw.strip() else None
    alive = alive_raw is True or (alive_raw is None and state in _LIVE_STATES)
    node_ip = _str_or_none(node.get("node_ip") or node.get("NodeManagerAddress"))
    out.update(
        node_id=_str_or_none(node.get("node_id") or node.get("NodeID")),
        node_ip=node_ip,
        node_manager_address=_str_or_none(node.get("node_manager_address") or node.get("NodeManagerAddress"))
        or node_ip,
        node_name=_str_or_none(node.get("node_name") or node.get("NodeName")),
        alive=alive,
        is_head=node.get("is_head") is True,
        state=state or ("ALIVE" if alive else "DEAD"),
        gpus=_float(node.get("gpus")),
        cpus=_float(node.get("cpus")),
    )
    return out


def cluster_status(doc: dict[str, Any] | None, expected_version: str | None) -> dict[str, Any]:
    """
    C{get_ray_status} from the helper's C{cluster-status} answer (bounded, typed; Ray's node
    records passed through by L{node_record}). Linear in the answer: a thread function.
    """
    if not isinstance(doc, dict):
        return dead_cluster(detail="the runtime helper gave no answer")
    raw_nodes = doc.get("nodes")
    nodes = [node_record(n) for n in (raw_nodes[:MAX_NODES] if isinstance(raw_nodes, list) else [])
             if isinstance(n, dict)]
    version = _str_or_none(doc.get("version") or doc.get("ray_version"), 64)
    alive = bool(doc.get("alive", False))
    out: dict[str, Any] = {
        "alive": alive,
        "version": version,
        "ray_version": version,
        "num_nodes": int(_float(doc.get("num_nodes"))) if alive else 0,
        "nodes": nodes,
        "total_gpus": _float(doc.get("total_gpus")),
        "available_gpus": _float(doc.get("available_gpus", doc.get("total_gpus"))),
        "total_cpus": _float(doc.get("total_cpus")),
        "available_cpus": _float(doc.get("available_cpus", doc.get("total_cpus"))),
        "cluster_address": _str_or_none(doc.get("cluster_address")),
        "head_address": _str_or_none(doc.get("head_address") or doc.get("cluster_address")),
    }
    if not alive:
        # What the backend reads as a dead cluster (protocol 10.6).
        out.update(version=None, ray_version=None, num_nodes=0, nodes=[])
        if doc.get("error"):
            out["detail"] = str(doc["error"])[:500]
    if expected_version and version and version != expected_version:
        out["version_mismatch"] = {"expected": expected_version, "observed": version}
    return out


def _deployment(entry: Any) -> dict[str, Any]:
    e = entry if isinstance(entry, dict) else {}
    return {
        "status": str(e.get("status") or "")[:64],
        "message": str(e.get("message") or "")[:4000],
        "num_replicas_ready": int(_float(e.get("num_replicas_ready"))),
        "num_replicas_pending": int(_float(e.get("num_replicas_pending"))),
    }


#: Deployment states the original agent (and the backend) count as serving.
HEALTHY_DEPLOYMENT_STATES = frozenset({"HEALTHY", "RUNNING", "UP"})


def serve_active(apps: dict[str, Any]) -> bool:
    """
    Serve's C{active}: at least one application, every application C{RUNNING} and every
    deployment of each healthy (L{HEALTHY_DEPLOYMENT_STATES}).
    """
    return bool(apps) and all(
        str(app.get("status", "")).upper() == "RUNNING"
        and all(str(dep.get("status", "")).upper() in HEALTHY_DEPLOYMENT_STATES
                for dep in app.get("deployments", {}).values())
        for app in apps.values()
    )


def serve_status(doc: dict[str, Any] | None, app_name: str | None) -> dict[str, Any]:
    """C{get_ray_serve_status} from the helper's C{serve-status} answer: {available, active, apps, detail}."""
    if not isinstance(doc, dict):
        return {"available": False, "active": False, "apps": {}, "detail": "the runtime helper gave no answer"}
    raw = doc.get("apps") or doc.get("applications") or {}
    apps: dict[str, Any] = {}
    if isinstance(raw, dict):
        for name, app in list(raw.items())[:256]:
            if not isinstance(app, dict):
                continue
            raw_deps = app.get("deployments")
            deployments: dict[str, Any] = raw_deps if isinstance(raw_deps, dict) else {}
            apps[str(name)[:200]] = {
                "status": str(app.get("status") or "")[:64],
                "message": str(app.get("message") or "")[:4000],
                "deployments": {str(k)[:200]: _deployment(v) for k, v in list(deployments.items())[:64]},
                **({"route_prefix": str(app["route_prefix"])[:256]} if app.get("route_prefix") else {}),
            }
    if app_name is not None:
        apps = {app_name: apps[app_name]} if app_name in apps else {}
    detail = doc.get("error") or doc.get("detail")
    available = bool(doc.get("available", False))
    return {
        "available": available,
        "active": available and serve_active(apps),
        "apps": apps,
        "detail": str(detail)[:1000] if detail else None,
    }


#: Ray's own list of its Prometheus exporters (file_sd format), inside the container.
METRICS_DISCOVERY_FILE = "/tmp/ray/prom_metrics_service_discovery.json"
_TARGET_RE = re.compile(r"^([A-Za-z0-9.:\[\]-]{1,255}):([0-9]{1,5})$")


def metrics_targets(text: str) -> dict[str, Any]:
    """C{get_ray_status.metrics} from Ray's discovery file: {enabled, targets [{address, port, url}]}."""
    try:
        groups = json.loads(text) if text.strip() else []
    except (ValueError, RecursionError):
        groups = []
    targets: list[dict[str, Any]] = []
    for group in groups[:64] if isinstance(groups, list) else []:
        entries = group.get("targets") if isinstance(group, dict) else None
        for entry in entries[:256] if isinstance(entries, list) else []:
            m = _TARGET_RE.match(str(entry)[:300])
            if m is None or not 0 < int(m.group(2)) < 65536:
                continue
            address, port = m.group(1), int(m.group(2))
            targets.append({"node_id": None, "address": address, "port": port,
                            "url": f"http://{address}:{port}/metrics"})
    return {"enabled": bool(targets), "targets": targets[:1024]}
