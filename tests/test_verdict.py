"""The decision core as tables: each evidence source's transitions, the verdict table, liveness,
and the canary's schedule. Pure functions, no I/O, no clock of their own."""

from __future__ import annotations

import gzip
import math
from dataclasses import replace

import pytest

from sidecar.core.endpoint import (
    EndpointState,
    apply_canary,
    apply_faults,
    apply_registration,
    apply_sample,
    canary_due,
    parked,
    suspected,
)
from sidecar.core.evidence.canary import CanaryState, TimeoutEvidence, on_canary
from sidecar.core.evidence.faults import EngineReport, read_status, report_for, reports_in
from sidecar.core.evidence.policy import Policy
from sidecar.core.evidence.progress import (
    COMPLETED,
    GENERATION,
    PROMPT,
    STEPS,
    CanaryCost,
    ProgressSample,
    ProgressState,
    foreign_progress,
    on_sample,
    read_progress,
    unusable,
)
from sidecar.core.evidence.registration import RegistrationState, on_registration
from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.verdict import (
    HEARTBEAT_STALE,
    Cause,
    Rule,
    Verdict,
    clocks,
    decide_liveness,
    decide_readiness,
    endpoint_verdict,
    endpoint_verdicts,
    engine_disagrees,
    monitor_silent,
    worker_liveness,
    worker_readiness,
)
from sidecar.core.vocabulary import StartingStatus
from sidecar.runtime.engine import BadEncoding, BodyTooLarge, _decode
from tests.support.tables import COST, POLICY, SPEC

pytestmark = pytest.mark.unit


def result(outcome: Outcome, at: float = 0.0, latency: float = 0.01, status: int | None = None):
    if status is None and outcome is Outcome.ERROR:
        status = 500
    if outcome is Outcome.SUCCESS:
        status = 200
    return Result(outcome, f"{outcome}", at, at + latency, 1e9 + at, "canary-x", status)


def sample(at: float, in_flight: float | None, total: float = 0.0, **counters: float):
    values = {PROMPT: total, GENERATION: total} | counters
    return ProgressSample(at, 1e9 + at, in_flight, values, stepwise=True)


def registered(has_canary: bool = True, at: float = 0.0) -> EndpointState:
    ep = EndpointState("generate", has_canary, "why")
    return apply_registration(ep, result(Outcome.SUCCESS, at), POLICY)


def passed(ep: EndpointState, at: float = 0.0) -> EndpointState:
    return apply_canary(ep, result(Outcome.SUCCESS, at), ep.incarnation, POLICY)


# --- the verdict table ----------------------------------------------------------------------------
def _verdict_rows():
    fresh = EndpointState("generate", True, "why")
    down = apply_registration(fresh, result(Outcome.ERROR, status=503), POLICY)
    ready = passed(registered())
    failing = ready
    for at in (1.0, 2.0):
        failing = apply_canary(failing, result(Outcome.INVALID, at), failing.incarnation, POLICY)
    unhealthy = apply_faults(ready, 0, EngineReport("unhealthy", "RuntimeError"), 3.0)
    recovering = apply_faults(ready, 1, EngineReport("recovering"), 3.0)
    return [
        ("not checked", fresh, None, "not checked yet"),
        (
            "registered, the engine reports a fault",
            unhealthy,
            False,
            "vLLM fault tolerance: engine 0 reports unhealthy (RuntimeError)",
        ),
        (
            "registered, the engine recovers",
            recovering,
            False,
            "vLLM fault tolerance: engine 1 reports recovering",
        ),
        ("deregistered (503)", down, False, "engine not registered: "),
        ("registered, no canary", registered(has_canary=False), True, "registered; no canary"),
        ("registered, no result yet", registered(), None, "registered; waiting for the first"),
        ("registered, canary ready", ready, True, "canary passed in 10 ms"),
        ("registered, canary notready", failing, False, "canary invalid: invalid"),
    ]


