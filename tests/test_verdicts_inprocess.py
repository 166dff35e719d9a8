"""Verdicts that were once wrong, one test each: the sidecar in-process on a virtual clock against
the fake engine's own app (tests/support/inprocess.py), a client's request held in the engine
where a test needs work in flight.

Timings: wait 1 s, canary timeout 0.5 s, retry 1 s, metrics read every 1 s (every 0.25 s while
work is in flight), stall window 1.25 s.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.support.exposition import metric
from tests.support.inprocess import EngineLink, run_virtually, running, until

pytestmark = pytest.mark.unit

URL = "http://engine:8000"
ROOT = Path(__file__).resolve().parents[1]
WAIT, TIMEOUT, RETRY = 1.0, 0.5, 1.0
STEP = 0.01  # how often a timing test polls: its bounds allow one step
CANARY_ON = {"DYN_HEALTH_CHECK_ENABLED": "true", "SIDECAR_ENGINE_URL": URL}


def check_of(body: dict[str, Any]) -> dict[str, Any]:
    return body["checks"]["generate"]  # type: ignore[no-any-return]


# 1. A malformed answer is a failure whatever the counters do --------------------------------------
@pytest.mark.parametrize("arrival", [False, True])
@pytest.mark.parametrize("garbage", ["no_finish_reason", "wrong_token_count"])
def test_broken_answers_are_not_hidden_by_the_engines_counters(garbage, arrival):
    async def main() -> None:
        engine = EngineLink("vllm", served=True, prompt_on_arrival=arrival)
        async with running(CANARY_ON, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await engine.fault(garbage=garbage)
            broken_at = side.now()
            await side.wait_status(503, 3.0, step=STEP)
            # Two failures: the next canary (at most wait later) and one retry after it.
            assert side.now() - broken_at <= WAIT + RETRY + STEP
            assert await side.statuses(10.0) == {503}  # and it stays so: no flapping
            _, body = await side.health_body()
            assert check_of(body)["last_canary"]["outcome"] == "invalid"
            assert check_of(body)["progress"]["readable"] is True  # progress on, as default

    run_virtually(main)


# 3. Metrics served gzip-compressed are read -------------------------------------------------------
@pytest.mark.parametrize(
    ("backend", "gzip"), [("sglang", "auto"), ("trtllm", "auto"), ("vllm", "always")]
)
def test_compressed_metrics_are_read_and_a_busy_engine_stays_ready(backend, gzip):
    env = CANARY_ON | {"SIDECAR_BACKEND": backend}

    async def main() -> None:
        engine = EngineLink(backend, served=True, metrics_gzip=gzip)
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)

            async def readable() -> bool:
                return check_of((await side.health_body())[1])["progress"]["readable"]

            await until(readable, 3, what="readable metrics")
            # Busy: a long request whose counters move (20 tokens a second); a canary queues
            # behind it (the fake engine spreads its latency over each request), so a sidecar
            # that cannot read the metrics counts its timeouts and goes notready.
            await engine.fault(latency=8.0)
            body = {"model": "tiny", "prompt": "x", "max_tokens": 160}
            native = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 160}}
            sglang = backend == "sglang"
            async with engine.in_flight(
                "/generate" if sglang else "/v1/completions", native if sglang else body
            ):
                assert await side.statuses(6.0) == {200}
                check = check_of((await side.health_body())[1])
                assert check["in_flight"] >= 1
                assert check["progress"]["stall_suspected"] is False

    run_virtually(main)


# A handoff whose peer never answers: the request waits for its KV with no timeout.
PARKED = {
    "model": "tiny",
    "prompt": [1, 2, 3],
    "max_tokens": 4,
    "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [0]},
}
DECODE = CANARY_ON | {"SIDECAR_DISAGGREGATION_MODE": "decode", "SIDECAR_LIVENESS_WINDOW": "3"}


async def canaries_since(engine: EngineLink, since: float) -> int:
    return sum(
        1
        for r in await engine.requests()
        if r["headers"].get("x-request-id", "").startswith("canary-") and r["at"] >= since
    )


# 4 and 10. A decode worker whose request waits for a KV transfer is healthy -----------------------
def test_a_decode_worker_waiting_on_its_prefill_peer_stays_ready_and_live():
    async def main() -> None:
        engine = EngineLink("vllm", "decode", served=True)
        async with running(DECODE, {URL: engine}) as side:
            await side.wait_status(200, 5)
            async with engine.in_flight("/v1/completions", PARKED):
                start = side.now()
                # Past the stall window and five liveness windows: ready and live throughout.
                assert await side.statuses(15.0) == {200}
                assert await side.statuses(1.0, path="/live") == {200}
                _, health = await side.health_body()
                check = check_of(health)
                assert check["progress"]["waiting_outside_engine"] is True
                assert check["progress"]["waiting_for_kv_transfer"] == 1
                assert "waiting for a KV transfer from a prefill peer" in health["reason"]
                assert check["stalled"] is False
                # The parked work gets a canary every wait, no more and no fewer.
                sent = await canaries_since(engine, start)
                elapsed = side.now() - start
                assert elapsed / WAIT - 1 <= sent <= elapsed / WAIT + 1, sent

    run_virtually(main)


def test_gauges_without_counters_leave_the_decision_to_the_canary():
    """As some TensorRT-LLM releases publish: in-flight gauges under the listed names, counters
    under others. Not readable progress: said once, and the canary alone decides."""

    async def main() -> None:
        engine = EngineLink("vllm", "decode", served=True)
        await engine.fault(hide_counters=True)
        async with running(DECODE, {URL: engine}) as side:
            await side.wait_status(200, 5)

            async def progress() -> dict[str, Any]:
                return check_of((await side.health_body())[1])["progress"]  # type: ignore[no-any-return]

            async def read() -> bool:
                return (await progress())["detail"] != "not read yet"

            await until(read, 3, what="a metrics read")
            assert (await progress())["readable"] is False
            detail = (await progress())["detail"]
            assert detail.startswith("in-flight gauges but none of the progress counters")
            async with engine.in_flight("/v1/completions", PARKED):  # never progresses
                assert await side.statuses(10.0) == {200}
                assert await side.statuses(1.0, path="/live") == {200}
            said = [
                line for line in side.log if "engine progress unknown (in-flight gauges" in line
            ]
            assert len(said) == 1, said
            text = await side.metrics()
            assert metric(text, "health_sidecar_engine_progress_readable", endpoint="generate") == 0
            timeouts = metric(
                text, "health_sidecar_canary_total", endpoint="generate", outcome="timeout"
            )
            assert timeouts == 0

    run_virtually(main)


# 5. An encode worker without a canary is never judged by progress (a text model's) ---------------
def profile(name: str) -> dict[str, str]:
    """A profile of config/, less the variables a test sets itself."""
    lines = (ROOT / "config" / name).read_text().splitlines()
    pairs = (line.split("=", 1) for line in lines if line and not line.startswith("#"))
    return {k: v for k, v in pairs if k not in ("DYN_SYSTEM_PORT", "SIDECAR_ENGINE_URL")}


def test_an_encode_worker_without_a_canary_and_a_stuck_request_stays_ready_and_live():
    """A text model's encode worker gets no canary (tests/test_encode.py has the image
    encoder's): its metrics are not even read, so a stuck request cannot make it stalled."""
    env = profile("vllm-encode.env") | {
        "SIDECAR_ENGINE_URL": URL,
        "SIDECAR_LIVENESS_WINDOW": "2",
        "SIDECAR_MODEL_TYPE": "text",
    }
    del env["SIDECAR_EC_STORAGE_PATH"]  # only an image encoder's canary writes there

    async def main() -> None:
        engine = EngineLink("vllm", "encode", served=True)
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await engine.fault(hang_generation=True)
            image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
            chat = {
                "model": "tiny",
                "messages": [{"role": "user", "content": [image]}],
                "max_tokens": 1,
            }
            async with engine.in_flight("/v1/chat/completions", chat):
                assert await side.statuses(10.0) == {200}  # five liveness windows
                assert await side.statuses(1.0, path="/live") == {200}
                _, body = await side.health_body()
                assert check_of(body)["canary"] == "disabled"
                assert check_of(body)["progress"]["readable"] is False  # not even read

    run_virtually(main)


