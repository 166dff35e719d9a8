"""Engine progress from its own Prometheus metrics: a hint, never a verdict.

What the metrics may do: hold routine canaries back while the engine is busy and its counters
advance (a canary would only queue behind real work); excuse a canary timeout when other work
progressed while it waited; raise the suspicion of a stall (work in flight, counters quiet) that a
canary then confirms or clears. What they may not do: make an endpoint ready, or undo a failed
canary. Which samples mean what is each backend's business: ``progress`` in
``sidecar/probes/<backend>.py``. Parsing is prometheus-client's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from sidecar.core.vocabulary import MAX_DP_RANKS

# The counter categories a spec may list. Each advances only when the engine computes.
PROMPT, GENERATION, STEPS, COMPLETED = "prompt", "generation", "steps", "completed"
CATEGORIES = (PROMPT, GENERATION, STEPS, COMPLETED)
# Consecutive failed reads after which the load counts as unknown (the first ones keep the last
# good read: under load an engine's metrics route may answer late once).
MISSES_TOLERATED = 3


@dataclass(frozen=True)
class Series:
    """A sample name (exposition name: a counter ``x`` is served as ``x_total``, a histogram's
    count as ``x_count``) and the labels it must carry; every matching sample is summed."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.labels)

    def scoped(self, label: str | None, value: str) -> Series:
        """The same series restricted to one value of ``label`` (one data-parallel rank)."""
        return self if label is None else Series(self.name, (*self.labels, (label, value)))

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        return self.name + "{" + ",".join(f'{k}="{v}"' for k, v in self.labels) + "}"


def _flat(groups: Mapping[str, tuple[Series, ...]]) -> tuple[Series, ...]:
    return tuple(s for group in groups.values() for s in group)


def series(*names: str | Series) -> tuple[Series, ...]:
    return tuple(n if isinstance(n, Series) else Series(n) for n in names)


@dataclass(frozen=True)
class ProgressSpec:
    """Where a backend publishes its metrics and which samples mean what."""

    path: str
    running: tuple[Series, ...]  # requests the engine works on
    waiting: tuple[Series, ...]  # requests queued for it
    counters: Mapping[str, tuple[Series, ...]]  # category -> totals that advance with work
    # Requests waiting on something outside the engine (a KV transfer from a prefill peer).
    peer_wait: tuple[Series, ...] = ()
    # The categories whose counters move at every engine step (a decode step, a batch), not only
    # when a request completes: only they can tell a busy engine from a stuck one while long
    # requests run. An engine that publishes none of them gets no stall rule.
    per_step: frozenset[str] = frozenset()
    # Whether a running request shows in ``running`` / ``waiting``. Not on a vLLM encoder: each
    # request finishes within the step that runs it, and the gauges are recorded after it, so
    # they read 0 under load (docs/engines.md). Then nothing is held or suspected for load: the
    # scheduled canaries find a hang, and only other requests' progress excuses a timeout.
    in_flight_shown: bool = True

    def step_series(self) -> tuple[Series, ...]:
        return tuple(s for c in CATEGORIES if c in self.per_step for s in self.counters.get(c, ()))

    def scoped(self, label: str | None, value: str) -> ProgressSpec:
        """Every series restricted to one value of ``label`` (one data-parallel rank)."""
        if label is None:
            return self

        def each(group: tuple[Series, ...]) -> tuple[Series, ...]:
            return tuple(s.scoped(label, value) for s in group)

        return replace(
            self,
            running=each(self.running),
            waiting=each(self.waiting),
            counters={c: each(g) for c, g in self.counters.items()},
            peer_wait=each(self.peer_wait),
        )

    def every(self) -> tuple[Series, ...]:
        """Every series the spec reads (to parse an exposition once for all its readers)."""
        return (*self.running, *self.waiting, *self.peer_wait, *_flat(self.counters))

    def names(self) -> list[str]:
        every = [*self.running, *self.waiting, *self.peer_wait]
        every += [s for c in CATEGORIES for s in self.counters.get(c, ())]
        return [str(s) for s in every]


