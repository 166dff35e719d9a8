"""dynamo.trtllm: the marked payload; prefill and decode add ``disaggregated_params`` with request
type ``context_and_generation`` (the engine's rule, :class:`~sidecar.engines.base.LocalRun`).

A Dynamo TensorRT-LLM decode worker raises "Disaggregated params are required for decode mode"
for any request without them (Dynamo's own canary crash-looped its decode workers on it). It runs
a request locally, as a prefill plus decode with no peer and no KV transfer, only when the
request carries both the ``_HEALTH_CHECK`` marker and these params.
"""

from __future__ import annotations

from typing import Any

from sidecar.probes.base import token_ids
from sidecar.transports.dynamo.base import HEALTH_CHECK_KEY, DynamoProber, carried, greedy_stop


class DynamoTrtllmProber(DynamoProber):
    def why(self) -> str:
        return f"{super().why()}, with the {HEALTH_CHECK_KEY} marker"

    def body(self, model: str | None, request_id: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "token_ids": token_ids(),
            "priority": 1.0,
            "stop_conditions": greedy_stop(self.tokens) | {"min_tokens": 0},
            "sampling_options": {
                "temperature": 0.0,
                "top_p": 1.0,
                "top_k": 1,
                "repetition_penalty": 1.0,
                "presence_penalty": 0.0,
                "frequency_penalty": 0.0,
                "seed": None,
            },
        }
        return self.stamped(body)

    def stamped(self, payload: dict[str, Any]) -> dict[str, Any]:
        # As dynamo.trtllm does with DYN_HEALTH_CHECK_PAYLOAD: the marker, and for a
        # disaggregated role its local-run params, are stamped on top of a user's payload.
        return {**payload, HEALTH_CHECK_KEY: True} | carried(self.need, "")
