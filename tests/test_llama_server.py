"""The sidecar against llama.cpp's llama-server: a real engine nobody here wrote.

Timings: DYN_CANARY_WAIT_TIME=1, DYN_HEALTH_CHECK_REQUEST_TIMEOUT=0.5, other knobs default.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.support.engines import LlamaServer
from tests.support.exposition import metric
from tests.support.harness import Sidecar, wait_until

pytestmark = pytest.mark.engine

WAIT, TIMEOUT = 1.0, 0.5
FROZEN_WHOLE = 1.0 + TIMEOUT + 1.0 + TIMEOUT + 0.5  # see test_ready_then_sigstop_sigcont


@pytest.fixture
def llama() -> Iterator[Callable[..., LlamaServer]]:
    started: list[LlamaServer] = []

    def start(model: str = "TINY_GGUF", *extra: str, wait: bool = True) -> LlamaServer:
        server = LlamaServer(model, *extra)
        started.append(server)
        return server.start(wait=wait)

    yield start
    for server in started:
        server.close()


def sidecar_env(server: LlamaServer, backend: str = "openai") -> dict[str, str]:
    return {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_BACKEND": backend,
        "SIDECAR_ENGINE_URL": server.url,
        "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
    }


def canaries_sent(side: Sidecar) -> float:
    text = side.metrics()
    return sum(
        metric(text, "health_sidecar_canary_total", endpoint="generate", outcome=o) or 0
        for o in ("success", "timeout", "error", "refused", "invalid")
    )


@pytest.mark.parametrize("backend", ["openai", "vllm"])
def test_ready_then_sigstop_sigcont(llama, sidecar, backend):
    server = llama()
    side = sidecar(sidecar_env(server, backend))
    side.wait_status(200, 5)
    _, body = side.health()
    assert body["checks"]["generate"]["model"] == "tiny"
    assert body["checks"]["generate"]["last_canary"]["outcome"] == "success"

    server.freeze()
    # Frozen whole: its health route stops answering, which only sends a canary at once (a slow
    # health route under load must not drop a serving worker); two canary timeouts in a row
    # decide. Within a check or routine canary (1 s), the timeout, a retry (1 s) and the timeout.
    detect = side.wait_status(503, FROZEN_WHOLE)
    assert side.get("/live").status_code == 200
    server.thaw()
    recover = side.wait_status(200, 2)
    print(f"LLAMA {backend}: SIGSTOP -> 503 in {detect:.2f} s, SIGCONT -> 200 in {recover:.2f} s")


def test_sigkill_then_restart_without_restarting_the_sidecar(llama, sidecar):
    server = llama()
    side = sidecar(sidecar_env(server))
    side.wait_status(200, 5)
    pid = side.proc.pid
    server.kill()
    side.wait_status(503, 3)
    _, body = side.health()
    assert "engine not registered" in body["reason"]
    assert "cannot connect" in body["reason"]
    assert side.get("/live").status_code == 200  # gone is not hung
    server.start()
    side.wait_status(200, 5)
    assert side.proc.pid == pid
    assert side.proc.popen.poll() is None


def test_slow_model_load_is_notready_but_live(llama, sidecar):
    server = llama("BIG_GGUF", "--load-mode", "dio", wait=False)
    env = sidecar_env(server) | {
        "SIDECAR_REGISTRATION_INTERVAL": "0.1",
        "SIDECAR_LIVENESS_WINDOW": "1",
    }
    side = sidecar(env)
    seen: set[tuple[int, int]] = set()
    reasons: set[str] = set()

    def loaded() -> bool:
        health, live = side.get("/health"), side.get("/live")
        seen.add((health.status_code, live.status_code))
        reasons.add(health.json()["reason"])
        return health.status_code == 200

    wait_until(loaded, 60, interval=0.02, what="the big model to load")
    assert (503, 200) in seen  # notready, but live, while loading
    assert (503, 503) not in seen
    assert (200, 503) not in seen
    assert any("Loading model" in r for r in reasons), reasons


def test_busy_under_load_then_sigstop_mid_load(llama, sidecar):
    server = llama()
    side = sidecar(sidecar_env(server) | {"SIDECAR_METRICS_INTERVAL": "0.5"})
    side.wait_status(200, 5)
    stop = threading.Event()
    served = [0]

    def load() -> None:
        with httpx.Client(timeout=5, trust_env=False) as client:
            while not stop.is_set():
                try:
                    client.post(
                        f"{server.url}/v1/completions",
                        json={"model": "tiny", "prompt": "hello", "max_tokens": 64},
                    )
                    served[0] += 1
                except httpx.HTTPError:
                    time.sleep(0.05)

    workers = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        wait_until(lambda: served[0] >= 5, 5, what="load to flow")
        before = canaries_sent(side)
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            assert side.get("/health").status_code == 200  # busy is not hung
            time.sleep(0.1)
        # The load progresses: canaries are held back. Between two back-to-back requests a
        # metrics read may find the engine idle for a moment and let one routine canary go
        # (one CI run on a loaded machine: 2); an engine read as idle throughout gets 4.
        assert canaries_sent(side) - before <= 2
        _, body = side.health()
        assert body["reason"].startswith("generate: canary passed")
        assert body["checks"]["generate"]["progress"]["readable"] is True

        server.freeze()
        detect = side.wait_status(503, FROZEN_WHOLE)  # as in the idle case
        server.thaw()
        recover = side.wait_status(200, 2)
        print(
            f"LLAMA under load: SIGSTOP -> 503 in {detect:.2f} s, SIGCONT -> 200 in {recover:.2f} s"
        )
    finally:
        stop.set()
        server.thaw()
        for worker in workers:
            worker.join(10)
