"""The one pure step: the snapshot before and an observation in; the snapshot after and the events
the observation caused out.

Each observation goes to the source it is about (:mod:`sidecar.core.endpoint`'s ``apply_*``);
the step then says what changed, as events (:mod:`sidecar.core.events`): a source's change worth
a line (registered, paused, stalled, ...), a unit's or an endpoint's verdict change, the worker's
readiness or liveness change. Nothing here does I/O or reads a clock: ``now`` and the wall time
come in with the call, so every step can be tested as a table.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from sidecar.core.endpoint import (
    EndpointState,
    apply_canary,
    apply_discovery,
    apply_engine_health,
    apply_faults,
    apply_lifecycle,
    apply_load,
    apply_registration,
    apply_sample,
    apply_transfers,
    judged,
    proves_anew,
    unit_name,
)
from sidecar.core.events import Event, Kind, note, verdict_events, worker_events
from sidecar.core.evidence import lifecycle
from sidecar.core.evidence.lifecycle import LifecycleState
from sidecar.core.evidence.progress import ProgressSample
from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.evidence.transfers import WINDOW
from sidecar.core.observations import (
    CanaryDone,
    DiscoverySaid,
    DrainAsked,
    EngineHealthSaid,
    FaultsSaid,
    Heartbeat,
    LoadRead,
    MaintenanceDeclared,
    MaintenanceOver,
    ModelServed,
    Observation,
    ProgressRead,
    RanksCounted,
    Registered,
    SleepSaid,
    TransfersRead,
)
from sidecar.core.snapshot import Snapshot, liveness_of, readiness_of, rebuilt


@dataclass(frozen=True)
class Stepped:
    snapshot: Snapshot
    events: tuple[Event, ...]


class _Changes:
    """The units' new states and the notes of one step, gathered before the snapshot is made."""

    def __init__(self, snap: Snapshot, now: float) -> None:
        self.snap = snap
        self.now = now
        self.endpoints: dict[str, EndpointState] = dict(snap.endpoints)
        self.events: list[Event] = []
        self.told_progress = snap.told_progress
        self.models: Mapping[str, str | None] = snap.models
        self.model_why: Mapping[str, str] = snap.model_why
        self.draining = snap.draining
        # The unit layout, changed only by a rank count.
        self.units = snap.units
        self.rank_of = snap.rank_of
        self.ranks_counted_for = snap.ranks_counted_for

    def say(self, text: str, level: int = logging.INFO, unit: str | None = None) -> None:
        self.events.append(note(text, level, unit))

    def pause_change(
        self, unit: str, before: LifecycleState, after: LifecycleState, why: str = ""
    ) -> None:
        """A new lifecycle state for ``unit``: a pause begins or ends, or ``why`` is said."""
        ep = self.endpoints[unit]
        if before.paused != after.paused:
            if after.paused:
                self.say(f"{unit}: paused: {after.reason(self.now)}", unit=unit)
            else:
                proof = "; a canary proves the engine before it is ready" if ep.has_canary else ""
                cause = why or "the engine is awake"
                self.say(f"{unit}: resumed ({cause}){proof}", unit=unit)
        elif why:
            self.say(f"{unit}: {why}; still paused: {after.reason(self.now)}", unit=unit)
        self.endpoints[unit] = apply_lifecycle(ep, after, self.now)


def step(snap: Snapshot, obs: Observation, now: float) -> Stepped:
    """Hand ``obs`` to its source; the new snapshot (stamped ``now``) and its events."""
    changes = _Changes(snap, now)
    _STEPS[type(obs)](changes, obs)
    return _published(snap, changes)


# --- the worker as a whole ----------------------------------------------------------------------
def _model(c: _Changes, obs: ModelServed) -> None:
    if c.snap.models[obs.unit] != obs.model:
        c.say(f"{obs.unit}: served model is {obs.model!r} (from GET /v1/models)", unit=obs.unit)
        c.models = {**c.snap.models, obs.unit: obs.model}
    if obs.model is None:
        c.model_why = {**c.model_why, obs.unit: obs.why}


