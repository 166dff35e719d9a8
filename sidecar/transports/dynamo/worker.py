"""This pod's Dynamo worker: found on its system server, canaried over the request plane.

One check (every SIDECAR_REGISTRATION_INTERVAL) asks the worker's system server, at
SIDECAR_ENGINE_URL, three things, each for its own evidence source:

- registration: which instance of the canaried endpoint the worker serves (its metrics' labels;
  under Kubernetes discovery its /metadata, which also carries the record to reach it by). None
  yet, while the worker loads; several, when SIDECAR_DYNAMO_ENDPOINT must say which;
- the engine's own health: what the worker's /health answers, shown beside the verdict;
- discovery: whether the discovery the router uses lists that instance (not asked under
  Kubernetes, see :mod:`sidecar.core.evidence.discovery`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sidecar.core.evidence.progress import MetricsUnreadable
from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.jsontext import loads as loads_json
from sidecar.core.vocabulary import GENERATE
from sidecar.probes.base import CanaryRequest
from sidecar.probes.exchange import (
    Answer,
    Checked,
    EngineHealth,
    Listed,
    NoAnswer,
    Received,
    error_text,
)
from sidecar.runtime.engine import EngineClient
from sidecar.transports.dynamo.client import RequestPlane
from sidecar.transports.dynamo.identity import (
    Instance,
    instances_in_metadata,
    instances_in_metrics,
    pick,
)

log = logging.getLogger("sidecar.requestplane")
METADATA_PATH = "/metadata"


def _engine_health(path: str, answer: Answer | NoAnswer) -> EngineHealth:
    if isinstance(answer, NoAnswer):
        return EngineHealth(None, None, answer.reason)
    try:
        status = loads_json(answer.body).get("status")
    except (ValueError, AttributeError):
        status = None
    status = status if isinstance(status, str) else None
    shown = f" ({status})" if status else f": {error_text(answer.body)}"
    detail = f"GET {path} -> {answer.status}{shown}"
    return EngineHealth(answer.status == 200, status, detail, code=answer.status)


class DynamoWorker:
    def __init__(
        self,
        endpoint: str | None,
        http: EngineClient,
        plane: RequestPlane,
        *,
        health_path: str,
        metrics_path: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.want = endpoint or GENERATE
        self.http = http
        self.plane = plane
        self.health_path = health_path
        self.metrics_path = metrics_path
        self.clock = clock
        self.instance: Instance | None = None
        self._said: str | None = None  # the last ambiguity logged

    def _result(
        self, started: float, outcome: Outcome, reason: str, identity: str | None = None
    ) -> Result:
        return Result(outcome, reason, started, self.clock(), time.time(), identity=identity)

    async def _identify(self) -> tuple[Instance | None, Outcome, str]:
        """The instance the system server names, or None with the outcome and reason why not."""
        path = METADATA_PATH if self.plane.local else self.metrics_path
        answer = await self.http.get(path)
        if isinstance(answer, NoAnswer):
            return None, answer.outcome, answer.reason
        if answer.status != 200:
            hint = ""
            if self.plane.local and answer.status == 404:
                hint = " (does the worker run with DYN_DISCOVERY_BACKEND=kubernetes?)"
            return None, Outcome.ERROR, f"GET {path} -> {answer.status}{hint}"
        try:
            if self.plane.local:
                found = instances_in_metadata(loads_json(answer.body), self.want)
            else:
                found = instances_in_metrics(answer.body.decode("utf-8", "replace"), self.want)
        except (ValueError, MetricsUnreadable) as exc:
            return None, Outcome.ERROR, f"GET {path}: {exc}"
        instance, why = pick(found, self.want, f"GET {path}")
        if instance is None and len(found) > 1 and why != self._said:
            log.error("%s", why)  # it will not resolve by itself
        self._said = why if instance is None else None
        return instance, Outcome.SUCCESS if instance else Outcome.ERROR, why

    async def __call__(self) -> Checked:
        """The registration check (:class:`~sidecar.probes.exchange.Registration`): the instance,
        the worker's own /health beside it, and whether discovery lists the instance."""
        started = self.clock()
        instance, outcome, why = await self._identify()
        health = _engine_health(self.health_path, await self.http.get(self.health_path))
        listed: bool | None = None
        if instance is not None:
            try:
                if self.plane.local:
                    if not await self.plane.advertise(instance):
                        outcome, why = Outcome.ERROR, f"{instance}: not listed from its record"
                else:
                    listed = await self.plane.listed(instance)
            except Exception as exc:  # the runtime raises plain Exceptions; none may escape
                detail = "timed out" if isinstance(exc, TimeoutError) else str(exc)
                if self.plane.local:
                    outcome = Outcome.ERROR
                    why = f"{instance}: the sidecar's own record of it is not listed: {detail}"
                else:
                    log.debug("discovery not asked about %s: %s", instance, detail)
        if outcome is Outcome.TIMEOUT:
            # Slow or frozen: the canary, to the instance known so far, finds out.
            instance = self.instance
        else:
            self.instance = instance if outcome is Outcome.SUCCESS else None
        identity = str(instance) if instance is not None else None
        registration = self._result(started, outcome, why, identity)
        return Checked(registration, health, Listed(listed, identity, self.plane.where))

    async def aclose(self) -> None:
        """Nothing of its own: the plane and the client are the wiring's."""

    async def send(self, request: CanaryRequest, deadline: float) -> Received:
        """The canary's channel (:class:`sidecar.probes.exchange.Channel`): to the instance the
        last check found, over the request plane."""
        instance = self.instance
        if instance is None:
            started = self.clock()
            why = NoAnswer(Outcome.REFUSED, "no instance of the worker is known")
            return Received(why, started, self.clock(), time.time())
        return await self.plane.send(request, instance, deadline)

    def redact(self, text: str) -> str:
        return self.http.redact(text)
