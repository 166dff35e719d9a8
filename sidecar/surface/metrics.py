"""Prometheus metrics, in a registry of the sidecar's own.

Counters and the latency histogram are updated as canaries finish. The verdict gauges
(ready, live, endpoint_ready, ...) are computed from the current state at scrape time, so they
are never stale, not even for liveness, which changes with time alone.

The scrape-time families are one table, ``ROWS``: each row names a family once (name, type,
help, label names) with a small function from the scrape to its samples. A row is read once per
scrape for the worker, once per endpoint, or once per unit (an endpoint's rank, or the endpoint
itself when it has no ranks); the collector walks the endpoints and their units once and fills
every family on the way. docs/reference/metrics.md lists the same families.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from sidecar import __version__
from sidecar.core.endpoint import EndpointState
from sidecar.core.events import Event
from sidecar.core.events import Kind as EventKind
from sidecar.core.evidence.faults import FAILED, PAUSED
from sidecar.core.evidence.result import Outcome
from sidecar.core.snapshot import Snapshot, liveness_of, readiness_of
from sidecar.core.verdict import clocks, engine_disagrees
from sidecar.surface.view import About, HealthView

PREFIX = "health_sidecar"

# The *_created series double the exposition for no use here.
disable_created_metrics()
ENGINE_SAYS = ("ready", "notready")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

Kind = Literal["gauge", "counter", "info"]
Family = GaugeMetricFamily | CounterMetricFamily | InfoMetricFamily
# A family's samples from one subject: (label values after the subject's endpoint label, value).
# An info's value is ignored: its sample is always 1, its label values say what runs.
Samples = Iterable[tuple[tuple[str, ...], float]]
FAMILIES: dict[Kind, type[Family]] = {
    "gauge": GaugeMetricFamily,
    "counter": CounterMetricFamily,
    "info": InfoMetricFamily,
}


@dataclass(frozen=True)
class Scrape:
    """What one scrape reads: one snapshot and one clock reading for every family."""

    snap: Snapshot
    now: float  # monotonic
    about: About
    loops: list[asyncio.AbstractEventLoop]  # the event loops besides the HTTP server's


@dataclass(frozen=True)
class Row:
    """One exported family: its name after ``PREFIX``, type, help text and label names."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]

    def family(self) -> Family:
        """The family, empty."""
        return FAMILIES[self.kind](f"{PREFIX}_{self.name}", self.help, labels=self.labels)


@dataclass(frozen=True)
class WorkerRow(Row):
    """A family of the whole worker, read once per scrape."""

    read: Callable[[Scrape], Samples]


@dataclass(frozen=True)
class EndpointRow(Row):
    """A family read once per endpoint (its units combined); its first label is ``endpoint``."""

    read: Callable[[Scrape, str], Samples]


@dataclass(frozen=True)
class UnitRow(Row):
    """A family read once per unit (a rank, or an endpoint without ranks, or kv_transfer) from
    its own state; its first label is ``endpoint``, whose value is the unit's name."""

    read: Callable[[Scrape, EndpointState], Samples]


def sample(value: float | None) -> Samples:
    """One sample with no labels of its own, or none while the value is unknown (None): the
    series is then absent, not 0."""
    return () if value is None else (((), value),)


def _task_count(loops: list[asyncio.AbstractEventLoop]) -> float:
    """Tasks of the running loop (the HTTP server's) and of the other loops (the monitor's)."""
    try:
        count = len(asyncio.all_tasks())
    except RuntimeError:  # collected outside any event loop
        count = 0
    return float(count + sum(len(asyncio.all_tasks(loop)) for loop in loops))


def _build(s: Scrape) -> Samples:
    """What runs, as label values in the order of the row's labels."""
    about = s.about
    values = (__version__, about.backend, about.mode, str(about.canaries).lower(), about.transport)
    return ((values, 1.0),)


def _rank_ready(s: Scrape, endpoint: str) -> Samples:
    """Each rank's own verdict; none for an endpoint without ranks."""
    snap = s.snap
    if not snap.ranked(endpoint):
        return ()
    return (
        ((str(snap.rank_of.get(unit)),), bool(snap.verdicts[unit].ready))
        for unit in snap.units[endpoint]
    )


def _transfer_failures(_: Scrape, ep: EndpointState) -> Samples:
    """The failures counted since start, for the kinds the engine publishes; none while it
    publishes none."""
    transfers = ep.transfers
    if transfers.latest is None:
        return ()
    return (((kind,), transfers.counted.get(kind, 0.0)) for kind in transfers.latest.failures)


def _transfers_failing(s: Scrape, ep: EndpointState) -> Samples:
    """Whether failures were seen within the window; none while the engine publishes none."""
    return sample(None if ep.transfers.latest is None else ep.transfers.failing(s.now))


def _clocks(s: Scrape, ep: EndpointState) -> Samples:
    """Seconds each running liveness clock has run, by its cause."""
    return (((str(cause),), max(0.0, s.now - since)) for cause, since in clocks(ep).items())


