"""The JSON bodies of /health, /live and /sidecar/live, each built from one snapshot.

Dynamo's fields come first (status, uptime, endpoints); then which rule decided and why, and per
endpoint what each evidence source knows.
"""

from __future__ import annotations

import time
from typing import Any

from sidecar.core.endpoint import EndpointState, parked, suspected
from sidecar.core.evidence.lifecycle import Maintenance
from sidecar.core.evidence.transfers import WINDOW
from sidecar.core.snapshot import Snapshot, liveness_of, readiness_of
from sidecar.core.verdict import (
    HEARTBEAT_STALE,
    RULE_TEXT,
    StartingStatus,
    engine_disagrees,
    engine_undersells,
)


def iso(wall: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall)) + f".{int(wall % 1 * 1000):03d}Z"


def _wall(monotonic: float | None, now: float) -> str | None:
    return None if monotonic is None else iso(time.time() - (now - monotonic))


def uptime(started: float, now: float) -> dict[str, int]:
    elapsed = max(0.0, now - started)
    secs = int(elapsed)
    return {"secs": secs, "nanos": int((elapsed - secs) * 1e9)}


def _progress(ep: EndpointState, snap: Snapshot, now: float) -> dict[str, Any]:
    progress = ep.progress
    latest = progress.latest
    return {
        "readable": progress.readable,
        "detail": progress.why,
        "in_flight": progress.in_flight,
        "quiet_seconds": round(progress.quiet_for(now), 3) if progress.busy else None,
        "stall_suspected": suspected(ep, snap.policy, now),
        "waiting_outside_engine": parked(ep, snap.policy, now),
        "waiting_for_kv_transfer": latest.peer_wait if latest is not None else None,
    }


def maintenance_body(window: Maintenance | None, now: float) -> dict[str, Any] | None:
    """A maintenance window as /health and the control route show it."""
    if window is None:
        return None
    return {
        "reason": window.reason,
        "since": iso(window.since_wall),
        "ends_in_seconds": round(max(0.0, window.until - now), 3),
    }


def _lifecycle(ep: EndpointState, now: float) -> dict[str, Any]:
    state = ep.lifecycle
    return {
        "paused": state.paused,
        "sleeping": state.sleeping,
        "sleep_detail": state.sleep_why if state.sleeping else None,
        "maintenance": maintenance_body(state.maintenance, now),
    }


def _transfers(ep: EndpointState, now: float) -> dict[str, Any] | None:
    state = ep.transfers
    if state.latest is None:
        return None  # not published (not a decode worker, or no KV connector)
    return {
        "failing": state.failing(now),
        "failures_in_window": state.in_window(now),
        "window_seconds": WINDOW,
        "failures_counted": dict(state.counted),
        "last_failure_time": iso(state.last_failure_wall) if state.last_failure_wall else None,
        "fetching": state.latest.fetching,
    }


def _fault_tolerance(ep: EndpointState, now: float) -> dict[str, Any] | None:
    state = ep.faults
    if state.report is None:
        return None  # not served (no --enable-fault-tolerance), or not asked yet
    return {
        "engine": state.rank,
        "state": state.report.state,
        "detail": state.report.detail or None,
        "unhealthy_since": _wall(state.since, now),
    }


def _discovery(ep: EndpointState, now: float) -> dict[str, Any] | None:
    state = ep.discovery
    if state.instance is None:
        return None  # not a Dynamo worker, or its instance is not known yet
    return {
        "instance": state.instance,
        "listed": state.listed,
        "where": state.where or None,
        "missing_since": _wall(state.missing_since, now),
        "detail": state.reason() or None,
    }


def _engine_health(ep: EndpointState) -> dict[str, Any] | None:
    state = ep.engine_health
    if not state.asked:
        return None  # the registration check is the engine's health route
    return {
        "ready": state.ready,
        "status_code": state.status_code,
        "status": state.status,
        "detail": state.detail,
    }


def _engine_load(ep: EndpointState) -> dict[str, Any] | None:
    """The engine's own load report, where it gives one (OpenEngine's GetLoad)."""
    load = ep.load
    if load.latest is None and not load.stale:
        return None
    latest = load.latest
    return {
        "running": latest.running if latest else None,
        "queued": latest.queued if latest else None,
        "stale": load.stale,
        "detail": load.why,
    }


