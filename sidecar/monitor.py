"""The scheduler: per endpoint, a registration loop and a canary loop, owned by one TaskGroup.

The registration loop checks the engine's own health route every SIDECAR_REGISTRATION_INTERVAL
(and learns the served model when the canary needs it). The canary loop sends one canary when
the state says one is due (``EndpointState.next_canary_due``), waits for its whole answer, records
it, and only then looks at the next: never more than one canary in flight per endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

from sidecar.canary import CanaryPlan
from sidecar.engine import EngineClient
from sidecar.progress import MetricsUnreadable, ProgressSpec, read_progress
from sidecar.rules import Probe, RegistrationResult, canary_due
from sidecar.state import Health

log = logging.getLogger("sidecar.monitor")


async def wait_event(event: asyncio.Event, seconds: float | None) -> None:
    """Wait until the event is set or the seconds have passed (None: no limit)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()


class Monitor:
    def __init__(
        self,
        health: Health,
        client: EngineClient,
        registration_path: str,
        registration_interval: float,
        progress: ProgressSpec | None = None,
        metrics_interval: float = 1.0,
    ) -> None:
        self.health = health
        self.client = client
        self.registration_path = registration_path
        self.registration_interval = registration_interval
        self.progress = progress
        self.metrics_interval = metrics_interval

    async def run(self) -> None:
        """Run until cancelled. An unexpected error in any loop propagates (and stops the rest)."""
        async with asyncio.TaskGroup() as group:
            for name, plan in self.health.plans.items():
                group.create_task(self._registration_loop(name, plan), name=f"registration:{name}")
                if plan.enabled:
                    group.create_task(self._canary_loop(name, plan), name=f"canary:{name}")
                if self.progress is not None:
                    group.create_task(
                        self._progress_loop(name, self.progress), name=f"progress:{name}"
                    )

    def _needs_discovery(self, name: str, plan: CanaryPlan) -> bool:
        return (
            plan.enabled
            and plan.override is None
            and plan.prober.needs_model
            and self.health.settings.model is None
        )

    async def _registration_loop(self, name: str, plan: CanaryPlan) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            result = await self.client.registration(self.registration_path)
            if result.registered and self._needs_discovery(name, plan):
                was_registered = self.health.endpoints[name].registered
                if not was_registered or self.health.models[name] is None:
                    model, why = await self.client.served_model()
                    if model is None:
                        result = RegistrationResult(
                            Probe.STATUS, f"model not known: {why}", result.started, result.finished
                        )
                    self.health.set_model(name, model)
            self.health.record_registration(name, result)
            self.health.evaluate()
            await asyncio.sleep(max(0.0, started + self.registration_interval - loop.time()))

    async def _canary_loop(self, name: str, plan: CanaryPlan) -> None:
        while True:
            changed = self.health.changed()
            state = self.health.endpoints[name]
            due = canary_due(state)
            if due is None:
                await wait_event(changed, None)
                continue
            delay = due - self.health.clock()
            if delay > 0:
                await wait_event(changed, delay)
                continue
            request = plan.request(self.health.models[name], f"canary-{uuid.uuid4()}")
            log.debug("%s: sending canary %s", name, request.request_id)
            result = await self.client.canary(plan, request)
            self.health.record_canary(name, result, state.incarnation)

    async def _progress_loop(self, name: str, spec: ProgressSpec) -> None:
        loop = asyncio.get_running_loop()
        unreadable: str | None = None
        while True:
            started = loop.time()
            text, why = await self.client.metrics_text(spec.path)
            sample = None
            if text is not None:
                try:
                    sample = read_progress(text, spec, self.health.clock())
                except MetricsUnreadable as exc:
                    why = f"GET {spec.path}: {exc}"
                else:
                    if sample.in_flight is None and sample.counters is None:
                        why = f"GET {spec.path}: none of the backend's progress metrics"
                        sample = None
            if (sample is None) != (unreadable is not None):
                if sample is None:
                    log.info(
                        "%s: engine progress unknown (%s); the canary alone decides", name, why
                    )
                else:
                    log.info("%s: reading engine progress from %s", name, spec.path)
                unreadable = why if sample is None else None
            self.health.record_progress(name, sample)
            await asyncio.sleep(max(0.0, started + self.metrics_interval - loop.time()))
