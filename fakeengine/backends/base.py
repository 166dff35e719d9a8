"""Behaviour shared by every fake backend: the request pipeline, OpenAI routes, health, metrics.

A subclass supplies the backend's wire details (error shape, health bodies, metric names, native
routes) and its role rules (``admit``), i.e. everything that differs between real engines.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, ClassVar, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ValidationError

from fakeengine.responses import (
    ApiError,
    ClientGone,
    RankOutOfRange,
    generation_response,
    json_response,
    sse_response,
)
from fakeengine.schemas import ChatRequest, CompletionRequest, OpenAIRequest
from fakeengine.state import (
    EngineConfig,
    EngineState,
    EngineStopping,
    Job,
    detokenize,
    rank_out_of_range,
)

RequestModel = TypeVar("RequestModel", bound=BaseModel)


class _FamilyCollector(Collector):
    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def collect(self) -> Iterable[Metric]:
        return self._backend.progress_families(self._backend.metric_families())


def gauge(name: str, doc: str, value: float, labels: dict[str, str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def counter(name: str, doc: str, value: float, labels: dict[str, str]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def new_id() -> str:
    return uuid.uuid4().hex


class Backend:
    """Base class; one subclass per real engine flavour."""

    name: ClassVar[str]
    owned_by: ClassVar[str]
    #: Real vLLM and trtllm-serve open their HTTP port only after the model is loaded.
    binds_after_loading: ClassVar[bool] = False
    metrics_path: ClassVar[str] = "/metrics"
    dead_message: ClassVar[str] = "The engine is dead"
    encoder_message: ClassVar[str] = "This instance is an encoder; text generation is not supported"
    #: False for llama-server, which serves any ``model`` value and has no P/D roles.
    checks_model_name: ClassVar[bool] = True
    has_roles: ClassVar[bool] = True

    def __init__(self, state: EngineState) -> None:
        self.state = state
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_FamilyCollector(self))

    @property
    def config(self) -> EngineConfig:
        return self.state.config

    # ---------------------------------------------------------------------------- wire details

    def error_body(self, status: int, message: str) -> object:
        raise NotImplementedError

    def healthy_response(self, status: int) -> Response:
        return Response(status_code=status)

    def unhealthy_response(self, status: int, message: str) -> Response:
        raise NotImplementedError

    def loading_health_response(self) -> Response:
        return Response(status_code=503)

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.config.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": self.owned_by,
        }

    def metric_families(self) -> list[Metric]:
        raise NotImplementedError

    def register_native(self, app: FastAPI) -> None:
        """Add the backend's own routes (health, native generation, ...)."""

    # ------------------------------------------------------------------------------- wiring

    def register(self, app: FastAPI) -> None:
        app.add_exception_handler(ApiError, self._on_api_error)
        app.add_exception_handler(ClientGone, self._on_client_gone)
        app.add_exception_handler(EngineStopping, self._on_stopping)
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route(self.metrics_path, self.metrics, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        self.register_native(app)

    async def _on_api_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return json_response(self.api_error_body(exc), exc.status)

    def api_error_body(self, exc: ApiError) -> object:
        """The body of an error answer; a backend may shape some errors its own way."""
        return self.error_body(exc.status, exc.message)

    async def _on_client_gone(self, request: Request, exc: Exception) -> Response:
        return Response(status_code=499)

    async def _on_stopping(self, request: Request, exc: Exception) -> Response:
        return json_response(self.error_body(503, "The engine is shutting down"), 503)

    # ----------------------------------------------------------------------- read-only routes

    def guard_loading(self) -> None:
        """Hook for backends whose non-health routes refuse to answer while loading."""

    async def health(self) -> Response:
        early = await self.health_precheck()
        return self.healthy_response(200) if early is None else early

    async def health_precheck(self) -> Response | None:
        """What the health route answers before looking at the engine itself (injected latency
        and status, loading, death), or None to go on."""
        if self.state.faults.health_latency:
            await asyncio.sleep(self.state.faults.health_latency)
        forced = self.state.faults.health_status
        if forced is not None:
            if forced < 300:
                return self.healthy_response(forced)
            return self.unhealthy_response(forced, f"Health status {forced} forced by fault")
        if self.state.loading:
            return self.loading_health_response()
        if self.state.faults.dead:
            return self.unhealthy_response(503, self.dead_message)
        return None

    async def models(self) -> Response:
        self.guard_loading()
        return json_response({"object": "list", "data": [self.model_card()]})

    #: Whether the real server gzips its metrics for a client that accepts it (TensorRT-LLM
    #: serves them through prometheus_client's ASGI app, which does; SGLang's backend serves
    #: them its own way, see SglangBackend.metrics).
    gzips_metrics: ClassVar[bool] = False

    async def metrics(self, request: Request) -> Response:
        self.guard_loading()
        body = generate_latest(self.registry)
        mode = self.config.metrics_gzip
        accepts = "gzip" in request.headers.get("accept-encoding", "")
        if mode == "always" or (mode == "auto" and self.gzips_metrics and accepts):
            return Response(
                gzip.compress(body),
                media_type=CONTENT_TYPE_LATEST,
                headers={"Content-Encoding": "gzip"},
            )
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def progress_families(self, families: list[Metric]) -> list[Metric]:
        """The backend's families, less its counters when the hide_counters fault is on."""
        if not self.state.faults.hide_counters:
            return families
        return [f for f in families if f.type not in ("counter", "histogram")]

    # -------------------------------------------------------------------- generation pipeline

    async def before_generation(self) -> None:
        """What a generation request meets while the model loads. Default: it queues."""
        await self.state.wait_loaded()

    async def read_generation(self, request: Request) -> dict[str, Any]:
        """Record the request, then apply loading, death and injected errors before parsing."""
        payload = _parse_json(await request.body())
        self.state.record(request.method, request.url.path, request.headers, payload)
        await self.before_generation()
        faults = self.state.faults
        if faults.dead:
            raise ApiError(500, self.dead_message)
        if faults.generation_status is not None:
            raise ApiError(faults.generation_status, faults.generation_error)
        if not isinstance(payload, dict):
            raise ApiError(400, "The request body must be a JSON object")
        return payload

    def parse(self, model: type[RequestModel], payload: dict[str, Any]) -> RequestModel:
        try:
            return model.model_validate(payload)
        except ValidationError as exc:
            raise ApiError(400, _describe(exc)) from exc

    def check_model(self, requested: str | None) -> None:
        if self.checks_model_name and requested not in (None, self.config.model):
            raise ApiError(404, f"The model `{requested}` does not exist.")

    def pinned_rank(self, request: Request, req: BaseModel) -> int | None:
        """The data-parallel rank a request asks for, or None (balanced). Default: none."""
        return None

    def assign_rank(self, job: Job, request: Request, req: BaseModel) -> None:
        """Send the job to its pinned rank (400 out of range) or balance it over the ranks."""
        pinned = self.pinned_rank(request, req)
        size = self.state.dp_size
        if pinned is not None and not 0 <= pinned < size:
            raise RankOutOfRange(self.rank_out_of_range(pinned, size))
        job.rank = self.state.route(pinned)

    def rank_out_of_range(self, rank: int, dp_size: int) -> str:
        """The message of the 400 for a request pinned outside [0, dp_size)."""
        return rank_out_of_range(rank, dp_size)

    def check_encoder(self, media_parts: int) -> None:
        """An encoder instance only accepts requests that carry media to encode."""
        if self.has_roles and self.config.mode == "encode" and media_parts == 0:
            raise ApiError(400, self.encoder_message)

    async def admit(self, req: OpenAIRequest, job: Job, request: Request) -> Job:
        """Apply the backend's role rules to an OpenAI-style request. Default: accept as is."""
        return job

    def decorate(self, job: Job, tokens: list[int], body: dict[str, Any]) -> None:
        """Add backend-specific fields (e.g. disaggregation params) to a finished response."""

    def finish(self, body: dict[str, Any]) -> Response:
        return generation_response(body, self.state.faults.garbage)

    async def park(
        self,
        request: Request,
        job: Job,
        *,
        on_peer: bool = False,
        until: Callable[[], bool] | None = None,
        seconds: float | None = None,
    ) -> bool:
        """Queue a request as waiting (``on_peer``: for its KV from a prefill peer, "deferred")
        until ``until()`` holds (True) or ``seconds`` pass (False); with neither it waits for
        something that never comes and ends when its client leaves. It waits on the job's rank."""
        stats = self.state.ranks[job.rank].stats
        stats.waiting += 1
        stats.deferred += on_peer
        try:
            return await self.wait_until(request, until, seconds)
        finally:
            stats.waiting -= 1
            stats.deferred -= on_peer

    async def wait_until(
        self, request: Request, until: Callable[[], bool] | None, seconds: float | None = None
    ) -> bool:
        """Wait until ``until()`` holds, checked now and at every change of the faults or of the
        sleep state (True), or until ``seconds`` pass (False). Raises ClientGone when the client
        leaves first, EngineStopping when the server shuts down."""
        loop = asyncio.get_running_loop()
        deadline = None if seconds is None else loop.time() + seconds
        disconnect = asyncio.ensure_future(_until_disconnect(request))
        stopping = asyncio.ensure_future(self.state.stopping.wait())
        try:
            while until is None or not until():
                changed = asyncio.ensure_future(self.state.change.wait())
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                try:
                    done, _ = await asyncio.wait(
                        {disconnect, stopping, changed},
                        timeout=remaining,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    changed.cancel()
                if stopping in done:
                    raise EngineStopping
                if disconnect in done:
                    raise ClientGone
                if not done:
                    return False
            return True
        finally:
            disconnect.cancel()
            stopping.cancel()

    # -------------------------------------------------------------------- abandoned requests

    def notice_delay(self, elapsed: float) -> float | None:
        """Seconds until the engine notices that a request's client left, ``elapsed`` seconds
        after the request began; None: it never does and computes the request anyway (what a
        frozen llama-server does with an abandoned connection after SIGCONT, measured)."""
        return None

    async def generate_watched(self, request: Request, job: Job) -> list[int]:
        """A non-streamed generation with its client watched: when the client leaves, the job
        is marked (``client_gone``) and aborted once the engine notices (``notice_delay``)."""
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def watch() -> None:
            await _until_disconnect(request)
            job.client_gone = True
            delay = self.notice_delay(loop.time() - started)
            if delay is None:
                return
            await asyncio.sleep(delay)
            job.abort.set()

        watcher = asyncio.ensure_future(watch())
        try:
            return await self.state.generate_all(job)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    # ----------------------------------------------------------------------- OpenAI routes

    async def completions(self, request: Request) -> Response:
        req = self.parse(CompletionRequest, await self.read_generation(request))
        self.check_model(req.model)
        self.check_encoder(media_parts=0)
        job = Job(
            request_id=req.request_id or new_id(),
            prompt_tokens=req.prompt_tokens(),
            max_tokens=req.wanted_tokens(),
            prompt_ids=req.prompt if isinstance(req.prompt, list) else None,
            stream=req.stream,
        )
        self.assign_rank(job, request, req)
        job = await self.admit(req, job, request)
        if req.stream:
            return sse_response(self._openai_chunks(job, chat=False), done_marker=True)
        tokens = await self.generate_watched(request, job)
        choice: dict[str, Any] = {
            "index": 0,
            "text": detokenize(tokens),
            "finish_reason": job.finish_reason,
            "logprobs": None,
        }
        if req.return_token_ids:
            choice["prompt_token_ids"] = job.prompt_ids
            choice["token_ids"] = tokens
        return self._finish_openai(job, tokens, "text_completion", "cmpl-", choice)

    async def chat_completions(self, request: Request) -> Response:
        req = self.parse(ChatRequest, await self.read_generation(request))
        self.check_model(req.model)
        self.check_encoder(media_parts=req.media_parts())
        job = Job(
            request_id=req.request_id or new_id(),
            prompt_tokens=req.prompt_tokens(),
            max_tokens=req.wanted_tokens(),
            stream=req.stream,
        )
        self.assign_rank(job, request, req)
        job = await self.admit(req, job, request)
        if req.stream:
            return sse_response(self._openai_chunks(job, chat=True), done_marker=True)
        tokens = await self.generate_watched(request, job)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": detokenize(tokens)},
            "finish_reason": job.finish_reason,
            "logprobs": None,
        }
        return self._finish_openai(job, tokens, "chat.completion", "chatcmpl-", choice)

    def _finish_openai(
        self, job: Job, tokens: list[int], obj: str, prefix: str, choice: dict[str, Any]
    ) -> Response:
        body = {
            "id": prefix + job.request_id,
            "object": obj,
            "created": int(time.time()),
            "model": self.config.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": job.prompt_tokens,
                "completion_tokens": len(tokens),
                "total_tokens": job.prompt_tokens + len(tokens),
            },
        }
        self.decorate(job, tokens, body)
        return self.finish(body)

    async def _openai_chunks(self, job: Job, *, chat: bool) -> AsyncIterator[dict[str, Any]]:
        created = int(time.time())
        base = {
            "id": ("chatcmpl-" if chat else "cmpl-") + job.request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": self.config.model,
        }

        def chunk(piece: str, finish_reason: str | None) -> dict[str, Any]:
            content: dict[str, Any] = {"delta": {"content": piece}} if chat else {"text": piece}
            choice = {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}
            return {**base, "choices": [choice]}

        async for token in self.state.generate(job):
            yield chunk(detokenize([token]), None)
        yield chunk("", job.finish_reason)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _parse_json(raw: bytes) -> object | None:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def _describe(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "body"
    return f"Invalid request: {where}: {first['msg']}"
