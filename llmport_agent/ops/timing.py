"""
Durations the agent records as it runs (commands, engine calls, pickup waits, reactor
lateness), as fixed-bucket histograms kept in plain counters.

prometheus_client is not imported here: an idle agent records a heartbeat's lateness and a
command's duration without it (issue 27: about 1 MiB), and each histogram becomes a
prometheus_client metric family only when C{/metrics} is scraped (L{Histogram.collect}, from
L{llmport_agent.ops.metrics.AgentCollector}). The families are what prometheus_client's own
C{Histogram} would expose (C{_bucket} with C{le}, C{_count}, C{_sum}; no C{_created}).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from twisted.application.service import Service

__all__ = [
    "COMMAND_BUCKETS",
    "ENGINE_BUCKETS",
    "LATENESS_BUCKETS",
    "PICKUP_BUCKETS",
    "PREFIX",
    "CommandPickup",
    "Histogram",
    "ReactorLatenessProbe",
    "TimedCalls",
    "command_calls",
    "engine_calls",
]

PREFIX = "llmport_agent_"

#: Command latencies span 1 ms (a refused command) to hours (a model sync).
COMMAND_BUCKETS = (0.005, 0.025, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 14400)
#: Engine calls: milliseconds (inspect) to minutes (stop with a grace period).
ENGINE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
#: Reactor lateness: a healthy reactor is late by well under 10 ms.
LATENESS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
#: Pickup: a command waits milliseconds (node online) to hours (node offline) for the agent.
PICKUP_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 14400)


class Histogram:
    """
    A histogram over fixed upper bounds, by label values: per label set, one count per bucket
    (an observation counts in the first bucket whose bound is >= it; beyond the last, in
    C{+Inf}) and the sum. The caller bounds the label sets (L{TimedCalls} folds unknown names
    into C{"other"}). Without label names, the one series exists from the start (as
    prometheus_client's own does).
    """

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...] = (),
                 buckets: tuple[float, ...] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(float(b) for b in buckets)
        #: label values -> [counts per bucket (the last is +Inf), sum]
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}
        if not self.labelnames:
            self._get(())

    def _get(self, labels: tuple[str, ...]) -> tuple[list[int], list[float]]:
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = ([0] * (len(self.bounds) + 1), [0.0])
        return series

    def observe(self, value: float, *labels: str) -> None:
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected, got {len(labels)}")
        counts, total = self._get(tuple(labels))
        counts[bisect.bisect_left(self.bounds, value)] += 1
        total[0] += value

    def count(self, *labels: str) -> int:
        """Observations so far of one label set (0 when none)."""
        series = self._series.get(tuple(labels))
        return 0 if series is None else sum(series[0])

    def collect(self) -> Iterator[Any]:
        """The prometheus_client metric family (imports prometheus_client: scrape time only)."""
        from prometheus_client.core import HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labelnames))
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for labels, (counts, total) in self._series.items():
            cumulative, running = [], 0
            for le, n in zip(les, counts, strict=True):
                running += n
                cumulative.append((le, float(running)))
            family.add_metric(list(labels), cumulative, total[0])
        yield family


class TimedCalls:
    """
    Counts and durations of calls by name and outcome, as one histogram (its C{_count} series
    is the call count). Names outside C{known} (when given) are recorded as C{"other"}, so
    input from the network cannot grow the label set.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: tuple[str, str],
        buckets: tuple[float, ...],
        known: Callable[[], Iterable[str]] | None = None,
        max_names: int = 64,
    ) -> None:
        self.histogram = Histogram(name, documentation, labels, buckets)
        self._known = known
        self._names: set[str] = set()
        self._max_names = max_names

    def _label(self, name: str) -> str:
        name = str(name)[:64]
        if self._known is not None and name not in set(self._known()):
            return "other"
        if name not in self._names:
            if len(self._names) >= self._max_names:
                return "other"
            self._names.add(name)
        return name

    def observe(self, name: str, outcome: str, seconds: float) -> None:
        self.histogram.observe(max(0.0, seconds), self._label(name), str(outcome)[:64])

    def collect(self) -> Iterable[Any]:
        return self.histogram.collect()


