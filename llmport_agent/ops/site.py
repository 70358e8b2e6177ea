"""
The ops endpoint's web site: C{/healthz}, C{/readyz} and C{/metrics} on the bounded HTTP
server (L{llmport_agent.ops.bounded}). L{llmport_agent.ops.endpoint.OpsService} builds it at
the first connection, so an agent nobody scrapes never imports twisted.web's server side or
prometheus_client (issue 27).
"""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from twisted.logger import Logger
from twisted.web.resource import Resource

from llmport_agent.ops.bounded import BoundedSite
from llmport_agent.ops.metrics import make_registry, render
from llmport_agent.ops.readiness import readiness

__all__ = ["QuietSite", "make_site"]


class _Metrics(Resource):
    isLeaf = True

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__()
        self.registry = registry

    def render_GET(self, request: Any) -> bytes:
        request.setHeader(b"content-type", CONTENT_TYPE_LATEST.encode())
        return render(self.registry)


class _Health(Resource):
    isLeaf = True

    def __init__(self, agent: Any, ready: bool) -> None:
        super().__init__()
        self.agent = agent
        self.ready = ready

    def render_GET(self, request: Any) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"cache-control", b"no-store")
        if not self.ready:
            return b'{"status":"ok"}'
        body = readiness(self.agent)
        if not body["ready"]:
            request.setResponseCode(503)
        return json.dumps(body, default=str).encode()


#: Module level: a Logger class attribute would take the class's name as its namespace.
_access_log = Logger(namespace="llmport_agent.ops.endpoint.access")


class QuietSite(BoundedSite):
    """
    A Site whose access log lines are DEBUG events (C{llmport_agent.ops.endpoint.access}), not INFO
    lines in the journal for every scrape of C{/metrics} or C{/readyz}.
    """

    def _updateLogDateTime(self) -> None:  # noqa: N802 - Twisted's name
        """
        Nothing: Twisted's L{HTTPFactory} refreshes a date string for its access log once a
        second, from C{startFactory} on; L{log} below never reads it, so the idle agent does
        not wake up for it.
        """

    def log(self, request: Any) -> None:
        _access_log.debug(
            "{method} {path} {code} {size}",
            method=request.method.decode("ascii", "replace")[:16],
            path=request.uri.decode("ascii", "replace")[:200],
            code=request.code,
            size=request.sentLength,
        )


def make_site(agent: Any, reactor: Any) -> QuietSite:
    """The site: C{/metrics} (the agent's registry), C{/healthz} and C{/readyz}."""
    root = Resource()
    root.putChild(b"metrics", _Metrics(make_registry(agent)))
    root.putChild(b"healthz", _Health(agent, ready=False))
    root.putChild(b"readyz", _Health(agent, ready=True))
    return QuietSite(root, reactor)