@pytest.mark.parametrize(
    ("ep", "ready", "reason"), [r[1:] for r in _verdict_rows()], ids=[r[0] for r in _verdict_rows()]
)
def test_verdict_table(ep, ready, reason):
    verdict = endpoint_verdict(ep, POLICY, 10.0)
    assert verdict.ready is ready
    assert verdict.reason.startswith(reason)


def test_a_role_without_canary_is_never_judged_by_progress():
    ep = registered(has_canary=False)
    for t in range(30):  # work in flight, counters frozen, for 30 s
        ep = apply_sample(ep, sample(float(t), 3, 100.0), "", SPEC)
    assert endpoint_verdict(ep, POLICY, 30.0) == Verdict(True, "registered; no canary (why)")
    assert decide_liveness({"generate": ep}, 30.0, POLICY.liveness_window).live


# --- the canary source ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("outcomes", "ready"),
    [
        (["success"], True),
        (["success", "timeout"], True),  # one failure: 1 of 2
        (["success", "timeout", "timeout"], False),
        (["success", "invalid", "invalid"], False),
        (["success", "timeout", "success", "timeout"], True),  # not consecutive
        (["error"], False),  # unproven: no benefit of the doubt
        (["timeout", "success"], True),
    ],
)
def test_canary_hysteresis(outcomes, ready):
    state = CanaryState()
    for i, name in enumerate(outcomes):
        state = on_canary(state, result(Outcome(name), float(i)), POLICY)
    assert state.ready is ready


# A timeout weighed against the engine's progress around it.
@pytest.mark.parametrize(
    ("evidence", "counted", "ready", "stalled"),
    [
        (TimeoutEvidence(True, 3, span=0.5), False, True, False),  # queued behind progress
        (TimeoutEvidence(None), True, True, False),  # metrics unknown: 1 of 2
        # No progress over the canary's life: it was held (the gauges may say 0: vLLM's freeze
        # with the loop that publishes them): hung at once.
        (TimeoutEvidence(False, 0, span=0.5), True, False, False),
        (TimeoutEvidence(False, 1, span=0.5), True, False, False),
        # The same over a moment (the baseline read answered late): proves nothing, 1 of 2.
        (TimeoutEvidence(False, 4, span=0.2), True, True, False),
        (TimeoutEvidence(False, 2, suspected=True, quiet_since=1.0, span=0.5), True, False, True),
    ],
)
def test_a_timeout_is_weighed_against_progress(evidence, counted, ready, stalled):
    state = on_canary(CanaryState(), result(Outcome.SUCCESS), POLICY)
    after = on_canary(state, result(Outcome.TIMEOUT, 5.0, 0.5), POLICY, evidence)
    assert (after.failures >= 1) is counted
    assert after.ready is ready
    assert after.stalled is stalled
    assert (after.hard_since is not None) is counted


@pytest.mark.parametrize("outcome", [Outcome.INVALID, Outcome.ERROR, Outcome.REFUSED])
def test_progress_never_excuses_a_failure_other_than_a_timeout(outcome):
    state = on_canary(CanaryState(), result(Outcome.SUCCESS), POLICY)
    for at in (1.0, 2.0):
        state = on_canary(state, result(outcome, at), POLICY, TimeoutEvidence(True, 5))
    assert state.ready is False
    assert state.failures == 2


@pytest.mark.parametrize(
    ("proven", "status", "hard"),
    [(False, 400, False), (True, 404, True), (True, 429, False), (False, 500, True)],
)
def test_rejections_are_hard_only_after_the_canary_passed(proven, status, hard):
    state = on_canary(CanaryState(), result(Outcome.SUCCESS), POLICY) if proven else CanaryState()
    after = on_canary(state, result(Outcome.ERROR, 1.0, status=status), POLICY)
    assert (after.hard_since is not None) is hard


