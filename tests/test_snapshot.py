"""One writer, one snapshot: the HTTP answers read the monitor's published state, and a monitor
that stops publishing is noticed (the verdict is stale) instead of served forever."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.observations import CanaryDone, DrainAsked, Heartbeat, Registered
from sidecar.core.verdict import HEARTBEAT_STALE
from sidecar.runtime.health import Health
from sidecar.surface.app import create_app
from sidecar.surface.metrics import Metrics
from sidecar.wiring import health_for
from tests.support.configured import blueprint_from

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ready_health(monkeypatch) -> tuple[Health, Clock, TestClient]:
    blueprint = blueprint_from(monkeypatch, DYN_HEALTH_CHECK_ENABLED="true", SIDECAR_MODEL="tiny")
    clock = Clock()
    health = health_for(blueprint, clock=clock)
    ok = Result(Outcome.SUCCESS, "GET /health -> 200", 100.0, 100.01, 1e9, "", 200)
    health.observe(Registered("generate", ok))
    canary = Result(Outcome.SUCCESS, "fine", 100.02, 100.03, 1e9, "canary-1", 200)
    incarnation = health.snapshot.endpoints["generate"].incarnation
    health.observe(CanaryDone("generate", canary, incarnation))
    app = create_app(blueprint.about, health, Metrics(health, blueprint.about))
    return health, clock, TestClient(app)


def test_a_fresh_snapshot_serves_the_verdict(monkeypatch):
    health, clock, client = ready_health(monkeypatch)
    assert client.get("/health").status_code == 200
    assert client.get("/sidecar/live").status_code == 200
    clock.now += HEARTBEAT_STALE - 1
    health.observe(Heartbeat())  # the monitor's heartbeat
    clock.now += HEARTBEAT_STALE - 1
    assert client.get("/health").status_code == 200


def test_a_stuck_monitor_is_not_served_as_a_verdict(monkeypatch):
    _, clock, client = ready_health(monkeypatch)
    clock.now += HEARTBEAT_STALE + 0.5  # no heartbeat since
    health = client.get("/health")
    assert health.status_code == 503
    assert health.json()["rule"] == "stale"
    assert "the monitor has not run for" in health.json()["reason"]
    live = client.get("/live")
    assert live.status_code == 200  # the engine may be fine: restart the sidecar, not it
    assert live.json()["reason"].startswith("unknown: the monitor has not run")
    own = client.get("/sidecar/live")
    assert own.status_code == 503
    assert own.json()["status"] == "notlive"
    assert "health_sidecar_ready 0.0" in client.get("/metrics").text


def test_draining_is_applied_by_the_writer_and_wins(monkeypatch):
    health, _, client = ready_health(monkeypatch)
    health.observe(DrainAsked())
    body = client.get("/health").json()
    assert body["rule"] == "draining"
    assert client.get("/live").status_code == 200
