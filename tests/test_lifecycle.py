"""The lifecycle source (sleep, maintenance), the KV-transfer source and the answer check, as
tables: pure functions, no
I/O, no clock of their own."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.core.endpoint import (
    EndpointState,
    apply_canary,
    apply_lifecycle,
    apply_registration,
    apply_transfers,
    canary_due,
    judged,
)
from sidecar.core.evidence import lifecycle
from sidecar.core.evidence.lifecycle import LifecycleState, sleeping_in
from sidecar.core.evidence.policy import Policy
from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.evidence.transfers import TransferState, on_transfers, read_transfers
from sidecar.core.verdict import clocks, decide_liveness, endpoint_verdict
from sidecar.engines import vllm
from tests.support.configured import blueprint_of

pytestmark = pytest.mark.unit

POLICY = Policy(
    failure_threshold=2, success_threshold=1, wait=1.0, retry=1.0, timeout=0.5,
    liveness_window=10.0, stall_window=2.5, metrics_interval=1.0, check_answer=True,
)  # fmt: skip


def result(outcome: Outcome, at: float = 0.0, answer: str | None = None) -> Result:
    status = 200 if outcome is Outcome.SUCCESS else 500
    return Result(outcome, str(outcome), at, at + 0.01, 1e9 + at, "canary-x", status, answer)


def ready_endpoint(at: float = 0.0, answer: str | None = "7") -> EndpointState:
    ep = apply_registration(
        EndpointState("generate", True, "why"), result(Outcome.SUCCESS, at), POLICY
    )
    return apply_canary(ep, result(Outcome.SUCCESS, at, answer), ep.incarnation, POLICY)


def sleep(ep: EndpointState, at: float, asleep: bool | None = True) -> EndpointState:
    after = lifecycle.on_sleep_route(ep.lifecycle, asleep, "GET /is_sleeping -> true", at)
    return apply_lifecycle(ep, after, at)


def maintain(ep: EndpointState, at: float, seconds: float = 30.0) -> EndpointState:
    after = lifecycle.start_maintenance(ep.lifecycle, "weight update", seconds, at, 1e9 + at)
    return apply_lifecycle(ep, after, at)


# --- the verdict -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "ready", "reason"),
    [
        (lambda: sleep(ready_endpoint(), 1.0), False, "sleeping (GET /is_sleeping -> true)"),
        (lambda: maintain(ready_endpoint(), 1.0), False, "maintenance: weight update (ends in 29"),
        # A declared window explains a worker whose engine is gone too.
        (
            lambda: apply_registration(
                maintain(ready_endpoint(), 1.0), result(Outcome.REFUSED, 2.0), POLICY
            ),
            False,
            "maintenance: weight update",
        ),
        # An engine that left forgets that it slept: not registered, not "sleeping".
        (
            lambda: apply_registration(
                sleep(ready_endpoint(), 1.0), result(Outcome.REFUSED, 2.0), POLICY
            ),
            False,
            "engine not registered",
        ),
        # Woken: no verdict until a canary passes again.
        (
            lambda: sleep(sleep(ready_endpoint(), 1.0), 2.0, False),
            None,
            "registered; waiting for the first",
        ),
    ],
)
def test_pauses_in_the_verdict_table(make, ready, reason):
    verdict = endpoint_verdict(make(), POLICY, 2.0)
    assert verdict.ready is ready
    assert verdict.reason.startswith(reason), verdict.reason


def test_the_sleep_gauge_and_the_route_are_separate_signals():
    state = lifecycle.on_sleep_route(LifecycleState(), False, "route", 1.0)
    state = lifecycle.on_sleep_gauge(state, True, "gauge says weights_offloaded", 2.0)
    assert state.sleeping
    assert state.changed_at == 2.0
    state = lifecycle.on_sleep_route(state, False, "route", 3.0)  # the route does not clear it
    assert state.sleeping
    state = lifecycle.on_sleep_gauge(state, False, "", 4.0)
    assert not state.sleeping
    assert state.changed_at == 4.0


# --- canaries ----------------------------------------------------------------------------------
def test_no_canary_while_paused_and_one_at_once_after():
    ep = sleep(ready_endpoint(), 1.0)
    assert canary_due(ep, POLICY) is None
    woken = sleep(ep, 5.0, False)
    assert canary_due(woken, POLICY) == 5.0
    ep = maintain(ready_endpoint(), 1.0)
    assert canary_due(ep, POLICY) is None
    ended = apply_lifecycle(ep, lifecycle.end_maintenance(ep.lifecycle, 9.0), 9.0)
    assert canary_due(ended, POLICY) == 9.0


def test_a_canary_sent_before_a_pause_says_nothing_after_it():
    ep = sleep(ready_endpoint(), 1.0)
    ep = sleep(ep, 3.0, False)
    # Sent at 0.5 (before the sleep), held by the sleeping engine, timed out after the wake.
    late = apply_canary(ep, result(Outcome.TIMEOUT, 0.5), ep.incarnation, POLICY)
    assert late is ep
    fresh = apply_canary(ep, result(Outcome.SUCCESS, 3.5, "7"), ep.incarnation, POLICY)
    assert endpoint_verdict(fresh, POLICY, 4.0).ready is True


def test_no_liveness_clock_runs_while_paused():
    ep = ready_endpoint()
    for at in (1.0, 2.0):
        ep = apply_canary(ep, result(Outcome.TIMEOUT, at), ep.incarnation, POLICY)
    assert clocks(ep)
    paused = maintain(ep, 3.0, seconds=600)
    assert clocks(paused) == {}
    assert decide_liveness({"generate": paused}, 500.0, POLICY.liveness_window).live


# --- the answer check --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("answers", "ready", "last_outcome"),
    [
        (["7", "7", "7"], True, Outcome.SUCCESS),
        (["7", "8"], True, Outcome.WRONG),  # one flip: 1 of 2 failures, still ready
        (["7", "8", "7"], True, Outcome.SUCCESS),  # and the next right answer clears it
        (["7", "8", "8"], False, Outcome.WRONG),  # two in a row: notready
        (["7", "8", "8", "7"], True, Outcome.SUCCESS),
    ],
)
def test_a_different_answer_is_a_failure_with_hysteresis(answers, ready, last_outcome):
    ep = ready_endpoint(answer=answers[0])
    last = None
    for i, answer in enumerate(answers[1:], start=1):
        last = judged(ep, result(Outcome.SUCCESS, float(i), answer), POLICY)
        ep = apply_canary(ep, last, ep.incarnation, POLICY)
    verdict = endpoint_verdict(ep, POLICY, 10.0)
    assert verdict.ready is ready
    if last is not None:
        assert last.outcome is last_outcome
    if last_outcome is Outcome.WRONG:
        assert verdict.reason.startswith("canary wrong_answer: wrong answer: '8'"), verdict.reason
        assert clocks(ep) == {}  # not hard: a restart reloads the same weights


def test_the_reference_is_taken_anew_after_a_restart_or_a_pause():
    ep = ready_endpoint(answer="7")
    restarted = apply_registration(ep, result(Outcome.REFUSED, 1.0), POLICY)
    restarted = apply_registration(restarted, result(Outcome.SUCCESS, 2.0), POLICY)
    first = judged(restarted, result(Outcome.SUCCESS, 3.0, "9"), POLICY)
    assert first.outcome is Outcome.SUCCESS
    paused = maintain(ep, 1.0)
    resumed = apply_lifecycle(paused, lifecycle.end_maintenance(paused.lifecycle, 2.0), 2.0)
    assert judged(resumed, result(Outcome.SUCCESS, 3.0, "9"), POLICY).outcome is Outcome.SUCCESS


def test_the_answer_is_not_checked_when_off_or_unknown():
    off = replace(POLICY, check_answer=False)
    ep = ready_endpoint(answer="7")
    assert judged(ep, result(Outcome.SUCCESS, 1.0, "8"), off).outcome is Outcome.SUCCESS
    assert judged(ep, result(Outcome.SUCCESS, 1.0, None), POLICY).outcome is Outcome.SUCCESS


def test_which_answers_are_reproducible():
    def prober(backend: str, mode: str):
        on = {"health_check_enabled": True}
        return blueprint_of(backend=backend, disaggregation_mode=mode, **on).plan.prober

    completion = {"choices": [{"text": " the", "finish_reason": "length"}]}
    assert prober("vllm", "decode").answer(completion) == " the"
    ids = {"choices": [{"text": "x", "token_ids": [5], "finish_reason": "length"}]}
    assert prober("vllm", "aggregated").answer(ids) == "x [5]"
    generated = {"text": " a", "meta_info": {}}
    assert prober("sglang", "aggregated").answer(generated) == " a"
    # A decode canary's fake transfer brings no KV: its answer cannot be a reference.
    assert prober("sglang", "decode").answer(generated) is None


# --- the sleep gauge ---------------------------------------------------------------------------
def asleep_as(state: str) -> str:
    text = AWAKE.replace('awake"} 1.0', 'awake"} 0.0')
    return text.replace(f'{state}"}} 0.0', f'{state}"}} 1.0') if state else text


AWAKE = """# HELP vllm:engine_sleep_state Engine sleep state
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{engine="0",model_name="tiny",sleep_state="awake"} 1.0
vllm:engine_sleep_state{engine="0",model_name="tiny",sleep_state="weights_offloaded"} 0.0
vllm:engine_sleep_state{engine="0",model_name="tiny",sleep_state="discard_all"} 0.0
"""


@pytest.mark.parametrize(
    ("text", "sleeping"),
    [
        (AWAKE, False),
        (asleep_as("weights_offloaded"), True),
        (asleep_as("discard_all"), True),
        (asleep_as(""), True),  # POST /sleep?level=0: every state at 0, awake included
        ("vllm:num_requests_running 0\n", None),  # not published: unknown
        ("", None),
    ],
)
def test_sleeping_in_the_metrics(text, sleeping):
    assert sleeping_in(text, vllm.HTTP.awake)[0] is sleeping


def test_one_sleeping_rank_is_named():
    text = AWAKE + AWAKE.replace('engine="0"', 'engine="1"').replace('awake"} 1.0', 'awake"} 0.0')
    sleeping, why = sleeping_in(text, vllm.HTTP.awake)
    assert sleeping is True
    assert why == 'vllm:engine_sleep_state{sleep_state="awake"} is 0 (engine 1)'


# --- KV transfers from prefill peers -----------------------------------------------------------
NIXL = """vllm:nixl_num_failed_transfers_total{{engine="0",model_name="tiny"}} {ft}
vllm:nixl_num_failed_notifications_total{{engine="0",model_name="tiny"}} {fn}
vllm:nixl_num_kv_expired_reqs_total{{engine="0",model_name="tiny"}} 0.0
vllm:num_requests_kv_fetch_by_stage{{engine="0",model_name="tiny",stage="in_progress"}} {ip}
vllm:num_requests_kv_fetch_by_stage{{engine="0",model_name="tiny",stage="completed_waiting"}} 7.0
"""


def nixl(at: float, ft: float = 0.0, fn: float = 0.0, ip: float = 0.0):
    text = NIXL.format(ft=ft, fn=fn, ip=ip)
    return read_transfers(text, vllm.HTTP.transfers, at, 1e9 + at)


def test_transfer_counters_are_read_by_kind():
    sample = nixl(1.0, ft=2, fn=1, ip=1)
    assert sample is not None
    assert sample.failures == {
        "failed_transfers": 2.0,
        "failed_notifications": 1.0,
        "expired_kv": 0.0,
    }
    assert sample.fetching == 1.0  # completed_waiting is not a fetch
    assert read_transfers("vllm:num_requests_running 0\n", vllm.HTTP.transfers, 1.0, 1.0) is None


def test_failing_transfers_note_the_verdict_and_change_nothing_else():
    ep = ready_endpoint()
    ep = apply_transfers(ep, nixl(1.0))
    assert endpoint_verdict(ep, POLICY, 1.0).reason == "canary passed in 10 ms"
    ep = apply_transfers(ep, nixl(2.0, ft=2, fn=1))  # the prefill peer was killed
    verdict = endpoint_verdict(ep, POLICY, 2.0)
    assert verdict.ready is True
    assert verdict.reason == (
        "canary passed in 10 ms; KV transfers from prefill peers failing: 1 failed "
        "notifications, 2 failed transfers in the last 60 s (the peer side: this worker serves "
        "its own requests)"
    )
    assert clocks(ep) == {}
    assert ep.transfers.counted == {"failed_transfers": 2.0, "failed_notifications": 1.0}
    # A minute without another failure: the note is gone; the count stays.
    later = apply_transfers(ep, nixl(63.0, ft=2, fn=1))
    assert endpoint_verdict(later, POLICY, 63.0).reason == "canary passed in 10 ms"
    assert later.transfers.counted["failed_transfers"] == 2.0


def test_a_reset_counter_is_a_new_base_not_a_failure():
    state = on_transfers(TransferState(), nixl(1.0, ft=5))
    state = on_transfers(state, nixl(2.0, ft=0))  # the engine restarted
    state = on_transfers(state, nixl(3.0, ft=0))
    assert state.counted == {}
    assert not state.failing(3.0)
