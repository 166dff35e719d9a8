"""SGLang (``python -m sglang.launch_server``, ``--disaggregation-mode prefill|decode``).

With ``--dp-size N``, ``/generate``'s ``data_parallel_rank`` field pins a request to a rank
(others are balanced); the metrics stay engine-wide sums (no per-rank label is known).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client.core import Metric
from pydantic import BaseModel

from sidecar.fakeengine.backends.base import Backend, counter, gauge, new_id
from sidecar.fakeengine.responses import ApiError, json_response, sse_response
from sidecar.fakeengine.schemas import GenerateRequest, OpenAIRequest
from sidecar.fakeengine.state import FAKE_BOOTSTRAP_HOST, Job, detokenize

logger = logging.getLogger(__name__)


class SglangBackend(Backend):
    name = "sglang"
    owned_by = "sglang"
    checks_model_name = False
    dead_message = "The server is not healthy: a scheduler process died"
    encoder_message = (
        "This instance is an encoder (disaggregation mode encode); text generation is not supported"
    )

    def error_body(self, status: int, message: str) -> object:
        return {"error": {"message": message}}

    def unhealthy_response(self, status: int, message: str) -> Response:
        return Response(status_code=status)

    def model_card(self) -> dict[str, Any]:
        return {**super().model_card(), "root": self.config.model}

    gzips_metrics = True

    def metric_families(self) -> list[Metric]:
        labels = {"model_name": self.config.model}
        s = self.state.published_total()
        return [
            gauge("sglang:num_running_reqs", "Running requests.", s.running, labels),
            gauge("sglang:num_queue_reqs", "Queued requests.", s.waiting, labels),
            counter("sglang:prompt_tokens", "Prefill tokens processed.", s.prompt_tokens, labels),
            counter("sglang:generation_tokens", "Tokens generated.", s.generated_tokens, labels),
            counter("sglang:num_requests", "Finished requests.", s.finished_requests, labels),
        ]

    def register_native(self, app: FastAPI) -> None:
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/health_generate", self.health, methods=["GET"])
        app.add_api_route("/model_info", self.model_info, methods=["GET"])
        app.add_api_route("/get_model_info", self.model_info, methods=["GET"])
        app.add_api_route("/generate", self.generate, methods=["POST", "PUT"])

    async def model_info(self) -> Response:
        model = self.config.model
        return json_response({"model_path": model, "tokenizer_path": model, "is_generation": True})

    def pinned_rank(self, request: Request, req: BaseModel) -> int | None:
        """Only the native ``/generate`` body's ``data_parallel_rank`` pins a rank."""
        return req.data_parallel_rank if isinstance(req, GenerateRequest) else None

    # ---------------------------------------------------------------------------- role rules

    async def admit(self, req: OpenAIRequest, job: Job, request: Request) -> Job:
        return await self._apply_roles(req.bootstrap_host, req.bootstrap_room, job, request)

    async def _apply_roles(
        self, host: str | None, room: int | None, job: Job, request: Request
    ) -> Job:
        mode = self.config.mode
        if mode not in ("prefill", "decode"):
            return job
        if room is None:
            raise ApiError(
                400,
                "Invalid request: Disaggregated request received without bootstrap room id. "
                f"req.rid={job.request_id}",
            )
        if host != FAKE_BOOTSTRAP_HOST:
            # A real peer named on one side only: the KV handshake never completes.
            logger.warning(
                "request %s waits for a KV transfer peer that never comes", job.request_id
            )
            await self.park(request, job)
        if mode == "prefill":
            # A prefill server finishes after the prefill forward and its first token.
            job.max_tokens = min(job.max_tokens, 1)
        return job

    # ------------------------------------------------------------------------ native /generate

    async def generate(self, request: Request) -> Response:
        req = self.parse(GenerateRequest, await self.read_generation(request))
        self.check_encoder(media_parts=0)
        if (req.text is None) == (req.input_ids is None):
            raise ApiError(400, "Either text or input_ids should be provided.")
        job = Job(
            request_id=req.rid or new_id(),
            prompt_tokens=req.prompt_tokens(),
            max_tokens=req.sampling_params.max_new_tokens,
            prompt_ids=req.input_ids,
        )
        self.assign_rank(job, request, req)
        job = await self._apply_roles(req.bootstrap_host, req.bootstrap_room, job, request)
        if req.stream:
            return sse_response(self._generate_chunks(job), done_marker=True)
        tokens = await self.state.generate_all(job)
        return self.finish(self._generate_body(job, tokens, finished=True))

    async def _generate_chunks(self, job: Job) -> AsyncIterator[dict[str, Any]]:
        tokens: list[int] = []
        async for token in self.state.generate(job):
            tokens.append(token)
            if len(tokens) < job.max_tokens:
                yield self._generate_body(job, tokens, finished=False)
        yield self._generate_body(job, tokens, finished=True)

    def _generate_body(self, job: Job, tokens: list[int], *, finished: bool) -> dict[str, Any]:
        finish_reason = {"type": "length", "length": len(tokens)} if finished else None
        return {
            "text": detokenize(tokens),
            "output_ids": list(tokens),
            "meta_info": {
                "id": job.request_id,
                "finish_reason": finish_reason,
                "prompt_tokens": job.prompt_tokens,
                "completion_tokens": len(tokens),
                "cached_tokens": 0,
            },
        }
