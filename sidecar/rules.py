"""The decision core: pure functions and immutable state, no I/O, no clock of their own.

Why did /health say 503? :func:`decide_readiness` (the one readiness rule) and
:func:`endpoint_verdict` (one endpoint's verdict) say so, with the reason they return.
Why did /live say 503? :func:`decide_liveness`. When is the next canary due?
:func:`on_canary` and :func:`on_registration` set ``next_canary_due``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from sidecar.config import StartingStatus
from sidecar.progress import ProgressSample


class Outcome(StrEnum):
    """A canary's outcome; the label values of health_sidecar_canary_total."""

    SUCCESS = "success"
    TIMEOUT = "timeout"  # no complete answer within the timeout: the engine hangs
    ERROR = "error"  # an HTTP error status, or the connection broke mid-answer
    REFUSED = "refused"  # nothing accepts connections: the engine is gone or not started
    INVALID = "invalid"  # 200, but the body is not a well-formed answer


class Probe(StrEnum):
    """How a registration check of the engine's own health route ended."""

    OK = "ok"  # 200: up with its model loaded
    STATUS = "status"  # another status: loading (503 "Loading model"), dead, draining
    TIMEOUT = "timeout"  # accepted the connection, did not answer in time: frozen
    REFUSED = "refused"  # nothing listening
    ERROR = "error"  # the connection broke


@dataclass(frozen=True)
class CanaryResult:
    outcome: Outcome
    reason: str
    started: float  # monotonic seconds
    finished: float  # monotonic seconds
    wall_time: float  # unix seconds at finish
    request_id: str
    status_code: int | None = None

    @property
    def latency(self) -> float:
        return self.finished - self.started

    @property
    def hard(self) -> bool:
        """A failure a restart could fix: the engine hangs, or fails with a server error.

        Refusals (the process is gone; the container runtime restarts it), 4xx answers (the
        canary is wrong, and a restart would not fix it: the DIS-1737 crash loop) and malformed
        bodies are not hard.
        """
        if self.outcome is Outcome.TIMEOUT:
            return True
        return self.outcome is Outcome.ERROR and (
            self.status_code is None or self.status_code >= 500
        )

    @property
    def rejected(self) -> bool:
        """The engine refused the request itself (4xx), other than for load (408, 429)."""
        code = self.status_code
        return (
            self.outcome is Outcome.ERROR
            and code is not None
            and 400 <= code < 500
            and code not in (408, 429)
        )


@dataclass(frozen=True)
class RegistrationResult:
    probe: Probe
    reason: str
    started: float
    finished: float

    @property
    def registered(self) -> bool:
        return self.probe is Probe.OK


@dataclass(frozen=True)
class Policy:
    """Thresholds and timings the transitions follow (from Settings)."""

    failure_threshold: int = 2
    success_threshold: int = 1
    wait: float = 10.0
    retry: float = 1.0
    liveness_window: float = 120.0
    stall_window: float = 5.0


@dataclass(frozen=True)
class EndpointState:
    """Everything known about one endpoint. Replaced, never mutated."""

    name: str
    has_canary: bool
    canary_why: str
    registered: bool = False
    registration: RegistrationResult | None = None
    incarnation: int = 0  # +1 each time the engine (re)registers; older canaries are dropped
    verdict_known: bool = False  # False until the first evidence; then DYN_SYSTEM_STARTING_* stops
    canary_ready: bool = False  # the canary's verdict, with hysteresis
    proven: bool = False  # a canary passed in this incarnation
    canary_reason: str = "no canary has run yet"
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    last_canary: CanaryResult | None = None
    last_success_wall: float | None = None
    next_canary_due: float | None = None  # monotonic; None: nothing to send until registered
    hard_failure_since: float | None = None  # monotonic start of an unbroken hard-failure run
    # From the engine's own metrics (None: not read, or not published).
    in_flight: float | None = None
    last_sample_at: float | None = None  # monotonic time of the last metrics read
    progress_total: float | None = None
    # The counters last advanced between two reads: after ``progress_after`` (the earlier read)
    # and by ``progress_seen`` (the later one). Monotonic; wall clock for display.
    progress_after: float | None = None
    progress_seen: float | None = None
    last_progress_wall: float | None = None
    quiet_since: float | None = None  # busy and no progress since then
    stalled: bool = False
    stalled_for: float = 0.0  # seconds without progress at the last read, while stalled


