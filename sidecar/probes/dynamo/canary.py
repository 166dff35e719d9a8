"""The canary over Dynamo's request plane: send the payload the backend's Dynamo prober built
(``sidecar/probes/dynamo/<backend>.py``) straight to this pod's worker instance, judge the whole
stream (:func:`sidecar.probes.judge.judge`). The channel stops the canary on the worker
(``stop_generating``) the moment its deadline passes, as the HTTP client closes a timed-out
canary's connection: a Dynamo canary's stop is its context, which only the channel holds."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from sidecar.probes.judge import judge

if TYPE_CHECKING:
    from sidecar.core.evidence.result import Result
    from sidecar.probes.base import CanaryPlan, CanaryRequest
    from sidecar.probes.exchange import Channel


class DynamoCanary:
    def __init__(self, channel: Channel, *, timeout: float) -> None:
        self.channel = channel
        self.timeout = timeout

    async def aclose(self) -> None:
        """Nothing to stop: each canary's context ends with its call (the runtime is closed by
        its owner)."""

    async def __call__(self, plan: CanaryPlan, request: CanaryRequest, model: str | None) -> Result:
        result = judge(plan, request, await self.channel.send(request, self.timeout))
        return replace(result, reason=self.channel.redact(result.reason))