@dataclass(frozen=True)
class ProgressSample:
    at: float  # monotonic time of the read
    wall: float
    in_flight: float | None  # running + waiting; None when the engine publishes neither
    counters: Mapping[str, float]  # category -> summed total, for the categories published
    peer_wait: float | None = None
    found: tuple[str, ...] = ()  # the spec's series present in the exposition
    # The sidecar's own canaries around this read: how many it had sent by its end, and how many
    # had finished before its start. Between two reads, at most ``later.sent - earlier.done``
    # ran.
    canaries_sent: int = 0
    canaries_done: int = 0
    # A counter that moves at every engine step was published (ProgressSpec.per_step).
    stepwise: bool = False


class MetricsUnreadable(ValueError):
    pass


#: The longest line of a series the sidecar reads that it parses (tests/test_fuzz.py).
MAX_LINE_CHARS = 4096


@dataclass(frozen=True)
class Exposition:
    """One read of an engine's metrics, parsed once for every unit that reads it (each rank, the
    transfer counters, the sleep gauge): the samples of the names asked for, by name.

    Only the lines of those names go to prometheus-client's parser: an engine's exposition is
    mostly histograms the sidecar never reads (vLLM's: 50 KB), and parsing it all, every second,
    on a CPU the engine saturates, starved the thread that answers the probes
    (docs/benchmarks.md)."""

    names: frozenset[str]
    samples: Mapping[str, tuple[Sample, ...]]

    @classmethod
    def parse(cls, text: str, names: Iterable[str]) -> Exposition:
        """Raises MetricsUnreadable."""
        wanted = frozenset(names)
        prefixes = tuple(wanted)
        lines = [line for line in text.splitlines() if line.startswith(prefixes)]
        # prometheus-client's parser takes time quadratic in a line's length (a label value of
        # escaped quotes, a sample of many labels): a line of a series read is a name, a few
        # labels and a value, so a longer one is not an exposition the sidecar reads.
        long = next((line for line in lines if len(line) > MAX_LINE_CHARS), None)
        if long is not None:
            raise MetricsUnreadable(
                f"a line of {len(long)} characters for {long[:60]!r}... (at most "
                f"{MAX_LINE_CHARS} are read)"
            )
        kept = "\n".join(lines)
        by_name: dict[str, list[Sample]] = {}
        try:
            for family in text_string_to_metric_families(kept + "\n"):
                for sample in family.samples:
                    if sample.name in wanted:
                        by_name.setdefault(sample.name, []).append(sample)
        except (ValueError, TypeError, IndexError) as exc:
            raise MetricsUnreadable(f"not a Prometheus exposition: {exc}") from None
        return cls(wanted, {n: tuple(v) for n, v in by_name.items()})


def names_of(*groups: Iterable[Series]) -> frozenset[str]:
    return frozenset(s.name for group in groups for s in group)


def matching(source: str | Exposition, series: Iterable[Series]) -> list[tuple[Series, Sample]]:
    """Every sample that one of ``series`` matches, paired with it (a sample matching two series
    comes twice), from an exposition parsed once or from its text. Raises MetricsUnreadable."""
    wanted = tuple(series)
    if isinstance(source, str):
        source = Exposition.parse(source, names_of(wanted))
    missing = names_of(wanted) - source.names
    assert not missing, f"the exposition was not parsed for {sorted(missing)}"
    return [
        (s, sample)
        for s in wanted
        for sample in source.samples.get(s.name, ())
        if s.matches(sample.labels)
    ]


def group_totals(
    text: str | Exposition, groups: Mapping[str, tuple[Series, ...]]
) -> tuple[dict[str, float], tuple[str, ...]]:
    """(group -> sum of its matching finite samples, for the groups with any; the series found).
    Raises MetricsUnreadable."""
    group_of: dict[Series, list[str]] = {}
    for group, members in groups.items():
        for s in members:
            group_of.setdefault(s, []).append(group)
    totals: dict[str, float] = {}
    found: dict[str, None] = {}
    for s, sample in matching(text, group_of):
        value = float(sample.value)
        if math.isfinite(value):
            for group in group_of[s]:
                totals[group] = totals.get(group, 0.0) + value
            found[str(s)] = None
    return totals, tuple(found)


