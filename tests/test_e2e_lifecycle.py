"""Sleep, wrong answers, new weights after a maintenance window and failing KV transfers, end to
end in-process on a virtual clock: the whole sidecar (``tests/support/inprocess.py``: its
monitor, probes, engine client and HTTP app) against the fake engine's app, the control routes
beside it (``tests/support/control.py``). The real vLLM's side of sleep and wrong answers:
tests/test_vllm_real.py; the control routes on a real loopback port: tests/test_maintenance.py.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests.support.control import control_client
from tests.support.engineprocess import ProcessLink
from tests.support.exposition import metric
from tests.support.inprocess import InProcessSidecar, run_virtually, running, until

pytestmark = pytest.mark.unit

URL = "http://engine:8000"
LOOPBACK = "127.0.0.1"
CANARY_ON = {"DYN_HEALTH_CHECK_ENABLED": "true", "SIDECAR_ENGINE_URL": URL}


async def canaries(engine: ProcessLink) -> list[dict[str, Any]]:
    return [r for r in await engine.requests() if r["path"] == "/v1/completions"]


async def count(side: InProcessSidecar, outcome: str) -> float:
    found = metric(
        await side.metrics(), "health_sidecar_canary_total", endpoint="generate", outcome=outcome
    )
    if found is None:
        raise AssertionError(f"no canary_total for {outcome}")
    return found


def at_least(side: InProcessSidecar, outcome: str, n: float) -> Callable[[], Awaitable[bool]]:
    async def held() -> bool:
        return await count(side, outcome) >= n

    return held


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleeping_engine_is_notready_live_and_gets_no_canary(level):
    async def main() -> None:
        engine = ProcessLink("vllm", dev_mode=True)
        async with running(CANARY_ON, {URL: engine}) as side:
            await side.wait_status(200, 5)
            answer = await engine.admin.post("/sleep", params={"level": level})
            assert answer.status_code == 200
            await side.wait_status(503, 3)
            _, body = await side.health_body()
            assert body["reason"].startswith("generate: sleeping ("), body["reason"]
            assert body["checks"]["generate"]["lifecycle"]["sleeping"] is True
            sent = len(await canaries(engine))
            # Two and a half canary waits (DYN_CANARY_WAIT_TIME=1), in which an awake engine
            # would get two canaries.
            assert await side.statuses(2.5) == {503}
            assert len(await canaries(engine)) == sent
            live = await side.get("/live")
            assert live.status_code == 200
            assert live.json()["reason"] == "no sustained hard failure"
            assert any("paused: sleeping" in line for line in side.log), side.log
            assert (await engine.admin.post("/wake_up")).status_code == 200
            await side.wait_status(200, 3)
            assert len(await canaries(engine)) > sent, "no canary proved the engine after it woke"

    run_virtually(main)


@pytest.mark.parametrize(
    "broken", [{"generation_status": 500}, {"hang_generation": True}], ids=["crashes", "hangs"]
)
def test_wake_is_not_ready_an_engine_broken_by_wake_up_stays_notready(broken):
    """vLLM #45650: after ``wake_up`` an engine can answer /health 200 and fail its first
    forward pass. Ready again only after a canary passes: from the wake on, /health says 503
    at every poll while the woken engine's generation fails, and 200 once it is mended."""

    async def main() -> None:
        engine = ProcessLink("vllm", dev_mode=True)
        async with running(CANARY_ON, {URL: engine}) as side:
            await side.wait_status(200, 5)
            assert (await engine.admin.post("/sleep", params={"level": 1})).status_code == 200
            await side.wait_status(503, 3)
            await engine.fault(**broken)  # what the wake will leave behind
            assert (await engine.admin.post("/wake_up")).status_code == 200
            assert (await engine.admin.get("/health")).status_code == 200  # its own says fine
            # Five canary waits: the woken engine is asked, fails, and is never called ready.
            assert await side.statuses(5.0, step=0.01) == {503}
            _, body = await side.health_body()
            assert body["checks"]["generate"]["lifecycle"]["sleeping"] is False
            assert body["checks"]["generate"]["last_canary"]["outcome"] in {"error", "timeout"}
            assert len(await canaries(engine)) >= 2, "the woken engine was not asked"
            assert (await side.get("/live")).status_code == 200
            await engine.fault(generation_status=None, hang_generation=False)
            await side.wait_status(200, 3)

    run_virtually(main)


def test_an_engine_without_the_sleep_route_is_ready_says_so_once_and_is_not_asked_again():
    """No dev routes: GET /is_sleeping answers 404; the worker is ready, the log says once that
    the engine serves no sleep route, and the route is not asked again."""

    async def main() -> None:
        engine = ProcessLink("vllm")
        async with running(CANARY_ON, {URL: engine}) as side:
            await side.wait_status(200, 5)

            def said() -> int:
                return sum("serves no sleep route" in line for line in side.log)

            await until(lambda: said() > 0, 3, what="the missing sleep route said")
            asked = [s for s in engine.sent if s.path == "/is_sleeping"]
            assert len(asked) == 1, asked
            # Ten registration intervals on: still ready, said once, never asked again.
            assert await side.statuses(10) == {200}
            assert said() == 1
            assert [s for s in engine.sent if s.path == "/is_sleeping"] == asked

    run_virtually(main)


