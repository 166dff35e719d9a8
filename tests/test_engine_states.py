"""What /health and /live say as the engine is frozen, killed, restarted, loading or hung for a
whole liveness window, and before the first verdict: in-process on a virtual clock
(tests/support/inprocess.py), so every bound is the schedule's, exact whatever the machine's load.

Timings: DYN_CANARY_WAIT_TIME=1, DYN_HEALTH_CHECK_REQUEST_TIMEOUT=0.5, other knobs at their
defaults (retry 1 s, failure threshold 2, registration every 1 s). Real SIGSTOP, SIGCONT and
SIGKILL of an engine process: tests/test_e2e_fake.py.
"""

from __future__ import annotations

import asyncio

import pytest

from sidecar.core.verdict import HEARTBEAT_INTERVAL
from tests.support.exposition import metric
from tests.support.inprocess import EngineLink, run_virtually, running, until

pytestmark = pytest.mark.unit

URL = "http://engine:8000"
WAIT, TIMEOUT, RETRY, REGISTRATION = 1.0, 0.5, 1.0, 1.0
STEP = 0.01  # how often a timing test polls: its bounds allow one step
CANARY_ON = {"DYN_HEALTH_CHECK_ENABLED": "true", "SIDECAR_ENGINE_URL": URL}


def test_frozen_thawed_killed_and_restarted():
    """SIGSTOP, SIGCONT, SIGKILL and a restart on the same port, with no restart of the sidecar."""
    env = CANARY_ON | {"SIDECAR_BACKEND": "openai"}

    async def main() -> None:
        engine = EngineLink("openai", served=True)
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)

            engine.freeze()
            frozen_at = side.now()
            # Frozen whole: the health check's timeout sends a canary at once; two canary
            # timeouts in a row (retry 1 s apart) decide. At the latest: the next registration
            # check, its timeout, the canary's, the retry after it started and the second's.
            await side.wait_status(503, WAIT + TIMEOUT + 1.0 + TIMEOUT + 0.5, step=STEP)
            detect = side.now() - frozen_at
            assert detect <= REGISTRATION + TIMEOUT + max(RETRY, TIMEOUT) + TIMEOUT + STEP, detect
            _, body = await side.health_body()
            assert body["checks"]["generate"]["last_canary"]["outcome"] == "timeout"
            assert (await side.get("/live")).status_code == 200  # briefly frozen: no restart
            engine.thaw()
            thawed_at = side.now()
            await side.wait_status(200, 3, step=STEP)
            assert side.now() - thawed_at <= RETRY + STEP  # the next canary passes

            engine.kill()
            killed_at = side.now()
            await side.wait_status(503, 3, step=STEP)
            assert side.now() - killed_at <= REGISTRATION + STEP  # the next check is refused
            _, body = await side.health_body()
            assert "engine not registered" in body["reason"]
            # Gone is not hung: the runtime restarts it. Not even past a liveness window (120 s).
            assert await side.statuses(130, path="/live", step=1.0) == {200}
            await engine.restart()
            restarted_at = side.now()
            await side.wait_status(200, 5, step=STEP)
            # The next registration check, then the first canary at once.
            assert side.now() - restarted_at <= REGISTRATION + STEP

    run_virtually(main)


def test_loading_engine_is_notready_but_live():
    """llama.cpp's 503 "Loading model": notready, and live however many windows it lasts."""
    env = CANARY_ON | {"SIDECAR_BACKEND": "openai", "SIDECAR_LIVENESS_WINDOW": "1"}

    async def main() -> None:
        engine = EngineLink("openai", served=True, load_seconds=3.0)
        async with running(env, {URL: engine}) as side:

            async def loading() -> bool:
                return "Loading model" in (await side.health_body())[1]["reason"]

            await until(loading, 3, what="the loading reason")
            assert (await side.get("/health")).status_code == 503
            # Live through the whole load: three liveness windows.
            assert await side.statuses(2.5, path="/live") == {200}
            assert await side.statuses(0.3) == {503}  # and not ready before it ends
            await side.wait_status(200, 5)
            assert side.now() <= 3.0 + REGISTRATION + STEP  # ready at the next check after

    run_virtually(main)


def test_sustained_hang_fails_liveness_and_recovery_restores_it():
    env = CANARY_ON | {"SIDECAR_LIVENESS_WINDOW": "2"}
    window = 2.0

    async def main() -> None:
        engine = EngineLink("vllm", served=True)
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            await engine.fault(hang_generation=True)
            hung_at = side.now()
            await side.wait_status(503, WAIT + TIMEOUT + 2, step=STEP)
            assert (await side.get("/live")).status_code == 200  # failed readiness only briefly
            await side.wait_status(503, WAIT + TIMEOUT + 2 + 3, path="/live", step=STEP)
            notlive = side.now() - hung_at
            # The hard-failure clock starts with the first failed canary (at most wait + retry
            # after the hang began) and runs the whole window: never sooner.
            assert window <= notlive <= WAIT + RETRY + window + STEP, notlive
            live = (await side.get("/live")).json()
            assert live["status"] == "notlive"
            assert "canary failing hard" in live["reason"]
            assert live["cause"] == "canary failing hard"
            assert metric(await side.metrics(), "health_sidecar_live") == 0
            await engine.fault(hang_generation=False)
            released_at = side.now()
            await side.wait_status(200, 3, path="/live", step=STEP)
            assert side.now() - released_at <= RETRY + STEP

    run_virtually(main)


def test_starting_status_ready_reports_ready_until_first_verdict():
    env = CANARY_ON | {"DYN_SYSTEM_STARTING_HEALTH_STATUS": "ready"}

    async def main() -> None:
        engine = EngineLink("vllm", served=True)
        await engine.fault(hang_generation=True)  # hung before the sidecar starts
        async with running(env, {URL: engine}) as side:
            status, body = await side.health_body()
            assert status == 200  # by decree, before any canary ended
            assert body["rule"] == "starting_status"
            await side.wait_status(503, WAIT + TIMEOUT + 2, step=STEP)  # the first verdict
            # The first canary leaves on registration and its timeout is the first verdict.
            assert side.now() <= TIMEOUT + STEP
            _, body = await side.health_body()
            assert body["rule"] != "starting_status"

    run_virtually(main)


def test_probes_answer_from_memory_while_the_engine_is_frozen():
    """No probe waits on the engine: with the engine frozen and canaries hanging, /health,
    /live and /sidecar/live answer in no (virtual) time at all, and the monitor's heartbeat
    keeps beating."""

    async def main() -> None:
        engine = EngineLink("vllm", served=True)
        async with running(CANARY_ON, {URL: engine}) as side:
            answer = await side.get("/sidecar/live")
            assert answer.status_code == 200
            assert answer.json()["monitor_heartbeat_age_seconds"] < 2
            await side.wait_status(200, 5)
            engine.freeze()
            for _ in range(50):
                asked_at = side.now()
                await side.get("/health")
                await side.get("/live")
                assert side.now() == asked_at
            for _ in range(20):  # ten seconds frozen: the sidecar itself stays alive
                answer = await side.get("/sidecar/live")
                assert answer.status_code == 200
                assert answer.json()["monitor_heartbeat_age_seconds"] <= HEARTBEAT_INTERVAL
                await asyncio.sleep(0.5)
            engine.thaw()

    run_virtually(main)
