"""KV transfers: how the transfers from this worker's prefill peers fare, from its own metrics.

A decode worker depends on its prefill peers, and when a peer dies or freezes nobody says so:
vLLM's decode answers the affected requests 500 (peer killed, or frozen before the handshake) or
leaves them waiting with no server-side timeout (frozen after it), while every /health says 200.
vLLM counts what its NIXL connector saw on the decode side: failed transfers, failed
notifications, KV blocks the prefill released before they were read; and gauges the requests
per fetch stage.

What this source may do: say in /health and the metrics that transfers fail, attributed to the
peer side. What it may not do: change a verdict or start a liveness clock. The decode worker
itself still serves (its local canary passes); restarting it would fix nothing and crash-loop
it. The failures are counted over a sliding window, so the note ends by itself once the
peers are healthy again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sidecar.core.evidence.progress import Exposition, MetricsUnreadable, Series, group_totals

# How long a failure keeps "transfers failing" in /health.
WINDOW = 60.0


@dataclass(frozen=True)
class TransferSpec:
    """Which samples count failed transfers (kind -> counters) and requests fetching KV now."""

    failures: Mapping[str, tuple[Series, ...]]
    fetching: tuple[Series, ...] = ()

    def every(self) -> tuple[Series, ...]:
        """Every series the spec reads."""
        return (*(s for g in self.failures.values() for s in g), *self.fetching)

    def scoped(self, label: str | None, value: str) -> TransferSpec:
        """Every series restricted to one value of ``label`` (one data-parallel rank)."""
        if label is None:
            return self
        return TransferSpec(
            {k: tuple(s.scoped(label, value) for s in g) for k, g in self.failures.items()},
            tuple(s.scoped(label, value) for s in self.fetching),
        )


@dataclass(frozen=True)
class TransferSample:
    at: float  # monotonic
    wall: float
    failures: Mapping[str, float]  # kind -> counter total, for the kinds published
    fetching: float | None = None


@dataclass(frozen=True)
class TransferState:
    latest: TransferSample | None = None
    # (monotonic time, kind, count) of the failures seen within the window.
    recent: tuple[tuple[float, str, float], ...] = ()
    counted: Mapping[str, float] = field(default_factory=dict)  # kind -> total since start
    last_failure_wall: float | None = None

    @property
    def published(self) -> bool:
        return self.latest is not None and bool(self.latest.failures)

    def in_window(self, now: float) -> dict[str, float]:
        """kind -> failures seen within the window before ``now``."""
        found: dict[str, float] = {}
        for at, kind, count in self.recent:
            if now - at <= WINDOW:
                found[kind] = found.get(kind, 0.0) + count
        return found

    def failing(self, now: float) -> bool:
        return bool(self.in_window(now))

    def note(self, now: float) -> str:
        """The note /health adds to the reason while transfers fail, or ""."""
        found = self.in_window(now)
        if not found:
            return ""
        counts = ", ".join(f"{n:g} {kind.replace('_', ' ')}" for kind, n in sorted(found.items()))
        return (
            f"; KV transfers from prefill peers failing: {counts} in the last {WINDOW:g} s "
            "(the peer side: this worker serves its own requests)"
        )


def read_transfers(
    text: str | Exposition, spec: TransferSpec, at: float, wall: float
) -> TransferSample | None:
    """The spec's samples in a metrics exposition; None when it publishes none of them."""
    try:
        totals, _ = group_totals(text, {**spec.failures, "fetching": spec.fetching})
    except MetricsUnreadable:
        return None
    fetching = totals.pop("fetching", None)
    if not totals and fetching is None:
        return None
    return TransferSample(at, wall, totals, fetching)


def on_transfers(state: TransferState, sample: TransferSample | None) -> TransferState:
    """Apply one read. A counter that went down was reset (the engine restarted): its new value
    is the base, not a failure."""
    if sample is None:
        return TransferState(None, state.recent, state.counted, state.last_failure_wall)
    before = state.latest
    recent = [r for r in state.recent if sample.at - r[0] <= WINDOW]
    counted = dict(state.counted)
    last_wall = state.last_failure_wall
    if before is not None:
        for kind, total in sample.failures.items():
            delta = total - before.failures.get(kind, total)
            if delta > 0:
                recent.append((sample.at, kind, delta))
                counted[kind] = counted.get(kind, 0.0) + delta
                last_wall = sample.wall
    return TransferState(sample, tuple(recent), counted, last_wall)
