"""Engine progress from its own Prometheus metrics: how much work is in flight, and whether the
counters that only move when the engine does work have moved.

Parsing uses prometheus-client's parser. Which samples count is each backend's business: see
``progress`` in ``sidecar/canary/<backend>.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class ProgressSpec:
    """Where a backend publishes its metrics and which samples mean what.

    Sample names are exposition names (a counter ``x`` is published as ``x_total``; a histogram's
    step count as ``x_count``). Every sample with a listed name is summed, over all labels.
    """

    path: str
    running: tuple[str, ...]  # requests the engine is working on
    waiting: tuple[str, ...]  # requests queued for it
    counters: tuple[str, ...]  # totals that advance only when the engine computes


@dataclass(frozen=True)
class ProgressSample:
    in_flight: float | None  # running + waiting; None when the engine publishes neither
    counters: float | None  # sum of the progress counters; None when none is published
    at: float  # monotonic time of the scrape

    def describe(self) -> str:
        flight = "unknown" if self.in_flight is None else f"{self.in_flight:g}"
        return f"{flight} requests in flight"


class MetricsUnreadable(ValueError):
    pass


def read_progress(text: str, spec: ProgressSpec, at: float) -> ProgressSample:
    """Sum the spec's samples in a Prometheus text exposition. Raises MetricsUnreadable."""
    wanted = {
        name: kind for kind in ("running", "waiting", "counters") for name in getattr(spec, kind)
    }
    totals: dict[str, float | None] = {"running": None, "waiting": None, "counters": None}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                kind = wanted.get(sample.name)
                if kind is not None:
                    totals[kind] = (totals[kind] or 0.0) + float(sample.value)
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsUnreadable(f"not a Prometheus exposition: {exc}") from None
    running, waiting = totals["running"], totals["waiting"]
    in_flight = None if running is None and waiting is None else (running or 0.0) + (waiting or 0.0)
    return ProgressSample(in_flight, totals["counters"], at)
