"""The fake engine's gRPC generation services (``--grpc-port``, ``fakeengine/grpcengine.py``):
vLLM's ``VllmEngine``, TensorRT-LLM's ``TrtllmService`` and SGLang's ``--smg-grpc-mode``
``SglangScheduler``, spoken to with the field's own generated stubs (smg_grpc_proto).

Each server runs in the test's own event loop on 127.0.0.1 (port 0) over an ``EngineState``, the
state the HTTP side drives, so the tests set faults and read counters, jobs and the request log
on it directly. One test runs the fake as users start it (``python -m fakeengine --grpc-port 0``).
Every call has a deadline: ``CALL`` for a call that answers, ``HUNG`` for one meant to time out;
every wait for the engine polls with a deadline (``WITHIN``).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import (
    sglang_scheduler_pb2,
    sglang_scheduler_pb2_grpc,
    trtllm_service_pb2,
    trtllm_service_pb2_grpc,
    vllm_engine_pb2,
    vllm_engine_pb2_grpc,
)

from fakeengine import cli, grpcengine
from fakeengine.grpc_base import VOCAB_SIZE
from fakeengine.state import FAKE_BOOTSTRAP_HOST, EngineConfig, EngineState, token_at
from tests.support.harness import FakeEngine
from tests.support.processes import wait_until

pytestmark = pytest.mark.process

HOST = "127.0.0.1"
CALL = 1.0  # deadline of a call that answers
HUNG = 0.5  # deadline of a call meant to time out
WITHIN = 1.0  # how long the engine may take to show what a test waits for
PROMPT = [10, 11, 12, 13]
TWO = [token_at(0), token_at(1)]  # the fake's greedy answer, two tokens
RID = "canary-1"
VLLM_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
DECODE_REFUSAL = "Disaggregated params are required for decode mode"
STUBS: dict[str, Callable[[grpc.aio.Channel], Any]] = {
    "vllm": vllm_engine_pb2_grpc.VllmEngineStub,
    "sglang": sglang_scheduler_pb2_grpc.SglangSchedulerStub,
    "trtllm": trtllm_service_pb2_grpc.TrtllmServiceStub,
}
Code = grpc.StatusCode


# --------------------------------------------------------------------------------- harness


@dataclass
class Engine:
    """One fake engine's state and its gRPC service, with a client stub."""

    state: EngineState
    server: grpcengine.GrpcEngine
    channel: grpc.aio.Channel
    stub: Any

    def fault(self, **changes: Any) -> None:
        self.state.update_faults(changes)

    async def answer(self, request: Message, deadline: float = CALL) -> list[Any]:
        """Every message of a Generate that ends OK (``deadline``: the call's, in seconds)."""
        return [reply async for reply in self.stub.Generate(request, timeout=deadline)]

    async def failure(self, request: Message, deadline: float = CALL) -> grpc.aio.AioRpcError:
        """The status of a Generate that fails."""
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await self.answer(request, deadline)
        return failed.value

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WITHIN
        while not condition():
            assert loop.time() < deadline, f"no {what} within {WITHIN} s"
            await asyncio.sleep(0.01)

    async def released(self) -> None:
        """Nothing runs on the engine any more."""
        await self.until(lambda: self.state.running == 0 and not self.state.jobs, "idle engine")

    def generated(self) -> list[dict[str, Any]]:
        return [r for r in self.state.requests if r["path"].endswith("/Generate")]


@contextlib.asynccontextmanager
async def serving(backend: str, mode: str = "aggregated", **config: Any) -> AsyncIterator[Engine]:
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
        loading_seconds=0.0,
    )
    server = await grpcengine.start(state, HOST, 0)
    channel = grpc.aio.insecure_channel(
        f"{HOST}:{server.port}", options=[("grpc.enable_http_proxy", 0)]
    )
    try:
        yield Engine(state, server, channel, STUBS[backend](channel))
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


def vllm_request(*, stream: bool = False, max_tokens: int = 2) -> Any:
    pb = vllm_engine_pb2
    return pb.GenerateRequest(
        request_id=RID,
        tokenized=pb.TokenizedInput(input_ids=PROMPT),
        sampling_params=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        stream=stream,
    )


def sglang_request(*, stream: bool = False, **disaggregated: Any) -> Any:
    pb = sglang_scheduler_pb2
    request = pb.GenerateRequest(
        request_id=RID,
        tokenized=pb.TokenizedInput(input_ids=PROMPT),
        sampling_params=pb.SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True),
        stream=stream,
    )
    if disaggregated:
        request.disaggregated_params.CopyFrom(pb.DisaggregatedParams(**disaggregated))
    return request


