"""The decision core as tables: readiness rule, canary hysteresis, registration, liveness."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.config import StartingStatus
from sidecar.rules import (
    CanaryResult,
    EndpointState,
    Outcome,
    Policy,
    Probe,
    RegistrationResult,
    Rule,
    Verdict,
    canary_due,
    decide_liveness,
    decide_readiness,
    endpoint_verdict,
    engine_disagrees,
    on_canary,
    on_progress,
    on_registration,
)

READY, NOTREADY = StartingStatus.READY, StartingStatus.NOTREADY
R, N, U = Verdict(True, "ok"), Verdict(False, "bad"), Verdict(None, "no verdict yet")


@pytest.mark.parametrize(
    ("verdicts", "listed", "starting", "ready", "rule"),
    [
        # no list: every monitored endpoint counts
        ({"generate": R}, (), NOTREADY, True, Rule.MONITORED),
        ({"generate": N}, (), NOTREADY, False, Rule.MONITORED),
        ({"generate": R, "other": N}, (), NOTREADY, False, Rule.MONITORED),
        # a list: only listed endpoints count
        ({"generate": R, "other": N}, ("generate",), NOTREADY, True, Rule.LISTED),
        ({"generate": N, "other": R}, ("generate",), NOTREADY, False, Rule.LISTED),
        # before the first verdict, the starting status decides
        ({"generate": U}, (), NOTREADY, False, Rule.STARTING),
        ({"generate": U}, (), READY, True, Rule.STARTING),
        ({"generate": U}, ("generate",), READY, True, Rule.STARTING),
        # a known failure beats the starting status
        ({"generate": U, "other": N}, (), READY, False, Rule.MONITORED),
        # an endpoint not listed cannot hold the worker at its starting status
        ({"generate": R, "other": U}, ("generate",), NOTREADY, True, Rule.LISTED),
    ],
)
def test_readiness_rule(verdicts, listed, starting, ready, rule):
    decision = decide_readiness(verdicts, listed, starting)
    assert (decision.ready, decision.rule) == (ready, rule)


def reg(probe: Probe, t: float = 0.0) -> RegistrationResult:
    return RegistrationResult(probe, f"probe {probe}", t, t + 0.01)


def canary(outcome: Outcome, t: float = 0.0, latency: float = 0.01, status: int | None = None):
    return CanaryResult(outcome, f"{outcome}", t, t + latency, 1e9 + t, "canary-x", status)


POLICY = Policy(failure_threshold=2, success_threshold=1, wait=10, retry=1, liveness_window=30)


def registered(has_canary: bool = True) -> EndpointState:
    return on_registration(EndpointState("generate", has_canary, "why"), reg(Probe.OK))


def run(state: EndpointState, outcomes: list[Outcome], policy: Policy = POLICY) -> EndpointState:
    for i, outcome in enumerate(outcomes):
        status = 500 if outcome is Outcome.ERROR else None
        state = on_canary(
            state, canary(outcome, t=float(i), status=status), state.incarnation, policy
        )
    return state


S, F = Outcome.SUCCESS, Outcome.TIMEOUT


@pytest.mark.parametrize(
    ("outcomes", "ready"),
    [
        ([], None),  # registered, no canary yet: no verdict
        ([S], True),
        ([F], False),  # starts notready; a failure keeps it there
        ([S, F], True),  # one slow canary does not flap readiness
        ([S, F, F], False),
        ([S, F, S, F], True),  # failures must be consecutive
        ([S, F, F, S], True),  # success threshold 1: one pass recovers
    ],
)
def test_canary_hysteresis(outcomes, ready):
    assert endpoint_verdict(run(registered(), outcomes)).ready is ready


@pytest.mark.parametrize(
    ("policy", "outcomes", "ready"),
    [
        (replace(POLICY, success_threshold=2), [S], False),
        (replace(POLICY, success_threshold=2), [S, S], True),
        (replace(POLICY, success_threshold=2), [S, S, F, F, S], False),
        (replace(POLICY, failure_threshold=1), [S, F], False),
        (replace(POLICY, failure_threshold=3), [S, F, F], True),
    ],
)
def test_thresholds(policy, outcomes, ready):
    assert endpoint_verdict(run(registered(), outcomes, policy)).ready is ready


@pytest.mark.parametrize(
    ("outcomes", "due"),
    [
        ([], 0.01),  # registered: the first canary goes at once
        ([S], 0.01 + 10),  # proven: wait DYN_CANARY_WAIT_TIME after the pass
        ([S, F], 1 + 1),  # after a failure: retry interval from the failed canary's start
    ],
)
def test_next_canary_due(outcomes, due):
    assert run(registered(), outcomes).next_canary_due == pytest.approx(due)


def test_retry_never_overlaps_a_slow_canary():
    state = on_canary(registered(), canary(F, t=5.0, latency=3.0), 1, POLICY)
    assert state.next_canary_due == pytest.approx(8.0)  # ends at 8 > start + retry (6)


def test_stale_canary_is_dropped_after_reregistration():
    state = run(registered(), [S])
    state = on_registration(state, reg(Probe.REFUSED, 20))
    state = on_registration(state, reg(Probe.OK, 21))
    assert state.incarnation == 2
    stale = on_canary(state, canary(S, t=19.5), 1, POLICY)
    assert stale is state
    assert endpoint_verdict(state).ready is False  # the new incarnation must prove itself


@pytest.mark.parametrize(
    ("has_canary", "probes", "ready"),
    [
        (False, [], None),
        (False, [Probe.OK], True),  # no canary: ready while registered
        (False, [Probe.OK, Probe.STATUS], False),  # "Loading model" 503
        (False, [Probe.OK, Probe.REFUSED, Probe.OK], True),  # restarted: never 503 forever
        (True, [Probe.OK], None),  # canary endpoint: registration alone is no verdict
        (True, [Probe.REFUSED], False),
        (True, [Probe.TIMEOUT], False),  # frozen whole
    ],
)
def test_registration(has_canary, probes, ready):
    state = EndpointState("generate", has_canary, "why")
    for i, probe in enumerate(probes):
        state = on_registration(state, reg(probe, float(i)))
    assert endpoint_verdict(state).ready is ready


def live_after(events, now: float) -> bool:
    state = registered()
    for event in events:
        if isinstance(event, RegistrationResult):
            state = on_registration(state, event)
        else:
            state = on_canary(state, event, state.incarnation, POLICY)
    return decide_liveness({"generate": state}, now, POLICY.liveness_window).live


@pytest.mark.parametrize(
    ("events", "now", "live"),
    [
        ([], 1000, True),
        ([canary(S, 0)], 1000, True),
        ([canary(F, 0)], 29, True),  # hung, but not yet for the whole window
        ([canary(F, 0), canary(F, 10)], 30, False),  # hung for the whole window
        ([canary(F, 0), canary(S, 10)], 100, True),  # a pass breaks the run
        ([canary(Outcome.ERROR, 0, status=500)], 31, False),  # 5xx is hard
        ([canary(Outcome.ERROR, 0, status=400)], 1000, True),  # 4xx: a wrong canary, not a hang
        ([canary(Outcome.INVALID, 0)], 1000, True),
        ([canary(F, 0), reg(Probe.REFUSED, 5)], 1000, True),  # gone: the runtime restarts it
        ([canary(F, 0), reg(Probe.STATUS, 5)], 1000, True),  # loading again
        ([reg(Probe.TIMEOUT, 0)], 31, False),  # frozen whole
        ([reg(Probe.TIMEOUT, 0), reg(Probe.OK, 5)], 31, False),  # back, but no canary passed yet
        ([reg(Probe.TIMEOUT, 0), reg(Probe.OK, 5), canary(S, 6)], 31, True),
    ],
)
def test_liveness(events, now, live):
    assert live_after(events, now) is live


def test_liveness_without_canary_is_restored_by_registration():
    state = EndpointState("generate", False, "why")
    state = on_registration(state, reg(Probe.TIMEOUT, 0))
    assert not decide_liveness({"generate": state}, 100, 30).live
    state = on_registration(state, reg(Probe.OK, 101))
    assert decide_liveness({"generate": state}, 102, 30).live


# --- engine progress (busy is not hung) -------------------------------------------------------

PROGRESS_POLICY = replace(POLICY, stall_window=5)


def sample(at: float, in_flight: float | None, counters: float | None):
    from sidecar.progress import ProgressSample

    return ProgressSample(in_flight, counters, at)


def feed(state: EndpointState, samples) -> EndpointState:
    for s in samples:
        state = on_progress(state, s, PROGRESS_POLICY, 1e9 + s.at)
    return state


def test_busy_and_advancing_stays_ready_and_sends_no_canary():
    state = run(registered(), [S], PROGRESS_POLICY)  # ready, next canary at 10.01
    state = feed(state, [sample(t, 3, 100 + t) for t in range(1, 30)])
    assert endpoint_verdict(state).ready is True
    assert canary_due(state) is None  # work in flight: a canary would only queue behind it
    assert state.next_canary_due == pytest.approx(28 + 10)  # put off by the last progress
    assert not state.stalled


def test_busy_without_progress_for_the_stall_window_is_stalled():
    state = run(registered(), [S], PROGRESS_POLICY)
    state = feed(state, [sample(1, 2, 50), sample(2, 2, 51)])  # progressing
    state = feed(state, [sample(t, 2, 51) for t in (3, 4, 5, 6)])
    assert endpoint_verdict(state).ready is True  # quiet for 4 s < 5 s
    state = feed(state, [sample(7, 2, 51)])
    verdict = endpoint_verdict(state)
    assert verdict.ready is False
    assert verdict.reason.startswith("stalled: 2 requests in flight")
    assert "own health route still answers 200" in verdict.reason
    assert engine_disagrees(state)
    assert state.hard_failure_since == 2
    assert decide_liveness({"g": state}, 2 + 29, 30).live
    assert not decide_liveness({"g": state}, 2 + 30, 30).live
    state = feed(state, [sample(8, 2, 52)])  # it moves again
    assert endpoint_verdict(state).ready is True
    assert decide_liveness({"g": state}, 100, 30).live


def test_long_prefill_with_moving_counters_never_reads_as_hung():
    state = run(registered(), [S], PROGRESS_POLICY)
    # one request in flight for 60 s (12 stall windows); a counter moves every 4 s
    samples = [sample(t, 1, 1000 + t // 4) for t in range(1, 61)]
    for s in samples:
        state = feed(state, [s])
        assert endpoint_verdict(state).ready is True, s
    assert decide_liveness({"g": state}, 61, 30).live


def test_idle_engine_gets_canaries_on_schedule():
    state = run(registered(), [S], PROGRESS_POLICY)
    state = feed(state, [sample(1, 0, 9), sample(2, 0, 9)])
    assert canary_due(state) == pytest.approx(10.01)


def test_canary_timeout_behind_progressing_work_is_excused():
    state = run(registered(), [S], PROGRESS_POLICY)
    state = feed(state, [sample(20, 1, 10)])
    state = on_canary(state, canary(F, t=20.5, latency=0.5), 1, PROGRESS_POLICY)
    state = feed(state, [sample(21, 1, 11), sample(22, 1, 12)])
    state = on_canary(state, canary(F, t=21.5, latency=3), 1, PROGRESS_POLICY)
    assert state.consecutive_failures == 1  # the second timeout overlapped progress
    assert endpoint_verdict(state).ready is True


def test_canary_timeout_with_work_in_flight_and_no_progress_is_hung_at_once():
    state = run(registered(), [S], PROGRESS_POLICY)
    state = feed(state, [sample(10, 0, 9)])
    state = on_canary(state, canary(F, t=11, latency=0.5), 1, PROGRESS_POLICY)
    assert endpoint_verdict(state).ready is True  # 1 of 2 failures
    state = feed(state, [sample(11.8, 1, 9)])  # the canary is stuck in the engine
    verdict = endpoint_verdict(state)
    assert verdict.ready is False
    assert "no engine progress since it was sent" in verdict.reason


def test_progress_after_a_hang_recovers_without_waiting_for_an_idle_canary():
    state = run(registered(), [S, F, F], PROGRESS_POLICY)
    assert endpoint_verdict(state).ready is False
    state = feed(state, [sample(30, 4, 100), sample(31, 4, 120)])
    assert endpoint_verdict(state).ready is True
    assert state.consecutive_failures == 0


def test_unreadable_metrics_fall_back_to_the_canary():
    state = run(registered(), [S], PROGRESS_POLICY)
    state = feed(state, [sample(1, 3, 10), sample(2, 3, 11)])
    assert canary_due(state) is None
    state = on_progress(state, None, PROGRESS_POLICY, 0)
    assert canary_due(state) is not None


def test_draining_rule_wins():
    decision = decide_readiness({"generate": R}, (), NOTREADY, draining=True)
    assert (decision.ready, decision.rule) == (False, Rule.DRAINING)


def test_read_progress_sums_samples_by_exposition_name():
    from sidecar.canary.vllm import VllmProber
    from sidecar.progress import read_progress

    text = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{model_name="m"} 100.0
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{le="1.0",model_name="m"} 3.0
vllm:iteration_tokens_total_bucket{le="+Inf",model_name="m"} 7.0
vllm:iteration_tokens_total_count{model_name="m"} 7.0
vllm:iteration_tokens_total_sum{model_name="m"} 70.0
"""
    got = read_progress(text, VllmProber.progress, 5.0)
    assert (got.in_flight, got.counters, got.at) == (7.0, 107.0, 5.0)
    empty = read_progress("# nothing here\n", VllmProber.progress, 1.0)
    assert (empty.in_flight, empty.counters) == (None, None)


