"""What the sidecar serves, value by value: its Prometheus metrics while healthy and while the
engine fails hard, and the HTTP contract of its routes (Dynamo's paths and body). In-process on
a virtual clock (tests/support/inprocess.py), against the fake engine's own app.

Timings: DYN_CANARY_WAIT_TIME=1, DYN_HEALTH_CHECK_REQUEST_TIMEOUT=0.5, retry 1 s, failure
threshold 2. The same routes served by uvicorn over loopback: tests/test_e2e_fake.py.
"""

from __future__ import annotations

import time

import pytest

from tests.support.exposition import metric
from tests.support.inprocess import EngineLink, run_virtually, running, until

pytestmark = pytest.mark.unit

URL = "http://engine:8000"
WAIT, TIMEOUT = 1.0, 0.5
CANARY_ON = {"DYN_HEALTH_CHECK_ENABLED": "true", "SIDECAR_ENGINE_URL": URL}


def test_metrics():
    async def main() -> None:
        engine = EngineLink("vllm", served=True)
        async with running(CANARY_ON, {URL: engine}) as side:
            await side.wait_status(200, 5)

            async def two_passed() -> bool:
                text = await side.metrics()
                passed = metric(
                    text, "health_sidecar_canary_total", endpoint="generate", outcome="success"
                )
                return (passed or 0) >= 2

            await until(two_passed, WAIT + 2, what="two passed canaries")
            text = await side.metrics()
            assert metric(text, "health_sidecar_ready") == 1
            assert metric(text, "health_sidecar_live") == 1
            assert metric(text, "health_sidecar_endpoint_ready", endpoint="generate") == 1
            timeouts = metric(
                text, "health_sidecar_canary_total", endpoint="generate", outcome="timeout"
            )
            assert timeouts == 0
            count = metric(
                text, "health_sidecar_canary_duration_seconds_count", endpoint="generate"
            )
            assert (count or 0) >= 2
            stamp = metric(
                text, "health_sidecar_last_canary_success_timestamp_seconds", endpoint="generate"
            )
            assert stamp is not None
            assert abs(stamp - time.time()) < 5  # wall time, for dashboards
            assert "health_sidecar_liveness_clock_seconds{" not in text  # none while healthy

            await engine.fault(
                generation_status=500, generation_error="CUDA error: an illegal memory access"
            )
            await side.wait_status(503, WAIT + TIMEOUT + 2)
            text = await side.metrics()
            assert metric(text, "health_sidecar_ready") == 0
            assert metric(text, "health_sidecar_endpoint_ready", endpoint="generate") == 0
            errors = metric(
                text, "health_sidecar_canary_total", endpoint="generate", outcome="error"
            )
            assert (errors or 0) >= 2
            assert "illegal memory access" in (await side.health_body())[1]["reason"]
            # A 5xx is a hard failure: its liveness clock runs, and alerts can compare it to the
            # window.
            clock = metric(
                text,
                "health_sidecar_liveness_clock_seconds",
                cause="canary failing hard",  # the exposition sorts labels
                endpoint="generate",
            )
            assert clock is not None
            assert 0 < clock < 120
            assert metric(text, "health_sidecar_liveness_window_seconds") == 120

    run_virtually(main)


def test_http_contract():
    env = {
        "SIDECAR_ENGINE_URL": URL,
        "DYN_SYSTEM_HEALTH_PATH": "/ready",
        "DYN_SYSTEM_LIVE_PATH": "/alive",
    }

    async def main() -> None:
        engine = EngineLink("vllm", served=True)
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5, path="/ready")
            ready = await side.get("/ready")
            assert ready.headers["content-type"] == "application/json"
            body = ready.json()
            assert set(body["uptime"]) == {"secs", "nanos"}
            assert isinstance(body["uptime"]["secs"], int)
            assert (await side.get("/alive")).json()["status"] == "live"
            assert (await side.get("/health")).status_code == 404  # moved, like Dynamo
            assert (await side.get("/nope")).status_code == 404
            assert (await side.http.post("/ready")).status_code == 405

    run_virtually(main)
