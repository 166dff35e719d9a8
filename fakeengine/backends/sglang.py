"""SGLang (``python -m sglang.launch_server``, ``--disaggregation-mode prefill|decode``), as
SGLang 0.5.23 behaves (measured here: docs/engines.md, "SGLang").

- ``/health`` (and ``/health_generate``, the same handler) runs a 1-token generation through the
  engine and answers 200, empty, as soon as the engine produces output (its own token, or any
  other request's: SGLang's check is a global "anything received since I started"), 503 when
  nothing comes within ``--health-check-timeout`` (SGLANG_HEALTH_CHECK_TIMEOUT, 20 s). The real
  one polls once a second, so it never answers in under 1 s; the fake answers at the output.
  Its request is left out of the request counters (``log_metrics=False``) but runs on a rank like
  any other, and is left to finish when the check gives up, as SGLang's is. ``/v1/models`` is the
  cheap route.
- ``/metrics`` (``--enable-metrics``), gzipped only for a client that sends
  ``Accept-Encoding: gzip``, in prometheus_client's text format 0.0.4 unless asked otherwise.
  The scheduler's series come once per data-parallel rank, labelled ``model_name, engine_type,
  tp_rank, pp_rank, moe_ep_rank, dp_rank`` (``dp_rank="0"`` with one rank), and a wedged rank's
  freeze: the in-flight and P/D queue gauges, ``realtime_tokens_total{mode=prefill_compute|
  decode}`` (the prompt tokens the rank computed, at each prefill chunk; one per decode step,
  i.e. every token after a request's first), ``prefill_effective_tokens_total{mode=input|
  device_hit|host_hit|storage_hit}`` (no prefix cache here: all input) and
  ``scheduler_idle_seconds_total`` (wall time with nothing running). The tokenizer manager's
  request counters are engine-wide (``model_name, engine_type, is_streaming``, no rank) and, as
  in SGLang's source, added when a request finishes: a long generation moves only its rank's
  series until it ends. (Measured on 0.5.23: the names and labels; from SGLang's source: the
  ``mode`` labels and when each counter moves.)
- With ``--dp-size N``, ``/generate``'s ``data_parallel_rank`` pins a request to a rank (400
  ``routed_dp_rank=N out of range [0, M)``), others are balanced round-robin; the answer's
  ``meta_info.dp_rank`` names the rank.
- A request whose client left runs on until the tokenizer manager notices: its wait for the
  answer wakes every 4 s and only then asks whether the client is still there, so a scheduler
  that resumes sooner computes it (measured on 0.5.23: 2 of 5 timed-out canaries computed after
  SIGCONT, 3 aborted). ``POST /abort_request {"rid": ...}`` (or ``{"abort_all": true}``)
  aborts it at once, answering 200 with an empty body. Aborted requests count in
  ``sglang:num_aborted_requests_total`` (the tokenizer manager's, engine-wide), not in
  ``num_requests_total``; ``/_fake/state``'s ``abandoned`` says how many were aborted and how
  many computed anyway.
- Decode: a request without ``bootstrap_host`` crashes the decode scheduler, and with it the whole
  server (SIGKILL, as SGLang's clean-up kills its process tree), answering nothing. Prefill
  refuses to start with ``--disaggregation-transfer-backend fake`` (see cli.py).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder, gzip_accepted
from pydantic import BaseModel

from fakeengine.backends.base import Backend, new_id
from fakeengine.responses import ApiError, json_response, sse_response
from fakeengine.schemas import GenerateRequest, OpenAIRequest
from fakeengine.state import (
    FAKE_BOOTSTRAP_HOST,
    EngineState,
    Job,
    RankStats,
    detokenize,
)

logger = logging.getLogger(__name__)

#: The id prefix and the one-token prompt of SGLang's own health generation.
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK_"
HEALTH_CHECK_INPUT_IDS = [0]
#: What the decode scheduler dies of when a request has no bootstrap host (measured), and the
#: line the server logs as it then kills its whole process tree.
DECODE_CRASH = "AttributeError: 'NoneType' object has no attribute 'startswith'"
SIGQUIT_LINE = "Received sigquit from a child process. It usually means the child failed."
#: How often the tokenizer manager's wait for an answer wakes to ask whether the client left.
DISCONNECT_POLL_SECONDS = 4.0
#: ``prefill_effective_tokens_total``'s modes, every one published from the start (SGLang seeds
#: them at 0); the fake has no prefix cache, so every prompt token is "input".
EFFECTIVE_MODES = ("input", "device_hit", "host_hit", "storage_hit")

#: The scheduler's gauges (one series per rank): name, help, the RankStats field (None: 0; the
#: fake has no prefill request in flight to a decode peer nor any decode request waiting for
#: KV memory).
RANK_GAUGES: tuple[tuple[str, str, str | None], ...] = (
    ("sglang:num_running_reqs", "The number of running requests.", "running"),
    ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", "waiting"),
    (
        "sglang:num_prefill_bootstrap_queue_reqs",
        "The number of requests in the prefill bootstrap queue.",
        "prefill_bootstrap_queue",
    ),
    (
        "sglang:num_prefill_inflight_queue_reqs",
        "The number of requests in the prefill inflight queue.",
        None,
    ),
    (
        "sglang:num_decode_prealloc_queue_reqs",
        "The number of requests in the decode prealloc queue.",
        None,
    ),
    (
        "sglang:num_decode_transfer_queue_reqs",
        "The number of requests in the decode transfer queue.",
        "decode_transfer_queue",
    ),
)

Samples = list[tuple[dict[str, str], float]]
FamilyType = type[GaugeMetricFamily] | type[CounterMetricFamily]


def _family(kind: FamilyType, name: str, doc: str, samples: Samples) -> Metric:
    """A family of one series per label set (all with the same label names)."""
    family = kind(name, doc, labels=list(samples[0][0]))
    for labels, value in samples:
        family.add_metric(list(labels.values()), value)
    return family


def _none(stats: RankStats) -> int:
    return 0


class SglangBackend(Backend):
    name = "sglang"
    owned_by = "sglang"
    checks_model_name = False
    dead_message = "The server is not healthy: a scheduler process died"
    encoder_message = (
        "This instance is an encoder (disaggregation mode encode); text generation is not supported"
    )

    def __init__(self, state: EngineState) -> None:
        super().__init__(state)
        # Health generations still running after their check answered (kept from the GC).
        self._health_jobs: set[asyncio.Future[list[int]]] = set()

    def error_body(self, status: int, message: str) -> object:
        return {"error": {"message": message}}

    def unhealthy_response(self, status: int, message: str) -> Response:
        return Response(status_code=status)

    def model_card(self) -> dict[str, Any]:
        return {**super().model_card(), "root": self.config.model}

    def rank_out_of_range(self, rank: int, dp_size: int) -> str:
        return f"routed_dp_rank={rank} out of range [0, {dp_size})"

    # ------------------------------------------------------------------------------- metrics

    @property
    def engine_type(self) -> str:
        mode = self.config.mode
        return mode if mode in ("prefill", "decode") else "unified"

    def _rank_labels(self, rank: int) -> dict[str, str]:
        """A scheduler's labels, in SGLang's order."""
        return {
            "model_name": self.config.model,
            "engine_type": self.engine_type,
            "tp_rank": "0",
            "pp_rank": "0",
            "moe_ep_rank": "0",
            "dp_rank": str(rank),
        }

    def _prefill_tokens(self, stats: RankStats) -> int:
        """Prompt tokens a rank computed: none on decode, whose KV comes from its prefill peer
        (or from the fake transfer) and whose first token runs no forward pass."""
        return 0 if self.config.mode == "decode" else stats.prompt_tokens

    def metric_families(self) -> list[Metric]:
        ranks = [
            (self._rank_labels(rank.index), self.state.published(rank)) for rank in self.state.ranks
        ]

        def per_rank(kind: FamilyType, name: str, doc: str, field: str | None) -> Metric:
            samples = [(labels, getattr(s, field) if field else 0) for labels, s in ranks]
            return _family(kind, name, doc, samples)

        def per_mode(name: str, doc: str, modes: dict[str, Callable[[RankStats], int]]) -> Metric:
            samples = [
                ({**labels, "mode": mode}, value(s))
                for labels, s in ranks
                for mode, value in modes.items()
            ]
            return _family(CounterMetricFamily, name, doc, samples)

        effective = {
            mode: self._prefill_tokens if mode == "input" else _none for mode in EFFECTIVE_MODES
        }
        realtime = per_mode(
            "sglang:realtime_tokens_total",
            "Total number of tokens processed (updated on each log interval). "
            "mode: prefill_compute, prefill_cache, decode.",
            {"prefill_compute": self._prefill_tokens, "decode": lambda s: s.decode_tokens},
        )
        return [
            *(per_rank(GaugeMetricFamily, *gauge) for gauge in RANK_GAUGES),
            *([realtime] if self.config.step_counters else []),
            per_mode(
                "sglang:prefill_effective_tokens_total",
                "Effective prefill tokens with retracted-request re-counts excluded. "
                "mode: device_hit, host_hit, storage_hit, input.",
                effective,
            ),
            per_rank(
                CounterMetricFamily,
                "sglang:scheduler_idle_seconds_total",
                "Total time the scheduler had nothing to run, in seconds.",
                "idle_seconds",
            ),
            *self._request_families(),
        ]

    def _request_families(self) -> list[Metric]:
        """The tokenizer manager's counters: engine-wide, added as requests finish. The
        non-streaming series exists from the start (a real server's warm-up request makes it),
        the streaming one from the first streamed request that finished."""
        tallies = [
            ({"model_name": self.config.model, "engine_type": self.engine_type,
              "is_streaming": "true" if streamed else "false"}, tally)
            for streamed, tally in self.state.logged.items()
            if not streamed or tally.requests or tally.prompt_tokens
        ]  # fmt: skip
        counters = (
            ("sglang:prompt_tokens_total", "Number of prefill tokens processed.", "prompt_tokens"),
            (
                "sglang:generation_tokens_total",
                "Number of generation tokens processed.",
                "generated_tokens",
            ),
            ("sglang:num_requests_total", "Number of requests processed.", "requests"),
        )
        aborted = sum(rank.stats.abandoned_aborted for rank in self.state.ranks)
        engine = {"engine_type": self.engine_type, "model_name": self.config.model}
        return [
            *(
                _family(
                    CounterMetricFamily,
                    name,
                    doc,
                    [(labels, getattr(tally, field)) for labels, tally in tallies],
                )
                for name, doc, field in counters
            ),
            _family(
                CounterMetricFamily,
                "sglang:num_aborted_requests_total",
                "Number of requests aborted.",
                [(engine, aborted)],
            ),
        ]

    async def metrics(self, request: Request) -> Response:
        """As prometheus_client's ASGI app serves them: the text format the client asks for
        (0.0.4 by default), gzipped only when it sends ``Accept-Encoding: gzip``."""
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        body = encoder(self.registry)
        mode = self.config.metrics_gzip
        accepts = gzip_accepted(request.headers.get("accept-encoding", ""))
        if mode == "always" or (mode == "auto" and accepts):
            return Response(
                gzip.compress(body),
                media_type=content_type,
                headers={"Content-Encoding": "gzip"},
            )
        return Response(body, media_type=content_type)

    # -------------------------------------------------------------------------------- routes

    def register_native(self, app: FastAPI) -> None:
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/health_generate", self.health, methods=["GET"])
        app.add_api_route("/model_info", self.model_info, methods=["GET"])
        app.add_api_route("/get_model_info", self.model_info, methods=["GET"])
        app.add_api_route("/generate", self.generate, methods=["POST", "PUT"])
        app.add_api_route("/abort_request", self.abort_request, methods=["POST"])

    def notice_delay(self, elapsed: float) -> float | None:
        """At the tokenizer manager's next wake-up (every 4 s since the request began)."""
        return DISCONNECT_POLL_SECONDS - elapsed % DISCONNECT_POLL_SECONDS

    async def abort_request(self, request: Request) -> Response:
        """SGLang's abort: the running request with this ``rid`` (or every one, with
        ``abort_all``) ends at its next step; 200 with an empty body, whether one ran or not."""
        payload = _json_object(await request.body())
        self.state.record(request.method, request.url.path, request.headers, payload)
        if payload.get("abort_all"):
            self.state.abort_all()
        elif isinstance(payload.get("rid"), str):
            self.state.abort_request(payload["rid"])
        return Response(status_code=200)

    async def model_info(self) -> Response:
        model = self.config.model
        return json_response({"model_path": model, "tokenizer_path": model, "is_generation": True})

    async def health(self) -> Response:
        early = await self.health_precheck()
        if early is not None:
            return early
        if self.state.stopping.is_set():
            return Response(status_code=503)  # "received during shutdown. Returning 503."
        started = time.time()
        if self.config.mode == "encode":
            return await self._health_encode()
        if await self._health_generation():
            return Response(status_code=200)
        timeout = self.config.health_check_timeout
        logger.error(
            "Health check failed. Server couldn't get a response from detokenizer for last "
            "%s seconds. tic start time: %s",
            f"{timeout:g}",
            time.strftime("%H:%M:%S", time.localtime(started)),
        )
        return Response(status_code=503)

    async def _health_encode(self) -> Response:
        """SGLang's encoder (``--encoder-only``): /health encodes a 32x32 test image (one step that
        computes and finishes it) and answers 200 with an empty body once it is done, or 503 after
        the health-check timeout (SGLang 0.5.23, docs/engines.md). A hung encoder holds it."""
        job = Job(request_id=HEALTH_CHECK_RID_PREFIX + new_id(), prompt_tokens=1, max_tokens=0)
        job.log_metrics = False
        job.rank = self.state.route(None)
        try:
            async with asyncio.timeout(self.config.health_check_timeout):
                await self.state.generate_all(job)
        except TimeoutError:
            return Response(status_code=503)
        return Response(status_code=200)

    async def models(self) -> Response:
        """SGLang's encoder serves no /v1/models (404, as any route it does not have)."""
        if self.config.mode == "encode":
            return json_response({"detail": "Not Found"}, status=404)
        return await super().models()

    async def _health_generation(self) -> bool:
        """Start a 1-token generation and wait until the engine produces any output since the
        start (this one's or another request's) or the timeout passes. The generation is not
        cancelled either way: the scheduler runs it on."""
        state = self.state
        seen = state.outputs
        job = Job(
            request_id=HEALTH_CHECK_RID_PREFIX + new_id(),
            prompt_tokens=len(HEALTH_CHECK_INPUT_IDS),
            max_tokens=1,
            prompt_ids=list(HEALTH_CHECK_INPUT_IDS),
            log_metrics=False,
        )
        job.rank = state.route(None)
        task = asyncio.ensure_future(state.generate_all(job))
        self._health_jobs.add(task)
        task.add_done_callback(self._health_job_done)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.health_check_timeout
        while state.outputs == seen:
            remaining = deadline - loop.time()
            if remaining <= 0 or state.stopping.is_set():
                return False
            output = asyncio.ensure_future(state.output.wait())
            stopping = asyncio.ensure_future(state.stopping.wait())
            try:
                await asyncio.wait(
                    {output, stopping}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                output.cancel()
                stopping.cancel()
        return True

    def _health_job_done(self, task: asyncio.Future[list[int]]) -> None:
        self._health_jobs.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a generation failed by shutdown is nobody's error

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
        if mode == "decode" and host is None:
            self._crash_decode_scheduler(job)
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
            await self._wait_for_peer(request, job)
        if mode == "prefill":
            # A prefill server finishes after the prefill forward and its first token.
            job.max_tokens = min(job.max_tokens, 1)
        return job

    async def _wait_for_peer(self, request: Request, job: Job) -> None:
        """Queue the request where SGLang keeps it while its peer is missing: a prefill's in its
        bootstrap queue (no decode connects), a decode's in its transfer queue (no KV arrives);
        neither is in the waiting queue. It ends when its client leaves."""
        stats = self.state.ranks[job.rank].stats
        queue = (
            "prefill_bootstrap_queue" if self.config.mode == "prefill" else "decode_transfer_queue"
        )
        setattr(stats, queue, getattr(stats, queue) + 1)
        try:
            await self.wait_until(request, None)
        finally:
            setattr(stats, queue, getattr(stats, queue) - 1)

    def _crash_decode_scheduler(self, job: Job) -> None:
        """SGLang 0.5.23's decode scheduler reads the request's bootstrap host without checking
        it, raises, and the server's clean-up SIGKILLs the whole process tree: no answer."""
        logger.error(
            "Scheduler hit an exception: Traceback (most recent call last):\n"
            "  (fake engine: the decode scheduler admits request %s, bootstrap_host None)\n%s",
            job.request_id,
            DECODE_CRASH,
        )
        logger.error(SIGQUIT_LINE)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)

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
            stream=req.stream,
        )
        self.assign_rank(job, request, req)
        job = await self._apply_roles(req.bootstrap_host, req.bootstrap_room, job, request)
        if req.stream:
            return sse_response(self._generate_chunks(job), done_marker=True)
        tokens = await self.generate_watched(request, job)
        return self.finish(self._generate_body(job, tokens, finished=True))

    async def _generate_chunks(self, job: Job) -> AsyncIterator[dict[str, Any]]:
        tokens: list[int] = []
        async for token in self.state.generate(job):
            tokens.append(token)
            if len(tokens) < job.max_tokens:
                yield self._generate_body(job, tokens, finished=False)
        yield self._generate_body(job, tokens, finished=True)

    def _generate_body(self, job: Job, tokens: list[int], *, finished: bool) -> dict[str, Any]:
        finish_reason: dict[str, Any] | None = None
        if finished and job.finish_reason == "abort":
            finish_reason = {"type": "abort", "message": "Abort before prefill"}
        elif finished:
            finish_reason = {"type": "length", "length": len(tokens)}
        return {
            "text": detokenize(tokens),
            "output_ids": list(tokens),
            "meta_info": {
                "id": job.request_id,
                "finish_reason": finish_reason,
                "prompt_tokens": job.prompt_tokens,
                "completion_tokens": len(tokens),
                "cached_tokens": 0,
                "dp_rank": job.rank,
            },
        }


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}
