"""
The ops endpoint on loopback: C{/healthz} (the process is alive), C{/readyz} (one check per
subsystem: session, engine, NVML, Loki; 503 with a JSON body saying what is wrong),
C{/metrics} (Prometheus text format through prometheus_client; see L{llmport_agent.ops.metrics}).
Metrics are read from the running services at scrape time; no label ever carries a secret.
"""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.logger import Logger
from twisted.web.resource import Resource

from llmport_agent import VERSION
from llmport_agent.core.backoff import Backoff
from llmport_agent.ops.bounded import BoundedSite
from llmport_agent.ops.metrics import AgentCollector, make_registry, render

#: The collector (it lives in llmport_agent.ops.metrics; this name is kept for existing callers).
_AgentCollector = AgentCollector


class _Metrics(Resource):
    isLeaf = True

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__()
        self.registry = registry

    def render_GET(self, request: Any) -> bytes:
        request.setHeader(b"content-type", CONTENT_TYPE_LATEST.encode())
        return render(self.registry)


def _engine_problem(error: str) -> str:
    """The engine's own error names it ("Docker engine at ... is unreachable: ..."): said once."""
    return error if error.startswith("Docker engine") else f"Docker engine unreachable: {error}"


def readiness(agent: Any) -> dict[str, Any]:
    """
    What C{/readyz} answers: one check per subsystem (session, engine, NVML, Loki), each with
    C{ok} and a C{detail} saying what is wrong; C{ready} when all are ok and no stop is under way.
    """
    from llmport_agent.ops.metrics import gpu_snapshot, session_state, workload_states

    session = agent.session
    state = session_state(session)
    checks: dict[str, dict[str, Any]] = {
        "session": {
            "ok": bool(session.connected),
            "state": state,
            "detail": "connected to the backend" if session.connected
            else (session.stats.last_error or state.replace("_", " ")),
        }
    }
    dispatch = getattr(session, "dispatch", None)
    if dispatch is not None:
        checks["session"]["dispatch_mode"] = dispatch.mode
    engine = getattr(agent, "engine", None)
    if engine is None:
        checks["engine"] = {"ok": True, "detail": "Docker executor off"}
    else:
        checks["engine"] = {
            "ok": bool(engine.available),
            "detail": f"Docker engine {engine.version} at {engine.address}" if engine.available
            else _engine_problem(engine.last_error),
        }
    checks["nvml"] = gpu_readiness(gpu_snapshot(agent))
    checks["loki"] = loki_readiness(agent)
    stopping = bool(getattr(agent, "stopping", False))
    ready = all(c["ok"] for c in checks.values()) and not stopping
    heartbeat = getattr(agent, "heartbeat", None)
    return {
        "ready": ready,
        "status": "stopping" if stopping else ("ready" if ready else "not_ready"),
        "checks": checks,
        "agent": {
            "version": VERSION,
            "node_id": session.node_id or "",
            "agent_id": agent.config.agent_id,
            "last_heartbeat_at": getattr(heartbeat, "last_sent_at", None),
            "workloads": len(workload_states(agent)),
            "commands_running": agent.pipeline.running_count,
            "heartbeat_status": agent.status.heartbeat_fields()["status"],
        },
    }


def loki_readiness(agent: Any) -> dict[str, Any]:
    """
    The C{loki} check of C{/readyz}: where logs go and whether pushes succeed. C{source} is
    C{LOKI_URL} (the operator's sink), C{backend} (the sink the backend named, LOKI_URL unset) or
    C{off}; C{url} is the sink without its password. Not ok after 3 failed pushes in a row,
    to either sink.
    """
    from llmport_agent.core.config import mask_url
    from llmport_agent.ops.metrics import loki_stats

    loki = loki_stats(agent)
    config = getattr(agent, "config", None)
    operator = bool(getattr(config, "loki_url", None))
    sink = getattr(agent, "log_sink", None)
    if loki is None:
        if sink is None or operator:
            return {"ok": True, "source": "off", "detail": "log shipping off"}
        last = str(getattr(sink, "last", "") or "not asked yet")
        return {"ok": True, "source": "off",
                "detail": f"log shipping off: LOKI_URL unset and the backend named no log sink ({last})"}
    source = "LOKI_URL" if operator else "backend"
    url = str(loki.get("url", "") or "")
    if not operator and sink is not None and getattr(sink, "url", None):
        url = mask_url(str(sink.url))
    where = f"{url} (LOKI_URL)" if operator else f"the backend's log sink {url} (LOKI_URL unset)"
    failures = int(loki.get("consecutive_failures", 0) or 0)
    return {
        "ok": failures < 3,
        "source": source,
        "url": url,
        "detail": f"{failures} failed pushes in a row to {where}: {loki.get('last_error', '')}" if failures
        else f"pushing to {where}",
        "queue_depth": loki.get("queue_depth", 0),
    }


