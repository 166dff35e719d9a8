"""Prometheus metrics, in a registry of the sidecar's own.

Counters and the latency histogram are updated as canaries finish. The verdict gauges
(ready, live, endpoint_ready, ...) are computed from the current state at scrape time, so they
are never stale, not even for liveness, which changes with time alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

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
from sidecar.evidence.result import Outcome, Result
from sidecar.health import Health, Listener, liveness_of, readiness_of
from sidecar.verdict import clocks, engine_disagrees

PREFIX = "health_sidecar"

# The *_created series double the exposition for no use here.
disable_created_metrics()
ENGINE_SAYS = ("ready", "notready")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def _task_count(loops: list[asyncio.AbstractEventLoop]) -> float:
    """Tasks of the running loop (the HTTP server's) and of the other loops (the monitor's)."""
    try:
        count = len(asyncio.all_tasks())
    except RuntimeError:  # collected outside any event loop
        count = 0
    return float(count + sum(len(asyncio.all_tasks(loop)) for loop in loops))


class _VerdictCollector(Collector):
    def __init__(self, health: Health, loops: list[asyncio.AbstractEventLoop]) -> None:
        self.health = health
        self.loops = loops

    def collect(self) -> Iterator[GaugeMetricFamily | InfoMetricFamily | CounterMetricFamily]:
        health = self.health
        settings = health.settings
        snap = health.snapshot  # one snapshot for the whole scrape
        now = health.clock()
        yield InfoMetricFamily(
            f"{PREFIX}_build",
            "Version and configuration of the sidecar.",
            value={
                "version": __version__,
                "backend": settings.backend.value,
                "mode": settings.disaggregation_mode.value,
                "canary": str(settings.health_check_enabled).lower(),
                "transport": settings.transport.value,
            },
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_ready",
            "1 if the worker is ready (/health 200).",
            value=readiness_of(snap, now).ready,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_live",
            "1 if the worker is live (/live 200).",
            value=liveness_of(snap, now).live,
        )
        ready = GaugeMetricFamily(
            f"{PREFIX}_endpoint_ready", "1 if the endpoint is ready.", labels=["endpoint"]
        )
        registered = GaugeMetricFamily(
            f"{PREFIX}_endpoint_registered",
            "1 if the engine answers its own health route with 200.",
            labels=["endpoint"],
        )
        failures = GaugeMetricFamily(
            f"{PREFIX}_canary_consecutive_failures",
            "Canaries failed in a row.",
            labels=["endpoint"],
        )
        last_success = GaugeMetricFamily(
            f"{PREFIX}_last_canary_success_timestamp_seconds",
            "Unix time of the last passed canary (absent before the first).",
            labels=["endpoint"],
        )
        for name, verdict in snap.endpoint_verdicts.items():
            ready.add_metric([name], bool(verdict.ready))
        discoverable = GaugeMetricFamily(
            f"{PREFIX}_endpoint_discoverable",
            "1 while discovery lists the Dynamo worker's instance, 0 while it is missing (absent "
            "where discovery is not asked: HTTP engines, Kubernetes discovery).",
            labels=["endpoint"],
        )
        for name, ep in snap.endpoints.items():
            registered.add_metric([name], bool(ep.registration.registered))
            if ep.discovery.listed is not None:
                discoverable.add_metric([name], ep.discovery.listed)
            failures.add_metric([name], ep.canary.failures)
            if ep.canary.last_success_wall is not None:
                last_success.add_metric([name], ep.canary.last_success_wall)
        in_flight = GaugeMetricFamily(
            f"{PREFIX}_engine_in_flight_requests",
            "Requests running or waiting in the engine, from its own metrics.",
            labels=["endpoint"],
        )
        stalled = GaugeMetricFamily(
            f"{PREFIX}_engine_stalled",
            "1 while a stall is confirmed: work in flight, no progress, and a canary timed out.",
            labels=["endpoint"],
        )
        readable = GaugeMetricFamily(
            f"{PREFIX}_engine_progress_readable",
            "1 while the engine's metrics show its progress (in-flight work and counters).",
            labels=["endpoint"],
        )
        disagrees = GaugeMetricFamily(
            f"{PREFIX}_engine_health_disagrees",
            "1 while the engine's own health route answers 200 but the sidecar finds it hung.",
            labels=["endpoint"],
        )
        last_progress = GaugeMetricFamily(
            f"{PREFIX}_last_progress_timestamp_seconds",
            "Unix time the engine's progress counters last advanced.",
            labels=["endpoint"],
        )
        for name, ep in snap.endpoints.items():
            if ep.progress.in_flight is not None:
                in_flight.add_metric([name], ep.progress.in_flight)
            stalled.add_metric([name], ep.canary.stalled)
            readable.add_metric([name], ep.progress.readable)
            disagrees.add_metric([name], engine_disagrees(ep))
            if ep.progress.last_advance_wall is not None:
                last_progress.add_metric([name], ep.progress.last_advance_wall)
        clock = GaugeMetricFamily(
            f"{PREFIX}_liveness_clock_seconds",
            "Seconds a liveness clock has run (absent while none runs); /live fails when one "
            "reaches the liveness window.",
            labels=["endpoint", "cause"],
        )
        for name, ep in snap.endpoints.items():
            for cause, since in clocks(ep).items():
                clock.add_metric([name, str(cause)], max(0.0, now - since))
        paused = GaugeMetricFamily(
            f"{PREFIX}_endpoint_paused",
            "1 while the endpoint is paused on purpose: notready, live, no canary (state: "
            "sleeping, the engine says it sleeps; maintenance, a window was declared).",
            labels=["endpoint", "state"],
        )
        for name, ep in snap.endpoints.items():
            paused.add_metric([name, "sleeping"], ep.lifecycle.sleeping)
            paused.add_metric([name, "maintenance"], ep.lifecycle.maintenance is not None)
        yield paused
        transfers = CounterMetricFamily(
            f"{PREFIX}_kv_transfer_failures",
            "Failed KV transfers from prefill peers seen in the engine's metrics (kind: "
            "failed_transfers, failed_notifications, expired_kv): the peer side's trouble.",
            labels=["endpoint", "kind"],
        )
        failing = GaugeMetricFamily(
            f"{PREFIX}_kv_transfers_failing",
            "1 while KV transfers from prefill peers failed within the last minute.",
            labels=["endpoint"],
        )
        for name, ep in snap.endpoints.items():
            if ep.transfers.latest is None:
                continue
            for kind in ep.transfers.latest.failures:
                transfers.add_metric([name, kind], ep.transfers.counted.get(kind, 0.0))
            failing.add_metric([name], ep.transfers.failing(now))
        yield transfers
        yield failing
        rank_ready = GaugeMetricFamily(
            f"{PREFIX}_rank_ready",
            "1 if the data-parallel rank is ready (its own canary passes); absent without ranks.",
            labels=["endpoint", "rank"],
        )
        degraded = GaugeMetricFamily(
            f"{PREFIX}_endpoint_degraded",
            "1 while the endpoint is ready with a data-parallel rank down, as "
            "SIDECAR_DP_MIN_READY_RANKS allows.",
            labels=["endpoint"],
        )
        for endpoint, units in snap.units.items():
            degraded.add_metric([endpoint], snap.endpoint_verdicts[endpoint].degraded)
            if snap.ranked(endpoint):
                for unit in units:
                    rank = snap.rank_of.get(unit)
                    rank_ready.add_metric([endpoint, str(rank)], bool(snap.verdicts[unit].ready))
        yield from (ready, registered, discoverable, failures, last_success, rank_ready, degraded)
        yield from (in_flight, stalled, readable, disagrees, last_progress, clock)
        yield GaugeMetricFamily(
            f"{PREFIX}_liveness_window_seconds",
            "SIDECAR_LIVENESS_WINDOW: how long a liveness clock may run before /live fails.",
            value=settings.liveness_window,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_draining", "1 after SIGTERM, while draining.", value=snap.draining
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_asyncio_tasks",
            "Tasks alive in the sidecar's event loop (flat over time: nothing leaks).",
            value=_task_count(self.loops),
        )


class Metrics:
    def __init__(self, health: Health) -> None:
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
        self.registry.register(_VerdictCollector(health, self.loops))
        health.listeners.append(
            Listener(self._on_canary, self._on_transition, self.disagreements_inc)
        )

    def _on_canary(self, endpoint: str, result: Result) -> None:
        self.canaries.labels(endpoint, result.outcome.value).inc()
        self.latency.labels(endpoint).observe(result.latency)

    def _on_transition(self, endpoint: str, to: str) -> None:
        self.transitions.labels(endpoint, to).inc()

    def disagreements_inc(self, endpoint: str, engine_says: str) -> None:
        self.disagreements.labels(endpoint, engine_says).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