# --- what one canary may move by itself -----------------------------------------------------------
@pytest.mark.parametrize(
    ("moved", "foreign"),
    [
        ({}, False),
        ({PROMPT: 8}, False),  # counted on arrival: the canary's own prompt
        ({PROMPT: 8, GENERATION: 1, STEPS: 2, COMPLETED: 1}, False),  # the canary, whole
        ({PROMPT: 17}, True),  # another request's prompt
        ({GENERATION: 2}, True),  # tokens beyond the canary's one
        ({COMPLETED: 2}, True),  # another request finished
    ],
)
def test_foreign_progress_excludes_the_canarys_own(moved, foreign):
    zero = dict.fromkeys((PROMPT, GENERATION, STEPS, COMPLETED), 100.0)
    before = ProgressSample(0.0, 0.0, 1, zero)
    after = ProgressSample(1.0, 1.0, 1, {k: v + moved.get(k, 0) for k, v in zero.items()})
    assert foreign_progress(before, after, COST) is foreign


def test_foreign_progress_is_unknown_without_both_reads_or_across_a_reset():
    a = sample(0.0, 1, 50.0)
    assert foreign_progress(None, a, COST) is None
    assert foreign_progress(a, None, COST) is None
    assert foreign_progress(a, sample(1.0, 1, 10.0), COST) is None


def test_a_users_payload_may_move_any_token_counter():
    cost = CanaryCost({COMPLETED: 1})
    assert foreign_progress(sample(0, 1, 0.0), sample(1, 1, 1000.0), cost) is False
    assert foreign_progress(sample(0, 1, completed=0.0), sample(1, 1, completed=2.0), cost)


