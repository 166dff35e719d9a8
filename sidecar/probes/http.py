"""The canary over the engine's HTTP API: the request the backend's prober built
(``sidecar/probes/<backend>.py``), sent by the engine client with the whole-answer deadline, its
answer judged by the same prober."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sidecar.core.evidence.result import Result
    from sidecar.probes.base import CanaryPlan, CanaryRequest
    from sidecar.runtime.engine import EngineClient


class HttpCanary:
    def __init__(self, client: EngineClient) -> None:
        self.client = client

    async def __call__(self, plan: CanaryPlan, request: CanaryRequest, model: str | None) -> Result:
        return await self.client.canary(plan, request)
