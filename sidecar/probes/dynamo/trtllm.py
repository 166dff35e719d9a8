"""dynamo.trtllm: prefill and decode add
``"disaggregated_params": {"request_type": "context_and_generation"}`` to the marked payload.

A Dynamo TensorRT-LLM decode worker raises "Disaggregated params are required for decode mode"
for any request without them (Dynamo's own canary crash-looped its decode workers on it). It
runs a request locally, as a prefill plus decode with no peer and no KV transfer, only when the
request carries both the ``_HEALTH_CHECK`` marker and these params.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sidecar.probes.base import PROMPT_TOKEN_IDS, Role
from sidecar.probes.dynamo.base import HEALTH_CHECK_KEY, DynamoProber, greedy_stop
from sidecar.probes.role import Backend, Mode
from sidecar.probes.trtllm import LOCAL_PREFILL_AND_DECODE

DISAGGREGATED = (Mode.PREFILL, Mode.DECODE)


class DynamoTrtllmProber(DynamoProber):
    backend: ClassVar[Backend] = Backend.TRTLLM

    def why(self, role: Role) -> str:
        if role.mode in DISAGGREGATED:
            return (
                f"{role.mode} worker: the _HEALTH_CHECK marker with disaggregated_params "
                "request_type context_and_generation runs it as a local prefill plus decode (no "
                "peer, no KV transfer)"
            )
        return "plain 1-token greedy request with the _HEALTH_CHECK marker"

    def body(self, role: Role, model: str | None, request_id: str) -> tuple[dict[str, Any], int]:
        tokens = 1
        body: dict[str, Any] = {
            "token_ids": list(PROMPT_TOKEN_IDS),
            "priority": 1.0,
            "stop_conditions": greedy_stop(tokens) | {"min_tokens": 0},
            "sampling_options": {
                "temperature": 0.0,
                "top_p": 1.0,
                "top_k": 1,
                "repetition_penalty": 1.0,
                "presence_penalty": 0.0,
                "frequency_penalty": 0.0,
                "seed": None,
            },
            HEALTH_CHECK_KEY: True,
        }
        return self.stamped(role, body), tokens

    def stamped(self, role: Role, payload: dict[str, Any]) -> dict[str, Any]:
        # As dynamo.trtllm does with DYN_HEALTH_CHECK_PAYLOAD: the marker, and for a
        # disaggregated role its local-prefill params, are stamped on top of a user's payload.
        body = {**payload, HEALTH_CHECK_KEY: True}
        if role.mode in DISAGGREGATED:
            body["disaggregated_params"] = dict(LOCAL_PREFILL_AND_DECODE)
        return body
