"""What the sidecar asks of an OpenEngine server's ``Control`` service beside the canary: its
health (the registration check), its own inference probe (the engine's opinion, shown, never the
verdict), the served model, and its load (a hint).

Registration, each interval: ``Health{include_inference_probe: false, role}`` within the check's
deadline.

=====================  ==========  ==========================================================
the engine's answer    outcome     so
=====================  ==========  ==========================================================
READY, DEGRADED        success     registered (DEGRADED: a check is degraded; the canary decides)
STARTING               error       loading: deregistered, no clock
NOT_READY              error       not serving; after READY it starts the liveness clock of an
                                   engine that says it cannot serve (TensorRT-LLM: its model
                                   check failed)
UNAVAILABLE            refused     nothing accepts connections (TensorRT-LLM opens its port only
                                   once the model is loaded)
DEADLINE_EXCEEDED      timeout     no answer within the deadline
=====================  ==========  ==========================================================

The engine's own probe (``include_inference_probe: true``: one token, its own 30 s timeout,
shared by concurrent callers) runs at most once per liveness window, in a task of its own that
the check owns, so that a probe that takes its 30 s never delays a registration check; its
latest answer goes with each check as the engine's opinion (READY: ready; DEGRADED, or no
answer: not). It knows neither the worker's role (it is always an aggregated request) nor a
threshold, and it cannot tell busy from hung: shown beside the verdict, never instead of it.

The served model: ``GetModelInfo`` once registered, until it names one (``model`` is required
in every ``Generate``).

Load, each metrics interval: ``GetLoad`` as a tiny exposition the monitor reads like any engine's
metrics: ``openengine:running_requests`` and ``openengine:queued_requests`` (what the server
fills), and ``openengine:load_stale`` 1 when it answers UNAVAILABLE because its scheduler's
sample is stale while requests are active (TensorRT-LLM: over 30 s old): the engine's own stall
hint, which a canary confirms.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any

from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.vocabulary import Mode
from sidecar.probes.base import CanaryRequest
from sidecar.probes.exchange import Channel, Checked, EngineHealth, NoAnswer, Received, Streamed
from sidecar.transports.openengine.prober import CONTROL

HEALTH = f"/{CONTROL}/Health"
GET_LOAD = f"/{CONTROL}/GetLoad"
GET_MODEL_INFO = f"/{CONTROL}/GetModelInfo"
READY, DEGRADED = "HEALTH_STATE_READY", "HEALTH_STATE_DEGRADED"
STARTING, NOT_READY = "HEALTH_STATE_STARTING", "HEALTH_STATE_NOT_READY"
#: The engine's own probe has a 30 s timeout of its own (TensorRT-LLM); its call gets 5 s more.
PROBE_DEADLINE = 35.0
ROLES = {
    Mode.AGGREGATED: "ENGINE_ROLE_AGGREGATED",
    Mode.PREFILL: "ENGINE_ROLE_PREFILL",
    Mode.DECODE: "ENGINE_ROLE_DECODE",
}
# The exposition's series (sidecar/transports/openengine/__init__.py reads them as a LoadSpec).
RUNNING, QUEUED, STALE = (
    "openengine:running_requests",
    "openengine:queued_requests",
    "openengine:load_stale",
)


def _one(got: Received) -> Mapping[str, Any] | NoAnswer:
    """A unary call's one message, or why there is none."""
    answer = got.answer
    if isinstance(answer, NoAnswer):
        return answer
    assert isinstance(answer, Streamed)
    return answer.chunks[0] if answer.chunks else {}


def _checks(message: Mapping[str, Any], *, not_ready_only: bool = True) -> str:
    """The checks' names, states and messages, the ones not READY (or all)."""
    said = []
    for check in message.get("checks") or ():
        state = str(check.get("state", "HEALTH_STATE_UNSPECIFIED")).removeprefix("HEALTH_STATE_")
        if not_ready_only and state == "READY":
            continue
        text = f"{check.get('name', '?')} {state}"
        said.append(f"{text}: {check['message']}" if check.get("message") else text)
    return "; ".join(said)


