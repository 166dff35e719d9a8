"""The state every reader reads, consistent with itself, and the two answers read from it.

A :class:`Snapshot` is immutable: the step (:mod:`sidecar.core.step`) makes a new one from the
one before, and the HTTP routes and the metrics read one per answer. Its verdicts are computed
when it is made (:func:`rebuilt`); only the worker's readiness and liveness are read at the
moment of the answer, since the stale rule and the liveness clocks depend on the time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from sidecar.config import StartingStatus
from sidecar.core.endpoint import EndpointState
from sidecar.core.evidence.policy import Policy
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


@dataclass(frozen=True)
class Snapshot:
    """Everything a reader needs, consistent with itself.

    ``endpoints`` and ``verdicts`` are per unit: an endpoint ("generate"), or one data-parallel
    rank of it ("generate/rank1"); ``endpoint_verdicts`` per endpoint, its ranks combined.
    The ``told_*`` fields are what the log last said, so that a change is said once."""

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
    told_ready: bool | None = None
    told_live: bool = True
    told_progress: Mapping[str, tuple[bool, str]] = field(default_factory=dict)  # per unit

    def ranked(self, endpoint: str) -> bool:
        """The endpoint is checked rank by rank."""
        units = self.units.get(endpoint, ())
        return units != (endpoint,)

    def endpoint_of(self, unit: str) -> str:
        return next(e for e, members in self.units.items() if unit in members)

    def stale_for(self, now: float) -> float | None:
        """Seconds the monitor has been silent, when that is too long; else None."""
        return monitor_silent(self.heartbeat, now)

    @property
    def engine_gone(self) -> bool:
        """Every endpoint's last registration check found nothing listening."""
        return all(ep.registration.gone for ep in self.endpoints.values())


def rebuilt(
    snap: Snapshot,
    now: float,
    *,
    endpoints: Mapping[str, EndpointState] | None = None,
    models: Mapping[str, str | None] | None = None,
    draining: bool | None = None,
) -> Snapshot:
    """The snapshot with new states (and the verdicts they make), stamped ``now``."""
    endpoints = dict(snap.endpoints if endpoints is None else endpoints)
    verdicts = {n: endpoint_verdict(ep, snap.policy, now) for n, ep in endpoints.items()}
    return replace(
        snap,
        endpoints=endpoints,
        verdicts=verdicts,
        models=dict(snap.models if models is None else models),
        draining=snap.draining if draining is None else draining,
        heartbeat=now,
        endpoint_verdicts=endpoint_verdicts(snap.units, verdicts, snap.min_ready),
    )


def readiness_of(snap: Snapshot, now: float) -> Readiness:
    """/health's answer."""
    return worker_readiness(
        snap.endpoint_verdicts,
        snap.listed,
        snap.starting,
        draining=snap.draining,
        informing=snap.informing,
        silent=snap.stale_for(now),
    )


def liveness_of(snap: Snapshot, now: float) -> Liveness:
    """/live's answer."""
    return worker_liveness(snap.endpoints, now, snap.policy.liveness_window, snap.stale_for(now))
