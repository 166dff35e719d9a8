"""The canary over the engine's HTTP API, as blackbox_exporter's ``ProbeHTTP`` reads: the common
probe (:mod:`sidecar.probes.canary`: send, judge, stop) through the engine client, which closes
a timed-out canary's connection on its deadline.

What is HTTP's own: a kept canary (``Prober.keeps_abandoned``) of an engine that cancels it when
its connection closes (``Prober.stops_on_close``: llama-server) is closed once the engine's
registration route answers again (any status, within a quarter of the canary's timeout): its HTTP
side is alive then, and an answer that still does not come is not coming.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sidecar.probes.base import CanaryPlan, CanaryRequest
from sidecar.probes.canary import Canary
from sidecar.probes.exchange import Channel, NoAnswer, Sweeper


class HttpCanary(Canary):
    def __init__(
        self,
        channel: Channel,
        *,
        timeout: float,
        answers: str,
        clock: Callable[[], float] = time.monotonic,
        sweeper: Sweeper | None = None,
    ) -> None:
        """``answers``: the route whose answer shows the engine's HTTP side is alive (its
        registration route)."""
        super().__init__(channel, timeout=timeout, clock=clock, sweeper=sweeper)
        self.answers_path = answers

    async def _answers(self, plan: CanaryPlan) -> bool:
        probe = CanaryRequest("GET", self.answers_path, {}, "", None)
        try:
            received = await self.channel.send(probe, self.timeout / 4)
        except Exception:  # nothing of it may reach the monitor
            return False
        return not isinstance(received.answer, NoAnswer)
