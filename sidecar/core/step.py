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
from collections.abc import Mapping
from dataclasses import dataclass, replace

from sidecar.core.endpoint import (
    EndpointState,
    apply_canary,
    apply_discovery,
    apply_engine_health,
    apply_faults,
    apply_lifecycle,
    apply_registration,
    apply_sample,
    apply_transfers,
    judged,
)
from sidecar.core.events import Event, Kind, note, verdict_events, worker_events
from sidecar.core.evidence import lifecycle
from sidecar.core.evidence.lifecycle import LifecycleState
from sidecar.core.evidence.progress import ProgressSample
from sidecar.core.evidence.result import Outcome
from sidecar.core.evidence.transfers import WINDOW
from sidecar.core.observations import (
    CanaryDone,
    DiscoverySaid,
    DrainAsked,
    EngineHealthSaid,
    FaultsSaid,
    Heartbeat,
    MaintenanceDeclared,
    MaintenanceOver,
    ModelServed,
    Observation,
    ProgressRead,
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
    models, draining = snap.models, snap.draining
    match obs:
        case ModelServed(unit, model):
            if snap.models[unit] != model:
                changes.say(f"{unit}: served model is {model!r} (from GET /v1/models)", unit=unit)
                models = {**snap.models, unit: model}
        case DrainAsked():
            draining = True
        case Heartbeat():
            pass
        case MaintenanceDeclared(reason, seconds, wall):
            for unit, ep in snap.endpoints.items():
                after = lifecycle.start_maintenance(ep.lifecycle, reason, seconds, now, wall)
                if ep.lifecycle.maintenance is not None:
                    changes.say(f"{unit}: maintenance window replaced: {after.reason(now)}")
                changes.pause_change(unit, ep.lifecycle, after)
        case MaintenanceOver(why):
            for unit, ep in snap.endpoints.items():
                if ep.lifecycle.maintenance is not None:
                    after = lifecycle.end_maintenance(ep.lifecycle, now)
                    changes.pause_change(unit, ep.lifecycle, after, f"maintenance ended: {why}")
        case _:
            _unit_step(changes, obs)
    return _published(snap, changes, models, draining)


def _unit_step(changes: _Changes, obs: Observation) -> None:
    """An observation about one unit, to that unit's source."""
    snap, now = changes.snap, changes.now
    match obs:
        case Registered(unit, result):
            before = snap.endpoints[unit]
            after = apply_registration(before, result, snap.policy)
            was, is_ = before.registration, after.registration
            if was.registered != is_.registered:
                said = "registered" if is_.registered else "deregistered"
                changes.say(f"{unit}: engine {said} ({is_.reason})", unit=unit)
            elif is_.note and is_.note != was.note:
                changes.say(f"{unit}: {is_.reason}", unit=unit)
            changes.endpoints[unit] = after
        case CanaryDone(unit):
            _canary_step(changes, obs)
        case ProgressRead(unit, sample, why, spec, own):
            after = apply_sample(snap.endpoints[unit], sample, why, spec, own)
            said = (after.progress.readable, after.progress.why)
            if snap.told_progress.get(unit) != said:  # once per change, not per incarnation
                changes.told_progress = {**changes.told_progress, unit: said}
                if after.progress.readable:
                    changes.say(f"{unit}: engine progress: {after.progress.why}", unit=unit)
                else:
                    changes.say(
                        f"{unit}: engine progress unknown ({after.progress.why}); "
                        "the canary alone decides",
                        unit=unit,
                    )
            changes.endpoints[unit] = after
        case SleepSaid(unit, sleeping, why, gauge, missing):
            before = snap.endpoints[unit].lifecycle
            if gauge:
                after_lc = lifecycle.on_sleep_gauge(before, sleeping, why, now)
            else:
                after_lc = lifecycle.on_sleep_route(before, sleeping, why, now, missing=missing)
                if missing and not before.sleep_route_missing:
                    changes.say(f"{unit}: {why}; its sleep state is not asked again", unit=unit)
            changes.pause_change(unit, before, after_lc)
        case FaultsSaid(unit, rank, report, missing):
            before = snap.endpoints[unit]
            after = apply_faults(before, rank, report, now, missing=missing)
            was, is_ = before.faults, after.faults
            if is_.missing and not was.missing:
                changes.say(
                    f"{unit}: the engine serves no fault-tolerance status (404); not asked again",
                    unit=unit,
                )
            elif not is_.healthy and (was.report != is_.report or was.rank != is_.rank):
                changes.say(f"{unit}: {is_.reason()}", logging.WARNING, unit)
            elif is_.healthy and not was.healthy:
                changes.say(
                    f"{unit}: vLLM fault tolerance: the engine reports healthy again; a canary "
                    "proves it before it is ready",
                    unit=unit,
                )
            changes.endpoints[unit] = after
        case TransfersRead(unit, sample):
            before = snap.endpoints[unit]
            after = apply_transfers(before, sample)
            was, is_ = before.transfers.failing(now), after.transfers.failing(now)
            if is_ and not was:
                text = after.transfers.note(now).removeprefix("; ")
                changes.say(f"{unit}: {text}", logging.WARNING, unit)
            elif was and not is_:
                changes.say(
                    f"{unit}: KV transfers from prefill peers: no failure for {WINDOW:g} s",
                    unit=unit,
                )
            changes.endpoints[unit] = after
        case DiscoverySaid(unit, listed, instance, where):
            before = snap.endpoints[unit]
            after = apply_discovery(before, listed, instance, now, where)
            d0, d1 = before.discovery, after.discovery
            if d1.listed is False and (d0.listed is not False or d0.instance != d1.instance):
                changes.say(f"{unit}: {d1.reason()}", logging.WARNING, unit)
            elif d1.listed and d0.listed is False and d0.instance == d1.instance:
                changes.say(f"{unit}: {d1.instance} is listed by {d1.where} again", unit=unit)
            changes.endpoints[unit] = after
        case EngineHealthSaid(unit, status_code, status, detail):
            before = snap.endpoints[unit]
            after = apply_engine_health(before, status_code, status, detail, now)
            if after.engine_health.says_ready != before.engine_health.says_ready:
                changes.say(f"{unit}: the engine's own health route: {detail}", unit=unit)
            changes.endpoints[unit] = after
        case _:  # pragma: no cover - every observation is matched above or in step()
            raise TypeError(f"not an observation: {obs!r}")


def _canary_step(changes: _Changes, obs: CanaryDone) -> None:
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


def _published(
    snap: Snapshot,
    changes: _Changes,
    models: Mapping[str, str | None],
    draining: bool,
) -> Stepped:
    """The new snapshot, and after the sources' notes the events of what it changed: each unit's
    verdict, its ranked endpoint's, the worker's readiness and liveness."""
    now = changes.now
    changed = [u for u, ep in changes.endpoints.items() if ep != snap.endpoints[u]]
    new = rebuilt(
        snap,
        now,
        endpoints=changes.endpoints,
        models=models,
        draining=draining,
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
