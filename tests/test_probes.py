"""``health-sidecar probes``: the engine container's probes, sized from the settings.

The YAML is parsed with PyYAML (installed with uvicorn[standard]; kubernetes-validate needs it
too), and the arithmetic is checked against the goals: a long load never restarts the engine, a
busy engine is never killed before the liveness window, a hung engine leaves rotation within
about 30 s.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import yaml

from sidecar.tools.probes import READINESS_TARGET_SECONDS, render, size
from sidecar.wiring import Blueprint
from tests.support.configured import blueprint_from
from tests.support.harness import ROOT, base_env

CANARY = {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
}
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def probes(blueprint: Blueprint, max_load: float = 7200) -> dict[str, Any]:
    parsed = yaml.safe_load(render(blueprint, max_load))
    assert isinstance(parsed, dict)
    return parsed


@pytest.mark.unit
def test_three_http_probes_on_the_sidecar_port_and_paths(monkeypatch):
    out = probes(blueprint_from(monkeypatch, **CANARY))
    assert list(out) == list(PROBES)
    paths = {name: out[name]["httpGet"]["path"] for name in PROBES}
    assert paths == {
        "startupProbe": "/health",
        "livenessProbe": "/live",
        "readinessProbe": "/health",
    }
    for name in PROBES:
        assert out[name]["httpGet"]["port"] == 9090
        assert set(out[name]["httpGet"]) == {"path", "port"}  # pod IP, plain HTTP
        assert out[name]["timeoutSeconds"] >= 2  # never Kubernetes' default of 1 s
    assert out["livenessProbe"]["failureThreshold"] > 1  # never one failure
    assert out["livenessProbe"]["terminationGracePeriodSeconds"] > 0
    assert out["readinessProbe"]["successThreshold"] == 1


@pytest.mark.unit
def test_port_and_paths_follow_the_settings(monkeypatch):
    b = blueprint_from(
        monkeypatch,
        DYN_SYSTEM_PORT="9345",
        DYN_SYSTEM_HEALTH_PATH="/ready",
        DYN_SYSTEM_LIVE_PATH="/alive",
        **CANARY,
    )
    out = probes(b)
    assert {out[n]["httpGet"]["port"] for n in PROBES} == {9345}
    assert out["livenessProbe"]["httpGet"]["path"] == "/alive"
    assert out["startupProbe"]["httpGet"]["path"] == out["readinessProbe"]["httpGet"]["path"]
    assert out["readinessProbe"]["httpGet"]["path"] == "/ready"


@pytest.mark.unit
def test_a_path_yaml_would_misread_is_quoted(monkeypatch):
    out = probes(blueprint_from(monkeypatch, DYN_SYSTEM_HEALTH_PATH="/a:b,[c]", **CANARY))
    assert out["readinessProbe"]["httpGet"]["path"] == "/a:b,[c]"


@pytest.mark.unit
def test_defaults_take_a_hung_engine_out_of_rotation_within_30_s(monkeypatch):
    b = blueprint_from(monkeypatch, **CANARY)
    z = size(b, 7200)
    # wait + retry + (failures - 1) x max(retry, timeout) + timeout = 10 + 1 + 3 + 3
    assert z.hang_to_notready == 17
    out = probes(b)["readinessProbe"]
    out_of_rotation = z.hang_to_notready + out["periodSeconds"] * out["failureThreshold"]
    assert out_of_rotation == z.hang_to_unready <= READINESS_TARGET_SECONDS
    assert out["failureThreshold"] >= 2  # one lost probe does not flap readiness


@pytest.mark.unit
@pytest.mark.parametrize("max_load", [60, 600, 7200, 4 * 3600, 12.5])
def test_startup_covers_the_longest_load(monkeypatch, max_load):
    b = blueprint_from(monkeypatch, **CANARY)
    out = probes(b, max_load)["startupProbe"]
    # The kubelet kills at the failureThreshold-th failure; the first probe runs at start.
    killed_at = (out["failureThreshold"] - 1) * out["periodSeconds"]
    assert killed_at >= max_load + size(b, max_load).load_to_ready
    assert killed_at < max_load + size(b, max_load).load_to_ready + 2 * out["periodSeconds"]


@pytest.mark.unit
def test_two_hour_load_default(monkeypatch):
    out = probes(blueprint_from(monkeypatch, **CANARY))["startupProbe"]
    assert out["periodSeconds"] * (out["failureThreshold"] - 1) >= 7200


@pytest.mark.unit
@pytest.mark.parametrize("canary", [True, False])
def test_liveness_never_kills_within_the_window(monkeypatch, canary):
    b = blueprint_from(monkeypatch, **(CANARY if canary else {}))
    z = size(b, 7200)
    out = probes(b)["livenessProbe"]
    # /live fails only after liveness_window of uninterrupted hard failure (busy engines pass
    # canaries, loading ones are not hard failures); the kubelet then needs failureThreshold
    # consecutive failures, the first of which can come at once.
    earliest_kill = (
        b.settings.liveness_window + (out["failureThreshold"] - 1) * out["periodSeconds"]
    )
    assert earliest_kill > b.settings.liveness_window
    # The failures span long enough that a sidecar restart (connection refused) is not a kill.
    assert (out["failureThreshold"] - 1) * out["periodSeconds"] >= 20
    # And a hang is still acted on: restart within window + detection + the kubelet's failures.
    assert z.hang_to_restart <= b.settings.liveness_window + 60


@pytest.mark.unit
def test_numbers_follow_the_settings(monkeypatch):
    base = size(blueprint_from(monkeypatch, **CANARY), 7200)
    slow = size(blueprint_from(monkeypatch, DYN_CANARY_WAIT_TIME="20", **CANARY), 7200)
    assert slow.hang_to_notready == base.hang_to_notready + 10
    assert slow.readiness.period < base.readiness.period  # still within the target
    assert slow.hang_to_unready <= READINESS_TARGET_SECONDS
    longer = size(blueprint_from(monkeypatch, **CANARY), 3 * 3600)
    assert longer.startup.failures > base.startup.failures
    shorter = size(blueprint_from(monkeypatch, **CANARY), 300)
    assert shorter.startup.failures < base.startup.failures
    patient = size(
        blueprint_from(monkeypatch, SIDECAR_SUCCESS_THRESHOLD="3", **CANARY),
        7200,
    )
    assert patient.load_to_ready > base.load_to_ready
    window = size(blueprint_from(monkeypatch, SIDECAR_LIVENESS_WINDOW="300", **CANARY), 7200)
    assert window.hang_to_restart == base.hang_to_restart + 180
    assert "300 s on one liveness clock" in render(
        blueprint_from(monkeypatch, SIDECAR_LIVENESS_WINDOW="300", **CANARY), 7200
    )


@pytest.mark.unit
def test_a_stall_under_load_is_seen_sooner(monkeypatch):
    z = size(blueprint_from(monkeypatch, SIDECAR_STALL_WINDOW="6", **CANARY), 7200)
    assert z.stall_to_notready == 6  # the stall window is the bound (timeout 3 s, reads 1 s)
    assert z.stall_to_notready < z.hang_to_notready
    off = blueprint_from(monkeypatch, SIDECAR_PROGRESS_ENABLED="false", **CANARY)
    assert size(off, 7200).stall_to_notready is None
    assert "counters stopping" not in render(off, 7200)


@pytest.mark.unit
def test_without_a_canary_readiness_follows_registration(monkeypatch):
    b = blueprint_from(monkeypatch)  # canaries off by default
    z = size(b, 7200)
    assert not z.canary
    assert z.hang_to_notready == b.settings.registration_interval + b.settings.request_timeout
    assert "no canary" in render(b, 7200)


@pytest.mark.unit
def test_target_out_of_reach_is_said(monkeypatch):
    b = blueprint_from(monkeypatch, DYN_CANARY_WAIT_TIME="60", **CANARY)
    z = size(b, 7200)
    assert z.readiness.period == 1
    assert z.hang_to_unready > READINESS_TARGET_SECONDS
    assert "WARNING: a hung engine leaves rotation only after" in render(b, 7200)


@pytest.mark.unit
def test_loopback_bind_is_warned(monkeypatch):
    text = render(blueprint_from(monkeypatch, DYN_SYSTEM_HOST="127.0.0.1", **CANARY), 7200)
    assert "WARNING: DYN_SYSTEM_HOST=127.0.0.1" in text


@pytest.mark.unit
def test_every_number_is_explained(monkeypatch):
    text = render(blueprint_from(monkeypatch, **CANARY), 7200)
    lines = text.splitlines()
    assert all(len(line) <= 100 for line in lines)
    assert "721 x 10 s = 7210 s >= 7200 s load" in text
    assert "out of rotation within 17 + 2 x 5 = 27 s" in text
    for name in PROBES:
        at = lines.index(f"{name}:")
        assert lines[at + 1].lstrip().startswith("#")  # a comment on why, under each probe


@pytest.mark.unit
@pytest.mark.parametrize("bad", [0, -5, float("inf"), float("nan")])
def test_bad_load_time_is_refused(monkeypatch, bad):
    with pytest.raises(ValueError, match="max-load-seconds"):
        size(blueprint_from(monkeypatch), bad)


@pytest.mark.process
def test_command_line():
    env = base_env() | {"DYN_HEALTH_CHECK_ENABLED": "true", "DYN_SYSTEM_PORT": "9191"}
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar", "probes", "--max-load-seconds", "3600"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = yaml.safe_load(proc.stdout)
    assert out["startupProbe"]["httpGet"]["port"] == 9191
    assert (out["startupProbe"]["failureThreshold"] - 1) * 10 >= 3600
    assert "--max-load-seconds 3600" in proc.stdout
