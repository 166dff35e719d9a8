"""vLLM (``vllm serve``, V1 engine, NixlConnector for P/D, ec_producer for encoders)."""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric

from sidecar.fakeengine.backends.base import Backend, counter, gauge, new_id
from sidecar.fakeengine.responses import ApiError, json_response, status_type
from sidecar.fakeengine.schemas import OpenAIRequest
from sidecar.fakeengine.state import EngineState, Job

logger = logging.getLogger(__name__)

KV_BLOCK_SIZE = 16
NIXL_SIDE_CHANNEL_PORT = 5600
_PEER_FIELDS = ("remote_engine_id", "remote_host", "remote_port")


class VllmBackend(Backend):
    name = "vllm"
    owned_by = "vllm"
    binds_after_loading = True
    dead_message = "EngineCore encountered an issue. See stack trace (above) for the root cause."
    encoder_message = "This instance is an encoder (ec_producer); text generation is not supported"
    max_model_len: ClassVar[int] = 2048

    def __init__(self, state: EngineState) -> None:
        super().__init__(state)
        self.engine_id = new_id()
        self._frozen: list[Metric] | None = None

    def error_body(self, status: int, message: str) -> object:
        return {"error": {"message": message, "type": status_type(status), "code": status}}

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

    def metric_families(self) -> list[Metric]:
        labels = {"model_name": self.config.model}
        s = self.state
        return [
            gauge("vllm:num_requests_running", "Requests in execution batches.", s.running, labels),
            gauge("vllm:num_requests_waiting", "Requests waiting to run.", s.waiting, labels),
            self._waiting_by_reason(labels),
            self._kv_fetch_by_stage(labels),
            counter("vllm:prompt_tokens", "Prefill tokens processed.", s.prompt_tokens, labels),
            counter("vllm:generation_tokens", "Tokens generated.", s.generated_tokens, labels),
            self._iteration_tokens(labels),
            counter(
                "vllm:request_success",
                "Successfully finished requests.",
                s.finished_requests,
                {**labels, "finished_reason": "length"},
            ),
        ]

    def _iteration_tokens(self, labels: dict[str, str]) -> Metric:
        """A histogram: one observation per engine step that produced tokens (its _count), of
        the prompt tokens it computed plus the tokens it generated (its _sum)."""
        family = HistogramMetricFamily(
            "vllm:iteration_tokens_total", "Tokens per engine step.", labels=list(labels)
        )
        s = self.state
        family.add_metric(
            list(labels.values()), [("+Inf", float(s.steps))], sum_value=s.iteration_tokens
        )
        return family

    def _waiting_by_reason(self, labels: dict[str, str]) -> Metric:
        """Waiting requests by why they wait: "deferred" for a KV transfer, else "capacity"."""
        family = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Waiting requests by reason.",
            labels=[*labels, "reason"],
        )
        deferred = self.state.deferred
        family.add_metric([*labels.values(), "capacity"], self.state.waiting - deferred)
        family.add_metric([*labels.values(), "deferred"], deferred)
        return family

    def _kv_fetch_by_stage(self, labels: dict[str, str]) -> Metric:
        family = GaugeMetricFamily(
            "vllm:num_requests_kv_fetch_by_stage",
            "Requests fetching KV from a remote instance, by stage.",
            labels=[*labels, "stage"],
        )
        for stage, value in (
            ("waiting_to_start", 0),
            ("in_progress", self.state.deferred),
            ("completed_waiting", 0),
        ):
            family.add_metric([*labels.values(), stage], value)
        return family

    def register_native(self, app: FastAPI) -> None:
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/ping", self.health, methods=["GET", "POST"])
        app.add_api_route("/version", self.version, methods=["GET"])

    async def version(self) -> Response:
        return json_response({"version": "0.0.0+fakeengine"})

    # ---------------------------------------------------------------------------- role rules

    async def admit(self, req: OpenAIRequest, job: Job, request: Request) -> Job:
        """NixlConnector semantics; only P/D instances have a KV connector configured."""
        params = req.kv_transfer_params
        if not params or self.config.mode not in ("prefill", "decode"):
            return job
        if params.get("do_remote_prefill"):
            await self._pull_remote_kv(params, request)
        if params.get("do_remote_decode"):
            job.meta["remote_decode"] = True
        return job

    async def _pull_remote_kv(self, params: dict[str, Any], request: Request) -> None:
        if not params.get("remote_block_ids"):
            # The scheduler already promised external tokens it can never load: it asserts,
            # the engine core dies and /health turns 503 for good.
            logger.error("do_remote_prefill without remote_block_ids: engine core dies")
            self.state.mark_dead()
            raise ApiError(500, self.dead_message)
        if any(not params.get(name) for name in _PEER_FIELDS):
            # No NIXL read is ever queued, yet the request waits for its remote KVs.
            logger.warning("Got invalid KVTransferParams: %s; request parks forever", params)
            await self.park(request, on_peer=True)
        # A complete handoff: the fake NIXL read succeeds at once.

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
