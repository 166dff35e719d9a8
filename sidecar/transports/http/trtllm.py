"""TensorRT-LLM over trtllm-serve's HTTP API: ``POST /v1/completions``; prefill and decode carry
``"disaggregated_params": {"request_type": "context_and_generation"}``
(:mod:`sidecar.engines.trtllm` says why)."""

from __future__ import annotations

from typing import Any, ClassVar

from sidecar.probes.completions import token_completion_body
from sidecar.transports.http.base import HttpProber, carried


class TrtllmProber(HttpProber):
    route: ClassVar[str] = "/v1/completions"

    def body(self, model: str | None, request_id: str) -> dict[str, Any]:
        # No request_id field: trtllm-serve's request models may forbid unknown fields.
        return token_completion_body(model, self.tokens) | carried(self.need, request_id)
