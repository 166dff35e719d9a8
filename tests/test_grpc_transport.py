"""The gRPC transport (SIDECAR_TRANSPORT=grpc) over real loopback sockets, against the fake
engine's gRPC services (fakeengine/grpcengine.py): the channel and the probe in the test's own
loop (what reached the engine, the Abort of a timed-out canary, the statuses as outcomes, the
registration checks), and the sidecar as users start it beside ``python -m fakeengine
--grpc-port``. The probers' rules, pure: tests/test_grpc_probers.py."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from fakeengine import grpcengine
from fakeengine.state import EngineConfig, EngineState
from sidecar.core.evidence.result import Outcome
from sidecar.probes.base import CanaryPlan
from sidecar.probes.canary import Canary
from sidecar.runtime.grpcchannel import GrpcEngine, RpcRegistration
from sidecar.runtime.grpcregistration import GrpcRegistration
from sidecar.runtime.grpctarget import GrpcTarget
from sidecar.transports.grpc import SERVICES
from tests.support.configured import blueprint_of
from tests.support.harness import LOOPBACK, base_env
from tests.support.processes import free_port

pytestmark = pytest.mark.process

TIMEOUT = 0.5  # the canary's deadline (conftest.FAST)
WITHIN = 1.0  # how long the engine may take to show what a test waits for


@contextlib.asynccontextmanager
async def serving(
    backend: str, mode: str = "aggregated"
) -> AsyncIterator[tuple[EngineState, GrpcEngine]]:
    """The fake engine's gRPC service for ``backend`` on a free loopback port, and the sidecar's
    channel to it."""
    config = EngineConfig(
        backend=backend,  # type: ignore[arg-type]
        mode=mode,  # type: ignore[arg-type]
        model="tiny",
        host=LOOPBACK,
        latency=0.0,
        load_seconds=0.0,
    )
    state = EngineState(config, loading_seconds=0.0)
    server = await grpcengine.start(state, LOOPBACK, 0)
    target = GrpcTarget(LOOPBACK, server.port, "")
    SERVICES[backend][0].messages()  # the backend's stubs, as the transport registers them
    engine = GrpcEngine(target, interval=0.1)
    try:
        yield state, engine
    finally:
        await engine.aclose()
        await server.stop(0)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    async def checked() -> None:
        await scenario()
        leaked = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not leaked, f"tasks left running: {leaked}"

    asyncio.run(checked())


def grpc_plan(backend: str, mode: str = "aggregated", **fields: object) -> CanaryPlan:
    """The generate endpoint's plan over gRPC, canaries on, as the sidecar resolves it."""
    return blueprint_of(
        backend=backend,
        disaggregation_mode=mode,
        transport="grpc",
        engine_url=f"grpc://{LOOPBACK}:50051",
        health_check_enabled=True,
        **fields,
    ).plan


def grpc_canary(engine: GrpcEngine, timeout: float) -> Canary:
    """The canary probe over the gRPC channel, as the transport opens it."""
    return Canary(engine, timeout=timeout, holds_on="call")


def generated(state: EngineState) -> list[dict[str, Any]]:
    return [r for r in state.requests if r["path"].endswith("/Generate")]


async def until(condition: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WITHIN
    while not condition():
        assert loop.time() < deadline, f"no {what} within {WITHIN} s"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    ("backend", "mode"),
    [("vllm", "aggregated"), ("vllm", "decode"), ("trtllm", "decode"), ("sglang", "decode")],
)
def test_the_canary_passes_and_the_engine_got_the_roles_request(backend, mode):
    plan = grpc_plan(backend, mode)

    async def scenario() -> None:
        async with serving(backend, mode) as (state, engine):
            probe = grpc_canary(engine, timeout=1.0)
            result = await probe(plan, plan.request(None, "canary-1"), None)
            assert result.outcome is Outcome.SUCCESS, result.reason
            (seen,) = generated(state)
            assert seen["json"]["request_id"] == "canary-1"
            if backend == "trtllm":  # DIS-1737: decode refuses a request without them
                # (request_type CONTEXT_AND_GENERATION is the enum's 0: the log omits it)
                assert "disaggregated_params" in seen["json"]
            if backend == "sglang":
                assert seen["json"]["disaggregated_params"]["bootstrap_host"] == "2.2.2.2"
            await probe.aclose()

    run(scenario)


