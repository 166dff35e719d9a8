"""The single writer of health state.

The monitor reports what it observed (:meth:`Health.record_registration`,
:meth:`Health.record_canary`); this class applies the pure transitions of :mod:`sidecar.rules`,
logs one line per change of verdict with its reason, counts it in metrics, and wakes whoever
waits for a change. The HTTP routes only read (:meth:`Health.readiness`,
:meth:`Health.liveness`, :meth:`Health.report`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sidecar.canary import CanaryPlan
from sidecar.config import Settings, StartingStatus
from sidecar.progress import ProgressSample
from sidecar.rules import (
    RULE_TEXT,
    CanaryResult,
    EndpointState,
    Liveness,
    Policy,
    Probe,
    Readiness,
    RegistrationResult,
    decide_liveness,
    decide_readiness,
    endpoint_verdict,
    engine_disagrees,
    on_canary,
    on_progress,
    on_registration,
)

log = logging.getLogger("sidecar.health")


def policy_from(settings: Settings) -> Policy:
    return Policy(
        failure_threshold=settings.failure_threshold,
        success_threshold=settings.success_threshold,
        wait=settings.canary_wait_time,
        retry=settings.retry_interval,
        liveness_window=settings.liveness_window,
        stall_window=settings.effective_stall_window,
    )


@dataclass(frozen=True)
class Listener:
    """Called after every recorded event (metrics use it)."""

    on_canary: Callable[[str, CanaryResult], None]
    on_transition: Callable[[str, str], None]
    on_disagreement: Callable[[str], None]


class Health:
    def __init__(
        self,
        settings: Settings,
        plans: Iterable[CanaryPlan],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.policy = policy_from(settings)
        self.clock = clock
        self.started = clock()
        self.plans = {p.endpoint: p for p in plans}
        self.endpoints: dict[str, EndpointState] = {
            p.endpoint: EndpointState(p.endpoint, p.enabled, p.why) for p in self.plans.values()
        }
        self.models: dict[str, str | None] = {name: settings.model for name in self.plans}
        self.listeners: list[Listener] = []
        self._changed = asyncio.Event()
        self._last_ready: bool | None = None
        self._last_live = True
        self._last_verdicts = {n: endpoint_verdict(s).ready for n, s in self.endpoints.items()}
        self._disagreeing = dict.fromkeys(self.endpoints, False)
        self.draining = False
        self.version = 0  # +1 at every change of state: the /health body cache's key
        self._version_lock = threading.Lock()  # written by the monitor's and the HTTP thread
        self._report_cache: tuple[int, bool, bytes, bytes] | None = None

    # --- writers -------------------------------------------------------------------------------
    def record_registration(self, name: str, result: RegistrationResult) -> None:
        before = self.endpoints[name]
        after = on_registration(before, result)
        if before.registered != after.registered:
            log.info(
                "%s: engine %s (%s)",
                name,
                "registered" if after.registered else "deregistered",
                result.reason,
            )
        self._commit(name, after)

    def record_canary(self, name: str, result: CanaryResult, incarnation: int) -> None:
        for listener in self.listeners:
            listener.on_canary(name, result)
        before = self.endpoints[name]
        after = on_canary(before, result, incarnation, self.policy)
        if after is before:
            log.debug("%s: dropped the result of a canary sent to an older incarnation", name)
            return
        self._commit(name, after)

    def record_progress(self, name: str, sample: ProgressSample | None) -> None:
        before = self.endpoints[name]
        after = on_progress(before, sample, self.policy, time.time())
        if before.stalled != after.stalled:
            log.info(
                "%s: engine %s",
                name,
                "stalled"
                if after.stalled
                else f"no longer stalled ({after.in_flight or 0:g} in flight)",
            )
        if after != before:
            self._commit(name, after)

    def engine_gone(self) -> bool:
        """Every endpoint's last registration check found nothing listening."""
        return all(
            s.registration is not None and s.registration.probe is Probe.REFUSED
            for s in self.endpoints.values()
        )

    def _bump(self) -> None:
        with self._version_lock:
            self.version += 1

    def start_draining(self) -> None:
        if not self.draining:
            self.draining = True
            self._bump()
            self.evaluate()

    def set_model(self, name: str, model: str | None) -> None:
        if self.models[name] != model:
            log.info("%s: served model is %r (from GET /v1/models)", name, model)
            self.models[name] = model
            self._bump()

    def _commit(self, name: str, state: EndpointState) -> None:
        self.endpoints[name] = state
        self._bump()
        verdict = endpoint_verdict(state)
        if verdict.ready != self._last_verdicts[name]:
            self._last_verdicts[name] = verdict.ready
            label = {True: "ready", False: "notready", None: "unknown"}[verdict.ready]
            log.info("%s: endpoint %s: %s", name, label, verdict.reason)
            for listener in self.listeners:
                listener.on_transition(name, label)
        disagrees = engine_disagrees(state)
        if disagrees != self._disagreeing[name]:
            self._disagreeing[name] = disagrees
            if disagrees:
                log.warning("%s: the engine's own health route answers 200 while it is hung", name)
                for listener in self.listeners:
                    listener.on_disagreement(name)
        self.evaluate()
        self._changed.set()
        self._changed = asyncio.Event()

    def evaluate(self) -> None:
        """Log changes of the overall verdicts. Liveness also changes with time alone, so the
        monitor calls this on every tick."""
        readiness = self.readiness()
        if readiness.ready != self._last_ready:
            self._last_ready = readiness.ready
            log.info(
                "worker %s (rule %s): %s",
                "ready" if readiness.ready else "notready",
                readiness.rule,
                readiness.reason,
            )
        liveness = self.liveness()
        if liveness.live != self._last_live:
            self._last_live = liveness.live
            log.warning("worker %s: %s", "live" if liveness.live else "not live", liveness.reason)

    # --- readers -------------------------------------------------------------------------------
    def changed(self) -> asyncio.Event:
        """An event set at the next change of state (take it before reading the state)."""
        return self._changed

    def readiness(self) -> Readiness:
        verdicts = {n: endpoint_verdict(s) for n, s in self.endpoints.items()}
        return decide_readiness(
            verdicts,
            self.settings.use_endpoint_health_status,
            self.settings.starting_health_status,
            draining=self.draining,
        )

    def liveness(self) -> Liveness:
        return decide_liveness(self.endpoints, self.clock(), self.policy.liveness_window)

    def uptime(self) -> dict[str, int]:
        elapsed = max(0.0, self.clock() - self.started)
        secs = int(elapsed)
        return {"secs": secs, "nanos": int((elapsed - secs) * 1e9)}

    def report_json(self) -> tuple[bool, bytes]:
        """The /health body as JSON bytes. Everything but the uptime changes only when the state
        does, so it is serialised once per change: probes cost microseconds."""
        version = self.version
        cached = self._report_cache
        if cached is None or cached[0] != version:
            ready, body = self.report()
            del body["status"], body["uptime"]
            tail = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
            cached = (
                version,
                ready,
                b'"status":"%s",' % (b"ready" if ready else b"notready"),
                tail,
            )
            self._report_cache = cached
        _, ready, status, tail = cached
        uptime = self.uptime()
        head = b'{%s"uptime":{"secs":%d,"nanos":%d},' % (status, uptime["secs"], uptime["nanos"])
        return ready, head + tail[1:]

    def report(self) -> tuple[bool, dict[str, Any]]:
        """The /health body: Dynamo's fields first, then the sidecar's detail."""
        readiness = self.readiness()
        now = self.clock()
        endpoints: dict[str, str] = {}
        checks: dict[str, Any] = {}
        for name, state in self.endpoints.items():
            verdict = endpoint_verdict(state)
            ready = verdict.ready
            if ready is None:
                ready = self.settings.starting_health_status is StartingStatus.READY
            endpoints[name] = "ready" if ready else "notready"
            checks[name] = self._check(state, verdict.reason, now)
        body = {
            "status": "ready" if readiness.ready else "notready",
            "uptime": self.uptime(),
            "endpoints": endpoints,
            "rule": readiness.rule.value,
            "rule_text": RULE_TEXT[readiness.rule],
            "reason": readiness.reason,
            "checks": checks,
        }
        return readiness.ready, body

    def live_report(self) -> tuple[bool, dict[str, Any]]:
        liveness = self.liveness()
        body = {
            "status": "live" if liveness.live else "notlive",
            "uptime": self.uptime(),
            "reason": liveness.reason,
            "window_seconds": self.policy.liveness_window,
        }
        return liveness.live, body

    def _check(self, state: EndpointState, reason: str, now: float) -> dict[str, Any]:
        last = state.last_canary
        reg = state.registration
        return {
            "reason": reason,
            "registered": state.registered,
            "registration": reg.reason if reg else "not checked yet",
            "canary": "enabled" if state.has_canary else "disabled",
            "canary_why": state.canary_why,
            "model": self.models.get(state.name),
            "consecutive_failures": state.consecutive_failures,
            "consecutive_successes": state.consecutive_successes,
            "hard_failure_since": (
                _iso(time.time() - (now - state.hard_failure_since))
                if state.hard_failure_since is not None
                else None
            ),
            "last_canary": None
            if last is None
            else {
                "outcome": last.outcome.value,
                "reason": last.reason,
                "latency_seconds": round(last.latency, 6),
                "time": _iso(last.wall_time),
                "request_id": last.request_id,
            },
            "engine_health_agrees": not engine_disagrees(state),
            "in_flight": state.in_flight,
            "stalled": state.stalled,
            "last_progress_time": (
                _iso(state.last_progress_wall) if state.last_progress_wall is not None else None
            ),
            "last_success_time": (
                _iso(state.last_success_wall) if state.last_success_wall is not None else None
            ),
        }


def _iso(wall: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall)) + f".{int(wall % 1 * 1000):03d}Z"
