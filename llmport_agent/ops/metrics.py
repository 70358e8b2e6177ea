"""
Prometheus metrics of the agent, through C{prometheus_client} (its own L{CollectorRegistry},
exposition by C{generate_latest}).

Most families are read from the subsystems' own counters at scrape time by L{AgentCollector}
(session, commands, journal, outbox, engine, GPUs and their health, Loki, model sync), so the subsystems keep
plain counters and know nothing about Prometheus. The two things a counter cannot express,
latency distributions, are fixed-bucket histograms kept in small recorder objects of
L{llmport_agent.ops.timing} (which does not import prometheus_client: an idle agent records
without it): L{TimedCalls} (commands by type and outcome, engine calls by operation and
outcome), L{CommandPickup} and L{ReactorLatenessProbe}; they become metric families here, at
scrape time.

Label values are bounded: command types outside the handler registry become C{"other"}, engine
operations are the names of the agent's own functions, GPU labels are index/uuid/name. No
label ever carries a secret.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmport_agent import VERSION
from llmport_agent.inventory.health import DEGRADED, HEALTHY, UNHEALTHY
from llmport_agent.ops.readers import (
    gpu_health_view,
    gpu_snapshot,
    loki_stats,
    session_state,
    workload_states,
)

# The recorders live in llmport_agent.ops.timing (no prometheus_client there); their names
# stay importable from here.
from llmport_agent.ops.timing import PREFIX
from llmport_agent.ops.timing import CommandPickup as CommandPickup
from llmport_agent.ops.timing import ReactorLatenessProbe as ReactorLatenessProbe
from llmport_agent.ops.timing import TimedCalls as TimedCalls
from llmport_agent.ops.timing import command_calls as command_calls
from llmport_agent.ops.timing import engine_calls as engine_calls

# No *_created series: they double the size of every histogram for nothing a scrape needs.
disable_created_metrics()

SESSION_STATES = ("connected", "connecting", "backing_off", "enrolling", "refused", "stopped")


# -- the collector -------------------------------------------------------------------------


def _get(obj: Any, name: str, default: Any = 0) -> Any:
    value = getattr(obj, name, default) if obj is not None else default
    return default if value is None else value


def _gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, doc, labels=list(labels or {}))
    family.add_metric(list((labels or {}).values()), float(value))
    return family


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, doc)
    family.add_metric([], float(value))
    return family


class AgentCollector:
    """Reads the running agent's counters at scrape time."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        a = self.agent
        yield from self._build_info()
        yield from self._session(a.session)
        yield from self._commands(a)
        yield from self._reports(a)
        probe = getattr(a, "lateness", None)
        if probe is not None:
            yield from probe.histogram.collect()
            yield _gauge("reactor_lateness_max_seconds",
                         "Worst reactor timer lateness since the previous scrape", probe.take_max())
        yield from self._engine(a)
        yield from self._workloads(a)
        yield from self._gpus(a)
        yield from self._gpu_monitor(a)
        yield from self._loki(a)
        yield from self._models(a)

    def _build_info(self) -> Iterator[Metric]:
        import twisted

        info = GaugeMetricFamily(PREFIX + "build_info", "Agent build",
                                 labels=["version", "python", "twisted", "frozen"])
        info.add_metric([VERSION, platform.python_version(), twisted.__version__,
                         "true" if getattr(sys, "frozen", False) else "false"], 1.0)
        yield info
        config = getattr(self.agent, "config", None)
        node = GaugeMetricFamily(PREFIX + "node_info", "This node's agent id and backend node id "
                                 "(empty before enrollment)", labels=["agent_id", "node_id"])
        node.add_metric([str(getattr(config, "agent_id", "") or "")[:128],
                         str(getattr(self.agent.session, "node_id", "") or "")[:128]], 1.0)
        yield node

    def _session(self, session: Any) -> Iterator[Metric]:
        s = session.stats
        current = session_state(session)
        state = GaugeMetricFamily(PREFIX + "session_state", "Backend session state (1 = current)",
                                  labels=["state"])
        for name in SESSION_STATES:
            state.add_metric([name], 1.0 if name == current else 0.0)
        yield state
        yield _gauge("connected", "1 while the backend stream is open", 1.0 if session.connected else 0.0)
        dispatch = getattr(session, "dispatch", None)
        if dispatch is not None:
            mode = GaugeMetricFamily(PREFIX + "dispatch_mode",
                                     "How commands reach the node: polled or pushed by the backend (1 = current)",
                                     labels=["mode"])
            for name in ("polling", "push"):
                mode.add_metric([name], 1.0 if dispatch.mode == name else 0.0)
            yield mode
        yield _counter("session_opens", "Backend stream opens", s.opens)
        yield _counter("session_reconnects", "Backend stream opens after the first", max(0, s.opens - 1))
        yield _counter("session_closes", "Backend stream closes (opened or not)", s.closes)
        yield _counter("session_refused", "Stream upgrades refused or failed before opening", s.refused)
        yield _counter("enrollments", "Successful enrollments", s.enrollments)
        yield _counter("credential_rotations", "Successful credential rotations", s.rotations)
        yield _counter("credential_rotation_errors", "Failed or unknown credential rotations",
                       s.rotation_errors)
        frames = CounterMetricFamily(PREFIX + "frames", "WebSocket frames by direction and type",
                                     labels=["direction", "type"])
        for direction, counts in (("out", _get(s, "frames_out", {})), ("in", _get(s, "frames_in", {}))):
            for kind, n in sorted(counts.items()):
                frames.add_metric([direction, kind], n)
        yield frames

    def _commands(self, a: Any) -> Iterator[Metric]:
        p = a.pipeline
        calls = getattr(p, "calls", None)
        if calls is not None:
            yield from calls.collect()
        pickup = getattr(p, "pickup", None)
        if pickup is not None:
            yield from pickup.collect()
        receipts = CounterMetricFamily(PREFIX + "command_receipts",
                                       "Commands received, duplicates, malformed, results re-sent, "
                                       "deferred by a stop", labels=["kind"])
        for key, value in sorted(p.stats.items()):
            if key not in ("succeeded", "failed", "timed_out"):
                receipts.add_metric([key], value)
        yield receipts
        outcomes = CounterMetricFamily(PREFIX + "commands", "Commands finished by outcome",
                                       labels=["outcome"])
        for key in ("succeeded", "failed", "timed_out"):
            outcomes.add_metric([key], p.stats.get(key, 0))
        yield outcomes
        yield _gauge("commands_running", "Commands running now", p.running_count)
        journal = GaugeMetricFamily(PREFIX + "command_journal_records",
                                    "Records in the command journal by state", labels=["state"])
        for key, value in sorted(a.journal.depth().items()):
            if key != "total":
                journal.add_metric([key], value)
        yield journal
        yield _gauge("command_journal_depth", "Records in the command journal", a.journal.depth().get("total", 0))
        yield _gauge("event_outbox_depth", "Events waiting to be sent", a.outbox.depth)
        yield _counter("events_dropped", "Events dropped (outbox full)", a.outbox.dropped)
        yield _counter("events_sent", "Events sent to the backend", _get(a.outbox, "sent"))
        mode = GaugeMetricFamily(PREFIX + "mode", "Node mode flags", labels=["mode"])
        mode.add_metric(["maintenance"], 1.0 if a.modes.maintenance else 0.0)
        mode.add_metric(["draining"], 1.0 if a.modes.draining else 0.0)
        mode.add_metric(["stopping"], 1.0 if getattr(a, "stopping", False) else 0.0)
        yield mode

    def _reports(self, a: Any) -> Iterator[Metric]:
        yield _counter("heartbeats", "Heartbeats sent", a.heartbeat.sent)
        yield _counter("inventories", "Inventory reports sent", a.inventory.sent)

    def _engine(self, a: Any) -> Iterator[Metric]:
        engine = getattr(a, "engine", None)
        if engine is None:
            return
        yield _gauge("engine_up", "1 while the Docker engine answers", 1.0 if engine.available else 0.0)
        yield _counter("engine_requests", "HTTP requests made to the Docker engine", _get(engine, "calls"))
        calls = getattr(engine, "call_stats", None)
        if calls is not None:
            yield from calls.collect()

    def _workloads(self, a: Any) -> Iterator[Metric]:
        if getattr(a, "health", None) is None:
            return
        counts: dict[str, int] = {}
        for state in workload_states(a).values():
            key = str(state.get("state") or "unknown")[:32]
            counts[key] = counts.get(key, 0) + 1
        family = GaugeMetricFamily(PREFIX + "workloads", "Managed workloads by last observed state",
                                   labels=["state"])
        for key, n in sorted(counts.items()):
            family.add_metric([key], n)
        yield family

    def _gpus(self, a: Any) -> Iterator[Metric]:
        snap = gpu_snapshot(a)
        if snap is None:
            return
        devices = tuple(getattr(snap, "devices", ()))
        yield _gauge("gpus", "GPUs seen in the last inventory", len(devices))
        yield _gauge("gpu_source_up", "1 when the GPU source (NVML) answered the last inventory",
                     0.0 if getattr(snap, "gpu_error", "") else 1.0)
        collector = getattr(a, "collector", None)
        errors = CounterMetricFamily(PREFIX + "nvml_errors",
                                     "Inventory collections in which NVML failed (source) or a GPU "
                                     "reported an error (device)", labels=["kind"])
        errors.add_metric(["source"], _get(collector, "gpu_source_errors"))
        errors.add_metric(["device"], _get(collector, "gpu_device_errors"))
        yield errors
        labels = ["gpu", "uuid", "name"]
        families = {
            "memory_total": GaugeMetricFamily(PREFIX + "gpu_memory_total_bytes", "GPU memory", labels=labels),
            "memory_used": GaugeMetricFamily(PREFIX + "gpu_memory_used_bytes", "GPU memory used", labels=labels),
            "util": GaugeMetricFamily(PREFIX + "gpu_utilization_ratio", "GPU utilization (0-1)", labels=labels),
            "mem_util": GaugeMetricFamily(PREFIX + "gpu_memory_utilization_ratio",
                                          "GPU memory controller utilization (0-1)", labels=labels),
            "temp": GaugeMetricFamily(PREFIX + "gpu_temperature_celsius", "GPU temperature", labels=labels),
            "power": GaugeMetricFamily(PREFIX + "gpu_power_watts", "GPU power draw", labels=labels),
            "power_limit": GaugeMetricFamily(PREFIX + "gpu_power_limit_watts", "GPU power limit", labels=labels),
            "error": GaugeMetricFamily(PREFIX + "gpu_error", "1 when NVML reported an error for this GPU",
                                       labels=labels),
        }
        ecc = GaugeMetricFamily(PREFIX + "gpu_ecc_errors",
                                "ECC memory errors (volatile: since boot, aggregate: lifetime)",
                                labels=[*labels, "counter", "type"])
        # Health (issue 13): the verdicts as they are now (the snapshot carries the current ones).
        health = GaugeMetricFamily(PREFIX + "gpu_health", "1 for the GPU's current health state",
                                   labels=[*labels, "state"])
        xids = CounterMetricFamily(PREFIX + "gpu_xid_errors", "Xid errors seen per GPU and code since "
                                   "the agent started", labels=[*labels, "xid"])
        unresponsive = GaugeMetricFamily(PREFIX + "gpu_unresponsive",
                                         "1 while a driver call for this GPU hangs", labels=labels)
        for d in devices:
            lv = [str(_get(d, "index")), str(_get(d, "uuid", "")), str(_get(d, "name", ""))[:96]]
            families["memory_total"].add_metric(lv, _get(d, "memory_total_bytes"))
            families["memory_used"].add_metric(lv, _get(d, "memory_used_bytes"))
            families["util"].add_metric(lv, _get(d, "utilization_pct") / 100.0)
            families["mem_util"].add_metric(lv, _get(d, "memory_utilization_pct") / 100.0)
            families["temp"].add_metric(lv, _get(d, "temperature_c"))
            families["power"].add_metric(lv, _get(d, "power_draw_w"))
            families["power_limit"].add_metric(lv, _get(d, "power_limit_w"))
            families["error"].add_metric(lv, 1.0 if _get(d, "error", "") else 0.0)
            counts = _get(d, "ecc_errors", None)
            for counter in ("volatile", "aggregate"):
                for kind in ("corrected", "uncorrected"):
                    ecc.add_metric([*lv, counter, kind], _get(counts, f"{counter}_{kind}"))
            verdict = _get(d, "health", None)
            state = _get(verdict, "state", HEALTHY)
            for name in (HEALTHY, DEGRADED, UNHEALTHY):
                health.add_metric([*lv, name], 1.0 if state == name else 0.0)
            for code, n in _get(verdict, "xid_counts", ()):
                xids.add_metric([*lv, str(code) if code >= 0 else "other"], n)
            unresponsive.add_metric(lv, 1.0 if _get(verdict, "unresponsive", False) else 0.0)
        yield from families.values()
        yield ecc
        yield health
        yield xids
        yield unresponsive
        yield _gauge("gpu_unhealthy", "GPUs left out of scheduling (unhealthy)",
                     sum(1 for d in devices if _get(_get(d, "health", None), "state", HEALTHY) == UNHEALTHY))

    def _gpu_monitor(self, a: Any) -> Iterator[Metric]:
        """The GPU health monitor's loop counters (issue 13); per-GPU verdicts are in L{_gpus}."""
        view = gpu_health_view(a)
        if view is None:
            return
        yield _counter("gpu_driver_events", "GPU driver events (NVML) handled", view.get("events_handled", 0))
        yield _counter("gpu_calls_timed_out", "GPU driver calls that ran past GPU_CALL_TIMEOUT_SEC",
                       view.get("calls_timed_out", 0))
        yield _gauge("gpu_calls_hung", "GPU driver calls running past their deadline now",
                     view.get("calls_hung_now", 0))

    def _loki(self, a: Any) -> Iterator[Metric]:
        loki = getattr(a, "loki", None)
        if loki is None:
            return
        from llmport_agent.logs.metrics import log_metric_families

        yield from log_metric_families(loki, getattr(a, "journald", None), getattr(a, "container_logs", None))
        stats = loki_stats(a) or {}
        yield _gauge("loki_lag_seconds", "Seconds since Loki last accepted a push while lines wait",
                     loki_lag(stats, self.agent.reactor.seconds()))

    def _models(self, a: Any) -> Iterator[Metric]:
        # Not built by a scrape: before the first sync_model nothing was downloaded.
        built = getattr(a, "models_if_built", None)
        models = built() if callable(built) else None
        yield _counter("model_sync_bytes", "Model bytes downloaded from the backend",
                       _get(models, "bytes_downloaded") if models is not None else 0)


def loki_lag(stats: dict[str, Any], now: float) -> float:
    """
    How far behind the Loki shipper is: 0 with an empty queue, else the age of its last
    success (reactor seconds, as the shipper records it).
    """
    if not stats.get("queue_depth"):
        return 0.0
    last = stats.get("last_success_at")
    if not isinstance(last, int | float) or last <= 0:
        return 0.0
    return max(0.0, now - float(last))


def make_registry(agent: Any) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent))  # type: ignore[arg-type]
    # process_resident_memory_bytes, process_cpu_seconds_total, open fds, start time: read from
    # /proc/self at scrape time (a few small reads; nothing on a platform without /proc).
    ProcessCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return bytes(generate_latest(registry))
