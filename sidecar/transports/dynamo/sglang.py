"""dynamo.sglang: prefill and decode add ``bootstrap_info`` with SGLang's fake-transfer host (the
engine's rule, :class:`~sidecar.engines.base.FakeTransfer`), and the health-check marker.

A Dynamo SGLang decode worker raises "bootstrap_info is required for disaggregated decode but was
not provided" for a request without it; a prefill worker given a request without it uses the real
bootstrap host and a random room, prefills, then waits for a decode peer that never comes. Never
send a plain canary to either. The room is fresh per canary (Dynamo's own uses 0, which always
lands on DP rank 0).
"""

from __future__ import annotations

from typing import Any

from sidecar.core.vocabulary import Mode
from sidecar.probes.base import token_ids
from sidecar.transports.dynamo.base import HEALTH_CHECK_KEY, DynamoProber, carried


class DynamoSglangProber(DynamoProber):
    def why(self) -> str:
        why = super().why()
        return f"{why}, with the {HEALTH_CHECK_KEY} marker" if self.role.disaggregated else why

    def body(self, model: str | None, request_id: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "token_ids": token_ids(),
            "stop_conditions": {"max_tokens": self.tokens, "ignore_eos": True},
            "sampling_options": {"temperature": 0.0, "top_p": 1.0, "top_k": -1},
            "eos_token_ids": [],
            "annotations": [],
        }
        if self.role.disaggregated:
            body |= carried(self.need, request_id) | {HEALTH_CHECK_KEY: True}
        return body

    def answer(self, parsed: Any) -> str | None:
        # A decode canary's fake transfer brings no KV: what it generates is not reproducible.
        return None if self.role.mode is Mode.DECODE else super().answer(parsed)
