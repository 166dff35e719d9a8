"""Data-parallel ranks against the fake engine's ranks (``dp_size``), in-process on a virtual clock
(tests/support/inprocess.py): a canary pinned to each rank, a wedged rank, the degraded policy
and a wedged rank's liveness clock. The rank policy as tables: tests/test_ranks.py; the real vLLM
with two ranks: tests/test_vllm_dp.py.

Timings: wait 1 s, canary timeout 0.5 s, retry 1 s.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.inprocess import EngineLink, run_virtually, running, until

pytestmark = pytest.mark.unit

URL = "http://engine:8000"
WAIT, TIMEOUT, RETRY = 1.0, 0.5, 1.0
STEP = 0.01  # how often a timing test polls: its bounds allow one step
CANARY_ON = {"DYN_HEALTH_CHECK_ENABLED": "true", "SIDECAR_ENGINE_URL": URL}


async def canaries(engine: EngineLink, path: str) -> list[dict[str, Any]]:
    return [r for r in await engine.requests() if r["path"] == path]


@pytest.mark.parametrize("count", ["2", "auto"])
def test_vllm_each_rank_its_own_canary_and_a_wedged_rank_is_notready(count):
    env = CANARY_ON | {"SIDECAR_DP_RANKS": count}

    async def main() -> None:
        engine = EngineLink("vllm", served=True, dp_size=2)
        async with running(env, {URL: engine}) as side:

            async def ranks() -> bool:
                return bool((await side.health_body())[1].get("ranks"))

            await until(ranks, 5, what="the ranks")
            await side.wait_status(200, 5)
            _, body = await side.health_body()
            assert body["reason"] == "generate: 2 of 2 ranks ready"
            pins = {
                r["headers"].get("x-data-parallel-rank")
                for r in await canaries(engine, "/v1/completions")
            }
            assert {"0", "1"} <= pins
            await engine.fault(hang_ranks=[1])
            wedged_at = side.now()
            await side.wait_status(503, 5, step=STEP)
            # Its next canary, at most wait later, times out with the rank's series frozen.
            assert side.now() - wedged_at <= WAIT + TIMEOUT + STEP
            _, body = await side.health_body()
            assert body["reason"].startswith(
                "generate: 1 of 2 ranks ready, 2 required; generate/rank1: canary timeout"
            ), body["reason"]
            assert body["ranks"]["generate"]["notready"] == ["generate/rank1"]
            assert "the engine's own health route still answers 200" in body["reason"]
            assert (await side.get("/live")).status_code == 200
            metrics = await side.metrics()
            assert 'health_sidecar_rank_ready{endpoint="generate",rank="1"} 0.0' in metrics
            assert 'health_sidecar_rank_ready{endpoint="generate",rank="0"} 1.0' in metrics
            await engine.fault(hang_ranks=[])
            released_at = side.now()
            await side.wait_status(200, 5, step=STEP)
            assert side.now() - released_at <= RETRY + STEP

    run_virtually(main)


def test_with_one_rank_required_the_worker_stays_ready_degraded():
    env = CANARY_ON | {"SIDECAR_DP_RANKS": "2", "SIDECAR_DP_MIN_READY_RANKS": "1"}

    async def main() -> None:
        engine = EngineLink("vllm", served=True, dp_size=2)
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await engine.fault(hang_ranks=[1])

            async def degraded() -> bool:
                return bool((await side.health_body())[1]["ranks"]["generate"]["degraded"])

            await until(degraded, 5, what="degraded")
            status, body = await side.health_body()
            assert status == 200
            assert body["reason"].startswith("generate: degraded: 1 of 2 ranks ready, 1 required")
            assert await side.statuses(5.0) == {200}  # and it stays ready
            assert 'health_sidecar_endpoint_degraded{endpoint="generate"} 1.0' in (
                await side.metrics()
            )
            assert any("generate: endpoint degraded" in line for line in side.log), side.log
            await engine.fault(hang_ranks=[1, 0])  # and the last rank too: notready
            await side.wait_status(503, 5)
            await engine.fault(hang_ranks=[])
            await side.wait_status(200, 5)

            async def whole() -> bool:
                return not (await side.health_body())[1]["ranks"]["generate"]["degraded"]

            await until(whole, 5, what="whole again")

    run_virtually(main)


def test_a_wedged_rank_clock_runs_for_liveness():
    """One server cannot restart one rank: a rank wedged for the whole window fails /live, even
    while the policy keeps the worker ready."""
    env = CANARY_ON | {
        "SIDECAR_DP_RANKS": "2",
        "SIDECAR_DP_MIN_READY_RANKS": "1",
        "SIDECAR_LIVENESS_WINDOW": "2",
    }
    window = 2.0

    async def main() -> None:
        engine = EngineLink("vllm", served=True, dp_size=2)
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await engine.fault(hang_ranks=[1])
            wedged_at = side.now()
            await side.wait_status(503, 6, path="/live", step=STEP)
            # The rank's hard-failure clock starts with its first failed canary (at most
            # wait + retry after the wedge) and runs the whole window: never sooner.
            assert window <= side.now() - wedged_at <= WAIT + RETRY + window + STEP
            live = (await side.get("/live")).json()
            assert live["reason"].startswith("generate/rank1: canary failing hard")
            assert (await side.get("/health")).status_code == 200

    run_virtually(main)


def test_sglang_pins_with_its_body_field():
    env = CANARY_ON | {"SIDECAR_BACKEND": "sglang", "SIDECAR_DP_RANKS": "2"}

    async def main() -> None:
        engine = EngineLink("sglang", served=True, dp_size=2)
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            pinned = {
                r["json"].get("data_parallel_rank") for r in await canaries(engine, "/generate")
            }
            assert pinned == {0, 1}
            await engine.fault(hang_ranks=[0])
            wedged_at = side.now()
            await side.wait_status(503, 5, step=STEP)
            assert side.now() - wedged_at <= WAIT + TIMEOUT + STEP
            assert "generate/rank0: canary timeout" in (await side.health_body())[1]["reason"]
            await engine.fault(hang_ranks=[])
            await side.wait_status(200, 5)

    run_virtually(main)
