"""The fake engine's OpenEngine services (``--grpc-port N --grpc-service openengine``,
``fakeengine/grpc_openengine.py``): ``openengine.v1.Inference`` and ``openengine.v1.Control`` as
TensorRT-LLM's merged OpenEngine adapter (schema v0.1.0) serves them.

The client speaks with the sidecar's own declarations (``DECLARED.message(name)``, the default
pool), so every test also shows that the fake's server declarations (its own pool) are
wire-compatible with them; only what the sidecar never sends (``kv.session``,
``AbortRequest.all_requests``) is sent with the fake's classes. Each server runs in the test's
own event loop on 127.0.0.1 (port 0) over an ``EngineState``, whose faults and jobs the tests
set and read directly; one test runs the fake as users start it. Every call has a deadline
(``CALL``, ``HUNG`` for one meant to time out); every wait polls with a deadline (``WITHIN``).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from fakeengine import cli, grpc_openengine, grpcengine
from fakeengine.backends.trtllm import TrtllmBackend
from fakeengine.state import EngineConfig, EngineState, token_at
from sidecar.transports.openengine.messages import CONTROL, DECLARED, INFERENCE
from tests.support.harness import FakeEngine
from tests.support.processes import wait_until

pytestmark = pytest.mark.process

HOST = "127.0.0.1"
CALL = 1.0  # deadline of a call that answers
HUNG = 0.5  # deadline of a call meant to time out
WITHIN = 1.0  # how long the engine may take to show what a test waits for
PROBE_TIMEOUT = 0.3  # the engine's own probe's timeout here (30 s on TensorRT-LLM)
STALE = 0.3  # GetLoad's staleness threshold here (30 s on TensorRT-LLM)
PROMPT = [10, 11, 12, 13]
TWO = [token_at(0), token_at(1)]  # the fake's greedy answer, two tokens
RID = "canary-1"
Code = grpc.StatusCode


def sidecar(name: str) -> type[Message]:
    """The sidecar's declared message class (the default pool)."""
    return DECLARED.message(name)


def enum(enum_name: str, value: str) -> int:
    return grpc_openengine.enum_value(enum_name, value)


LENGTH = enum("FinishReason", "FINISH_REASON_LENGTH")
CANCELLED = enum("FinishReason", "FINISH_REASON_CANCELLED")
UNSPECIFIED = enum("FinishReason", "FINISH_REASON_UNSPECIFIED")
READY = enum("HealthState", "HEALTH_STATE_READY")
DEGRADED = enum("HealthState", "HEALTH_STATE_DEGRADED")
NOT_READY = enum("HealthState", "HEALTH_STATE_NOT_READY")
ABORTED = enum("AbortStatus", "ABORT_STATUS_ABORTED")
ALREADY_FINISHED = enum("AbortStatus", "ABORT_STATUS_ALREADY_FINISHED")
INTERNAL = enum("ErrorCode", "ERROR_CODE_INTERNAL")
INVALID = enum("ErrorCode", "ERROR_CODE_INVALID_ARGUMENT")
#: Control's unary methods: their request and answer, as the sidecar declares them.
UNARY = {
    method: (request, response)
    for method, (request, response, _) in DECLARED.services["Control"].items()
}


# --------------------------------------------------------------------------------- harness


@dataclass
class Engine:
    """One fake engine's state and its OpenEngine services, with a client channel."""

    state: EngineState
    server: grpcengine.GrpcEngine
    channel: grpc.aio.Channel

    def fault(self, **changes: Any) -> None:
        self.state.update_faults(changes)

    async def answer(self, request: Message, deadline: float = CALL) -> list[Any]:
        """Every event of a Generate that ends OK (any request class: the wire is the same)."""
        generate = self.channel.unary_stream(
            f"/{INFERENCE}/Generate",
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=sidecar("GenerateResponse").FromString,
        )
        return [reply async for reply in generate(request, timeout=deadline)]

    async def failure(self, request: Message, deadline: float = CALL) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await self.answer(request, deadline)
        return failed.value

    async def control(self, method: str, request: Message, deadline: float = CALL) -> Any:
        answer = sidecar(UNARY[method][1])
        call = self.channel.unary_unary(
            f"/{CONTROL}/{method}",
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=answer.FromString,
        )
        return await call(request, timeout=deadline)

    async def health(self, probe: bool = False, model: str = "") -> Any:
        request = sidecar("HealthRequest")(include_inference_probe=probe, model=model)
        return await self.control("Health", request)

    async def load(self) -> Any:
        return await self.control("GetLoad", sidecar("GetLoadRequest")())

    async def abort(self, request_id: str = RID) -> Any:
        return await self.control("Abort", sidecar("AbortRequest")(request_id=request_id))

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WITHIN
        while not condition():
            assert loop.time() < deadline, f"no {what} within {WITHIN} s"
            await asyncio.sleep(0.01)

    async def running(self, request_id: str = RID) -> None:
        await self.until(lambda: request_id in self.state.jobs, f"{request_id} running")

    async def released(self) -> None:
        """Nothing runs on the engine any more."""
        await self.until(lambda: self.state.running == 0 and not self.state.jobs, "idle engine")