class OpenEngineHealth:
    """The registration check (:class:`~sidecar.probes.exchange.Registration`) over the
    engine's ``Control`` service; the channel is the transport's (closed by its owner)."""

    def __init__(
        self,
        engine: Channel,
        *,
        role: Mode,
        timeout: float,
        probe_every: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.role = ROLES.get(role, "ENGINE_ROLE_UNSPECIFIED")
        self.timeout = timeout
        self.probe_every = probe_every
        self.clock = clock
        self.model: str | None = None
        self._probe: asyncio.Task[EngineHealth] | None = None
        self._probe_started: float | None = None
        self._opinion: EngineHealth | None = None

    async def _call(self, path: str, body: dict[str, Any], deadline: float) -> Received:
        return await self.engine.send(CanaryRequest("gRPC", path, body, "", None), deadline)

    async def __call__(self) -> Checked:
        started = self.clock()
        got = _one(await self._call(HEALTH, {"role": self.role}, self.timeout))

        def result(outcome: Outcome, reason: str, *, not_serving: bool = False) -> Result:
            return Result(
                outcome, reason, started, self.clock(), time.time(), not_serving=not_serving
            )

        if isinstance(got, NoAnswer):
            return Checked(result(got.outcome, got.reason), self._opinion)
        state = str(got.get("state", "HEALTH_STATE_UNSPECIFIED"))
        shown = state.removeprefix("HEALTH_STATE_")
        checks = _checks(got)
        said = f"{HEALTH} -> {shown}" + (f" ({checks})" if checks else "")
        if state in (READY, DEGRADED):
            registered = result(Outcome.SUCCESS, said)
        elif state == STARTING:
            registered = result(Outcome.ERROR, f"{said}: loading")
        else:
            registered = result(Outcome.ERROR, said, not_serving=state == NOT_READY)
        model = await self._served_model() if registered.ok else None
        if registered.ok:
            self._maybe_probe()
        return Checked(registered, self._opinion, model=model)

    async def _served_model(self) -> tuple[str | None, str] | None:
        """The served model from GetModelInfo, until it names one."""
        if self.model is not None:
            return self.model, f"{GET_MODEL_INFO} names it"
        got = _one(await self._call(GET_MODEL_INFO, {}, self.timeout))
        if isinstance(got, NoAnswer):
            return None, got.reason
        name = got.get("served_model_name") or got.get("model_id")
        if not isinstance(name, str) or not name:
            return None, f"{GET_MODEL_INFO}: no model name in the answer"
        self.model = name
        return name, f"{GET_MODEL_INFO} names it"

    def _maybe_probe(self) -> None:
        """Start the engine's own inference probe when one is due (at most once per
        ``probe_every``, never two at once); take the opinion of one that ended."""
        if self._probe is not None and self._probe.done():
            if not self._probe.cancelled():
                self._opinion = self._probe.result()
            self._probe = None
        now = self.clock()
        due = self._probe_started is None or now - self._probe_started >= self.probe_every
        if self._probe is None and due:
            self._probe_started = now
            self._probe = asyncio.create_task(self._inference_probe(), name="openengine-probe")

    async def _inference_probe(self) -> EngineHealth:
        body = {"include_inference_probe": True, "role": self.role}
        got = _one(await self._call(HEALTH, body, PROBE_DEADLINE))
        if isinstance(got, NoAnswer):
            return EngineHealth(None, None, f"its own inference probe: {got.reason}")
        probe = next(
            (c for c in got.get("checks") or () if c.get("name") == "inference_probe"), None
        )
        if probe is None:
            return EngineHealth(None, None, "its own inference probe: no inference_probe check")
        state = str(probe.get("state", "HEALTH_STATE_UNSPECIFIED")).removeprefix("HEALTH_STATE_")
        message = f": {probe['message']}" if probe.get("message") else ""
        return EngineHealth(state == "READY", state, f"its own inference probe {state}{message}")

    async def aclose(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
            self._probe = None


class OpenEngineLoad:
    """``GetLoad`` as the engine's metrics (:class:`~sidecar.probes.exchange.MetricsSource`)."""

    def __init__(self, engine: Channel, *, timeout: float) -> None:
        self.engine = engine
        self.timeout = timeout

    async def metrics_text(self, path: str) -> tuple[str | None, str]:
        request = CanaryRequest("gRPC", GET_LOAD, {}, "", None)
        got = _one(await self.engine.send(request, self.timeout))
        if isinstance(got, NoAnswer):
            if got.status == "UNAVAILABLE" and "stale" in got.reason.lower():
                return f"{STALE} 1\n", got.reason
            return None, got.reason
        lines = [f"{STALE} 0"]
        for name, field in ((RUNNING, "running_requests"), (QUEUED, "queued_requests")):
            if field in got:
                lines.append(f"{name} {int(got[field])}")
        return "\n".join(lines) + "\n", f"{GET_LOAD} -> OK"