def test_trtllm_decode_without_disaggregated_params_is_a_rejection_in_the_engines_words():
    """What the canary's params prevent: the engine refuses a plain request (INVALID_ARGUMENT),
    which the probe records as the worker's refusal with its message."""
    plan = grpc_plan("trtllm", "aggregated")  # the aggregated body, sent to a decode worker

    async def scenario() -> None:
        async with serving("trtllm", "decode") as (_, engine):
            result = await grpc_canary(engine, timeout=1.0)(plan, plan.request(None, "c"), None)
            assert (result.outcome, result.rejection) == (Outcome.ERROR, True)
            assert "INVALID_ARGUMENT: Disaggregated params are required for decode mode" in (
                result.reason
            )

    run(scenario)


@pytest.mark.parametrize("backend", ["vllm", "trtllm", "sglang"])
def test_a_hung_engine_times_out_and_the_canary_is_aborted_and_released(backend):
    """The deadline ends the call; the probe then sends the engine's Abort with the canary's id;
    nothing of the canary stays on the engine."""
    plan = grpc_plan(backend)

    async def scenario() -> None:
        async with serving(backend) as (state, engine):
            state.update_faults({"hang_generation": True})
            result = await grpc_canary(engine, timeout=TIMEOUT)(
                plan, plan.request(None, "canary-9"), None
            )
            assert result.outcome is Outcome.TIMEOUT
            assert f"no complete answer within {TIMEOUT:g} s" in result.reason
            abort = f"/{plan.prober.service}/Abort"  # type: ignore[attr-defined]
            assert result.reason.endswith(f"stopped on the engine (gRPC {abort} -> OK)")
            aborts = [r for r in state.requests if r["path"].endswith("/Abort")]
            assert len(aborts) == 1
            assert "canary-9" in str(aborts[0]["json"])
            await until(lambda: state.running == 0 and not state.jobs, "the engine released")

    run(scenario)


@pytest.mark.parametrize(
    ("backend", "outcome"), [("vllm", Outcome.ERROR), ("sglang", Outcome.REFUSED)]
)
def test_a_dead_engine_is_its_servers_status(backend, outcome):
    """vLLM's servicer answers a dead engine core with INTERNAL; SGLang's whole server goes
    (UNAVAILABLE): an error, and a refusal."""
    plan = grpc_plan(backend)

    async def scenario() -> None:
        async with serving(backend) as (state, engine):
            state.update_faults({"dead": True})
            result = await grpc_canary(engine, timeout=1.0)(plan, plan.request(None, "c"), None)
            assert result.outcome is outcome, result.reason

    run(scenario)


def test_registration_asks_grpc_health_or_getmodelinfo_and_sees_the_server_go():
    async def scenario() -> None:
        async with serving("vllm") as (state, engine):
            health = GrpcRegistration(
                engine.target, timeout=1.0, interval=0.1, clock=asyncio.get_running_loop().time
            )
            assert (await health()).registration.outcome is Outcome.SUCCESS
            state.update_faults({"dead": True})
            assert (await health()).registration.outcome is Outcome.ERROR  # NOT_SERVING
            await health.aclose()
        async with serving("trtllm") as (_, engine):
            check = RpcRegistration(engine, "/trtllm.TrtllmService/GetModelInfo", timeout=1.0)
            registered = (await check()).registration
            assert registered.outcome is Outcome.SUCCESS, registered.reason
            assert registered.reason == "/trtllm.TrtllmService/GetModelInfo -> OK"
        gone = (await check()).registration  # the server stopped: nothing accepts connections
        assert gone.outcome is Outcome.REFUSED, gone.reason
        await engine.aclose()

    run(scenario)


