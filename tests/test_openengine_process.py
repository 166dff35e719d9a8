"""The OpenEngine transport as users start it (``python -m sidecar``, SIDECAR_TRANSPORT=openengine)
beside the fake engine's OpenEngine server as a process (``python -m fakeengine --grpc-port N
--grpc-service openengine``): ready, notready on a hang within its bound and ready again, the
timed-out canaries aborted and none left on the engine, the engine's own load report seen.
These runs are the OpenEngine rows of docs/fault-benchmark.md (``-s`` prints the figures)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from sidecar.transports.openengine.messages import DECLARED
from tests.support.harness import LOOPBACK
from tests.support.processes import free_port

pytestmark = pytest.mark.process

TIMEOUT = 0.5  # the canary's deadline (conftest.FAST)
WAIT = 1.0  # DYN_CANARY_WAIT_TIME (conftest.FAST)


def _state(fake: Any) -> dict[str, Any]:
    return fake.http.get(f"{fake.url}/_fake/state").json()


@contextlib.contextmanager
def _users_request(port: int, seconds: float) -> Iterator[None]:
    """A user's Generate held on the engine (in a thread of its own, ended by its deadline or
    the engine's answer): requests active."""
    request, response = DECLARED.message("GenerateRequest"), DECLARED.message("GenerateResponse")
    body = request(request_id="users-1", model="tiny")
    body.token_ids.ids.extend([1, 2, 3])
    body.stopping.max_tokens = 4
    channel = grpc.insecure_channel(f"{LOOPBACK}:{port}")
    call = channel.unary_stream(
        "/openengine.v1.Inference/Generate",
        request_serializer=request.SerializeToString,
        response_deserializer=response.FromString,
    )

    def run() -> None:
        with contextlib.suppress(grpc.RpcError):
            for _ in call(body, timeout=seconds):
                pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join(seconds + 1)
        channel.close()


def _sidecar_env(port: int, mode: str) -> dict[str, str]:
    return {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_TRANSPORT": "openengine",
        "SIDECAR_ENGINE_URL": f"grpc://{LOOPBACK}:{port}",
        "SIDECAR_BACKEND": "trtllm",
        "SIDECAR_DISAGGREGATION_MODE": mode,
    }


@pytest.mark.parametrize("mode", ["aggregated", "prefill", "decode"])
def test_a_hang_is_notready_within_its_bound_and_a_release_ready_again(engine, sidecar, mode):
    port = free_port()
    fake = engine("trtllm", mode, "--grpc-port", str(port), "--grpc-service", "openengine")
    side = sidecar(_sidecar_env(port, mode))
    side.wait_status(200, 10)
    check = side.health()[1]["checks"]["generate"]
    assert check["last_canary"]["outcome"] == "success", check
    assert check["model"] == "tiny"  # learned from GetModelInfo: every Generate names it
    generated = [r for r in fake.requests() if r["path"].endswith(".Inference/Generate")]
    sent = generated[-1]["json"]
    if mode == "aggregated":
        assert "extra" not in sent, sent
    else:  # run whole, locally: DIS-1737's rule on this contract
        assert sent["extra"] == {"request_type": "context_and_generation"}, sent
    assert _state(fake)["pinned_kv_sessions"] == 0  # never a context-only canary

    hung = time.monotonic()
    fake.fault(hang_generation=True)
    side.wait_status(503, WAIT + TIMEOUT + 2.5)
    detected = time.monotonic() - hung
    reason = side.health()[1]["reason"]
    assert "canary timeout" in reason, reason
    assert side.get("/live").status_code == 200

    released = time.monotonic()
    fake.fault(hang_generation=False)
    side.wait_status(200, 5)
    recovered = time.monotonic() - released
    aborts = [r for r in fake.requests() if r["path"].endswith(".Control/Abort")]
    assert aborts, "the timed-out canaries were not aborted"
    state = _state(fake)
    left = state["running"] + state["waiting"]
    assert left == 0, state  # no canary left running on the engine
    assert state["abandoned"]["computed"] == 0, state  # none computed after its client left
    print(
        f"\nOPENENGINE trtllm {mode}: notready {detected:.2f} s after the hang, ready "
        f"{recovered:.2f} s after the release; {len(aborts)} timed-out canaries aborted, "
        f"{state['abandoned']['computed']} computed, {left} left on the engine"
    )


def test_a_stale_load_report_sends_a_canary_at_once_and_its_timeout_is_stalled(engine, sidecar):
    """The engine says its sample is stale under load (GetLoad UNAVAILABLE): the canary leaves
    at once, and its timeout is notready 'stalled' at once (no second failure waited for)."""
    port = free_port()
    fake = engine(
        "trtllm",
        "aggregated",
        "--grpc-port",
        str(port),
        "--grpc-service",
        "openengine",
        "--openengine-load-stale",
        "0.5",
    )
    # A long wait: without the engine's hint no canary would leave for 30 s.
    side = sidecar(_sidecar_env(port, "aggregated") | {"DYN_CANARY_WAIT_TIME": "30"})
    side.wait_status(200, 10)
    hung = time.monotonic()
    fake.fault(hang_generation=True)
    # A user's request held by the hung engine: requests active, no step: stale after 0.5 s.
    with _users_request(port, 8.0):
        side.wait_status(503, 0.5 + 1.0 + TIMEOUT + 2.0)
        took = time.monotonic() - hung
        body = side.health()[1]
        check = body["checks"]["generate"]
        assert "stalled" in body["reason"], body["reason"]
        assert check["consecutive_failures"] == 1, check
        assert check["hang_confirmed"], check
        assert check["engine_load"]["stale"] is True, check
        fake.fault(hang_generation=False)
        side.wait_status(200, 5)
    print(f"\nOPENENGINE stale GetLoad: notready 'stalled' {took:.2f} s after the hang")