def trtllm_request(*, stream: bool = False, disaggregated: Any = None) -> Any:
    pb = trtllm_service_pb2
    request = pb.GenerateRequest(
        request_id=RID,
        tokenized=pb.TokenizedInput(input_token_ids=PROMPT),
        sampling_config=pb.SamplingConfig(temperature=0),
        max_tokens=2,
        streaming=stream,
        ignore_eos=True,
    )
    if disaggregated is not None:
        request.disaggregated_params.CopyFrom(disaggregated)
    return request


REQUESTS: dict[str, Callable[[], Any]] = {
    "vllm": vllm_request,
    "sglang": sglang_request,
    "trtllm": trtllm_request,
}


def kinds(replies: list[Any]) -> list[str]:
    return [reply.WhichOneof("response") for reply in replies]


# ------------------------------------------------------------------------- two greedy tokens


def test_vllm_answers_two_greedy_tokens_in_one_complete() -> None:
    async def scenario() -> None:
        async with serving("vllm") as engine:
            replies = await engine.answer(vllm_request())
            assert kinds(replies) == ["complete"]
            complete = replies[0].complete
            assert list(complete.output_ids) == TWO
            assert complete.finish_reason == "length"
            assert (complete.prompt_tokens, complete.completion_tokens) == (4, 2)
            stats = engine.state.ranks[0].stats
            assert (stats.prompt_tokens, stats.generated_tokens, stats.finished_requests) == (
                4,
                2,
                1,
            )
            [logged] = engine.generated()
            assert logged["method"] == "GRPC"
            assert logged["path"] == "/vllm.grpc.engine.VllmEngine/Generate"
            assert logged["json"]["request_id"] == RID
            assert logged["json"]["tokenized"]["input_ids"] == PROMPT
            assert logged["json"]["sampling_params"]["max_tokens"] == 2
            assert logged["headers"]["user-agent"].startswith("grpc-python")

    run(scenario)


def test_vllm_streams_deltas_then_a_complete_repeating_the_last_one() -> None:
    async def scenario() -> None:
        async with serving("vllm") as engine:
            replies = await engine.answer(vllm_request(stream=True))
            assert kinds(replies) == ["chunk", "chunk", "complete"]
            assert [list(r.chunk.token_ids) for r in replies[:2]] == [[TWO[0]], [TWO[1]]]
            assert [r.chunk.completion_tokens for r in replies[:2]] == [1, 1]
            final = replies[2].complete
            assert list(final.output_ids) == [TWO[1]]
            assert (final.finish_reason, final.completion_tokens) == ("length", 1)
            assert engine.state.logged[True].requests == 1

    run(scenario)


def test_sglang_scheduler_answers_and_streams_with_cumulative_counts() -> None:
    async def scenario() -> None:
        async with serving("sglang") as engine:
            [reply] = await engine.answer(sglang_request())
            assert reply.request_id == RID
            assert list(reply.complete.output_ids) == TWO
            assert reply.complete.finish_reason == "length"
            assert (reply.complete.prompt_tokens, reply.complete.completion_tokens) == (4, 2)

            replies = await engine.answer(sglang_request(stream=True))
            assert kinds(replies) == ["chunk", "chunk", "complete"]
            # The scheduler's outputs are deltas; their completion_tokens count from the start.
            assert [list(r.chunk.token_ids) for r in replies[:2]] == [[TWO[0]], [TWO[1]]]
            assert [r.chunk.completion_tokens for r in replies[:2]] == [1, 2]
            final = replies[2].complete
            assert (list(final.output_ids), final.completion_tokens) == ([TWO[1]], 2)
            assert {streamed: t.requests for streamed, t in engine.state.logged.items()} == {
                False: 1,
                True: 1,
            }

    run(scenario)


def test_trtllm_answers_and_streams_deltas_then_every_token() -> None:
    async def scenario() -> None:
        async with serving("trtllm") as engine:
            [reply] = await engine.answer(trtllm_request())
            assert list(reply.complete.output_token_ids) == TWO
            assert reply.complete.finish_reason == "length"
            assert (reply.complete.prompt_tokens, reply.complete.completion_tokens) == (4, 2)

            replies = await engine.answer(trtllm_request(stream=True))
            assert kinds(replies) == ["chunk", "chunk", "complete"]
            assert [list(r.chunk.token_ids) for r in replies[:2]] == [[TWO[0]], [TWO[1]]]
            assert [r.chunk.completion_tokens for r in replies[:2]] == [1, 2]
            assert list(replies[2].complete.output_token_ids) == TWO
            assert engine.state.generated_tokens == 4

    run(scenario)


