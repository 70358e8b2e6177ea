"""
The inspection program of C{describe_ray_cluster}: run INSIDE the Ray runtime container as
C{python3 -} (this file on stdin), never imported by the agent.

It attaches to the running cluster with Ray's own API and prints one JSON document between
two markers that carry the nonce the agent passed in C{LLMPORT_DESCRIBE_NONCE} (Ray prints
log lines of its own around it):

    {"attached", "ray_version", "gcs_address", "nodes": [...], "serve": {"running",
     "http_options"}, "apps": [{"name", "route_prefix", "status", "message", "deployments":
     [...], "llm_configs": [...], "defaults": [[...]], "errors": [...]}], "errors": [...]}

For the apps whose name starts with C{LLMPORT_DESCRIBE_APP_PREFIX} (the apps llm-port
deploys), each deployment's replica config is read from the Serve controller
(C{get_deployment_info}): an LLM server deployment holds its C{LLMConfig} in
C{init_kwargs['llm_config']} (in Ray 2.58 an internal subclass, not the public
C{ray.serve.llm.LLMConfig}), so a configuration is recognised as a pydantic model with a
C{model_loading_config} field, found by walking plain dicts, lists and tuples only: an
ingress's arguments hold DeploymentHandles, which answer every attribute name and are never
taken for configurations. Each configuration is dumped as JSON, with C{defaults}: the dotted
paths of its fields that nobody set (Ray's defaults). Other apps are listed with
C{llm_configs: []}.

The agent compares, bounds and type-checks all of this itself (L{llmport_agent.ray.describe}):
this program only reads. Standard library and Ray only; Python 3.9 or later.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from typing import Any

#: Bounds on what is printed (the agent enforces its own as well).
MAX_NODES = 1024
MAX_APPS = 256
MAX_DEPLOYMENTS = 64
MAX_CONFIGS = 16
MAX_WALK = 10000
MAX_DEPTH = 8
MAX_TEXT = 2000


def _text(value: Any, limit: int = MAX_TEXT) -> str | None:
    if value is None:
        return None
    return str(getattr(value, "value", value))[:limit]


def _num(value: Any) -> float:
    try:
        return float(value or 0)
    except (TypeError, ValueError):
        return 0.0


def _why(what: str, exc: BaseException) -> str:
    return f"{what}: {type(exc).__name__}: {str(exc)[:300]}"


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _nodes(ray: Any) -> list[dict[str, Any]]:
    nodes = []
    for node in list(ray.nodes())[:MAX_NODES]:
        if not isinstance(node, dict):
            continue
        resources = node.get("Resources") or {}
        nodes.append({
            "node_id": _text(node.get("NodeID"), 128),
            "ip": _text(node.get("NodeManagerAddress"), 128),
            "hostname": _text(node.get("NodeManagerHostname"), 256),
            "alive": bool(node.get("Alive")),
            "is_head": "node:__internal_head__" in resources,
            "gpus": _num(resources.get("GPU")),
            "cpus": _num(resources.get("CPU")),
        })
    return nodes


def _is_config(value: Any, base: type) -> bool:
    # By shape, not by class: the class Serve stores is not the public LLMConfig. isinstance()
    # looks at the real type, so a handle that answers every attribute is never one.
    return isinstance(value, base) and "model_loading_config" in getattr(type(value), "model_fields", {})


def find_configs(roots: list[Any], base: type) -> list[Any]:
    """The LLM configurations among C{roots}: plain containers walked, nothing else."""
    found: list[Any] = []
    stack = [(root, 0) for root in reversed(roots)]
    seen = 0
    while stack and seen < MAX_WALK and len(found) < MAX_CONFIGS:
        value, depth = stack.pop()
        seen += 1
        if _is_config(value, base):
            found.append(value)
        elif depth < MAX_DEPTH and type(value) in (dict, list, tuple):
            items = list(value.values()) if type(value) is dict else list(value)
            stack.extend((item, depth + 1) for item in reversed(items))
    return found


def unset_paths(model: Any, base: type) -> list[str]:
    """Dotted paths of the fields of C{model} (and of its nested models) nobody set."""
    out: list[str] = []
    stack = [(model, "")]
    while stack and len(out) < MAX_WALK:
        current, prefix = stack.pop()
        fields_set: Any = getattr(current, "model_fields_set", set())
        for name in sorted(getattr(type(current), "model_fields", {})):
            path = prefix + name
            if name not in fields_set:
                out.append(path)
                continue
            child = getattr(current, name, None)
            if isinstance(child, base):
                stack.append((child, path + "."))
    return sorted(out)


def _dump(model: Any) -> Any:
    try:
        return _jsonable(model.model_dump(mode="json"))
    except Exception:  # noqa: BLE001 - an older pydantic or an odd field: plain dump
        return _jsonable(model.model_dump())


def _deployment(name: Any, dep: Any) -> dict[str, Any]:
    dep = dep if isinstance(dep, dict) else {}
    replicas = dep.get("replicas") if isinstance(dep.get("replicas"), list) else []
    states = [_text((r or {}).get("state"), 64) if isinstance(r, dict) else None for r in replicas]
    running = sum(1 for s in states if s == "RUNNING")
    return {
        "name": _text(name, 256),
        "status": _text(dep.get("status"), 64),
        "message": _text(dep.get("message") or ""),
        "running_replicas": running,
        "pending_replicas": len(states) - running,
    }


def _app(client: Any, name: Any, app: Any, prefix: str, base: type) -> dict[str, Any]:
    app = app if isinstance(app, dict) else {}
    entry: dict[str, Any] = {
        "name": _text(name, 256),
        "route_prefix": _text(app.get("route_prefix"), 256),
        "status": _text(app.get("status"), 64),
        "message": _text(app.get("message") or ""),
        "deployments": [],
        "llm_configs": [],
        "defaults": [],
        "errors": [],
    }
    deployments = app.get("deployments") if isinstance(app.get("deployments"), dict) else {}
    configs: list[Any] = []
    for dep_name, dep in list(deployments.items())[:MAX_DEPLOYMENTS]:
        entry["deployments"].append(_deployment(dep_name, dep))
        if not str(name).startswith(prefix):
            continue  # not deployed by llm-port: listed, not read
        try:
            info, _route = client.get_deployment_info(dep_name, name)
            replica = info.replica_config
            roots = [replica.init_args or (), replica.init_kwargs or {}]
            configs.extend(find_configs(roots, base)[: MAX_CONFIGS - len(configs)])
        except Exception as exc:  # noqa: BLE001 - said, the rest still read
            entry["errors"].append(_why(f"deployment {dep_name}", exc))
    for config in configs:
        try:
            entry["llm_configs"].append(_dump(config))
            entry["defaults"].append(unset_paths(config, base))
        except Exception as exc:  # noqa: BLE001
            entry["errors"].append(_why("llm_config", exc))
    return entry


def _serve(out: dict[str, Any], prefix: str) -> None:
    try:
        import pydantic
        from ray.serve.context import _get_global_client
    except Exception as exc:  # noqa: BLE001
        out["errors"].append(_why("serve", exc))
        return
    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        out["serve"] = {"running": False, "http_options": None}
        return
    details = client.get_serve_details() or {}
    http = details.get("http_options") if isinstance(details, dict) else None
    out["serve"] = {"running": True, "http_options": _jsonable(http) if isinstance(http, dict) else None}
    apps = details.get("applications") if isinstance(details, dict) else None
    for name, app in list((apps if isinstance(apps, dict) else {}).items())[:MAX_APPS]:
        out["apps"].append(_app(client, name, app, prefix, pydantic.BaseModel))


def inspect(prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {"attached": False, "ray_version": None, "gcs_address": None, "nodes": [],
           "serve": {"running": False, "http_options": None}, "apps": [], "errors": []}
    try:
        import ray
    except Exception as exc:  # noqa: BLE001
        out["ray_importable"] = False
        out["errors"].append(_why("import ray", exc))
        return out
    out["ray_version"] = _text(getattr(ray, "__version__", None), 64)
    try:
        ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    except Exception as exc:  # noqa: BLE001 - no cluster to attach to
        out["errors"].append(_why("attach", exc))
        return out
    out["attached"] = True
    try:
        out["gcs_address"] = _text(getattr(ray.get_runtime_context(), "gcs_address", None), 256)
        out["nodes"] = _nodes(ray)
    except Exception as exc:  # noqa: BLE001
        out["errors"].append(_why("nodes", exc))
    try:
        _serve(out, prefix)
    except Exception as exc:  # noqa: BLE001
        out["errors"].append(_why("serve", exc))
    return out


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    nonce = os.environ.get("LLMPORT_DESCRIBE_NONCE", "")
    prefix = os.environ.get("LLMPORT_DESCRIBE_APP_PREFIX", "llmport-")
    doc = inspect(prefix)
    text = json.dumps(doc, default=str)
    sys.stdout.write(f"\n@@llmport-describe-begin:{nonce}@@{text}@@llmport-describe-end:{nonce}@@\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
