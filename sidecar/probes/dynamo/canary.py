"""The canary over Dynamo's request plane: the payload the backend's Dynamo prober built
(``sidecar/probes/dynamo/<backend>.py``), sent straight to this pod's worker instance, judged on
the whole stream, and stopped on the worker (``stop_generating``) when its deadline passes."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sidecar.core.evidence.result import Result
    from sidecar.probes.base import CanaryPlan, CanaryRequest
    from sidecar.runtime.requestplane.worker import DynamoWorker


class DynamoCanary:
    def __init__(self, worker: DynamoWorker) -> None:
        self.worker = worker

    async def aclose(self) -> None:
        """Nothing to stop: each canary's context ends with its call (the runtime is closed by
        its owner)."""

    async def __call__(self, plan: CanaryPlan, request: CanaryRequest, model: str | None) -> Result:
        return await self.worker.canary(plan, request)
