"""The public LLMConfig (a pydantic model, as in Ray 2.58)."""

from __future__ import annotations

from typing import Any

import pydantic


class ModelLoadingConfig(pydantic.BaseModel):
    model_id: str
    model_source: str | None = None
    tokenizer_source: str | None = None


class LLMConfig(pydantic.BaseModel):
    model_loading_config: ModelLoadingConfig
    llm_engine: str = "vLLM"
    engine_kwargs: dict[str, Any] = {}
    deployment_config: dict[str, Any] = {}
    accelerator_type: str | None = None
    runtime_env: dict[str, Any] | None = None
    placement_group_config: dict[str, Any] | None = None
