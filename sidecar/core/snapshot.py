"""The state every reader reads, consistent with itself, and the two answers read from it.

A :class:`Snapshot` is immutable: the step (:mod:`sidecar.core.step`) makes a new one from the
one before, and the HTTP routes and the metrics read one per answer. Its verdicts are computed
when it is made (:func:`rebuilt`); only the worker's readiness and liveness are read at the
moment of the answer, since the stale rule and the liveness clocks depend on the time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from sidecar.core.endpoint import EndpointState, unit_name
from sidecar.core.evidence.policy import Policy
from sidecar.core.verdict import (
    Liveness,
    Readiness,
    StartingStatus,
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
    # The unit layout's rules: endpoints checked rank by rank once the ranks are counted (those
    # with a canary that can be pinned), and the incarnation whose ranks were last counted.
    per_rank: tuple[str, ...] = ()
    ranks_counted_for: int | None = None
    # Endpoints whose canary names the served model, learned from the engine; per unit, why it
    # could not be learned at the last try.
    model_wanted: tuple[str, ...] = ()
    model_why: Mapping[str, str] = field(default_factory=dict)
    told_ready: bool | None = None
    told_live: bool = True
    told_progress: Mapping[str, tuple[bool, str]] = field(default_factory=dict)  # per unit

    def incarnation(self) -> int:
        """The engine's incarnation, as its canary units see it (they share registration)."""
        return max((ep.incarnation for ep in self.endpoints.values() if ep.has_canary), default=0)

    def wants_model(self) -> list[str]:
        """The units whose canary needs the served model's name and that do not know it yet, or
        whose engine is not registered yet (a new incarnation may serve another model)."""
        return [
            unit
            for endpoint in self.model_wanted
            for unit in self.units.get(endpoint, ())
            if not self.endpoints[unit].registration.registered or self.models[unit] is None
        ]

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


@dataclass(frozen=True)
class UnitSpec:
    """One unit as the sidecar starts: its endpoint and rank, whether its role gets a canary and
    why, and the rules its endpoint follows."""

    endpoint: str
    rank: int | None
    has_canary: bool
    canary_why: str
    informs: bool = False  # kv_transfer: informs, gates readiness only when listed, never /live
    per_rank: bool = False  # checked rank by rank once the engine's ranks are counted
    wants_model: bool = False  # its canary names the served model, learned from the engine

    @property
    def unit(self) -> str:
        return unit_name(self.endpoint, self.rank)


def first_snapshot(
    specs: Iterable[UnitSpec],
    policy: Policy,
    now: float,
    *,
    model: str | None = None,
    listed: tuple[str, ...] = (),
    starting: StartingStatus = StartingStatus.NOTREADY,
    min_ready: int | None = None,
) -> Snapshot:
    """The snapshot the sidecar starts from: every unit unchecked."""
    specs = list(specs)
    units: dict[str, tuple[str, ...]] = {}
    for spec in specs:
        units[spec.endpoint] = (*units.get(spec.endpoint, ()), spec.unit)
    empty = Snapshot(
        endpoints={
            s.unit: EndpointState(s.unit, s.has_canary, s.canary_why, liveness=not s.informs)
            for s in specs
        },
        verdicts={},
        models={s.unit: model for s in specs},
        draining=False,
        heartbeat=now,
        policy=policy,
        listed=listed,
        starting=starting,
        units=units,
        min_ready=min_ready,
        rank_of={s.unit: s.rank for s in specs},
        informing=tuple(dict.fromkeys(s.endpoint for s in specs if s.informs)),
        per_rank=tuple(dict.fromkeys(s.endpoint for s in specs if s.per_rank)),
        model_wanted=tuple(dict.fromkeys(s.endpoint for s in specs if s.wants_model)),
    )
    return rebuilt(empty, now)


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
