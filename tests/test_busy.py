"""Busy is not hung: the sidecar reads the engine's own metrics (the fake engine's here), in-process
on a virtual clock (tests/support/inprocess.py), with a client's request held in the engine.

Timings: wait 1 s, canary timeout 0.5 s, metrics read every 0.5 s, and so (the defaults derived
from them, sidecar/core/evidence/policy.py) a stall window of 1.25 s: timeout + half the wait, at
least 0.75 s. While work is in flight the metrics are read every 0.25 s; a stall is suspected 0.5 s
after the last read that showed the counters move, and confirmed by one canary: notready within
1.25 s of the counters stopping.
"""

from __future__ import annotations

import asyncio

import pytest

from sidecar.wiring import policy_of
from tests.support.exposition import metric
from tests.support.inprocess import EngineLink, run_virtually, running, settings_of, until

pytestmark = pytest.mark.unit

URL = "http://engine:8000"
STEP = 0.01  # how often a timing test polls: its bounds allow one step
ENV = {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "SIDECAR_METRICS_INTERVAL": "0.5",
    "SIDECAR_ENGINE_URL": URL,
}
POLICY = policy_of(settings_of(ENV))
STALL = POLICY.stall_window
# A silent step that begins as its request reaches an idle engine: the first read that sees the
# request comes up to one (idle) metrics interval later.
FROM_IDLE = POLICY.to_stalled_from_idle().seconds
assert (STALL, POLICY.busy_metrics_interval, POLICY.suspect_after) == (1.25, 0.25, 0.5)


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
            await engine.fault(prefill_seconds=8 * STALL)  # a 10 s prefill, chunked
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
            await engine.fault(latency=4.0)  # a token every 0.1 s
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
                # A canary confirmed the suspicion; it left only after the counters went quiet:
                # the quiet spell counts from the last read that showed them move, at most one
                # busy read before the hang.
                sent = await canaries_since(engine, hung_at)
                assert len(sent) == 1
                assert sent[0] - hung_at >= POLICY.suspect_after - POLICY.busy_metrics_interval
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
    window looks hung. Raise SIDECAR_STALL_WINDOW above the longest silent step. The step begins
    as its request reaches an idle engine: notready within ``to_stalled_from_idle()``."""

    async def main() -> None:
        engine = EngineLink("vllm", served=True)
        async with running(ENV, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await after_a_canary(engine)
            await engine.fault(prefill_seconds=3 * STALL, prefill_progress=False)
            async with engine.in_flight("/v1/completions", generation(1)):
                arrived_at = side.now()
                await side.wait_status(503, FROM_IDLE + 2, step=STEP)
                assert side.now() - arrived_at <= FROM_IDLE + STEP
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
    metrics read every 0.5 s): notready within ``to_stalled_from_idle()`` of its arrival wherever
    it lands. Arriving after the last read before the next routine canary is due, the request is
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
                await side.wait_status(503, FROM_IDLE + 2, step=STEP)
                assert side.now() - arrived_at <= FROM_IDLE + STEP
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


# --- open-loop traffic, as a router sends it (issue 37: from verdict to traffic) ------------------
RATE = 20.0  # requests a second, 4 tokens each


async def traffic(engine: EngineLink, stop: asyncio.Event) -> None:
    """Requests at RATE a second, none waited for; cancelled (the clients leave) at the end."""
    sent: set[asyncio.Task[object]] = set()
    try:
        while not stop.is_set():
            task = engine.send("/v1/completions", generation(4))
            sent.add(task)
            task.add_done_callback(sent.discard)
            await asyncio.sleep(1 / RATE)
    finally:
        for task in list(sent):
            task.cancel()
        await asyncio.gather(*sent, return_exceptions=True)


@pytest.mark.parametrize("offset", [0.0, 0.25, 0.5, 0.75])
@pytest.mark.parametrize(
    ("latency", "bound"),
    [
        # Each request done at once: nothing in flight when the engine hangs, the idle rule's
        # bound (a canary wait, then its timeout). What the engine computed before the canary
        # left never excuses its timeout (its baseline is a read that leaves with it).
        (0.0, POLICY.wait + POLICY.timeout),
        # Requests in flight at the hang: the stall window, sooner than the idle rule's bound.
        (0.3, STALL),
    ],
    ids=["idle-between-requests", "work-in-flight"],
)
def test_a_hang_under_traffic_is_notready_within_its_bound(latency, bound, offset):
    async def main() -> None:
        engine = EngineLink("vllm", served=True, latency=latency)
        async with running(ENV, {URL: engine}) as side:
            await side.wait_status(200, 5)
            stop = asyncio.Event()
            load = asyncio.create_task(traffic(engine, stop))
            try:
                assert await side.statuses(3.0 + offset) == {200}  # busy is not hung
                await engine.fault(hang_generation=True)
                hung_at = side.now()
                await side.wait_status(503, bound + 1, step=STEP)
                took = side.now() - hung_at
                assert took <= bound + STEP, took
                _, body = await side.health_body()
                assert "no engine progress" in body["reason"], body["reason"]
            finally:
                stop.set()
                await load
                await engine.fault(hang_generation=False)

    run_virtually(main)


def test_busy_traffic_is_never_out_and_gets_no_canary_failure():
    """Twenty requests a second, several in flight at any time, the counters moving at every
    step: ready throughout, and no canary is counted as failed."""

    async def main() -> None:
        engine = EngineLink("vllm", served=True, latency=0.3)
        async with running(ENV, {URL: engine}) as side:
            await side.wait_status(200, 5)
            stop = asyncio.Event()
            load = asyncio.create_task(traffic(engine, stop))
            try:
                assert await side.statuses(20.0, step=STEP * 5) == {200}
                _, body = await side.health_body()
                assert body["checks"]["generate"]["in_flight"] >= 1
                assert body["checks"]["generate"]["consecutive_failures"] == 0
                text = await side.metrics()
                for outcome in ("timeout", "error", "invalid"):
                    failed = metric(
                        text, "health_sidecar_canary_total", endpoint="generate", outcome=outcome
                    )
                    assert not failed, (outcome, failed)
            finally:
                stop.set()
                await load

    run_virtually(main)
