"""One endpoint: its evidence sources, and how each observation reaches its source.

Each ``apply_*`` function hands one observation to the source it belongs to, with the hints the
source may take from the others (read-only). Two things cross sources: a new incarnation of the
engine (it restarted, or came back from a freeze) gets fresh canary and progress sources, since
its counters start again and it proves itself anew; and a pause of its lifecycle (asleep, or in
a declared maintenance window) ends the canary's evidence, so that it proves itself anew after.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from sidecar.core.evidence import lifecycle
from sidecar.core.evidence.canary import CanaryState, TimeoutEvidence, check_answer, on_canary
from sidecar.core.evidence.discovery import DiscoveryState, on_discovery
from sidecar.core.evidence.enginehealth import EngineHealthState, on_engine_health
from sidecar.core.evidence.faults import EngineReport, FaultState, on_fault_report
from sidecar.core.evidence.lifecycle import LifecycleState, Maintenance
from sidecar.core.evidence.load import LoadSample, LoadState, on_load
from sidecar.core.evidence.policy import Policy
from sidecar.core.evidence.progress import (
    CanaryCost,
    ProgressSample,
    ProgressSpec,
    ProgressState,
    foreign_progress,
    on_sample,
)
from sidecar.core.evidence.registration import RegistrationState, on_registration
from sidecar.core.evidence.result import Result
from sidecar.core.evidence.transfers import TransferSample, TransferState, on_transfers


def unit_name(endpoint: str, rank: int | None) -> str:
    """What one unit checks: the endpoint, or one data-parallel rank of it ("generate/rank1")."""
    return endpoint if rank is None else f"{endpoint}/rank{rank}"


@dataclass(frozen=True)
class EndpointState:
    name: str
    has_canary: bool
    canary_why: str
    registration: RegistrationState = field(default_factory=RegistrationState)
    canary: CanaryState = field(default_factory=CanaryState)
    progress: ProgressState = field(default_factory=ProgressState)
    lifecycle: LifecycleState = field(default_factory=LifecycleState)
    transfers: TransferState = field(default_factory=TransferState)
    discovery: DiscoveryState = field(default_factory=DiscoveryState)
    engine_health: EngineHealthState = field(default_factory=EngineHealthState)
    faults: FaultState = field(default_factory=FaultState)
    load: LoadState = field(default_factory=LoadState)  # the engine's own load report
    # False for an endpoint that informs (kv_transfer): its failures never fail /live.
    liveness: bool = True

    @property
    def incarnation(self) -> int:
        return self.registration.incarnation


def proves_anew(ep: EndpointState, at: float) -> CanaryState:
    """A fresh canary source: the engine proves itself anew (a new incarnation, back in
    discovery, resumed from a pause, a rank of its own), its first canary due at ``at`` once it
    is registered and its role has one."""
    return CanaryState(next_due=at if ep.registration.registered and ep.has_canary else None)


def apply_registration(ep: EndpointState, result: Result, policy: Policy) -> EndpointState:
    registration = on_registration(
        ep.registration,
        result,
        progressing=ep.progress.progressing_since(result.started - policy.metrics_interval),
        canary_decides=ep.has_canary,
        threshold=policy.failure_threshold,
    )
    new_incarnation = registration.incarnation != ep.incarnation
    dropped = bool(ep.registration.registered) and not registration.registered
    if new_incarnation or dropped:
        ep = replace(ep, registration=registration)
        return replace(
            ep,
            canary=proves_anew(ep, result.finished),
            progress=ProgressState(),
            # The sleep state of an engine that left is unknown; a declared window stands.
            lifecycle=lifecycle.new_incarnation(ep.lifecycle),
            discovery=DiscoveryState(),
            faults=FaultState(),  # a restarted engine may be started otherwise: asked again
            load=LoadState(),
        )
    return replace(ep, registration=registration)


def apply_discovery(
    ep: EndpointState, listed: bool | None, instance: str | None, at: float, where: str
) -> EndpointState:
    """A look at whether discovery lists the worker's instance. An instance that reappears after
    it went missing proves itself with a fresh canary before it is ready again."""
    before = ep.discovery
    after = on_discovery(before, listed, instance, at, where)
    canary = ep.canary
    if after.listed and before.listed is False and before.instance == after.instance:
        canary = proves_anew(ep, at)
    return replace(ep, discovery=after, canary=canary)


def apply_engine_health(
    ep: EndpointState,
    ready: bool | None,
    status: str | None,
    detail: str,
    at: float,
    status_code: int | None = None,
) -> EndpointState:
    """What the engine said of itself (where it is not the registration check)."""
    health = on_engine_health(ep.engine_health, ready, status, detail, at, status_code)
    return replace(ep, engine_health=health)


def apply_faults(
    ep: EndpointState,
    rank: int | None,
    report: EngineReport | None,
    at: float,
    *,
    missing: bool = False,
) -> EndpointState:
    """What the engine's fault-tolerance status says of this unit's rank. Into a pause
    (recovering), the canary's evidence ends, as a lifecycle pause ends it; back to healthy from
    a pause or a fault, a fresh canary proves the engine before it is ready again."""
    before = ep.faults
    after = on_fault_report(before, rank, report, at, missing=missing)
    canary = ep.canary
    if after.paused and not before.paused:
        canary = CanaryState(reason=f"{after.reason()}: no canary is sent")
    elif after.healthy and not before.healthy:
        canary = proves_anew(ep, at)
    return replace(ep, faults=after, canary=canary)


def apply_lifecycle(ep: EndpointState, after: LifecycleState, at: float) -> EndpointState:
    """Hand a new lifecycle state over. Pausing drops the canary's evidence (and its clocks);
    resuming sends a canary at once: the engine proves itself before it is ready again."""
    before = ep.lifecycle
    if before.paused == after.paused:
        return replace(ep, lifecycle=after)
    if after.paused:
        canary = CanaryState(reason="paused: no canary is sent")
    else:
        canary = proves_anew(ep, at)
    return replace(ep, lifecycle=after, canary=canary)


def judged(ep: EndpointState, result: Result, policy: Policy) -> Result:
    """The canary's result as the endpoint counts it: a passed canary with the wrong answer
    fails (SIDECAR_CANARY_CHECK_ANSWER)."""
    return check_answer(ep.canary, result, policy)


def apply_canary(
    ep: EndpointState,
    result: Result,
    incarnation: int,
    policy: Policy,
    *,
    baseline: ProgressSample | None = None,
    end: ProgressSample | None = None,
    cost: CanaryCost | None = None,
    suspected: bool = False,
) -> EndpointState:
    """Apply a canary's result; ``baseline`` and ``end`` are the metrics read just before it was
    sent and just after it timed out. Results from an older incarnation are dropped."""
    if incarnation != ep.incarnation or not ep.registration.registered:
        return ep
    if ep.lifecycle.paused or result.started < ep.lifecycle.changed_at:
        return ep  # sent before a pause began or ended: it says nothing about now
    if result.started < ep.faults.changed_at:
        return ep  # sent before the engine reported a fault, or its recovery: as a pause
    latest = ep.progress.latest
    if (
        baseline is None
        and latest is not None
        and result.started - policy.metrics_interval <= latest.at <= result.started
    ):
        # No read was taken as it left: the progress loop's last read before it stands in,
        # recent enough that progress it shows cannot predate the canary by more than one
        # interval (a read after it left would hide what moved meanwhile).
        baseline = latest
    evidence = TimeoutEvidence(
        foreign_progress(baseline, end, cost or CanaryCost()),
        end.in_flight if end is not None else None,
        suspected,
        ep.progress.quiet_since,
        result.finished - baseline.at if baseline is not None else 0.0,
        stepwise=end.stepwise if end is not None else ep.progress.stepwise,
        other_work=end is not None and _others_in_flight(end) > 0,
        moved_lately=ep.progress.moved_since(result.finished - policy.liveness_window),
        engine_stale=ep.load.stale,
    )
    return replace(ep, canary=on_canary(ep.canary, result, policy, evidence))


def _others_in_flight(sample: ProgressSample) -> float:
    """Requests in flight at a read besides the sidecar's own canaries then."""
    own = max(0, sample.canaries_sent - sample.canaries_done)
    return (sample.in_flight or 0.0) - own


