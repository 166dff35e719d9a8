"""Recent canaries and verdict changes, for the status page (/) and /debug/history.

Like blackbox_exporter's prober/history.go, successes and failures are kept in separate bounded
rings, so a burst of successes never pushes out the failures a person comes to look at. The
monitor's thread writes (as a subscriber to Health's events, :mod:`sidecar.core.events`); the
HTTP thread reads a :class:`View`, a consistent copy of immutable entries taken under a lock.
Every text kept here is scrubbed of credentials first (see :func:`scrub`), so nothing secret can
be served from it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from sidecar.core.events import Event, Kind
from sidecar.core.evidence.result import Result
from sidecar.redact import redact

SUCCESSES = 100
FAILURES = 100
CHANGES = 50
MAX_REASON = 500  # characters of a reason kept


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without the given secrets, URL credentials or Authorization/bearer values, and
    at most MAX_REASON characters long."""
    text = redact(text, secrets)
    if len(text) > MAX_REASON:
        text = text[: MAX_REASON - 3] + "..."
    return text


@dataclass(frozen=True)
class Canary:
    """One finished canary."""

    wall_time: float  # unix seconds at finish
    endpoint: str
    request_id: str
    outcome: str
    latency: float  # seconds
    status_code: int | None
    reason: str

    @property
    def ok(self) -> bool:
        return self.outcome == "success"


@dataclass(frozen=True)
class Change:
    """A change of a verdict: the worker's readiness or liveness, or an endpoint's readiness."""

    wall_time: float
    scope: str  # "worker" or "endpoint"
    name: str  # "readiness", "liveness", or the endpoint's name
    to: str  # ready, notready, unknown, live, notlive
    rule: str | None  # the readiness rule that decided (worker readiness only)
    reason: str


@dataclass(frozen=True)
class View:
    """What a reader gets: newest first, immutable."""

    canaries: tuple[Canary, ...]
    changes: tuple[Change, ...]
    successes_kept: int
    failures_kept: int
    changes_kept: int
    limits: Mapping[str, int]  # the most each ring keeps: successes, failures, changes


class History:
    def __init__(
        self,
        successes: int = SUCCESSES,
        failures: int = FAILURES,
        changes: int = CHANGES,
        secrets: Iterable[str] = (),
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._lock = threading.Lock()
        self._successes: deque[Canary] = deque(maxlen=successes)
        self._failures: deque[Canary] = deque(maxlen=failures)
        self._changes: deque[Change] = deque(maxlen=changes)
        self.limits = {"successes": successes, "failures": failures, "changes": changes}
        self._secrets = tuple(s for s in secrets if s)
        self._wall = wall

    def _scrub(self, text: str) -> str:
        return scrub(text, self._secrets)

    # --- writers: the monitor's thread -----------------------------------------------------------
    def add_canary(self, endpoint: str, result: Result) -> None:
        entry = Canary(
            wall_time=result.wall_time,
            endpoint=endpoint,
            request_id=self._scrub(result.request_id),
            outcome=result.outcome.value,
            latency=max(0.0, result.latency),
            status_code=result.status_code,
            reason=self._scrub(result.reason),
        )
        with self._lock:
            (self._successes if entry.ok else self._failures).append(entry)

    def add_change(
        self, scope: str, name: str, to: str, reason: str, rule: str | None = None
    ) -> None:
        entry = Change(self._wall(), scope, name, to, rule, self._scrub(reason))
        with self._lock:
            self._changes.append(entry)

    def on_event(self, event: Event) -> None:
        """Health's subscriber: record its canaries and verdict changes."""
        if event.kind is Kind.CANARY and event.unit and event.result is not None:
            self.add_canary(event.unit, event.result)
        elif event.kind is Kind.VERDICT and event.unit and event.label:
            self.add_change("endpoint", event.unit, event.label, event.reason)
        elif event.kind is Kind.READINESS and event.readiness is not None:
            r = event.readiness
            self.add_change("worker", "readiness", "ready" if r.ready else "notready",
                            r.reason, r.rule.value)  # fmt: skip
        elif event.kind is Kind.LIVENESS and event.liveness is not None:
            lv = event.liveness
            self.add_change("worker", "liveness", "live" if lv.live else "notlive", lv.reason)

    # --- reader: any thread ----------------------------------------------------------------------
    def view(self) -> View:
        with self._lock:
            successes, failures = tuple(self._successes), tuple(self._failures)
            changes = tuple(self._changes)
        canaries = sorted(successes + failures, key=lambda c: c.wall_time, reverse=True)
        return View(
            canaries=tuple(canaries),
            changes=tuple(reversed(changes)),
            successes_kept=len(successes),
            failures_kept=len(failures),
            changes_kept=len(changes),
            limits=dict(self.limits),
        )
