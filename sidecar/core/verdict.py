"""Why did /health or /live say what it said? Everything is decided here, from the evidence
sources' states, by pure functions.

One endpoint's verdict (:func:`endpoint_verdict`), as a table:

=================  ======================  =========  ==========================================
registration       canary                  verdict    reason
=================  ======================  =========  ==========================================
not checked yet    any                     none       not checked yet
any                in maintenance          notready   maintenance: <why> (ends in N s)
not registered     any                     notready   engine not registered: <its answer>
not discoverable   any                     notready   not discoverable: <instance> is gone from
                                                      <discovery> ... (Dynamo workers)
registered         engine asleep           notready   sleeping (<what the engine said>)
registered         engine reports a fault  notready   vLLM fault tolerance: engine <rank>
                   or recovers                        reports <its state> ... (unhealthy, dead,
                                                      recovering, paused; with its fault_info)
registered         none for this role      ready      registered; no canary (<why>)
registered         no result yet           none       registered; waiting for the first canary
registered         ready                   ready      canary passed ... (+ what the metrics say)
registered         notready                notready   the canary's reason ("stalled: ...",
                                                      "canary timeout: ..."), + "the engine's own
                                                      health route still answers 200" when so
=================  ======================  =========  ==========================================

Failing KV transfers from prefill peers (:mod:`sidecar.core.evidence.transfers`) add a note to the
reason of a registered endpoint and change nothing else. Maintenance and sleep come from the
lifecycle source (:mod:`sidecar.core.evidence.lifecycle`); while either holds no canary is sent. An
endpoint split into data-parallel ranks is decided by :func:`rank_verdict`. "none" counts as
DYN_SYSTEM_STARTING_HEALTH_STATUS says. The engine's metrics never appear in the verdict column:
they only shape the canary's schedule and how a timeout is counted.

The worker's readiness (:func:`decide_readiness`): every counted endpoint ready (those listed in
DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS, or all), and not draining.

Liveness (:func:`decide_liveness`): live unless one of the liveness clocks (:class:`Cause`, each
with what starts and ends it) has run for the whole liveness window, each started and ended by
its own source only.

An endpoint fails liveness when its first clock reaches the window; the cause named is that
clock's, or "not discoverable" whenever that one runs (no canary reaches an orphan).

A refused connection or any other non-200 health answer stops every clock: a loading, draining or
gone engine is never restarted by this sidecar; nor is a paused one (asleep, or in maintenance).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from sidecar.core.endpoint import EndpointState, parked
from sidecar.core.evidence.policy import Policy
from sidecar.core.vocabulary import Cause, StartingStatus


@dataclass(frozen=True)
class Verdict:
    ready: bool | None  # None: no verdict yet
    reason: str
    degraded: bool = False  # ready with a data-parallel rank down, as the policy allows


def engine_says_ready(ep: EndpointState) -> bool | None:
    """What the engine's own health route says: a Dynamo worker's /health where it is asked
    apart from registration, else the registration check's answer (vLLM's /health)."""
    if ep.engine_health.asked:
        return ep.engine_health.says_ready
    return ep.registration.answers_200


def engine_disagrees(ep: EndpointState) -> bool:
    """The engine's own health route answers 200 while the canary finds it hung or failing
    hard: the blind spot of vLLM's and TensorRT-LLM's /health."""
    canary = ep.canary
    return (
        ep.has_canary
        and ep.liveness
        and engine_says_ready(ep) is True
        and canary.ready is False
        and canary.hard_since is not None
    )


def engine_undersells(ep: EndpointState) -> bool:
    """The engine's own health route answers non-200 while the canary passes: a Dynamo worker
    that registers no canary payload says 503 for its whole life (the second seed's bug)."""
    return (
        ep.has_canary
        and ep.engine_health.asked
        and ep.engine_health.says_ready is False
        and bool(ep.registration.registered)
        and ep.discovery.listed is not False
        and ep.canary.ready is True
    )


DISAGREES = "; the engine's own health route still answers 200"


def _disagreement(ep: EndpointState) -> str:
    """What says 200 about an engine the canary finds hung: its own health route (vLLM's
    /health, a Dynamo worker's), or the cheap route that registers it (SGLang's /v1/models:
    its /health runs a generation, and says 503 only after 20 s)."""
    if not engine_disagrees(ep):
        return ""
    last = ep.registration.last
    if ep.engine_health.asked or last is None or last.reason.startswith("GET /health "):
        return DISAGREES
    return f"; the engine still answers its registration check ({last.reason})"


def _progress_note(ep: EndpointState, policy: Policy, now: float) -> str:
    progress = ep.progress
    if not parked(ep, policy, now):
        return ""
    note = (
        f"; {progress.in_flight or 0:g} requests in flight without progress for "
        f"{progress.quiet_for(now):.0f} s while the canary passes: they wait on something "
        "outside the engine"
    )
    peer = progress.latest.peer_wait if progress.latest else None
    if peer:
        note += f" ({peer:g} waiting for a KV transfer from a prefill peer)"
    return note


def endpoint_verdict(ep: EndpointState, policy: Policy, now: float) -> Verdict:
    registration, canary = ep.registration, ep.canary
    if registration.registered is None:
        return Verdict(None, "not checked yet")
    if ep.lifecycle.maintenance is not None:
        return Verdict(False, ep.lifecycle.reason(now) or "maintenance")
    if not registration.registered:
        return Verdict(False, f"engine not registered: {registration.reason}")
    if ep.discovery.listed is False:
        return Verdict(False, ep.discovery.reason())
    if ep.lifecycle.sleeping:
        return Verdict(False, ep.lifecycle.reason(now) or "sleeping")
    if not ep.faults.healthy:
        return Verdict(False, ep.faults.reason())
    peers = ep.transfers.note(now)  # informs, never decides
    if not ep.has_canary:
        return Verdict(True, f"registered; no canary ({ep.canary_why})" + peers)
    if canary.ready is None:
        return Verdict(None, "registered; waiting for the first canary" + peers)
    if canary.ready:
        own = ""
        if engine_undersells(ep):
            own = f"; the worker's own health route says {ep.engine_health.detail}"
        return Verdict(True, canary.reason + _progress_note(ep, policy, now) + own + peers)
    return Verdict(False, canary.reason + _disagreement(ep) + peers)


def rank_verdict(units: Mapping[str, Verdict], need: int | None) -> Verdict:
    """One endpoint's verdict from its data-parallel ranks' (unit name -> verdict). ``need``:
    ranks that must be ready (SIDECAR_DP_MIN_READY_RANKS; None: all).

    ======================================  =========  ==========================================
    ranks                                   verdict    reason
    ======================================  =========  ==========================================
    every one ready                         ready      N of N ranks ready
    at least ``need`` ready, others not     ready      degraded: R of N ranks ready, ``need``
                                            degraded   required; <rank>: <its reason>
    fewer ready, but the undecided could    none       R of N ranks ready, ``need`` required; no
    make up ``need``                                   verdict yet for <ranks>
    fewer ready                             notready   R of N ranks ready, ``need`` required;
                                                       <rank>: <its reason>
    ======================================  =========  ==========================================
    """
    total = len(units)
    required = total if need is None else min(need, total)
    ready = [n for n, v in units.items() if v.ready]
    undecided = [n for n, v in units.items() if v.ready is None]
    down = [n for n, v in units.items() if v.ready is False]
    head = f"{len(ready)} of {total} ranks ready"
    detail = "; ".join(f"{n}: {units[n].reason}" for n in down)
    if len(ready) == total:
        return Verdict(True, head)
    if len(ready) >= required:
        waiting = f"; no verdict yet for {', '.join(undecided)}" if undecided else ""
        sep = "; " if detail else ""
        return Verdict(
            True, f"degraded: {head}, {required} required{waiting}{sep}{detail}", degraded=True
        )
    if len(ready) + len(undecided) >= required:
        return Verdict(
            None, f"{head}, {required} required; no verdict yet for {', '.join(undecided)}"
        )
    return Verdict(False, f"{head}, {required} required; {detail}")


class Rule(StrEnum):
    """Which rule decided readiness; reported in /health as "rule"."""

    DRAINING = "draining"  # shutting down: SIGTERM received
    STALE = "stale"  # the monitor stopped updating the evidence
    LISTED = "listed_endpoints"  # DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS is set
    MONITORED = "monitored_endpoints"
    STARTING = "starting_status"  # an endpoint had no verdict yet


RULE_TEXT = {
    Rule.DRAINING: "shutting down: notready while in-flight work drains",
    Rule.STALE: "the sidecar's monitor has stopped: no verdict can be vouched for",
    Rule.LISTED: "ready iff every endpoint in DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS is ready",
    Rule.MONITORED: "ready iff every monitored endpoint is ready",
    Rule.STARTING: "an endpoint has no verdict yet: DYN_SYSTEM_STARTING_HEALTH_STATUS decides",
}


@dataclass(frozen=True)
class Readiness:
    ready: bool
    rule: Rule
    reason: str


def decide_readiness(
    verdicts: Mapping[str, Verdict],
    listed: tuple[str, ...],
    starting: StartingStatus,
    *,
    draining: bool = False,
    informing: tuple[str, ...] = (),
) -> Readiness:
    """The endpoints that count are those listed in DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS, or every
    monitored endpoint but the ``informing`` ones (kv_transfer) when the list is empty. The worker
    is ready iff each of them is ready. An endpoint with no verdict yet counts as
    DYN_SYSTEM_STARTING_HEALTH_STATUS says."""
    if draining:
        return Readiness(False, Rule.DRAINING, "draining: SIGTERM received")
    rule = Rule.LISTED if listed else Rule.MONITORED
    names = listed or tuple(n for n in verdicts if n not in informing)
    undecided = [n for n in names if verdicts[n].ready is None]
    failing = [n for n in names if verdicts[n].ready is False]
    if failing:
        return Readiness(False, rule, "; ".join(f"{n}: {verdicts[n].reason}" for n in failing))
    if undecided:
        ready = starting is StartingStatus.READY
        return Readiness(
            ready,
            Rule.STARTING,
            f"{', '.join(undecided)}: no verdict yet; DYN_SYSTEM_STARTING_HEALTH_STATUS={starting}",
        )
    return Readiness(True, rule, "; ".join(f"{n}: {verdicts[n].reason}" for n in names))


def liveness_causes(
    *, canary: bool, progress: bool, discovery: bool, faults: bool, grpc_health: bool
) -> tuple[Cause, ...]:
    """The clocks that can run for a worker checked so: ``canary`` it gets canaries; ``progress``
    its metrics are read (a stall can be confirmed); ``discovery`` a Dynamo worker whose
    discovery is watched; ``faults`` its engine reports its fault-tolerance status;
    ``grpc_health`` registered over the engine's gRPC health."""
    runs = {
        Cause.REGISTRATION: not canary,
        Cause.NOT_SERVING: grpc_health,
        Cause.CANARY: canary,
        Cause.STALL: canary and progress,
        Cause.UNDISCOVERABLE: discovery,
        Cause.FAULT: faults,
    }
    return tuple(cause for cause in Cause if runs[cause])


def clocks(ep: EndpointState) -> dict[Cause, float]:
    """The liveness clocks running for one endpoint: cause -> monotonic start."""
    running: dict[Cause, float] = {}
    if ep.lifecycle.paused or not ep.liveness:
        return running
    if ep.registration.timeout_since is not None:
        running[Cause.REGISTRATION] = ep.registration.timeout_since
    if ep.registration.not_serving_since is not None:
        running[Cause.NOT_SERVING] = ep.registration.not_serving_since
    if ep.registration.registered:
        if ep.discovery.missing_since is not None:
            running[Cause.UNDISCOVERABLE] = ep.discovery.missing_since
        if ep.canary.stall_since is not None:
            running[Cause.STALL] = ep.canary.stall_since
        if ep.canary.hard_since is not None:
            running[Cause.CANARY] = ep.canary.hard_since
        if ep.faults.failed and ep.faults.since is not None:
            running[Cause.FAULT] = ep.faults.since
    return running


def _current_reason(ep: EndpointState, cause: Cause) -> str:
    if cause in (Cause.REGISTRATION, Cause.NOT_SERVING):
        return ep.registration.reason
    if cause is Cause.UNDISCOVERABLE:
        return ep.discovery.reason()
    if cause is Cause.FAULT:
        return ep.faults.reason()
    return ep.canary.reason


@dataclass(frozen=True)
class Liveness:
    live: bool
    reason: str
    cause: Cause | None = None  # the clock that failed liveness, or runs first


def decide_liveness(endpoints: Mapping[str, EndpointState], now: float, window: float) -> Liveness:
    """Live unless a clock has run for at least ``window`` seconds; the reason names the cause
    and quotes its source's current reason.

    An endpoint's first clock decides when it fails liveness. The cause named is that clock's,
    except that "not discoverable" names itself whenever it runs: no canary can reach an orphaned
    worker, so the canary clock a freeze started before the records expired cannot end, and
    discovery is what only a restart repairs."""
    running = []
    for name, ep in endpoints.items():
        own = clocks(ep)
        if own:
            start, first = min((s, c) for c, s in own.items())
            cause = Cause.UNDISCOVERABLE if Cause.UNDISCOVERABLE in own else first
            running.append((start, name, cause, first))
    if not running:
        return Liveness(True, "no sustained hard failure")
    start, name, cause, first = min(running)
    elapsed = now - start
    if cause is first:
        detail = f"{name}: {cause} for {elapsed:.1f} s"
    else:
        since = now - clocks(endpoints[name])[cause]
        detail = f"{name}: {cause} for {since:.1f} s, after {first} for {elapsed:.1f} s"
    current = _current_reason(endpoints[name], cause)
    if elapsed >= window:
        return Liveness(False, f"{detail} (window {window:g} s): {current}", cause)
    return Liveness(True, f"{detail}, within the {window:g} s window: {current}", cause)


# --- the worker as a whole ----------------------------------------------------------------------
# The monitor publishes a heartbeat every HEARTBEAT_INTERVAL; a snapshot older than
# HEARTBEAT_STALE means its loop is stuck: /health and the sidecar's own probe then fail.
HEARTBEAT_INTERVAL = 0.5
HEARTBEAT_STALE = 10.0


def monitor_silent(heartbeat: float, now: float) -> float | None:
    """Seconds the monitor has been silent, when that is too long (the stale rule); else None."""
    silent = now - heartbeat
    return silent if silent > HEARTBEAT_STALE else None


def endpoint_verdicts(
    units: Mapping[str, tuple[str, ...]], verdicts: Mapping[str, Verdict], need: int | None
) -> dict[str, Verdict]:
    """Each endpoint's verdict from its units' (endpoint -> its units): its own when it is its
    only unit, else :func:`rank_verdict` over its ranks."""
    return {
        endpoint: verdicts[members[0]]
        if members == (endpoint,)
        else rank_verdict({u: verdicts[u] for u in members}, need)
        for endpoint, members in units.items()
    }


def worker_readiness(
    verdicts: Mapping[str, Verdict],
    listed: tuple[str, ...],
    starting: StartingStatus,
    *,
    draining: bool,
    informing: tuple[str, ...],
    silent: float | None,
) -> Readiness:
    """/health: notready while the monitor is silent (stale), unless draining; else
    :func:`decide_readiness` over the endpoints' verdicts."""
    if silent is not None and not draining:
        return Readiness(
            False, Rule.STALE, f"the monitor has not run for {silent:.1f} s: the verdict is stale"
        )
    return decide_readiness(verdicts, listed, starting, draining=draining, informing=informing)


def worker_liveness(
    endpoints: Mapping[str, EndpointState], now: float, window: float, silent: float | None
) -> Liveness:
    """/live: live while the monitor is silent (the engine may be fine; restarting it would not
    revive the monitor: the sidecar's own probe, /sidecar/live, does that); else
    :func:`decide_liveness`."""
    if silent is not None:
        return Liveness(True, f"unknown: the monitor has not run for {silent:.1f} s")
    return decide_liveness(endpoints, now, window)
