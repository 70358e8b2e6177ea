"""llmport-agent: the node agent of llm-port GPU clusters."""

from llmport_agent._version import __version__

#: The plain version string sent to the backend (enroll ``version``, heartbeat ``version``).
VERSION: str = __version__.public()

__all__ = ["VERSION", "__version__"]
