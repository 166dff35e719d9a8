"""What every canary probe does, whatever its transport, as blackbox_exporter's probers each send,
judge and stop their own request: send the request the wire's prober built through the
transport's channel with the whole-answer deadline, judge what came back
(:func:`sidecar.probes.judge.judge`), and stop it on the engine if it timed out. A transport adds
only what is its own (HTTP: ``sidecar/transports/http/canary.py``).

A canary that times out must not stay on the engine. What stops it is the backend's (its
prober's, measured on each real engine: docs/concepts/backends.md):

- closing the connection or the stream, which the channel does on the deadline (vLLM aborts the
  request; a Dynamo worker's context is stopped);
- the engine's own abort (``Prober.abort``: SGLang's ``/abort_request`` by ``rid``), sent right
  after the timeout with a short deadline of its own; what it answers is logged, never raised;
- removing what it caused the engine to write, where there is any and the sidecar can reach it
  (an encoder's output for the canary's image: ``Prober.leftovers``, removed by the sweeper,
  ``sidecar/runtime/leftovers.py``): at once when an answer came, else when it appears;
- nothing, where the engine computes an abandoned request and has no abort
  (``Prober.keeps_abandoned``: llama-server frozen whole, SGLang's encoder, Dynamo's encode
  worker): the probe keeps the timed-out canary waiting for its answer and, while it runs, waits
  for it again instead of sending another, so that at most one canary is ever on the engine; its
  answer, when it comes, is swept like any other (Dynamo's encode worker names its file only
  there). Where closing stops it (``Prober.stops_on_close``) and the engine answers otherwise
  again (``answers``: over HTTP its registration route answers, at any status; llama-server then
  cancels the queued task), an answer that still does not come is not coming: the kept canary is
  closed and a fresh one sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from sidecar.core.evidence.result import Outcome, Result
from sidecar.probes.base import CanaryPlan, CanaryRequest
from sidecar.probes.exchange import (
    Channel,
    NoAnswer,
    Received,
    Streamed,
    Sweeper,
    parsed_answer,
)
from sidecar.probes.judge import judge

#: The abort's own deadline: short, since it is sent to an engine that just failed to answer.
ABORT_TIMEOUT = 1.0
#: How long a kept canary may wait on its connection before it is given up for good (then the
#: connection closes and the next canary is a new request).
KEEP_CAP = 300.0


class Canary:
    """One kind's canary probe: its channel, its timeout, what it removes (the sweeper), and the
    canaries it keeps waiting on the engine."""

    def __init__(
        self,
        channel: Channel,
        *,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
        abort_timeout: float = ABORT_TIMEOUT,
        sweeper: Sweeper | None = None,
        holds_on: str = "connection",
        answers: Callable[[float], Awaitable[bool]] | None = None,
    ) -> None:
        """``holds_on``: what a kept canary waits on, in its reason (a connection, a stream, a
        call); ``answers``: whether the engine answers otherwise now, within the seconds given
        (its HTTP side is alive: then closing a kept canary that the engine cancels on close
        stops it, and a fresh one is sent); None: the transport cannot tell."""
        self.channel = channel
        self.holds_on = holds_on
        self.answers = answers
        self.sweeper = sweeper
        self.timeout = timeout
        self.clock = clock
        self.abort_timeout = abort_timeout
        # Per unit (endpoint or rank): the canary still waiting on the engine after its timeout,
        # and its request id.
        self._kept: dict[str, tuple[asyncio.Task[Result], str]] = {}

    async def aclose(self) -> None:
        """Give the canaries still kept on the engine (the one in flight when the sidecar stops
        among them) up to one canary timeout to end, so that what their answers name is
        removed (Dynamo's encode worker writes its file whatever its caller does); then cancel
        the rest, and wait for them to end."""
        tasks = [task for task, _ in self._kept.values()]
        self._kept.clear()
        if tasks:
            await asyncio.wait(tasks, timeout=self.timeout)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __call__(self, plan: CanaryPlan, request: CanaryRequest, model: str | None) -> Result:
        if plan.prober.keeps_abandoned:
            return await self._kept_canary(plan, request)
        return await self._exchange(plan, request, self.timeout)

    async def _exchange(self, plan: CanaryPlan, request: CanaryRequest, deadline: float) -> Result:
        """Send, judge, and stop on the engine: the abort of a timed-out canary, the sweep of
        what it wrote."""
        received = await self.channel.send(request, deadline)
        result = self._judged(plan, request, received)
        if result.outcome is Outcome.TIMEOUT:
            said = await self._abort(plan, request)
            if said:
                result = replace(result, reason=f"{result.reason}; {said}")
        await self._sweep(plan, request, received)
        return result

    def _judged(self, plan: CanaryPlan, request: CanaryRequest, received: Received) -> Result:
        """The judgement, its reason scrubbed of the secrets the channel sends."""
        result = judge(plan, request, received)
        return replace(result, reason=self.channel.redact(result.reason))

    async def _sweep(self, plan: CanaryPlan, request: CanaryRequest, received: Received) -> None:
        """Remove what the canary caused the engine to write: what its answer names, or, with no
        answer, what it may still cause to be written when the engine resumes."""
        if self.sweeper is None:
            return
        no_answer = isinstance(received.answer, NoAnswer)
        names = plan.leftovers(request, parsed_answer(received.answer))
        if names:
            await self.sweeper.remove(names, later=no_answer)

    async def _abort(self, plan: CanaryPlan, request: CanaryRequest) -> str | None:
        """Send the engine's abort of a timed-out canary, where it has one, and say how it went
        (it goes into the canary's reason, so /health and the history show it); never raise."""
        abort = plan.prober.abort(request)
        if abort is None:
            return None
        what = f"{abort.method} {abort.path}"
        try:
            answer = (await self.channel.send(abort, self.abort_timeout)).answer
        except Exception as exc:  # nothing of an abort may reach the monitor
            return f"its abort failed ({what}: {type(exc).__name__}: {exc})"
        if isinstance(answer, NoAnswer):
            return f"its abort failed ({answer.reason})"
        if isinstance(answer, Streamed):  # a call (gRPC): answered with status OK
            return f"stopped on the engine ({what} -> OK)"
        status = getattr(answer, "status", None)
        if status != 200:
            return f"its abort failed ({what} -> {status})"
        return f"stopped on the engine ({what} -> 200)"

    async def _kept_canary(self, plan: CanaryPlan, request: CanaryRequest) -> Result:
        """The canary of an engine that cannot stop an abandoned request: wait for the one still
        on the engine if there is one, else send this one; either way, on the deadline leave it
        waiting on its connection (up to KEEP_CAP) rather than close it."""
        started = self.clock()
        kept = self._kept.get(plan.unit)
        stoppable = plan.prober.stops_on_close
        if kept is not None and not kept[0].done() and stoppable and await self._answering():
            kept[0].cancel()  # closes its connection; the engine, awake, lets it go
            kept = None
        again = kept is not None and not kept[0].done()
        if kept is None or kept[0].done():
            # Nothing on the engine (an earlier kept canary that has its answer now is stale).
            task = asyncio.create_task(self._exchange(plan, request, KEEP_CAP))
            task.add_done_callback(_retrieve)
            kept = self._kept[plan.unit] = (task, request.request_id)
        task, request_id = kept
        left = self.timeout - (self.clock() - started)
        await asyncio.wait({task}, timeout=max(0.0, left))
        if task.done():
            del self._kept[plan.unit]
            result = task.result()
            return replace(result, started=started) if again else result
        which = f"canary {request_id}, sent before this one," if again else "it"
        reason = (
            f"no complete answer within {self.timeout:g} s; {which} stays on its "
            f"{self.holds_on} ({plan.prober.kept_because}): no other is sent until it ends"
        )
        return Result(Outcome.TIMEOUT, reason, started, self.clock(), time.time(), request_id)

    async def _answering(self) -> bool:
        """Whether the engine, with a kept canary on it, answers otherwise now (within a quarter
        of the canary's timeout); a transport that cannot tell says no."""
        if self.answers is None:
            return False
        try:
            return await self.answers(self.timeout / 4)
        except Exception:  # nothing of it may reach the monitor
            return False


def _retrieve(task: asyncio.Task[Result]) -> None:
    if not task.cancelled():
        task.exception()
