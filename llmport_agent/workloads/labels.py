"""
The labels the agent puts on the containers it manages (light: the health watcher, adoption and
the container helpers read them at start, without the spec parser and its policy checks).
"""

from __future__ import annotations

LABEL_MANAGED = "io.llmport.managed"
MANAGED_VALUE = "llmport-agent"
LABEL_RUNTIME_ID = "io.llmport.runtime-id"
LABEL_RUNTIME_NAME = "io.llmport.runtime-name"
LABEL_COMMAND_ID = "io.llmport.command-id"
LABEL_PROVIDER = "io.llmport.provider-type"
LABEL_CONTAINER_PORT = "io.llmport.container-port"
LABEL_HOST_PORT = "io.llmport.host-port"
LABEL_AGENT_ID = "io.llmport.agent-id"
LABEL_NETWORK = "io.llmport.network-mode"
LABEL_HEALTH_PATH = "io.llmport.health-path"
LABEL_NAME = "io.llmport.container-name"
LABEL_IMAGE = "io.llmport.image"

__all__ = [
    "LABEL_AGENT_ID",
    "LABEL_COMMAND_ID",
    "LABEL_CONTAINER_PORT",
    "LABEL_HEALTH_PATH",
    "LABEL_HOST_PORT",
    "LABEL_IMAGE",
    "LABEL_MANAGED",
    "LABEL_NAME",
    "LABEL_NETWORK",
    "LABEL_PROVIDER",
    "LABEL_RUNTIME_ID",
    "LABEL_RUNTIME_NAME",
    "MANAGED_VALUE",
]
