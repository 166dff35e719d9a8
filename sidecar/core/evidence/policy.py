"""Thresholds and timings the sources follow, derived once from the settings; and the bounds they
make, each a sum of named terms, so that whatever prints a bound prints how it is made from the
same code (``health-sidecar probes``, ``--check-config``, the docs)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Term:
    """One term of a bound: ``seconds``, ``times`` over (None: once, shown without a count), and
    what it is."""

    seconds: float
    what: str = ""
    times: int | None = None

    @property
    def total(self) -> float:
        return self.seconds * (1 if self.times is None else self.times)

    def __str__(self) -> str:
        text = f"{self.seconds:g} s" if self.times is None else f"{self.times} x {self.seconds:g} s"
        return f"{text} {self.what}" if self.what else text


@dataclass(frozen=True)
class Sum:
    """A bound as the sum of its terms; ``str`` says the terms, ``seconds`` their total."""

    terms: tuple[Term, ...]

    @property
    def seconds(self) -> float:
        return sum(t.total for t in self.terms)

    def __str__(self) -> str:
        """The terms that count (none taken zero times), joined by +."""
        return " + ".join(str(t) for t in self.terms if t.times != 0)


#: The shortest interval between reads of a busy engine's metrics, whatever the stall window.
MIN_BUSY_READ = 0.25
#: What SIDECAR_STALL_WINDOW is when unset (:func:`default_stall_window`), in words.
STALL_WINDOW_DEFAULT = (
    "DYN_HEALTH_CHECK_REQUEST_TIMEOUT + half of DYN_CANARY_WAIT_TIME, that half at least 0.75 s "
    "and at most 2 s"
)


def default_stall_window(timeout: float, wait: float) -> float:
    """The stall window when SIDECAR_STALL_WINDOW is unset: the canary timeout and half the
    canary wait (at least three of the shortest busy reads, at most 2 s), so that a hang under
    load is notready sooner than an idle engine's next canary would find it (wait + timeout)."""
    return timeout + min(2.0, max(3 * MIN_BUSY_READ, wait / 2))


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
    registration_interval: float = 1.0  # seconds between checks of the engine's health route
    check_answer: bool = False  # a passed canary must give this incarnation's first answer

    @property
    def busy_metrics_interval(self) -> float:
        """Seconds between reads of the engine's metrics while it has work in flight: the
        metrics interval, or less where the stall window needs it (a third of what the window
        leaves beside the canary's timeout), never under :data:`MIN_BUSY_READ`."""
        third = math.floor((self.stall_window - self.timeout) / 3 * 20) / 20  # to 0.05 s
        return max(MIN_BUSY_READ, min(self.metrics_interval, third))

    @property
    def suspect_after(self) -> float:
        """Seconds of quiet counters with work in flight (counted from the last read that showed
        an advance) before a canary leaves to confirm a stall. Chosen so that a confirmed stall
        is notready within ``stall_window`` of the counters stopping (up to one busy metrics
        interval passes before a read last shows them move, then this, then the canary's
        timeout), and never under two busy intervals: the next read of an engine that still
        computes lands well inside it."""
        read = self.busy_metrics_interval
        return max(2 * read, self.stall_window - self.timeout - read)

    def to_stalled(self) -> Sum:
        """From counters stopping under load to notready ("stalled"), at the longest: one busy
        metrics interval before a read last shows them move, the quiet spell that raises the
        suspicion, then the confirming canary's timeout."""
        return Sum(
            (
                Term(self.busy_metrics_interval, "busy metrics interval"),
                Term(self.suspect_after, "quiet"),
                Term(self.timeout, "timeout"),
            )
        )

    def to_stalled_from_idle(self) -> Sum:
        """From work arriving at an idle engine that then computes nothing (a hang, or a silent
        step) to notready ("stalled"), at the longest: the first read that sees the work comes
        up to one metrics interval after it arrived (reads go at the busy interval only once one
        has), then the quiet spell and the confirming canary's timeout."""
        return Sum(
            (
                Term(self.metrics_interval, "metrics interval"),
                Term(self.suspect_after, "quiet"),
                Term(self.timeout, "timeout"),
            )
        )

    def to_ready(self, canary: bool = True) -> Sum:
        """From the engine up to ready, at the longest: a registration interval and its check's
        timeout; with a canary, also the model lookup and ``success_threshold`` canaries, each
        started ``retry`` after the previous ended."""
        first = (
            Term(self.registration_interval, "registration interval"),
            Term(self.timeout, "registration check"),
        )
        if not canary:
            return Sum(first)
        return Sum(
            (
                *first,
                Term(self.timeout, "model lookup"),
                Term(self.timeout, "canary", self.success_threshold),
                Term(self.retry, "retry", self.success_threshold - 1),
            )
        )

    def to_notready(self, canary: bool = True) -> Sum:
        """From a hang to notready, at the longest. With a canary: after the last passed canary
        the next is due ``wait`` later (the monitor wakes at most ``retry`` late), then
        ``failure_threshold`` canaries time out, started ``max(retry, timeout)`` apart. Without:
        the registration check's interval and timeout (a hang behind a 200 health route is not
        seen at all)."""
        if not canary:
            return Sum(
                (
                    Term(self.registration_interval, "registration interval"),
                    Term(self.timeout, "timeout"),
                )
            )
        return Sum(
            (
                Term(self.wait, "wait"),
                Term(self.retry, "retry"),
                Term(max(self.retry, self.timeout), "", self.failure_threshold - 1),
                Term(self.timeout, "timeout"),
            )
        )

    def to_notlive(self, canary: bool = True) -> Sum:
        """From a hang to /live failing, at the longest: the hard-failure clock starts with the
        first failed canary, at most ``wait + retry`` after the hang began (without a canary,
        with the first timed-out registration check), and runs ``liveness_window``."""
        if not canary:
            return Sum(
                (
                    Term(self.registration_interval, "registration interval"),
                    Term(self.liveness_window, "window"),
                )
            )
        return Sum(
            (
                Term(self.wait, "wait"),
                Term(self.retry, "retry"),
                Term(self.liveness_window, "window"),
            )
        )

    @property
    def stall_bound(self) -> float:
        """The longest time from counters stopping under load to notready ("stalled")."""
        return self.to_stalled().seconds

    @property
    def hang_to_notready(self) -> float:
        """The longest time from a hang to notready, with a canary (:meth:`to_notready`)."""
        return self.to_notready().seconds

    @property
    def hang_to_notlive(self) -> float:
        """The longest time from a hang to /live failing, with a canary (:meth:`to_notlive`)."""
        return self.to_notlive().seconds
