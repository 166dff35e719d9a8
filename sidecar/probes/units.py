"""Which plan each unit follows, and which units each of the engine's routes is asked for: pure
functions of the snapshot's unit layout (:class:`~sidecar.core.snapshot.Snapshot`) and the
endpoints' plans.

A unit is an endpoint, or one data-parallel rank of it; the snapshot holds the layout (its
``units`` and ``rank_of``, changed only by the step), the plans are fixed at start, one per
endpoint. A rank's plan is its endpoint's, pinned to the rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from sidecar.core.snapshot import Snapshot, UnitSpec
from sidecar.probes.base import CanaryPlan


def unit_specs(plans: Iterable[CanaryPlan], *, ranks: int, model: str | None) -> list[UnitSpec]:
    """The units the sidecar starts with: each endpoint, or each of its ``ranks`` (a count the
    configuration fixed) when its canary can be pinned to one; ``model``: SIDECAR_MODEL."""
    specs = []
    for plan in plans:
        pinned = plan.is_canary
        wants = plan.wants_model
        for rank in range(ranks) if pinned and ranks > 1 else [None]:
            specs.append(
                UnitSpec(
                    plan.endpoint,
                    rank,
                    plan.enabled,
                    plan.why,
                    informs=not pinned,
                    per_rank=pinned,
                    wants_model=wants and model is None,
                )
            )
    return specs


def plans_of(snap: Snapshot, plans: Mapping[str, CanaryPlan]) -> dict[str, CanaryPlan]:
    """Each unit's plan (unit -> plan), from its endpoint's (``plans``: endpoint -> plan)."""
    return {
        unit: replace(plans[endpoint], rank=snap.rank_of.get(unit))
        for endpoint, units in snap.units.items()
        for unit in units
    }


@dataclass(frozen=True)
class Asks:
    """The engine's routes to ask with a registration check, each once for the units it serves
    (path -> units): its sleep route and its fault-tolerance status."""

    sleep: Mapping[str, tuple[str, ...]]
    faults: Mapping[str, tuple[str, ...]]


def asks(snap: Snapshot, plans: Mapping[str, CanaryPlan]) -> Asks:
    """Which units each route is asked for now: a registered unit whose plan reads the route
    (its transport resolved whether it can); not again once the route was found missing (404) in
    this incarnation. The fault-tolerance status is a canary unit's (the transfer probe has no
    rank to report on)."""
    sleep: dict[str, tuple[str, ...]] = {}
    faults: dict[str, tuple[str, ...]] = {}
    for unit, plan in plans_of(snap, plans).items():
        ep = snap.endpoints[unit]
        if not ep.registration.registered:
            continue
        path = plan.reads.sleep_path
        if path and not ep.lifecycle.sleep_route_missing:
            sleep[path] = (*sleep.get(path, ()), unit)
        path = plan.reads.fault_path
        if path and plan.is_canary and not ep.faults.missing:
            faults[path] = (*faults.get(path, ()), unit)
    return Asks(sleep, faults)
