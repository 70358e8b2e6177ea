"""A stand-in for the parts of Ray that the describe program uses (see ../README.md)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

__version__ = "2.58.0"


def scenario() -> dict[str, Any]:
    with open(os.environ["STANDIN_RAY_SCENARIO"], encoding="utf-8") as f:
        return json.load(f)  # type: ignore[no-any-return]


def init(**kwargs: Any) -> None:
    # Ray logs on stdout around what the driver prints.
    sys.stdout.write("2026-12-02 10:00:00,000\tINFO worker.py:1 -- Connecting to existing Ray cluster at: 127.0.0.2:6379...\n")
    error = scenario().get("attach_error")
    if error:
        raise ConnectionError(error)
    if kwargs.get("address") != "auto":
        raise ValueError("the stand-in attaches only with address='auto'")


class _Context:
    @property
    def gcs_address(self) -> str:
        return str(scenario().get("gcs_address", "127.0.0.2:6379"))


def get_runtime_context() -> _Context:
    return _Context()


def nodes() -> list[dict[str, Any]]:
    return list(scenario().get("nodes", []))
