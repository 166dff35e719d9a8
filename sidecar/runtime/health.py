"""The single writer of health state, and the snapshot every reader reads.

The monitor (on its own thread) reports what it observed; :class:`Health` hands each observation
to its evidence source (:mod:`sidecar.core.endpoint`), publishes a new immutable
:class:`Snapshot`, and hands what changed, as events (:mod:`sidecar.core.events`), to its
subscribers: the log (:func:`log_event`), the metrics and the history. The HTTP routes and the
metrics collector, on another thread, read ``health.snapshot`` once per answer: one /health
body always comes from one snapshot. Only the monitor's thread calls the writers (SIGTERM's
drain request is handed to it too).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from sidecar.config import Settings, StartingStatus
from sidecar.core.endpoint import (
    EndpointState,
    apply_canary,
    apply_discovery,
    apply_engine_health,
    apply_lifecycle,
    apply_registration,
    apply_sample,
    apply_transfers,
    judged,
)
from sidecar.core.events import Event, Kind, note, verdict_events, worker_events
from sidecar.core.evidence import lifecycle
from sidecar.core.evidence.canary import CanaryState
from sidecar.core.evidence.lifecycle import LifecycleState
from sidecar.core.evidence.policy import Policy
from sidecar.core.evidence.progress import CanaryCost, ProgressSample, ProgressSpec
from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.evidence.transfers import WINDOW, TransferSample
from sidecar.core.verdict import (
    Liveness,
    Readiness,
    Verdict,
    endpoint_verdict,
    endpoint_verdicts,
    monitor_silent,
    worker_liveness,
    worker_readiness,
)
from sidecar.probes import CanaryPlan, ProbeKind

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


@dataclass(frozen=True)
class Snapshot:
    """Everything a reader needs, consistent with itself.

    ``endpoints`` and ``verdicts`` are per unit: an endpoint ("generate"), or one data-parallel
    rank of it ("generate/rank1"); ``endpoint_verdicts`` per endpoint, its ranks combined."""

    endpoints: Mapping[str, EndpointState]
    verdicts: Mapping[str, Verdict]
    models: Mapping[str, str | None]
    draining: bool
    heartbeat: float  # monotonic time the monitor last ran
    policy: Policy = field(default_factory=Policy)
    listed: tuple[str, ...] = ()
    starting: StartingStatus = StartingStatus.NOTREADY
    units: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # endpoint -> units
    endpoint_verdicts: Mapping[str, Verdict] = field(default_factory=dict)
    min_ready: int | None = None  # SIDECAR_DP_MIN_READY_RANKS
    rank_of: Mapping[str, int | None] = field(default_factory=dict)  # unit -> its rank
    # Endpoints that inform and gate readiness only when listed (kv_transfer).
    informing: tuple[str, ...] = ()

    def ranked(self, endpoint: str) -> bool:
        """The endpoint is checked rank by rank."""
        units = self.units.get(endpoint, ())
        return units != (endpoint,)

    def stale_for(self, now: float) -> float | None:
        """Seconds the monitor has been silent, when that is too long; else None."""
        return monitor_silent(self.heartbeat, now)

    @property
    def engine_gone(self) -> bool:
        """Every endpoint's last registration check found nothing listening."""
        return all(ep.registration.gone for ep in self.endpoints.values())


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
        self.snapshot = self._make(endpoints, {n: settings.model for n in endpoints}, False)
        self._last_ready: bool | None = None
        self._last_live = True
        self._progress_said: dict[str, tuple[bool, str]] = {}

    def _make(
        self,
        endpoints: Mapping[str, EndpointState],
        models: Mapping[str, str | None],
        draining: bool,
    ) -> Snapshot:
        now = self.clock()
        verdicts = {n: endpoint_verdict(ep, self.policy, now) for n, ep in endpoints.items()}
        units: dict[str, tuple[str, ...]] = {}
        for unit, plan in self.plans.items():
            units[plan.endpoint] = (*units.get(plan.endpoint, ()), unit)
        need = self.settings.dp_min_ready_ranks
        combined = endpoint_verdicts(units, verdicts, need)
        return Snapshot(
            endpoints=dict(endpoints),
            verdicts=verdicts,
            models=dict(models),
            draining=draining,
            heartbeat=now,
            policy=self.policy,
            listed=self.settings.use_endpoint_health_status,
            starting=self.settings.starting_health_status,
            units=units,
            endpoint_verdicts=combined,
            min_ready=need,
            rank_of={u: p.rank for u, p in self.plans.items()},
            informing=tuple(
                p.endpoint for p in self.plans.values() if p.probe is ProbeKind.TRANSFER
            ),
        )

    def set_ranks(self, ranks: int) -> dict[str, CanaryPlan]:
        """Check each endpoint rank by rank from now on (SIDECAR_DP_RANKS=auto, once the engine's
        metrics told how many): each rank gets a fresh canary source and keeps what the engine
        said of registration and lifecycle. Returns the new plans by unit; the caller cancels the
        old units' loops in the same step, so that nothing writes to a unit that is gone."""
        snap = self.snapshot
        now = self.clock()
        plans: dict[str, CanaryPlan] = {}
        endpoints: dict[str, EndpointState] = {}
        models: dict[str, str | None] = {}
        for unit, plan in self.plans.items():
            before = snap.endpoints[unit]
            if not plan.probe.is_canary:  # the transfer probe is not a rank's
                plans[unit], endpoints[unit], models[unit] = plan, before, snap.models.get(unit)
                continue
            for rank in range(ranks):
                ranked = plan.for_rank(rank)
                due = now if before.registration.registered and ranked.enabled else None
                plans[ranked.unit] = ranked
                endpoints[ranked.unit] = replace(
                    EndpointState(ranked.unit, ranked.enabled, ranked.why),
                    registration=before.registration,
                    lifecycle=before.lifecycle,
                    canary=CanaryState(next_due=due),
                )
                models[ranked.unit] = snap.models.get(unit)
        self._say(
            logging.INFO,
            "checking %d data-parallel ranks (%s), each with its own canary",
            ranks,
            ", ".join(plans),
        )
        self.plans = plans
        self.snapshot = self._make(endpoints, models, snap.draining)
        self._log_worker()
        return plans

    # --- writers: the monitor's thread only ----------------------------------------------------
    def record_registration(self, name: str, result: Result) -> None:
        before = self.snapshot.endpoints[name]
        after = apply_registration(before, result, self.policy)
        if before.registration.registered != after.registration.registered:
            self._say(
                logging.INFO,
                "%s: engine %s (%s)",
                name,
                "registered" if after.registration.registered else "deregistered",
                after.registration.reason,
            )
        elif after.registration.note and after.registration.note != before.registration.note:
            self._say(logging.INFO, "%s: %s", name, after.registration.reason)
        self._commit(name, after)

    def record_canary(
        self,
        name: str,
        result: Result,
        incarnation: int,
        *,
        baseline: ProgressSample | None = None,
        end: ProgressSample | None = None,
        cost: CanaryCost | None = None,
        suspected: bool = False,
    ) -> None:
        before = self.snapshot.endpoints[name]
        result = judged(before, result, self.policy)
        self._emit(Event(Kind.CANARY, None, unit=name, result=result))
        after = apply_canary(
            before,
            result,
            incarnation,
            self.policy,
            baseline=baseline,
            end=end,
            cost=cost,
            suspected=suspected,
        )
        if after is before:
            self._say(
                logging.DEBUG,
                "%s: dropped the result of canary %s: sent to an older incarnation, or across "
                "a pause",
                name,
                result.request_id,
            )
            return
        if result.outcome is Outcome.TIMEOUT:
            self._say(
                logging.DEBUG,
                "%s: canary %s timed out; metrics before: %s; after: %s; %s",
                name,
                result.request_id,
                _described(baseline),
                _described(end),
                after.canary.reason,
            )
        if after.canary.stalled and not before.canary.stalled:
            self._say(logging.WARNING, "%s: engine stalled: %s", name, after.canary.reason)
        self._commit(name, after)

    def record_sample(
        self,
        name: str,
        sample: ProgressSample | None,
        why: str,
        spec: ProgressSpec,
        own: CanaryCost | None = None,
    ) -> None:
        before = self.snapshot.endpoints[name]
        after = apply_sample(before, sample, why, spec, own)
        said = (after.progress.readable, after.progress.why)
        if self._progress_said.get(name) != said:  # once per change, not per incarnation
            self._progress_said[name] = said
            if after.progress.readable:
                self._say(logging.INFO, "%s: engine progress: %s", name, after.progress.why)
            else:
                self._say(
                    logging.INFO,
                    "%s: engine progress unknown (%s); the canary alone decides",
                    name,
                    after.progress.why,
                )
        self._commit(name, after)

    def record_sleep(
        self, name: str, sleeping: bool | None, why: str, *, gauge: bool, missing: bool = False
    ) -> None:
        """What the engine's sleep route (``gauge`` False) or sleep-state gauge said."""
        before = self.snapshot.endpoints[name]
        now = self.clock()
        if gauge:
            after = lifecycle.on_sleep_gauge(before.lifecycle, sleeping, why, now)
        else:
            after = lifecycle.on_sleep_route(before.lifecycle, sleeping, why, now, missing=missing)
            if missing and not before.lifecycle.sleep_route_missing:
                self._say(logging.INFO, "%s: %s; its sleep state is not asked again", name, why)
        self._pause_change(name, before.lifecycle, after)

    def record_transfers(self, name: str, sample: TransferSample | None) -> None:
        before = self.snapshot.endpoints[name]
        after = apply_transfers(before, sample)
        now = self.clock()
        was, is_ = before.transfers.failing(now), after.transfers.failing(now)
        if is_ and not was:
            self._say(logging.WARNING, "%s: %s", name, after.transfers.note(now).removeprefix("; "))
        elif was and not is_:
            self._say(
                logging.INFO,
                "%s: KV transfers from prefill peers: no failure for %g s",
                name,
                WINDOW,
            )
        self._commit(name, after)

    def record_discovery(
        self, name: str, listed: bool | None, instance: str | None, where: str
    ) -> None:
        """Whether discovery lists the worker's instance (None: not asked)."""
        before = self.snapshot.endpoints[name]
        after = apply_discovery(before, listed, instance, self.clock(), where)
        was, is_ = before.discovery, after.discovery
        if is_.listed is False and (was.listed is not False or was.instance != is_.instance):
            self._say(logging.WARNING, "%s: %s", name, is_.reason())
        elif is_.listed and was.listed is False and was.instance == is_.instance:
            self._say(logging.INFO, "%s: %s is listed by %s again", name, is_.instance, is_.where)
        self._commit(name, after)

    def record_engine_health(
        self, name: str, status_code: int | None, status: str | None, detail: str
    ) -> None:
        """What the engine's own health route answered (a Dynamo worker's /health)."""
        before = self.snapshot.endpoints[name]
        after = apply_engine_health(before, status_code, status, detail, self.clock())
        if after.engine_health.says_ready != before.engine_health.says_ready:
            self._say(logging.INFO, "%s: the engine's own health route: %s", name, detail)
        self._commit(name, after)

    def start_maintenance(self, reason: str, seconds: float) -> None:
        """Declare (or replace) a maintenance window on every endpoint."""
        now, wall = self.clock(), time.time()
        for name, ep in self.snapshot.endpoints.items():
            after = lifecycle.start_maintenance(ep.lifecycle, reason, seconds, now, wall)
            if ep.lifecycle.maintenance is not None:
                self._say(
                    logging.INFO, "%s: maintenance window replaced: %s", name, after.reason(now)
                )
            self._pause_change(name, ep.lifecycle, after)

    def end_maintenance(self, why: str) -> None:
        """End the maintenance window, if one is declared."""
        now = self.clock()
        for name, ep in self.snapshot.endpoints.items():
            if ep.lifecycle.maintenance is not None:
                after = lifecycle.end_maintenance(ep.lifecycle, now)
                self._pause_change(name, ep.lifecycle, after, f"maintenance ended: {why}")

    def _pause_change(
        self, name: str, before: LifecycleState, after: LifecycleState, why: str = ""
    ) -> None:
        ep = self.snapshot.endpoints[name]
        now = self.clock()
        if before.paused != after.paused:
            if after.paused:
                self._say(logging.INFO, "%s: paused: %s", name, after.reason(now))
            else:
                proof = "; a canary proves the engine before it is ready" if ep.has_canary else ""
                self._say(
                    logging.INFO, "%s: resumed (%s)%s", name, why or "the engine is awake", proof
                )
        elif why:
            self._say(logging.INFO, "%s: %s; still paused: %s", name, why, after.reason(now))
        self._commit(name, apply_lifecycle(ep, after, self.clock()))

    def set_model(self, name: str, model: str | None) -> None:
        snap = self.snapshot
        if snap.models[name] != model:
            self._say(logging.INFO, "%s: served model is %r (from GET /v1/models)", name, model)
            self.snapshot = replace(snap, models={**snap.models, name: model})

    def start_draining(self) -> None:
        if not self.snapshot.draining:
            self.snapshot = self._make(self.snapshot.endpoints, self.snapshot.models, True)
            self._log_worker()

    def tick(self) -> None:
        """The heartbeat: republish, and log a change of liveness (which time alone changes)."""
        self.snapshot = replace(self.snapshot, heartbeat=self.clock())
        self._log_worker()

    def _commit(self, name: str, after: EndpointState) -> None:
        snap = self.snapshot
        before = snap.endpoints[name]
        if after == before:
            self.snapshot = replace(snap, heartbeat=self.clock())
            return
        new = self._make({**snap.endpoints, name: after}, snap.models, snap.draining)
        endpoint = self.plans[name].endpoint
        combined = (
            (endpoint, snap.endpoint_verdicts[endpoint], new.endpoint_verdicts[endpoint])
            if new.ranked(endpoint)
            else None
        )
        self.snapshot = new
        self._emit(
            *verdict_events(
                name,
                name not in new.units,
                before,
                after,
                snap.verdicts[name],
                new.verdicts[name],
                combined,
            )
        )
        self._log_worker()

    def _log_worker(self) -> None:
        """Tell the worker's readiness and liveness when they changed."""
        snap, now = self.snapshot, self.clock()
        readiness, liveness = readiness_of(snap, now), liveness_of(snap, now)
        events = worker_events(self._last_ready, self._last_live, readiness, liveness)
        self._last_ready, self._last_live = readiness.ready, liveness.live
        self._emit(*events)

    def _emit(self, *events: Event) -> None:
        for event in events:
            for subscriber in self.listeners:
                subscriber(event)

    def _say(self, level: int, text: str, *args: object) -> None:
        """A source's change worth a line (``text % args``), as an event."""
        self._emit(note(text % args if args else text, level))


# --- readers: any thread, one snapshot per answer -----------------------------------------------
def readiness_of(snap: Snapshot, now: float) -> Readiness:
    return worker_readiness(
        snap.endpoint_verdicts,
        snap.listed,
        snap.starting,
        draining=snap.draining,
        informing=snap.informing,
        silent=snap.stale_for(now),
    )


def liveness_of(snap: Snapshot, now: float) -> Liveness:
    return worker_liveness(snap.endpoints, now, snap.policy.liveness_window, snap.stale_for(now))


def _described(sample: ProgressSample | None) -> str:
    if sample is None:
        return "unread"
    return f"in flight {sample.in_flight}, counters {dict(sample.counters)}"