@dataclass(frozen=True)
class Verdict:
    ready: bool | None  # None: no verdict yet
    reason: str


def _first(since: float | None, now: float) -> float:
    return now if since is None else since


def on_registration(state: EndpointState, result: RegistrationResult) -> EndpointState:
    """Apply one check of the engine's own health route."""
    changes: dict[str, object] = {"registration": result, "registered": result.registered}
    if result.registered:
        if not state.registered:
            # A new incarnation (first start, restart, or back from a freeze) proves itself anew.
            changes |= {
                "incarnation": state.incarnation + 1,
                "canary_ready": False,
                "proven": False,
                "canary_reason": "registered; waiting for the first canary",
                "consecutive_failures": 0,
                "consecutive_successes": 0,
                "next_canary_due": result.finished if state.has_canary else None,
                # Its counters start again from zero; its stalls are not the old one's.
                "progress_total": None,
                "quiet_since": None,
                "stalled": False,
                "stalled_for": 0.0,
            }
        if not state.has_canary:
            changes |= {"verdict_known": True, "hard_failure_since": None}
    else:
        changes |= {"verdict_known": True, "next_canary_due": None}
        if result.probe is Probe.TIMEOUT:
            changes["hard_failure_since"] = _first(state.hard_failure_since, result.started)
        else:
            # Gone, loading or answering: not a hang. A restart would not help.
            changes["hard_failure_since"] = None
    return replace(state, **changes)  # type: ignore[arg-type]


def on_canary(
    state: EndpointState, result: CanaryResult, incarnation: int, policy: Policy
) -> EndpointState:
    """Apply one canary's result with hysteresis. Results from an older incarnation are dropped."""
    if incarnation != state.incarnation or not state.registered:
        return state
    if (
        result.outcome is Outcome.TIMEOUT
        and state.progress_after is not None
        and state.progress_after >= result.started
    ):
        # Queued behind work while the engine kept computing: busy, not hung.
        return replace(
            state,
            last_canary=result,
            next_canary_due=state.progress_after + policy.wait,
            canary_reason=state.canary_reason
            if state.canary_ready
            else "canary timed out behind work while the engine progressed (not counted)",
        )
    if result.outcome is Outcome.SUCCESS:
        successes = state.consecutive_successes + 1
        ready = state.canary_ready or successes >= policy.success_threshold
        reason = f"canary passed in {result.latency * 1000:.0f} ms"
        if not ready:
            reason += f" ({successes} of {policy.success_threshold} passes needed)"
        return replace(
            state,
            verdict_known=True,
            canary_ready=ready,
            proven=True,
            canary_reason=reason,
            consecutive_failures=0,
            consecutive_successes=successes,
            last_canary=result,
            last_success_wall=result.wall_time,
            next_canary_due=result.finished + (policy.wait if ready else policy.retry),
            hard_failure_since=None,
            quiet_since=None,
            stalled=False,
            stalled_for=0.0,
        )
    failures = state.consecutive_failures + 1
    ready = state.canary_ready and failures < policy.failure_threshold
    reason = f"canary {result.outcome}: {result.reason}"
    if ready:
        reason += f" ({failures} of {policy.failure_threshold} failures before notready)"
    # A rejection of the very canary that passed before in this incarnation means the engine
    # changed (a Dynamo worker dropped from discovery answers 404 for its model): a restart can
    # fix that. A canary rejected from the start is a configuration problem (DIS-1737): it can't.
    hard = result.hard or (result.rejected and state.proven)
    hard_since = _first(state.hard_failure_since, result.started) if hard else None
    failed = replace(
        state,
        verdict_known=True,
        canary_ready=ready,
        canary_reason=reason,
        consecutive_failures=failures,
        consecutive_successes=0,
        last_canary=result,
        next_canary_due=max(result.started + policy.retry, result.finished),
        hard_failure_since=hard_since,
    )
    return _corroborate(failed, policy)


