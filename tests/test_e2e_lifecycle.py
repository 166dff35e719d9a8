"""Sleep and wrong answers end to end: the sidecar and the fake engine as real processes over
loopback (the real vLLM's side of both: tests/test_vllm_real.py)."""

from __future__ import annotations

import time

import pytest

from tests.support.harness import LOOPBACK, free_port, wait_until

CANARY_ON = {"DYN_HEALTH_CHECK_ENABLED": "true"}


def canaries(fake) -> list[dict]:
    return [r for r in fake.requests() if r["path"] == "/v1/completions"]


def count(side, outcome: str) -> float:
    series = f'health_sidecar_canary_total{{endpoint="generate",outcome="{outcome}"}}'
    for line in side.metrics().splitlines():
        if line.startswith(series):
            return float(line.split()[-1])
    raise AssertionError(f"no canary_total for {outcome}")


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleeping_engine_is_notready_live_and_gets_no_canary(engine, sidecar, level):
    fake = engine("vllm", "aggregated", "--dev-mode")
    side = sidecar(CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url})
    side.wait_status(200, 5)
    assert fake.http.post(f"{fake.url}/sleep", params={"level": level}).status_code == 200
    side.wait_status(503, 3)
    _, body = side.health()
    assert body["reason"].startswith("generate: sleeping ("), body["reason"]
    assert body["checks"]["generate"]["lifecycle"]["sleeping"] is True
    sent = len(canaries(fake))
    # An absence takes time to show: two and a half canary waits (DYN_CANARY_WAIT_TIME=1), in
    # which an awake engine would get two canaries.
    time.sleep(2.5)
    assert len(canaries(fake)) == sent
    assert side.health()[0] == 503
    live = side.get("/live")
    assert live.status_code == 200
    assert live.json()["reason"] == "no sustained hard failure"
    assert "paused: sleeping" in side.proc.output()
    assert fake.http.post(f"{fake.url}/wake_up").status_code == 200
    side.wait_status(200, 3)
    assert len(canaries(fake)) > sent, "no canary proved the engine after it woke"


def test_an_engine_without_the_sleep_route_is_ready_and_says_so_once(engine, sidecar):
    """No dev routes: GET /is_sleeping answers 404; the worker is ready and the log says once
    that the engine serves no sleep route (that it is not asked again is not visible here: the
    fake engine records no request to a route it does not serve)."""
    fake = engine("vllm")
    side = sidecar(CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url})
    side.wait_status(200, 5)
    wait_until(lambda: "serves no sleep route" in side.proc.output(), 3)
    checks = side.get("/health").json()["checks"]["generate"]
    wait_until(lambda: side.get("/health").json()["checks"]["generate"] != checks, 3)
    assert side.proc.output().count("serves no sleep route") == 1
    assert side.health()[0] == 200


def test_one_wrong_answer_does_not_flap_two_make_it_notready(engine, sidecar):
    fake = engine("vllm")
    side = sidecar(
        CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url, "SIDECAR_CANARY_CHECK_ANSWER": "true"}
    )
    side.wait_status(200, 5)
    wait_until(lambda: count(side, "success") >= 2, 3, what="a reference and a match")
    fake.fault(wrong_answers=1)
    wait_until(lambda: count(side, "wrong_answer") == 1, 3, what="one wrong answer")
    wait_until(lambda: count(side, "success") >= 3, 3, what="the next right answer")
    assert side.health()[0] == 200
    assert "endpoint notready" not in side.proc.output()

    fake.fault(wrong_answer=True)
    side.wait_status(503, 5)
    _, body = side.health()
    assert "canary wrong_answer: wrong answer: " in body["reason"], body["reason"]
    assert "where this incarnation first answered" in body["reason"]
    # Not hard: the worker stays live (a restart would reload the same weights).
    assert side.get("/live").status_code == 200
    assert body["checks"]["generate"]["hard_failure_since"] is None
    fake.fault(wrong_answer=False)
    side.wait_status(200, 3)


def test_new_weights_after_a_maintenance_window_set_a_new_reference(engine, sidecar):
    """A training loop declares a window, updates the weights (here: the fake answers otherwise),
    and ends it: the first answer after the window is the new reference, not a wrong answer."""
    fake = engine("vllm")
    port = free_port()
    side = sidecar(
        CANARY_ON
        | {
            "SIDECAR_ENGINE_URL": fake.url,
            "SIDECAR_CANARY_CHECK_ANSWER": "true",
            "SIDECAR_CONTROL_PORT": str(port),
        }
    )
    side.wait_status(200, 5)
    wait_until(lambda: count(side, "success") >= 2, 3, what="a reference and a match")
    control = f"http://{LOOPBACK}:{port}/maintenance"
    window = {"seconds": 60, "reason": "weights, step 7"}
    assert side.http.put(control, json=window).status_code == 200
    side.wait_status(503, 2)
    fake.fault(wrong_answer=True)  # the new weights
    assert side.http.delete(control).status_code == 200
    side.wait_status(200, 3)
    passed = count(side, "success")
    wait_until(lambda: count(side, "success") >= passed + 2, 4, what="two more canaries")
    assert count(side, "wrong_answer") == 0
    assert side.health()[0] == 200


def test_failing_transfers_from_a_prefill_peer_are_reported_and_restart_nothing(engine, sidecar):
    """A decode worker whose prefill peer was killed: the request answers 500 and NIXL's counters
    move (failed transfers +2, failed notifications +1, as measured on a real pair); /health
    stays 200 and says so, /live stays 200, the metrics count it."""
    fake = engine("vllm", "decode")
    side = sidecar(
        CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url, "SIDECAR_DISAGGREGATION_MODE": "decode"}
    )
    side.wait_status(200, 5)
    fake.fault(kv_transfer_failure="peer_killed")
    model = fake.http.get(f"{fake.url}/v1/models").json()["data"][0]["id"]
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [0, 1],
        "remote_engine_id": "prefill-0",
        "remote_request_id": "req-1",
        "remote_host": LOOPBACK,
        "remote_port": 5600,
    }
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "kv_transfer_params": params}
    assert fake.http.post(f"{fake.url}/v1/completions", json=body).status_code == 500
    wait_until(
        lambda: "KV transfers from prefill peers failing" in side.get("/health").json()["reason"],
        3,
        what="the transfer failures in /health",
    )
    status, health = side.health()
    assert status == 200
    transfers = health["checks"]["generate"]["kv_transfers"]
    assert transfers["failing"] is True
    assert transfers["failures_in_window"] == {"failed_transfers": 2, "failed_notifications": 1}
    assert side.get("/live").status_code == 200
    metrics = side.metrics()
    failures = 'health_sidecar_kv_transfer_failures_total{endpoint="generate",kind='
    assert failures + '"failed_transfers"} 2.0' in metrics
    assert failures + '"failed_notifications"} 1.0' in metrics
    assert 'health_sidecar_kv_transfers_failing{endpoint="generate"} 1.0' in metrics
    assert "KV transfers from prefill peers failing" in side.proc.output()
