"""The sidecar as a real process against the fake engine as a real process, over loopback.

Timings: DYN_CANARY_WAIT_TIME=1, DYN_HEALTH_CHECK_REQUEST_TIMEOUT=0.5, other knobs at their
defaults (retry 1 s, failure threshold 2, success threshold 1, registration every 1 s).
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.exposition import metric
from tests.support.harness import wait_until

WAIT, TIMEOUT = 1.0, 0.5
CANARY_ON = {"DYN_HEALTH_CHECK_ENABLED": "true"}
MATRIX = [
    (b, m, arrival)
    for b in ("vllm", "sglang", "trtllm")
    for m in ("aggregated", "prefill", "decode")
    for arrival in (False, True)
]


def canaries(fake) -> list[dict]:
    return [r for r in fake.requests() if r["path"] in ("/v1/completions", "/generate")]


@pytest.mark.parametrize(("backend", "mode", "arrival"), MATRIX)
def test_role_matrix_detects_and_recovers_from_a_generation_hang(
    engine, sidecar, backend, mode, arrival
):
    """On an engine that counts a prompt when the request arrives, the canary's own arrival
    must not read as progress (it excused the timeout and delayed detection to the stall rule)."""
    fake = engine(backend, mode, *(["--prompt-on-arrival"] if arrival else []))
    env = CANARY_ON | {
        "SIDECAR_BACKEND": backend,
        "SIDECAR_DISAGGREGATION_MODE": mode,
        "SIDECAR_ENGINE_URL": fake.url,
        "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
    }
    side = sidecar(env)
    side.wait_status(200, 5)
    _status, body = side.health()
    assert body["status"] == "ready"
    assert body["endpoints"] == {"generate": "ready"}
    assert body["rule"] == "listed_endpoints"
    assert body["checks"]["generate"]["last_canary"]["outcome"] == "success"

    # What reached the engine: the role-aware body, never a rejected one.
    sent = canaries(fake)
    assert sent, "no canary reached the engine"
    first = sent[0]
    assert first["headers"]["x-request-id"].startswith("canary-")
    if backend == "trtllm" and mode != "aggregated":
        assert first["json"]["disaggregated_params"] == {"request_type": "context_and_generation"}
    if backend == "sglang" and mode != "aggregated":
        assert first["json"]["bootstrap_host"] == "2.2.2.2"
        assert isinstance(first["json"]["bootstrap_room"], int)
    if backend == "vllm":
        assert "kv_transfer_params" not in first["json"]

    # A hung GPU loop behind a 200.
    fake.fault(hang_generation=True)
    hung_at = time.monotonic()
    side.wait_status(503, WAIT + TIMEOUT + 2)
    detect = time.monotonic() - hung_at
    if backend == "vllm":
        # A hung vLLM freezes every series, so the metrics cannot confirm: two failed canaries.
        assert detect <= WAIT + TIMEOUT + max(1.0, TIMEOUT) + 0.5
    else:
        assert detect <= WAIT + TIMEOUT + 0.5  # one canary, its stuck request confirmed
    # The engine lies: its health route answers 200 (SGLang's /health runs a generation, so
    # there the route that lies is the cheap one the sidecar registers with, /v1/models).
    lying = "/v1/models" if backend == "sglang" else "/health"
    assert fake.http.get(f"{fake.url}{lying}").status_code == 200
    _, body = side.health()
    assert body["status"] == "notready"
    check = body["checks"]["generate"]
    assert check["last_canary"]["outcome"] == "timeout"
    assert check["consecutive_failures"] >= 2
    assert "timeout" in body["reason"]

    fake.fault(hang_generation=False)
    released_at = time.monotonic()
    side.wait_status(200, 1.5)
    recover = time.monotonic() - released_at
    kind = "on arrival" if arrival else "after prefill"
    print(f"MATRIX {backend:6} {mode:10} {kind:13} detect {detect:.2f} s  recover {recover:.2f} s")
    rejected = metric(
        side.metrics(), "health_sidecar_canary_total", endpoint="generate", outcome="error"
    )
    assert rejected == 0  # the role-aware canary was never rejected


def test_negative_control_canaries_off_stay_ready_through_a_hang(engine, sidecar):
    """Without canaries a hung engine is invisible: proves the harness tells both outcomes apart."""
    fake = engine("trtllm", "aggregated")
    side = sidecar({"SIDECAR_BACKEND": "trtllm", "SIDECAR_ENGINE_URL": fake.url})
    side.wait_status(200, 5)
    fake.fault(hang_generation=True)
    deadline = time.monotonic() + WAIT + TIMEOUT + 2
    while time.monotonic() < deadline:
        assert side.get("/health").status_code == 200
        time.sleep(0.1)
    assert canaries(fake) == []


def test_encode_worker_without_canary_or_list_is_ready(engine, sidecar):
    """Dynamo's E/P/D encode worker answered 503 for its whole life; this one is ready."""
    fake = engine("vllm", "encode")
    side = sidecar(
        {
            "SIDECAR_BACKEND": "vllm",
            "SIDECAR_DISAGGREGATION_MODE": "encode",
            "SIDECAR_MODEL_TYPE": "multimodal",
            "SIDECAR_ENGINE_URL": fake.url,
        }
    )
    side.wait_status(200, 5)
    _, body = side.health()
    assert body["rule"] == "monitored_endpoints"
    assert body["checks"]["generate"]["canary"] == "disabled"
    assert canaries(fake) == []


