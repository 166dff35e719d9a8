"""Any other OpenAI-compatible server (llama.cpp's llama-server, ...): a plain request in every
role; llama-server's metrics where it publishes them (``--metrics``)."""

from __future__ import annotations

from sidecar.core.evidence.progress import GENERATION, PROMPT, STEPS, ProgressSpec, series
from sidecar.core.vocabulary import Role
from sidecar.engines.base import Canary, Engine, HttpApi, NoCanary

HTTP = HttpApi(
    registration_path="/health",
    # llama.cpp's llama-server (started with --metrics); other servers publish none of these, and
    # then the canary alone decides.
    progress=ProgressSpec(
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
    ),
)


class OpenAI(Engine):
    name = "openai"
    title = "an OpenAI-compatible server"
    http = HTTP

    def role_canary(self, role: Role, bootstrap_port: int) -> Canary | NoCanary:
        return Canary(None, 1, "plain greedy request (generic OpenAI-compatible server)")


ENGINE = OpenAI()
