"""TensorRT-LLM's gRPC generation service, faked: ``trtllm.TrtllmService`` (see grpcengine.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import Message

from fakeengine.backends.base import new_id
from fakeengine.grpc_base import MAX_CONTEXT_LENGTH, VOCAB_SIZE, Context, Servicer
from fakeengine.state import EngineStopping, Job


class TrtllmServicer(Servicer):
    """``trtllm.TrtllmService`` as TensorRT-LLM's SMG servicer runs it (``tensorrt_llm/grpc/smg``,
    read in its source, not run here).

    - Generate: ``tokenized.input_token_ids`` (missing: INVALID_ARGUMENT "Missing tokenized
      input"), ``max_tokens``, ``streaming``. Streamed: one ``chunk`` per new token (``token_ids``
      the delta, ``completion_tokens`` cumulative; an empty delta is not sent), then
      ``complete`` whose ``output_token_ids`` are ALL the tokens (cumulative, unlike vLLM's).
    - Role rules, the HTTP fake's (``backends/trtllm.py``): in prefill and decode modes a request
      without ``disaggregated_params`` is refused, INVALID_ARGUMENT "Disaggregated params are
      required for decode mode" (DIS-1737: a plain canary to a decode worker). With them:
      ``REQUEST_TYPE_CONTEXT_ONLY`` runs the context phase (one token; this proto has no field
      to return context params in), ``REQUEST_TYPE_GENERATION_ONLY`` needs the context phase's
      ``context_phase_params``, ``REQUEST_TYPE_CONTEXT_AND_GENERATION`` (0, the default) runs
      locally as an aggregated request does (the DIS-1737 fix's decode canary).
    - Errors are gRPC statuses (the servicer's ValueError: INVALID_ARGUMENT, anything else:
      INTERNAL): ``dead`` INTERNAL with the HTTP side's message; ``generation_status`` below 500
      INVALID_ARGUMENT, else INTERNAL.
    - Abort{request_id}: ``success`` and "Request <id> aborted" when it runs ("not found" else);
      the pending Generate ends OK with ``finish_reason "cancelled"`` and the tokens so far
      (TensorRT-LLM's FinishReason.CANCELLED).
    - HealthCheck: ``status`` "OK", or why not ("Executor is unhealthy"); a hung executor is OK.
    """

    backend = "trtllm"
    module = "trtllm_service_pb2"
    service_name = "TrtllmService"

    rpcs = ("Generate", "Abort", "HealthCheck", "GetModelInfo", "GetServerInfo")

    async def on_generation_status(self, context: Context, status: int) -> None:
        code = grpc.StatusCode.INVALID_ARGUMENT if status < 500 else grpc.StatusCode.INTERNAL
        await context.abort(code, self.state.faults.generation_error)

    async def Generate(self, request: Any, context: Context) -> AsyncIterator[Message]:
        self.record("Generate", request, context)
        await self.before_generation(context)
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if not request.HasField("tokenized"):
            await context.abort(invalid, "Missing tokenized input")
        prompt_ids = list(request.tokenized.input_token_ids)
        job = Job(
            request_id=request.request_id or new_id(),
            prompt_tokens=len(prompt_ids),
            max_tokens=request.max_tokens,
            prompt_ids=prompt_ids,
            stream=request.streaming,
        )
        refusal = self._role_refusal(request, job)
        if refusal is not None:
            await context.abort(invalid, refusal)
        job.rank = self.state.route(None)
        run = self.run(job, context)
        try:
            async for token in run.stream():
                if request.streaming:
                    yield self._chunk(job, [token], len(run.tokens))
        except EngineStopping:
            await self.stopping(context)
        if job.finish_reason == "abort":
            yield self._complete(job, run.tokens, "cancelled")
            return
        complete = self.garbled(self._complete(job, run.tokens, "length"))
        if complete is not None:
            yield complete

    def _role_refusal(self, request: Any, job: Job) -> str | None:
        """The HTTP fake's TensorRT-LLM role rule on this proto's fields: why the request is
        refused, or None (a context-only request is cut to its one token)."""
        mode = self.state.config.mode
        if not request.HasField("disaggregated_params"):
            if mode in ("prefill", "decode"):
                return f"Disaggregated params are required for {mode} mode"
            return None
        params = request.disaggregated_params
        types = self.pb.DisaggregatedParams
        if params.request_type == types.REQUEST_TYPE_CONTEXT_ONLY:
            job.max_tokens = min(job.max_tokens, 1)
        elif params.request_type == types.REQUEST_TYPE_GENERATION_ONLY:
            if not params.HasField("context_phase_params"):
                return "generation_only requests need context_phase_params from the context phase"
        elif params.request_type != types.REQUEST_TYPE_CONTEXT_AND_GENERATION:
            return f"Unknown request type: {params.request_type}"
        return None

    def _chunk(self, job: Job, delta: list[int], generated: int) -> Message:
        pb = self.pb
        chunk = pb.GenerateStreamChunk(
            token_ids=delta, prompt_tokens=job.prompt_tokens, completion_tokens=generated
        )
        return pb.GenerateResponse(request_id=job.request_id, chunk=chunk)

    def _complete(self, job: Job, tokens: list[int], reason: str) -> Message:
        pb = self.pb
        complete = pb.GenerateComplete(
            output_token_ids=tokens,
            finish_reason=reason,
            prompt_tokens=job.prompt_tokens,
            completion_tokens=len(tokens),
        )
        return pb.GenerateResponse(request_id=job.request_id, complete=complete)

    async def Abort(self, request: Any, context: Context) -> Message:
        self.record("Abort", request, context)
        found = self.state.abort_request(request.request_id)
        message = f"Request {request.request_id} {'aborted' if found else 'not found'}"
        return self.pb.AbortResponse(success=found, message=message)

    async def HealthCheck(self, request: Any, context: Context) -> Message:
        healthy = await self.engine_health()
        return self.pb.HealthCheckResponse(status="OK" if healthy else "Executor is unhealthy")

    async def GetModelInfo(self, request: Any, context: Context) -> Message:
        return self.pb.GetModelInfoResponse(
            model_id=self.state.config.model,
            max_input_len=MAX_CONTEXT_LENGTH,
            max_seq_len=MAX_CONTEXT_LENGTH,
            vocab_size=VOCAB_SIZE,
        )

    async def GetServerInfo(self, request: Any, context: Context) -> Message:
        return self.pb.GetServerInfoResponse(
            version="0.0.0+fakeengine",
            backend="tensorrt-llm",
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            context_parallel_size=1,
            world_size=1,
        )