def gpu_readiness(snap: Any) -> dict[str, Any]:
    """
    The C{nvml} check of C{/readyz}: whether the GPU driver answers, not whether the GPUs
    are good. Not ok when a GPU host's source fails (NVML broke) or when every GPU's driver
    calls hang (NVML is not answering at all). A GPU the driver I{reports} bad (an Xid 79,
    uncorrectable ECC, a reset required) is a hardware verdict, not an unready agent: the
    check stays ok and names it, while the heartbeat turns C{degraded} and the GPU leaves
    C{gpu_count} (restarting the agent would not mend the GPU). A host without GPUs (no
    driver) is not unready either.
    """
    if snap is None:
        return {"ok": True, "detail": "not read yet", "gpus": 0}
    error = str(snap.gpu_error or "")
    seen = snap.vendor != "none"
    devices = tuple(snap.devices)
    every_gpu_hangs = bool(devices) and all(d.health is not None and d.health.unresponsive for d in devices)
    if error:
        detail = error
    else:
        detail = f"{snap.device_count} GPU(s), {snap.count} schedulable"
        for d in [d for d in devices if d.state != "healthy"][:8]:
            detail += f"; {d.describe()} {d.state}: {'; '.join(d.health.reasons if d.health else ())[:200]}"
        if every_gpu_hangs:
            detail = "every GPU's driver calls hang (NVML is not answering): " + detail
    return {
        "ok": not (error and seen) and not every_gpu_hangs,
        "detail": detail[:2000],
        "gpus": snap.device_count,
        "schedulable": snap.count,
        "health": snap.by_state(),
    }


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


#: Bind retries: 1 s, then doubling to a minute (another process may hold the port a while).
BIND_RETRY_MIN = 1.0
BIND_RETRY_MAX = 60.0


class OpsService(Service):
    """
    The ops endpoint. A bind that fails (the port is taken, e.g. by the agent being replaced)
    is retried with backoff for as long as the agent runs; the agent says once that it is
    retrying and once when it listens.
    """

    log = Logger()

    def __init__(self, reactor: Any, agent: Any, port: int, interface: str = "127.0.0.1") -> None:
        self.setName("ops")
        self._reactor = reactor
        self.agent = agent
        self.port = port
        self.interface = interface
        self._listening: Any = None
        self.site: BoundedSite | None = None
        self._retry: Any = None  # IDelayedCall of the next bind attempt
        self._binding: Deferred[Any] | None = None
        self.bind_failures = 0
        self.backoff = Backoff(BIND_RETRY_MIN, BIND_RETRY_MAX, random=lambda: 1.0)

    def startService(self) -> None:
        super().startService()
        registry = make_registry(self.agent)
        root = Resource()
        root.putChild(b"metrics", _Metrics(registry))
        root.putChild(b"healthz", _Health(self.agent, ready=False))
        root.putChild(b"readyz", _Health(self.agent, ready=True))
        site = QuietSite(root, self._reactor)
        self.site = site
        self.bind_failures = 0
        self._bind()

    def _bind(self) -> None:
        self._retry = None
        if not self.running or self.site is None:
            return
        endpoint = TCP4ServerEndpoint(self._reactor, self.port, interface=self.interface)
        d = self._binding = endpoint.listen(self.site)

        def listening(port: Any) -> None:
            self._binding = None
            if not self.running:
                port.stopListening()
                return
            self._listening = port
            after = f" (after {self.bind_failures} failed attempts)" if self.bind_failures else ""
            self.log.info("Ops endpoint listening on http://{host}:{port}/ (healthz, readyz, metrics){after}",
                          host=self.interface, port=port.getHost().port, after=after)

        def failed(f: Any) -> None:
            self._binding = None
            if not self.running:
                return
            self.bind_failures += 1
            delay = self.backoff.delay(self.bind_failures - 1)
            fields = dict(host=self.interface, port=self.port, error=f.getErrorMessage(), delay=delay,
                          attempt=self.bind_failures)
            if self.bind_failures == 1:
                self.log.warn(
                    "The ops endpoint could not listen on {host}:{port} ({error}); running without "
                    "it and retrying (first in {delay:.0f} s, then up to every "
                    f"{BIND_RETRY_MAX:.0f} s). Free the port, or set LLM_PORT_NODE_AGENT_OPS_PORT to "
                    "another port (0 disables it)",
                    **fields,
                )
            else:
                self.log.debug("Ops endpoint bind attempt {attempt} failed ({error}); retrying in "
                               "{delay:.0f} s", **fields)
            self._retry = self._reactor.callLater(delay, self._bind)

        d.addCallbacks(listening, failed)

    @property
    def listening_port(self) -> int | None:
        """The bound port, or C{None} while not listening."""
        return None if self._listening is None else int(self._listening.getHost().port)

    def stopService(self) -> Deferred[None]:
        super().stopService()
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None
        port, self._listening = self._listening, None
        if port is None:
            return succeed(None)
        return port.stopListening()
