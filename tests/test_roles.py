"""Each backend in each role, in-process on a virtual clock (tests/support/inprocess.py): the
role-aware canary that reaches the engine, a generation hang behind a 200 health route detected
and recovered within exact bounds, the negative control with canaries off, encode workers, and a
rejected decode canary that never fails liveness.

Timings: DYN_CANARY_WAIT_TIME=1, DYN_HEALTH_CHECK_REQUEST_TIMEOUT=0.5, other knobs at their
defaults (retry 1 s, failure threshold 2, success threshold 1, registration every 1 s). The real
processes (CLI, environment, uvicorn, loopback HTTP) are wired in tests/test_e2e_fake.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.exposition import metric
from tests.support.inprocess import EngineLink, run_virtually, running, until

pytestmark = pytest.mark.unit

URL = "http://engine:8000"
WAIT, TIMEOUT, RETRY = 1.0, 0.5, 1.0
STEP = 0.01  # how often a timing test polls: its bounds allow one step
CANARY_ON = {"DYN_HEALTH_CHECK_ENABLED": "true", "SIDECAR_ENGINE_URL": URL}
MATRIX = [
    (b, m, "text", arrival)
    for b in ("vllm", "sglang", "trtllm")
    for m in ("aggregated", "prefill", "decode")
    for arrival in (False, True)
] + [(b, "decode", "multimodal", False) for b in ("vllm", "sglang", "trtllm")]


async def canaries(engine: EngineLink) -> list[dict[str, Any]]:
    return [r for r in await engine.requests() if r["path"] in ("/v1/completions", "/generate")]


async def next_canary(engine: EngineLink) -> None:
    """Return just after the next canary reached the engine (an idle engine answers it at once)."""
    before = len(await canaries(engine))

    async def sent() -> bool:
        return len(await canaries(engine)) > before

    await until(sent, WAIT + RETRY, STEP, "the next canary")


@pytest.mark.parametrize(("backend", "mode", "model_type", "arrival"), MATRIX)
def test_role_matrix_detects_and_recovers_from_a_generation_hang(
    backend, mode, model_type, arrival
):
    """On an engine that counts a prompt when the request arrives, the canary's own arrival
    must not read as progress (it excused the timeout and delayed detection to the stall rule).
    The hang starts just after a canary passed, its worst moment: one canary confirms it, so
    /health is 503 within wait + timeout, on every backend (vLLM's frozen series included).
    A multimodal model's decode worker gets the same local text canary as a text model's."""
    env = CANARY_ON | {
        "SIDECAR_BACKEND": backend,
        "SIDECAR_DISAGGREGATION_MODE": mode,
        "SIDECAR_MODEL_TYPE": model_type,
        "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
    }

    async def main() -> None:
        engine = EngineLink(backend, mode, served=True, prompt_on_arrival=arrival)
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            _status, body = await side.health_body()
            assert body["status"] == "ready"
            assert body["endpoints"] == {"generate": "ready"}
            assert body["rule"] == "listed_endpoints"
            assert body["checks"]["generate"]["last_canary"]["outcome"] == "success"

            # What reached the engine: the role-aware body, never a rejected one.
            sent = await canaries(engine)
            assert sent, "no canary reached the engine"
            first = sent[0]
            assert first["headers"]["x-request-id"].startswith("canary-")
            if backend == "trtllm" and mode != "aggregated":
                assert first["json"]["disaggregated_params"] == {
                    "request_type": "context_and_generation"
                }
            if backend == "sglang" and mode != "aggregated":
                assert first["json"]["bootstrap_host"] == "2.2.2.2"
                assert isinstance(first["json"]["bootstrap_room"], int)
            if backend == "vllm":
                assert "kv_transfer_params" not in first["json"]

            # A hung GPU loop behind a 200, from just after a canary passed.
            await next_canary(engine)
            hung_at = side.now()
            await engine.fault(hang_generation=True)
            await side.wait_status(503, WAIT + TIMEOUT + 2, step=STEP)
            detect = side.now() - hung_at
            assert detect <= WAIT + TIMEOUT + STEP, detect
            # The engine lies: its health route answers 200 (SGLang's /health runs a generation,
            # so there the route that lies is the cheap one the sidecar registers with).
            lying = "/v1/models" if backend == "sglang" else "/health"
            assert (await engine.admin.get(lying)).status_code == 200
            _, body = await side.health_body()
            assert body["status"] == "notready"
            check = body["checks"]["generate"]
            assert check["last_canary"]["outcome"] == "timeout"
            # One canary confirmed the hang (it was notready within one wait and timeout): one
            # failure counted, the fast path said apart.
            assert check["consecutive_failures"] == 1
            assert check["hang_confirmed"] is True
            assert "timeout" in body["reason"]

            await engine.fault(hang_generation=False)
            released_at = side.now()
            await side.wait_status(200, 1.5, step=STEP)
            assert side.now() - released_at <= RETRY + STEP  # the next canary, at most retry on
            rejected = metric(
                await side.metrics(),
                "health_sidecar_canary_total",
                endpoint="generate",
                outcome="error",
            )
            assert rejected == 0  # the role-aware canary was never rejected

    run_virtually(main)


def test_negative_control_canaries_off_stay_ready_through_a_hang():
    """Without canaries a hung engine is invisible: proves the harness tells both outcomes apart."""
    env = {"SIDECAR_BACKEND": "trtllm", "SIDECAR_ENGINE_URL": URL}

    async def main() -> None:
        engine = EngineLink("trtllm", served=True)
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await engine.fault(hang_generation=True)
            # Ten times as long as a canary needs to see the hang (wait + timeout + 2 s before).
            assert await side.statuses(10 * (WAIT + TIMEOUT), step=0.1) == {200}
            assert await canaries(engine) == []

    run_virtually(main)


def test_encode_worker_without_canary_or_list_is_ready():
    """Dynamo's E/P/D encode worker answered 503 for its whole life; this one is ready (canaries
    off: readiness follows registration)."""
    env = {
        "SIDECAR_BACKEND": "vllm",
        "SIDECAR_DISAGGREGATION_MODE": "encode",
        "SIDECAR_MODEL_TYPE": "multimodal",
        "SIDECAR_ENGINE_URL": URL,
    }

    async def main() -> None:
        engine = EngineLink("vllm", "encode", served=True)
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            _, body = await side.health_body()
            assert body["rule"] == "monitored_endpoints"
            assert body["checks"]["generate"]["canary"] == "disabled"
            assert await canaries(engine) == []

    run_virtually(main)


def test_encode_worker_with_canaries_on_is_ready_on_registration():
    env = CANARY_ON | {"SIDECAR_BACKEND": "sglang", "SIDECAR_DISAGGREGATION_MODE": "encode"}

    async def main() -> None:
        engine = EngineLink("sglang", "encode", served=True)
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            assert await canaries(engine) == []
            _, body = await side.health_body()
            assert "an encode worker of a text model" in body["reason"]

    run_virtually(main)


def test_dynamo_decode_crash_loop_is_not_reproduced():
    """A plain canary to a TensorRT-LLM decode worker is rejected (DIS-1737): proven with a
    payload override that drops disaggregated_params. The rejection is notready with the
    engine's own words, and never fails liveness (no restart loop), however long it lasts."""
    payload = '{"prompt": [100, 101], "max_tokens": 1, "temperature": 0, "stream": false}'
    env = CANARY_ON | {
        "SIDECAR_BACKEND": "trtllm",
        "SIDECAR_DISAGGREGATION_MODE": "decode",
        "DYN_HEALTH_CHECK_PAYLOAD": payload,
        "SIDECAR_LIVENESS_WINDOW": "1",
    }

    async def main() -> None:
        engine = EngineLink("trtllm", "decode", served=True)
        async with running(env, {URL: engine}) as side:

            async def three() -> bool:
                return len(await canaries(engine)) >= 3

            await until(three, 5, what="three canaries")
            status, body = await side.health_body()
            assert status == 503
            assert "Disaggregated params are required for decode mode" in body["reason"]
            # Ten liveness windows of rejected canaries: /live never fails.
            assert await side.statuses(10.0, path="/live") == {200}
            assert len(await canaries(engine)) >= 10

    run_virtually(main)
