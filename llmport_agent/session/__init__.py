"""
The backend session (enrollment, the stream, polls, rotation).

Autobahn's Twisted package is registered without its C{__init__}, which imports Autobahn's
WAMP modules (the stream is plain WebSocket): see L{defer_package_init}.
"""

from llmport_agent.core.lazypackage import defer_package_init

defer_package_init("autobahn.twisted")