# --- the progress source --------------------------------------------------------------------------
EXPOSITION = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{reason="capacity"} 0.0
vllm:num_requests_waiting_by_reason{reason="deferred"} 1.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 40.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 7.0
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_count{engine="0",model_name="tiny"} 9.0
vllm:iteration_tokens_total_sum{engine="0",model_name="tiny"} 47.0
"""


def test_read_progress_sums_by_category_and_label():
    got = read_progress(EXPOSITION, SPEC, 5.0, 6.0)
    assert got.in_flight == 4
    assert got.counters == {PROMPT: 40, GENERATION: 7, STEPS: 9}
    assert got.peer_wait == 1  # only reason="deferred"
    assert 'vllm:num_requests_waiting_by_reason{reason="deferred"}' in got.found


def test_gauges_without_counters_are_not_readable_metrics():
    gauges = "\n".join(line for line in EXPOSITION.splitlines() if "tokens" not in line)
    got = read_progress(gauges + "\n", SPEC, 0.0, 0.0)
    assert got.in_flight == 4
    problem = unusable(got, SPEC)
    assert problem is not None
    assert problem.startswith("in-flight gauges but none of the progress counters")
    state = on_sample(ProgressState(), got, "", SPEC)
    assert state.readable is False
    assert state.busy is False  # so no hold, no suspicion: the canary alone decides


def test_quiet_counters_with_work_in_flight_raise_a_suspicion_on_time():
    state = ProgressState()
    for t, total in ((0.0, 10.0), (1.0, 20.0), (2.0, 20.0)):
        state = on_sample(state, sample(t, 2, total), "", SPEC)
    assert state.quiet_since == 1.0  # the last read that showed them move
    assert state.suspect_at(POLICY.suspect_after) == 1.0 + POLICY.suspect_after
    assert not state.suspects_stall(POLICY.suspect_after, 1.0 + POLICY.suspect_after - 0.01)
    assert state.suspects_stall(POLICY.suspect_after, 1.0 + POLICY.suspect_after)
    state = on_sample(state, sample(3.0, 0, 20.0), "", SPEC)  # drained
    assert state.quiet_since is None


@pytest.mark.parametrize(
    ("timeout", "window", "interval", "busy", "suspect_after", "bound"),
    [
        (0.5, 2.5, 1.0, 0.65, 1.35, 2.5),
        (3.0, 5.0, 1.0, 0.65, 1.35, 5.0),
        (3.0, 30.0, 1.0, 1.0, 26.0, 30.0),
        (0.5, 1.25, 0.5, 0.25, 0.5, 1.25),  # the test suite's timings: wait 1 s
        # Too tight for its timeout: the shortest busy read, two of them quiet, the timeout.
        (0.5, 0.6, 1.0, 0.25, 0.5, 1.25),
    ],
)
def test_the_stall_window_is_the_bound(timeout, window, interval, busy, suspect_after, bound):
    policy = Policy(timeout=timeout, stall_window=window, metrics_interval=interval)
    assert policy.busy_metrics_interval == pytest.approx(busy)
    assert policy.suspect_after == pytest.approx(suspect_after)
    assert policy.suspect_after >= 2 * policy.busy_metrics_interval  # a read lands inside it
    assert policy.stall_bound == pytest.approx(bound)


# --- the canary's schedule ------------------------------------------------------------------------
def test_schedule():
    ep = passed(registered(), at=0.0)
    assert canary_due(ep, POLICY) == pytest.approx(1.01)  # ready, idle: every wait
    busy = apply_sample(ep, sample(0.5, 2, 10.0), "", SPEC)
    busy = apply_sample(busy, sample(1.5, 2, 20.0), "", SPEC)
    suspect = 1.5 + POLICY.suspect_after
    assert canary_due(busy, POLICY) == suspect  # held while counters move
    assert not suspected(busy, POLICY, suspect - 0.01)
    assert suspected(busy, POLICY, suspect)
    # The confirming canary passes: the requests wait outside the engine; back to every wait.
    calm = passed(busy, at=suspect)
    assert parked(calm, POLICY, suspect + 0.1)
    assert canary_due(calm, POLICY) == pytest.approx(suspect + 0.01 + POLICY.wait)
    assert (
        "they wait on something outside the engine"
        in endpoint_verdict(calm, POLICY, suspect + 0.5).reason
    )


def test_no_canary_while_not_registered_or_for_a_role_without_one():
    ep = EndpointState("generate", True, "why")
    assert canary_due(ep, POLICY) is None
    assert canary_due(registered(has_canary=False), POLICY) is None
    assert canary_due(registered(at=3.0), POLICY) == pytest.approx(3.01)


def test_a_result_from_an_older_incarnation_is_dropped():
    ep = registered()
    old = ep.incarnation
    ep = apply_registration(ep, result(Outcome.REFUSED, 1.0), POLICY)
    ep = apply_registration(ep, result(Outcome.SUCCESS, 2.0), POLICY)
    assert apply_canary(ep, result(Outcome.SUCCESS, 1.5), old, POLICY) is ep


# --- the registration source ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("answers", "progressing", "canary", "registered", "clock", "doubt"),
    [
        (["success", "refused"], False, True, False, False, False),  # gone: at once, no clock
        (["success", "error"], False, True, False, False, False),  # 503 loading/draining
        (["timeout"], False, True, False, False, False),  # never answered: not registered
        # With a canary: a timeout only sends one; the canary decides.
        (["success", "timeout"], False, True, True, False, True),
        (["success", "timeout", "timeout", "timeout"], False, True, True, False, True),
        (["success", "timeout", "timeout"], True, True, True, False, False),  # slow under load
        (["success", "timeout", "success"], False, True, True, False, False),
        # Without one: two unexcused timeouts in a row deregister, and the clock runs.
        (["success", "timeout"], False, False, True, True, False),
        (["success", "timeout", "timeout"], False, False, False, True, False),
        (["success", "timeout", "timeout"], True, False, True, False, False),  # slow under load
        (["success", "timeout", "success"], False, False, True, False, False),
    ],
)
def test_registration(answers, progressing, canary, registered, clock, doubt):
    state = RegistrationState()
    for i, name in enumerate(answers):
        state = on_registration(
            state,
            result(Outcome(name), float(i)),
            progressing=progressing,
            canary_decides=canary,
            threshold=POLICY.failure_threshold,
        )
    assert state.registered is registered
    assert (state.timeout_since is not None) is clock
    assert state.doubt is doubt


def test_a_health_route_timeout_sends_a_canary_at_once():
    policy = replace(POLICY, wait=10.0)
    ep = registered()
    ep = apply_canary(ep, result(Outcome.SUCCESS, 0.0), ep.incarnation, policy)
    assert canary_due(ep, policy) == 10.01
    ep = apply_registration(ep, result(Outcome.TIMEOUT, 2.0, 0.5), policy)
    assert ep.registration.registered
    assert canary_due(ep, policy) == 2.5  # at once: when the check timed out
    ep = apply_canary(ep, result(Outcome.TIMEOUT, 2.5, 0.5), ep.incarnation, policy)
    assert canary_due(ep, policy) == 3.5  # then never closer than retry to the last one
    ep = apply_registration(ep, result(Outcome.SUCCESS, 3.0), policy)
    assert not ep.registration.doubt


def test_a_canary_that_passes_after_a_health_route_timeout_ends_the_doubt():
    """A health route slow under load keeps timing out; once a canary has passed since, the
    schedule is the ordinary one again (not a canary every retry)."""
    policy = replace(POLICY, wait=10.0)
    ep = registered()
    ep = apply_canary(ep, result(Outcome.SUCCESS, 0.0), ep.incarnation, policy)
    ep = apply_registration(ep, result(Outcome.TIMEOUT, 2.0, 0.5), policy)
    ep = apply_canary(ep, result(Outcome.SUCCESS, 2.5), ep.incarnation, policy)
    assert ep.registration.doubt
    assert canary_due(ep, policy) == 12.51  # wait after the pass
    ep = apply_registration(ep, result(Outcome.TIMEOUT, 3.0, 0.5), policy)
    assert canary_due(ep, policy) == 3.5  # a new timeout, asked after that pass: doubt again


def test_a_recent_progress_read_stands_in_for_a_baseline_read_that_failed():
    """On a saturated engine the baseline read can miss the timeout; the progress loop's read
    from just before the canary is evidence enough, an older one is not."""
    base = passed(registered())
    base = apply_sample(base, sample(9.6, 4, 100.0), "", SPEC, COST)
    end = sample(10.6, 4, 100.0)
    timeout = result(Outcome.TIMEOUT, 10.0, 0.5)
    ep = apply_canary(base, timeout, base.incarnation, POLICY, end=end, cost=COST)
    assert ep.canary.ready is False  # nothing moved across the canary: a hang, at once
    late = result(Outcome.TIMEOUT, 11.0, 0.5)  # that read is now 1.4 s older than the canary
    ep = apply_canary(base, late, base.incarnation, POLICY, end=end, cost=COST)
    assert ep.canary.ready is True  # unknown: an ordinary failure, 1 of 2


def test_a_slow_health_route_under_load_does_not_drop_a_serving_engine():
    ep = passed(registered())
    ep = apply_sample(ep, sample(0.0, 4, 10.0), "", SPEC)
    ep = apply_sample(ep, sample(1.0, 4, 30.0), "", SPEC)
    for at in (1.5, 2.5, 3.5):
        ep = apply_registration(ep, result(Outcome.TIMEOUT, at, 1.0), POLICY)
        ep = apply_sample(ep, sample(at + 0.5, 4, 30.0 + at * 10), "", SPEC)
    assert ep.registration.registered is True
    assert endpoint_verdict(ep, POLICY, 4.0).ready is True


# --- liveness -------------------------------------------------------------------------------------
def _hung(at: float = 0.0) -> EndpointState:
    ep = passed(registered())
    for t in (1.0, 2.0):
        ep = apply_canary(ep, result(Outcome.TIMEOUT, at + t, 0.5), ep.incarnation, POLICY)
    return ep


@pytest.mark.parametrize(
    ("now", "live", "cause"),
    [(5.0, True, Cause.CANARY), (10.9, True, Cause.CANARY), (11.0, False, Cause.CANARY)],
)
def test_liveness_follows_the_canary_clock(now, live, cause):
    got = decide_liveness({"generate": _hung()}, now, POLICY.liveness_window)
    assert got.live is live
    assert got.cause is cause
    assert "canary failing hard" in got.reason


@pytest.mark.parametrize("answer", [Outcome.ERROR, Outcome.REFUSED])
def test_liveness_never_fails_while_the_health_route_answers_non_200_or_refuses(answer):
    ep = _hung()
    ep = apply_registration(ep, result(answer, 3.0, status=503), POLICY)
    assert decide_liveness({"generate": ep}, 1000.0, POLICY.liveness_window).live


# The gRPC health's answers, as on_registration sees them: "serving", "not_serving" (a status),
# "other" (another non-OK status: NOT_FOUND, UNKNOWN), "refused" (nothing listens), "timeout".
GRPC_ANSWERS = {
    "serving": result(Outcome.SUCCESS),
    "not_serving": replace(result(Outcome.ERROR), not_serving=True),
    "other": result(Outcome.ERROR),
    "refused": result(Outcome.REFUSED),
    "timeout": result(Outcome.TIMEOUT),
}


@pytest.mark.parametrize(
    ("answers", "since"),
    [
        (["not_serving", "not_serving"], None),  # warming up: it never served
        (["serving", "not_serving"], 1),  # it served, and now says it cannot
        (["serving", "not_serving", "not_serving", "not_serving"], 1),  # from the first one on
        (["serving", "not_serving", "timeout"], 1),  # then silent: the same trouble
        (["serving", "not_serving", "serving"], None),  # serving again
        (["serving", "not_serving", "refused"], None),  # the server went away (a restart)
        (["serving", "not_serving", "refused", "not_serving"], None),  # a new one, warming up
        (["serving", "not_serving", "other"], None),  # another answer: not this clock's
        (["serving", "other", "not_serving"], None),  # it did not come straight from serving
        (["serving", "refused"], None),
    ],
)
def test_not_serving_after_serving_starts_a_clock(answers, since):
    state = RegistrationState()
    for i, name in enumerate(answers):
        answer = replace(GRPC_ANSWERS[name], started=float(i), finished=i + 0.01)
        state = on_registration(
            state, answer, progressing=False, canary_decides=False, threshold=99
        )
    assert state.not_serving_since == since


def test_a_server_that_stays_up_saying_not_serving_fails_liveness():
    ep = registered(has_canary=False)
    said = replace(result(Outcome.ERROR, 1.0), not_serving=True, reason="Check(''): NOT_SERVING")
    for t in range(1, 13):
        ep = apply_registration(ep, replace(said, started=float(t), finished=t + 0.01), POLICY)
    within = decide_liveness({"generate": ep}, 10.9, POLICY.liveness_window)
    assert within.live is True
    assert within.cause is Cause.NOT_SERVING
    got = decide_liveness({"generate": ep}, 11.0, POLICY.liveness_window)
    assert got.live is False
    assert got.reason == (
        "generate: engine says it is not serving for 10.0 s (window 10 s): Check(''): NOT_SERVING"
    )
    gone = apply_registration(ep, result(Outcome.REFUSED, 13.0), POLICY)
    assert decide_liveness({"generate": gone}, 1000.0, POLICY.liveness_window).live


def test_registration_timeouts_have_their_own_clock_without_a_canary():
    ep = registered(has_canary=False)
    for t in range(1, 14):
        ep = apply_registration(ep, result(Outcome.TIMEOUT, float(t), 0.5), POLICY)
    got = decide_liveness({"generate": ep}, 14.0, POLICY.liveness_window)
    assert got.live is False
    assert got.cause is Cause.REGISTRATION


def test_with_a_canary_a_frozen_server_fails_liveness_on_the_canary_clock():
    ep = passed(registered())
    for t in range(1, 14):
        ep = apply_registration(ep, result(Outcome.TIMEOUT, float(t), 0.5), POLICY)
        ep = apply_canary(ep, result(Outcome.TIMEOUT, t + 0.5, 0.5), ep.incarnation, POLICY)
    assert ep.registration.registered
    assert endpoint_verdict(ep, POLICY, 14.0).ready is False
    got = decide_liveness({"generate": ep}, 14.0, POLICY.liveness_window)
    assert got.live is False
    assert got.cause is Cause.CANARY


def test_the_live_reason_quotes_the_current_cause():
    ep = _hung()
    ep = apply_canary(ep, result(Outcome.ERROR, 3.0, status=502), ep.incarnation, POLICY)
    got = decide_liveness({"generate": ep}, 12.0, POLICY.liveness_window)
    assert got.reason.endswith("canary error: error")


def test_engine_disagreement_needs_a_200_and_a_hard_failure():
    assert engine_disagrees(_hung())
    invalid = passed(registered())
    for t in (1.0, 2.0):
        invalid = apply_canary(invalid, result(Outcome.INVALID, t), invalid.incarnation, POLICY)
    assert not engine_disagrees(invalid)


# --- readiness ------------------------------------------------------------------------------------
R, N, U = Verdict(True, "ok"), Verdict(False, "bad"), Verdict(None, "none")


@pytest.mark.parametrize(
    ("verdicts", "listed", "starting", "ready", "rule"),
    [
        ({"generate": R}, (), StartingStatus.NOTREADY, True, Rule.MONITORED),
        ({"generate": N}, (), StartingStatus.READY, False, Rule.MONITORED),
        ({"generate": U}, (), StartingStatus.READY, True, Rule.STARTING),
        ({"generate": U}, (), StartingStatus.NOTREADY, False, Rule.STARTING),
        ({"generate": R}, ("generate",), StartingStatus.NOTREADY, True, Rule.LISTED),
    ],
)
def test_readiness_rule(verdicts, listed, starting, ready, rule):
    got = decide_readiness(verdicts, listed, starting)
    assert (got.ready, got.rule) == (ready, rule)


def test_draining_wins():
    got = decide_readiness({"generate": R}, (), StartingStatus.READY, draining=True)
    assert (got.ready, got.rule) == (False, Rule.DRAINING)


# --- reading what an engine serves ----------------------------------------------------------------
def test_gzip_is_undone_within_the_byte_bound():
    text = EXPOSITION.encode() * 3
    assert _decode(gzip.compress(text), "gzip", 1 << 20) == text
    assert _decode(text, "identity", 10) == text
    with pytest.raises(BodyTooLarge):
        _decode(gzip.compress(b"0" * 100_000), "gzip", 1024)  # a bomb stops at the bound
    with pytest.raises(BadEncoding):
        _decode(b"not gzip", "gzip", 1024)
    with pytest.raises(BadEncoding):
        _decode(text, "br", 1 << 20)
    assert math.isfinite(read_progress(_decode(gzip.compress(text), "gzip", 1 << 20).decode(),
                                       SPEC, 0.0, 0.0).in_flight or 0)  # fmt: skip


def test_one_slow_metrics_read_does_not_make_the_load_unknown():
    state = on_sample(ProgressState(), sample(0.0, 3, 10.0), "", SPEC)
    state = on_sample(state, sample(1.0, 3, 20.0), "", SPEC)
    for _ in range(2):  # late answers of a saturated metrics route
        state = on_sample(state, None, "GET /metrics: no complete answer within 1 s", SPEC)
        assert state.readable
        assert state.busy
    state = on_sample(state, None, "GET /metrics: no complete answer within 1 s", SPEC)
    assert not state.readable
    assert state.why.startswith("GET /metrics")


# --- the worker as a whole: the stale rule and the ranks -----------------------------------------


@pytest.mark.parametrize(
    ("silent_for", "draining", "ready", "rule"),
    [
        (HEARTBEAT_STALE - 0.1, False, True, Rule.MONITORED),
        (HEARTBEAT_STALE + 0.1, False, False, Rule.STALE),
        (HEARTBEAT_STALE + 0.1, True, False, Rule.DRAINING),  # draining says so, stale or not
    ],
)
def test_a_silent_monitor_makes_the_verdict_stale_unless_draining(
    silent_for, draining, ready, rule
):
    silent = monitor_silent(0.0, silent_for)
    got = worker_readiness(
        {"generate": Verdict(True, "canary passed")},
        (),
        StartingStatus.NOTREADY,
        draining=draining,
        informing=(),
        silent=silent,
    )
    assert (got.ready, got.rule) == (ready, rule)


def test_a_silent_monitor_never_fails_liveness():
    got = worker_liveness({"generate": _hung()}, 1000.0, POLICY.liveness_window, 11.0)
    assert got.live
    assert got.reason == "unknown: the monitor has not run for 11.0 s"
    assert not worker_liveness({"generate": _hung()}, 1000.0, POLICY.liveness_window, None).live


def test_an_endpoint_of_ranks_is_decided_by_its_ranks_and_a_single_unit_by_itself():
    verdicts = {
        "generate/rank0": Verdict(True, "canary passed"),
        "generate/rank1": Verdict(False, "canary timeout"),
        "kv_transfer": Verdict(None, "no verdict yet"),
    }
    units = {"generate": ("generate/rank0", "generate/rank1"), "kv_transfer": ("kv_transfer",)}
    got = endpoint_verdicts(units, verdicts, None)
    assert got["kv_transfer"] is verdicts["kv_transfer"]
    assert got["generate"].ready is False
    assert got["generate"].reason.startswith("1 of 2 ranks ready")
    degraded = endpoint_verdicts(units, verdicts, 1)["generate"]
    assert (degraded.ready, degraded.degraded) == (True, True)


@pytest.mark.parametrize(
    ("states", "clock_from", "canary_due_after"),
    [
        (["unhealthy"], 1.0, True),
        (["unhealthy", "dead"], 1.0, True),  # still failed: the clock runs on
        (["unhealthy", "healthy"], None, True),
        (["recovering"], None, False),  # a pause: no canary, no clock
        (["unhealthy", "recovering"], None, False),
        (["recovering", "healthy"], None, True),
    ],
)
def test_the_engines_fault_reports(states, clock_from, canary_due_after):
    ep = passed(registered())
    for at, state in enumerate(states, start=1):
        ep = apply_faults(ep, 0, EngineReport(state), float(at))
    running = clocks(ep)
    assert running.get(Cause.FAULT) == clock_from
    assert (canary_due(ep, POLICY) is not None) is canary_due_after
    if states[-1] == "healthy":  # back from a fault: a fresh canary proves it first
        assert ep.canary.ready is None
        assert endpoint_verdict(ep, POLICY, 10.0).ready is None


def test_fault_reports_are_read_per_rank_from_vllms_status_body():
    body = {
        "schema_version": 1,
        "total_engines": 2,
        "engines": [
            {"id": 0, "status": "healthy"},
            {"id": 1, "status": "unhealthy", "fault_info": "RuntimeError", "ft_error": None},
            {"id": "x", "status": "dead"},  # not well formed: left out
        ],
    }
    reports = reports_in(body)
    assert reports == {0: EngineReport("healthy"), 1: EngineReport("unhealthy", "RuntimeError")}
    assert report_for(reports, 0) == (0, EngineReport("healthy"))
    assert report_for(reports, None) == (1, EngineReport("unhealthy", "RuntimeError"))
    assert read_status(404, "") == (None, True)
    assert read_status(200, "[]") == (None, False)  # not the status at all
    assert read_status(200, '{"engines": []}') == ({}, False)


def test_a_canary_sent_before_the_engine_reported_its_recovery_is_dropped():
    """A canary that left while the engine was unhealthy and times out just after it reports
    healthy says nothing about the recovered engine: the fresh canary proves it."""
    ep = passed(registered())
    ep = apply_faults(ep, 0, EngineReport("unhealthy"), 2.0)
    ep = apply_faults(ep, 0, EngineReport("healthy"), 3.0)
    fresh = ep.canary
    late = apply_canary(ep, result(Outcome.TIMEOUT, at=2.5, latency=0.6), ep.incarnation, POLICY)
    assert late.canary == fresh
    proved = apply_canary(ep, result(Outcome.SUCCESS, at=3.1), ep.incarnation, POLICY)
    assert proved.canary.ready
