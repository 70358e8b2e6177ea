"""
The ops endpoint on loopback: C{/healthz} (the process is alive), C{/readyz} (connected to the
backend), C{/metrics} (Prometheus text format). Metrics are read from the running services at
scrape time; no label ever carries a secret.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.logger import Logger
from twisted.web.resource import Resource
from twisted.web.server import Site


class _AgentCollector:
    def __init__(self, agent: Any) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Any]:
        a = self.agent
        s = a.session.stats
        up = GaugeMetricFamily("llmport_agent_connected", "1 while the backend stream is open")
        up.add_metric([], 1.0 if a.session.connected else 0.0)
        yield up
        opens = CounterMetricFamily("llmport_agent_session_opens", "Backend stream opens")
        opens.add_metric([], s.opens)
        yield opens
        refused = CounterMetricFamily("llmport_agent_session_refused", "Refused stream upgrades")
        refused.add_metric([], s.refused)
        yield refused
        commands = CounterMetricFamily(
            "llmport_agent_commands", "Commands by outcome", labels=["outcome"]
        )
        for key, value in a.pipeline.stats.items():
            commands.add_metric([key], value)
        yield commands
        running = GaugeMetricFamily("llmport_agent_commands_running", "Commands running now")
        running.add_metric([], len(a.pipeline._running))
        yield running
        outbox = GaugeMetricFamily("llmport_agent_event_outbox_depth", "Events waiting to be sent")
        outbox.add_metric([], a.outbox.depth)
        yield outbox
        dropped = CounterMetricFamily("llmport_agent_events_dropped", "Events dropped (outbox full)")
        dropped.add_metric([], a.outbox.dropped)
        yield dropped
        hb = CounterMetricFamily("llmport_agent_heartbeats", "Heartbeats sent")
        hb.add_metric([], a.heartbeat.sent)
        yield hb
        mode = GaugeMetricFamily("llmport_agent_mode", "Node mode flags", labels=["mode"])
        mode.add_metric(["maintenance"], 1.0 if a.modes.maintenance else 0.0)
        mode.add_metric(["draining"], 1.0 if a.modes.draining else 0.0)
        yield mode


class _Metrics(Resource):
    isLeaf = True

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__()
        self.registry = registry

    def render_GET(self, request: Any) -> bytes:
        request.setHeader(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")
        return bytes(generate_latest(self.registry))


class _Health(Resource):
    isLeaf = True

    def __init__(self, agent: Any, ready: bool) -> None:
        super().__init__()
        self.agent = agent
        self.ready = ready

    def render_GET(self, request: Any) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        if not self.ready:
            return b'{"status":"ok"}'
        ok = bool(self.agent.session.connected)
        if not ok:
            request.setResponseCode(503)
        return json.dumps({"status": "ready" if ok else "not_connected"}).encode()


class OpsService(Service):
    log = Logger()

    def __init__(self, reactor: Any, agent: Any, port: int, interface: str = "127.0.0.1") -> None:
        self.setName("ops")
        self._reactor = reactor
        self.agent = agent
        self.port = port
        self.interface = interface
        self._listening: Any = None

    def startService(self) -> None:
        super().startService()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_AgentCollector(self.agent))  # type: ignore[arg-type]
        root = Resource()
        root.putChild(b"metrics", _Metrics(registry))
        root.putChild(b"healthz", _Health(self.agent, ready=False))
        root.putChild(b"readyz", _Health(self.agent, ready=True))
        site = Site(root)
        site.noisy = False
        endpoint = TCP4ServerEndpoint(self._reactor, self.port, interface=self.interface)
        d = endpoint.listen(site)

        def listening(port: Any) -> None:
            self._listening = port
            self.log.info("Ops endpoint on http://{host}:{port}/ (healthz, readyz, metrics)",
                          host=self.interface, port=port.getHost().port)

        def failed(f: Any) -> None:
            self.log.warn(
                "The ops endpoint could not listen on {host}:{port} ({error}); running without it "
                "(set LLM_PORT_NODE_AGENT_OPS_PORT to another port, or 0 to disable)",
                host=self.interface,
                port=self.port,
                error=f.getErrorMessage(),
            )

        d.addCallbacks(listening, failed)

    def stopService(self) -> Deferred[None]:
        super().stopService()
        port, self._listening = self._listening, None
        if port is None:
            return succeed(None)
        return port.stopListening()
