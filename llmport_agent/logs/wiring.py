# -*- test-case-name: tests.test_logs_agent -*-
"""
Log shipping as the agent builds it from its configuration (used by the root service and by
the tests that restart it): a worker pool, the shipper with its spool, the agent's own log
observer, the journal reader and, with the Docker executor, the container log reader.

Start order: pool, shipper, journal reader, (engine,) container reader; stop in reverse, so the
readers hand their last lines to the shipper, which pushes or spools them, before the pool goes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from llmport_agent.core.config import AgentConfig
from llmport_agent.core.threads import PoolService
from llmport_agent.core.values import define

__all__ = ["LogShipping", "build_log_shipping", "journal_selection"]


def journal_selection(config: AgentConfig, *, backend_sink: bool) -> tuple[str, ...] | None:
    """
    Which of the host journal ships (issue 29: by the operator's consent): C{None} none, C{()}
    all of it, else these units. The operator chooses with C{LOG_JOURNAL_UNITS}; unset, the
    whole journal goes to the operator's own C{LOKI_URL} (as the original agent shipped it) and
    none of it to a sink the backend names, which gets the agent's own lines and its workloads'
    (what the backend may read, docs/security.md): sshd logins, sudo command lines and other
    services' logs are the host's, not the backend's.
    """
    units = tuple(config.log_journal_units)
    if units == ("none",):
        return None
    if units == ("*",):
        return ()
    if units:
        return units
    return None if backend_sink else ()


@define
class LogShipping:
    """The parts; C{services} in start order (the container reader goes after the engine)."""

    pool: PoolService
    shipper: Any
    http_pool: Any
    observer: Any
    journald: Any
    containers: Any
    ray_serve: Any = None

    def describe(self) -> dict[str, Any]:
        return {
            "loki": self.shipper.describe(),
            "journal": self.journald.describe() if self.journald is not None else {},
            "containers": self.containers.describe() if self.containers is not None else {},
            "ray_serve": self.ray_serve.describe() if self.ray_serve is not None else {},
        }

    @property
    def readers(self) -> list[Any]:
        """The pool, the shipper and the readers that do not need the engine, in start order."""
        parts = [self.pool, self.shipper, self.journald, self.ray_serve]
        return [p for p in parts if p is not None]


def build_log_shipping(
    reactor: Any,
    config: AgentConfig,
    *,
    state_dir: str,
    host: Callable[[], str],
    secrets: Callable[[], list[str]],
    engine: Any = None,
    docker_environ: Mapping[str, str] | None = None,
    journal_directory: str | None = None,
    journal_units: tuple[str, ...] | None = None,
    adoption: Any = None,
    backend_sink: bool = False,
) -> LogShipping:
    """
    Build (not start) log shipping to C{config.loki_url}.

    @param backend_sink: C{config.loki_url} is the sink the backend named (C{LOKI_URL} unset):
        the host journal ships only as far as C{LOG_JOURNAL_UNITS} says (see L{journal_selection}).
    @param journal_units: tests: these units instead of L{journal_selection}'s.
    @param host: returns the C{host} label (what the backend stores as the node host).
    @param secrets: returns the agent's secret values (token, credentials) to mask in every line.
    @param engine: the L{DockerEngine}, or C{None} for no container logs.
    @param adoption: the original agent's containers taken over (their logs ship too).
    """
    from twisted.logger import LogLevel

    from llmport_agent.core.logsetup import LEVELS
    from llmport_agent.logs.agent_source import AgentLogObserver, node_labels
    from llmport_agent.logs.auth import LokiAuth
    from llmport_agent.logs.containers import ContainerLogSource
    from llmport_agent.logs.journald import JournaldSource
    from llmport_agent.logs.loki import LokiShipper, loki_http_client
    from llmport_agent.logs.rayserve import RayServeLogSource
    from llmport_agent.logs.spool import SPOOL_DIR, Spool
    from llmport_agent.session.tls import https_policy

    c = config
    assert c.loki_url is not None
    pool = PoolService(reactor, "logs", 2)
    http, http_pool = loki_http_client(
        reactor,
        tls_policy=https_policy(c.verify_tls, c.ca_bundle),
        connect_timeout=c.request_timeout_sec,
    )
    spool = None
    if c.loki_spool_max_mb > 0:
        spool = Spool(pool, os.path.join(state_dir, SPOOL_DIR), c.loki_spool_max_mb << 20)
    auth = LokiAuth(
        tenant=c.loki_tenant,
        username=c.loki_username,
        password=c.loki_password,
        password_file=c.loki_password_file,
        bearer_token=c.loki_bearer_token,
        bearer_token_file=c.loki_bearer_token_file,
    )
    shipper = LokiShipper(
        reactor,
        http,
        c.loki_url,
        batch_size=c.log_batch_size,
        flush_interval=c.log_flush_interval_sec,
        batch_bytes=c.loki_batch_bytes,
        spool=spool,
        auth=auth,
        runner=pool,
    )

    def all_secrets() -> list[str]:
        return [*secrets(), *shipper.secrets()]

    labels = node_labels(c.agent_id, host)
    observer = AgentLogObserver(
        shipper, labels, secrets=all_secrets, min_level=LEVELS.get(c.log_level, LogLevel.info)
    )
    units = journal_units if journal_units is not None else journal_selection(c, backend_sink=backend_sink)
    journald = None
    if units is not None:
        journald = JournaldSource(
            reactor, shipper, labels, pool, state_dir=state_dir, secrets=all_secrets,
            directory=journal_directory, units=units,
        )
    containers = None
    if engine is not None:
        containers = ContainerLogSource(
            reactor, engine, shipper, host, agent_id=c.agent_id, runner=pool, streams=c.loki_container_streams,
            environ=docker_environ, secrets=all_secrets, state_dir=state_dir, adoption=adoption,
        )
    ray_serve = RayServeLogSource(
        reactor, shipper, host, pool, session_dir=c.ray_session_dir, state_dir=state_dir,
        secrets=all_secrets,
    )
    return LogShipping(pool, shipper, http_pool, observer, journald, containers, ray_serve)
