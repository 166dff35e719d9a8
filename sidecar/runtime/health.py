"""The single writer of health state, and the snapshot every reader reads.

The monitor (on its own thread) reports what it observed, as observations
(:mod:`sidecar.core.observations`); :meth:`Health.observe` runs the pure step
(:func:`sidecar.core.step.step`), publishes the new immutable :class:`Snapshot`, and hands the
step's events (:mod:`sidecar.core.events`) to its subscribers: the log (:func:`log_event`), the
metrics and the history. The HTTP routes and the metrics collector, on another thread, read
``health.snapshot`` once per answer: one /health body always comes from one snapshot. Only the
monitor's thread observes (SIGTERM's drain and the control route's windows are handed to it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from sidecar.config import Settings
from sidecar.core.endpoint import EndpointState, proves_anew
from sidecar.core.events import Event, note
from sidecar.core.evidence.policy import Policy
from sidecar.core.observations import Observation
from sidecar.core.snapshot import Snapshot, liveness_of, readiness_of, rebuilt
from sidecar.core.step import step
from sidecar.probes import CanaryPlan, ProbeKind

__all__ = ["Health", "Snapshot", "Subscriber", "liveness_of", "log_event", "readiness_of"]

log = logging.getLogger("sidecar.health")


def policy_from(settings: Settings) -> Policy:
    return Policy(
        failure_threshold=settings.failure_threshold,
        success_threshold=settings.success_threshold,
        wait=settings.canary_wait_time,
        retry=settings.retry_interval,
        timeout=settings.request_timeout,
        liveness_window=settings.liveness_window,
        stall_window=settings.effective_stall_window,
        metrics_interval=settings.metrics_interval,
        check_answer=settings.check_answer,
    )


# A subscriber to the events of every step (the log, the metrics, the history), called on the
# monitor's thread after the new snapshot is published.
Subscriber = Callable[[Event], None]


def log_event(event: Event) -> None:
    """The log's subscription: one line per event that says itself."""
    if event.text is not None:
        log.log(event.level, "%s", event.text)


def _layout(plans: Iterable[CanaryPlan]) -> dict[str, tuple[str, ...]]:
    """Endpoint -> its units, in the plans' order."""
    units: dict[str, tuple[str, ...]] = {}
    for plan in plans:
        units[plan.endpoint] = (*units.get(plan.endpoint, ()), plan.unit)
    return units


class Health:
    def __init__(
        self,
        settings: Settings,
        plans: Iterable[CanaryPlan],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.policy = policy_from(settings)
        self.clock = clock
        self.started = clock()
        self.plans = {p.unit: p for p in plans}
        self.listeners: list[Subscriber] = [log_event]
        endpoints = {
            u: EndpointState(u, p.enabled, p.why, liveness=p.probe is not ProbeKind.TRANSFER)
            for u, p in self.plans.items()
        }
        empty = Snapshot(
            endpoints=endpoints,
            verdicts={},
            models={n: settings.model for n in endpoints},
            draining=False,
            heartbeat=self.started,
            policy=self.policy,
            listed=settings.use_endpoint_health_status,
            starting=settings.starting_health_status,
            units=_layout(self.plans.values()),
            min_ready=settings.dp_min_ready_ranks,
            rank_of={u: p.rank for u, p in self.plans.items()},
            informing=tuple(
                p.endpoint for p in self.plans.values() if p.probe is ProbeKind.TRANSFER
            ),
        )
        self.snapshot = rebuilt(empty, self.started)

    def observe(self, obs: Observation) -> None:
        """The monitor's thread only: one step, published, and its events handed on."""
        stepped = step(self.snapshot, obs, self.clock())
        self.snapshot = stepped.snapshot
        self._emit(*stepped.events)

    def set_ranks(self, ranks: int) -> dict[str, CanaryPlan]:
        """Check each endpoint with a canary rank by rank from now on (1: as one), as the
        engine's metrics counted them (SIDECAR_DP_RANKS=auto; again after a restart). Each unit
        gets a fresh canary source and keeps what the engine said of registration and
        lifecycle. Returns the new plans by unit; the caller stops the old units' probes in the
        same step, so that nothing writes to a unit that is gone."""
        snap = self.snapshot
        now = self.clock()
        plans: dict[str, CanaryPlan] = {}
        endpoints: dict[str, EndpointState] = {}
        models: dict[str, str | None] = {}
        split: set[str] = set()
        for unit, plan in self.plans.items():
            before = snap.endpoints[unit]
            if not plan.probe.is_canary:  # the transfer probe is not a rank's
                plans[unit], endpoints[unit], models[unit] = plan, before, snap.models.get(unit)
                continue
            if plan.endpoint in split:  # one of its other ranks
                continue
            split.add(plan.endpoint)
            whole = replace(plan, rank=None)
            for ranked in [whole.for_rank(r) for r in range(ranks)] if ranks > 1 else [whole]:
                plans[ranked.unit] = ranked
                fresh = replace(
                    EndpointState(ranked.unit, ranked.enabled, ranked.why),
                    registration=before.registration,
                    lifecycle=before.lifecycle,
                )
                endpoints[ranked.unit] = replace(fresh, canary=proves_anew(fresh, now))
                models[ranked.unit] = snap.models.get(unit)
        self.plans = plans
        layout = replace(
            snap,
            units=_layout(plans.values()),
            rank_of={u: p.rank for u, p in plans.items()},
            told_progress={},
        )
        self.snapshot = rebuilt(layout, now, endpoints=endpoints, models=models)
        if ranks > 1:
            text = f"checking {ranks} data-parallel ranks ({', '.join(plans)}), each with its own "
            text += "canary"
        else:
            text = f"checking the engine as one ({', '.join(plans)}): it has one data-parallel rank"
        self._emit(note(text))
        return plans

    def _emit(self, *events: Event) -> None:
        for event in events:
            for subscriber in self.listeners:
                subscriber(event)