def test_encode_worker_with_canaries_on_is_ready_on_registration(engine, sidecar):
    fake = engine("sglang", "encode")
    env = CANARY_ON | {
        "SIDECAR_BACKEND": "sglang",
        "SIDECAR_DISAGGREGATION_MODE": "encode",
        "SIDECAR_ENGINE_URL": fake.url,
    }
    side = sidecar(env)
    side.wait_status(200, 5)
    assert canaries(fake) == []
    assert "encode workers have no safe generation probe" in side.health()[1]["reason"]


def test_dynamo_decode_crash_loop_is_not_reproduced(engine, sidecar):
    """A plain canary to a TensorRT-LLM decode worker is rejected (DIS-1737): proven with a
    payload override that drops disaggregated_params. The rejection is notready with the
    engine's own words, and never fails liveness (no restart loop)."""
    fake = engine("trtllm", "decode")
    payload = '{"prompt": [100, 101], "max_tokens": 1, "temperature": 0, "stream": false}'
    env = CANARY_ON | {
        "SIDECAR_BACKEND": "trtllm",
        "SIDECAR_DISAGGREGATION_MODE": "decode",
        "SIDECAR_ENGINE_URL": fake.url,
        "DYN_HEALTH_CHECK_PAYLOAD": payload,
        "SIDECAR_LIVENESS_WINDOW": "1",
    }
    side = sidecar(env)
    wait_until(lambda: len(canaries(fake)) >= 3, 5, what="three canaries")
    status, body = side.health()
    assert status == 503
    assert "Disaggregated params are required for decode mode" in body["reason"]
    assert side.get("/live").status_code == 200


def test_sigstop_sigcont_and_kill_restart(engine, sidecar):
    fake = engine("openai", "aggregated")
    env = CANARY_ON | {"SIDECAR_BACKEND": "openai", "SIDECAR_ENGINE_URL": fake.url}
    side = sidecar(env)
    side.wait_status(200, 5)

    fake.proc.signal(signal.SIGSTOP)
    # Frozen whole: the health check's timeout sends a canary at once; two canary timeouts in
    # a row (retry 1 s apart) decide.
    detect = side.wait_status(503, WAIT + TIMEOUT + 1.0 + TIMEOUT + 0.5)
    fake.proc.signal(signal.SIGCONT)
    recover = side.wait_status(200, 3)
    print(f"SIGSTOP detect {detect:.2f} s, SIGCONT recover {recover:.2f} s")

    fake.proc.kill()
    side.wait_status(503, 3)
    _, body = side.health()
    assert "engine not registered" in body["reason"]
    assert side.get("/live").status_code == 200  # gone is not hung: the runtime restarts it
    fake.start()
    side.wait_status(200, 5)


def test_loading_engine_is_notready_but_live(engine, sidecar):
    fake = engine("openai", "aggregated", "--load-seconds", "3")
    env = CANARY_ON | {
        "SIDECAR_BACKEND": "openai",
        "SIDECAR_ENGINE_URL": fake.url,
        "SIDECAR_LIVENESS_WINDOW": "1",
    }
    side = sidecar(env)
    wait_until(lambda: "Loading model" in side.health()[1]["reason"], 3, what="loading reason")
    assert side.get("/health").status_code == 503
    assert side.get("/live").status_code == 200
    side.wait_status(200, 5)


def test_sustained_hang_fails_liveness_and_recovery_restores_it(engine, sidecar):
    fake = engine("vllm", "aggregated")
    env = CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url, "SIDECAR_LIVENESS_WINDOW": "2"}
    side = sidecar(env)
    side.wait_status(200, 5)
    fake.fault(hang_generation=True)
    side.wait_status(503, WAIT + TIMEOUT + 2)
    assert side.get("/live").status_code == 200  # failed readiness only briefly
    side.wait_status(503, WAIT + TIMEOUT + 2 + 3, path="/live")
    live = side.get("/live").json()
    assert live["status"] == "notlive"
    assert "canary failing hard" in live["reason"]
    assert live["cause"] == "canary failing hard"
    assert metric(side.metrics(), "health_sidecar_live") == 0
    fake.fault(hang_generation=False)
    side.wait_status(200, 3, path="/live")