# ------------------------------------------------------------------------------ role rules


def test_trtllm_decode_refuses_a_request_without_disaggregated_params() -> None:
    params = trtllm_service_pb2.DisaggregatedParams
    context = trtllm_service_pb2.ContextPhaseParams(first_gen_token_id=7, kv_cache_blocks=b"kv")

    async def scenario() -> None:
        async with serving("trtllm", "decode") as engine:
            refused = await engine.failure(trtllm_request())
            assert refused.code() == Code.INVALID_ARGUMENT
            assert refused.details() == DECODE_REFUSAL
            assert engine.state.generated_tokens == 0

            local = params(request_type=params.REQUEST_TYPE_CONTEXT_AND_GENERATION)
            [reply] = await engine.answer(trtllm_request(disaggregated=local))
            assert list(reply.complete.output_token_ids) == TWO

            remote = params(
                request_type=params.REQUEST_TYPE_GENERATION_ONLY, context_phase_params=context
            )
            [reply] = await engine.answer(trtllm_request(disaggregated=remote))
            assert reply.complete.finish_reason == "length"

            blind = params(request_type=params.REQUEST_TYPE_GENERATION_ONLY)
            refused = await engine.failure(trtllm_request(disaggregated=blind))
            assert refused.code() == Code.INVALID_ARGUMENT
            assert "context_phase_params" in (refused.details() or "")

    run(scenario)


def test_sglang_prefill_and_decode_apply_the_bootstrap_rule() -> None:
    async def scenario() -> None:
        async with serving("sglang", "prefill") as prefill, serving("sglang", "decode") as decode:
            refused = await prefill.failure(sglang_request())
            assert refused.code() == Code.INVALID_ARGUMENT
            assert "without bootstrap room id" in (refused.details() or "")

            fake = {"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": 0}
            [reply] = await prefill.answer(sglang_request(**fake))
            assert list(reply.complete.output_ids) == TWO[:1]  # prefill: its first token only
            [reply] = await decode.answer(sglang_request(**fake))
            assert list(reply.complete.output_ids) == TWO

            # A real peer that never comes: the request waits in the transfer queue.
            call = decode.answer(sglang_request(bootstrap_host="10.0.0.9", bootstrap_room=5), HUNG)
            waiting = asyncio.ensure_future(call)
            stats = decode.state.ranks[0].stats
            await decode.until(lambda: stats.decode_transfer_queue == 1, "queued request")
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await waiting
            assert failed.value.code() == Code.DEADLINE_EXCEEDED
            await decode.until(lambda: stats.decode_transfer_queue == 0, "empty queue")

    run(scenario)


# ------------------------------------------------------------------------- hangs and aborts


def test_a_client_deadline_on_a_hung_engine_releases_the_job_on_every_backend() -> None:
    async def hung(backend: str) -> None:
        async with serving(backend) as engine:
            engine.fault(hang_generation=True)
            failed = await engine.failure(REQUESTS[backend](), HUNG)
            assert failed.code() == Code.DEADLINE_EXCEEDED
            await engine.released()
            assert engine.state.snapshot()["abandoned"] == {"aborted": 1, "computed": 0}
            assert engine.state.generated_tokens == 0
            engine.fault(hang_generation=False)
            assert kinds(await engine.answer(REQUESTS[backend]())) == ["complete"]

    async def scenario() -> None:
        await asyncio.gather(*(hung(backend) for backend in STUBS))

    run(scenario)


async def abort_when_running(engine: Engine, abort: Callable[[], Awaitable[Any]]) -> Any:
    """Abort RID once the engine runs it; the Abort's answer."""
    await engine.until(lambda: RID in engine.state.jobs, "running job")
    return await abort()


def test_vllm_abort_during_a_hang_ends_ok_with_abort_and_no_tokens() -> None:
    async def scenario() -> None:
        async with serving("vllm") as engine:
            engine.fault(hang_generation=True)
            abort_request = vllm_engine_pb2.AbortRequest(request_ids=[RID])

            async def abort() -> Any:
                return await engine.stub.Abort(abort_request, timeout=CALL)

            for stream, expected in ((False, ["complete"]), (True, ["chunk", "complete"])):
                call = asyncio.ensure_future(engine.answer(vllm_request(stream=stream)))
                await abort_when_running(engine, abort)
                replies = await call
                assert kinds(replies) == expected
                assert replies[-1].complete.finish_reason == "abort"
                assert list(replies[-1].complete.output_ids) == []
                await engine.released()
            aborts = [r for r in engine.state.requests if r["path"].endswith("/Abort")]
            assert [r["json"] for r in aborts] == [{"request_ids": [RID]}] * 2

    run(scenario)