def _ranks(c: _Changes, obs: RanksCounted) -> None:
    """The engine's ranks, counted (SIDECAR_DP_RANKS=auto): with more than one, each endpoint
    checked per rank is a unit per rank from now on, with one, the endpoint as a whole. A count
    for another incarnation than the engine's now says nothing (it restarted meanwhile)."""
    snap = c.snap
    if not snap.per_rank or obs.incarnation != snap.incarnation():
        return
    first = snap.ranks_counted_for is None
    c.ranks_counted_for = obs.incarnation
    found = len(obs.ranks)
    members = snap.units[snap.per_rank[0]]
    had = len(members) if snap.ranked(snap.per_rank[0]) else 1
    if first or found != had:
        again = "" if first else f"; it had {had} before it restarted"
        c.say(
            f"the engine's metrics show {found} data-parallel rank(s) "
            f"({obs.label}={','.join(map(str, obs.ranks))}){again}"
        )
    if found == had:
        return
    endpoints = dict(c.endpoints)
    units = dict(snap.units)
    rank_of = dict(snap.rank_of)
    models = dict(c.models)
    for endpoint in snap.per_rank:
        old = snap.units[endpoint]
        before = snap.endpoints[old[0]]
        for unit in old:
            del endpoints[unit], rank_of[unit], models[unit]
        ranks: list[int | None] = list(range(found)) if found > 1 else [None]
        units[endpoint] = tuple(unit_name(endpoint, r) for r in ranks)
        for rank, unit in zip(ranks, units[endpoint], strict=True):
            fresh = replace(
                EndpointState(unit, before.has_canary, before.canary_why, liveness=before.liveness),
                registration=before.registration,
                lifecycle=before.lifecycle,
            )
            endpoints[unit] = replace(fresh, canary=proves_anew(fresh, c.now))
            rank_of[unit] = rank
            models[unit] = c.models.get(old[0])
    c.endpoints, c.units, c.rank_of, c.models = endpoints, units, rank_of, models
    c.told_progress = {}
    checked = ", ".join(u for e in snap.per_rank for u in units[e])
    if found > 1:
        c.say(f"checking {found} data-parallel ranks ({checked}), each with its own canary")
    else:
        c.say(f"checking the engine as one ({checked}): it has one data-parallel rank")


def _drain(c: _Changes, obs: DrainAsked) -> None:
    c.draining = True


def _heartbeat(c: _Changes, obs: Heartbeat) -> None:
    """Nothing changes but the time: liveness, which time alone changes, is told if it did."""


def _window(c: _Changes, obs: MaintenanceDeclared) -> None:
    for unit, ep in c.snap.endpoints.items():
        after = lifecycle.start_maintenance(ep.lifecycle, obs.reason, obs.seconds, c.now, obs.wall)
        if ep.lifecycle.maintenance is not None:
            c.say(f"{unit}: maintenance window replaced: {after.reason(c.now)}")
        c.pause_change(unit, ep.lifecycle, after)


def _window_over(c: _Changes, obs: MaintenanceOver) -> None:
    for unit, ep in c.snap.endpoints.items():
        if ep.lifecycle.maintenance is not None:
            after = lifecycle.end_maintenance(ep.lifecycle, c.now)
            c.pause_change(unit, ep.lifecycle, after, f"maintenance ended: {obs.why}")


# --- one unit's sources -------------------------------------------------------------------------
def _unusable(c: _Changes, unit: str, result: Result) -> Result:
    """A registered engine whose served model could not be learned, for a canary that names
    it, cannot be canaried: it counts as not registered, with the lookup's reason."""
    if not result.ok or c.snap.endpoint_of(unit) not in c.snap.model_wanted:
        return result
    if c.models.get(unit) is not None:
        return result
    why = c.model_why.get(unit, "not looked up yet")
    return replace(result, outcome=Outcome.ERROR, reason=f"model not known: {why}")


def _registered(c: _Changes, obs: Registered) -> None:
    unit, before = obs.unit, c.snap.endpoints[obs.unit]
    after = apply_registration(before, _unusable(c, unit, obs.result), c.snap.policy)
    was, is_ = before.registration, after.registration
    if was.registered != is_.registered:
        if is_.registered:
            said = "registered"
        elif is_.incarnation:
            said = "deregistered"
        else:  # never registered: it is coming, not going
            said = "not reachable yet" if is_.gone or is_.last is None else "not registered yet"
            if is_.last is not None and is_.last.outcome is Outcome.TIMEOUT:
                said = "not reachable yet"
        c.say(f"{unit}: engine {said} ({is_.reason})", unit=unit)
    elif is_.note and is_.note != was.note:
        c.say(f"{unit}: {is_.reason}", unit=unit)
    c.endpoints[unit] = after


