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
from typing import Any

from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.jsontext import loads as loads_json
from sidecar.probes.base import CanaryPlan, CanaryRequest
from sidecar.probes.completions import token_completion_body
from sidecar.probes.exchange import Answer, Channel, NoAnswer, error_text

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


async def post_json(channel: Channel, body: dict[str, Any], deadline: float) -> Any:
    """POST a completion body: the parsed JSON of a 200 answer, or why there is none (its
    reason scrubbed of the channel's secrets)."""
    answer = (await channel.send(CanaryRequest("POST", PATH, body, "", None), deadline)).answer
    if isinstance(answer, NoAnswer):
        return NoAnswer(answer.outcome, channel.redact(answer.reason))
    if not isinstance(answer, Answer):
        return NoAnswer(Outcome.INVALID, "not an HTTP answer")
    if answer.status != 200:
        reason = channel.redact(f"HTTP {answer.status}: {error_text(answer.body)}")
        return NoAnswer(Outcome.ERROR, reason)
    try:
        return loads_json(answer.body)
    except ValueError:
        return NoAnswer(Outcome.INVALID, f"body is not valid JSON ({len(answer.body)} bytes)")


class TransferProbe:
    """The probe: a prefill on the peer, the decode here with the KV it returned, and the local
    reference, with the probe's deadline (SIDECAR_KV_PROBE_TIMEOUT) on the whole and on every
    request. Its two channels (the peer's, the local engine's) are closed by their owner."""

    def __init__(
        self,
        peer: Channel,
        local: Channel,
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
        """Nothing of its own to stop: each request ends within the probe."""

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
        answer = await post_json(self.peer, plan.prefill, self.timeout)
        if isinstance(answer, NoAnswer):
            return result(answer.outcome, f"prefill peer: {answer.reason}")
        params = transfer_params(answer)
        if params is None:
            return result(Outcome.INVALID, "prefill peer: no kv_transfer_params in its answer")
        # The transfer leg and the reference run side by side: the deadline covers both.
        decoded, local = await asyncio.gather(
            post_json(self.local, plan.decode(params), self.timeout),
            post_json(self.local, plan.local, self.timeout),
        )
        if isinstance(decoded, NoAnswer):
            return result(decoded.outcome, f"decode with the transferred KV: {decoded.reason}")
        if isinstance(local, NoAnswer):
            return result(local.outcome, f"local reference: {local.reason}")
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