@contextlib.asynccontextmanager
async def serving(
    backend: str, mode: str = "aggregated", loading: float = 0.0, **config: Any
) -> AsyncIterator[Engine]:
    state = EngineState(
        EngineConfig(
            backend=backend,  # type: ignore[arg-type]
            mode=mode,  # type: ignore[arg-type]
            model="tiny",
            host=HOST,
            latency=0.0,
            load_seconds=0.0,
            **config,
        ),
        loading_seconds=loading,
    )
    server = await grpcengine.start(state, HOST, 0, "openengine")
    channel = grpc.aio.insecure_channel(
        f"{HOST}:{server.port}", options=[("grpc.enable_http_proxy", 0)]
    )
    try:
        yield Engine(state, server, channel)
    finally:
        await channel.close()
        await server.stop(0)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    """Run the scenario in a loop of its own; once its servers stopped, no task may be left."""

    async def checked() -> None:
        await scenario()
        leaked = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        assert not leaked, f"tasks left running: {leaked}"

    asyncio.run(checked())


def generate(
    request_id: str = RID, *, max_tokens: int | None = 2, request_type: str | None = None
) -> Any:
    """The canary's request, as the sidecar's declared class builds it."""
    request = sidecar("GenerateRequest")(
        request_id=request_id,
        model="tiny",
        token_ids=sidecar("TokenIds")(ids=PROMPT),
        sampling=sidecar("SamplingParams")(temperature=0.0),
    )
    if max_tokens is not None:
        request.stopping.CopyFrom(sidecar("StoppingOptions")(max_tokens=max_tokens))
    if request_type is not None:
        request.extra.update({"request_type": request_type})
    return request


def kinds(replies: list[Any]) -> list[str]:
    return [reply.WhichOneof("event") for reply in replies]


def tokens(replies: list[Any]) -> list[int]:
    return [t.token_id for r in replies if r.WhichOneof("event") == "token" for t in r.token.tokens]


def usage(reply: Any) -> tuple[int, int, int]:
    u = reply.usage
    return u.prompt_tokens, u.completion_tokens, u.total_tokens


# ------------------------------------------------------------------------------- generation


def test_generate_streams_token_deltas_then_finished_with_usage() -> None:
    async def scenario() -> None:
        async with serving("trtllm") as engine:
            replies = await engine.answer(generate())
            assert kinds(replies) == ["token", "token", "finished"]
            assert [list(r.token.tokens) for r in replies[:2]] == [
                [sidecar("TokenInfo")(token_id=TWO[0])],
                [sidecar("TokenInfo")(token_id=TWO[1])],
            ]
            assert all(r.token.HasField("output_index") for r in replies[:2])  # 0, on the wire
            assert {r.request_id for r in replies} == {RID}
            final = replies[-1]
            assert (final.finished.output_index, final.finished.reason) == (0, LENGTH)
            assert [r.HasField("usage") for r in replies] == [False, False, True]
            assert usage(final) == (4, 2, 6)
            [logged] = [r for r in engine.state.requests if r["path"].endswith("/Generate")]
            assert (logged["method"], logged["path"]) == ("GRPC", f"/{INFERENCE}/Generate")
            assert logged["json"]["request_id"] == RID
            assert logged["json"]["stopping"] == {"max_tokens": 2}

            # Without stopping.max_tokens, the fake's default length (the real one: no limit).
            assert len(tokens(await engine.answer(generate(max_tokens=None)))) == 16

            info = await engine.control("GetModelInfo", sidecar("GetModelInfoRequest")())
            assert (info.model_id, info.served_model_name) == ("tiny", "tiny")
            server = await engine.control("GetServerInfo", sidecar("GetServerInfoRequest")())
            assert (server.engine_name, server.engine_version) == (
                "tensorrt_llm",
                "0.0.0+fakeengine",
            )
            assert server.HasField("engine_role")  # sent, as UNSPECIFIED: no server role
            assert server.engine_role == 0
        async with serving("vllm") as engine:
            server = await engine.control("GetServerInfo", sidecar("GetServerInfoRequest")())
            assert server.engine_name == "vllm"

    run(scenario)


