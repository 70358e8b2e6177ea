"""twistd plugin: ``twistd -n llmport-agent``. Kept tiny; the real work is in llmport_agent.agent.tap."""

from twisted.application.service import ServiceMaker

llmportAgent = ServiceMaker(
    "llmport-agent",
    "llmport_agent.agent.tap",
    "Node agent of llm-port GPU clusters",
    "llmport-agent",
)
