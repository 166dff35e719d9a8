"""SGLang: POST /generate with input_ids; prefill and decode add fake-transfer bootstrap fields.

A real SGLang 0.5.23 decode server given a request without ``bootstrap_host`` crashes its
scheduler ("'NoneType' object has no attribute 'startswith'") and the whole server exits: a
plain canary does not fail there, it kills the worker. An SGLang prefill or decode server
rejects a request without a bootstrap room ("Disaggregated request received without bootstrap
room id", HTTP 400). ``bootstrap_host`` "2.2.2.2" is SGLang's
FAKE_BOOTSTRAP_HOST: the request runs with a fake KV sender/receiver, needs no peer and never
touches the bootstrap server. The room is fresh per canary, so probes spread over DP ranks.
Decode asks for 2 tokens: its first token comes from a prebuilt batch that runs no forward pass.

A canary whose client gave up runs on: SGLang's tokenizer manager notices a closed connection
only when its wait for the answer next wakes (every 4 s), so a scheduler that resumes before
that computes it (measured on 0.5.23: 2 of 5 timed-out canaries computed after SIGCONT). The
canary carries its own ``rid`` (the canary's request id) and the probe sends SGLang's
``POST /abort_request {"rid": ...}`` right after the timeout: 5 of 5 aborted, none computed.
"""

from __future__ import annotations

import uuid
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
from sidecar.probes.base import PROMPT_TOKEN_IDS, CanaryRequest, Prober, Role
from sidecar.probes.role import Backend, Mode, ModelType

FAKE_BOOTSTRAP_HOST = "2.2.2.2"
ABORT_PATH = "/abort_request"


def bootstrap_room(request_id: str) -> int:
    """A room derived from the canary's id: random per canary, reproducible from the logs."""
    return uuid.uuid5(uuid.NAMESPACE_URL, request_id).int % (1 << 63)


class SglangProber(Prober):
    backend: ClassVar[Backend] = Backend.SGLANG
    generation_path: ClassVar[str] = "/generate"
    # SGLang's /health runs a generation in current versions; /v1/models is answered by the
    # tokenizer manager once the model is loaded, at no cost to the scheduler.
    registration_path: ClassVar[str] = "/v1/models"
    needs_model: ClassVar[bool] = False
    # GenerateReqInput.data_parallel_rank routes a request to one DP rank (400 out of range).
    rank_field: ClassVar[str | None] = "data_parallel_rank"
    # Measured on a real SGLang 0.5.23 (docs/engines.md): with --dp-size N every scheduler-side
    # series carries dp_rank (with one rank, none does); the tokenizer manager's counters never do.
    rank_label: ClassVar[str | None] = "dp_rank"
    # --enable-metrics; gzipped only when asked. The schedulers count, per rank and with every
    # batch, the tokens they compute by kind (realtime_tokens_total{mode}: a prompt's tokens as
    # prefill_compute, or prefill_cache when its prefix is cached; one per decode step) and the
    # batches they run (cuda_graph_passes_total, graph or not). The tokenizer manager's counters
    # move only when a request completes (in bursts under load, engine-wide, no rank): only its
    # count of completed requests is read. The schedulers' idle and stage seconds advance while
    # idle, so they prove nothing. Scoped to one rank, only the schedulers' series remain.
    progress: ProgressSpec = ProgressSpec(
        path="/metrics",
        running=series("sglang:num_running_reqs"),
        waiting=series("sglang:num_queue_reqs"),
        counters={
            PROMPT: (
                Series("sglang:realtime_tokens_total", (("mode", "prefill_compute"),)),
                Series("sglang:realtime_tokens_total", (("mode", "prefill_cache"),)),
            ),
            GENERATION: (Series("sglang:realtime_tokens_total", (("mode", "decode"),)),),
            STEPS: series("sglang:cuda_graph_passes_total"),
            COMPLETED: series("sglang:num_requests_total"),
        },
        # The schedulers' counters, with every batch (SGLang 0.5.23 has realtime_tokens_total;
        # an older one only the tokenizer manager's, which move as requests complete).
        per_step=frozenset({PROMPT, GENERATION, STEPS}),
    )

    def __init__(self, bootstrap_port: int = 8998) -> None:
        self.bootstrap_port = bootstrap_port

    def why(self, role: Role) -> str:
        if role.mode in (Mode.PREFILL, Mode.DECODE):
            return (
                f"{role.mode} worker: bootstrap_host {FAKE_BOOTSTRAP_HOST} selects SGLang's fake "
                "KV transfer, so the probe runs without a peer"
            )
        return "plain 1-token greedy generation"

    def body(self, role: Role, model: str | None, request_id: str) -> tuple[dict[str, Any], int]:
        tokens = 2 if role.mode is Mode.DECODE else 1
        body: dict[str, Any] = {
            "input_ids": list(PROMPT_TOKEN_IDS),
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
            "rid": request_id,
            "stream": False,
        }
        if role.mode in (Mode.PREFILL, Mode.DECODE):
            body["bootstrap_host"] = FAKE_BOOTSTRAP_HOST
            body["bootstrap_port"] = self.bootstrap_port
            body["bootstrap_room"] = bootstrap_room(request_id)
        return body, tokens

    def abort(self, request: CanaryRequest) -> CanaryRequest | None:
        """SGLang's abort of one request by its ``rid`` (a user's payload without one is never
        aborted: ``abort_all`` would take every user's request with it)."""
        rid = request.body.get("rid")
        if not isinstance(rid, str) or not rid:
            return None
        return CanaryRequest("POST", ABORT_PATH, {"rid": rid}, request.request_id, None)

    def answer(self, parsed: Any, role: Role) -> str | None:
        # A decode canary's fake transfer brings no KV: what it generates is not reproducible.
        if role.mode is Mode.DECODE:
            return None
        text = parsed.get("text")
        return text if isinstance(text, str) else None

    def problem(self, answer: Any, expected_tokens: int | None) -> str | None:
        if not isinstance(answer, dict):
            return "body is not a JSON object"
        if answer.get("error"):
            return f"engine error in body: {answer['error']}"
        meta = answer.get("meta_info")
        if not isinstance(meta, dict):
            return "no meta_info in body"
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else None
        if not kind:
            return "no meta_info.finish_reason.type in body"
        if kind != "length":
            return f"finish_reason {kind!r}, expected 'length'"
        got = meta.get("completion_tokens")
        if expected_tokens is not None and got is not None and got != expected_tokens:
            return f"meta_info.completion_tokens {got!r}, expected {expected_tokens}"
        return None


