#!/opt/ray/bin/python3
"""
llm-port-ray-runtime: the helper CLI of the llmport-agent TEST runtime image.

The agent reaches Ray inside its runtime container only through this command (protocol 10.6):

    llm-port-ray-runtime cluster-status
    llm-port-ray-runtime serve-status [--app-name A]
    llm-port-ray-runtime run-serve-app --app-name A --route-prefix /A --config -
    llm-port-ray-runtime delete-serve-app --app-name A

Each verb prints ONE JSON object on stdout (the agent reads the first one). Implemented on
Ray's own SDK (ray.init(address="auto"), ray.nodes(), ray.serve). The test image deploys a
trivial Serve app for run-serve-app (no vLLM): it answers every request on its route with
{"app", "models", "route_prefix"}, the models being the llm_configs' model ids.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _emit(doc: dict) -> int:
    sys.stdout.write(json.dumps(doc, default=str) + "\n")
    sys.stdout.flush()
    return 0


def _connect():
    import ray

    ray.init(address="auto", logging_level="ERROR", log_to_driver=False, configure_logging=False)
    return ray


def cluster_status(_args) -> int:
    try:
        import ray
    except Exception as exc:  # noqa: BLE001
        return _emit({"alive": False, "version": None, "num_nodes": 0, "nodes": [], "error": str(exc)})
    try:
        _connect()
    except Exception as exc:  # noqa: BLE001 - no cluster here
        return _emit({"alive": False, "version": ray.__version__, "num_nodes": 0, "nodes": [],
                      "error": f"{type(exc).__name__}: {exc}"[:500]})
    nodes = []
    for n in ray.nodes():
        res = n.get("Resources") or {}
        alive = bool(n.get("Alive"))
        nodes.append({
            "node_id": n.get("NodeID"),
            "node_ip": n.get("NodeManagerAddress"),
            "alive": alive,
            "is_head": any(k == "node:__internal_head__" for k in res),
            "state": "ALIVE" if alive else "DEAD",
            "gpus": float(res.get("GPU", 0.0)),
            "cpus": float(res.get("CPU", 0.0)),
            "metrics_export_port": n.get("MetricsExportPort"),
        })
    total = ray.cluster_resources()
    avail = ray.available_resources()
    ctx = ray.get_runtime_context()
    gcs = getattr(ctx, "gcs_address", None)
    doc = {
        "alive": True,
        "version": ray.__version__,
        "num_nodes": sum(1 for n in nodes if n["alive"]),
        "nodes": nodes,
        "total_gpus": float(total.get("GPU", 0.0)),
        "available_gpus": float(avail.get("GPU", 0.0)),
        "total_cpus": float(total.get("CPU", 0.0)),
        "available_cpus": float(avail.get("CPU", 0.0)),
        "cluster_address": gcs,
        "head_address": gcs,
    }
    return _emit(doc)


def _overview(app) -> dict:
    deployments = {}
    for name, d in (getattr(app, "deployments", None) or {}).items():
        states = getattr(d, "replica_states", None) or {}
        ready = sum(v for k, v in states.items() if str(k).upper().endswith("RUNNING"))
        pending = sum(v for k, v in states.items() if not str(k).upper().endswith("RUNNING"))
        deployments[name] = {
            "status": str(getattr(d.status, "value", d.status)),
            "message": getattr(d, "message", "") or "",
            "num_replicas_ready": int(ready),
            "num_replicas_pending": int(pending),
        }
    return {
        "status": str(getattr(app.status, "value", app.status)),
        "message": getattr(app, "message", "") or "",
        "deployments": deployments,
    }


def serve_status(args) -> int:
    try:
        _connect()
        from ray import serve

        status = serve.status()
    except Exception as exc:  # noqa: BLE001
        return _emit({"available": False, "applications": {}, "error": f"{type(exc).__name__}: {exc}"[:500]})
    apps = {name: _overview(app) for name, app in (status.applications or {}).items()}
    if args.app_name:
        apps = {k: v for k, v in apps.items() if k == args.app_name}
    return _emit({"available": True, "applications": apps})


def run_serve_app(args) -> int:
    try:
        doc = json.loads(sys.stdin.read(4 * 1024 * 1024) if args.config == "-" else open(args.config).read())
        serving = doc.get("llm_serving_args") or {}
        http = doc.get("http_options") or {}
        models = []
        for cfg in serving.get("llm_configs") or []:
            loading = (cfg or {}).get("model_loading_config") or {}
            models.append(str(loading.get("model_id") or cfg.get("model_id") or ""))
        _connect()
        from ray import serve

        serve.start(
            proxy_location=str(doc.get("proxy_location") or "HeadOnly"),
            http_options={"host": str(http.get("host") or "127.0.0.1"), "port": int(http.get("port") or 8000)},
        )
        app_name, prefix = args.app_name, args.route_prefix

        @serve.deployment(name="echo", num_replicas=1, ray_actor_options={"num_cpus": 0})
        class Echo:
            def __init__(self, app: str, models: list, prefix: str) -> None:
                self.doc = {"app": app, "models": models, "route_prefix": prefix}

            async def __call__(self, request):
                return self.doc

        serve.run(Echo.bind(app_name, models, prefix), name=app_name, route_prefix=prefix, blocking=False)
    except Exception as exc:  # noqa: BLE001
        _emit({"deployed": False, "error": f"{type(exc).__name__}: {exc}"[:1000]})
        return 1
    return _emit({"deployed": True, "app_name": app_name, "route_prefix": prefix})


def delete_serve_app(args) -> int:
    try:
        _connect()
        from ray import serve

        serve.delete(args.app_name)
    except Exception as exc:  # noqa: BLE001
        _emit({"deleted": False, "app_name": args.app_name, "error": f"{type(exc).__name__}: {exc}"[:500]})
        return 1
    return _emit({"deleted": True, "app_name": args.app_name})


def main() -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    parser = argparse.ArgumentParser(prog="llm-port-ray-runtime")
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("cluster-status").set_defaults(fn=cluster_status)
    p = sub.add_parser("serve-status")
    p.add_argument("--app-name")
    p.set_defaults(fn=serve_status)
    p = sub.add_parser("run-serve-app")
    p.add_argument("--app-name", required=True)
    p.add_argument("--route-prefix", required=True)
    p.add_argument("--config", default="-")
    p.set_defaults(fn=run_serve_app)
    p = sub.add_parser("delete-serve-app")
    p.add_argument("--app-name", required=True)
    p.set_defaults(fn=delete_serve_app)
    args = parser.parse_args()
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
