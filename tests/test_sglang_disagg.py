"""A real SGLang decode server (fake transfer backend) and prefill server (mooncake over TCP), each
with the sidecar's built-in canary of its role.

A decode request without the bootstrap fields crashes the whole decode server: the test that
shows it runs on the decode server that has just passed the decode canaries (it spends it), so
that the decode body this project sends is proven necessary, not only accepted. One server at a
time (about 2 GB each), in a private network namespace. Prepared by
``scripts/prepare_engines.sh --only sglang``; skipped without it or without root (failed under
CI).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.configured import blueprint_of
from tests.support.harness import wait_until
from tests.support.netns import isolated  # noqa: F401  (the module's private network namespace)
from tests.support.processes import Shared, handed_over, spends
from tests.support.sglang_engine import (
    SglangServer,
    check,
    sglang_env,
    sglang_server,
    sidecar_metric,
)

pytestmark = pytest.mark.engine


def role_body(mode: str) -> dict[str, Any]:
    """The body this project's SGLang prober sends in ``mode``."""
    plan = blueprint_of(backend="sglang", disaggregation_mode=mode, health_check_enabled=True).plan
    return plan.request(None, "canary-probe").body


@pytest.fixture(scope="module")
def decode_pool(isolated) -> Iterator[Shared[SglangServer]]:  # noqa: F811
    with Shared("SGLang decode", lambda: sglang_server(mode="decode")) as pool:
        yield pool


decode = handed_over("decode")


def test_the_decode_canary_passes_and_the_server_survives_it(decode, sidecar):
    side = sidecar(sglang_env(decode, "decode", DYN_CANARY_WAIT_TIME="0.1"))
    side.wait_status(200, 15)
    wait_until(lambda: sidecar_metric(side, "health_sidecar_canary_total") >= 10, 20)
    assert sidecar_metric(side, "health_sidecar_canary_total", outcome="success") >= 10
    assert check(side)["consecutive_failures"] == 0
    assert decode.running
    assert decode.status("/v1/models") == 200
    body = role_body("decode")
    assert body["bootstrap_host"] == "2.2.2.2"
    assert body["sampling_params"]["max_new_tokens"] == 2


@spends("decode")
def test_a_canary_without_the_bootstrap_fields_kills_a_decode_server(decode):
    """What a plain (aggregated) canary does to a real SGLang decode server: not a 400, a dead
    server. It spends the module's decode server."""
    started = time.monotonic()
    with pytest.raises(httpx.HTTPError):
        decode.generate(role_body("aggregated"), timeout=30)
    assert decode.proc is not None
    code = decode.proc.popen.wait(30)
    print(
        f"\nREAL-SGLANG decode given a plain canary: the server exited {code} after "
        f"{time.monotonic() - started:.1f} s: {decode.proc.output()[-400:]}"
    )
    assert code != 0
    assert "'NoneType' object has no attribute 'startswith'" in decode.proc.output()
    assert decode.status("/v1/models") is None  # refused


@pytest.fixture(scope="module")
def prefill(isolated, decode_pool) -> Iterator[SglangServer]:  # noqa: F811
    decode_pool.close()  # one server at a time
    with sglang_server(mode="prefill") as started:
        yield started


QUEUES = ("sglang:num_prefill_bootstrap_queue_reqs", "sglang:num_prefill_inflight_queue_reqs")


def queued(server: SglangServer) -> dict[str, float]:
    totals = dict.fromkeys(QUEUES, 0.0)
    for (name, _labels), value in server.metrics().items():
        if name in totals:
            totals[name] += value
    return totals


def test_the_prefill_canary_passes_and_pins_nothing(prefill, sidecar):
    """SGLang's prefill refuses the fake transfer backend; with mooncake over TCP the fake
    bootstrap host runs the canary locally. After 20 canaries nothing waits in its queues."""
    side = sidecar(
        sglang_env(prefill, "prefill", DYN_CANARY_WAIT_TIME="0.1")
        | {"SIDECAR_SGLANG_BOOTSTRAP_PORT": str(prefill.bootstrap_port)}
    )
    side.wait_status(200, 15)
    wait_until(lambda: sidecar_metric(side, "health_sidecar_canary_total") >= 20, 30)
    assert sidecar_metric(side, "health_sidecar_canary_total", outcome="success") >= 20
    # The canaries go on (one every 0.1 s), so one reading may catch one of them queued: a
    # pinned request is in every reading. Each queue's floor over a second of readings.
    readings = []
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        readings.append(queued(prefill))
        time.sleep(0.1)
    after = {queue: min(reading[queue] for reading in readings) for queue in QUEUES}
    print(f"\nREAL-SGLANG prefill after 20 canaries: {after}")
    assert after == dict.fromkeys(QUEUES, 0.0)
    assert prefill.status("/health", timeout=10) == 200
