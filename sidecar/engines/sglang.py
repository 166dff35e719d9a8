"""SGLang: prefill and decode need its fake KV transfer; its scheduler's per-batch counters;
rank pinning by a body field; an encoder checked by its own /health (measured on SGLang 0.5.23:
docs/engines.md).

A real SGLang decode server given a request without ``bootstrap_host`` crashes its scheduler and
the whole server exits: a plain canary does not fail there, it kills the worker
(:class:`~sidecar.engines.base.FakeTransfer`). Decode asks for 2 tokens: its first token comes
from a prebuilt batch that runs no forward pass.
"""

from __future__ import annotations

from sidecar.core.evidence.progress import (
    COMPLETED,
    GENERATION,
    PROMPT,
    STEPS,
    ProgressSpec,
    Series,
    series,
)
from sidecar.core.vocabulary import Mode, Role
from sidecar.engines.base import Canary, Engine, FakeTransfer, HttpApi, NewImage, NoCanary, RankPin

# --enable-metrics; gzipped only when asked. The schedulers count, per rank and with every batch,
# the tokens they compute by kind (realtime_tokens_total{mode}: a prompt's tokens as
# prefill_compute, or prefill_cache when its prefix is cached; one per decode step) and the
# batches they run (cuda_graph_passes_total, graph or not). The tokenizer manager's counters move
# only when a request completes (in bursts under load, engine-wide, no rank): only its count of
# completed requests is read. The schedulers' idle and stage seconds advance while idle, so they
# prove nothing. Scoped to one rank, only the schedulers' series remain.
PROGRESS = ProgressSpec(
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
    # The schedulers' counters, with every batch (SGLang 0.5.23 has realtime_tokens_total; an
    # older one only the tokenizer manager's, which move as requests complete).
    per_step=frozenset({PROMPT, GENERATION, STEPS}),
)

HTTP = HttpApi(
    # SGLang's /health runs a generation in current versions; /v1/models is answered by the
    # tokenizer manager once the model is loaded, at no cost to the scheduler.
    registration_path="/v1/models",
    progress=PROGRESS,
    needs_model=False,
    # GenerateReqInput.data_parallel_rank routes a request to one DP rank (400 out of range);
    # with --dp-size N every scheduler-side series carries dp_rank (with one rank, none does).
    pin=RankPin(label="dp_rank", field="data_parallel_rank"),
)

# SGLang's encoder (--encoder-only) serves no cheap route that answers 200 (no /v1/models;
# /metrics only with --enable-metrics): it is registered while GET /v1/models answers at all (its
# 404 within the deadline: the server is up; it serves HTTP only once the model is loaded). Its
# metrics hold no progress series the sidecar reads: the canary alone decides. Its /health goes
# to every rank at once: no pin.
ENCODER_HTTP = HttpApi(
    registration_path="/v1/models",
    progress=ProgressSpec(path="/metrics", running=(), waiting=(), counters={}),
    registered_by_any_answer=True,
    needs_model=False,
)


class Sglang(Engine):
    name = "sglang"
    title = "SGLang"
    http = HTTP

    def role_canary(self, role: Role, bootstrap_port: int) -> Canary | NoCanary:
        if role.mode is Mode.ENCODE:  # any model type with a multimodal encoder: its own check
            return Canary(NewImage(), 0, "SGLang's own encode check")
        tokens = 2 if role.mode is Mode.DECODE else 1
        if role.disaggregated:
            transfer = FakeTransfer(bootstrap_port)
            return Canary(transfer, tokens, f"{role.mode} worker: {transfer.why}")
        return Canary(None, tokens, "plain greedy generation")

    def api(self, role: Role) -> HttpApi:
        return ENCODER_HTTP if role.mode is Mode.ENCODE else HTTP  # its routes, any model type


ENGINE = Sglang()
