"""TensorRT-LLM: POST /v1/completions; prefill and decode add
``"disaggregated_params": {"request_type": "context_and_generation"}``.

A Dynamo TensorRT-LLM decode worker given a request without it answers "Disaggregated params are
required for decode mode" (Dynamo's own canary crash-looped decode workers on it).
``context_and_generation`` makes the worker run the probe as a local prefill plus decode: no
peer, no KV transfer, nothing pinned. Never forge ``generation_only`` params: newer builds
reject unsigned ones.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sidecar.core.evidence.progress import (
    COMPLETED,
    GENERATION,
    PROMPT,
    ProgressSpec,
    series,
)
from sidecar.probes.base import Prober, Role, token_completion_body
from sidecar.probes.role import Backend, Mode, ModelType

LOCAL_PREFILL_AND_DECODE = {"request_type": "context_and_generation"}


class TrtllmProber(Prober):
    backend: ClassVar[Backend] = Backend.TRTLLM
    generation_path: ClassVar[str] = "/v1/completions"
    registration_path: ClassVar[str] = "/health"
    # trtllm-serve's /metrics is JSON; Prometheus text is on /prometheus/metrics (with
    # return_perf_metrics). Names vary across releases: older ones have no trtllm_ prefix, some
    # forks publish vLLM-style gauges. Without a running gauge, busy cannot be told from idle and
    # the canary alone decides; advancing counters still excuse a canary queued behind work.
    progress: ProgressSpec = ProgressSpec(
        path="/prometheus/metrics",
        running=series("trtllm_num_requests_running", "tensorrt_llm:num_requests_running"),
        waiting=series("trtllm_num_requests_waiting", "tensorrt_llm:num_requests_waiting"),
        counters={
            PROMPT: series("trtllm_prompt_tokens_total"),
            GENERATION: series("trtllm_generation_tokens_total"),
            COMPLETED: series("trtllm_request_success_total", "request_success_total"),
        },
    )

    def skip_reason(self, role: Role) -> str | None:
        if role == Role(Mode.ENCODE, ModelType.MULTIMODAL):
            return (
                "TensorRT-LLM's encoder (trtllm-serve encoder, POST /v1/multimodal_encoder, "
                "experimental) answers with CUDA IPC handles of the embeddings, kept for the "
                "worker that reads them; a canary's would never be read, and when the encoder "
                "frees them is not documented: no canary, readiness follows registration"
            )
        return super().skip_reason(role)

    def why(self, role: Role) -> str:
        if role.mode in (Mode.PREFILL, Mode.DECODE):
            return (
                f"{role.mode} worker: disaggregated_params request_type context_and_generation "
                "runs the probe as a local prefill plus decode (no peer, no KV transfer)"
            )
        return "plain 1-token greedy completion"

    def body(self, role: Role, model: str | None, request_id: str) -> tuple[dict[str, Any], int]:
        tokens = 1
        # No request_id field: trtllm-serve's request models may forbid unknown fields.
        body = token_completion_body(model, tokens)
        if role.mode in (Mode.PREFILL, Mode.DECODE):
            body["disaggregated_params"] = dict(LOCAL_PREFILL_AND_DECODE)
        return body, tokens
