"""The canary: a role-aware inference request, the only evidence that decides readiness.

Hysteresis: a ready endpoint turns notready after ``failure_threshold`` counted failures in a
row, a notready one ready after ``success_threshold`` passes. Every failure other than a timeout
(a malformed body, a wrong token count, a wrong answer, 4xx, 5xx, a refusal) counts, whatever the
engine's counters do. A timeout is weighed against the engine's progress measured around it:

- other work progressed meanwhile (beyond what the canary itself could move): the canary queued
  behind load; not counted;
- nothing progressed beyond what the canary could move, over a span the reads are sure to
  cover of at least half the timeout: the engine held work (the canary, at least) and did not
  compute; a hang confirmed by the metrics, notready at once, "stalled" when the canary was sent
  to confirm a stall suspicion;
- but where the engine publishes no counter that moves at every step (only counters that move
  as requests complete: an older SGLang, another server), quiet counters prove nothing while
  other requests are in flight: long requests leave them quiet on a healthy engine. Such a
  timeout is load, not counted, as long as a counter moved within the liveness window; after a
  whole window with none moving, it counts as an ordinary failure (a hang under load is still
  found, a window later);
- the metrics cannot tell: an ordinary failure; but where the engine's own load report says
  its sample is stale while requests are active (OpenEngine's GetLoad), the timeout of the
  canary sent to confirm it is a hang the engine itself saw: notready at once, "stalled".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sidecar.core.evidence.policy import Policy
from sidecar.core.evidence.result import Outcome, Result


@dataclass(frozen=True)
class TimeoutEvidence:
    """What the engine's metrics said about a canary that timed out."""

    foreign_progress: bool | None  # None: unknown (no readable metrics at both ends)
    in_flight: float | None = None  # requests the engine held at the end
    suspected: bool = False  # sent to confirm a stall suspicion
    quiet_since: float | None = None  # since when work sat without progress
    # Seconds the two reads are sure to span: from the baseline's answer to the canary's end. A
    # saturated engine's metrics route can answer late, and counters compared over a moment
    # prove nothing (vLLM's advance in bursts under load).
    span: float = 0.0
    # The engine publishes a counter that moves at every step (progress.ProgressSpec.per_step).
    stepwise: bool = True
    # Requests besides the sidecar's canaries were in flight at the end.
    other_work: bool = False
    # A counter moved within the liveness window before the canary ended.
    moved_lately: bool = False
    # The engine's own load report said its sample is stale while requests are active
    # (sidecar/core/evidence/load.py): the engine saw the stall itself.
    engine_stale: bool = False


NO_EVIDENCE = TimeoutEvidence(None)


@dataclass(frozen=True)
class CanaryState:
    """One incarnation's canary verdict. A (re)registered engine gets a fresh one."""

    ready: bool | None = None  # None: no counted result yet
    proven: bool = False  # a canary passed in this incarnation
    failures: int = 0  # consecutive counted failures, a true count
    # Notready on a confirmed hang, before the failures reached the threshold: the metrics (or
    # the engine's own load report) showed it held work and did not compute. Until a pass.
    confirmed: bool = False
    successes: int = 0
    last: Result | None = None
    reason: str = "no canary has run yet"
    hard_since: float | None = None  # liveness clock: unbroken run of hard failures
    stall_since: float | None = None  # liveness clock: a stall a canary confirmed
    last_pass_at: float | None = None  # monotonic
    last_success_wall: float | None = None
    next_due: float | None = None  # monotonic; None: nothing to send
    # The first passed canary's answer in this incarnation (SIDECAR_CANARY_CHECK_ANSWER).
    reference: str | None = None

    @property
    def stalled(self) -> bool:
        return self.stall_since is not None


def _hard(result: Result, proven: bool) -> bool:
    """A failure a restart could fix: a hang, a server error, or a rejection of the very canary
    that passed before in this incarnation (the engine changed: a Dynamo worker dropped from
    discovery answers 404). A canary rejected from the start is a configuration problem (the
    wrong canary for the role): a restart cannot fix it. Refusals and malformed bodies are not
    hard."""
    return result.outcome is Outcome.TIMEOUT or result.server_error or (result.rejected and proven)


def _shown(answer: str) -> str:
    return repr(answer if len(answer) <= 40 else answer[:37] + "...")


def check_answer(state: CanaryState, result: Result, policy: Policy) -> Result:
    """A passed canary whose answer differs from the first one of this incarnation is a wrong
    answer: greedy decoding of the same prompt is reproducible on a healthy engine. Counted like
    any failure (not hard: a restart reloads the same weights)."""
    if not (policy.check_answer and result.ok and result.answer is not None):
        return result
    if state.reference is None or result.answer == state.reference:
        return result
    return replace(
        result,
        outcome=Outcome.WRONG,
        reason=f"wrong answer: {_shown(result.answer)}, where this incarnation first answered "
        f"{_shown(state.reference)}",
    )


