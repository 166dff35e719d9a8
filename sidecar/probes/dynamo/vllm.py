"""dynamo.vllm: a plain local request in every role, with the health-check marker.

A Dynamo vLLM decode worker given no ``prefill_result`` runs prefill and decode locally, so the
plain payload checks its engine; a prefill worker given the marker skips the KV hand-off (without
it, a hand-off is set up that nobody consumes and its blocks stay pinned until NIXL's abort
timeout).
"""

from __future__ import annotations

from typing import Any, ClassVar

from sidecar.probes.base import PROMPT_TOKEN_IDS, Role
from sidecar.probes.dynamo.base import HEALTH_CHECK_KEY, DynamoProber, greedy_stop
from sidecar.probes.role import Backend, Mode
from sidecar.probes.vllm import VllmProber


class DynamoVllmProber(DynamoProber):
    backend: ClassVar[Backend] = Backend.VLLM

    def skip_reason(self, role: Role) -> str | None:
        if role.mode is Mode.ENCODE:  # Dynamo's encode worker takes its own request type
            return super().skip_reason(role)
        return VllmProber().skip_reason(role)  # the engine's rules, whatever carries the request

    def why(self, role: Role) -> str:
        if role.mode is Mode.PREFILL:
            return (
                "plain local request with the _HEALTH_CHECK marker: the prefill worker skips "
                "the KV hand-off"
            )
        if role.mode is Mode.DECODE:
            return "plain local request: a dynamo.vllm decode worker prefills it itself"
        return "plain 1-token greedy request with the _HEALTH_CHECK marker"

    def body(self, role: Role, model: str | None, request_id: str) -> tuple[dict[str, Any], int]:
        tokens = 1
        return {
            "token_ids": list(PROMPT_TOKEN_IDS),
            "sampling_options": {"temperature": 0.0},
            "stop_conditions": greedy_stop(tokens),
            HEALTH_CHECK_KEY: True,
        }, tokens

    def stamped(self, role: Role, payload: dict[str, Any]) -> dict[str, Any]:
        # As dynamo.vllm does with DYN_HEALTH_CHECK_PAYLOAD: the marker is stamped on top.
        return {**payload, HEALTH_CHECK_KEY: True}
