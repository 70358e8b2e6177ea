"""
The ops endpoint on loopback: C{/healthz} (the process is alive), C{/readyz} (one check per
subsystem: session, engine, NVML, Loki; 503 with a JSON body saying what is wrong),
C{/metrics} (Prometheus text format through prometheus_client; see L{llmport_agent.ops.metrics}).
Metrics are read from the running services at scrape time; no label ever carries a secret.

The port listens from the start; the web site behind it (L{llmport_agent.ops.site}: twisted.web's
server side and prometheus_client, about 2 MiB) is built at the first connection, so an agent
nobody scrapes never imports it (issue 27).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.protocol import Factory
from twisted.logger import Logger

from llmport_agent.core.backoff import Backoff

# What /readyz answers; the names stay importable from here.
from llmport_agent.ops.readiness import gpu_readiness as gpu_readiness
from llmport_agent.ops.readiness import loki_readiness as loki_readiness
from llmport_agent.ops.readiness import readiness as readiness

#: Bind retries: 1 s, then doubling to a minute (another process may hold the port a while).
BIND_RETRY_MIN = 1.0
BIND_RETRY_MAX = 60.0


class SiteOnFirstConnection(Factory):
    """
    The listening port's factory: it builds the site (C{build()}) at the first connection and
    hands every connection to it. The port's start and stop reach the site as they would if it
    listened itself (its bounds and timers start with the port, once it exists).
    """

    noisy = False

    def __init__(self, build: Callable[[], Any]) -> None:
        self._build = build
        self._site: Any = None
        self._ports = 0

    @property
    def built(self) -> bool:
        """Whether the site exists yet."""
        return self._site is not None

    def site(self) -> Any:
        """The site, built now if it was not."""
        if self._site is None:
            self._site = self._build()
            for _ in range(self._ports):
                self._site.doStart()
        return self._site

    def logPrefix(self) -> str:  # noqa: N802 - Twisted's name
        return "OpsSite"

    def doStart(self) -> None:  # noqa: N802 - Twisted's name
        self._ports += 1
        if self._site is not None:
            self._site.doStart()

    def doStop(self) -> None:  # noqa: N802 - Twisted's name
        self._ports = max(0, self._ports - 1)
        if self._site is not None:
            self._site.doStop()

    def buildProtocol(self, addr: Any) -> Any:  # noqa: N802 - Twisted's name
        return self.site().buildProtocol(addr)


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
        self._factory: SiteOnFirstConnection | None = None
        self._retry: Any = None  # IDelayedCall of the next bind attempt
        self._binding: Deferred[Any] | None = None
        self.bind_failures = 0
        self.backoff = Backoff(BIND_RETRY_MIN, BIND_RETRY_MAX, random=lambda: 1.0)

    def startService(self) -> None:
        super().startService()
        if self._factory is None:
            self._factory = SiteOnFirstConnection(self._make_site)
        self.bind_failures = 0
        self._bind()

    def _make_site(self) -> Any:
        from llmport_agent.ops.site import make_site

        return make_site(self.agent, self._reactor)

    @property
    def site(self) -> Any:
        """
        The web site (a L{llmport_agent.ops.site.QuietSite}), built now if no connection built
        it yet; C{None} before the service first starts.
        """
        return None if self._factory is None else self._factory.site()

    @property
    def site_built(self) -> bool:
        """Whether the web site exists (a connection came, or L{site} was read)."""
        return self._factory is not None and self._factory.built

    def _bind(self) -> None:
        self._retry = None
        if not self.running or self._factory is None:
            return
        endpoint = TCP4ServerEndpoint(self._reactor, self.port, interface=self.interface)
        d = self._binding = endpoint.listen(self._factory)

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