@pytest.mark.parametrize(
    ("proven", "status", "live"),
    [
        (False, 400, True),  # rejected from the start: a wrong canary, never restart (DIS-1737)
        (True, 404, False),  # the same canary passed before: the engine changed (Dynamo lease)
        (True, 429, True),  # load shedding is not a fault
        (True, 500, False),
    ],
)
def test_rejections_are_hard_only_after_the_canary_passed(proven, status, live):
    state = run(registered(), [S]) if proven else registered()
    state = on_canary(state, canary(Outcome.ERROR, t=5, status=status), 1, POLICY)
    assert decide_liveness({"g": state}, 5 + 30, 30).live is live


def test_a_stall_stands_when_the_metrics_cannot_be_read():
    state = run(registered(), [S], PROGRESS_POLICY)
    state = feed(state, [sample(t, 2, 51) for t in (1, 2, 3, 4, 5, 6, 7)])
    assert endpoint_verdict(state).ready is False
    state = on_progress(state, None, PROGRESS_POLICY, 0)  # a stuck engine's /metrics hangs too
    assert endpoint_verdict(state).ready is False
    assert canary_due(state) is not None  # load unknown: a canary may go
    state = on_canary(state, canary(S, t=9), 1, PROGRESS_POLICY)  # and it passes
    assert endpoint_verdict(state).ready is True
    assert not state.stalled
