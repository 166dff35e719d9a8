"""Thresholds and timings the sources follow, derived once from the settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    failure_threshold: int = 2  # consecutive counted canary failures: ready -> notready
    success_threshold: int = 1  # consecutive passes: notready -> ready
    wait: float = 10.0  # seconds a ready endpoint goes without a canary
    retry: float = 1.0  # seconds between canaries while failing or unproven
    timeout: float = 3.0  # the whole answer of any request
    liveness_window: float = 120.0
    stall_window: float = 5.0  # counters stopping under load -> notready, at most this long
    metrics_interval: float = 1.0
    check_answer: bool = False  # a passed canary must give this incarnation's first answer

    @property
    def suspect_after(self) -> float:
        """Seconds of quiet counters with work in flight (counted from the last read that showed
        an advance) before a canary leaves to confirm a stall. Chosen so that a confirmed stall
        is notready within ``stall_window`` of the counters stopping: up to one metrics interval
        passes before a read last shows them move, then this, then the canary's timeout."""
        return max(
            self.metrics_interval / 2, self.stall_window - self.timeout - self.metrics_interval
        )

    @property
    def stall_bound(self) -> float:
        """The longest time from counters stopping under load to notready ("stalled")."""
        return self.metrics_interval + self.suspect_after + self.timeout

    @property
    def hang_to_notready(self) -> float:
        """The longest time from a hang to notready, with a canary: after the last passed canary
        the next is due ``wait`` later (the monitor wakes at most ``retry`` late), then
        ``failure_threshold`` canaries time out, started ``max(retry, timeout)`` apart."""
        return (
            self.wait
            + self.retry
            + (self.failure_threshold - 1) * max(self.retry, self.timeout)
            + self.timeout
        )

    @property
    def hang_to_notlive(self) -> float:
        """The longest time from a hang to /live failing, with a canary: the hard-failure clock
        starts with the first failed canary, at most ``wait + retry`` after the hang began, and
        runs ``liveness_window``."""
        return self.wait + self.retry + self.liveness_window
