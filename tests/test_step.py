"""The one pure step (sidecar/core/step.py): the snapshot before and an observation in, the
snapshot after and the events it caused out. No clock, no I/O: tested as tables."""

from __future__ import annotations

from typing import get_args

import pytest

from sidecar.core.events import Kind
from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.observations import (
    CanaryDone,
    DrainAsked,
    Heartbeat,
    MaintenanceDeclared,
    MaintenanceOver,
    ModelServed,
    Observation,
    Registered,
)
from sidecar.core.snapshot import Snapshot, readiness_of
from sidecar.core.step import _STEPS, step
from tests.support.configured import health_of, settings_from

pytestmark = pytest.mark.unit

OK = Result(Outcome.SUCCESS, "GET /health -> 200", 1.0, 1.01, 1e9, "", 200)
GONE = Result(Outcome.ERROR, "GET /health: connection refused", 2.0, 2.01, 1e9, "", None)
PASS = Result(Outcome.SUCCESS, "complete, well-formed answer", 1.1, 1.2, 1e9, "canary-1", 200)
SLOW = Result(Outcome.TIMEOUT, "canary timeout after 0.5 s", 1.1, 1.6, 1e9, "canary-2", None)


def fresh(monkeypatch: pytest.MonkeyPatch) -> Snapshot:
    settings = settings_from(monkeypatch, DYN_HEALTH_CHECK_ENABLED="true", SIDECAR_MODEL="tiny")
    return health_of(settings, clock=lambda: 0.0).snapshot


def run(snap: Snapshot, *observations: Observation, now: float = 1.5) -> list[list[str]]:
    """The events' texts (or kinds, for those not logged) of each step, in order."""
    said = []
    for obs in observations:
        stepped = step(snap, obs, now)
        snap = stepped.snapshot
        said.append([e.text if e.text is not None else str(e.kind) for e in stepped.events])
    return said


@pytest.mark.parametrize(
    ("observations", "said"),
    [
        (
            [Registered("generate", OK)],
            [
                [
                    "generate: engine registered (GET /health -> 200)",
                    "worker notready (rule starting_status): generate: no verdict yet; "
                    "DYN_SYSTEM_STARTING_HEALTH_STATUS=notready",
                ]
            ],
        ),
        (
            [Registered("generate", OK), CanaryDone("generate", PASS, 1)],
            [
                ["generate: engine registered (GET /health -> 200)", "*"],
                [
                    "canary",
                    "generate: endpoint ready: *",
                    "worker ready (rule monitored_endpoints): *",
                ],
            ],
        ),
        (  # a result from an incarnation that is gone says nothing about now
            [Registered("generate", OK), CanaryDone("generate", PASS, 7)],
            [["*", "*"], ["canary", "generate: dropped the result of canary canary-1: *"]],
        ),
        (  # the same observation twice: its change is told once
            [Registered("generate", OK), Registered("generate", OK), Heartbeat()],
            [["*", "*"], [], []],
        ),
        (
            [Registered("generate", OK), ModelServed("generate", "tiny")],
            [["*", "*"], []],
        ),
        (
            [Registered("generate", OK), ModelServed("generate", "other")],
            [["*", "*"], ["generate: served model is 'other' (from GET /v1/models)"]],
        ),
        (
            [Registered("generate", OK), CanaryDone("generate", PASS, 1), DrainAsked()],
            [["*", "*"], ["*", "*", "*"], ["worker notready (rule draining): *"]],
        ),
        (
            [Registered("generate", OK), Registered("generate", GONE)],
            [["*", "*"], ["generate: engine deregistered (*)", "*"]],
        ),
        (
            [
                Registered("generate", OK),
                MaintenanceDeclared("weights", 30.0, 1e9),
                MaintenanceOver("ended by hand"),
            ],
            [
                ["*", "*"],
                ["generate: paused: maintenance: weights *", "generate: endpoint notready: *"],
                [
                    "generate: resumed (maintenance ended: ended by hand); a canary proves the "
                    "engine before it is ready",
                    "generate: endpoint unknown: *",
                ],
            ],
        ),
    ],
)
def test_each_observation_tells_its_changes_once(monkeypatch, observations, said):
    got = run(fresh(monkeypatch), *observations)
    assert len(got) == len(said)
    for texts, patterns in zip(got, said, strict=True):
        assert len(texts) == len(patterns), (texts, patterns)
        for text, pattern in zip(texts, patterns, strict=True):
            head, _, _ = pattern.partition("*")
            assert text.startswith(head), (text, pattern)


def test_timeouts_after_a_pass_turn_the_worker_notready_at_the_threshold(monkeypatch):
    snap = fresh(monkeypatch)  # SIDECAR_FAILURE_THRESHOLD=2
    for obs in (Registered("generate", OK), CanaryDone("generate", PASS, 1)):
        snap = step(snap, obs, 1.5).snapshot
    first = step(snap, CanaryDone("generate", SLOW, 1), 1.6)
    assert readiness_of(first.snapshot, 1.6).ready
    assert [e.kind for e in first.events] == [Kind.CANARY, Kind.NOTE]  # the timeout, at DEBUG
    snap = first.snapshot
    later = Result(Outcome.TIMEOUT, "canary timeout after 0.5 s", 1.65, 2.15, 1e9, "canary-3")
    stepped = step(snap, CanaryDone("generate", later, 1), 2.2)
    assert not readiness_of(stepped.snapshot, 2.2).ready
    kinds = [e.kind for e in stepped.events]
    assert kinds[0] is Kind.CANARY
    assert Kind.READINESS in kinds
    assert stepped.snapshot.verdicts["generate"].reason.startswith("canary timeout")


def test_the_step_is_pure(monkeypatch):
    snap = fresh(monkeypatch)
    once = step(snap, Registered("generate", OK), 1.5)
    again = step(snap, Registered("generate", OK), 1.5)
    assert once == again
    assert not snap.endpoints["generate"].registration.registered  # the input is unchanged
    assert once.snapshot.heartbeat == 1.5


def test_every_kind_of_observation_has_its_step():
    assert set(get_args(Observation)) == set(_STEPS)
