"""The Serve controller client, as far as the describe program uses it."""

from __future__ import annotations

from typing import Any

from ray import scenario
from ray.serve.llm import LLMConfig


class _ServerConfig(LLMConfig):
    """What Serve stores: a subclass, not the public class."""


class Handle:
    """Like a DeploymentHandle: any attribute name is answered, with a method."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: Handle()


class _ReplicaConfig:
    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.init_args, self.init_kwargs = args, kwargs


class _Info:
    def __init__(self, replica: _ReplicaConfig) -> None:
        self.replica_config = replica


class _Client:
    def get_serve_details(self) -> dict[str, Any]:
        s = scenario()
        apps = {}
        for name, app in s.get("apps", {}).items():
            apps[name] = {
                "route_prefix": app.get("route_prefix", f"/{name}"),
                "status": app.get("status", "RUNNING"),
                "message": "",
                "deployments": {
                    dep: {"status": "HEALTHY", "message": "", "replicas": [{"state": "RUNNING"}] * d.get("replicas", 1),
                          "deployment_config": {"num_replicas": d.get("replicas", 1)}}
                    for dep, d in app.get("deployments", {}).items()
                },
            }
        return {"http_options": s.get("http_options", {"host": "127.0.0.1", "port": 8000}), "applications": apps}

    def get_deployment_info(self, name: str, app_name: str) -> tuple[_Info, str | None]:
        dep = scenario()["apps"][app_name]["deployments"][name]
        if dep.get("error"):
            raise RuntimeError(dep["error"])
        if "llm_config" in dep:
            config = _ServerConfig.model_validate(dep["llm_config"])
            return _Info(_ReplicaConfig((), {"llm_config": config, "engine_cls": None})), None
        # An ingress: its arguments hold handles to the LLM servers (never configurations).
        return _Info(_ReplicaConfig((Handle(),), {"llm_deployments": [Handle(), Handle()], "server": Handle()})), f"/{app_name}"


def _get_global_client(raise_if_no_controller_running: bool = True) -> _Client | None:
    if not scenario().get("serve_running", True):
        if raise_if_no_controller_running:
            raise RuntimeError("There is no Serve instance running on this Ray cluster.")
        return None
    return _Client()
