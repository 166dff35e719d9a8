"""The single writer of health state, and the snapshot every reader reads.

The monitor (on its own thread) reports what it observed, as observations
(:mod:`sidecar.core.observations`); :meth:`Health.observe` runs the pure step
(:func:`sidecar.core.step.step`), publishes the new immutable :class:`Snapshot`, and hands the
step's events (:mod:`sidecar.core.events`) to its subscribers: the log (:func:`log_event`), the
metrics, the history and the gRPC service, each registered with :meth:`Health.subscribe`. The
HTTP routes and the metrics collector, on another thread, read ``health.snapshot`` once per
answer: one /health body always comes from one snapshot. Only the monitor's thread observes
(SIGTERM's drain and the control route's windows are handed to it). Nothing else writes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sidecar.core.events import Event
from sidecar.core.observations import Observation
from sidecar.core.snapshot import Snapshot, liveness_of, readiness_of
from sidecar.core.step import step

__all__ = ["Health", "Snapshot", "Subscriber", "liveness_of", "log_event", "readiness_of"]

log = logging.getLogger("sidecar.health")

# A subscriber to the events of every step (the log, the metrics, the history), called on the
# monitor's thread after the new snapshot is published.
Subscriber = Callable[[Event], None]


def log_event(event: Event) -> None:
    """The log's subscription: one line per event that says itself."""
    if event.text is not None:
        log.log(event.level, "%s", event.text)


class Health:
    """The state's only writer: the snapshot it publishes, and who hears of each step."""

    def __init__(self, snapshot: Snapshot, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started = snapshot.heartbeat
        self.snapshot = snapshot
        self._subscribers: list[Subscriber] = [log_event]

    def subscribe(self, subscriber: Subscriber) -> None:
        """Hear every step's events from now on (on the monitor's thread)."""
        self._subscribers.append(subscriber)

    def observe(self, obs: Observation) -> None:
        """The monitor's thread only: one step, published, and its events handed on."""
        stepped = step(self.snapshot, obs, self.clock())
        self.snapshot = stepped.snapshot
        for event in stepped.events:
            for subscriber in self._subscribers:
                subscriber(event)
