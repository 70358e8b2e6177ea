"""
Air-gapped model delivery (protocol 4.3): copy HuggingFace hub caches from the backend
into MODEL_STORE, resumably, verified, without blocking the reactor.

The names below are imported at their first use: the agent's command table reads
L{llmport_agent.models.handler} at start, and the syncer (with its file and HTTP layers) is
imported only when a model is first synced (issue 27).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmport_agent.models.handler import sync_model_handler_spec
    from llmport_agent.models.manifest import Manifest, parse_manifest
    from llmport_agent.models.syncer import ModelSyncer

__all__ = ["Manifest", "ModelSyncer", "parse_manifest", "sync_model_handler_spec"]

_WHERE = {
    "Manifest": "llmport_agent.models.manifest",
    "parse_manifest": "llmport_agent.models.manifest",
    "ModelSyncer": "llmport_agent.models.syncer",
    "sync_model_handler_spec": "llmport_agent.models.handler",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(where), name)
