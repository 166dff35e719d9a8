"""The engine's own report of its load, where it gives one (OpenEngine's ``GetLoad``): the
requests it runs and queues, and whether it says its own scheduler sample is stale while
requests are active (TensorRT-LLM answers UNAVAILABLE when that sample is over 30 s old).

A hint, never a verdict, and a source of its own: it is shown; a report that the engine's
sample is stale makes a canary leave at once to confirm it (as a stall suspicion does), and a
timeout of a canary sent while the engine says so is a hang the engine itself saw (notready at
once, "stalled", the stall clock: ``sidecar/core/evidence/canary.py``). It never holds a canary
back and never excuses a timeout: without a counter that moves, running requests cannot tell
busy from stuck.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.core.evidence.progress import Exposition, Series, group_totals


@dataclass(frozen=True)
class LoadSpec:
    """Which samples of the engine's report say what."""

    running: tuple[Series, ...]
    queued: tuple[Series, ...]
    stale: tuple[Series, ...]  # > 0: the engine says its own sample is stale under load

    def every(self) -> tuple[Series, ...]:
        return (*self.running, *self.queued, *self.stale)


@dataclass(frozen=True)
class LoadSample:
    at: float  # monotonic
    running: float | None
    queued: float | None
    stale: bool


@dataclass(frozen=True)
class LoadState:
    latest: LoadSample | None = None
    stale_since: float | None = None  # the engine says its sample is stale, since then
    why: str = "not read yet"

    @property
    def stale(self) -> bool:
        return self.stale_since is not None


def read_load(source: str | Exposition, spec: LoadSpec, at: float) -> LoadSample:
    """The report's numbers. Raises MetricsUnreadable."""
    totals, _ = group_totals(
        source, {"running": spec.running, "queued": spec.queued, "stale": spec.stale}
    )
    return LoadSample(at, totals.get("running"), totals.get("queued"), totals.get("stale", 0) > 0)


def on_load(state: LoadState, sample: LoadSample | None, why: str) -> LoadState:
    """One read of the report (None: it could not be read; ``why`` says why, and the stale hint
    ends: an engine that does not answer is the registration check's and the canary's)."""
    if sample is None:
        return LoadState(state.latest, None, why)
    since = (state.stale_since or sample.at) if sample.stale else None
    return LoadState(sample, since, why)
