"""The sidecar against SGLang's real encoder (0.5.23, ``--encoder-only``, a tiny random-weight
Qwen2-VL), started as users start it, in the module's private network namespace.

The encoder is one process: its HTTP server, its scheduler and the vision model share one event
loop, so a frozen encoder (SIGSTOP) answers nothing, its own ``/health`` included. The sidecar's
canary is that ``/health`` (SGLang encodes its own test image) under the sidecar's deadline.
One encoder is shared by the module (``Shared``); the last test kills it. Prepared by
``scripts/prepare_engines.sh`` (the ``sglang`` and ``sglang-encode`` parts); skipped without it
(failed under CI). What the encoder does, measured: docs/engines.md ("SGLang's encoder").
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from tests.support.harness import Sidecar, wait_until
from tests.support.netns import isolated  # noqa: F401  (the module's private network namespace)
from tests.support.processes import Shared, handed_over, spends
from tests.support.sglang_engine import SglangEncoder, sglang_encoder

pytestmark = pytest.mark.engine

WAIT, TIMEOUT = 1.0, 1.0


@pytest.fixture(scope="module")
def encoder_pool(isolated: None) -> Iterator[Shared[SglangEncoder]]:  # noqa: F811
    with Shared("SGLang encoder", sglang_encoder) as pool:
        yield pool


encoder = handed_over("encoder")


def sidecar_env(server: SglangEncoder) -> dict[str, str]:
    """An encode worker's sidecar as config/sglang-encode.env configures it, on this encoder."""
    return {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_BACKEND": "sglang",
        "SIDECAR_DISAGGREGATION_MODE": "encode",
        "SIDECAR_MODEL_TYPE": "multimodal",
        "SIDECAR_ENGINE_URL": server.url,
        "DYN_CANARY_WAIT_TIME": str(WAIT),
        "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": str(TIMEOUT),
    }


def last_canary(side: Sidecar) -> dict[str, object]:
    return side.health()[1]["checks"]["generate"]["last_canary"]


def test_the_canary_is_the_encoders_own_health_check(encoder, sidecar):
    side = sidecar(sidecar_env(encoder))
    side.wait_status(200, 30)
    canary = last_canary(side)
    assert canary["outcome"] == "success", canary
    assert canary["reason"] == "HTTP 200 from GET /health"
    assert encoder.status("/v1/models") == 404  # registered on this answer: the server is up
    print(f"\nREAL-SGLANG-ENCODE canary: {canary}")


def test_a_frozen_encoder_is_notready_while_its_own_health_gives_no_answer(encoder, sidecar):
    """SIGSTOP: the canary times out and SGLang's own /health answers nothing; SIGCONT: ready
    again (the kept /health answers, or the next canary)."""
    side = sidecar(sidecar_env(encoder))
    side.wait_status(200, 30)
    engine_health: set[int | None] = set()
    encoder.freeze()
    try:
        frozen = time.monotonic()

        def notready() -> bool:
            return side.get("/health").status_code == 503

        wait_until(notready, WAIT + 2 * TIMEOUT + 1 + 5, interval=0.05, what="/health -> 503")
        took = time.monotonic() - frozen
        engine_health.add(encoder.status("/health", timeout=1))
        _, body = side.health()
        assert side.get("/live").status_code == 200
    finally:
        encoder.thaw()
    print(f"\nREAL-SGLANG-ENCODE frozen: notready after {took:.2f} s: {body['reason']}")
    assert took <= WAIT + 2 * TIMEOUT + 1 + 2
    assert engine_health == {None}  # SGLang's own /health: no answer
    assert "canary timeout" in body["reason"]
    back = side.wait_status(200, 15)
    print(f"REAL-SGLANG-ENCODE SIGCONT: ready after {back:.2f} s")


@spends("encoder")
def test_a_killed_encoder_is_notready_and_live(encoder, sidecar):
    """Last in the module: it spends the shared encoder. A gone engine is not a hang."""
    side = sidecar(sidecar_env(encoder))
    side.wait_status(200, 30)
    encoder.signal(signal.SIGKILL)
    took = side.wait_status(503, WAIT + 2 * TIMEOUT + 2)
    _, body = side.health()
    assert side.get("/live").status_code == 200
    print(f"\nREAL-SGLANG-ENCODE killed: notready after {took:.2f} s: {body['reason']}")
