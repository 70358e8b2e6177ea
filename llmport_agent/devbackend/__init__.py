"""
A local stand-in of the llm-port backend's node-facing side (see C{protocol.md}).

Used by the agent's tests, its C{demo} command and C{llmport-agent devbackend}.
"""

from __future__ import annotations

from llmport_agent.devbackend._state import OMIT
from llmport_agent.devbackend.backend import STREAM_PATH, DevBackend, Faults, ImageEntry
from llmport_agent.devbackend.runtimes import Provider, Runtime, build_payload
from llmport_agent.devbackend.tls import TLSFiles, make_test_tls, tls_files_in

__all__ = [
    "OMIT",
    "Provider",
    "Runtime",
    "build_payload",
    "STREAM_PATH",
    "DevBackend",
    "Faults",
    "ImageEntry",
    "TLSFiles",
    "make_test_tls",
    "tls_files_in",
]