# 6. Liveness holds while the engine's health route answers 503 ------------------------------------
def test_liveness_never_fails_or_flaps_while_the_engine_answers_503():
    env = CANARY_ON | {"SIDECAR_LIVENESS_WINDOW": "1"}

    async def main() -> None:
        engine = EngineLink("vllm", served=True)
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await engine.fault(hang_generation=True)
            async with engine.in_flight(
                "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1}
            ):
                await engine.fault(health_status=503)  # loading, or draining
                await side.wait_status(503, 3)
                assert await side.statuses(20.0, path="/live") == {200}  # twenty windows

    run_virtually(main)


# 7. Smaller faults --------------------------------------------------------------------------------
def test_the_live_reason_names_the_running_cause_and_quotes_its_current_reason():
    env = CANARY_ON | {"SIDECAR_LIVENESS_WINDOW": "2"}

    async def main() -> None:
        engine = EngineLink("vllm", served=True)
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await engine.fault(generation_status=500, generation_error="first text")
            await side.wait_status(503, 3, path="/live")
            await engine.fault(generation_error="second text")

            async def new_reason() -> bool:
                return "second text" in (await side.get("/live")).json()["reason"]

            await until(new_reason, 3, what="the new reason")
            live = (await side.get("/live")).json()
            assert live["cause"] == "canary failing hard"
            assert "first text" not in live["reason"]

    run_virtually(main)


def test_one_health_body_is_consistent_with_itself():
    async def main() -> None:
        engine = EngineLink("vllm", served=True)
        async with running(CANARY_ON, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await engine.fault(garbage="no_finish_reason")
            seen = set()
            for _ in range(400):  # four seconds, across the change of verdict
                body = (await side.get("/health")).json()
                assert (body["status"] == "ready") == (body["endpoints"]["generate"] == "ready")
                seen.add(body["status"])
                await asyncio.sleep(0.01)
            assert seen == {"ready", "notready"}

    run_virtually(main)


# 9. One slow answer of the engine's own health route under load -----------------------------------
def test_a_slow_health_route_while_the_engine_progresses_does_not_deregister():
    async def main() -> None:
        engine = EngineLink("vllm", served=True)
        async with running(CANARY_ON, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await engine.fault(latency=12.0)  # a long generation: counters move, 20 tokens a s
            request = {"model": "tiny", "prompt": "x", "max_tokens": 240}
            async with engine.in_flight("/v1/completions", request):

                async def progressed() -> bool:  # the sidecar has seen the counters move
                    return bool(check_of((await side.health_body())[1])["last_progress_time"])

                await until(progressed, 3, what="progress")
                await engine.fault(health_latency=0.8)  # answers after the 0.5 s deadline
                assert await side.statuses(8.0) == {200}
                _, body = await side.health_body()
                assert "it is busy" in check_of(body)["registration"]

    run_virtually(main)
