"""TensorRT-LLM (``trtllm-serve``, PyTorch backend) as run by a Dynamo-style P/D worker."""

from __future__ import annotations

import base64
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client.core import Metric

from fakeengine.backends.base import Backend, counter, gauge, new_id
from fakeengine.responses import ApiError, json_response, status_type
from fakeengine.schemas import OpenAIRequest
from fakeengine.state import Job

UNAVAILABLE = "LLM is unavailable. Please check the server logs for more details."
REQUEST_TYPES = ("context_only", "generation_only", "context_and_generation")


class TrtllmBackend(Backend):
    name = "trtllm"
    owned_by = "tensorrt_llm"
    binds_after_loading = True
    metrics_path = "/prometheus/metrics"
    dead_message = "Executor is shut down: " + UNAVAILABLE
    encoder_message = (
        "This instance is a multimodal encoder (MM_ENCODER); text generation is not supported"
    )

    def error_body(self, status: int, message: str) -> object:
        return {"error": {"message": message, "type": status_type(status), "code": status}}

    def unhealthy_response(self, status: int, message: str) -> Response:
        return PlainTextResponse(UNAVAILABLE, status_code=status)

    gzips_metrics = True

    def metric_families(self) -> list[Metric]:
        labels = {"model_name": self.config.model}
        s = self.state.published_total()
        return [
            counter(
                "trtllm_request_success",
                "Successfully finished requests.",
                s.finished_requests,
                {**labels, "finished_reason": "length"},
            ),
            counter("trtllm_prompt_tokens", "Prefill tokens processed.", s.prompt_tokens, labels),
            counter("trtllm_generation_tokens", "Tokens generated.", s.generated_tokens, labels),
            gauge("trtllm_num_requests_running", "Requests running.", s.running, labels),
            gauge("trtllm_num_requests_waiting", "Requests waiting.", s.waiting, labels),
        ]

    def register_native(self, app: FastAPI) -> None:
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/health_generate", self.health_generate, methods=["GET"])
        app.add_api_route("/version", self.version, methods=["GET"])
        app.add_api_route("/metrics", self.iteration_stats, methods=["GET"])

    async def version(self) -> Response:
        return json_response({"version": "0.0.0+fakeengine"})

    async def iteration_stats(self) -> Response:
        """``/metrics`` is JSON on trtllm-serve: a list of per-iteration executor stats."""
        s = self.state.published_total()
        stats = {"numActiveRequests": s.running, "numQueuedRequests": s.waiting}
        return json_response([stats])

    async def health_generate(self) -> Response:
        """One-token generation with no internal timeout, like the real route."""
        faults = self.state.faults
        if faults.dead or faults.generation_status is not None:
            return PlainTextResponse("Generation health check failed", status_code=500)
        await self.state.generate_all(Job(request_id=new_id(), prompt_tokens=1, max_tokens=1))
        return PlainTextResponse("Generation health check OK")

    # ---------------------------------------------------------------------------- role rules

    async def admit(self, req: OpenAIRequest, job: Job, request: Request) -> Job:
        mode = self.config.mode
        if mode == "encode":
            job.meta["encoder"] = True
            return job
        params = req.disaggregated_params
        if params is None:
            if mode in ("prefill", "decode"):
                raise ApiError(400, f"Disaggregated params are required for {mode} mode")
            return job
        raw_type = params.get("request_type")
        request_type = str(raw_type).lower()
        if request_type not in REQUEST_TYPES:
            raise ApiError(400, f"Unknown request type: {raw_type}")
        if request_type == "context_only":
            job.max_tokens = 1
            job.meta["context_only"] = params
        elif request_type == "generation_only" and not params.get("encoded_opaque_state"):
            raise ApiError(
                400, "generation_only requests need encoded_opaque_state from the context phase"
            )
        return job

    def decorate(self, job: Job, tokens: list[int], body: dict[str, Any]) -> None:
        choice = body["choices"][0]
        context = job.meta.get("context_only")
        if context is not None:
            choice["disaggregated_params"] = self._context_params(job, tokens, context)
            body["prompt_token_ids"] = job.prompt_ids or list(range(1, job.prompt_tokens + 1))
        elif job.meta.get("encoder"):
            choice["disaggregated_params"] = {
                "multimodal_embedding_handles": [{"handle": f"fake-mm-{job.request_id}"}],
                "multimodal_hashes": [[(job.prompt_tokens + i) % 256 for i in range(8)]],
            }

    @staticmethod
    def _context_params(job: Job, tokens: list[int], request: dict[str, Any]) -> dict[str, Any]:
        opaque = base64.b64encode(f"fakeengine-kv:{job.request_id}".encode()).decode()
        params: dict[str, Any] = {
            "request_type": "context_only",
            "first_gen_tokens": tokens[:1],
            "ctx_request_id": uuid.uuid4().int >> 65,
            "encoded_opaque_state": opaque,
            "draft_tokens": None,
        }
        if "disagg_request_id" in request:
            params["disagg_request_id"] = request["disagg_request_id"]
        return params