def _check(ep: EndpointState, snap: Snapshot, now: float) -> dict[str, Any]:
    canary, registration, progress = ep.canary, ep.registration, ep.progress
    last = canary.last
    return {
        "reason": snap.verdicts[ep.name].reason,
        "registered": bool(registration.registered),
        "registration": registration.reason,
        "canary": "enabled" if ep.has_canary else "disabled",
        "canary_why": ep.canary_why,
        "model": snap.models.get(ep.name),
        "consecutive_failures": canary.failures,
        "hang_confirmed": canary.confirmed,
        "consecutive_successes": canary.successes,
        "hard_failure_since": _wall(canary.hard_since, now),
        "stalled": canary.stalled,
        "last_canary": None
        if last is None
        else {
            "outcome": last.outcome.value,
            "reason": last.reason,
            "latency_seconds": round(last.latency, 6),
            "time": iso(last.wall_time),
            "request_id": last.request_id,
        },
        "engine_health_agrees": not (engine_disagrees(ep) or engine_undersells(ep)),
        "engine_health": _engine_health(ep),
        "engine_load": _engine_load(ep),
        "discovery": _discovery(ep, now),
        "in_flight": progress.in_flight,
        "progress": _progress(ep, snap, now),
        "lifecycle": _lifecycle(ep, now),
        "kv_transfers": _transfers(ep, now),
        "fault_tolerance": _fault_tolerance(ep, now),
        "last_progress_time": (
            iso(progress.last_advance_wall) if progress.last_advance_wall is not None else None
        ),
        "last_success_time": (
            iso(canary.last_success_wall) if canary.last_success_wall is not None else None
        ),
    }


def health_body(snap: Snapshot, started: float, now: float) -> tuple[bool, dict[str, Any]]:
    readiness = readiness_of(snap, now)
    endpoints = {}
    for name, verdict in snap.endpoint_verdicts.items():
        ready = verdict.ready
        if ready is None:
            ready = snap.starting is StartingStatus.READY
        endpoints[name] = "ready" if ready else "notready"
    body: dict[str, Any] = {
        "status": "ready" if readiness.ready else "notready",
        "uptime": uptime(started, now),
        "endpoints": endpoints,
        "rule": readiness.rule.value,
        "rule_text": RULE_TEXT[readiness.rule],
        "reason": readiness.reason,
        "checks": {name: _check(ep, snap, now) for name, ep in snap.endpoints.items()},
    }
    ranked = [e for e in snap.units if snap.ranked(e)]
    if ranked:
        body["ranks"] = {e: _ranks(snap, e) for e in ranked}
    return readiness.ready, body


def _ranks(snap: Snapshot, endpoint: str) -> dict[str, Any]:
    """One endpoint's data-parallel ranks: how many, which are ready, what the policy needs."""
    units = snap.units[endpoint]
    verdict = snap.endpoint_verdicts[endpoint]
    return {
        "count": len(units),
        "required": len(units) if snap.min_ready is None else min(snap.min_ready, len(units)),
        "ready": [u for u in units if snap.verdicts[u].ready],
        "notready": [u for u in units if snap.verdicts[u].ready is False],
        "degraded": verdict.degraded,
        "reason": verdict.reason,
    }


def live_body(snap: Snapshot, started: float, now: float) -> tuple[bool, dict[str, Any]]:
    liveness = liveness_of(snap, now)
    return liveness.live, {
        "status": "live" if liveness.live else "notlive",
        "uptime": uptime(started, now),
        "reason": liveness.reason,
        "cause": liveness.cause.value if liveness.cause else None,
        "window_seconds": snap.policy.liveness_window,
    }


def sidecar_body(snap: Snapshot, started: float, now: float) -> tuple[bool, dict[str, Any]]:
    """The sidecar's own liveness: its monitor thread still runs."""
    silent = now - snap.heartbeat
    ok = silent <= HEARTBEAT_STALE
    return ok, {
        "status": "live" if ok else "notlive",
        "uptime": uptime(started, now),
        "monitor_heartbeat_age_seconds": round(silent, 3),
        "stale_after_seconds": HEARTBEAT_STALE,
        "reason": "the monitor runs"
        if ok
        else f"the monitor has not run for {silent:.1f} s: restart the sidecar",
    }
