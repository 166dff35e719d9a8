"""Data-parallel ranks end to end: the sidecar and the fake engine (``--dp-size``) as real
processes over loopback. The real vLLM with two ranks: tests/test_vllm_dp.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.harness import wait_until

CANARY_ON = {"DYN_HEALTH_CHECK_ENABLED": "true"}


def canaries(fake, path: str) -> list[dict[str, Any]]:
    return [r for r in fake.requests() if r["path"] == path]


@pytest.mark.parametrize("count", ["2", "auto"])
def test_vllm_each_rank_its_own_canary_and_a_wedged_rank_is_notready(engine, sidecar, count):
    fake = engine("vllm", "aggregated", "--dp-size", "2")
    side = sidecar(CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url, "SIDECAR_DP_RANKS": count})
    wait_until(lambda: side.health()[1].get("ranks"), 5, what="the ranks")
    side.wait_status(200, 5)
    _, body = side.health()
    assert body["reason"] == "generate: 2 of 2 ranks ready"
    pins = {r["headers"].get("x-data-parallel-rank") for r in canaries(fake, "/v1/completions")}
    assert {"0", "1"} <= pins
    fake.fault(hang_ranks=[1])
    side.wait_status(503, 5)
    _, body = side.health()
    assert body["reason"].startswith(
        "generate: 1 of 2 ranks ready, 2 required; generate/rank1: canary timeout"
    ), body["reason"]
    assert body["ranks"]["generate"]["notready"] == ["generate/rank1"]
    assert "the engine's own health route still answers 200" in body["reason"]
    assert side.get("/live").status_code == 200
    metrics = side.metrics()
    assert 'health_sidecar_rank_ready{endpoint="generate",rank="1"} 0.0' in metrics
    assert 'health_sidecar_rank_ready{endpoint="generate",rank="0"} 1.0' in metrics
    fake.fault(hang_ranks=[])
    side.wait_status(200, 5)


def test_with_one_rank_required_the_worker_stays_ready_degraded(engine, sidecar):
    fake = engine("vllm", "aggregated", "--dp-size", "2")
    side = sidecar(
        CANARY_ON
        | {
            "SIDECAR_ENGINE_URL": fake.url,
            "SIDECAR_DP_RANKS": "2",
            "SIDECAR_DP_MIN_READY_RANKS": "1",
        }
    )
    side.wait_status(200, 5)
    fake.fault(hang_ranks=[1])
    wait_until(lambda: side.health()[1]["ranks"]["generate"]["degraded"], 5, what="degraded")
    status, body = side.health()
    assert status == 200
    assert body["reason"].startswith("generate: degraded: 1 of 2 ranks ready, 1 required")
    assert 'health_sidecar_endpoint_degraded{endpoint="generate"} 1.0' in side.metrics()
    assert "generate: endpoint degraded" in side.proc.output()
    fake.fault(hang_ranks=[1, 0])  # and the last rank too: notready
    side.wait_status(503, 5)
    fake.fault(hang_ranks=[])
    side.wait_status(200, 5)
    wait_until(lambda: not side.health()[1]["ranks"]["generate"]["degraded"], 5, what="whole")


def test_a_wedged_rank_clock_runs_for_liveness(engine, sidecar):
    """One server cannot restart one rank: a rank wedged for the whole window fails /live, even
    while the policy keeps the worker ready."""
    fake = engine("vllm", "aggregated", "--dp-size", "2")
    side = sidecar(
        CANARY_ON
        | {
            "SIDECAR_ENGINE_URL": fake.url,
            "SIDECAR_DP_RANKS": "2",
            "SIDECAR_DP_MIN_READY_RANKS": "1",
            "SIDECAR_LIVENESS_WINDOW": "2",
        }
    )
    side.wait_status(200, 5)
    fake.fault(hang_ranks=[1])
    side.wait_status(503, 6, path="/live")
    assert side.get("/live").json()["reason"].startswith("generate/rank1: canary failing hard")
    assert side.get("/health").status_code == 200


def test_sglang_pins_with_its_body_field(engine, sidecar):
    fake = engine("sglang", "aggregated", "--dp-size", "2")
    side = sidecar(
        CANARY_ON
        | {"SIDECAR_ENGINE_URL": fake.url, "SIDECAR_BACKEND": "sglang", "SIDECAR_DP_RANKS": "2"}
    )
    side.wait_status(200, 5)
    pinned = {r["json"].get("data_parallel_rank") for r in canaries(fake, "/generate")}
    assert pinned == {0, 1}
    fake.fault(hang_ranks=[0])
    side.wait_status(503, 5)
    assert "generate/rank0: canary timeout" in side.health()[1]["reason"]
    fake.fault(hang_ranks=[])
    side.wait_status(200, 5)