def test_metrics(engine, sidecar):
    fake = engine("vllm", "aggregated")
    side = sidecar(CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url})
    side.wait_status(200, 5)
    wait_until(
        lambda: (
            (
                metric(
                    side.metrics(),
                    "health_sidecar_canary_total",
                    endpoint="generate",
                    outcome="success",
                )
                or 0
            )
            >= 2
        ),
        WAIT + 2,
        what="two passed canaries",
    )
    text = side.metrics()
    assert metric(text, "health_sidecar_ready") == 1
    assert metric(text, "health_sidecar_live") == 1
    assert metric(text, "health_sidecar_endpoint_ready", endpoint="generate") == 1
    assert metric(text, "health_sidecar_canary_total", endpoint="generate", outcome="timeout") == 0
    assert metric(text, "health_sidecar_canary_duration_seconds_count", endpoint="generate") >= 2
    stamp = metric(
        text, "health_sidecar_last_canary_success_timestamp_seconds", endpoint="generate"
    )
    assert stamp is not None
    assert abs(stamp - time.time()) < 5
    assert "health_sidecar_liveness_clock_seconds{" not in text  # no clock runs while healthy

    fake.fault(generation_status=500, generation_error="CUDA error: an illegal memory access")
    side.wait_status(503, WAIT + TIMEOUT + 2)
    text = side.metrics()
    assert metric(text, "health_sidecar_ready") == 0
    assert metric(text, "health_sidecar_endpoint_ready", endpoint="generate") == 0
    assert metric(text, "health_sidecar_canary_total", endpoint="generate", outcome="error") >= 2
    assert "illegal memory access" in side.health()[1]["reason"]
    # A 5xx is a hard failure: its liveness clock runs, and alerts can compare it to the window.
    clock = metric(
        text,
        "health_sidecar_liveness_clock_seconds",
        cause="canary failing hard",  # the exposition sorts labels
        endpoint="generate",
    )
    assert clock is not None
    assert 0 < clock < 120
    assert metric(text, "health_sidecar_liveness_window_seconds") == 120


def test_http_contract(engine, sidecar):
    fake = engine("vllm", "aggregated")
    env = {
        "SIDECAR_ENGINE_URL": fake.url,
        "DYN_SYSTEM_HEALTH_PATH": "/ready",
        "DYN_SYSTEM_LIVE_PATH": "/alive",
    }
    side = sidecar(env)
    side.wait_status(200, 5, path="/ready")
    ready = side.get("/ready")
    assert ready.headers["content-type"] == "application/json"
    body = ready.json()
    assert set(body["uptime"]) == {"secs", "nanos"}
    assert isinstance(body["uptime"]["secs"], int)
    assert side.get("/alive").json()["status"] == "live"
    assert side.get("/health").status_code == 404  # moved, like Dynamo
    assert side.get("/nope").status_code == 404
    assert side.http.post(f"{side.url}/ready").status_code == 405


def test_starting_status_ready_reports_ready_until_first_verdict(engine, sidecar):
    fake = engine("vllm", "aggregated")
    fake.fault(hang_generation=True)
    env = CANARY_ON | {
        "SIDECAR_ENGINE_URL": fake.url,
        "DYN_SYSTEM_STARTING_HEALTH_STATUS": "ready",
    }
    side = sidecar(env)
    assert side.get("/health").status_code == 200  # by decree, before any canary ended
    assert side.health()[1]["rule"] == "starting_status"
    side.wait_status(503, WAIT + TIMEOUT + 2)  # the first verdict: the hung canary


def test_probes_answer_in_milliseconds_while_the_engine_is_frozen(engine, sidecar):
    fake = engine("vllm", "aggregated")
    side = sidecar(CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url})
    side.wait_status(200, 5)
    fake.proc.signal(signal.SIGSTOP)
    slowest = 0.0
    for _ in range(50):
        start = time.monotonic()
        side.get("/health")
        side.get("/live")
        slowest = max(slowest, time.monotonic() - start)
    fake.proc.signal(signal.SIGCONT)
    assert slowest < 0.25, slowest  # two requests; never a canary's 0.5 s timeout


def test_sigterm_drains_until_the_engine_is_gone_then_exits_zero(engine, sidecar):
    fake = engine("vllm", "aggregated")
    side = sidecar(CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url, "SIDECAR_DRAIN_TIMEOUT": "30"})
    side.wait_status(200, 5)
    side.proc.signal(signal.SIGTERM)
    side.wait_status(503, 1)
    _status, body = side.health()
    assert body["rule"] == "draining"
    assert side.get("/live").status_code == 200
    assert metric(side.metrics(), "health_sidecar_draining") == 1
    assert side.proc.popen.poll() is None  # still serving while the engine drains
    fake.proc.kill()
    assert side.proc.popen.wait(3) == 0


def test_sigterm_exits_zero_when_the_grace_period_ends(engine, sidecar):
    fake = engine("vllm", "aggregated")
    side = sidecar({"SIDECAR_ENGINE_URL": fake.url, "SIDECAR_DRAIN_TIMEOUT": "1"})
    side.wait_status(200, 5)
    side.proc.signal(signal.SIGTERM)
    assert side.proc.popen.wait(4) == 0
    assert "drain: 1 s passed with the engine still up" in side.proc.output()