# --- the sidecar as users start it ---------------------------------------------------------
@pytest.mark.parametrize(("backend", "mode"), [("vllm", "aggregated"), ("trtllm", "decode")])
def test_the_sidecar_over_grpc_is_ready_notready_on_a_hang_and_ready_again(
    engine, sidecar, backend, mode
):
    port = free_port()
    fake = engine(backend, mode, "--grpc-port", str(port))
    side = sidecar(
        {
            "DYN_HEALTH_CHECK_ENABLED": "true",
            "SIDECAR_TRANSPORT": "grpc",
            "SIDECAR_ENGINE_URL": f"grpc://{LOOPBACK}:{port}",
            "SIDECAR_BACKEND": backend,
            "SIDECAR_DISAGGREGATION_MODE": mode,
        }
    )
    side.wait_status(200, 10)
    check = side.health()[1]["checks"]["generate"]
    assert check["last_canary"]["outcome"] == "success", check
    fake.fault(hang_generation=True)
    took = side.wait_status(503, 1.0 + TIMEOUT + 2)
    reason = side.health()[1]["reason"]
    assert "canary timeout" in reason, reason
    assert side.get("/live").status_code == 200
    fake.fault(hang_generation=False)
    side.wait_status(200, 5)
    aborts = [r for r in fake.requests() if r["path"].endswith("/Abort")]
    assert aborts, "the timed-out canaries were not aborted"
    print(f"\nGRPC {backend} {mode}: notready {took:.2f} s after the hang: {reason}")


def test_a_users_payload_is_mapped_onto_the_request_message():
    """DYN_HEALTH_CHECK_PAYLOAD replaces the request, field by field (the proto's names): what
    reached the engine is the user's; it is judged as a user payload (any count)."""
    payload = {
        "request_id": "users-own",
        "tokenized": {"input_ids": [7, 8, 9]},
        "sampling_params": {"temperature": 0, "max_tokens": 3, "ignore_eos": True},
    }
    plan = grpc_plan("vllm", health_check_payload=payload)

    async def scenario() -> None:
        async with serving("vllm") as (state, engine):
            result = await grpc_canary(engine, 1.0)(plan, plan.request(None, "c-1"), None)
            assert result.outcome is Outcome.SUCCESS, result.reason
            (seen,) = generated(state)
            assert seen["json"]["request_id"] == "users-own"
            assert seen["json"]["tokenized"]["input_ids"] == [7, 8, 9]
            assert seen["json"]["sampling_params"]["max_tokens"] == 3

    run(scenario)


def test_a_payload_that_does_not_fit_the_message_is_an_error_naming_the_field():
    plan = grpc_plan("vllm", health_check_payload={"prompt": "hi"})

    async def scenario() -> None:
        async with serving("vllm") as (state, engine):
            result = await grpc_canary(engine, 1.0)(plan, plan.request(None, "c-1"), None)
            assert result.outcome is Outcome.ERROR
            assert "cannot build the request" in result.reason
            assert "prompt" in result.reason
            assert generated(state) == []

    run(scenario)


def test_a_payload_that_does_not_fit_stops_the_sidecar_at_start_with_one_line():
    """Validated once, at start: the sidecar exits 2 naming DYN_HEALTH_CHECK_PAYLOAD and the
    field the message lacks."""
    env = base_env() | {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_TRANSPORT": "grpc",
        "SIDECAR_ENGINE_URL": f"grpc://{LOOPBACK}:{free_port()}",
        "DYN_HEALTH_CHECK_PAYLOAD": '{"prompt": "hi"}',
        "DYN_SYSTEM_HOST": LOOPBACK,
        "DYN_SYSTEM_PORT": str(free_port()),
    }
    done = subprocess.run(
        [sys.executable, "-m", "sidecar"], env=env, capture_output=True, text=True, timeout=30
    )
    lines = [line for line in done.stderr.splitlines() if "DYN_HEALTH_CHECK_PAYLOAD:" in line]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, done.stderr
    assert "expected a request of /vllm.grpc.engine.VllmEngine/Generate" in lines[0]
    assert "prompt" in lines[0]
