"""Lifecycle: the engine is deliberately not serving, so it is neither probed nor restarted.

Two pauses, each from its own signal:

- **sleep**: the engine says it sleeps (vLLM's ``GET /is_sleeping`` with its development routes
  on, or its ``vllm:engine_sleep_state`` gauge). A request sent to a sleeping vLLM is held until
  it wakes, so a canary would only time out: none is sent.
- **maintenance**: an operator or a training loop (updating weights between RL steps) declared a
  window through the sidecar's loopback control route. It ends by itself at its deadline (the
  monitor ends it then, so the change is logged like any other), or earlier when ended.

While either holds, the endpoint is notready with the pause as its reason, every liveness clock
stops, and no canary leaves. A pause ends the canary's evidence: the engine may come back with
other weights or lost state, so it proves itself with a fresh canary before it is ready again.
The sleep state is only asked of an engine whose backend has a sleep route; a 404 there means
the engine serves none (vLLM without ``VLLM_SERVER_DEV_MODE``), and it is not asked again in
this incarnation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sidecar.core.evidence.progress import Exposition, MetricsUnreadable, Series, matching


@dataclass(frozen=True)
class Maintenance:
    """A declared window: notready, live, no canaries, until ``until`` (monotonic)."""

    reason: str
    since: float  # monotonic
    until: float  # monotonic
    since_wall: float  # unix seconds, for people


@dataclass(frozen=True)
class LifecycleState:
    # What the engine's sleep route said last: True, False, or None (not asked, no answer).
    route_sleeping: bool | None = None
    # What the engine's sleep-state gauge said last (None: absent or not read).
    gauge_sleeping: bool | None = None
    sleep_why: str = ""
    sleep_route_missing: bool = False  # it answered 404: not asked again in this incarnation
    maintenance: Maintenance | None = None
    changed_at: float = float("-inf")  # monotonic: when a pause last began or ended

    @property
    def sleeping(self) -> bool:
        return bool(self.route_sleeping or self.gauge_sleeping)

    @property
    def paused(self) -> bool:
        return self.sleeping or self.maintenance is not None

    def reason(self, now: float) -> str | None:
        """Why the engine is paused, or None."""
        m = self.maintenance
        if m is not None:
            return f"maintenance: {m.reason} (ends in {max(0.0, m.until - now):.0f} s)"
        if self.sleeping:
            return f"sleeping ({self.sleep_why}); no canary is sent to a sleeping engine"
        return None


def _moved(before: LifecycleState, after: LifecycleState, at: float) -> LifecycleState:
    """Stamp the time when the state went from running to paused or back."""
    if before.paused != after.paused:
        return replace(after, changed_at=at)
    return after


def on_sleep_route(
    state: LifecycleState, sleeping: bool | None, why: str, at: float, *, missing: bool = False
) -> LifecycleState:
    """The engine's sleep route answered ``sleeping`` (None: no usable answer; ``missing``: 404)."""
    after = replace(
        state,
        route_sleeping=sleeping,
        sleep_route_missing=missing,
        sleep_why=why if sleeping else state.sleep_why,
    )
    return _moved(state, after, at)


def on_sleep_gauge(
    state: LifecycleState, sleeping: bool | None, why: str, at: float
) -> LifecycleState:
    """A metrics read found the sleep-state gauge saying ``sleeping`` (None: not published)."""
    after = replace(state, gauge_sleeping=sleeping, sleep_why=why if sleeping else state.sleep_why)
    return _moved(state, after, at)


def start_maintenance(
    state: LifecycleState, reason: str, seconds: float, at: float, wall: float
) -> LifecycleState:
    """Declare (or replace) a maintenance window of ``seconds`` from ``at``."""
    after = replace(state, maintenance=Maintenance(reason, at, at + seconds, wall))
    return _moved(state, after, at)


def end_maintenance(state: LifecycleState, at: float) -> LifecycleState:
    return _moved(state, replace(state, maintenance=None), at)


def new_incarnation(state: LifecycleState) -> LifecycleState:
    """An engine that left or restarted: its sleep state is unknown, its sleep route is asked
    again; a declared window stands."""
    return replace(state, route_sleeping=None, gauge_sleeping=None, sleep_route_missing=False)


def sleeping_in(text: str | Exposition, awake: tuple[Series, ...]) -> tuple[bool | None, str]:
    """Whether a metrics exposition says the engine sleeps: one of its ``awake`` series (one per
    data-parallel rank) at 0. None when none is published."""
    if not awake:
        return None, ""
    try:
        samples = matching(text, awake)
    except MetricsUnreadable:
        return None, ""
    seen = bool(samples)
    asleep = [
        f"engine {sample.labels['engine']}" if "engine" in sample.labels else ""
        for _, sample in samples
        if sample.value == 0
    ]
    if not seen:
        return None, ""
    what = ", ".join(filter(None, asleep))
    return bool(asleep), f"{awake[0]} is 0" + (f" ({what})" if what else "")