def read_progress(
    text: str | Exposition,
    spec: ProgressSpec,
    at: float,
    wall: float,
    canaries: tuple[int, int] = (0, 0),
) -> ProgressSample:
    """Sum the spec's samples in a Prometheus text exposition. Raises MetricsUnreadable."""
    groups = {
        "running": spec.running,
        "waiting": spec.waiting,
        "peer_wait": spec.peer_wait,
        **spec.counters,
    }
    totals, found = group_totals(text, groups)
    running, waiting = totals.get("running"), totals.get("waiting")
    in_flight = None if running is None and waiting is None else (running or 0.0) + (waiting or 0.0)
    counters = {c: totals[c] for c in CATEGORIES if c in totals}
    stepwise = any(c in counters for c in spec.per_step)
    sent, done = canaries
    return ProgressSample(
        at, wall, in_flight, counters, totals.get("peer_wait"), found, sent, done, stepwise
    )


RANK_LABEL = re.compile(r"[0-9]{1,4}")


def ranks_in(text: str | Exposition, gauges: tuple[Series, ...], label: str) -> tuple[int, ...]:
    """The data-parallel ranks an exposition shows: the values of ``label`` on the ``gauges``
    (vLLM: engine="0", engine="1", ... on its in-flight gauges; SGLang: dp_rank="0", ...); () when
    it has none of the gauges; (0,) when they carry no such label (SGLang with one rank labels
    none of its series dp_rank)."""
    try:
        samples = matching(text, gauges)
    except MetricsUnreadable:
        return ()
    if not samples:
        return ()
    values = {sample.labels.get(label, "") for _, sample in samples}
    # A rank is an ASCII number below MAX_DP_RANKS ("01" is rank 1); any other label value
    # (a superscript digit, thousands of digits, a rank past the bound) names no rank.
    ranks = {int(v) for v in values if RANK_LABEL.fullmatch(v) and int(v) < MAX_DP_RANKS}
    return tuple(sorted(ranks)) or (0,)


def unusable(sample: ProgressSample, spec: ProgressSpec) -> str | None:
    """Why a sample cannot serve as evidence, or None. Without a counter nothing shows progress:
    in-flight gauges alone would read every busy engine as stuck."""
    if sample.counters:
        return None
    wanted = ", ".join(str(s) for c in CATEGORIES for s in spec.counters.get(c, ()))
    if sample.in_flight is not None:
        return f"in-flight gauges but none of the progress counters ({wanted})"
    return f"none of the backend's progress metrics ({', '.join(spec.names())})"


@dataclass(frozen=True)
class ProgressState:
    readable: bool = False
    why: str = "not read yet"  # why not readable, or what is read
    latest: ProgressSample | None = None
    quiet_since: float | None = None  # work in flight and no counter advanced since then
    last_advance_at: float | None = None  # monotonic time of the read that showed an advance
    last_advance_wall: float | None = None
    missed: int = 0  # consecutive reads that failed since the last good one
    watched_since: float | None = None  # the first readable read of this incarnation

    def moved_since(self, since: float) -> bool:
        """A counter advanced at or after ``since``, or the metrics were first read then (a fresh
        engine has had no time to move them)."""
        seen = [t for t in (self.last_advance_at, self.watched_since) if t is not None]
        return max(seen, default=-math.inf) >= since

    @property
    def in_flight(self) -> float | None:
        return self.latest.in_flight if self.readable and self.latest else None

    @property
    def busy(self) -> bool:
        return bool(self.in_flight)

    @property
    def stepwise(self) -> bool:
        """The engine publishes a counter that moves at every step: quiet counters with work in
        flight can be a stall. Without one (only counters that move as requests complete), a
        busy engine running long requests looks the same as a stuck one: no stall rule."""
        return self.readable and self.latest is not None and self.latest.stepwise

    def quiet_for(self, now: float) -> float:
        """Seconds work has sat in flight with no counter advancing (0 when idle or unknown)."""
        if not self.busy or self.quiet_since is None:
            return 0.0
        return max(0.0, now - self.quiet_since)

    def suspect_at(self, suspect_after: float) -> float | None:
        """When a stall becomes suspect if no read shows progress before (monotonic); None while
        idle or unknown. A time, not a read: the confirming canary leaves on the dot."""
        if not self.busy or self.quiet_since is None:
            return None
        return self.quiet_since + suspect_after

    def suspects_stall(self, suspect_after: float, now: float) -> bool:
        """Work in flight and no counter advanced for ``suspect_after``: a canary should confirm."""
        at = self.suspect_at(suspect_after)
        return at is not None and now >= at

    def progressing_since(self, since: float) -> bool:
        return self.readable and self.last_advance_at is not None and self.last_advance_at >= since


