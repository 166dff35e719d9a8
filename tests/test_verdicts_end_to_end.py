"""Verdicts that were once wrong, one test each, run as a user runs them: the sidecar and the
fake engine as processes over loopback.

Timings: wait 1 s, canary timeout 0.5 s, metrics read every 1 s, stall window 2.5 s.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.exposition import metric
from tests.support.harness import ROOT, FakeEngine, Sidecar, wait_until

CANARY_ON = {"DYN_HEALTH_CHECK_ENABLED": "true"}


def hold(side: Sidecar, seconds: float, path: str = "/health") -> set[int]:
    """Every status ``path`` answered over ``seconds``."""
    seen = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.add(side.get(path).status_code)
        time.sleep(0.05)
    return seen


@contextmanager
def in_flight(fake: FakeEngine, body: dict, path: str = "/v1/completions") -> Iterator[None]:
    """One request held open in the engine while the test watches."""
    client = httpx.Client(timeout=60, trust_env=False)

    def send() -> None:
        with contextlib.suppress(httpx.HTTPError):  # ended by the test or the engine
            client.post(f"{fake.url}{path}", json=body)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()

    def arrived() -> bool:  # this very request, not a canary
        return any(r["path"] == path and r["json"] == body for r in fake.requests())

    wait_until(arrived, 2, what="the request to reach the engine")
    try:
        yield
    finally:
        fake.fault(hang_generation=False)
        client.close()
        thread.join(5)


# 1. A malformed answer is a failure whatever the counters do --------------------------------------
@pytest.mark.parametrize("arrival", [False, True])
@pytest.mark.parametrize("garbage", ["no_finish_reason", "wrong_token_count"])
def test_broken_answers_are_not_hidden_by_the_engines_counters(engine, sidecar, garbage, arrival):
    fake = engine("vllm", "aggregated", *(["--prompt-on-arrival"] if arrival else []))
    side = sidecar(CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url})
    side.wait_status(200, 5)
    fake.fault(garbage=garbage)
    took = side.wait_status(503, 3.0)  # two failures: within wait + retry + a little
    print(f"FINDING1 {garbage} arrival={arrival}: notready in {took:.2f} s")
    assert hold(side, 3.0) == {503}  # and it stays so: no flapping
    _, body = side.health()
    assert body["checks"]["generate"]["last_canary"]["outcome"] == "invalid"
    assert body["checks"]["generate"]["progress"]["readable"] is True  # progress on, as default


# 3. Metrics served gzip-compressed are read -------------------------------------------------------
@pytest.mark.parametrize(
    ("backend", "gzip"), [("sglang", "auto"), ("trtllm", "auto"), ("vllm", "always")]
)
def test_compressed_metrics_are_read_and_a_busy_engine_stays_ready(engine, sidecar, backend, gzip):
    fake = engine(backend, "aggregated", "--metrics-gzip", gzip)
    side = sidecar(CANARY_ON | {"SIDECAR_BACKEND": backend, "SIDECAR_ENGINE_URL": fake.url})
    side.wait_status(200, 5)
    wait_until(
        lambda: side.health()[1]["checks"]["generate"]["progress"]["readable"], 3, what="readable"
    )
    # Busy: a long request whose counters move (20 tokens a second); a canary queues behind it
    # (the fake engine spreads its latency over each request), so a sidecar that cannot read the
    # metrics counts its timeouts and goes notready.
    fake.fault(latency=8.0)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 160}
    native = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 160}}
    with in_flight(
        fake,
        native if backend == "sglang" else body,
        "/generate" if backend == "sglang" else "/v1/completions",
    ):
        assert hold(side, 4.0) == {200}
        check = side.health()[1]["checks"]["generate"]
        assert check["in_flight"] >= 1
        assert check["progress"]["stall_suspected"] is False
    fake.fault(latency=0)


# A handoff whose peer never answers: the request waits for its KV with no timeout.
PARKED = {
    "model": "tiny",
    "prompt": [1, 2, 3],
    "max_tokens": 4,
    "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [0]},
}


def decode_sidecar(sidecar, fake: FakeEngine) -> Sidecar:
    """A ready sidecar watching ``fake`` as a decode worker, with a 3 s liveness window."""
    side = sidecar(
        CANARY_ON
        | {
            "SIDECAR_DISAGGREGATION_MODE": "decode",
            "SIDECAR_ENGINE_URL": fake.url,
            "SIDECAR_LIVENESS_WINDOW": "3",
        }
    )
    side.wait_status(200, 5)
    return side


# 4 and 10. A decode worker whose request waits for a KV transfer is healthy -----------------------
def test_a_decode_worker_waiting_on_its_prefill_peer_stays_ready_and_live(engine, sidecar):
    fake = engine("vllm", "decode")
    side = decode_sidecar(sidecar, fake)
    with in_flight(fake, PARKED):
        start = time.time()
        # Past the stall window and two liveness windows: ready and live throughout.
        assert hold(side, 7.0) == {200}
        assert side.get("/live").status_code == 200
        _, health = side.health()
        check = health["checks"]["generate"]
        assert check["progress"]["waiting_outside_engine"] is True
        assert check["progress"]["waiting_for_kv_transfer"] == 1
        assert "waiting for a KV transfer from a prefill peer" in health["reason"]
        assert check["stalled"] is False
        canaries = [
            r for r in fake.requests()
            if r["headers"].get("x-request-id", "").startswith("canary-") and r["time"] >= start
        ]  # fmt: skip
        assert 2 <= len(canaries) <= 9  # the parked work gets canaries every wait, not more


def test_gauges_without_counters_leave_the_decision_to_the_canary(engine, sidecar):
    """As some TensorRT-LLM releases publish: in-flight gauges under the listed names, counters
    under others. Not readable progress: said once, and the canary alone decides."""
    fake = engine("vllm", "decode")
    fake.fault(hide_counters=True)
    side = decode_sidecar(sidecar, fake)

    def progress() -> dict:
        return side.health()[1]["checks"]["generate"]["progress"]

    wait_until(lambda: progress()["detail"] != "not read yet", 3, what="a metrics read")
    assert progress()["readable"] is False
    assert progress()["detail"].startswith("in-flight gauges but none of the progress counters")
    assert side.proc.output().count("engine progress unknown (in-flight gauges but none") == 1
    with in_flight(fake, PARKED):  # work in flight that never progresses
        assert hold(side, 5.0) == {200}
        assert side.get("/live").status_code == 200
    text = side.metrics()
    assert metric(text, "health_sidecar_engine_progress_readable", endpoint="generate") == 0
    assert metric(text, "health_sidecar_canary_total", endpoint="generate", outcome="timeout") == 0


# 5. An encode worker is never judged by progress --------------------------------------------------
def test_the_encode_profile_with_a_stuck_request_stays_ready_and_live(engine, sidecar):
    fake = engine("vllm", "encode")
    env = {
        k: v
        for k, v in (
            line.split("=", 1)
            for line in Path(ROOT, "config/vllm-encode.env").read_text().splitlines()
            if line and not line.startswith("#")
        )
        if k not in ("DYN_SYSTEM_PORT", "SIDECAR_ENGINE_URL")
    }
    side = sidecar(env | {"SIDECAR_ENGINE_URL": fake.url, "SIDECAR_LIVENESS_WINDOW": "2"})
    side.wait_status(200, 5)
    fake.fault(hang_generation=True)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": [image]}], "max_tokens": 1}
    with in_flight(fake, chat, "/v1/chat/completions"):
        assert hold(side, 6.0) == {200}
        assert side.get("/live").status_code == 200
        _, body = side.health()
        assert body["checks"]["generate"]["canary"] == "disabled"
        assert body["checks"]["generate"]["progress"]["readable"] is False  # not even read


# 6. Liveness holds while the engine's health route answers 503 ------------------------------------
def test_liveness_never_fails_or_flaps_while_the_engine_answers_503(engine, sidecar):
    fake = engine("vllm", "aggregated")
    side = sidecar(CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url, "SIDECAR_LIVENESS_WINDOW": "1"})
    side.wait_status(200, 5)
    fake.fault(hang_generation=True)
    with in_flight(fake, {"model": "tiny", "prompt": "x", "max_tokens": 1}):
        fake.fault(health_status=503)  # loading, or draining
        side.wait_status(503, 3)
        assert hold(side, 5.0, path="/live") == {200}  # five liveness windows


# 7. Smaller faults --------------------------------------------------------------------------------
def test_the_live_reason_names_the_running_cause_and_quotes_its_current_reason(engine, sidecar):
    fake = engine("vllm", "aggregated")
    side = sidecar(CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url, "SIDECAR_LIVENESS_WINDOW": "2"})
    side.wait_status(200, 5)
    fake.fault(generation_status=500, generation_error="first text")
    side.wait_status(503, 3, path="/live")
    fake.fault(generation_error="second text")
    wait_until(lambda: "second text" in side.get("/live").json()["reason"], 3, what="new reason")
    live = side.get("/live").json()
    assert live["cause"] == "canary failing hard"
    assert "first text" not in live["reason"]


def test_the_sidecars_own_probe_reads_the_monitors_heartbeat(engine, sidecar):
    fake = engine("vllm", "aggregated")
    side = sidecar(CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url})
    answer = side.get("/sidecar/live")
    assert answer.status_code == 200
    assert answer.json()["monitor_heartbeat_age_seconds"] < 2
    fake.proc.signal(signal.SIGSTOP)  # the engine frozen: the sidecar itself stays alive
    try:
        assert hold(side, 2.0, path="/sidecar/live") == {200}
    finally:
        fake.proc.signal(signal.SIGCONT)


def test_one_health_body_is_consistent_with_itself(engine, sidecar):
    fake = engine("vllm", "aggregated")
    side = sidecar(CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url})
    side.wait_status(200, 5)
    fake.fault(garbage="no_finish_reason")
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:  # across the change of verdict
        body = side.get("/health").json()
        assert (body["status"] == "ready") == (body["endpoints"]["generate"] == "ready")
        time.sleep(0.01)


# 9. One slow answer of the engine's own health route under load -----------------------------------
def test_a_slow_health_route_while_the_engine_progresses_does_not_deregister(engine, sidecar):
    fake = engine("vllm", "aggregated")
    side = sidecar(CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url})
    side.wait_status(200, 5)
    fake.fault(latency=12.0)  # a long generation: counters move, 20 tokens a second
    with in_flight(fake, {"model": "tiny", "prompt": "x", "max_tokens": 240}):
        wait_until(  # the sidecar has seen the counters move
            lambda: side.health()[1]["checks"]["generate"]["last_progress_time"], 3, what="progress"
        )
        fake.fault(health_latency=0.8)  # its /health answers after the 0.5 s deadline
        assert hold(side, 5.0) == {200}
        _, body = side.health()
        assert "it is busy" in body["checks"]["generate"]["registration"]
    fake.fault(health_latency=0, latency=0)
