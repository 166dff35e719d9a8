"""llama.cpp ``llama-server`` (backend name ``openai``): no P/D roles, port open while loading."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client.core import Metric

from fakeengine.backends.base import Backend, counter, gauge, new_id
from fakeengine.responses import ApiError, json_response, sse_response
from fakeengine.schemas import LlamaCompletionRequest
from fakeengine.state import Job, detokenize

LOADING_MESSAGE = "Loading model"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


class LlamaCppBackend(Backend):
    name = "openai"
    owned_by = "llamacpp"
    dead_message = "The server is not able to serve requests"
    checks_model_name = False
    has_roles = False

    def notice_delay(self, elapsed: float) -> float | None:
        """llama-server's handler asks whether its client is still there once a second while it
        waits (HTTP_POLLING_SECONDS) and then cancels the task, queued or running (from
        llama.cpp's source). Frozen whole, it reads an abandoned request after SIGCONT and
        computes it before that (measured): a request with no latency finishes first here too."""
        return 1.0 - elapsed % 1.0

    def error_body(self, status: int, message: str) -> object:
        default = "server_error" if status >= 500 else "invalid_request_error"
        error_type = _ERROR_TYPES.get(status, default)
        return {"error": {"code": status, "message": message, "type": error_type}}

    def healthy_response(self, status: int) -> Response:
        return json_response({"status": "ok"}, status)

    def unhealthy_response(self, status: int, message: str) -> Response:
        return json_response(self.error_body(status, message), status)

    def loading_health_response(self) -> Response:
        return self.unhealthy_response(503, LOADING_MESSAGE)

    def guard_loading(self) -> None:
        if self.state.loading:
            raise ApiError(503, LOADING_MESSAGE)

    async def before_generation(self) -> None:
        self.guard_loading()

    def metric_families(self) -> list[Metric]:
        s = self.state.published_total()
        return [
            counter("llamacpp:prompt_tokens", "Prompt tokens processed.", s.prompt_tokens, {}),
            counter("llamacpp:tokens_predicted", "Tokens generated.", s.generated_tokens, {}),
            gauge("llamacpp:requests_processing", "Requests processing.", s.running, {}),
            gauge("llamacpp:requests_deferred", "Requests deferred.", s.waiting, {}),
        ]

    def register_native(self, app: FastAPI) -> None:
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/health", self.health, methods=["GET"])
        app.add_api_route("/completion", self.native_completion, methods=["POST"])

    # ---------------------------------------------------------------------- native /completion

    async def native_completion(self, request: Request) -> Response:
        req = self.parse(LlamaCompletionRequest, await self.read_generation(request))
        job = Job(
            request_id=new_id(),
            prompt_tokens=req.prompt_tokens(),
            max_tokens=req.wanted_tokens(),
            prompt_ids=req.prompt if isinstance(req.prompt, list) else None,
        )
        if req.stream:
            return sse_response(self._native_chunks(job), done_marker=False)
        started = time.monotonic()
        tokens = await self.generate_watched(request, job)
        return self.finish(self._native_body(job, tokens, time.monotonic() - started))

    async def _native_chunks(self, job: Job) -> AsyncIterator[dict[str, Any]]:
        started = time.monotonic()
        tokens: list[int] = []
        async for token in self.state.generate(job):
            tokens.append(token)
            yield {"index": 0, "content": detokenize([token]), "tokens": [token], "stop": False}
        final = self._native_body(job, tokens, time.monotonic() - started)
        yield {**final, "content": ""}

    def _native_body(self, job: Job, tokens: list[int], seconds: float) -> dict[str, Any]:
        return {
            "index": 0,
            "content": detokenize(tokens),
            "tokens": [],
            "id_slot": 0,
            "stop": True,
            "model": self.config.model,
            "tokens_predicted": len(tokens),
            "tokens_evaluated": job.prompt_tokens,
            "stop_type": "limit",
            "stopping_word": "",
            "truncated": False,
            "timings": {
                "prompt_n": job.prompt_tokens,
                "predicted_n": len(tokens),
                "predicted_ms": round(seconds * 1000, 3),
            },
        }