def test_refusals_are_statuses_before_anything_runs() -> None:
    async def scenario() -> None:
        async with serving("trtllm") as engine:
            for change, details in (
                ({"request_id": ""}, "request_id must be non-empty"),
                ({"model": ""}, "model must be non-empty"),
            ):
                request = generate()
                for name, value in change.items():
                    setattr(request, name, value)
                failed = await engine.failure(request)
                assert (failed.code(), failed.details()) == (Code.INVALID_ARGUMENT, details)
            request = generate()
            request.ClearField("token_ids")
            failed = await engine.failure(request)
            assert failed.code() == Code.INVALID_ARGUMENT
            assert failed.details() == "exactly one of prompt or token_ids must be set"
            assert not engine.state.jobs
            assert engine.state.generated_tokens == 0

    run(scenario)


def test_a_duplicate_request_id_in_flight_is_already_exists() -> None:
    async def scenario() -> None:
        async with serving("trtllm") as engine:
            engine.fault(hang_generation=True)
            first = asyncio.ensure_future(engine.answer(generate()))
            await engine.running()
            failed = await engine.failure(generate())
            assert failed.code() == Code.ALREADY_EXISTS
            assert failed.details() == f"request_id '{RID}' is already active"
            assert (await engine.abort()).status == ABORTED
            assert kinds(await first) == ["finished"]
            engine.fault(hang_generation=False)
            assert tokens(await engine.answer(generate())) == TWO  # the id is free again

    run(scenario)


# ------------------------------------------------------------------------------------ roles


def test_decode_refuses_a_plain_request_and_runs_context_and_generation() -> None:
    async def scenario() -> None:
        async with serving("trtllm", "decode") as decode, serving("sglang", "prefill") as prefill:
            for engine, mode in ((decode, "decode"), (prefill, "prefill")):
                failed = await engine.failure(generate())
                assert failed.code() == Code.INVALID_ARGUMENT
                assert failed.details() == f"Disaggregated params are required for {mode} mode"
            replies = await decode.answer(generate(request_type="context_and_generation"))
            assert kinds(replies) == ["token", "token", "finished"]
            assert (tokens(replies), usage(replies[-1])) == (TWO, (4, 2, 6))
            failed = await decode.failure(generate(request_type="generation_only"))
            assert failed.code() == Code.INVALID_ARGUMENT
            assert "kv.session" in failed.details()
            failed = await decode.failure(generate(request_type="bogus"))
            assert failed.code() == Code.INVALID_ARGUMENT
            checks = {c.name: c.message for c in (await decode.health()).checks}
            assert checks == {"grpc": "serving", "model": "tiny", "kv_connector": "DEFAULT"}

    run(scenario)


def test_context_only_pins_a_kv_session_until_its_decode_leg_takes_it() -> None:
    async def scenario() -> None:
        async with serving("trtllm", "prefill") as engine:
            replies = await engine.answer(generate(request_type="context_only"))
            assert kinds(replies) == ["token", "prefill_ready"]  # no finished
            ready = replies[-1]
            session_id = ready.prefill_ready.kv_session.session_id
            assert session_id.isdigit()
            assert usage(ready) == (4, 1, 5)
            assert engine.state.snapshot()["pinned_kv_sessions"] == 1

            # The decode leg, with the fake's classes (the sidecar declares no kv): the session
            # as the prefill answered it, its fields unknown to the sidecar's class kept.
            ours = grpc_openengine.MESSAGES
            session = ours["GenerateResponse"].FromString(ready.SerializeToString())
            kv_session = session.prefill_ready.kv_session
            assert kv_session.attributes_struct["opaque_state"]
            made_up = ours["KvSessionRef"]()
            made_up.CopyFrom(kv_session)
            made_up.session_id = "12345"

            def leg(kv: Message) -> Message:
                request = ours["GenerateRequest"].FromString(generate().SerializeToString())
                request.kv.session.CopyFrom(kv)
                return request

            failed = await engine.failure(leg(made_up))
            assert failed.code() == Code.INVALID_ARGUMENT
            assert engine.state.snapshot()["pinned_kv_sessions"] == 1
            replies = await engine.answer(leg(kv_session))
            assert (kinds(replies)[-1], tokens(replies)) == ("finished", TWO)
            assert engine.state.snapshot()["pinned_kv_sessions"] == 0
            failed = await engine.failure(leg(kv_session))  # taken: no longer pinned
            assert failed.code() == Code.INVALID_ARGUMENT

    run(scenario)