def sglang_abort(engine: Engine) -> Callable[[], Awaitable[Any]]:
    async def abort() -> Any:
        request = sglang_scheduler_pb2.AbortRequest(request_id=RID)
        return await engine.stub.Abort(request, timeout=CALL)

    return abort


def test_sglang_abort_before_the_first_token_ends_the_stream_internal() -> None:
    async def scenario() -> None:
        async with serving("sglang") as engine:
            engine.fault(hang_generation=True)
            call = asyncio.ensure_future(engine.failure(sglang_request()))
            answer = await abort_when_running(engine, sglang_abort(engine))
            assert (answer.success, answer.message) == (True, f"Request {RID} aborted")
            failed = await call
            assert (failed.code(), failed.details()) == (Code.INTERNAL, "Request aborted")
            await engine.released()

    run(scenario)


def test_sglang_abort_after_a_token_leaves_the_stream_silent_until_the_deadline() -> None:
    async def scenario() -> None:
        async with serving("sglang") as engine:
            # 0.3 s a token: without the abort the answer would be complete at 0.6 s.
            engine.fault(latency=0.6)
            call = engine.stub.Generate(sglang_request(stream=True), timeout=CALL)
            first = await call.read()
            assert list(first.chunk.token_ids) == TWO[:1]
            await sglang_abort(engine)()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await call.read()
            assert failed.value.code() == Code.DEADLINE_EXCEEDED
            await engine.released()
            assert engine.state.generated_tokens == 1

    run(scenario)


def test_trtllm_abort_cancels_the_request() -> None:
    async def scenario() -> None:
        async with serving("trtllm") as engine:
            engine.fault(hang_generation=True)
            call = asyncio.ensure_future(engine.answer(trtllm_request()))

            async def abort() -> Any:
                request = trtllm_service_pb2.AbortRequest(request_id=RID)
                return await engine.stub.Abort(request, timeout=CALL)

            answer = await abort_when_running(engine, abort)
            assert (answer.success, answer.message) == (True, f"Request {RID} aborted")
            [reply] = await call
            assert reply.complete.finish_reason == "cancelled"
            answer = await abort()
            assert (answer.success, answer.message) == (False, f"Request {RID} not found")

    run(scenario)


# ---------------------------------------------------------------------------------- faults


def test_a_dead_engine_fails_generate_as_each_servicer_does() -> None:
    async def scenario() -> None:
        async with (
            serving("vllm") as vllm,
            serving("sglang") as sglang,
            serving("trtllm") as trtllm,
        ):
            for engine in (vllm, sglang, trtllm):
                engine.fault(dead=True)
            failed = await vllm.failure(vllm_request())
            assert (failed.code(), failed.details()) == (Code.INTERNAL, VLLM_DEAD)
            failed = await sglang.failure(sglang_request())
            assert failed.code() == Code.UNAVAILABLE
            failed = await trtllm.failure(trtllm_request())
            assert failed.code() == Code.INTERNAL
            assert "Executor is shut down" in (failed.details() or "")

            health = await vllm.stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest())
            assert (health.healthy, health.message) == (False, "Engine is not alive")
            health = await trtllm.stub.HealthCheck(trtllm_service_pb2.HealthCheckRequest())
            assert health.status == "Executor is unhealthy"
            for engine in (vllm, sglang, trtllm):
                assert len(engine.generated()) == 1  # recorded all the same

    run(scenario)


def test_vllm_health_check_does_not_see_a_hang_but_sglang_does() -> None:
    async def scenario() -> None:
        async with serving("vllm") as vllm, serving("sglang", health_check_timeout=0.2) as sglang:
            request = vllm_engine_pb2.HealthCheckRequest()
            health = await vllm.stub.HealthCheck(request, timeout=CALL)
            assert (health.healthy, health.message) == (True, "Health")
            probe = sglang_scheduler_pb2.HealthCheckRequest()
            health = await sglang.stub.HealthCheck(probe, timeout=CALL)
            assert (health.healthy, health.message) == (True, "Health check passed")
            assert sglang.state.logged[False].requests == 0  # its probe is not counted

            for engine in (vllm, sglang):
                engine.fault(hang_generation=True)
            health = await vllm.stub.HealthCheck(request, timeout=CALL)
            assert health.healthy
            checker = health_pb2_grpc.HealthStub(vllm.channel)
            check = await checker.Check(health_pb2.HealthCheckRequest(service=""), timeout=CALL)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            health = await sglang.stub.HealthCheck(probe, timeout=CALL)
            assert (health.healthy, health.message) == (False, "Health check timeout after 0.2s")
            sglang.fault(hang_generation=False)
            await sglang.released()

    run(scenario)