class SglangEncoderProber(SglangProber):
    """SGLang's encoder (``--encoder-only``, the E of E/P/D): its own ``GET /health``, which
    encodes a 32x32 test image on every data-parallel rank and answers 200 (503 after its 30 s
    timeout, or at once when a rank has died), under the sidecar's deadline. While the encoder
    hangs it gives no answer at all: a single-process encoder runs HTTP and the vision model on
    one event loop. Measured on SGLang 0.5.23 with a tiny Qwen2-VL (docs/engines.md).

    The encoder serves no cheap route that answers 200 (no ``/v1/models``; ``/metrics`` only
    with ``--enable-metrics``), so it is registered while ``GET /v1/models`` answers at all (its
    404 within the deadline: the server is up; it serves HTTP only once the model is loaded). Its
    metrics hold no progress series the sidecar reads: the canary alone decides. A ``/health``
    runs on when its client leaves (a blocked loop cannot see it go, and a frozen rank's share
    waits for SGLang's own 30 s timeout): the probe keeps a timed-out one waiting on its
    connection and sends no other until it ends, so at most one is ever on the encoder.
    While ``POST /encode`` requests wait to send their embeddings, SGLang answers ``/health``
    200 without encoding: a busy encoder is trusted, as by SGLang's own check."""

    generation_path: ClassVar[str] = "/health"
    method: ClassVar[str] = "GET"
    reads_body: ClassVar[bool] = False
    registration_path: ClassVar[str] = "/v1/models"
    registered_by_any_answer: ClassVar[bool] = True
    keeps_abandoned: ClassVar[bool] = True
    stops_on_close: ClassVar[bool] = False
    kept_because: ClassVar[str] = "SGLang runs a /health to its end whatever its client does"
    rank_field: ClassVar[str | None] = None  # /health goes to every rank at once
    rank_label: ClassVar[str | None] = None
    progress: ProgressSpec = ProgressSpec(path="/metrics", running=(), waiting=(), counters={})

    def skip_reason(self, role: Role) -> str | None:
        if role.model_type is ModelType.TEXT:  # the rule for a text model's encode worker
            return Prober.skip_reason(self, role)
        return None

    def why(self, role: Role) -> str:
        return (
            "SGLang's own encode check (GET /health encodes a 32x32 test image on every rank), "
            "under the sidecar's deadline: it gives no answer while the encoder hangs"
        )

    def body(self, role: Role, model: str | None, request_id: str) -> tuple[dict[str, Any], int]:
        return {}, 0

    def good_answer(self, role: Role) -> str:
        return "HTTP 200 (the encoder encoded its own test image)"

    def answer(self, parsed: Any, role: Role) -> str | None:
        return None
