"""The alerts in deploy/monitoring, proven with Prometheus's own tools and a real Prometheus.

- ``promtool check rules`` and ``promtool test rules`` (deploy/monitoring/rules.test.yml: every
  alert fires and does not fire) on the single source, deploy/monitoring/rules.yml;
- the PrometheusRule embeds exactly those groups (no drift);
- ``promtool check metrics`` on the sidecar's real /metrics when ready, notready after a
  generation hang, and draining after SIGTERM;
- a real Prometheus server on a free loopback port scrapes a real sidecar beside the fake engine
  and evaluates the rules: a generation hang makes the disagreement, not-ready and
  liveness-about-to-fail alerts fire, read back from /api/v1/alerts, and they resolve after
  recovery; a draining sidecar does not fire not-ready; a killed sidecar fires HealthSidecarDown.
  The real rules' ``for:`` are minutes, so the server loads a copy whose expressions, labels
  and annotations are the real ones and whose non-zero ``for:`` is rewritten to FOR_IN_TEST.

Prometheus and promtool come from Debian's ``prometheus`` package (2.42), installed by
scripts/prepare_prometheus.sh. Without them these tests skip naming the script; under CI (``CI``
set) they fail instead, since .ci/run prepares them first.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.harness import LOOPBACK, ROOT, Proc, base_env, free_port, wait_until
from tests.support.prerequisites import missing as prerequisite_missing

PREPARE = "scripts/prepare_prometheus.sh"
MONITORING = ROOT / "deploy" / "monitoring"
RULES = MONITORING / "rules.yml"
RULES_TEST = MONITORING / "rules.test.yml"
PROMETHEUS_RULE = MONITORING / "prometheusrule.yaml"
RENDER = MONITORING / "render_prometheusrule.py"

CANARY_ON = {"DYN_HEALTH_CHECK_ENABLED": "true"}
LIVENESS_WINDOW = 6.0  # seconds: the liveness alert fires at 0.75 of it, 4.5 s into a hang
FOR_IN_TEST = "2s"
POD, NAMESPACE, JOB = "worker-0", "alerts-test", "health-sidecar"


def require(*tools: str) -> dict[str, str]:
    """The tools' paths, or skip (fail under CI) naming the script that installs them."""
    found = {tool: shutil.which(tool) for tool in tools}
    missing = [tool for tool, path in found.items() if path is None]
    if missing:
        prerequisite_missing(f"{', '.join(missing)} missing: run {PREPARE}")
    return {tool: str(path) for tool, path in found.items()}


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    tool = require("promtool")["promtool"]
    return subprocess.run(
        [tool, *args], input=stdin, capture_output=True, text=True, timeout=60, cwd=MONITORING
    )


def alerting_rules(groups: dict[str, Any]) -> list[dict[str, Any]]:
    return [rule for group in groups["groups"] for rule in group["rules"] if "alert" in rule]


# --- the rule files ---------------------------------------------------------------------------


