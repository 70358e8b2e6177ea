"""
The backend session (enrollment, the stream, polls, rotation).

Autobahn's Twisted package is registered without its C{__init__}, which imports Autobahn's
WAMP modules (the stream is plain WebSocket): see L{defer_package_init}. Autobahn's NVX
validator and masker come from its compiled modules without the build scripts that parse C
at import: see L{install_light_nvx}.
"""

from llmport_agent.core.lazypackage import defer_package_init
from llmport_agent.core.nvxlight import install_light_nvx

defer_package_init("autobahn.twisted")
install_light_nvx()