def test_one_wrong_answer_does_not_flap_two_make_it_notready():
    async def main() -> None:
        engine = ProcessLink("vllm")
        env = CANARY_ON | {"SIDECAR_CANARY_CHECK_ANSWER": "true"}
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await until(at_least(side, "success", 2), 3, what="a reference and a match")
            await engine.fault(wrong_answers=1)
            await until(at_least(side, "wrong_answer", 1), 3, what="one wrong answer")
            assert await count(side, "wrong_answer") == 1
            passed = await count(side, "success")
            await until(at_least(side, "success", passed + 1), 3, what="the next right answer")
            assert (await side.health_body())[0] == 200
            assert not any("endpoint notready" in line for line in side.log), side.log

            await engine.fault(wrong_answer=True)
            await side.wait_status(503, 5)
            _, body = await side.health_body()
            assert "canary wrong_answer: wrong answer: " in body["reason"], body["reason"]
            assert "where this incarnation first answered" in body["reason"]
            # Not hard: the worker stays live (a restart would reload the same weights).
            assert (await side.get("/live")).status_code == 200
            assert body["checks"]["generate"]["hard_failure_since"] is None
            await engine.fault(wrong_answer=False)
            await side.wait_status(200, 3)

    run_virtually(main)


def test_new_weights_after_a_maintenance_window_set_a_new_reference():
    """A training loop declares a window, updates the weights (here: the fake answers otherwise),
    and ends it: the first answer after the window is the new reference, not a wrong answer."""

    async def main() -> None:
        engine = ProcessLink("vllm")
        env = CANARY_ON | {"SIDECAR_CANARY_CHECK_ANSWER": "true", "SIDECAR_CONTROL_PORT": "9091"}
        async with running(env, {URL: engine}) as side, control_client(side) as control:
            await side.wait_status(200, 5)
            await until(at_least(side, "success", 2), 3, what="a reference and a match")
            window = {"seconds": 60, "reason": "weights, step 7"}
            assert (await control.put("/maintenance", json=window)).status_code == 200
            await side.wait_status(503, 2)
            await engine.fault(wrong_answer=True)  # the new weights
            assert (await control.delete("/maintenance")).status_code == 200
            await side.wait_status(200, 3)
            passed = await count(side, "success")
            await until(at_least(side, "success", passed + 2), 4, what="two more canaries")
            assert await count(side, "wrong_answer") == 0
            assert (await side.health_body())[0] == 200

    run_virtually(main)


def test_failing_transfers_from_a_prefill_peer_are_reported_and_restart_nothing():
    """A decode worker whose prefill peer was killed: the request answers 500 and NIXL's counters
    move (failed transfers +2, failed notifications +1, as measured on a real pair); /health
    stays 200 and says so, /live stays 200, the metrics count it."""

    async def main() -> None:
        engine = ProcessLink("vllm", "decode")
        env = CANARY_ON | {"SIDECAR_DISAGGREGATION_MODE": "decode"}
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await engine.fault(kv_transfer_failure="peer_killed")
            model = (await engine.admin.get("/v1/models")).json()["data"][0]["id"]
            params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [0, 1],
                "remote_engine_id": "prefill-0",
                "remote_request_id": "req-1",
                "remote_host": LOOPBACK,
                "remote_port": 5600,
            }
            body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 2}
            body["kv_transfer_params"] = params
            assert (await engine.admin.post("/v1/completions", json=body)).status_code == 500

            async def reported() -> bool:
                reason = (await side.health_body())[1]["reason"]
                return "KV transfers from prefill peers failing" in reason

            await until(reported, 3, what="the transfer failures in /health")
            status, health = await side.health_body()
            assert status == 200
            transfers = health["checks"]["generate"]["kv_transfers"]
            assert transfers["failing"] is True
            failures = transfers["failures_in_window"]
            assert failures == {"failed_transfers": 2, "failed_notifications": 1}
            assert (await side.get("/live")).status_code == 200
            metrics = await side.metrics()
            name = "health_sidecar_kv_transfer_failures_total"
            assert metric(metrics, name, endpoint="generate", kind="failed_transfers") == 2.0
            assert metric(metrics, name, endpoint="generate", kind="failed_notifications") == 1.0
            failing = metric(metrics, "health_sidecar_kv_transfers_failing", endpoint="generate")
            assert failing == 1.0
            assert any("KV transfers from prefill peers failing" in line for line in side.log)

    run_virtually(main)
