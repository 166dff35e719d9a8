"""The Grafana dashboard in deploy/monitoring, checked against the sidecar's real metrics.

- dashboard.json is exactly what deploy/monitoring/dashboard.py (grafana-foundation-sdk) writes
  now, and dashboard-configmap.yaml embeds exactly that JSON in a ConfigMap in the namespace
  monitoring labelled grafana_dashboard: "1" (no drift), valid for kubernetes-validate --strict;
- every panel has a title and at least one query; every query (and every variable's
  label_values selector) parses with promql-parser once Grafana's variables are replaced by
  valid placeholders, and every metric it selects is one the sidecar exports: the names come
  from the sidecar's own exposition, built in-process (sidecar.wiring.surface_for) and read back
  with prometheus_client's parser (a counter's _total and a histogram's _bucket, _count and _sum
  count as its names);
- every topic the dashboard is for (readiness and liveness per pod, canary outcomes and latency,
  engine in-flight and progress, disagreements, transitions, ...) has a panel naming its metric.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.support.deployfiles import OLDEST_K8S, need, newest_k8s, run
from tests.support.harness import ROOT

promql_parser = pytest.importorskip("promql_parser", reason="pip install -e '.[dev]'")
pytest.importorskip("grafana_foundation_sdk", reason="pip install -e '.[dev]'")

MONITORING = ROOT / "deploy" / "monitoring"
SCRIPT = MONITORING / "dashboard.py"
DASHBOARD_JSON = MONITORING / "dashboard.json"
CONFIGMAP = MONITORING / "dashboard-configmap.yaml"

# Grafana's variables, replaced before parsing: durations where PromQL wants a duration, a plain
# label value elsewhere (they only ever stand inside a quoted matcher value there).
DURATIONS = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h"}
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")

# Each topic of the dashboard: the metrics of which at least one must appear in some query.
TOPICS = {
    "worker readiness per pod": {"health_sidecar_ready"},
    "worker liveness per pod": {"health_sidecar_live"},
    "endpoint readiness": {"health_sidecar_endpoint_ready"},
    "canary outcomes": {"health_sidecar_canary_total"},
    "canary latency": {"health_sidecar_canary_duration_seconds_bucket"},
    "engine in flight": {"health_sidecar_engine_in_flight_requests"},
    "engine progress": {"health_sidecar_last_progress_timestamp_seconds"},
    "engine stalled": {"health_sidecar_engine_stalled"},
    "disagreement now": {"health_sidecar_engine_health_disagrees"},
    "disagreements counted": {"health_sidecar_engine_health_disagreements_total"},
    "transitions": {"health_sidecar_endpoint_transitions_total"},
    "liveness clock": {"health_sidecar_liveness_clock_seconds"},
    "liveness window": {"health_sidecar_liveness_window_seconds"},
    "draining": {"health_sidecar_draining"},
}


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("health_sidecar_dashboard", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script()


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_JSON.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Every series name the sidecar's /metrics can carry, from its real exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    from sidecar.wiring import health_for, load, resolve, surface_for

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DYN_HEALTH_CHECK_ENABLED", "true")
        blueprint = resolve(load())
    text = surface_for(blueprint, health_for(blueprint)).metrics.exposition().decode()
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"]}
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        # A family is declared (# TYPE) even before its first sample (transitions, clocks).
        names.update(family.name + s for s in suffixes.get(family.type, [""]))
        names.update(sample.name for sample in family.samples)
    return names


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel but rows, including those inside collapsed rows."""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def targets(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def substitute(expr: str) -> str:
    def placeholder(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        return DURATIONS.get(name, "placeholder")

    return VARIABLE.sub(placeholder, expr)


def selected_metrics(expr: str) -> set[str]:
    """The metric names an expression selects (parsing fails loudly on invalid PromQL)."""
    found: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name or next(
                (m.value for m in node.matchers.matchers if m.name == "__name__"), None
            )
            assert name, f"a selector without a metric name in {expr!r}"
            found.add(name)

    promql_parser.walk(promql_parser.parse(substitute(expr)), visit)
    return found


# --- no drift -----------------------------------------------------------------------------------


@pytest.mark.unit
def test_committed_json_is_a_fresh_build(script: ModuleType):
    assert DASHBOARD_JSON.read_text(encoding="utf-8") == script.render_json(), (
        "dashboard.json is stale: run python deploy/monitoring/dashboard.py"
    )


@pytest.mark.unit
def test_configmap_embeds_exactly_the_json(script: ModuleType):
    text = CONFIGMAP.read_text(encoding="utf-8")
    assert text == script.render_configmap(DASHBOARD_JSON.read_text(encoding="utf-8")), (
        "dashboard-configmap.yaml is stale: run python deploy/monitoring/dashboard.py"
    )
    doc = yaml.safe_load(text)
    assert doc["apiVersion"] == "v1"
    assert doc["kind"] == "ConfigMap"
    assert doc["metadata"]["namespace"] == "monitoring"
    assert doc["metadata"]["labels"]["grafana_dashboard"] == "1"  # a string, as the sidecar wants
    assert list(doc["data"]) == ["health-sidecar.json"]
    assert doc["data"]["health-sidecar.json"] == DASHBOARD_JSON.read_text(encoding="utf-8")


@pytest.mark.process
def test_configmap_is_valid_kubernetes(tmp_path: Path):
    validator = need("kubernetes-validate", "pip install kubernetes-validate")
    for version in (OLDEST_K8S, newest_k8s(validator)):
        proc = run([validator, "--strict", "--quiet", "-k", version, str(CONFIGMAP)])
        assert proc.returncode == 0, f"{version}: {proc.stdout}{proc.stderr}"


# --- the dashboard ------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_json_round_trips_through_the_sdk_model(dashboard: dict[str, Any]):
    """grafana-foundation-sdk's Dashboard model reads the JSON back without losing a field."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    model = Dashboard.from_json(dashboard)
    assert json.loads(json.dumps(model, cls=JSONEncoder)) == dashboard


@pytest.mark.unit
def test_dashboard_identity_and_variables(dashboard: dict[str, Any]):
    assert dashboard["uid"] == "health-sidecar"
    assert dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert list(variables) == ["datasource", "namespace", "pod"]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["pod"]["multi"] is True
    assert variables["pod"]["includeAll"] is True


@pytest.mark.unit
def test_every_panel_has_a_title_and_a_query(dashboard: dict[str, Any]):
    found = list(panels(dashboard))
    assert len(found) >= 10
    for panel in found:
        assert panel.get("title"), panel
        assert panel.get("targets"), f"{panel['title']}: no query"
        for target in panel["targets"]:
            assert target.get("expr", "").strip(), f"{panel['title']}: an empty query"
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


@pytest.mark.unit
def test_every_query_is_filtered_by_namespace_and_pod(dashboard: dict[str, Any]):
    for title, expr in targets(dashboard):
        for metric in selected_metrics(expr):
            selectors = re.findall(rf"{metric}\{{([^}}]*)\}}", expr)
            assert selectors, f"{title}: {metric} unfiltered in {expr!r}"
            for matchers in selectors:
                assert 'namespace="$namespace"' in matchers, f"{title}: {expr!r}"
                assert 'pod=~"$pod"' in matchers, f"{title}: {expr!r}"


@pytest.mark.unit
def test_every_query_parses_and_names_exported_metrics(
    dashboard: dict[str, Any], exported: set[str]
):
    assert {"health_sidecar_ready", "health_sidecar_canary_duration_seconds_bucket"} <= exported
    for title, expr in targets(dashboard):
        metrics = selected_metrics(expr)
        assert metrics, f"{title}: {expr!r} selects no metric"
        unknown = metrics - exported
        assert not unknown, f"{title}: {sorted(unknown)} not exported by the sidecar"


@pytest.mark.unit
def test_variable_queries_name_exported_metrics(dashboard: dict[str, Any], exported: set[str]):
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        found = re.fullmatch(r"label_values\((.+), *(\w+)\)", variable["query"])
        assert found, variable["query"]
        assert selected_metrics(found.group(1)) <= exported, variable["query"]


@pytest.mark.unit
def test_the_checks_catch_a_bad_query(exported: set[str]):
    with pytest.raises(ValueError, match="unclosed left parenthesis"):
        selected_metrics('sum(rate(health_sidecar_ready{pod=~"$pod"}[$__rate_interval])')
    assert selected_metrics("health_sidecar_redy") - exported == {"health_sidecar_redy"}


@pytest.mark.unit
@pytest.mark.parametrize("topic", sorted(TOPICS))
def test_the_dashboard_covers(topic: str, dashboard: dict[str, Any]):
    named = {metric for _, expr in targets(dashboard) for metric in selected_metrics(expr)}
    assert TOPICS[topic] & named, f"no panel for {topic}: expected one of {sorted(TOPICS[topic])}"