def apply_sample(
    ep: EndpointState,
    sample: ProgressSample | None,
    why: str,
    spec: ProgressSpec,
    own: CanaryCost | None = None,
) -> EndpointState:
    return replace(ep, progress=on_sample(ep.progress, sample, why, spec, own))


def apply_load(ep: EndpointState, sample: LoadSample | None, why: str) -> EndpointState:
    """A read of the engine's own load report."""
    return replace(ep, load=on_load(ep.load, sample, why))


def apply_transfers(ep: EndpointState, sample: TransferSample | None) -> EndpointState:
    """A read of the KV-transfer counters. Kept across incarnations: it is about the peers."""
    return replace(ep, transfers=on_transfers(ep.transfers, sample))


def canary_due(ep: EndpointState, policy: Policy) -> float | None:
    """When the next canary may leave (monotonic); None while there is nothing to send.

    - Not registered, no canary for this role, paused (asleep, in maintenance, recovering from a
      fault the engine reports), or missing from discovery (there is no way to it): nothing.
    - The health route timed out, no progress excused it and no canary passed since: now (slow
      or frozen, the canary finds out), at most every ``retry``.
    - Work in flight and the counters quiet for ``policy.suspect_after``: a stall is suspected;
      a canary leaves now to confirm or clear it. If one already passed during this quiet spell,
      the engine serves while its requests wait on something outside it (a KV transfer from a
      prefill peer): the next one goes ``wait`` later, as on an idle engine.
    - Ready, no failure pending, work in flight and the counters advancing: held back (it would
      queue behind real work and prove nothing the counters do not).
    - Otherwise the schedule the canary source set: ``wait`` when ready, ``retry`` when not.
    """
    canary, progress = ep.canary, ep.progress
    if not ep.has_canary or not ep.registration.registered or canary.next_due is None:
        return None
    if ep.lifecycle.paused or ep.discovery.listed is False or ep.faults.paused:
        return None
    if _in_doubt(ep):
        assert ep.registration.last is not None
        due = min(canary.next_due, ep.registration.last.finished)
        if canary.last is not None:  # never closer than ``retry`` to the last one
            due = max(due, canary.last.started + policy.retry)
        return due
    if ep.load.stale_since is not None and not _passed_since(ep, ep.load.stale_since):
        due = min(canary.next_due, ep.load.stale_since)  # the engine's own stall hint
        if canary.last is not None:  # never closer than ``retry`` to the last one
            due = max(due, canary.last.started + policy.retry)
        return due
    suspect_at = progress.suspect_at(policy.suspect_after)
    if suspect_at is None:  # idle, or the load is unknown
        return canary.next_due
    if _passed_while_quiet(ep):
        return max(canary.next_due, (canary.last_pass_at or 0.0) + policy.wait)
    if canary.ready and not canary.failures:
        return suspect_at  # held back until the counters have been quiet too long
    due = min(canary.next_due, suspect_at)
    if canary.last is not None:  # never closer than ``retry`` to the last one
        due = max(due, canary.last.started + policy.retry)
    return due


