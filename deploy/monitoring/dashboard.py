"""Write the health-sidecar Grafana dashboard: dashboard.json and dashboard-configmap.yaml.

Built as code with Grafana's own SDK (grafana-foundation-sdk, a dev extra). One row per topic:
worker verdicts per pod (ready, live, each endpoint, draining), canaries (outcomes, latency
p50/p95 from the histogram, failures in a row), the engine (in-flight requests, seconds since its
progress counters advanced, confirmed stalls), liveness (each running clock against the window),
and disagreements and verdict transitions. Variables: the Prometheus data source, the namespace
and the pods (several, or all). Series carry the `namespace` and `pod` labels the PodMonitor's
scrape sets, as the alerts in rules.yml expect.

The output is deterministic (stable uid, sorted keys), and tests/test_dashboard.py fails when the
committed files are not what this writes. Run after editing this file:
    python deploy/monitoring/dashboard.py
The ConfigMap (namespace monitoring, label grafana_dashboard: "1") is what Grafana's dashboard
sidecar loads, as the Dynamo platform's dashboards are shipped.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import statetimeline as timeline_b
from grafana_foundation_sdk.builders import timeseries as ts_b
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dash_m

HERE = Path(__file__).resolve().parent
JSON_PATH = HERE / "dashboard.json"
CONFIGMAP_PATH = HERE / "dashboard-configmap.yaml"

UID = "health-sidecar"
TITLE = "Health sidecar"
CONFIGMAP_KEY = "health-sidecar.json"

DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
# Every selector names the dashboard's variables (the PodMonitor's target labels).
SEL = 'namespace="$namespace", pod=~"$pod"'
RATE = "$__rate_interval"

GREEN, RED, ORANGE, BLUE = "green", "red", "orange", "blue"


def flag_mappings(zero: tuple[str, str], one: tuple[str, str]) -> list[dash_m.ValueMapping]:
    """0/1 gauges shown as words and colours."""
    return [
        dash_m.ValueMap(
            options={
                "0": dash_m.ValueMappingResult(text=zero[0], color=zero[1], index=0),
                "1": dash_m.ValueMappingResult(text=one[0], color=one[1], index=1),
            }
        )
    ]


def thresholds(*steps: tuple[float | None, str]) -> dash_b.ThresholdsConfig:
    return (
        dash_b.ThresholdsConfig()
        .mode(dash_m.ThresholdsMode.ABSOLUTE)
        .steps([dash_m.Threshold(value=value, color=color) for value, color in steps])
    )


def query(expr: str, legend: str, ref: str = "A") -> prom_b.Dataquery:
    return (
        prom_b.Dataquery()
        .expr(expr)
        .legend_format(legend)
        .ref_id(ref)
        .range()
        .datasource(DATASOURCE)
    )


def flag_timeline(
    title: str,
    description: str,
    expr: str,
    legend: str,
    zero: tuple[str, str],
    one: tuple[str, str],
    width: int = 12,
) -> timeline_b.Panel:
    return (
        timeline_b.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .with_target(query(expr, legend))
        .mappings(flag_mappings(zero, one))
        .color_scheme(dash_b.FieldColor().mode(dash_m.FieldColorModeId.THRESHOLDS))
        .thresholds(thresholds((None, zero[1]), (1, one[1])))
        .show_value(common.VisibilityMode.NEVER)
        .merge_values(True)
        .row_height(0.9)
        .fill_opacity(80)
        .line_width(0)
        .legend(common_b.VizLegendOptions().show_legend(False))
        .height(8)
        .span(width)
    )


def timeseries(
    title: str,
    description: str,
    targets: list[tuple[str, str]],
    unit: str,
    width: int = 12,
    bars: bool = False,
) -> ts_b.Panel:
    panel = (
        ts_b.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .line_width(1)
        .fill_opacity(10)
        .legend(
            common_b.VizLegendOptions()
            .show_legend(True)
            .display_mode(common.LegendDisplayMode.TABLE)
            .placement(common.LegendPlacement.RIGHT)
            .calcs(["lastNotNull", "max"])
        )
        .tooltip(
            common_b.VizTooltipOptions()
            .mode(common.TooltipDisplayMode.MULTI)
            .sort(common.SortOrder.DESCENDING)
        )
        .height(8)
        .span(width)
    )
    if bars:
        panel = panel.draw_style(common.GraphDrawStyle.BARS).fill_opacity(80)
    for index, (expr, legend) in enumerate(targets):
        panel = panel.with_target(query(expr, legend, chr(ord("A") + index)))
    return panel


def stat(
    title: str, description: str, targets: list[tuple[str, str]], width: int = 6
) -> stat_b.Panel:
    panel = (
        stat_b.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]))
        .graph_mode(common.BigValueGraphMode.AREA)
        .color_mode(common.BigValueColorMode.VALUE)
        .color_scheme(dash_b.FieldColor().mode(dash_m.FieldColorModeId.FIXED).fixed_color(BLUE))
        .height(8)
        .span(width)
    )
    for index, (expr, legend) in enumerate(targets):
        panel = panel.with_target(query(expr, legend, chr(ord("A") + index)))
    return panel


def variables() -> list[dash_b.DatasourceVariable | dash_b.QueryVariable]:
    datasource = (
        dash_b.DatasourceVariable("datasource")
        .label("Data source")
        .type("prometheus")
        .current(dash_m.VariableOption(text="default", value="default", selected=True))
    )
    namespace = (
        dash_b.QueryVariable("namespace")
        .label("Namespace")
        .datasource(DATASOURCE)
        .query("label_values(health_sidecar_build_info, namespace)")
        .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dash_m.VariableSort.ALPHABETICAL_ASC)
    )
    pod = (
        dash_b.QueryVariable("pod")
        .label("Pod")
        .datasource(DATASOURCE)
        .query('label_values(health_sidecar_build_info{namespace="$namespace"}, pod)')
        .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dash_m.VariableSort.NATURAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(dash_m.VariableOption(text="All", value="$__all", selected=True))
    )
    return [datasource, namespace, pod]


def build() -> dash_m.Dashboard:
    ready_words = (("not ready", RED), ("ready", GREEN))
    builder = (
        dash_b.Dashboard(TITLE)
        .uid(UID)
        .description(
            "Verdicts, canaries and engine progress of every worker's health sidecar "
            "(generated by deploy/monitoring/dashboard.py)."
        )
        .tags(["health-sidecar", "llm-inference"])
        .editable()
        .tooltip(dash_m.DashboardCursorSync.CROSSHAIR)
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .variables(variables())
        # --- worker verdicts ----------------------------------------------------------------
        .with_row(dash_b.Row("Worker verdicts"))
        .with_panel(
            flag_timeline(
                "Worker ready per pod",
                "health_sidecar_ready: /health answers 200 (the pod is in rotation).",
                f"max by (pod) (health_sidecar_ready{{{SEL}}})",
                "{{pod}}",
                *ready_words,
            )
        )
        .with_panel(
            flag_timeline(
                "Worker live per pod",
                "health_sidecar_live: /live answers 200 (a failing /live restarts the engine).",
                f"max by (pod) (health_sidecar_live{{{SEL}}})",
                "{{pod}}",
                ("not live", RED),
                ("live", GREEN),
            )
        )
        .with_panel(
            flag_timeline(
                "Endpoint ready",
                "health_sidecar_endpoint_ready: each endpoint's verdict.",
                f"max by (pod, endpoint) (health_sidecar_endpoint_ready{{{SEL}}})",
                "{{pod}} {{endpoint}}",
                *ready_words,
                width=12,
            )
        )
        .with_panel(
            flag_timeline(
                "Draining",
                "health_sidecar_draining: 1 after SIGTERM while the worker drains "
                "(not-ready is expected then).",
                f"max by (pod) (health_sidecar_draining{{{SEL}}})",
                "{{pod}}",
                ("serving", GREEN),
                ("draining", BLUE),
                width=6,
            )
        )
        .with_panel(
            stat(
                "Pods ready",
                "Pods whose worker is ready, of the pods selected.",
                [
                    (f"sum(health_sidecar_ready{{{SEL}}})", "ready"),
                    (f"count(health_sidecar_ready{{{SEL}}})", "pods"),
                ],
            )
        )
        # --- canaries -----------------------------------------------------------------------
        .with_row(dash_b.Row("Canaries"))
        .with_panel(
            timeseries(
                "Canary outcomes",
                "health_sidecar_canary_total: canaries per second by outcome "
                "(success, timeout, error, refused, invalid).",
                [
                    (
                        f"sum by (outcome) (rate(health_sidecar_canary_total{{{SEL}}}[{RATE}]))",
                        "{{outcome}}",
                    )
                ],
                "ops",
            )
        )
        .with_panel(
            timeseries(
                "Failed canaries per pod",
                "Canaries that did not succeed, per pod, endpoint and outcome.",
                [
                    (
                        "sum by (pod, endpoint, outcome) (rate(health_sidecar_canary_total"
                        f'{{{SEL}, outcome!="success"}}[{RATE}]))',
                        "{{pod}} {{endpoint}} {{outcome}}",
                    )
                ],
                "ops",
            )
        )
        .with_panel(
            timeseries(
                "Canary latency p50 / p95",
                "From health_sidecar_canary_duration_seconds: time from sending a canary to "
                "its complete answer (or to the timeout).",
                [
                    (
                        "histogram_quantile(0.5, sum by (pod, le) (rate("
                        f"health_sidecar_canary_duration_seconds_bucket{{{SEL}}}[{RATE}])))",
                        "p50 {{pod}}",
                    ),
                    (
                        "histogram_quantile(0.95, sum by (pod, le) (rate("
                        f"health_sidecar_canary_duration_seconds_bucket{{{SEL}}}[{RATE}])))",
                        "p95 {{pod}}",
                    ),
                    (
                        "sum(rate(health_sidecar_canary_duration_seconds_sum"
                        f"{{{SEL}}}[{RATE}])) / sum(rate("
                        f"health_sidecar_canary_duration_seconds_count{{{SEL}}}[{RATE}]))",
                        "mean, all pods",
                    ),
                ],
                "s",
            )
        )
        .with_panel(
            timeseries(
                "Canaries failed in a row",
                "health_sidecar_canary_consecutive_failures per endpoint.",
                [
                    (
                        f"max by (pod, endpoint) "
                        f"(health_sidecar_canary_consecutive_failures{{{SEL}}})",
                        "{{pod}} {{endpoint}}",
                    )
                ],
                "short",
            )
        )
        # --- engine progress ----------------------------------------------------------------
        .with_row(dash_b.Row("Engine"))
        .with_panel(
            timeseries(
                "Engine in-flight requests",
                "health_sidecar_engine_in_flight_requests: running or waiting, from the "
                "engine's own metrics.",
                [
                    (
                        "sum by (pod, endpoint) "
                        f"(health_sidecar_engine_in_flight_requests{{{SEL}}})",
                        "{{pod}} {{endpoint}}",
                    )
                ],
                "short",
                width=8,
            )
        )
        .with_panel(
            timeseries(
                "Seconds since engine progress",
                "time() - health_sidecar_last_progress_timestamp_seconds: how long ago the "
                "engine's progress counters last advanced (grows while idle, too).",
                [
                    (
                        f"time() - max by (pod, endpoint) "
                        f"(health_sidecar_last_progress_timestamp_seconds{{{SEL}}})",
                        "{{pod}} {{endpoint}}",
                    )
                ],
                "s",
                width=8,
            )
        )
        .with_panel(
            flag_timeline(
                "Engine stalled",
                "health_sidecar_engine_stalled: work in flight, counters stopped, and the "
                "confirming canary timed out.",
                f"max by (pod, endpoint) (health_sidecar_engine_stalled{{{SEL}}})",
                "{{pod}} {{endpoint}}",
                ("progressing", GREEN),
                ("stalled", RED),
                width=8,
            )
        )
        # --- liveness -----------------------------------------------------------------------
        .with_row(dash_b.Row("Liveness"))
        .with_panel(
            timeseries(
                "Liveness clock / window",
                "health_sidecar_liveness_clock_seconds over health_sidecar_liveness_window_"
                "seconds: /live fails at 100%; HealthSidecarLivenessAboutToFail fires at 75%.",
                [
                    (
                        "max by (namespace, pod, endpoint, cause) "
                        f"(health_sidecar_liveness_clock_seconds{{{SEL}}})\n"
                        "/ on (namespace, pod) group_left\n"
                        f"max by (namespace, pod) (health_sidecar_liveness_window_seconds"
                        f"{{{SEL}}})",
                        "{{pod}} {{endpoint}} {{cause}}",
                    )
                ],
                "percentunit",
            )
            .min(0)
            .max(1)
            .thresholds(thresholds((None, GREEN), (0.75, ORANGE), (1, RED)))
            .thresholds_style(
                common_b.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.DASHED)
            )
        )
        .with_panel(
            timeseries(
                "Liveness clocks (seconds)",
                "Each running liveness clock by cause, and the window it may reach.",
                [
                    (
                        "max by (pod, endpoint, cause) "
                        f"(health_sidecar_liveness_clock_seconds{{{SEL}}})",
                        "{{pod}} {{endpoint}} {{cause}}",
                    ),
                    (
                        f"max(health_sidecar_liveness_window_seconds{{{SEL}}})",
                        "window",
                    ),
                ],
                "s",
            )
        )
        # --- disagreements and transitions --------------------------------------------------
        .with_row(dash_b.Row("Disagreements and transitions"))
        .with_panel(
            flag_timeline(
                "Engine health disagrees",
                "health_sidecar_engine_health_disagrees: the engine's own health route answers "
                "200 while the sidecar finds it hung.",
                f"max by (pod, endpoint) (health_sidecar_engine_health_disagrees{{{SEL}}})",
                "{{pod}} {{endpoint}}",
                ("agrees", GREEN),
                ("disagrees", RED),
                width=8,
            )
        )
        .with_panel(
            timeseries(
                "Disagreements",
                "Increase of health_sidecar_engine_health_disagreements_total.",
                [
                    (
                        "sum by (pod, endpoint) (increase("
                        f"health_sidecar_engine_health_disagreements_total{{{SEL}}}[{RATE}]))",
                        "{{pod}} {{endpoint}}",
                    )
                ],
                "short",
                width=8,
                bars=True,
            )
        )
        .with_panel(
            timeseries(
                "Verdict transitions",
                "Increase of health_sidecar_endpoint_transitions_total by the verdict an "
                "endpoint changed to.",
                [
                    (
                        "sum by (pod, endpoint, to) (increase("
                        f"health_sidecar_endpoint_transitions_total{{{SEL}}}[{RATE}]))",
                        "{{pod}} {{endpoint}} to {{to}}",
                    )
                ],
                "short",
                width=8,
                bars=True,
            )
        )
        # --- ranks, pauses and peers -------------------------------------------------------
        .with_row(dash_b.Row("Ranks, pauses and KV transfers"))
        .with_panel(
            flag_timeline(
                "Data-parallel rank ready",
                "health_sidecar_rank_ready: each rank's own canary (SIDECAR_DP_RANKS).",
                f"max by (pod, endpoint, rank) (health_sidecar_rank_ready{{{SEL}}})",
                "{{pod}} rank {{rank}}",
                *ready_words,
                width=8,
            )
        )
        .with_panel(
            flag_timeline(
                "Degraded or paused",
                "health_sidecar_endpoint_degraded (ready with a rank down) and "
                "health_sidecar_endpoint_paused (asleep, or in a maintenance window).",
                f"max by (pod) (health_sidecar_endpoint_degraded{{{SEL}}}) or max by (pod, state) "
                f"(health_sidecar_endpoint_paused{{{SEL}}})",
                "{{pod}} {{state}}",
                ("no", GREEN),
                ("yes", BLUE),
                width=8,
            )
        )
        .with_panel(
            timeseries(
                "Failed KV transfers from prefill peers",
                "Increase of health_sidecar_kv_transfer_failures_total by kind: the peer side's "
                "trouble, seen by the decode worker.",
                [
                    (
                        "sum by (pod, kind) (increase("
                        f"health_sidecar_kv_transfer_failures_total{{{SEL}}}[{RATE}]))",
                        "{{pod}} {{kind}}",
                    )
                ],
                "short",
                width=8,
                bars=True,
            )
        )
        # --- build --------------------------------------------------------------------------
        .with_row(dash_b.Row("Sidecars"))
        .with_panel(
            stat(
                "Sidecars by version",
                "health_sidecar_build_info: sidecars per version, backend and mode.",
                [
                    (
                        f"count by (version, backend, mode) (health_sidecar_build_info{{{SEL}}})",
                        "{{version}} {{backend}} {{mode}}",
                    )
                ],
                width=24,
            )
        )
    )
    dashboard = builder.build()
    # Stable panel ids in layout order (Grafana would otherwise assign them on each import).
    for number, panel in enumerate(dashboard.panels or [], start=1):
        panel.id_val = number
    return dashboard


def render_json() -> str:
    return json.dumps(build(), cls=JSONEncoder, sort_keys=True, indent=2) + "\n"


CONFIGMAP_HEADER = """\
# GENERATED by deploy/monitoring/dashboard.py (with dashboard.json): edit dashboard.py, then run
#   python deploy/monitoring/dashboard.py
# The health-sidecar Grafana dashboard for Grafana's dashboard sidecar, which loads ConfigMaps
# labelled grafana_dashboard: "1" (kube-prometheus-stack, the Dynamo platform), for example:
#   kubectl apply -f deploy/monitoring/dashboard-configmap.yaml
apiVersion: v1
kind: ConfigMap
metadata:
  name: health-sidecar-dashboard
  namespace: monitoring
  labels:
    grafana_dashboard: "1"
    app.kubernetes.io/name: health-sidecar
    app.kubernetes.io/part-of: health-sidecar
data:
"""


def render_configmap(dashboard_json: str) -> str:
    body = "".join(f"    {line}\n" for line in dashboard_json.splitlines())
    return f"{CONFIGMAP_HEADER}  {CONFIGMAP_KEY}: |\n{body}"


def main() -> int:
    text = render_json()
    JSON_PATH.write_text(text, encoding="utf-8")
    CONFIGMAP_PATH.write_text(render_configmap(text), encoding="utf-8")
    print(f"wrote {JSON_PATH.name} and {CONFIGMAP_PATH.name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