def _progress(c: _Changes, obs: ProgressRead) -> None:
    unit = obs.unit
    after = apply_sample(c.snap.endpoints[unit], obs.sample, obs.why, obs.spec, obs.own)
    said = (after.progress.readable, after.progress.why)
    if c.snap.told_progress.get(unit) != said:  # once per change, not per incarnation
        c.told_progress = {**c.told_progress, unit: said}
        if after.progress.readable:
            c.say(f"{unit}: engine progress: {after.progress.why}", unit=unit)
        else:
            c.say(
                f"{unit}: engine progress unknown ({after.progress.why}); the canary alone decides",
                unit=unit,
            )
    c.endpoints[unit] = after


def _sleep(c: _Changes, obs: SleepSaid) -> None:
    unit, before = obs.unit, c.snap.endpoints[obs.unit].lifecycle
    if obs.gauge:
        after = lifecycle.on_sleep_gauge(before, obs.sleeping, obs.why, c.now)
    else:
        after = lifecycle.on_sleep_route(before, obs.sleeping, obs.why, c.now, missing=obs.missing)
        if obs.missing and not before.sleep_route_missing:
            c.say(f"{unit}: {obs.why}; its sleep state is not asked again", unit=unit)
    c.pause_change(unit, before, after)


def _faults(c: _Changes, obs: FaultsSaid) -> None:
    unit, before = obs.unit, c.snap.endpoints[obs.unit]
    after = apply_faults(before, obs.rank, obs.report, c.now, missing=obs.missing)
    was, is_ = before.faults, after.faults
    if is_.missing and not was.missing:
        c.say(
            f"{unit}: the engine serves no fault-tolerance status (404); not asked again", unit=unit
        )
    elif not is_.healthy and (was.report != is_.report or was.rank != is_.rank):
        c.say(f"{unit}: {is_.reason()}", logging.WARNING, unit)
    elif is_.healthy and not was.healthy:
        c.say(
            f"{unit}: vLLM fault tolerance: the engine reports healthy again; a canary proves it "
            "before it is ready",
            unit=unit,
        )
    c.endpoints[unit] = after


def _load(c: _Changes, obs: LoadRead) -> None:
    unit, before = obs.unit, c.snap.endpoints[obs.unit]
    after = apply_load(before, obs.sample, obs.why)
    if after.load.stale and not before.load.stale:
        c.say(
            f"{unit}: the engine says its load sample is stale while requests are active "
            f"({obs.why}): a canary confirms",
            logging.WARNING,
            unit,
        )
    elif before.load.stale and not after.load.stale:
        c.say(f"{unit}: the engine's load report is fresh again", unit=unit)
    c.endpoints[unit] = after


def _transfers(c: _Changes, obs: TransfersRead) -> None:
    unit, before = obs.unit, c.snap.endpoints[obs.unit]
    after = apply_transfers(before, obs.sample)
    was, is_ = before.transfers.failing(c.now), after.transfers.failing(c.now)
    if is_ and not was:
        c.say(f"{unit}: {after.transfers.note(c.now).removeprefix('; ')}", logging.WARNING, unit)
    elif was and not is_:
        c.say(f"{unit}: KV transfers from prefill peers: no failure for {WINDOW:g} s", unit=unit)
    c.endpoints[unit] = after


def _discovery(c: _Changes, obs: DiscoverySaid) -> None:
    unit, before = obs.unit, c.snap.endpoints[obs.unit]
    after = apply_discovery(before, obs.listed, obs.instance, c.now, obs.where)
    d0, d1 = before.discovery, after.discovery
    if d1.listed is False and (d0.listed is not False or d0.instance != d1.instance):
        c.say(f"{unit}: {d1.reason()}", logging.WARNING, unit)
    elif d1.listed and d0.listed is False and d0.instance == d1.instance:
        c.say(f"{unit}: {d1.instance} is listed by {d1.where} again", unit=unit)
    c.endpoints[unit] = after