def on_canary(
    state: CanaryState, result: Result, policy: Policy, evidence: TimeoutEvidence = NO_EVIDENCE
) -> CanaryState:
    """One canary's result: a pass, a timeout that was load (not counted), or a failure."""
    if result.ok:
        return _passed(state, result, policy)
    load = _load(evidence) if result.outcome is Outcome.TIMEOUT else None
    if load is not None:
        return replace(
            state,
            last=result,
            reason=state.reason if state.ready else load,
            hard_since=None,
            stall_since=None,
            next_due=result.finished
            + (policy.wait if state.ready and not state.failures else policy.retry),
        )
    return _failed(state, result, policy, evidence)


def _passed(state: CanaryState, result: Result, policy: Policy) -> CanaryState:
    successes = state.successes + 1
    ready = bool(state.ready) or successes >= policy.success_threshold
    reason = f"canary passed in {result.latency * 1000:.0f} ms"
    if not ready:
        reason += f" ({successes} of {policy.success_threshold} passes needed)"
    return CanaryState(
        reference=state.reference
        if state.reference is not None or not policy.check_answer
        else result.answer,
        ready=ready,
        proven=True,
        successes=successes,
        last=result,
        reason=reason,
        last_pass_at=result.finished,
        last_success_wall=result.wall_time,
        next_due=result.finished + (policy.wait if ready else policy.retry),
    )


def _blind(evidence: TimeoutEvidence) -> bool:
    """Nothing moved while other requests were in flight, on an engine with no per-step counter:
    long requests leave such counters quiet on a healthy engine, so this proves nothing."""
    return evidence.foreign_progress is False and not evidence.stepwise and evidence.other_work


def _load(evidence: TimeoutEvidence) -> str | None:
    """Why a timeout is load and not counted, or None: the canary queued behind real work while
    the engine kept computing; or, blind, while its counters moved within the liveness window."""
    if evidence.foreign_progress:
        return "canary timed out behind other work while the engine progressed (not counted)"
    if _blind(evidence) and evidence.moved_lately:
        return (
            "canary timed out behind requests in flight; the engine publishes no per-step "
            "counter, so this is load while its counters moved within the liveness window (not "
            "counted)"
        )
    return None


def _failed(
    state: CanaryState, result: Result, policy: Policy, evidence: TimeoutEvidence
) -> CanaryState:
    failures = state.failures + 1
    ready = bool(state.ready) and failures < policy.failure_threshold
    reason = f"canary {result.outcome}: {result.reason}"
    stall_since = state.stall_since
    # The engine holds at least the canary itself: gauges published by the stuck loop (vLLM's
    # scheduler) freeze at what they said before, often 0.
    held = evidence.in_flight or 0.0
    confirmed = (
        result.outcome is Outcome.TIMEOUT
        and evidence.foreign_progress is False
        and not _blind(evidence)
        and evidence.span >= policy.timeout / 2
    )
    said_stale = result.outcome is Outcome.TIMEOUT and evidence.engine_stale and not confirmed
    confirmed_now = False
    if said_stale:
        # The engine said its own sample is stale under load, and the canary sent to confirm
        # it timed out: a hang the engine itself saw.
        ready, confirmed_now = False, True
        stall_since = result.started if stall_since is None else stall_since
        reason = (
            "stalled: the engine says its load sample is stale while requests are active, and "
            f"the canary sent to confirm timed out ({result.reason})"
        )
    elif confirmed:
        # The engine held work and nothing moved while the canary waited: a hang, confirmed.
        ready, confirmed_now = False, True
        if evidence.suspected:
            since = evidence.quiet_since if evidence.quiet_since is not None else result.started
            stall_since = since if stall_since is None else stall_since
            reason = (
                f"stalled: {max(held, 1):g} requests in flight and no engine progress for "
                f"{result.finished - since:.1f} s; the canary sent to confirm timed out "
                f"({result.reason})"
            )
        elif held:
            reason += f", with {held:g} requests in flight and no engine progress since it was sent"
        else:
            reason += ", and no engine progress since it was sent"
    elif ready:
        reason += f" ({failures} of {policy.failure_threshold} failures before notready)"
    hard = _hard(result, state.proven)
    hard_since = (
        (state.hard_since if state.hard_since is not None else result.started) if hard else None
    )
    return replace(
        state,
        ready=ready,
        failures=failures,
        confirmed=state.confirmed or confirmed_now,
        successes=0,
        last=result,
        reason=reason,
        hard_since=hard_since,
        stall_since=stall_since if hard else None,
        next_due=max(result.started + policy.retry, result.finished),
    )
