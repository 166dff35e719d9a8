"""SIDECAR_REGISTRATION=grpc://: the registration check as a grpc.health.v1 Check of the engine's
own gRPC health service, against the fake vLLM's (``--grpc-health-port``, modelled on vLLM's gRPC
server: tests/test_vllm_grpc.py runs the real one).

What a user sees: /health's verdict and reason follow the engine's SERVING / NOT_SERVING,
an unknown service and a dead port are named, a Check that does not answer is a timeout, an
engine that restarts is registered again within a check or two (grpcio's reconnect backoff
capped), and a canary still decides where there is one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.configured import run_cli
from tests.support.harness import FakeEngine, Sidecar, base_env, free_port, wait_until

pytestmark = pytest.mark.process

SERVICE = "vllm.grpc.engine.VllmEngine"
INTERVAL = 0.2


@pytest.fixture
def grpc_engine(engine: Callable[..., FakeEngine]) -> tuple[FakeEngine, int]:
    port = free_port()
    return engine("vllm", "aggregated", "--grpc-health-port", str(port)), port


def grpc_env(fake: FakeEngine, port: int, service: str = SERVICE, **extra: str) -> dict[str, str]:
    return {
        "SIDECAR_BACKEND": "vllm",
        "SIDECAR_ENGINE_URL": fake.url,
        "SIDECAR_REGISTRATION": f"grpc://127.0.0.1:{port}/{service}",
        "SIDECAR_REGISTRATION_INTERVAL": str(INTERVAL),
    } | extra


def check(side: Sidecar) -> dict[str, Any]:
    return side.health()[1]["checks"]["generate"]


def grpc_checks(fake: FakeEngine) -> int:
    return int(fake.http.get(f"{fake.url}/_fake/state").json()["grpc_checks"])


def test_readiness_follows_the_engines_serving_status(grpc_engine, sidecar):
    fake, port = grpc_engine
    side = sidecar(grpc_env(fake, port))
    side.wait_status(200, 5)
    assert check(side)["registration"] == (
        f"grpc.health.v1 Check('{SERVICE}') at 127.0.0.1:{port}: SERVING"
    )
    before = grpc_checks(fake)
    wait_until(lambda: grpc_checks(fake) >= before + 3, 3, what="three more Checks")

    fake.fault(health_status=503)  # the fake's engine says NOT_SERVING
    side.wait_status(503, 2)
    assert check(side)["reason"] == (
        f"engine not registered: grpc.health.v1 Check('{SERVICE}') at 127.0.0.1:{port}: NOT_SERVING"
    )
    fake.fault(health_status=None)
    side.wait_status(200, 2)


def test_not_serving_after_serving_for_the_window_fails_liveness(grpc_engine, sidecar):
    """A server that stays up saying NOT_SERVING (vLLM's gRPC server with its engine dead, for
    good) is restarted; one that goes away (refused) is not, nor one that serves again."""
    fake, port = grpc_engine
    window = 2.0
    side = sidecar(grpc_env(fake, port, SIDECAR_LIVENESS_WINDOW=str(window)))
    side.wait_status(200, 5)
    fake.fault(health_status=503)
    side.wait_status(503, 2)
    took = side.wait_status(503, window + 2, path="/live")
    body = side.get("/live").json()
    assert body["reason"].startswith("generate: engine says it is not serving for ")
    assert body["reason"].endswith(f"at 127.0.0.1:{port}: NOT_SERVING")
    print(f"\n/live 503 {took:.2f} s after /health (window {window:g} s)")
    fake.fault(health_status=None)
    side.wait_status(200, 2, path="/live")
    side.wait_status(200, 2)


def test_an_unknown_service_is_named_and_never_ready(grpc_engine, sidecar):
    fake, port = grpc_engine
    side = sidecar(grpc_env(fake, port, service="no.such.Service"))
    wait_until(
        lambda: check(side)["registration"] != "not checked yet", 3, what="a registration check"
    )
    status, body = side.health()
    assert status == 503
    assert body["checks"]["generate"]["registration"].endswith(
        "NOT_FOUND (the engine knows no such service)"
    )


def test_the_server_as_a_whole_is_the_empty_service(grpc_engine, sidecar):
    fake, port = grpc_engine
    side = sidecar(grpc_env(fake, port, service=""))
    side.wait_status(200, 5)
    assert check(side)["registration"].startswith("grpc.health.v1 Check('') at ")


def test_a_dead_port_is_refused_and_a_restarted_engine_registers_again(grpc_engine, sidecar):
    fake, port = grpc_engine
    side = sidecar(grpc_env(fake, port))
    side.wait_status(200, 5)
    assert fake.proc is not None
    fake.proc.kill()
    side.wait_status(503, 2)
    assert check(side)["registration"].startswith(
        f"grpc.health.v1 Check('{SERVICE}') at 127.0.0.1:{port}: UNAVAILABLE"
    )
    assert side.get("/live").status_code == 200  # refused is gone, not hung
    # Down for 6 s, grpcio's default reconnect backoff (1 s, x1.6 per failure, up to 120 s) has
    # grown to 4-7 s: uncapped, the next attempt came too late for the wait below (measured: it
    # failed, twice). Capped at the registration interval, it takes a check or two.
    time.sleep(6)
    fake.restart()
    took = side.wait_status(200, 2)
    print(f"\nregistered again {took:.2f} s after the restart")


def test_a_check_that_does_not_answer_is_a_timeout(grpc_engine, sidecar):
    fake, port = grpc_engine
    side = sidecar(grpc_env(fake, port, SIDECAR_FAILURE_THRESHOLD="2"))
    side.wait_status(200, 5)
    fake.fault(health_latency=5)  # longer than the check's 0.5 s deadline
    side.wait_status(503, 3)
    assert check(side)["registration"].endswith(": no answer within 0.5 s")
    fake.fault(health_latency=0)
    side.wait_status(200, 7)  # the Checks in flight end within their deadline


def test_the_canary_still_decides_over_http(grpc_engine, sidecar):
    """gRPC says SERVING while generation hangs, as vLLM's does (it asks only whether the
    engine errored); the canary, over the engine's HTTP API, sees the hang."""
    fake, port = grpc_engine
    side = sidecar(grpc_env(fake, port, DYN_HEALTH_CHECK_ENABLED="true"))
    side.wait_status(200, 5)
    assert fake.requests(), "no canary reached the engine"
    fake.fault(hang_generation=True)
    side.wait_status(503, 5)
    generate = check(side)
    assert generate["registered"] is True
    assert generate["registration"].endswith(": SERVING")
    assert "timeout" in generate["reason"]