def _engine_health(c: _Changes, obs: EngineHealthSaid) -> None:
    unit, before = obs.unit, c.snap.endpoints[obs.unit]
    after = apply_engine_health(before, obs.ready, obs.status, obs.detail, c.now, obs.status_code)
    if after.engine_health.says_ready != before.engine_health.says_ready:
        c.say(f"{unit}: the engine's own health: {obs.detail}", unit=unit)
    c.endpoints[unit] = after


def _canary(changes: _Changes, obs: CanaryDone) -> None:
    snap, unit = changes.snap, obs.unit
    before = snap.endpoints[unit]
    result = judged(before, obs.result, snap.policy)
    changes.events.append(Event(Kind.CANARY, None, unit=unit, result=result))
    after = apply_canary(
        before,
        result,
        obs.incarnation,
        snap.policy,
        baseline=obs.baseline,
        end=obs.end,
        cost=obs.cost,
        suspected=obs.suspected,
    )
    if after is before:
        changes.say(
            f"{unit}: dropped the result of canary {result.request_id}: sent to an older "
            "incarnation, or across a pause",
            logging.DEBUG,
            unit,
        )
        return
    if result.outcome is Outcome.TIMEOUT:
        changes.say(
            f"{unit}: canary {result.request_id} timed out; metrics before: "
            f"{_described(obs.baseline)}; after: {_described(obs.end)}; {after.canary.reason}",
            logging.DEBUG,
            unit,
        )
    if after.canary.stalled and not before.canary.stalled:
        changes.say(f"{unit}: engine stalled: {after.canary.reason}", logging.WARNING, unit)
    changes.endpoints[unit] = after


def _published(snap: Snapshot, changes: _Changes) -> Stepped:
    """The new snapshot, and after the sources' notes the events of what it changed: each unit's
    verdict, its ranked endpoint's, the worker's readiness and liveness."""
    now = changes.now
    # Units new in this step (a rank count) have no verdict to change from yet.
    changed = [
        u for u, ep in changes.endpoints.items() if u in snap.endpoints and ep != snap.endpoints[u]
    ]
    layout = replace(
        snap,
        units=changes.units,
        rank_of=changes.rank_of,
        ranks_counted_for=changes.ranks_counted_for,
        model_why=changes.model_why,
    )
    new = rebuilt(
        layout,
        now,
        endpoints=changes.endpoints,
        models=changes.models,
        draining=changes.draining,
    )
    events = changes.events
    for unit in changed:
        endpoint = snap.endpoint_of(unit)
        combined = (
            (endpoint, snap.endpoint_verdicts[endpoint], new.endpoint_verdicts[endpoint])
            if new.ranked(endpoint)
            else None
        )
        events += verdict_events(
            unit,
            unit not in new.units,
            snap.endpoints[unit],
            changes.endpoints[unit],
            snap.verdicts[unit],
            new.verdicts[unit],
            combined,
        )
    readiness, liveness = readiness_of(new, now), liveness_of(new, now)
    events += worker_events(snap.told_ready, snap.told_live, readiness, liveness)
    new = replace(
        new,
        told_ready=readiness.ready,
        told_live=liveness.live,
        told_progress=changes.told_progress,
    )
    return Stepped(new, tuple(events))


def _described(sample: ProgressSample | None) -> str:
    if sample is None:
        return "unread"
    return f"in flight {sample.in_flight}, counters {dict(sample.counters)}"


# Each observation's step: one function per kind of observation (tests/test_step.py checks that
# every kind in sidecar.core.observations.Observation has one).
_STEPS: dict[type, Callable[[_Changes, Any], None]] = {
    ModelServed: _model,
    RanksCounted: _ranks,
    DrainAsked: _drain,
    Heartbeat: _heartbeat,
    MaintenanceDeclared: _window,
    MaintenanceOver: _window_over,
    Registered: _registered,
    CanaryDone: _canary,
    ProgressRead: _progress,
    SleepSaid: _sleep,
    FaultsSaid: _faults,
    TransfersRead: _transfers,
    LoadRead: _load,
    DiscoverySaid: _discovery,
    EngineHealthSaid: _engine_health,
}