def _corroborate(state: EndpointState, policy: Policy) -> EndpointState:
    """A canary timed out, and a read of the engine's metrics since it was sent shows work in
    flight and no counter advanced: not one slow canary but a stuck engine. The failure
    threshold, there to absorb a slow canary, does not apply."""
    last = state.last_canary
    if (
        not state.canary_ready
        or last is None
        or last.outcome is not Outcome.TIMEOUT
        or state.consecutive_failures == 0
        or not state.in_flight
        or state.last_sample_at is None
        or state.last_sample_at < last.started
        or (state.progress_seen is not None and state.progress_seen >= last.started)
    ):
        return state
    return replace(
        state,
        canary_ready=False,
        consecutive_failures=max(state.consecutive_failures, policy.failure_threshold),
        canary_reason=f"canary timeout: {last.reason}, with {state.in_flight:g} requests in "
        "flight and no engine progress since it was sent",
    )


def on_progress(
    state: EndpointState, sample: ProgressSample | None, policy: Policy, wall: float
) -> EndpointState:
    """Apply one read of the engine's metrics (None: it could not be read).

    Counters that advance prove health: a ready endpoint stays ready and its next canary is put
    off; a notready one turns ready, since real work just completed. Requests in flight with no
    counter advancing for ``policy.stall_window`` is a hang ("stalled"), found without queuing a
    canary behind the stuck work.
    """
    if sample is None:
        # Unknown load: canaries may go again. A stall stands until progress, a passed canary or
        # a new incarnation ends it (a stuck engine often cannot serve its metrics either).
        return replace(state, in_flight=None)
    previous = state.progress_total
    advanced = sample.counters is not None and previous is not None and sample.counters > previous
    busy = bool(sample.in_flight)
    changes: dict[str, object] = {
        "in_flight": sample.in_flight,
        "progress_total": sample.counters,
        "last_sample_at": sample.at,
    }
    if busy:
        quiet_since = sample.at if advanced or state.quiet_since is None else state.quiet_since
        stalled = not advanced and sample.at - quiet_since >= policy.stall_window
        changes |= {
            "quiet_since": quiet_since,
            "stalled": stalled,
            "stalled_for": sample.at - quiet_since if stalled else 0.0,
        }
    else:
        stalled = False
        changes |= {"quiet_since": None, "stalled": False}
    if stalled:
        changes["hard_failure_since"] = _first(state.hard_failure_since, quiet_since)
    elif state.stalled and not advanced:
        changes["hard_failure_since"] = None  # the work drained: no longer stuck
    if advanced:
        after = state.last_sample_at if state.last_sample_at is not None else sample.at
        changes |= {"progress_after": after, "progress_seen": sample.at, "last_progress_wall": wall}
        if state.registered:
            due = state.next_canary_due
            changes |= {
                "verdict_known": True,
                "canary_ready": True,
                "canary_reason": f"engine progressing ({sample.describe()}); counters advanced",
                "consecutive_failures": 0,
                "hard_failure_since": None,
                "next_canary_due": None if due is None else max(due, after + policy.wait),
            }
    return _corroborate(replace(state, **changes), policy)  # type: ignore[arg-type]


def canary_due(state: EndpointState) -> float | None:
    """When the next canary may go out; None while there is nothing to send: not registered, no
    canary, or work in flight (a canary would only queue behind it; the stall rule watches)."""
    if not state.has_canary or not state.registered or state.in_flight:
        return None
    return state.next_canary_due


def engine_disagrees(state: EndpointState) -> bool:
    """The engine's own health route says 200 while the canary or the stall rule says hung:
    the blind spot of vLLM's and TensorRT-LLM's /health."""
    if not state.registered:
        return False
    if state.stalled:
        return True
    last = state.last_canary
    return (
        state.has_canary
        and state.verdict_known
        and not state.canary_ready
        and last is not None
        and last.hard
    )