def _paused(_: Scrape, ep: EndpointState) -> Samples:
    """One series for each reason to pause, 1 while it holds."""
    return (
        (("sleeping",), ep.lifecycle.sleeping),
        (("maintenance",), ep.lifecycle.maintenance is not None),
    )


def _fault(_: Scrape, ep: EndpointState) -> Samples:
    """One series per state vLLM's fault tolerance can report short of healthy, 1 for the one
    it reports now; none where the engine reports nothing."""
    report = ep.faults.report
    if report is None:
        return ()
    return tuple(((state,), report.state == state) for state in sorted(FAILED | PAUSED))


# The label every endpoint and unit row starts with; its value is the endpoint's (or unit's) name.
EP = ("endpoint",)

# Every scrape-time family, in the order of the exposition.
ROWS: tuple[WorkerRow | EndpointRow | UnitRow, ...] = (
    WorkerRow(
        "build",
        "info",
        "Version and configuration of the sidecar.",
        ("version", "backend", "mode", "canary", "transport"),
        _build,
    ),
    WorkerRow(
        "ready",
        "gauge",
        "1 if the worker is ready (/health 200).",
        (),
        lambda s: sample(readiness_of(s.snap, s.now).ready),
    ),
    WorkerRow(
        "live",
        "gauge",
        "1 if the worker is live (/live 200).",
        (),
        lambda s: sample(liveness_of(s.snap, s.now).live),
    ),
    UnitRow(
        "endpoint_paused",
        "gauge",
        "1 while the endpoint is paused on purpose: notready, live, no canary (state: "
        "sleeping, the engine says it sleeps; maintenance, a window was declared).",
        (*EP, "state"),
        _paused,
    ),
    UnitRow(
        "engine_fault",
        "gauge",
        "1 for the state short of healthy that vLLM's fault tolerance reports for the unit's "
        "engine (state: unhealthy, dead, recovering, paused); absent without fault tolerance.",
        (*EP, "state"),
        _fault,
    ),
    UnitRow(
        "kv_transfer_failures",
        "counter",
        "Failed KV transfers from prefill peers seen in the engine's metrics (kind: "
        "failed_transfers, failed_notifications, expired_kv): the peer side's trouble.",
        (*EP, "kind"),
        _transfer_failures,
    ),
    UnitRow(
        "kv_transfers_failing",
        "gauge",
        "1 while KV transfers from prefill peers failed within the last minute.",
        EP,
        _transfers_failing,
    ),
    EndpointRow(
        "endpoint_ready",
        "gauge",
        "1 if the endpoint is ready.",
        EP,
        lambda s, endpoint: sample(bool(s.snap.endpoint_verdicts[endpoint].ready)),
    ),
    UnitRow(
        "endpoint_registered",
        "gauge",
        "1 if the engine answers its own health route with 200.",
        EP,
        lambda _, ep: sample(bool(ep.registration.registered)),
    ),
    UnitRow(
        "endpoint_discoverable",
        "gauge",
        "1 while discovery lists the Dynamo worker's instance, 0 while it is missing (absent "
        "where discovery is not asked: HTTP engines, Kubernetes discovery).",
        EP,
        lambda _, ep: sample(ep.discovery.listed),
    ),
    UnitRow(
        "canary_consecutive_failures",
        "gauge",
        "Canaries failed in a row.",
        EP,
        lambda _, ep: sample(ep.canary.failures),
    ),
    UnitRow(
        "last_canary_success_timestamp_seconds",
        "gauge",
        "Unix time of the last passed canary (absent before the first).",
        EP,
        lambda _, ep: sample(ep.canary.last_success_wall),
    ),
    EndpointRow(
        "rank_ready",
        "gauge",
        "1 if the data-parallel rank is ready (its own canary passes); absent without ranks.",
        (*EP, "rank"),
        _rank_ready,
    ),
    EndpointRow(
        "endpoint_degraded",
        "gauge",
        "1 while the endpoint is ready with a data-parallel rank down, as "
        "SIDECAR_DP_MIN_READY_RANKS allows.",
        EP,
        lambda s, endpoint: sample(s.snap.endpoint_verdicts[endpoint].degraded),
    ),
    UnitRow(
        "engine_in_flight_requests",
        "gauge",
        "Requests running or waiting in the engine, from its own metrics.",
        EP,
        lambda _, ep: sample(ep.progress.in_flight),
    ),
    UnitRow(
        "engine_stalled",
        "gauge",
        "1 while a stall is confirmed: work in flight, no progress, and a canary timed out.",
        EP,
        lambda _, ep: sample(ep.canary.stalled),
    ),
    UnitRow(
        "engine_progress_readable",
        "gauge",
        "1 while the engine's metrics show its progress (in-flight work and counters).",
        EP,
        lambda _, ep: sample(ep.progress.readable),
    ),
    UnitRow(
        "engine_health_disagrees",
        "gauge",
        "1 while the engine's own health route answers 200 but the sidecar finds it hung.",
        EP,
        lambda _, ep: sample(engine_disagrees(ep)),
    ),
    UnitRow(
        "last_progress_timestamp_seconds",
        "gauge",
        "Unix time the engine's progress counters last advanced.",
        EP,
        lambda _, ep: sample(ep.progress.last_advance_wall),
    ),
    UnitRow(
        "liveness_clock_seconds",
        "gauge",
        "Seconds a liveness clock has run (absent while none runs); /live fails when one "
        "reaches the liveness window.",
        (*EP, "cause"),
        _clocks,
    ),
    WorkerRow(
        "liveness_window_seconds",
        "gauge",
        "SIDECAR_LIVENESS_WINDOW: how long a liveness clock may run before /live fails.",
        (),
        lambda s: sample(s.snap.policy.liveness_window),
    ),
    WorkerRow(
        "draining",
        "gauge",
        "1 after SIGTERM, while draining.",
        (),
        lambda s: sample(s.snap.draining),
    ),
    WorkerRow(
        "asyncio_tasks",
        "gauge",
        "Tasks alive in the sidecar's event loop (flat over time: nothing leaks).",
        (),
        lambda s: sample(_task_count(s.loops)),
    ),
)
WORKER_ROWS = tuple(row for row in ROWS if isinstance(row, WorkerRow))
ENDPOINT_ROWS = tuple(row for row in ROWS if isinstance(row, EndpointRow))
UNIT_ROWS = tuple(row for row in ROWS if isinstance(row, UnitRow))