def test_generation_errors_end_as_each_servicer_ends_them() -> None:
    async def scenario() -> None:
        async with (
            serving("vllm") as vllm,
            serving("sglang") as sglang,
            serving("trtllm") as trtllm,
        ):
            vllm.fault(generation_status=500)
            [reply] = await vllm.answer(vllm_request())
            assert reply.complete.finish_reason == "error"
            assert list(reply.complete.output_ids) == []
            vllm.fault(generation_status=503, generation_error="queue full")
            failed = await vllm.failure(vllm_request())
            assert (failed.code(), failed.details()) == (Code.UNAVAILABLE, "queue full")
            sglang.fault(generation_status=500)
            assert (await sglang.failure(sglang_request())).code() == Code.INTERNAL
            trtllm.fault(generation_status=400)
            assert (await trtllm.failure(trtllm_request())).code() == Code.INVALID_ARGUMENT

    run(scenario)


def test_garbage_answers_and_latency() -> None:
    async def scenario() -> None:
        async with serving("vllm") as engine:
            engine.fault(garbage="wrong_token_count")
            [reply] = await engine.answer(vllm_request())
            assert (list(reply.complete.output_ids), reply.complete.completion_tokens) == (TWO, 3)
            engine.fault(garbage="no_finish_reason")
            [reply] = await engine.answer(vllm_request())
            assert reply.complete.finish_reason == ""
            engine.fault(garbage="truncated")
            assert kinds(await engine.answer(vllm_request(stream=True))) == ["chunk", "chunk"]
            engine.fault(garbage=None, latency=0.2)
            loop = asyncio.get_running_loop()
            started = loop.time()
            await engine.answer(vllm_request())
            assert loop.time() - started >= 0.2

    run(scenario)


def test_refusals_before_anything_runs() -> None:
    async def scenario() -> None:
        async with serving("vllm", dp_size=2) as engine:
            request = vllm_request(max_tokens=0)
            failed = await engine.failure(request)
            assert failed.code() == Code.INVALID_ARGUMENT
            request = vllm_request()
            request.data_parallel_rank = 2
            failed = await engine.failure(request)
            assert failed.details() == "data_parallel_rank 2 is out of range [0, 2)."
            info = await engine.stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest())
            assert (info.served_model_name, info.vocab_size) == ("tiny", VOCAB_SIZE)

    run(scenario)
    for argv in (["--backend", "openai"], ["--backend", "vllm", "--mode", "encode"]):
        with pytest.raises(SystemExit) as refused:
            cli.main([*argv, "--port", "0", "--grpc-port", "0"])
        assert refused.value.code == 2


# --------------------------------------------------------------------------------- process

LISTENING = re.compile(r"fakeengine gRPC listening on 127\.0\.0\.1:(\d+) service=(\S+)")


def test_the_process_serves_grpc_on_the_port_it_prints(
    engine: Callable[..., FakeEngine],
) -> None:
    fake = engine("vllm", "aggregated", "--grpc-port", "0")
    found: list[re.Match[str]] = []

    def listening() -> bool:
        found[:] = [m for m in [LISTENING.search(fake.output())] if m is not None]
        return bool(found)

    wait_until(listening, timeout=WITHIN * 5, what="the gRPC listening line")
    port, service = int(found[0].group(1)), found[0].group(2)
    assert service == "vllm.grpc.engine.VllmEngine"
    with grpc.insecure_channel(f"{HOST}:{port}", options=[("grpc.enable_http_proxy", 0)]) as ch:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        replies = list(stub.Generate(vllm_request(), timeout=CALL * 5))
        assert list(replies[-1].complete.output_ids) == TWO
        check = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=CALL
        )
        assert check.status == health_pb2.HealthCheckResponse.SERVING
    [logged] = fake.requests()
    assert (logged["method"], logged["json"]["request_id"]) == ("GRPC", RID)
    assert fake.stop() == 0