@pytest.mark.parametrize(
    ("env", "line"),
    [
        (
            {"SIDECAR_REGISTRATION": "grpc://127.0.0.1"},
            "SIDECAR_REGISTRATION='grpc://127.0.0.1': expected grpc://HOST:PORT or "
            "grpc://HOST:PORT/SERVICE (no port (the engine's gRPC server has no default))",
        ),
        (
            {"SIDECAR_REGISTRATION": "http://127.0.0.1:50051"},
            "SIDECAR_REGISTRATION='http://127.0.0.1:50051': expected grpc://HOST:PORT or "
            "grpc://HOST:PORT/SERVICE (not a grpc:// URL with a host)",
        ),
        (
            {"SIDECAR_REGISTRATION": "grpc://127.0.0.1:50051/a b"},
            "SIDECAR_REGISTRATION='grpc://127.0.0.1:50051/a b': expected grpc://HOST:PORT or "
            "grpc://HOST:PORT/SERVICE (the service is not a gRPC service name (letters, digits, "
            "_ . -))",
        ),
        (
            {"SIDECAR_REGISTRATION": "grpc://127.0.0.1:50051", "SIDECAR_REGISTRATION_PATH": "/x"},
            "SIDECAR_REGISTRATION_PATH='/x': expected unset with SIDECAR_REGISTRATION (the "
            "registration check asks the gRPC health service instead)",
        ),
    ],
)
def test_a_malformed_target_fails_at_start_with_one_line(env, line):
    done = run_cli("--check-config", env=base_env() | env)
    assert done.returncode == 2
    assert done.stderr.strip() == f"health-sidecar: configuration error: {line}"


def test_check_config_says_what_is_asked_and_what_is_not():
    env = base_env() | {
        "SIDECAR_BACKEND": "vllm",
        "SIDECAR_REGISTRATION": f"grpc://127.0.0.1:50051/{SERVICE}",
    }
    out = run_cli("--check-config", env=env).stdout
    assert (
        f"registration   grpc.health.v1 Check('{SERVICE}') at 127.0.0.1:50051 every 1 s, "
        "timeout 3 s: registered while it answers SERVING"
    ) in out
    lines = out.splitlines()
    (sleep,) = (line for line in lines if line.startswith("sleep "))
    (faults,) = (line for line in lines if line.startswith("faults "))
    for line, what in ((sleep, "sleep          not asked"), (faults, "faults         not read")):
        # Why: the engine is registered over gRPC without a canary, so it may serve no HTTP.
        assert line.startswith(what), line
        assert "registered by grpc.health.v1 Check(" in line, line
        assert "without a canary: the engine may serve no HTTP" in line, line
        assert "the engine may serve no HTTP" in line, line
    with_canary = run_cli("--check-config", env=env | {"DYN_HEALTH_CHECK_ENABLED": "true"}).stdout
    assert "sleep          GET /is_sleeping" in with_canary
