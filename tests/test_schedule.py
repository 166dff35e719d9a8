"""When each piece of the monitor's work is due (sidecar/core/schedule.py): pure, as tables."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.core.endpoint import EndpointState
from sidecar.core.evidence.canary import CanaryState
from sidecar.core.evidence.lifecycle import Maintenance
from sidecar.core.evidence.registration import RegistrationState
from sidecar.core.schedule import Job, Timing, Work, next_due
from sidecar.core.snapshot import Snapshot, rebuilt
from sidecar.core.verdict import HEARTBEAT_INTERVAL

pytestmark = pytest.mark.unit

REG, METRICS, RANKS = Work(Job.REGISTRATION), Work(Job.METRICS), Work(Job.RANKS)
BEAT, WINDOW = Work(Job.HEARTBEAT), Work(Job.MAINTENANCE)
CANARY = Work(Job.CANARY, "generate")
TIMING = Timing(registration=1.0, metrics=0.5, transfer=60.0)


def snapshot(registered: bool = True, next_canary: float | None = 12.0) -> Snapshot:
    ep = EndpointState("generate", True, "why")
    if registered:
        ep = replace(
            ep,
            registration=RegistrationState(registered=True, incarnation=1),
            canary=CanaryState(next_due=next_canary),
        )
    empty = Snapshot({"generate": ep}, {}, {"generate": "tiny"}, False, 0.0)
    return rebuilt(replace(empty, units={"generate": ("generate",)}), 0.0)


@pytest.mark.parametrize(
    ("timing", "started", "running", "expect"),
    [
        # nothing ran yet: the engine's reads and the heartbeat at once
        (TIMING, {}, (), {REG: 10.0, METRICS: 10.0, BEAT: 10.0, CANARY: 12.0, WINDOW: None}),
        # one interval after each last started
        (
            TIMING,
            {REG: 9.5, METRICS: 9.8, BEAT: 9.9},
            (),
            {REG: 10.5, METRICS: 10.3, BEAT: 9.9 + HEARTBEAT_INTERVAL},
        ),
        # a read that took longer than its interval is due again at once when it ends
        (TIMING, {REG: 8.0}, (), {REG: 9.0}),
        # in flight: never due, however late (never two canaries, nor two reads, at once)
        (TIMING, {REG: 8.0}, (REG, CANARY), {REG: None, CANARY: None}),
        # the progress source off: no metrics read; ranks counted while not counted yet
        (Timing(1.0, None, 60.0, count_ranks=True), {RANKS: 9.5}, (), {RANKS: 10.5}),
    ],
)
def test_each_work_is_due_one_interval_after_it_started_and_never_while_in_flight(
    timing, started, running, expect
):
    due = next_due(snapshot(), {"generate": Job.CANARY}, timing, started, running, 10.0)
    for work, at in expect.items():
        assert due[work] == pytest.approx(at) if at is not None else due[work] is None, work
    assert (METRICS in due) == (timing.metrics is not None)
    assert (RANKS in due) == timing.count_ranks


def test_no_canary_is_due_before_the_engine_is_registered_or_for_a_unit_without_one():
    due = next_due(snapshot(registered=False), {"generate": Job.CANARY}, TIMING, {}, (), 10.0)
    assert due[CANARY] is None
    due = next_due(snapshot(), {"generate": None}, TIMING, {}, (), 10.0)
    assert CANARY not in due


def test_a_declared_window_is_due_to_end_at_its_deadline():
    snap = snapshot()
    ep = snap.endpoints["generate"]
    window = Maintenance("weights", since=5.0, until=35.0, since_wall=1e9)
    paused = replace(ep, lifecycle=replace(ep.lifecycle, maintenance=window))
    snap = rebuilt(snap, 10.0, endpoints={"generate": paused})
    due = next_due(snap, {"generate": Job.CANARY}, TIMING, {}, (), 10.0)
    assert due[WINDOW] == 35.0
    assert due[CANARY] is None  # paused: no canary