@pytest.mark.system
def test_promtool_check_rules_passes():
    result = promtool("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    count = len(alerting_rules(yaml.safe_load(RULES.read_text())))
    assert f"SUCCESS: {count} rules found" in result.stdout


@pytest.mark.system
def test_promtool_unit_tests_of_every_alert_pass():
    result = promtool("test", "rules", RULES_TEST.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.unit
def test_unit_tests_cover_every_alert_firing_and_not_firing():
    alerts = {rule["alert"] for rule in alerting_rules(yaml.safe_load(RULES.read_text()))}
    fires, quiet = set(), set()
    for case in yaml.safe_load(RULES_TEST.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert fires == alerts, f"alerts never seen firing: {alerts - fires}"
    assert quiet == alerts, f"alerts never seen quiet: {alerts - quiet}"


@pytest.mark.process
def test_prometheusrule_embeds_the_rule_file_unchanged():
    resource = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert resource["apiVersion"] == "monitoring.coreos.com/v1"
    assert resource["kind"] == "PrometheusRule"
    assert resource["spec"] == yaml.safe_load(RULES.read_text())
    check = subprocess.run(
        [sys.executable, str(RENDER), "--check"], capture_output=True, text=True, timeout=30
    )
    assert check.returncode == 0, check.stderr  # the file is byte for byte what the script writes


@pytest.mark.unit
def test_every_alert_is_actionable():
    """A severity as llm-d and Dynamo use them, and annotations naming the pod and namespace."""
    for rule in alerting_rules(yaml.safe_load(RULES.read_text())):
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        summary, description = rule["annotations"]["summary"], rule["annotations"]["description"]
        if "absent(" not in rule["expr"]:  # absent() has no pod to name
            for text in (summary, description):
                assert "$labels.pod" in text, name
                assert "$labels.namespace" in text, name
        assert len(description.split()) >= 30, f"{name}: description is no runbook"
        for label in ("cause", "outcome"):  # the reason, where the metric carries it
            if f"by (namespace, pod, endpoint, {label})" in rule["expr"]:
                assert f"$labels.{label}" in summary, name


# --- the sidecar's real /metrics ---------------------------------------------------------------


def lint(text: str) -> None:
    result = promtool("check", "metrics", stdin=text)
    assert result.returncode == 0, result.stdout + result.stderr
    output = result.stdout + result.stderr
    assert output.strip() == "", output  # no lint finding at all


def sample(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(f"{name} ") or line.startswith(f"{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.system
def test_promtool_check_metrics_passes_in_every_state(engine, sidecar):
    require("promtool")
    fake = engine("vllm", "aggregated")
    env = CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url, "SIDECAR_DRAIN_TIMEOUT": "30"}
    side = sidecar(env)
    side.wait_status(200, 5)
    ready = side.metrics()
    assert sample(ready, "health_sidecar_ready") == 1
    lint(ready)

    fake.fault(hang_generation=True)
    side.wait_status(503, 5)
    wait_until(
        lambda: "health_sidecar_liveness_clock_seconds{" in side.metrics(), 5, what="a clock"
    )
    notready = side.metrics()
    assert sample(notready, "health_sidecar_ready") == 0
    assert sample(notready, "health_sidecar_engine_health_disagrees") == 1
    lint(notready)

    fake.fault(hang_generation=False)
    side.wait_status(200, 5)
    side.proc.signal(signal.SIGTERM)
    side.wait_status(503, 2)
    draining = side.metrics()
    assert sample(draining, "health_sidecar_draining") == 1
    lint(draining)


# --- a real Prometheus -------------------------------------------------------------------------


class Prometheus:
    """The prometheus server on a free loopback port, its data in a temporary directory."""

    def __init__(self, directory: Path, rules: dict[str, Any], target: str) -> None:
        binary = require("prometheus", "promtool")["prometheus"]
        self.port = free_port()
        (directory / "rules.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
        config = {
            "global": {
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "evaluation_interval": "1s",
            },
            "rule_files": ["rules.yml"],
            "scrape_configs": [
                {
                    "job_name": JOB,
                    "static_configs": [
                        {"targets": [target], "labels": {"pod": POD, "namespace": NAMESPACE}}
                    ],
                }
            ],
        }
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        checked = promtool("check", "config", str(directory / "prometheus.yml"))
        assert checked.returncode == 0, checked.stdout + checked.stderr
        argv = [
            binary,
            f"--config.file={directory / 'prometheus.yml'}",
            f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address={LOOPBACK}:{self.port}",
            "--log.level=warn",
        ]
        self.proc = Proc(argv, base_env(), "prometheus")
        self.http = httpx.Client(timeout=2.0, trust_env=False)
        try:
            wait_until(self._ready, 20, interval=0.1, what="prometheus /-/ready")
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def _ready(self) -> bool:
        if self.proc.popen.poll() is not None:
            raise AssertionError(f"prometheus exited: {self.proc.output()[-3000:]}")
        return self.http.get(f"{self.url}/-/ready").status_code == 200

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = self.http.get(f"{self.url}/api/v1/query", params={"query": expr}).json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def alerts(self, state: str | None = None) -> list[dict[str, Any]]:
        body = self.http.get(f"{self.url}/api/v1/alerts").json()
        assert body["status"] == "success", body
        found = body["data"]["alerts"]
        return [a for a in found if state is None or a["state"] == state]

    def alert(self, name: str, state: str = "firing") -> dict[str, Any] | None:
        for found in self.alerts(state):
            if found["labels"]["alertname"] == name:
                return found
        return None

    def close(self) -> None:
        self.http.close()
        self.proc.stop()  # SIGTERM to its process group, SIGKILL after 5 s


def rules_for_test() -> dict[str, Any]:
    """The real rules with each non-zero ``for:`` shortened to FOR_IN_TEST; nothing else changes."""
    rules = yaml.safe_load(RULES.read_text())
    for rule in alerting_rules(rules):
        if rule.get("for", "0s") not in ("0s", "0m"):
            rule["for"] = FOR_IN_TEST
    return rules


@pytest.fixture
def prometheus(tmp_path):
    started: list[Prometheus] = []

    def start(target: str) -> Prometheus:
        server = Prometheus(tmp_path, rules_for_test(), target)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


def start_pair(engine, sidecar, prometheus, **env: str):
    fake = engine("vllm", "aggregated")
    settings = CANARY_ON | {
        "SIDECAR_ENGINE_URL": fake.url,
        "SIDECAR_LIVENESS_WINDOW": str(LIVENESS_WINDOW),
        "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
    }
    side = sidecar(settings | env)
    side.wait_status(200, 5)
    server = prometheus(f"{LOOPBACK}:{side.port}")
    wait_until(
        lambda: server.query(f'health_sidecar_ready{{pod="{POD}"}} == 1'),
        10,
        interval=0.1,
        what="prometheus to scrape the ready sidecar",
    )
    return fake, side, server


def wait_alert(server: Prometheus, name: str, since: float, timeout: float) -> tuple[dict, float]:
    found = wait_until(lambda: server.alert(name), timeout, interval=0.1, what=f"{name} firing")
    return found, time.monotonic() - since


@pytest.mark.system
def test_a_generation_hang_fires_the_alerts_on_a_real_prometheus_and_they_resolve(
    engine, sidecar, prometheus
):
    fake, side, server = start_pair(engine, sidecar, prometheus)
    # Before the first scrape (Prometheus's discovery sends targets after up to 5 s) the
    # shortened HealthSidecarTargetsMissing may fire; it resolves once the target is scraped.
    wait_until(lambda: not server.alerts("firing"), 10, interval=0.1, what="no alert firing")
    assert server.query(f'up{{job="{JOB}"}}')[0]["value"][1] == "1"

    fake.fault(hang_generation=True)
    hung_at = time.monotonic()
    hung, hung_after = wait_alert(server, "HealthSidecarEngineHungBehindHealthyRoute", hung_at, 15)
    notready, notready_after = wait_alert(server, "HealthSidecarWorkerNotReady", hung_at, 15)
    live, live_after = wait_alert(server, "HealthSidecarLivenessAboutToFail", hung_at, 20)
    for found in (hung, notready, live):
        assert found["labels"]["pod"] == POD
        assert found["labels"]["namespace"] == NAMESPACE
        assert f"{NAMESPACE}/{POD}" in found["annotations"]["summary"]
        assert f"{NAMESPACE}/{POD}" in found["annotations"]["description"]
    assert hung["labels"]["severity"] == "critical"
    assert hung["labels"]["endpoint"] == "generate"
    assert live["labels"]["cause"] == "canary failing hard"
    assert "canary failing hard" in live["annotations"]["summary"]
    assert float(live["value"]) > 0.75
    assert live_after >= 0.75 * LIVENESS_WINDOW  # not before the clock says so

    fake.fault(hang_generation=False)
    released_at = time.monotonic()
    resolved = {}
    names = [
        "HealthSidecarEngineHungBehindHealthyRoute",
        "HealthSidecarWorkerNotReady",
        "HealthSidecarLivenessAboutToFail",
    ]
    for name in names:
        wait_until(
            lambda name=name: (
                server.alert(name, "firing") is None and server.alert(name, "pending") is None
            ),
            15,
            interval=0.1,
            what=f"{name} to resolve",
        )
        resolved[name] = time.monotonic() - released_at
    side.wait_status(200, 1)
    print(
        f"ALERTS fire after hang: disagrees {hung_after:.1f} s, not ready {notready_after:.1f} s,"
        f" liveness {live_after:.1f} s (window {LIVENESS_WINDOW:g} s, for {FOR_IN_TEST});"
        " resolve after recovery: "
        + ", ".join(f"{n.removeprefix('HealthSidecar')} {t:.1f} s" for n, t in resolved.items())
    )


@pytest.mark.system
def test_draining_does_not_fire_not_ready_and_a_dead_sidecar_fires_down(
    engine, sidecar, prometheus
):
    _fake, side, server = start_pair(engine, sidecar, prometheus, SIDECAR_DRAIN_TIMEOUT="30")
    side.proc.signal(signal.SIGTERM)
    side.wait_status(503, 2)
    wait_until(
        lambda: server.query(f'health_sidecar_draining{{pod="{POD}"}} == 1'),
        5,
        interval=0.1,
        what="prometheus to see the sidecar draining",
    )
    # Longer than FOR_IN_TEST plus a scrape and an evaluation: not-ready would be firing by now.
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:
        assert server.query(f'health_sidecar_ready{{pod="{POD}"}} == 0')
        assert server.alert("HealthSidecarWorkerNotReady", "pending") is None
        assert server.alert("HealthSidecarWorkerNotReady", "firing") is None
        time.sleep(0.2)

    side.proc.kill()
    killed_at = time.monotonic()
    down, down_after = wait_alert(server, "HealthSidecarDown", killed_at, 15)
    assert down["labels"]["pod"] == POD
    assert down["labels"]["namespace"] == NAMESPACE
    assert down["labels"]["severity"] == "critical"
    assert f"{NAMESPACE}/{POD}" in down["annotations"]["summary"]
    assert server.alert("HealthSidecarTargetsMissing") is None  # the target exists, down
    print(f"ALERTS HealthSidecarDown fires {down_after:.1f} s after the sidecar is killed")
