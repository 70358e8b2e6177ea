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
        return float(value or 0.0)
    except (TypeError, ValueError, OverflowError):
        return 0.0


def _str_or_none(value: Any, limit: int = 256) -> str | None:
    return str(value)[:limit] if isinstance(value, (str, int, float)) and str(value) else None


def dead_cluster(**extra: Any) -> dict[str, Any]:
    """What C{get_ray_status} answers when no Ray runs here."""
    return {"alive": False, "version": None, "num_nodes": 0, "nodes": [], **extra}


def cluster_status(doc: dict[str, Any] | None, expected_version: str | None) -> dict[str, Any]:
    """C{get_ray_status} from the helper's C{cluster-status} answer (bounded, typed)."""
    if not isinstance(doc, dict):
        return dead_cluster(detail="the runtime helper gave no answer")
    nodes = []
    for node in (doc.get("nodes") or [])[:1024] if isinstance(doc.get("nodes"), list) else []:
        if not isinstance(node, dict):
            continue
        alive = bool(node.get("alive", False))
        nodes.append({
            "node_id": _str_or_none(node.get("node_id")),
            "node_ip": _str_or_none(node.get("node_ip")),
            "alive": alive,
            "is_head": bool(node.get("is_head", False)),
            "state": "ALIVE" if alive else "DEAD",
            "gpus": _float(node.get("gpus")),
            "cpus": _float(node.get("cpus")),
        })
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


def serve_status(doc: dict[str, Any] | None, app_name: str | None) -> dict[str, Any]:
    """C{get_ray_serve_status} from the helper's C{serve-status} answer: {available, apps, detail}."""
    if not isinstance(doc, dict):
        return {"available": False, "apps": {}, "detail": "the runtime helper gave no answer"}
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
    return {
        "available": bool(doc.get("available", False)),
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
