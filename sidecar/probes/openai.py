"""Any other OpenAI-compatible server (llama.cpp's llama-server, ...): a plain completion.

The body keeps to fields every OpenAI-compatible server accepts: a short string prompt and
max_tokens 1. Without ignore_eos the engine may stop early, so the check asks for a finish
reason and at most one generated token.

A canary whose client gave up is computed later: a frozen llama-server accepts the abandoned
connection after SIGCONT, reads the whole request and runs it (measured: 5 of 5 timed-out
canaries computed), and it has no abort by request. So the probe keeps waiting for the canary it
sent (``keeps_abandoned``) and sends no other while it runs: at most one is ever on the engine.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sidecar.core.evidence.progress import GENERATION, PROMPT, STEPS, ProgressSpec, series
from sidecar.probes.base import Prober, Role, completion_problem
from sidecar.probes.role import Backend


class OpenAIProber(Prober):
    backend: ClassVar[Backend] = Backend.OPENAI
    generation_path: ClassVar[str] = "/v1/completions"
    registration_path: ClassVar[str] = "/health"
    # llama.cpp's llama-server (started with --metrics); other servers publish none of these,
    # and then the canary alone decides.
    progress: ProgressSpec = ProgressSpec(
        path="/metrics",
        running=series("llamacpp:requests_processing"),
        waiting=series("llamacpp:requests_deferred"),
        counters={
            PROMPT: series("llamacpp:prompt_tokens_total"),
            GENERATION: series("llamacpp:tokens_predicted_total"),
            STEPS: series("llamacpp:n_decode_total"),
        },
        # llama_decode calls; its token totals are added as each request ends.
        per_step=frozenset({STEPS}),
    )
    keeps_abandoned: ClassVar[bool] = True
    # "Say OK." is a few tokens in any tokenizer, with BOS and a chat template at most 16.
    prompt_budget: ClassVar[int] = 16

    def why(self, role: Role) -> str:
        return "plain 1-token greedy completion (generic OpenAI-compatible server)"

    def body(self, role: Role, model: str | None, request_id: str) -> tuple[dict[str, Any], int]:
        tokens = 1
        return {
            "model": model,
            "prompt": "Say OK.",
            "max_tokens": tokens,
            "temperature": 0,
            "stream": False,
        }, tokens

    def problem(self, answer: Any, expected_tokens: int | None) -> str | None:
        return completion_problem(answer, expected_tokens, exact=False)