def command_calls(known: Callable[[], Iterable[str]]) -> TimedCalls:
    return TimedCalls(
        PREFIX + "command_duration_seconds",
        "Time from start to result of commands, by type and outcome (success or error_code)",
        ("type", "outcome"),
        COMMAND_BUCKETS,
        known=known,
    )


class CommandPickup:
    """
    How long commands waited between the backend issuing them (their C{issued_at}) and their
    handler starting on this node, by type: the backend's queue, the poll or push delay, the
    agent's lanes. Types outside C{known} count as C{"other"}; a negative wait (the two clocks
    disagree) counts as 0.
    """

    def __init__(self, known: Callable[[], Iterable[str]]) -> None:
        self.histogram = Histogram(
            PREFIX + "command_pickup_seconds",
            "Time from the backend issuing a command to its handler starting on this node, by type",
            ("type",),
            PICKUP_BUCKETS,
        )
        self._known = known

    def observe(self, name: str, seconds: float) -> None:
        label = str(name)[:64]
        if label not in set(self._known()):
            label = "other"
        self.histogram.observe(max(0.0, seconds), label)

    def collect(self) -> Iterable[Any]:
        return self.histogram.collect()


def engine_calls() -> TimedCalls:
    return TimedCalls(
        PREFIX + "engine_call_duration_seconds",
        "Docker engine calls by operation and outcome (ok or error)",
        ("operation", "outcome"),
        ENGINE_BUCKETS,
    )


class ReactorLatenessProbe(Service):
    """
    How late the reactor runs timers: a blocked reactor shows here before it shows anywhere
    else.

    It measures the wake-ups that happen anyway: the heartbeat loop hands the lateness of
    each of its ticks to L{observe}. Its own timer (every C{interval} seconds, 60 by default)
    runs only while no heartbeats do: before the first connect and while disconnected (it is
    a session listener), so a connected idle agent never wakes up for it.
    """

    def __init__(self, reactor: Any, interval: float = 60.0) -> None:
        self.setName("reactor-lateness")
        self._reactor = reactor
        self.interval = interval
        self.histogram = Histogram(
            PREFIX + "reactor_lateness_seconds",
            "How late the agent's periodic timers fired (heartbeats; a 60 s timer of its own "
            "while disconnected)",
            buckets=LATENESS_BUCKETS,
        )
        self.max_recent = 0.0
        self.last = 0.0
        self.observed = 0
        self._call: Any = None
        self._due = 0.0
        self._connected = False

    def startService(self) -> None:
        super().startService()
        self._arm()

    def observe(self, late: float) -> None:
        """Record that a timer ran C{late} seconds after it was due (reactor thread)."""
        late = max(0.0, late)
        self.last = late
        self.observed += 1
        self.max_recent = max(self.max_recent, late)
        self.histogram.observe(late)

    # -- session listener: heartbeats run while connected

    def session_opened(self) -> None:
        self._connected = True
        self._disarm()

    def session_closed(self) -> None:
        self._connected = False
        self._arm()

    def frame_received(self, frame: dict[str, Any]) -> None:
        pass

    def _arm(self) -> None:
        if self.running and not self._connected and self._call is None:
            self._due = self._reactor.seconds() + self.interval
            self._call = self._reactor.callLater(self.interval, self._tick)

    def _disarm(self) -> None:
        call, self._call = self._call, None
        if call is not None and call.active():
            call.cancel()

    def _tick(self) -> None:
        self._call = None
        self.observe(self._reactor.seconds() - self._due)
        self._arm()

    def take_max(self) -> float:
        """The worst lateness since the last call (each scrape starts a new window)."""
        value, self.max_recent = self.max_recent, 0.0
        return value

    def stopService(self) -> None:  # type: ignore[override]
        super().stopService()
        self._disarm()
