"""Busy is never hung for lack of evidence. The stall rule (requests in flight, no counter
advancing, confirmed by one canary) needs a counter that moves at every engine step; an engine
that publishes only counters that move as requests complete (an older SGLang without
``sglang:realtime_tokens_total``, another server) gets no stall rule, and a canary timing out
behind its requests is load while any counter moved within the liveness window. A hang under load
is still found: a window without any counter moving, then the canary's own hysteresis."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from sidecar.core.evidence.progress import ProgressState, on_sample, read_progress
from sidecar.engines import sglang
from sidecar.wiring import policy_of
from tests.support.inprocess import EngineLink, InProcessSidecar, run_virtually, running, until

pytestmark = pytest.mark.unit

URL = "http://engine:8000"
WINDOW = 30.0
ENV = {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "SIDECAR_BACKEND": "sglang",
    "SIDECAR_ENGINE_URL": URL,
    "SIDECAR_LIVENESS_WINDOW": str(WINDOW),
}
LONG = 20.0  # virtual seconds each request takes (the canary's too: it times out behind them)
OLD_SGLANG = (
    "sglang:num_running_reqs 3\nsglang:num_queue_reqs 1\n"
    'sglang:num_requests_total{model_name="tiny",engine_type="unified",is_streaming="false"} 5\n'
)


def test_without_a_per_step_counter_quiet_counters_raise_no_suspicion():
    spec = sglang.PROGRESS
    state = ProgressState()
    for at in (1.0, 2.0, 30.0):
        state = on_sample(state, read_progress(OLD_SGLANG, spec, at, 1e9 + at), "", spec)
    assert state.readable
    assert state.busy
    assert state.quiet_since is None
    assert not state.suspects_stall(0.5, 60.0)
    assert "the stall rule is off" in state.why
    assert "sglang:realtime_tokens_total" in state.why  # what it would need


@contextlib.asynccontextmanager
async def long_requests(engine: EngineLink, count: int = 3) -> AsyncIterator[None]:
    """``count`` long generations in flight on the engine the whole time, as users keep it busy."""

    async def one_after_another() -> None:
        while True:
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 64}}
            await engine.admin.post("/generate", json=body, timeout=None)

    await engine.fault(latency=LONG)
    tasks = [asyncio.create_task(one_after_another()) for _ in range(count)]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def in_flight(engine: EngineLink) -> int:
    return sum(rank.stats.running + rank.stats.waiting for rank in engine.state.ranks)


async def never_unready(side: InProcessSidecar, seconds: float) -> None:
    """/health and /live answer 200 at every look for ``seconds`` virtual seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        code, body = await side.health_body()
        assert code == 200, body["reason"]
        assert (await side.get("/live")).status_code == 200
        await asyncio.sleep(0.25)


@pytest.mark.parametrize("step_counters", [False, True])
def test_a_busy_engine_with_long_requests_stays_ready_and_live(step_counters):
    """The independent fake's case: three long requests in flight, the canary queued behind
    them. With SGLang 0.5.23's per-step counters, they show the engine computing; without them
    (an older SGLang), nothing moves until a request completes, and it must still not read as
    stalled, nor be restarted after the liveness window."""

    async def main() -> list[str]:
        engines = {URL: EngineLink("sglang", step_counters=step_counters)}
        async with running(ENV, engines) as side:
            await side.wait_status(200, 5)
            async with long_requests(engines[URL]):
                await until(lambda: in_flight(engines[URL]) >= 3, 2)
                await never_unready(side, 2 * WINDOW + 10)
            return [r["path"] for r in await engines[URL].requests()]

    paths = run_virtually(main)
    assert paths.count("/generate") > 10  # the canaries and the long requests reached it


def test_a_hang_under_load_without_per_step_counters_is_still_found():
    """Nothing completes for a whole liveness window while requests sit in flight: the canary's
    timeouts count again, notready within the window plus the usual bound, then /live fails."""

    async def main() -> tuple[float, str]:
        engines = {URL: EngineLink("sglang", step_counters=False)}
        async with running(ENV, engines) as side:
            await side.wait_status(200, 5)
            async with long_requests(engines[URL]):
                await until(lambda: in_flight(engines[URL]) >= 3, 2)
                await engines[URL].fault(hang_generation=True)
                policy = policy_of(side.settings)
                took = await side.wait_status(503, WINDOW + policy.to_notready().seconds + 1)
                _, body = await side.health_body()
                await side.wait_status(503, WINDOW + 5, path="/live")
                return took, body["reason"]

    took, reason = run_virtually(main)
    assert took > WINDOW - LONG  # not before a window without any counter moving
    assert "canary timeout" in reason
    assert "stalled" not in reason


@pytest.mark.parametrize(
    ("backend", "step_series"),
    [("sglang", "sglang:realtime_tokens_total"), ("vllm", "vllm:iteration_tokens_total")],
)
def test_the_fake_engine_can_publish_no_per_step_counter(backend, step_series):
    async def main() -> tuple[str, str]:
        with_steps, without = EngineLink(backend), EngineLink(backend, step_counters=False)
        texts = [(await e.admin.get("/metrics")).text for e in (with_steps, without)]
        for engine in (with_steps, without):
            await engine.aclose()
        return texts[0], texts[1]

    published, blind = run_virtually(main)
    assert step_series in published
    assert step_series not in blind
