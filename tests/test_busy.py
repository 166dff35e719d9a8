"""Busy is not hung: the sidecar reads the engine's own metrics (the fake engine's here), in-process
on a virtual clock (tests/support/inprocess.py), with a client's request held in the engine.

Timings: wait 1 s, canary timeout 0.5 s, stall window 2.5 s (the default: timeout + 2 s),
metrics read every 0.5 s (so a stall is suspected 1.5 s after the last read that showed the
counters move, and confirmed by one canary: notready within 2.5 s of the counters stopping).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.support.exposition import metric
from tests.support.inprocess import EngineLink, run_virtually, running, until

pytestmark = pytest.mark.unit

URL = "http://engine:8000"
STALL = 2.5
STEP = 0.01  # how often a timing test polls: its bounds allow one step
ENV = {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "SIDECAR_METRICS_INTERVAL": "0.5",
    "SIDECAR_ENGINE_URL": URL,
}


def generation(max_tokens: int) -> dict[str, object]:
    return {"model": "tiny", "prompt": "a long one", "max_tokens": max_tokens}


async def canaries_since(engine: EngineLink, since: float) -> list[float]:
    """When each canary since ``since`` reached the engine (virtual seconds)."""
    return [
        r["at"]
        for r in await engine.requests()
        if r["headers"].get("x-request-id", "").startswith("canary-") and r["at"] >= since
    ]


def test_busy_and_advancing_stays_ready_with_no_canary():
    async def main() -> None:
        engine = EngineLink("vllm", served=True)
        async with running(ENV, {URL: engine}) as side:
            await side.wait_status(200, 5)
            # 20 tokens a second for 6 s. (The fake spreads its latency over each request's
            # tokens, so a canary sent before the sidecar sees the load takes as long: its
            # timeout must be excused by the other request's progress, which must exceed what
            # the canary itself could move.)
            await engine.fault(latency=6.0)
            async with engine.in_flight("/v1/completions", generation(120)):
                start = side.now()
                assert await side.statuses(5.0) == {200}
                assert await canaries_since(engine, start + 0.5) == []  # no extra load
                _, body = await side.health_body()
                check = body["checks"]["generate"]
                assert check["in_flight"] >= 1
                assert check["progress"]["readable"] is True
                assert check["progress"]["stall_suspected"] is False
                assert body["reason"].startswith("generate: canary passed")

    run_virtually(main)


def test_long_prefill_with_moving_counters_never_reads_as_hung():
    env = ENV | {"SIDECAR_BACKEND": "sglang"}

    async def main() -> None:
        engine = EngineLink("sglang", served=True)
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await engine.fault(prefill_seconds=4 * STALL)  # a 10 s prefill, chunked
            native = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
            async with engine.in_flight("/generate", native) as request:
                seen = set()
                while not request.done():
                    seen.add((await side.get("/health")).status_code)
                    await asyncio.sleep(0.05)
                assert request.result().status_code == 200  # it ran its whole prefill
            assert seen == {200}
            stalled = metric(
                await side.metrics(), "health_sidecar_engine_stalled", endpoint="generate"
            )
            assert stalled == 0

    run_virtually(main)


def test_busy_and_stalled_is_notready_as_stalled_within_the_window():
    env = ENV | {"SIDECAR_LIVENESS_WINDOW": "60"}

    async def main() -> None:
        engine = EngineLink("vllm", served=True)
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await engine.fault(latency=20.0)
            async with engine.in_flight("/v1/completions", generation(40)):
                await asyncio.sleep(1.0)  # let it make progress first (virtual)
                await engine.fault(hang_generation=True)
                hung_at = side.now()
                await side.wait_status(503, STALL + 2, step=STEP)
                assert side.now() - hung_at <= STALL + STEP
                _, body = await side.health_body()
                check = body["checks"]["generate"]
                assert check["stalled"] is True
                # The stuck request (the canary sent to confirm the suspicion is not seen: a
                # hung vLLM freezes its gauges too).
                assert body["reason"].startswith("generate: stalled: 1 requests in flight")
                assert "the canary sent to confirm timed out" in body["reason"]
                assert "the engine's own health route still answers 200" in body["reason"]
                assert check["engine_health_agrees"] is False
                # A canary confirmed the suspicion; it left only after the counters went quiet.
                sent = await canaries_since(engine, hung_at)
                assert len(sent) == 1
                assert sent[0] - hung_at >= 0.5
                text = await side.metrics()
                assert metric(text, "health_sidecar_engine_stalled", endpoint="generate") == 1
                disagreements = metric(
                    text,
                    "health_sidecar_engine_health_disagreements_total",
                    endpoint="generate",
                    engine_says="ready",
                )
                assert disagreements == 1
                assert (await side.get("/live")).status_code == 200  # not yet a restart
                # Released, and fast again (the fake spreads its latency over a request's
                # tokens, so a 1-token canary would otherwise take the whole 20 s).
                await engine.fault(hang_generation=False, latency=0)
                await side.wait_status(200, 2)

    run_virtually(main)


def test_idle_engine_gets_canaries():
    async def main() -> None:
        engine = EngineLink("vllm", served=True)
        async with running(ENV, {URL: engine}) as side:
            await side.wait_status(200, 5)
            start = side.now()

            async def two() -> bool:
                return len(await canaries_since(engine, start)) >= 2

            await until(two, 3.5, what="two idle canaries")
            _, body = await side.health_body()
            assert body["checks"]["generate"]["in_flight"] == 0

    run_virtually(main)


def test_unchunked_long_prefill_reads_as_stalled():
    """The documented limit: work in flight whose counters stand still longer than the stall
    window looks hung. Raise SIDECAR_STALL_WINDOW above the longest silent step."""

    async def main() -> None:
        engine = EngineLink("vllm", served=True)
        async with running(ENV, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await after_a_canary(engine)
            await engine.fault(prefill_seconds=3 * STALL, prefill_progress=False)
            async with engine.in_flight("/v1/completions", generation(1)):
                arrived_at = side.now()
                await side.wait_status(503, STALL + 2, step=STEP)
                assert side.now() - arrived_at <= STALL + STEP
                assert "stalled" in (await side.health_body())[1]["reason"]
                await engine.fault(prefill_seconds=0)  # the confirming canaries needed it too
            await side.wait_status(200, 3)

    run_virtually(main)


async def after_a_canary(engine: EngineLink) -> None:
    """Return just after the next canary reached the (idle) engine."""
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def sent() -> bool:
        return bool(await canaries_since(engine, start))

    await until(sent, 2.0, STEP, "the next canary")


@pytest.mark.parametrize("phase", [0.0, 0.25, 0.7, 0.9])
def test_unchunked_long_prefill_reads_as_hung_wherever_it_arrives(phase):
    """The same limit, the request arriving ``phase`` seconds after an idle canary (wait 1 s,
    metrics read every 0.5 s): notready within the stall window of its arrival wherever it
    lands. Arriving after the last read before the next routine canary is due, the request is
    not seen when that canary leaves: it queues behind the prefill, and its timeout with no
    progress since it left decides first, by the hang rule ("canary timeout") rather than as a
    confirmed stall."""

    async def main() -> None:
        engine = EngineLink("vllm", served=True)
        async with running(ENV, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await after_a_canary(engine)
            await asyncio.sleep(phase)
            await engine.fault(prefill_seconds=3 * STALL, prefill_progress=False)
            async with engine.in_flight("/v1/completions", generation(1)):
                arrived_at = side.now()
                await side.wait_status(503, STALL + 2, step=STEP)
                assert side.now() - arrived_at <= STALL + STEP
                _, body = await side.health_body()
                if phase < 0.5:
                    assert body["reason"].startswith("generate: stalled: 2 requests in flight")
                    assert body["checks"]["generate"]["stalled"] is True
                else:
                    assert body["reason"].startswith(
                        "generate: canary timeout: no complete answer within 0.5 s, with 2 "
                        "requests in flight and no engine progress since it was sent"
                    ), body["reason"]
                    assert body["checks"]["generate"]["stalled"] is False
                await engine.fault(prefill_seconds=0)
            await side.wait_status(200, 3)

    run_virtually(main)