# ------------------------------------------------------------------------------------ abort


def test_abort_ends_a_hung_stream_with_cancelled() -> None:
    async def scenario() -> None:
        async with serving("trtllm") as engine:
            engine.fault(hang_generation=True)
            call = asyncio.ensure_future(engine.answer(generate()))
            await engine.running()
            answer = await engine.abort()
            assert (answer.status, answer.message) == (ABORTED, RID)
            [reply] = await call
            assert reply.finished.reason == CANCELLED
            assert usage(reply) == (4, 0, 4)
            answer = await engine.abort()
            assert (answer.status, answer.message) == (ALREADY_FINISHED, RID)
            await engine.released()

            # all_requests, with the fake's class (the sidecar's oneof has request_id only).
            ours = grpc_openengine.MESSAGES
            every = ours["AbortRequest"](all_requests=ours["AllRequests"]())
            answer = await engine.control("Abort", every)
            assert (answer.status, answer.message) == (ALREADY_FINISHED, "aborted 0 request(s)")
            call = asyncio.ensure_future(engine.answer(generate()))
            await engine.running()
            answer = await engine.control("Abort", every)
            assert (answer.status, answer.message) == (ABORTED, "aborted 1 request(s)")
            assert kinds(await call) == ["finished"]
            logged = [r["json"] for r in engine.state.requests if r["path"].endswith("/Abort")]
            assert (logged[0], logged[-1]) == ({"request_id": RID}, {"all_requests": {}})

    run(scenario)


def test_a_client_deadline_on_a_hung_engine_aborts_the_job() -> None:
    async def scenario() -> None:
        async with serving("trtllm") as engine:
            engine.fault(hang_generation=True)
            failed = await engine.failure(generate(), deadline=HUNG)
            assert failed.code() == Code.DEADLINE_EXCEEDED
            await engine.released()
            assert engine.state.snapshot()["abandoned"] == {"aborted": 1, "computed": 0}
            assert (await engine.load()).running_requests == 0

    run(scenario)


# ------------------------------------------------------------------------------- the faults


def test_dead_and_generation_errors_are_an_engine_error_in_an_ok_stream() -> None:
    async def scenario() -> None:
        async with serving("trtllm") as engine:
            engine.fault(dead=True)
            [reply] = await engine.answer(generate())  # status OK
            assert (reply.error.code, reply.error.message) == (
                INTERNAL,
                TrtllmBackend.dead_message,
            )
            assert usage(reply) == (4, 0, 4)
            health = await engine.health()
            assert health.state == NOT_READY
            assert [(c.name, c.state) for c in health.checks] == [
                ("grpc", READY),
                ("model", NOT_READY),
            ]
            assert health.checks[1].message == "engine health check failed"
            engine.state.reset_faults()
            for status, code in ((400, INVALID), (503, INTERNAL)):
                engine.fault(generation_status=status, generation_error="no")
                [reply] = await engine.answer(generate())
                assert (reply.error.code, reply.error.message) == (code, "no")
            assert engine.state.generated_tokens == 0

    run(scenario)


def test_garbage_faults_on_the_final_event() -> None:
    async def scenario() -> None:
        async with serving("trtllm") as engine:
            engine.fault(garbage="wrong_token_count")
            replies = await engine.answer(generate())
            assert (tokens(replies), usage(replies[-1])[1]) == (TWO, 3)
            engine.fault(garbage="no_finish_reason")
            replies = await engine.answer(generate())
            assert replies[-1].finished.reason == UNSPECIFIED
            engine.fault(garbage="truncated")
            assert kinds(await engine.answer(generate())) == ["token", "token"]

    run(scenario)


# -------------------------------------------------------------------------- health and load


def test_health_probe_is_shared_counted_and_degraded_while_hung() -> None:
    async def scenario() -> None:
        async with serving("trtllm", openengine_probe_timeout=PROBE_TIMEOUT) as engine:
            health = await engine.health()
            assert health.state == READY
            assert [c.name for c in health.checks] == ["grpc", "model"]
            replies = await engine.health(probe=True, model="asked")
            assert (replies.state, replies.checks[-1].name) == (READY, "inference_probe")
            assert replies.checks[-1].message == "asked"
            assert not [r for r in engine.state.requests if r["path"].endswith("/Health")]

            engine.fault(hang_generation=True)
            probes = [asyncio.ensure_future(engine.health(probe=True)) for _ in range(2)]
            await engine.until(lambda: len(engine.state.jobs) == 1, "one probe running")
            [probe_id] = engine.state.jobs
            assert probe_id.startswith(grpc_openengine.PROBE_PREFIX)
            assert (await engine.load()).running_requests == 1
            assert (await engine.health()).state == READY  # without the probe: a hang is unseen
            for answer in await asyncio.gather(*probes):
                assert answer.state == DEGRADED
                probe = answer.checks[-1]
                assert (probe.name, probe.state) == ("inference_probe", DEGRADED)
                assert probe.message == f"probe did not complete within {PROBE_TIMEOUT}s"
            await engine.released()  # the timed-out probe was aborted
            assert (await engine.load()).running_requests == 0

    run(scenario)


