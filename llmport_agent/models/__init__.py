"""
Air-gapped model delivery (protocol 4.3): copy HuggingFace hub caches from the backend
into MODEL_STORE, resumably, verified, without blocking the reactor.
"""

from __future__ import annotations

from llmport_agent.models.handler import sync_model_handler_spec
from llmport_agent.models.manifest import Manifest, parse_manifest
from llmport_agent.models.syncer import ModelSyncer

__all__ = ["Manifest", "ModelSyncer", "parse_manifest", "sync_model_handler_spec"]
