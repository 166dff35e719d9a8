"""The transfer probe of a vLLM decode worker (SIDECAR_KV_PEER_URL): a real KV transfer from a
prefill peer, checked for time and for correctness. The bodies and the judgement; the I/O is in
``sidecar/transferprobe.py``.

One probe, as a disaggregated router runs a request, plus a reference:

1. the prompt to the prefill peer with ``max_tokens`` 1 and ``kv_transfer_params``
   ``do_remote_decode``: the peer computes the KV and keeps it for a decoder to pull; its answer's
   ``kv_transfer_params`` say where (engine id, host, port, block ids);
2. the same prompt with those parameters to this decode worker: it pulls the KV over NIXL and
   decodes greedily;
3. the same prompt to this decode worker with no parameters: a local prefill, the reference.

It passes only if all three answer 200 within the deadline and 2 answers what 3 answers: a
transfer that completes but brings corrupted KV fails too. Each probe uses a prompt of its own
and two cache salts (vLLM's ``cache_salt``), so that neither the peer's nor this worker's prefix
cache can stand in for the transfer, and the reference is computed from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sidecar.canary.base import token_completion_body

# What vLLM's NIXL connector reads in a prefill request: "keep the KV, a decoder will pull it".
REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
PATH = "/v1/completions"
DECODE_TOKENS = 2


def probe_prompt(tokens: int, nonce: int) -> list[int]:
    """``tokens`` ordinary token ids (100..499: valid in every vocabulary, the 512-token test
    model's included), different for every ``nonce``."""
    return [100 + (nonce * 131 + i * 7) % 400 for i in range(tokens)]


@dataclass(frozen=True)
class TransferBodies:
    """The three requests of one probe."""

    prefill: dict[str, Any]
    local: dict[str, Any]

    def decode(self, params: dict[str, Any]) -> dict[str, Any]:
        """The decode leg, with the parameters the peer's answer gave."""
        return {**self.prefill, "max_tokens": DECODE_TOKENS, "kv_transfer_params": params}


def bodies(model: str | None, tokens: int, nonce: int, request_id: str) -> TransferBodies:
    prompt = probe_prompt(tokens, nonce)
    salt = f"health-sidecar-{request_id}"
    prefill = token_completion_body(model, 1, prompt) | {
        "kv_transfer_params": dict(REMOTE_DECODE),
        "cache_salt": salt,
        "request_id": request_id,
    }
    local = token_completion_body(model, DECODE_TOKENS, prompt) | {
        "cache_salt": salt + "-local",
        "request_id": request_id + "-local",
    }
    return TransferBodies(prefill, local)


def transfer_params(answer: Any) -> dict[str, Any] | None:
    """The peer's ``kv_transfer_params``, when they say where to pull the KV from."""
    if not isinstance(answer, dict):
        return None
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None
    return params


def generated(answer: Any) -> str | None:
    """The text a completion generated, or None."""
    try:
        text = answer["choices"][0]["text"]
    except (KeyError, IndexError, TypeError):
        return None
    return text if isinstance(text, str) else None