def test_get_load_is_unavailable_when_stale_under_a_hung_generation() -> None:
    async def scenario() -> None:
        async with serving("trtllm", openengine_load_stale_seconds=STALE) as engine:
            load = await engine.load()
            assert (load.running_requests, load.HasField("queued_requests")) == (0, False)
            assert load.instance_id
            assert abs(load.timestamp_unix_nanos - time.time_ns()) < 5e9  # now

            engine.fault(hang_generation=True)
            call = asyncio.ensure_future(engine.answer(generate()))
            await engine.running()
            assert (await engine.load()).running_requests == 1  # fresh: it just started

            async def refused() -> grpc.aio.AioRpcError | None:
                try:
                    await engine.load()
                except grpc.aio.AioRpcError as failed:
                    return failed
                return None

            loop = asyncio.get_running_loop()
            deadline = loop.time() + STALE + WITHIN
            while (failed := await refused()) is None:
                assert loop.time() < deadline, "GetLoad never went stale"
                await asyncio.sleep(0.02)
            assert failed.code() == Code.UNAVAILABLE
            assert failed.details() == grpc_openengine.STALE_MESSAGE
            await engine.abort()
            await call
            await engine.released()
            assert (await engine.load()).running_requests == 0  # idle: an old sample is fine

    run(scenario)


def test_while_loading_generate_queues_and_health_is_not_ready() -> None:
    """SGLang's fake opens its ports while loading (the real OpenEngine server does not)."""

    async def scenario() -> None:
        async with serving("sglang", loading=0.3) as engine:
            call = asyncio.ensure_future(engine.answer(generate()))
            health = await engine.health()
            assert (health.state, health.checks[1].state) == (NOT_READY, NOT_READY)
            assert kinds(await call) == ["token", "token", "finished"]  # once loaded
            assert (await engine.health()).state == READY

    run(scenario)


# --------------------------------------------------------------------------------- process

LISTENING = re.compile(r"fakeengine gRPC listening on 127\.0\.0\.1:(\d+) service=(\S+)")


def test_the_process_serves_openengine_on_the_port_it_prints(
    engine: Callable[..., FakeEngine],
) -> None:
    fake = engine("trtllm", "prefill", "--grpc-port", "0", "--grpc-service", "openengine")
    found: list[re.Match[str]] = []

    def listening() -> bool:
        found[:] = [m for m in [LISTENING.search(fake.output())] if m is not None]
        return bool(found)

    wait_until(listening, timeout=WITHIN * 5, what="the gRPC listening line")
    port, service = int(found[0].group(1)), found[0].group(2)
    assert service == f"{INFERENCE},{CONTROL}"
    with grpc.insecure_channel(f"{HOST}:{port}", options=[("grpc.enable_http_proxy", 0)]) as ch:
        call = ch.unary_stream(
            f"/{INFERENCE}/Generate",
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=sidecar("GenerateResponse").FromString,
        )
        replies = list(call(generate(request_type="context_only"), timeout=CALL * 5))
        assert kinds(replies) == ["token", "prefill_ready"]
    state = fake.http.get(f"{fake.url}/_fake/state").json()
    assert state["pinned_kv_sessions"] == 1
    [logged] = fake.requests()
    assert (logged["path"], logged["json"]["extra"]) == (
        f"/{INFERENCE}/Generate",
        {"request_type": "context_only"},
    )
    assert fake.stop() == 0


def test_the_flags_refuse_what_is_not_served() -> None:
    for argv in (
        ["--grpc-service", "openengine"],  # no --grpc-port
        ["--grpc-port", "0", "--grpc-service", "openengine", "--mode", "encode"],
        ["--grpc-port", "0", "--grpc-service", "openengine", "--backend", "openai"],
        ["--grpc-port", "0", "--grpc-service", "nope"],
    ):
        with pytest.raises(SystemExit) as refused:
            cli.main(["--port", "0", *argv])
        assert refused.value.code == 2