def _in_doubt(ep: EndpointState) -> bool:
    """The health route timed out unexcused and no canary has passed since it was asked."""
    last, passed = ep.registration.last, ep.canary.last_pass_at
    if not ep.registration.doubt or last is None:
        return False
    return passed is None or passed < last.started


def _passed_since(ep: EndpointState, since: float) -> bool:
    passed = ep.canary.last_pass_at
    return passed is not None and passed >= since


def _passed_while_quiet(ep: EndpointState) -> bool:
    last_pass, quiet = ep.canary.last_pass_at, ep.progress.quiet_since
    return ep.progress.busy and last_pass is not None and quiet is not None and last_pass >= quiet


def suspected(ep: EndpointState, policy: Policy, now: float) -> bool:
    """A canary leaving now goes to confirm a stall suspicion: the metrics' (work in flight,
    counters quiet), or the engine's own (its load report says its sample is stale)."""
    if ep.load.stale_since is not None and not _passed_since(ep, ep.load.stale_since):
        return True
    return ep.progress.suspects_stall(policy.suspect_after, now) and not _passed_while_quiet(ep)


def parked(ep: EndpointState, policy: Policy, now: float) -> bool:
    """Work sits in flight without progress while the canary passes: the requests wait on
    something outside the engine (a decode worker waiting for a prefill peer's KV). Not on the
    first pass after a failure, until a metrics read after it still shows the work quiet: a
    frozen engine's first canary after it resumes passes before the read that shows its work
    moving again."""
    if not (ep.progress.suspects_stall(policy.suspect_after, now) and _passed_while_quiet(ep)):
        return False
    latest, passed = ep.progress.latest, ep.canary.last_pass_at
    read_since = latest is not None and passed is not None and latest.at > passed
    return ep.canary.successes >= 2 or read_since


def transfer_due(
    ep: EndpointState,
    others: Iterable[EndpointState],
    policy: Policy,
    interval: float,
    now: float,
) -> float | None:
    """When the next transfer probe may leave (monotonic); None while the engine is not
    registered or paused. Every ``interval`` (SIDECAR_KV_PROBE_INTERVAL) while it passes, every
    ``retry`` while failing or unproven, and at once (at most every ``retry``) when an endpoint's
    metrics (``others``) counted a failed transfer since the last probe started."""
    if not ep.registration.registered or ep.lifecycle.paused:
        return None
    last = ep.canary.last
    if last is None:
        return now
    passing = ep.canary.ready and not ep.canary.failures
    due = last.finished + (interval if passing else policy.retry)
    failed_since = any(
        other.transfers.recent and other.transfers.recent[-1][0] > last.started for other in others
    )
    if failed_since:
        due = min(due, max(last.finished, last.started + policy.retry))
    return due


def maintenance_due(endpoints: Iterable[EndpointState]) -> Maintenance | None:
    """The declared maintenance window that ends first, if any."""
    windows = [ep.lifecycle.maintenance for ep in endpoints if ep.lifecycle.maintenance]
    return min(windows, key=lambda m: m.until, default=None)
