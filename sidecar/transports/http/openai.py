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

from sidecar.probes.completions import completion_problem
from sidecar.transports.http.base import HttpProber


class OpenAIProber(HttpProber):
    route: ClassVar[str] = "/v1/completions"
    keeps_abandoned: ClassVar[bool] = True
    # "Say OK." is a few tokens in any tokenizer, with BOS and a chat template at most 16.
    prompt_budget: ClassVar[int] = 16

    def body(self, model: str | None, request_id: str) -> dict[str, Any]:
        return {
            "model": model,
            "prompt": "Say OK.",
            "max_tokens": self.tokens,
            "temperature": 0,
            "stream": False,
        }

    def problem(self, answer: Any, expected_tokens: int | None) -> str | None:
        return completion_problem(answer, expected_tokens, exact=False)
