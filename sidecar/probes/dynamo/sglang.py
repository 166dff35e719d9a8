"""dynamo.sglang: prefill and decode add ``bootstrap_info`` with SGLang's fake-transfer host.

A Dynamo SGLang decode worker raises "bootstrap_info is required for disaggregated decode but was
not provided" for a request without it; a prefill worker given a request without it uses the real
bootstrap host and a random room, prefills, then waits for a decode peer that never comes. Never
send a plain canary to either. Host "2.2.2.2" selects SGLang's fake KV transfer: no peer, never
dialled. The room is fresh per canary (Dynamo's own uses 0, which always lands on DP rank 0).
Decode asks for 2 tokens: its first token comes from a prebuilt batch that runs no forward pass.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sidecar.probes.base import PROMPT_TOKEN_IDS, Role
from sidecar.probes.dynamo.base import HEALTH_CHECK_KEY, DynamoProber
from sidecar.probes.role import Backend, Mode
from sidecar.probes.sglang import FAKE_BOOTSTRAP_HOST, bootstrap_room

DISAGGREGATED = (Mode.PREFILL, Mode.DECODE)


class DynamoSglangProber(DynamoProber):
    backend: ClassVar[Backend] = Backend.SGLANG

    def __init__(self, endpoint: str = "generate", bootstrap_port: int = 8998) -> None:
        super().__init__(endpoint)
        self.bootstrap_port = bootstrap_port

    def why(self, role: Role) -> str:
        if role.mode in DISAGGREGATED:
            return (
                f"{role.mode} worker: bootstrap_info with host {FAKE_BOOTSTRAP_HOST} selects "
                "SGLang's fake KV transfer, so the probe runs without a peer"
            )
        return "plain 1-token greedy request"

    def body(self, role: Role, model: str | None, request_id: str) -> tuple[dict[str, Any], int]:
        tokens = 2 if role.mode is Mode.DECODE else 1
        body: dict[str, Any] = {
            "token_ids": list(PROMPT_TOKEN_IDS),
            "stop_conditions": {"max_tokens": tokens, "ignore_eos": True},
            "sampling_options": {"temperature": 0.0, "top_p": 1.0, "top_k": -1},
            "eos_token_ids": [],
            "annotations": [],
        }
        if role.mode in DISAGGREGATED:
            body["bootstrap_info"] = {
                "bootstrap_host": FAKE_BOOTSTRAP_HOST,
                "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": bootstrap_room(request_id),
            }
            body[HEALTH_CHECK_KEY] = True
        return body, tokens

    def answer(self, parsed: Any, role: Role) -> str | None:
        # A decode canary's fake transfer brings no KV: what it generates is not reproducible.
        return None if role.mode is Mode.DECODE else super().answer(parsed, role)
