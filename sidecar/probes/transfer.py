"""The transfer probe of a vLLM decode worker (SIDECAR_KV_PEER_URL): a real KV transfer from a
prefill peer, checked for time and for correctness: the bodies, the judgement and the probe's I/O
(:class:`TransferProbe`).

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

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sidecar.core.evidence.result import Outcome, Result
from sidecar.probes.base import token_completion_body

if TYPE_CHECKING:
    from sidecar.probes.base import CanaryPlan, CanaryRequest
    from sidecar.runtime.engine import EngineClient

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


class TransferProbe:
    """The probe's I/O: a prefill on the peer, the decode here with the KV it returned, and the
    local reference, with the probe's deadline (SIDECAR_KV_PROBE_TIMEOUT) on the whole. Its two
    clients (the peer's, the local engine's) carry that deadline on every request; it owns and
    closes them."""

    def __init__(
        self,
        peer: EngineClient,
        local: EngineClient,
        *,
        timeout: float,
        prompt_tokens: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout = timeout
        self.prompt_tokens = prompt_tokens
        self.clock = clock
        self.peer = peer
        self.local = local
        self._nonce = itertools.count(int(time.time()))

    async def aclose(self) -> None:
        await self.peer.aclose()
        await self.local.aclose()

    async def __call__(self, plan: CanaryPlan, request: CanaryRequest, model: str | None) -> Result:
        """One probe (the protocol of :mod:`sidecar.probes.kinds`): only the request's id is
        taken; the probe builds its own three bodies."""
        return await self.run(model, request.request_id)

    async def run(self, model: str | None, request_id: str) -> Result:
        started = self.clock()

        def result(outcome: Outcome, reason: str) -> Result:
            return Result(outcome, reason, started, self.clock(), time.time(), request_id, None)

        try:
            async with asyncio.timeout(self.timeout):
                return await self._run(model, request_id, result)
        except TimeoutError:
            return result(
                Outcome.TIMEOUT, f"the transfer probe did not finish within {self.timeout:g} s"
            )

    async def _run(
        self, model: str | None, request_id: str, result: Callable[[Outcome, str], Result]
    ) -> Result:
        plan = bodies(model, self.prompt_tokens, next(self._nonce), request_id)
        answer, failed = await self.peer.post_json(PATH, plan.prefill)
        if failed is not None:
            return result(failed.outcome, f"prefill peer: {failed.reason}")
        params = transfer_params(answer)
        if params is None:
            return result(Outcome.INVALID, "prefill peer: no kv_transfer_params in its answer")
        # The transfer leg and the reference run side by side: the deadline covers both.
        transfer, reference = await asyncio.gather(
            self.local.post_json(PATH, plan.decode(params)),
            self.local.post_json(PATH, plan.local),
        )
        (decoded, failed), (local, local_failed) = transfer, reference
        if failed is not None:
            return result(failed.outcome, f"decode with the transferred KV: {failed.reason}")
        if local_failed is not None:
            return result(local_failed.outcome, f"local reference: {local_failed.reason}")
        got, want = generated(decoded), generated(local)
        if got is None or want is None:
            return result(Outcome.INVALID, "no generated text in an answer")
        if got != want:
            return result(
                Outcome.WRONG,
                f"wrong answer: the transferred KV decodes to {got!r} where a local prefill "
                f"gives {want!r}: corrupted KV",
            )
        return result(Outcome.SUCCESS, "transfer from the prefill peer completed, same answer")
