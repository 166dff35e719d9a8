"""The events a step hands to the log, the metrics and the history (sidecar/core/events.py),
derived from the states before and after: pure, tested as tables."""

from __future__ import annotations

import logging

import pytest

from sidecar.core.endpoint import EndpointState
from sidecar.core.events import Kind, verdict_events, worker_events
from sidecar.core.verdict import Cause, Liveness, Readiness, Rule, Verdict

pytestmark = pytest.mark.unit

EP = EndpointState("generate", True, "why")
READY, DOWN, NONE = (
    Verdict(True, "canary passed"),
    Verdict(False, "canary timeout"),
    Verdict(None, "no verdict yet"),
)


@pytest.mark.parametrize(
    ("was", "now", "ranked", "texts"),
    [
        (READY, READY, False, []),
        (READY, DOWN, False, ["generate: endpoint notready: canary timeout"]),
        (NONE, READY, False, ["generate: endpoint ready: canary passed"]),
        (DOWN, READY, True, ["generate: rank ready: canary passed"]),
    ],
)
def test_a_unit_verdict_change_is_one_event_that_says_itself(was, now, ranked, texts):
    events = verdict_events("generate", ranked, EP, EP, was, now, None)
    assert [e.text for e in events] == texts
    assert all(e.kind is Kind.VERDICT and e.label == e.text.split()[2][:-1] for e in events)


def test_a_ranked_endpoint_reports_its_combined_verdict_only_when_it_changes():
    degraded = Verdict(True, "degraded: 1 of 2 ranks ready", degraded=True)
    same = verdict_events("generate/rank1", True, EP, EP, READY, READY, ("generate", READY, READY))
    assert same == []
    (event,) = verdict_events(
        "generate/rank1", True, EP, EP, READY, READY, ("generate", READY, degraded)
    )
    assert (event.kind, event.label) == (Kind.ENDPOINT, "degraded")
    assert event.text == "generate: endpoint degraded: degraded: 1 of 2 ranks ready"


@pytest.mark.parametrize(
    ("last_ready", "last_live", "ready", "live", "kinds"),
    [
        (True, True, True, True, []),
        (None, True, False, True, [Kind.READINESS]),
        (True, True, False, False, [Kind.READINESS, Kind.LIVENESS]),
        (False, False, False, True, [Kind.LIVENESS]),
    ],
)
def test_the_worker_verdicts_are_told_once_per_change(last_ready, last_live, ready, live, kinds):
    readiness = Readiness(ready, Rule.MONITORED, "generate: canary timeout")
    liveness = Liveness(live, "generate: canary failing hard", None if live else Cause.CANARY)
    events = worker_events(last_ready, last_live, readiness, liveness)
    assert [e.kind for e in events] == kinds
    for event in events:
        if event.kind is Kind.LIVENESS:
            assert event.level == logging.WARNING
            assert event.text.startswith("worker live:" if live else "worker not live:")
        else:
            assert event.text.startswith(
                f"worker {'ready' if ready else 'notready'} (rule monitored_endpoints)"
            )
