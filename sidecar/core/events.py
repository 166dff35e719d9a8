"""What a step changed, as events. Health publishes each new snapshot and hands the step's events
to its subscribers: the log (:func:`sidecar.runtime.health.log_event`), the metrics and the
history. Nothing else tells them what happened.

Every event says itself as one log line (``text`` at ``level``; ``None``: not logged, as a
canary's result), and carries what its subscribers count or keep. :func:`verdict_events` and
:func:`worker_events` derive the events of a verdict change from the states before and after:
pure, like the rest of the core.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum

from sidecar.core.endpoint import EndpointState
from sidecar.core.evidence.result import Result
from sidecar.core.verdict import Liveness, Readiness, Verdict, engine_disagrees, engine_undersells


class Kind(StrEnum):
    NOTE = "note"  # a source's change worth a line: registered, paused, stalled, progress ...
    CANARY = "canary"  # a probe finished (``result``)
    VERDICT = "verdict"  # a unit's verdict changed (``label``: ready, notready, unknown)
    ENDPOINT = "endpoint"  # a ranked endpoint's combined verdict changed
    DISAGREEMENT = "disagreement"  # the engine's own health route began to disagree
    READINESS = "readiness"  # the worker's readiness changed (``readiness``)
    LIVENESS = "liveness"  # the worker's liveness changed (``liveness``)


@dataclass(frozen=True)
class Event:
    kind: Kind
    text: str | None  # the log line; None: not logged
    level: int = logging.INFO
    unit: str | None = None  # None: the worker as a whole
    label: str | None = None  # VERDICT: the new label; DISAGREEMENT: what the engine says
    reason: str = ""
    result: Result | None = None
    readiness: Readiness | None = None
    liveness: Liveness | None = None


def note(text: str, level: int = logging.INFO, unit: str | None = None) -> Event:
    return Event(Kind.NOTE, text, level, unit)


LABELS = {True: "ready", False: "notready", None: "unknown"}


def verdict_events(
    unit: str,
    ranked_unit: bool,
    before: EndpointState,
    after: EndpointState,
    was: Verdict,
    now: Verdict,
    endpoint: tuple[str, Verdict, Verdict] | None,
) -> list[Event]:
    """The events of one unit's new state: its verdict changed (``was`` -> ``now``), the
    combined verdict of its ranked endpoint changed (``endpoint``: name, before, after; None for
    an unranked one), the engine's own health route began to disagree."""
    events: list[Event] = []
    if was.ready != now.ready:
        label = LABELS[now.ready]
        scope = "rank" if ranked_unit else "endpoint"
        text = f"{unit}: {scope} {label}: {now.reason}"
        events.append(Event(Kind.VERDICT, text, unit=unit, label=label, reason=now.reason))
    if endpoint is not None:
        name, old, new = endpoint
        if (old.ready, old.degraded) != (new.ready, new.degraded):
            state = "degraded" if new.degraded else LABELS[new.ready]
            text = f"{name}: endpoint {state}: {new.reason}"
            events.append(Event(Kind.ENDPOINT, text, unit=name, label=state, reason=new.reason))
    if engine_disagrees(after) and not engine_disagrees(before):
        text = f"{unit}: the engine's own health route answers 200 while it is hung"
        events.append(Event(Kind.DISAGREEMENT, text, logging.WARNING, unit, "ready"))
    if engine_undersells(after) and not engine_undersells(before):
        detail = after.engine_health.detail
        text = f"{unit}: the engine's own health route says {detail} while its canaries pass"
        events.append(Event(Kind.DISAGREEMENT, text, unit=unit, label="notready"))
    return events


def worker_events(
    last_ready: bool | None, last_live: bool, readiness: Readiness, liveness: Liveness
) -> list[Event]:
    """The worker's readiness or liveness changed since they were last told."""
    events: list[Event] = []
    if readiness.ready != last_ready:
        said = "ready" if readiness.ready else "notready"
        text = f"worker {said} (rule {readiness.rule}): {readiness.reason}"
        events.append(Event(Kind.READINESS, text, readiness=readiness))
    if liveness.live != last_live:
        said = "live" if liveness.live else "not live"
        text = f"worker {said}: {liveness.reason}"
        events.append(Event(Kind.LIVENESS, text, logging.WARNING, liveness=liveness))
    return events