def _advanced(
    before: ProgressSample | None, after: ProgressSample, own: CanaryCost, canaries: float
) -> bool | None:
    """True if a counter went up by more than ``canaries`` canaries could move it (categories
    without a budget: by anything), False if not, None if one went down (a reset)."""
    if before is None:
        return False
    moved = False
    for category, value in after.counters.items():
        old = before.counters.get(category)
        if old is None:
            continue
        if value < old:
            return None
        moved = moved or value - old > own.budgets.get(category, 0.0) * canaries
    return moved


def on_sample(
    state: ProgressState,
    sample: ProgressSample | None,
    why: str,
    spec: ProgressSpec,
    own: CanaryCost | None = None,
) -> ProgressState:
    """Apply one read of the engine's metrics (None: it could not be read, ``why`` says why).

    ``own``: what one of the sidecar's canaries moves. Between two reads, the canaries that may
    have run meanwhile are allowed for: their tokens are not the progress of the work in flight.
    """
    if sample is None and state.readable and state.missed + 1 < MISSES_TOLERATED:
        # One slow read of a saturated engine's metrics route is not unknown load: the last
        # read stands (and its quiet time keeps growing).
        return replace(state, missed=state.missed + 1)
    problem = why if sample is None else unusable(sample, spec)
    if problem is not None:
        # Unknown load: no hold, no suspicion, no excuse; the canary alone decides.
        return replace(state, readable=False, why=problem, latest=None, quiet_since=None, missed=0)
    assert sample is not None
    previous = state.latest if state.readable else None
    canaries = sample.canaries_sent - previous.canaries_done if previous is not None else 0
    advanced = _advanced(previous, sample, own or CanaryCost({}), canaries)
    why = f"reading {', '.join(sample.found)}"
    if not sample.stepwise:
        steps = ", ".join(map(str, spec.step_series())) or "none known for this backend"
        why += (
            f"; no counter that moves at every engine step ({steps}): requests in flight with "
            "quiet counters are not taken for a stall (the stall rule is off)"
        )
    changes: dict[str, object] = {"readable": True, "why": why, "latest": sample, "missed": 0}
    if state.watched_since is None:
        changes["watched_since"] = sample.at
    if advanced:
        changes |= {"last_advance_at": sample.at, "last_advance_wall": sample.wall}
    if not sample.in_flight or not sample.stepwise:
        changes["quiet_since"] = None
    elif advanced or advanced is None or state.quiet_since is None:
        changes["quiet_since"] = sample.at
    return replace(state, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class CanaryCost:
    """What one canary may move by itself: progress within these budgets proves nothing."""

    budgets: Mapping[str, float] = field(default_factory=dict)  # category -> amount; absent: inf

    def exceeded_by(self, category: str, delta: float) -> bool:
        return delta > self.budgets.get(category, math.inf)


def foreign_progress(
    baseline: ProgressSample | None, end: ProgressSample | None, cost: CanaryCost
) -> bool | None:
    """Did work other than the canary progress between two reads taken around it? None when it
    cannot be told (a read is missing, or the counters were reset)."""
    if baseline is None or end is None or not baseline.counters or not end.counters:
        return None
    if any(end.counters[c] < baseline.counters[c] for c in end.counters if c in baseline.counters):
        return None
    return any(
        cost.exceeded_by(c, end.counters[c] - baseline.counters[c])
        for c in end.counters
        if c in baseline.counters
    )
