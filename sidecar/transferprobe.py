"""The transfer probe's I/O: a prefill on the peer, the decode here with the KV it returned,
and a local reference (the bodies and what they mean: ``sidecar/canary/transfer.py``).

Its own two clients, with the probe's deadline (SIDECAR_KV_PROBE_TIMEOUT) on every request and
on the whole: one for the peer (SIDECAR_KV_PEER_URL), one for the local engine. The result is a
:class:`~sidecar.evidence.result.Result` like a canary's, for the ``kv_transfer`` endpoint.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Callable

from sidecar.canary.transfer import PATH, bodies, generated, transfer_params
from sidecar.engine import EngineClient
from sidecar.evidence.result import Outcome, Result


class TransferProbe:
    def __init__(
        self,
        peer_url: str,
        engine_url: str,
        *,
        timeout: float,
        prompt_tokens: int,
        max_bytes: int,
        api_key: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout = timeout
        self.prompt_tokens = prompt_tokens
        self.clock = clock
        self.peer = EngineClient(
            peer_url, timeout=timeout, max_bytes=max_bytes, api_key=api_key, clock=clock
        )
        self.local = EngineClient(
            engine_url, timeout=timeout, max_bytes=max_bytes, api_key=api_key, clock=clock
        )
        self._nonce = itertools.count(int(time.time()))

    async def aclose(self) -> None:
        await self.peer.aclose()
        await self.local.aclose()

    async def run(self, model: str | None) -> Result:
        started = self.clock()
        request_id = f"kv-probe-{uuid.uuid4()}"

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
