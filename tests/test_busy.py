"""Busy is not hung: the sidecar reads the engine's own metrics (the fake engine's here).

Timings: wait 1 s, canary timeout 0.5 s, stall window 2.5 s (the default: timeout + 2 s),
metrics read every 0.5 s (so a stall is suspected 1.5 s after the last read that showed the
counters move, and confirmed by one canary: notready within 2.5 s of the counters stopping).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tests.support.exposition import metric
from tests.support.harness import FakeEngine, wait_until

STALL = 2.5
ENV = {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "SIDECAR_METRICS_INTERVAL": "0.5",
}


@contextmanager
def background_request(fake: FakeEngine, max_tokens: int) -> Iterator[threading.Thread]:
    """One real generation request in flight while the test watches the sidecar."""

    def send() -> None:
        with httpx.Client(timeout=60, trust_env=False) as client:
            client.post(
                f"{fake.url}/v1/completions",
                json={"model": "tiny", "prompt": "a long one", "max_tokens": max_tokens},
            )

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    wait_until(lambda: fake.http.get(f"{fake.url}/_fake/state").json()["running"] >= 1, 2)
    try:
        yield thread
    finally:
        fake.fault(hang_generation=False)
        thread.join(30)


def canaries_since(fake: FakeEngine, since: float) -> int:
    return sum(
        1
        for r in fake.requests()
        if r["headers"].get("x-request-id", "").startswith("canary-") and r["time"] >= since
    )


def watch(side, seconds: float) -> set[int]:
    """Every /health status seen over ``seconds``."""
    seen = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.add(side.get("/health").status_code)
        time.sleep(0.05)
    return seen


def test_busy_and_advancing_stays_ready_with_no_canary(engine, sidecar):
    fake = engine("vllm", "aggregated")
    side = sidecar(ENV | {"SIDECAR_ENGINE_URL": fake.url})
    side.wait_status(200, 5)
    # 20 tokens a second for 6 s. (The fake spreads its latency over each request's tokens, so a
    # canary sent before the sidecar sees the load takes as long: its timeout must be excused by
    # the other request's progress, which must exceed what the canary itself could move.)
    fake.fault(latency=6.0)
    with background_request(fake, 120):
        start = time.time()
        assert watch(side, 5.0) == {200}
        assert canaries_since(fake, start + 0.5) == 0  # a busy engine gets no extra load
        _, body = side.health()
        check = body["checks"]["generate"]
        assert check["in_flight"] >= 1
        assert check["progress"]["readable"] is True
        assert check["progress"]["stall_suspected"] is False
        assert body["reason"].startswith("generate: canary passed")


def test_long_prefill_with_moving_counters_never_reads_as_hung(engine, sidecar):
    fake = engine("sglang", "aggregated")
    side = sidecar(ENV | {"SIDECAR_BACKEND": "sglang", "SIDECAR_ENGINE_URL": fake.url})
    side.wait_status(200, 5)
    fake.fault(prefill_seconds=4 * STALL)  # a 10 s prefill, chunked: counters move
    with background_request(fake, 1) as request:
        seen = set()
        while request.is_alive():
            seen.add(side.get("/health").status_code)
            time.sleep(0.05)
    assert seen == {200}
    assert metric(side.metrics(), "health_sidecar_engine_stalled", endpoint="generate") == 0


def test_busy_and_stalled_is_notready_as_stalled_within_the_window(engine, sidecar):
    fake = engine("vllm", "aggregated")
    side = sidecar(ENV | {"SIDECAR_ENGINE_URL": fake.url, "SIDECAR_LIVENESS_WINDOW": "60"})
    side.wait_status(200, 5)
    fake.fault(latency=20.0)
    with background_request(fake, 40):
        time.sleep(1.0)  # let it make progress first
        fake.fault(hang_generation=True)
        hung_at = time.time()
        elapsed = side.wait_status(503, STALL + 2)
        print(f"STALL detect {elapsed:.2f} s (window {STALL} s)")
        assert elapsed <= STALL + 0.5
        _, body = side.health()
        check = body["checks"]["generate"]
        assert check["stalled"] is True
        # The stuck request (the canary sent to confirm the suspicion is not seen: a hung vLLM
        # freezes its gauges too).
        assert body["reason"].startswith("generate: stalled: 1 requests in flight")
        assert "the canary sent to confirm timed out" in body["reason"]
        assert "the engine's own health route still answers 200" in body["reason"]
        assert check["engine_health_agrees"] is False
        # A canary confirmed the suspicion; it left only after the counters went quiet.
        sent = [
            r["time"]
            for r in fake.requests()
            if r["headers"].get("x-request-id", "").startswith("canary-") and r["time"] >= hung_at
        ]
        assert sent
        assert sent[0] - hung_at >= 0.5
        text = side.metrics()
        assert metric(text, "health_sidecar_engine_stalled", endpoint="generate") == 1
        assert (
            metric(
                text,
                "health_sidecar_engine_health_disagreements_total",
                endpoint="generate",
                engine_says="ready",
            )
            == 1
        )
        assert side.get("/live").status_code == 200  # hung briefly: not yet a restart
        # Released, and fast again (the fake spreads its latency over a request's tokens, so a
        # 1-token canary would otherwise take the whole 20 s).
        fake.fault(hang_generation=False, latency=0)
        side.wait_status(200, 2)


def test_idle_engine_gets_canaries(engine, sidecar):
    fake = engine("vllm", "aggregated")
    side = sidecar(ENV | {"SIDECAR_ENGINE_URL": fake.url})
    side.wait_status(200, 5)
    start = time.time()
    wait_until(lambda: canaries_since(fake, start) >= 2, 3.5, what="two idle canaries")
    _, body = side.health()
    assert body["checks"]["generate"]["in_flight"] == 0


def test_unchunked_long_prefill_reads_as_stalled(engine, sidecar):
    """The documented limit: work in flight whose counters stand still longer than the stall
    window looks hung. Raise SIDECAR_STALL_WINDOW above the longest silent step."""
    fake = engine("vllm", "aggregated")
    side = sidecar(ENV | {"SIDECAR_ENGINE_URL": fake.url})
    side.wait_status(200, 5)
    fake.fault(prefill_seconds=3 * STALL, prefill_progress=False)
    with background_request(fake, 1):
        side.wait_status(503, STALL + 2)
        assert "stalled" in side.health()[1]["reason"]
        fake.fault(prefill_seconds=0)  # the confirming canaries needed the same prefill
    side.wait_status(200, 3)
