"""SGLang's ``--smg-grpc-mode`` service, faked: ``sglang.grpc.scheduler.SglangScheduler`` (see
grpcengine.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import Message

from fakeengine.backends.base import new_id
from fakeengine.grpc_base import (
    HEALTH_CHECK_PREFIX,
    MAX_CONTEXT_LENGTH,
    VOCAB_SIZE,
    Context,
    Servicer,
    first_done,
)
from fakeengine.schemas import DEFAULT_MAX_TOKENS
from fakeengine.state import FAKE_BOOTSTRAP_HOST, EngineStopping, Job


class SglangServicer(Servicer):
    """``sglang.grpc.scheduler.SglangScheduler``, SGLang's ``--smg-grpc-mode`` as
    smg-grpc-servicer 0.14.1 serves it over SGLang 0.5.23's scheduler (read in their sources, not
    run here).

    - Generate: ``tokenized.input_ids`` (missing: INVALID_ARGUMENT "Tokenized input must be
      provided"), ``sampling_params.max_new_tokens``, ``stream``. Streamed: one ``chunk`` per
      scheduler output whose ``token_ids`` are the step's delta (the scheduler sends
      ``output_ids[send_token_offset:]``) and whose ``completion_tokens`` are cumulative; at
      the end the servicer sends that last output again as ``complete`` (its delta as
      ``output_ids``, the cumulative ``completion_tokens``). Not streamed: one ``complete`` with
      every token. ``finish_reason`` as the proto carries it: "length", "stop", "abort".
    - Role rules, the HTTP fake's (``backends/sglang.py``), on ``disaggregated_params
      {bootstrap_host, bootstrap_port, bootstrap_room}`` (host None when empty, room None only
      without the message, as the servicer converts them): a decode request without a host
      crashes the decode scheduler and the server with it (SIGKILL); a prefill request without a
      room is refused, INVALID_ARGUMENT with the HTTP 400's message (a tokenizer-manager rule,
      kept here though the smg servicer does not pass its requests through that manager); a
      host other than the fake-transfer host (2.2.2.2) waits for a peer that never comes, in the
      bootstrap or transfer queue, until the client leaves; prefill generates one token.
    - ``generation_status``: the scheduler's abort with that status, the status smg-grpc-
      servicer's table gives it (500: INTERNAL) with ``generation_error``. ``dead``: UNAVAILABLE
      with the HTTP side's message (a dead scheduler takes the whole server down: no server).
    - Abort{request_id}: ``success`` "Request <id> aborted" (for any id the servicer can send
      to the scheduler; HEALTH_CHECK ids: not found). A request aborted before its first token
      comes back from the scheduler as a generic abort, which the servicer ends with INTERNAL
      "Request aborted"; one aborted after tokens is marked finished locally, so its last
      output is dropped and the stream stays open, silent, until the client leaves.
    - HealthCheck: a 1-token generation (rid HEALTH_CHECK_..., not counted, the fake transfer
      host in P/D modes) answered healthy at the engine's first output after the check began,
      unhealthy after ``--health-check-timeout`` (SGLANG_HEALTH_CHECK_TIMEOUT) without one; a
      hung scheduler is seen. The probe runs on when the check gives up.
    """

    backend = "sglang"
    module = "sglang_scheduler_pb2"
    service_name = "SglangScheduler"

    async def on_dead(self, context: Context) -> None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, self.http.dead_message)

    async def Generate(self, request: Any, context: Context) -> AsyncIterator[Message]:
        self.record("Generate", request, context)
        await self.before_generation(context)
        if not request.HasField("tokenized"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "Tokenized input must be provided"
            )
        prompt_ids = list(request.tokenized.input_ids)
        params = request.sampling_params
        max_tokens = (
            params.max_new_tokens if params.HasField("max_new_tokens") else DEFAULT_MAX_TOKENS
        )
        pinned = request.data_parallel_rank if request.HasField("data_parallel_rank") else None
        job = Job(
            request_id=request.request_id or new_id(),
            prompt_tokens=len(prompt_ids),
            max_tokens=max_tokens,
            prompt_ids=prompt_ids,
            stream=request.stream,
        )
        job.rank = await self.check_rank(context, pinned)
        try:
            await self._apply_roles(request, job, context)
        except EngineStopping:
            await self.stopping(context)
        run = self.run(job, context)
        generated = 0
        last: list[int] = []
        try:
            async for token in run.stream():
                generated += 1
                last = [token]
                if request.stream:
                    yield self._chunk(job, last, generated)
        except EngineStopping:
            await self.stopping(context)
        if job.finish_reason == "abort":
            if not run.tokens:
                await context.abort(grpc.StatusCode.INTERNAL, "Request aborted")
            # The servicer dropped the scheduler's last output: nothing more comes.
            await self.state.stopping.wait()
            await self.stopping(context)
        complete = self._complete(job, last if request.stream else run.tokens, generated)
        garbled = self.garbled(complete)
        if garbled is not None:
            yield garbled

    async def _apply_roles(self, request: Any, job: Job, context: Context) -> None:
        mode = self.state.config.mode
        if mode not in ("prefill", "decode"):
            return
        host: str | None = None
        room: int | None = None
        if request.HasField("disaggregated_params"):
            params = request.disaggregated_params
            host = params.bootstrap_host or None
            room = params.bootstrap_room
        if mode == "decode" and host is None:
            self.http._crash_decode_scheduler(job)  # type: ignore[attr-defined]
        if room is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "Invalid request: Disaggregated request received without bootstrap room id. "
                f"req.rid={job.request_id}",
            )
        if host != FAKE_BOOTSTRAP_HOST:
            await self._wait_for_peer(job)
        if mode == "prefill":
            job.max_tokens = min(job.max_tokens, 1)

    async def _wait_for_peer(self, job: Job) -> None:
        """Where SGLang keeps a request whose peer never comes (the prefill's bootstrap queue,
        the decode's transfer queue), until the client leaves (the call is cancelled) or the
        server stops (EngineStopping)."""
        stats = self.state.ranks[job.rank].stats
        queue = (
            "prefill_bootstrap_queue"
            if self.state.config.mode == "prefill"
            else "decode_transfer_queue"
        )
        setattr(stats, queue, getattr(stats, queue) + 1)
        try:
            await self.state.stopping.wait()
        finally:
            setattr(stats, queue, getattr(stats, queue) - 1)
        raise EngineStopping

    def _chunk(self, job: Job, delta: list[int], generated: int) -> Message:
        pb = self.pb
        chunk = pb.GenerateStreamChunk(
            token_ids=delta, prompt_tokens=job.prompt_tokens, completion_tokens=generated
        )
        return pb.GenerateResponse(request_id=job.request_id, chunk=chunk)

    def _complete(self, job: Job, tokens: list[int], generated: int) -> Message:
        pb = self.pb
        complete = pb.GenerateComplete(
            output_ids=tokens,
            finish_reason="length",
            prompt_tokens=job.prompt_tokens,
            completion_tokens=generated,
        )
        return pb.GenerateResponse(request_id=job.request_id, complete=complete)

    async def Abort(self, request: Any, context: Context) -> Message:
        self.record("Abort", request, context)
        request_id = request.request_id
        if request_id.startswith(HEALTH_CHECK_PREFIX):
            return self.pb.AbortResponse(success=False, message=f"Request {request_id} not found")
        self.state.abort_request(request_id)
        return self.pb.AbortResponse(success=True, message=f"Request {request_id} aborted")

    async def HealthCheck(self, request: Any, context: Context) -> Message:
        pb = self.pb
        if self.state.faults.dead:
            await self.on_dead(context)
        if self.state.stopping.is_set():
            return pb.HealthCheckResponse(healthy=False, message="Server is shutting down")
        faults = self.state.faults
        if faults.health_latency:
            await asyncio.sleep(faults.health_latency)
        if faults.health_status is not None:
            forced = faults.health_status
            message = f"Health status {forced} forced by fault"
            return pb.HealthCheckResponse(healthy=forced < 300, message=message)
        if await self._probe():
            return pb.HealthCheckResponse(healthy=True, message="Health check passed")
        timeout = self.state.config.health_check_timeout
        return pb.HealthCheckResponse(
            healthy=False, message=f"Health check timeout after {timeout:g}s"
        )

    async def _probe(self) -> bool:
        """Start a 1-token generation and wait for any output of the engine since then (this
        one's or another request's) within the health-check timeout."""
        state = self.state
        seen = state.outputs
        job = Job(
            request_id=f"{HEALTH_CHECK_PREFIX}_{time.time()}",
            prompt_tokens=1,
            max_tokens=1,
            prompt_ids=[0],
            log_metrics=False,
        )
        job.rank = state.route(None)
        probe = asyncio.ensure_future(self._run_probe(job))
        self._tasks.add(probe)
        probe.add_done_callback(self._tasks.discard)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + state.config.health_check_timeout
        while state.outputs == seen:
            remaining = deadline - loop.time()
            if remaining <= 0 or state.stopping.is_set():
                return False
            await first_done(state.output.wait(), state.stopping.wait(), seconds=remaining)
        return True

    async def _run_probe(self, job: Job) -> None:
        with contextlib.suppress(EngineStopping):
            await self.state.wait_loaded()
            await self.state.generate_all(job)

    async def GetModelInfo(self, request: Any, context: Context) -> Message:
        model = self.state.config.model
        return self.pb.GetModelInfoResponse(
            model_path=model,
            tokenizer_path=model,
            served_model_name=model,
            is_generation=True,
            max_context_length=MAX_CONTEXT_LENGTH,
            max_req_input_len=MAX_CONTEXT_LENGTH,
            vocab_size=VOCAB_SIZE,
        )
