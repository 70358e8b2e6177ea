# -*- test-case-name: tests.test_logs -*-
"""
Prometheus metric families of log shipping, read from the running parts at scrape time
(C{prometheus_client} custom-collector style; L{llmport_agent.ops.metrics} yields them). No label
carries a secret: the only label values are drop reasons, push outcomes and fixed names.

 - C{llmport_agent_loki_lines_in_total}: lines queued for Loki;
 - C{llmport_agent_loki_lines_sent_total}: lines Loki accepted;
 - C{llmport_agent_loki_lines_dropped_total{reason}}: every reason of L{DROP_REASONS}, also at 0;
 - C{llmport_agent_loki_pushes_total{outcome}}: C{ok}, C{failed} (retried), C{rejected};
 - C{llmport_agent_loki_retries_total}: pushes that failed and were retried;
 - C{llmport_agent_loki_queue_depth}: lines waiting in memory;
 - C{llmport_agent_loki_memory_bytes} / C{..._memory_max_bytes}: what they take, the bound;
 - C{llmport_agent_loki_spool_bytes} / C{..._spool_max_bytes} / C{..._spool_lines};
 - C{llmport_agent_loki_retrying}: 1 while pushes fail;
 - C{llmport_agent_loki_last_success_timestamp_seconds};
 - C{llmport_agent_log_readers_paused{reader}}: 1 while a reader waits for room
   (C{journal}, C{containers});
 - C{llmport_agent_container_log_streams{state}}: C{open}, C{max}, C{waiting}.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmport_agent.logs.loki import DROP_REASONS

__all__ = ["log_metric_families"]


def log_metric_families(shipper: Any, journald: Any = None, containers: Any = None) -> Iterator[Any]:
    """The families for a L{LokiShipper} and its readers (either may be C{None})."""
    if shipper is None:
        return
    stats = shipper.stats()
    lines_in = CounterMetricFamily("llmport_agent_loki_lines_in", "Log lines queued for Loki")
    lines_in.add_metric([], stats["lines_in"])
    yield lines_in
    sent = CounterMetricFamily("llmport_agent_loki_lines_sent", "Log lines accepted by Loki")
    sent.add_metric([], stats["sent"])
    yield sent
    dropped = CounterMetricFamily("llmport_agent_loki_lines_dropped", "Log lines dropped, by reason",
                                  labels=["reason"])
    by_reason = stats["dropped_by_reason"]
    for reason in DROP_REASONS:
        dropped.add_metric([reason], by_reason.get(reason, 0))
    yield dropped
    pushes = CounterMetricFamily("llmport_agent_loki_pushes", "Pushes to Loki by outcome",
                                 labels=["outcome"])
    pushes.add_metric(["ok"], stats["pushes"])
    pushes.add_metric(["failed"], stats["failed_pushes"])
    pushes.add_metric(["rejected"], stats["rejected_pushes"])
    yield pushes
    retries = CounterMetricFamily("llmport_agent_loki_retries", "Loki pushes that failed and were retried")
    retries.add_metric([], stats["failed_pushes"])
    yield retries
    for name, key, text in (
        ("llmport_agent_loki_queue_depth", "queue_lines", "Log lines waiting in memory"),
        ("llmport_agent_loki_memory_bytes", "memory_bytes", "Log lines and batches held in memory"),
        ("llmport_agent_loki_memory_max_bytes", "memory_max_bytes", "Memory bound of log shipping"),
        ("llmport_agent_loki_spool_bytes", "spool_bytes", "Bytes in the Loki spool on disk"),
        ("llmport_agent_loki_spool_max_bytes", "spool_max_bytes", "Bound of the Loki spool (0: off)"),
        ("llmport_agent_loki_spool_lines", "spool_lines", "Log lines waiting in the Loki spool"),
    ):
        gauge = GaugeMetricFamily(name, text)
        gauge.add_metric([], float(stats[key]))
        yield gauge
    retrying = GaugeMetricFamily("llmport_agent_loki_retrying", "1 while pushes to Loki fail")
    retrying.add_metric([], 1.0 if stats["retrying"] else 0.0)
    yield retrying
    last = GaugeMetricFamily("llmport_agent_loki_last_success_timestamp_seconds",
                             "Unix time of the last push Loki accepted (0: none yet)")
    last.add_metric([], float(stats["last_success_at"] or 0.0))
    yield last
    paused = GaugeMetricFamily("llmport_agent_log_readers_paused",
                               "1 while a log reader waits for room in the shipper", labels=["reader"])
    if journald is not None:
        paused.add_metric(["journal"], 1.0 if journald.paused else 0.0)
    if containers is not None:
        paused.add_metric(["containers"], 1.0 if containers.describe()["paused"] else 0.0)
    yield paused
    if containers is not None:
        info = containers.describe()
        streams = GaugeMetricFamily("llmport_agent_container_log_streams",
                                    "Container log streams", labels=["state"])
        streams.add_metric(["open"], float(info["streams_open"]))
        streams.add_metric(["max"], float(info["streams_max"]))
        streams.add_metric(["waiting"], float(info["waiting_for_a_stream"]))
        yield streams