def _add(family: Family, labels: list[str], value: float) -> None:
    """One sample; an info's label values are what it says, and its sample is always 1."""
    if isinstance(family, InfoMetricFamily):
        family.add_metric(labels, {})
    else:
        family.add_metric(labels, value)


def collect(scrape: Scrape) -> Iterator[Family]:
    """Every row's family, filled in one walk: the worker's rows, then for each endpoint its
    rows and each of its units' rows."""
    snap = scrape.snap
    families = {row.name: row.family() for row in ROWS}

    def fill(row: Row, subject: tuple[str, ...], samples: Samples) -> None:
        for labels, value in samples:
            _add(families[row.name], [*subject, *labels], value)

    for worker_row in WORKER_ROWS:
        fill(worker_row, (), worker_row.read(scrape))
    for endpoint, units in snap.units.items():
        for endpoint_row in ENDPOINT_ROWS:
            fill(endpoint_row, (endpoint,), endpoint_row.read(scrape, endpoint))
        for unit in units:
            state = snap.endpoints[unit]
            for unit_row in UNIT_ROWS:
                fill(unit_row, (unit,), unit_row.read(scrape, state))
    return iter(families.values())


class _VerdictCollector(Collector):
    """The scrape-time families, from the snapshot current when Prometheus scrapes."""

    def __init__(
        self, health: HealthView, about: About, loops: list[asyncio.AbstractEventLoop]
    ) -> None:
        self.health = health
        self.about = about
        self.loops = loops

    def collect(self) -> Iterator[Family]:
        health = self.health
        return collect(Scrape(health.snapshot, health.clock(), self.about, self.loops))


class Metrics:
    """The sidecar's own metrics: counters that follow Health's events (:meth:`on_event`, its
    subscriber) and the families read from each snapshot when Prometheus scrapes."""

    def __init__(self, health: HealthView, about: About) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.canaries = Counter(
            f"{PREFIX}_canary",
            "Canaries by outcome (" + ", ".join(o.value for o in Outcome) + ").",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            f"{PREFIX}_canary_duration_seconds",
            "Time from sending a canary to its complete answer (or to the timeout).",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.transitions = Counter(
            f"{PREFIX}_endpoint_transitions",
            "Changes of an endpoint's verdict, by the verdict it changed to.",
            ["endpoint", "to"],
            registry=self.registry,
        )
        self.disagreements = Counter(
            f"{PREFIX}_engine_health_disagreements",
            "Times a disagreement with the engine's own health route began: engine_says ready, "
            "it answered 200 while the sidecar found it hung; notready, it answered non-200 (a "
            "Dynamo worker's /health) while canaries passed.",
            ["endpoint", "engine_says"],
            registry=self.registry,
        )
        for name in health.snapshot.endpoints:
            for says in ENGINE_SAYS:
                self.disagreements.labels(name, says)
            for outcome in Outcome:
                self.canaries.labels(name, outcome.value)
            self.latency.labels(name)
        # Event loops besides the HTTP server's whose tasks count in health_sidecar_asyncio_tasks.
        self.loops: list[asyncio.AbstractEventLoop] = []
        self.registry.register(_VerdictCollector(health, about, self.loops))

    def on_event(self, event: Event) -> None:
        """The counters that follow Health's events: canaries, transitions, disagreements."""
        unit = event.unit or ""
        if event.kind is EventKind.CANARY and event.result is not None:
            self.canaries.labels(unit, event.result.outcome.value).inc()
            self.latency.labels(unit).observe(event.result.latency)
        elif event.kind is EventKind.VERDICT and event.label is not None:
            self.transitions.labels(unit, event.label).inc()
        elif event.kind is EventKind.DISAGREEMENT and event.label is not None:
            self.disagreements_inc(unit, event.label)

    def disagreements_inc(self, endpoint: str, engine_says: str) -> None:
        self.disagreements.labels(endpoint, engine_says).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
