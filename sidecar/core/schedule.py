"""When each piece of the monitor's work is next due: one pure function, :func:`next_due`.

The monitor (:mod:`sidecar.runtime.monitor`) is one loop: it asks :func:`next_due`, starts what
is due, and waits for the earliest of the rest or for an observation. The rules:

- Engine-level work, done once per engine and fanned out to its units: the registration check
  every SIDECAR_REGISTRATION_INTERVAL, the metrics read every SIDECAR_METRICS_INTERVAL (when the
  progress source is on; every ``Policy.busy_metrics_interval`` while a unit has work in flight
  and a counter that moves at every step, so that a stall is seen within the stall window),
  counting the data-parallel ranks every registration interval until they are counted for the
  engine's incarnation (SIDECAR_DP_RANKS=auto).
- The heartbeat every :data:`~sidecar.core.verdict.HEARTBEAT_INTERVAL`; the end of a declared
  maintenance window at its deadline.
- Per unit, its probe: the canary when :func:`~sidecar.core.endpoint.canary_due` says, the
  transfer probe when :func:`~sidecar.core.endpoint.transfer_due` says.
- Work still in flight is never due: never two canaries (or two reads of one kind) at once.
  Periodic work is due one interval after it last started, or at once if it took longer.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum

from sidecar.core.endpoint import canary_due, maintenance_due, transfer_due
from sidecar.core.snapshot import Snapshot
from sidecar.core.verdict import HEARTBEAT_INTERVAL


class Job(StrEnum):
    HEARTBEAT = "heartbeat"
    MAINTENANCE = "maintenance"  # end the declared window
    REGISTRATION = "registration"  # the engine's own health route (and its sleep route)
    METRICS = "metrics"  # the engine's metrics: progress, transfers, sleep gauge
    RANKS = "ranks"  # count the data-parallel ranks
    CANARY = "canary"  # one unit's canary
    TRANSFER = "transfer"  # one unit's transfer probe


@dataclass(frozen=True, order=True)
class Work:
    """One piece of work: a job, for one unit ("" for the engine's or the worker's)."""

    job: Job
    unit: str = ""


@dataclass(frozen=True)
class Timing:
    registration: float  # SIDECAR_REGISTRATION_INTERVAL
    metrics: float | None  # SIDECAR_METRICS_INTERVAL; None: the metrics are not read
    transfer: float  # SIDECAR_KV_PROBE_INTERVAL
    count_ranks: bool = False  # SIDECAR_DP_RANKS=auto: counted once per incarnation


def next_due(
    snap: Snapshot,
    probes: Mapping[str, Job | None],
    timing: Timing,
    started: Mapping[Work, float],
    running: Collection[Work],
    now: float,
) -> dict[Work, float | None]:
    """Each piece of work and when it is next due (monotonic; None: not now, nor at any time the
    clock alone brings). ``probes``: each unit's probe (CANARY, TRANSFER, or None for a unit
    without one); ``started``: when each piece of work last started."""

    def every(work: Work, interval: float) -> float:
        last = started.get(work)
        return now if last is None else last + interval

    due: dict[Work, float | None] = {
        Work(Job.HEARTBEAT): every(Work(Job.HEARTBEAT), HEARTBEAT_INTERVAL),
        Work(Job.REGISTRATION): every(Work(Job.REGISTRATION), timing.registration),
    }
    window = maintenance_due(snap.endpoints.values())
    due[Work(Job.MAINTENANCE)] = window.until if window is not None else None
    if timing.metrics is not None:
        busy = any(ep.progress.busy and ep.progress.stepwise for ep in snap.endpoints.values())
        interval = timing.metrics
        if busy:
            interval = min(interval, snap.policy.busy_metrics_interval)
        due[Work(Job.METRICS)] = every(Work(Job.METRICS), interval)
    if timing.count_ranks and snap.ranks_counted_for != snap.incarnation():
        due[Work(Job.RANKS)] = every(Work(Job.RANKS), timing.registration)
    for unit, job in probes.items():
        ep = snap.endpoints[unit]
        if job is Job.CANARY:
            due[Work(job, unit)] = canary_due(ep, snap.policy)
        elif job is Job.TRANSFER:
            others = snap.endpoints.values()
            due[Work(job, unit)] = transfer_due(ep, others, snap.policy, timing.transfer, now)
    for work in running:
        if work in due:
            due[work] = None
    return due