def endpoint_verdict(state: EndpointState) -> Verdict:
    """One endpoint's readiness: registered, and (when it has a canary) the canary's verdict."""
    if not state.verdict_known:
        return Verdict(None, "no verdict yet")
    if not state.registered:
        why = state.registration.reason if state.registration else "not checked yet"
        return Verdict(False, f"engine not registered: {why}")
    lie = "; the engine's own health route still answers 200" if engine_disagrees(state) else ""
    if state.stalled and state.quiet_since is not None:
        return Verdict(
            False,
            f"stalled: {state.in_flight or 0:g} requests in flight and no progress counter "
            f"advanced for {state.stalled_for:.1f} s{lie}",
        )
    if state.has_canary:
        return Verdict(
            state.canary_ready, state.canary_reason + ("" if state.canary_ready else lie)
        )
    return Verdict(True, f"registered; no canary ({state.canary_why})")


class Rule(StrEnum):
    """Which rule decided readiness; reported in /health as "rule"."""

    DRAINING = "draining"  # shutting down: SIGTERM received
    LISTED = "listed_endpoints"  # DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS is set
    MONITORED = "monitored_endpoints"
    STARTING = "starting_status"  # an endpoint had no verdict yet


RULE_TEXT = {
    Rule.DRAINING: "shutting down: notready while in-flight work drains",
    Rule.LISTED: "ready iff every endpoint in DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS is ready",
    Rule.MONITORED: "ready iff every monitored endpoint is ready",
    Rule.STARTING: "an endpoint has no verdict yet: DYN_SYSTEM_STARTING_HEALTH_STATUS decides",
}


@dataclass(frozen=True)
class Readiness:
    ready: bool
    rule: Rule
    reason: str


def decide_readiness(
    verdicts: Mapping[str, Verdict],
    listed: tuple[str, ...],
    starting: StartingStatus,
    *,
    draining: bool = False,
) -> Readiness:
    """The one readiness rule.

    The endpoints that count are those listed in DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS, or every
    monitored endpoint when the list is empty. The worker is ready iff each of them is ready. An
    endpoint with no verdict yet counts as DYN_SYSTEM_STARTING_HEALTH_STATUS says.
    """
    if draining:
        return Readiness(False, Rule.DRAINING, "draining: SIGTERM received")
    rule = Rule.LISTED if listed else Rule.MONITORED
    names = listed or tuple(verdicts)
    undecided = [n for n in names if verdicts[n].ready is None]
    failing = [n for n in names if verdicts[n].ready is False]
    if failing:
        return Readiness(False, rule, "; ".join(f"{n}: {verdicts[n].reason}" for n in failing))
    if undecided:
        ready = starting is StartingStatus.READY
        return Readiness(
            ready,
            Rule.STARTING,
            f"{', '.join(undecided)}: no verdict yet; DYN_SYSTEM_STARTING_HEALTH_STATUS={starting}",
        )
    return Readiness(True, rule, "; ".join(f"{n}: {verdicts[n].reason}" for n in names))


@dataclass(frozen=True)
class Liveness:
    live: bool
    reason: str


def decide_liveness(states: Mapping[str, EndpointState], now: float, window: float) -> Liveness:
    """Live unless an endpoint has failed hard, without a break, for at least ``window`` seconds.

    Starting, loading, refusing connections, being busy or failing readiness briefly never
    fails liveness: restarting a worker that is loading its model is a crash loop.
    """
    for name, state in states.items():
        since = state.hard_failure_since
        if since is not None and now - since >= window:
            last = state.canary_reason if state.registered else endpoint_verdict(state).reason
            return Liveness(
                False,
                f"{name}: hard failure for {now - since:.1f} s (window {window:g} s): {last}",
            )
    hung = {
        n: now - s.hard_failure_since for n, s in states.items() if s.hard_failure_since is not None
    }
    if hung:
        detail = ", ".join(f"{n} for {t:.1f} s" for n, t in hung.items())
        return Liveness(True, f"failing hard ({detail}), within the {window:g} s window")
    return Liveness(True, "no sustained hard failure")
