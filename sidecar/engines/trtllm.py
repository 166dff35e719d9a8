"""TensorRT-LLM: prefill and decode carry disaggregated parameters that run the canary whole,
locally (:class:`~sidecar.engines.base.LocalRun`: DIS-1737); its metrics on trtllm-serve's
Prometheus route. Its encoder gets no canary.
"""

from __future__ import annotations

from sidecar.core.evidence.progress import COMPLETED, GENERATION, PROMPT, ProgressSpec, series
from sidecar.core.vocabulary import Role
from sidecar.engines.base import Canary, Engine, HttpApi, LocalRun, NoCanary

HTTP = HttpApi(
    registration_path="/health",
    # trtllm-serve's /metrics is JSON; Prometheus text is on /prometheus/metrics (with
    # return_perf_metrics). Names vary across releases: older ones have no trtllm_ prefix, some
    # forks publish vLLM-style gauges. Without a running gauge, busy cannot be told from idle and
    # the canary alone decides; advancing counters still excuse a canary queued behind work.
    progress=ProgressSpec(
        path="/prometheus/metrics",
        running=series("trtllm_num_requests_running", "tensorrt_llm:num_requests_running"),
        waiting=series("trtllm_num_requests_waiting", "tensorrt_llm:num_requests_waiting"),
        counters={
            PROMPT: series("trtllm_prompt_tokens_total"),
            GENERATION: series("trtllm_generation_tokens_total"),
            COMPLETED: series("trtllm_request_success_total", "request_success_total"),
        },
    ),
)

ENCODER = (
    "TensorRT-LLM's encoder (trtllm-serve encoder, POST /v1/multimodal_encoder, experimental) "
    "answers with CUDA IPC handles of the embeddings, kept for the worker that reads them; a "
    "canary's would never be read, and when the encoder frees them is not documented: no "
    "canary, readiness follows registration (DYN_HEALTH_CHECK_PAYLOAD gives it one)"
)


class Trtllm(Engine):
    name = "trtllm"
    title = "TensorRT-LLM"
    http = HTTP

    def role_canary(self, role: Role, bootstrap_port: int) -> Canary | NoCanary:
        if role.encoder:
            return NoCanary(ENCODER)
        if role.disaggregated:
            local = LocalRun()
            return Canary(local, 1, f"{role.mode} worker: {local.why}")
        return Canary(None, 1, "plain greedy request")


ENGINE = Trtllm()
